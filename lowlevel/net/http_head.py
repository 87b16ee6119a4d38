"""The egress proxy's request head: a bounded HTTP/1.x request-head parser and its refusals. Pure: no sockets.

Concept: the bytes a program sent through the proxy up to the blank line (at most
:data:`MAX_HEAD_BYTES`, read by :mod:`lowlevel.net.proxy`) become a :class:`Request`: a
``CONNECT host:port`` (a tunnel), or a plain-HTTP request in absolute form
(``GET http://host[:port]/path``) or origin form with ``Host:``, rewritten for the origin
(origin form, ``Host`` from the URL, ``Proxy-*`` and hop-by-hop headers dropped,
``Connection: close``) with the length of its body. Anything else raises
:class:`RefusedError`, which the proxy answers with :func:`refusal` (status and reason in
the status line and the body).

The refusals are security rules, each probed in tests/unit/test_egress_rules.py: a bare CR
or LF, NUL or another control but HTAB anywhere in the head (RFC 9112 section 2.2: an origin
that takes a bare LF as a line end would read a second request smuggled in a header value,
past the proxy's check), a folded header line (obs-fold, section 5.2), a blank line inside
the head, a ``Transfer-Encoding`` (``411``: a chunked body's end cannot be found without
decoding it) and ``Content-Length`` values that disagree or are not digits (the smuggling
forms of section 6.3 and 11.2), so the proxy forwards exactly one request per connection.

Why not h11 (evaluated, h11 0.16, installed here only as a dependency of the test extra's
uvicorn): h11 accepts bare-LF line ends, unfolds obs-fold lines, takes ``Transfer-Encoding:
chunked`` and lower-case methods, and refuses the Host-less HTTP/1.1 absolute-form and
CONNECT heads proxies get; the rules above would stay ours around it, and the authority
split and the origin-form rewrite are a proxy's job h11 does not do. It would replace the
~20 lines that split the head into lines and headers at the price of a core dependency.

Sources: RFC 9110 (CONNECT 9.3.6, absolute-form 7.1, 400/403/411/502/503/504), RFC 9112
sections 2.2, 5.2, 6.3, 9.6 (``Connection: close``) and 11.2; RFC 7230 section 6.1 (hop-by-hop
headers).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

#: Largest request head the proxy reads (request line and headers), bytes.
MAX_HEAD_BYTES = 64 * 1024

#: Headers a proxy does not pass on (RFC 7230 6.1 hop-by-hop, and the proxy's own).
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authorization",
                         "proxy-authenticate", "te", "trailer", "upgrade", "host"})


class RefusedError(Exception):
    """A request the proxy answers itself (with :func:`refusal`).

    Attributes:
        status: the HTTP status (int, a key of the status table: 400, 403, 408, 411, 431,
            502, 503, 504).
        reason: the one-line reason shown to the program and recorded in its attempt (str).
    """

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


_STATUS = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 411: "Length Required",
           431: "Request Header Fields Too Large",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


def refusal(status: int, reason: str) -> bytes:
    """An HTTP/1.1 error response (bytes) with the reason in the status line and the body;
    non-printable characters of ``reason`` become ``?``, the status line keeps 200 of them."""
    safe = "".join(c if 32 <= ord(c) < 127 else "?" for c in reason)
    phrase = f"{_STATUS[status]} (lowlevel egress: {safe[:200]})"
    body = f"lowlevel egress proxy: {_STATUS[status].lower()}: {safe}\n".encode()
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nX-Lowlevel-Egress: refused\r\n\r\n").encode() + body


class Request:
    """A parsed request head.

    Attributes:
        method: ``"CONNECT"`` or the plain-HTTP method (upper case).
        host: the host asked for, lower case, without brackets (a name or an IP literal).
        port: the TCP port (80 when a plain-HTTP request names none).
        head_out: plain HTTP: the head to send upstream first (bytes); None for CONNECT.
        body_len: plain HTTP: the body's length from ``Content-Length`` (bytes, 0 without one).
    """

    def __init__(self, method: str, host: str, port: int, head_out: bytes | None, body_len: int = 0) -> None:
        self.method = method
        self.host = host
        self.port = port
        self.head_out = head_out
        self.body_len = body_len


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (port optional when ``default_port``) -> (host, port)."""
    text = authority.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise RefusedError(400, f"bad authority {authority!r}")
        host, rest = text[1:end], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise RefusedError(400, f"bad authority {authority!r}")
        port_text = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise RefusedError(400, f"bad authority {authority!r}: write an IPv6 address in brackets")
    else:
        host, port_text = text, ""
    if not port_text:
        if default_port is None:
            raise RefusedError(400, f"CONNECT {authority!r} has no port")
        return host, default_port
    # isascii: str.isdigit() is also true for '²' or '¹', which int() refuses (a ValueError, no 400).
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise RefusedError(400, f"bad port in {authority!r}")
    return host, int(port_text)


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
#: Bytes never allowed in a request head line once it is split on CRLF: a bare CR or LF, NUL and
#: the other controls but HTAB (RFC 9112 section 2.2: a recipient of a bare CR must reject or
#: replace it, and section 5.5 field values). An origin that takes a bare LF as a line end would
#: otherwise read a second request smuggled inside a header value, past the proxy's checks.
_HEAD_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


_TCHARS = rb"!#$%&'*+.^_`|~0-9A-Za-z-"
#: Whitespace a lenient server splits a request line on (RFC 9112 section 3: SP, HTAB, VT, FF, bare CR).
_WS = rb"[ \t\x0b\x0c\r]"
#: An HTTP request line as the most lenient server reads one (no LF in it): a method token,
#: whitespace, a target, and an ``HTTP/`` version after whitespace later on (the HTTP/2
#: preface's ``PRI * HTTP/2.0`` included); or an HTTP/0.9 ``GET /path``.
_LINE_CHAR = rb"[^\x00-\x08\x0a\x0e-\x1f\x7f]"  # no other control: a NUL is no HTTP (git's pkt-lines)
_REQUEST_LINE = re.compile(rb"[%s]+%s+[^ \t\x0b\x0c\r]%s*%s[Hh][Tt][Tt][Pp]/[0-9]%s*|GET%s+/%s*" % (
    _TCHARS, _WS, _LINE_CHAR, _WS, _LINE_CHAR, _WS, _LINE_CHAR))
#: What can still grow into one before its line ends.
_REQUEST_PREFIX = re.compile(rb"[%s]*|[%s]+%s%s*" % (_TCHARS, _TCHARS, _WS, _LINE_CHAR))


def starts_http_request(data: bytes) -> bool | None:
    """Whether the first bytes of a tunnel are an HTTP request: True (a request line, after the
    empty lines RFC 9112 section 2.2 lets a server skip), False (they cannot become one), None
    (a request line's start so far: more bytes decide).

    Why: a CONNECT tunnel to a port outside ``Egress.tls_ports`` (80 by default) passes its bytes
    unchecked, so a plain-HTTP request inside it reached any site served at an allowed name's
    address by naming it in ``Host`` (virtual-host fronting: a fresh-user trial). Plain HTTP goes
    through the proxy as a request of its own, whose ``Host`` the proxy sets. Other protocols
    are told apart by their first line: SSH's banner, SMTP's ``EHLO x``, Redis' ``*1``, git's
    pkt-lines have no ``SP target SP HTTP/d.d`` line; a binary protocol's first byte is no token.
    """
    start = len(data) - len(data.lstrip(b"\r\n"))
    end = data.find(b"\n", start)
    if end < 0:
        return None if _REQUEST_PREFIX.fullmatch(data, start) else False
    return _REQUEST_LINE.fullmatch(data, start, end) is not None


def parse_request(head: bytes) -> Request:
    """Parse a request head (up to and including the blank line) into what the proxy needs.

    Args:
        head: the raw head, bytes (latin-1: every byte maps to one character).
    Returns:
        A :class:`Request`: for ``CONNECT`` the authority and ``head_out=None``; for plain
        HTTP the origin-form head to send on and the body's length.
    Raises:
        RefusedError: 400 for anything that is not a CONNECT or a plain-HTTP/1.x request (and
            the refusals of the module docstring), 411 for a ``Transfer-Encoding``.
    """
    lines = _head_lines(head)
    if "\t" in lines[0]:  # urlsplit drops a TAB the origin would get: the target checked would not be the one sent
        raise RefusedError(400, "a TAB in the request line (RFC 9112 section 3: single spaces between its parts)")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise RefusedError(400, f"not an HTTP/1.x request line: {lines[0][:80]!r}")
    method, target, version = parts
    if not method.isalpha() or not method.isupper():
        raise RefusedError(400, f"bad method {method[:20]!r}")
    headers = _header_fields(lines[1:])
    if method == "CONNECT":
        host, port = _split_authority(target, None)
        return Request(method, host.lower(), port, None)
    host, port, path = _plain_target(target, headers)
    host = host.lower()
    body_len = _body_length(headers)
    shown = f"[{host}]" if ":" in host else host
    authority = shown if port == 80 else f"{shown}:{port}"
    out = [f"{method} {path} {version}", f"Host: {authority}"]
    out += [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_BY_HOP]
    out.append("Connection: close")
    return Request(method, host, port, ("\r\n".join(out) + "\r\n\r\n").encode("latin-1"), body_len)


def _head_lines(head: bytes) -> list[str]:
    """The head's lines, split on CRLF only, the final blank line dropped; refuses controls
    (a bare CR or LF among them), a blank line inside and folded lines."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise RefusedError(400, "undecodable request head") from None
    lines = text.split("\r\n")
    while lines and not lines[-1]:
        lines.pop()  # the blank line that ends the head
    for line in lines:
        bad = _HEAD_CONTROL.search(line)
        if bad:
            raise RefusedError(400, f"a control character ({bad.group()!r}: a bare CR or LF, NUL...) in the request "
                               "head (RFC 9112 section 2.2); end every line with CRLF")
        if not line:
            raise RefusedError(400, "a blank line inside the request head")
        if line[0] in " \t":
            raise RefusedError(400, "a folded header line (obs-fold, RFC 9112 section 5.2): send each header "
                               "on one line")
    if not lines:
        raise RefusedError(400, "an empty request head")
    return lines


def _header_fields(lines: list[str]) -> list[tuple[str, str]]:
    """``name: value`` lines -> [(name as sent, value stripped)]; a name must be a token."""
    headers: list[tuple[str, str]] = []
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.match(name):
            raise RefusedError(400, f"bad header line {line[:80]!r}")
        headers.append((name, value.strip()))
    return headers


def _plain_target(target: str, headers: list[tuple[str, str]]) -> tuple[str, int, str]:
    """(host, port, origin-form path) of a plain-HTTP request: from its one ``Host`` header
    (origin form) or its ``http://`` URL (absolute form, userinfo dropped)."""
    if target.startswith("/"):
        hosts = [v for k, v in headers if k.lower() == "host"]
        if len(hosts) != 1:
            raise RefusedError(400, "an origin-form request needs exactly one Host header")
        host, port = _split_authority(hosts[0], 80)
        return host, port, target
    url = urlsplit(target)
    if url.scheme.lower() != "http":
        raise RefusedError(400, f"only http:// URLs are forwarded (use CONNECT for {url.scheme or 'this'}; "
                           "HTTPS_PROXY does that)")
    netloc = url.netloc.rpartition("@")[2]
    host, port = _split_authority(netloc, 80)
    path = target[len(url.scheme) + 3 + len(url.netloc):] or "/"
    if not path.startswith("/"):
        path = "/" + path
    return host, port, path


def _body_length(headers: list[tuple[str, str]]) -> int:
    """The length of a plain-HTTP request's body, so that the proxy forwards that request and
    nothing after it (RFC 9112 section 6.3: no Content-Length and no Transfer-Encoding means
    no body).

    Raises:
        RefusedError: 411 for a Transfer-Encoding (chunked bodies are not forwarded over
            plain HTTP: their end cannot be found without decoding them; HTTPS tunnels carry
            them), 400 for Content-Length values that disagree or are not digits (the
            request-smuggling forms of RFC 9112 section 6.3 and 11.2).
    """
    if any(k.lower() == "transfer-encoding" for k, _ in headers):
        raise RefusedError(411, "plain-HTTP request bodies need a Content-Length (no Transfer-Encoding): "
                            "send the body with its length, or use HTTPS")
    values = {v.strip() for k, value in headers if k.lower() == "content-length" for v in value.split(",")}
    if not values:
        return 0
    value = next(iter(values))
    if len(values) != 1 or not (value.isascii() and value.isdigit()):
        raise RefusedError(400, f"bad Content-Length {sorted(values)!r}")
    return int(value)


__all__ = ["MAX_HEAD_BYTES", "RefusedError", "Request", "parse_request", "refusal", "starts_http_request"]
