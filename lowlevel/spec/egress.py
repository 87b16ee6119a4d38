"""Network egress by allowlist: the policy (:class:`Egress`) and its decisions. Pure: no I/O.

``Policy(network=Egress(allow=("pypi.org", "*.npmjs.org")))`` keeps the sandbox in its own
network namespace (loopback only) and gives it one way out: an HTTP proxy that runs on the
host (:mod:`lowlevel.net.proxy`), reached from inside through a unix socket bound into the
sandbox and a small relay listening on ``127.0.0.1:3128`` inside
(``native/lowlevel_relay.c``). ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``
(and the lower-case forms) point there, so pip, npm, curl, git and requests work unchanged.
Nothing else leaves the sandbox: no DNS (there is no resolver inside and nothing to send a
query through), no UDP, no raw TCP to anything but the proxy.

This module decides; the proxy only asks. For each request the proxy calls
:meth:`Egress.decide` with the name and port the program asked for (the CONNECT authority or
the absolute URL of a plain-HTTP request), then resolves the name once, calls
:meth:`Egress.check_addresses` with the answers, and connects only to those checked
addresses: a resolver that answers differently the second time (DNS rebinding) gets no
second question.

Glossary:
    pattern: an entry of ``allow`` or ``deny``: an exact host name (``pypi.org`` matches
        ``pypi.org`` only), a suffix pattern (``*.npmjs.org`` matches ``registry.npmjs.org``
        and ``a.b.npmjs.org``, not ``npmjs.org`` itself: list both when you want both), or
        ``*`` (any name; the address rules below still apply). Case-insensitive; non-ASCII
        names are IDNA-encoded (Python's ``idna`` codec, IDNA 2003 with nameprep) on both
        sides, so ``bücher.example`` and ``xn--bcher-kva.example`` are the same name.
    deny: patterns refused even when ``allow`` matches (deny wins).
    non-public address: every address in :data:`NON_GLOBAL_V4` or :data:`NON_GLOBAL_V6`,
        a table of the IANA special-purpose registries kept here (not the interpreter's
        :mod:`ipaddress`, whose ranges changed with CVE-2024-4032): loopback, private,
        link-local (169.254.169.254, the cloud metadata service, among them), multicast,
        unspecified, shared 100.64/10, documentation, benchmarking, reserved, site-local
        ``fec0::/10``, IPv4-compatible ``::/96``, IPv4-translated ``::ffff:0:0:0/96``, Teredo,
        local-use NAT64, and every IPv6 address outside global unicast ``2000::/3``. IPv4
        addresses embedded in IPv6 ones (``::ffff:127.0.0.1``, 6to4 ``2002::/16``, NAT64
        ``64:ff9b::/96``) are judged as the IPv4 address they carry.
    host address: an address assigned to an interface of the proxy's host, other than the
        loopback ranges (which the table refuses anyway). A server listening on ``0.0.0.0``
        there (the Ray dashboard on 8265, CVE-2023-48022 "ShadowRay"; anything on 80/443)
        answers on each of them, public ones included, so they are refused like non-public
        addresses. The proxy reads them from the kernel when it decides
        (:func:`lowlevel.net.host_addresses.host_addresses`).
    IP literal: a request naming an address instead of a name (``CONNECT 10.0.0.5:443``,
        ``http://[::1]/``), in any form ``inet_aton(3)`` accepts (``2130706433``,
        ``0x7f.1``: the same 127.0.0.1 to ``getaddrinfo``).

Rules, in order (the first that refuses wins; each refusal's reason names the rule):
    1. the port is in ``allow_ports`` (default 80 and 443); a plain-HTTP request (not CONNECT)
       to a port of ``tls_ports`` (default 443) is refused: there a tunnel must carry TLS;
    2. an IP literal is refused unless an ``allow_cidrs`` network contains it;
    3. a name is refused when a ``deny`` pattern matches, then unless an ``allow`` pattern does;
    4. every address the name resolves to must be public and not a host address, or inside an
       ``allow_cidrs`` network; one such answer refuses the request (a name with a private
       answer among public ones is what a rebinding attack looks like).

Sources: RFC 9110 section 9.3.6 (CONNECT) and 7.1 (absolute-form targets); RFC 6890 and the
IANA IPv4 and IPv6 special-purpose address registries (iana-ipv4-special-registry,
iana-ipv6-special-registry; the tables :data:`NON_GLOBAL_V4`, :data:`NON_GLOBAL_V6` cite each
entry's RFC); CVE-2024-4032 (Python's ``ipaddress`` ranges); CVE-2023-48022 (ShadowRay);
RFC 3490 (IDNA 2003); the Capital One 2019 breach and AWS IMDSv2 notes for 169.254.169.254;
DNS rebinding: Jackson et al., "Protecting Browsers from DNS Rebinding Attacks" (CCS 2007).
"""

from __future__ import annotations

import functools
import re
import socket
from collections.abc import Collection, Iterable, Mapping, Sequence

from dataclasses import field

from lowlevel._dataclass import dataclass
from lowlevel.errors import PolicyError

TYPE_CHECKING = False
if TYPE_CHECKING:  # imported where used: ~1 ms that a run without egress (nearly all) never pays
    import ipaddress

#: TCP port the relay listens on inside the sandbox (127.0.0.1 only), squid's customary port.
PROXY_PORT = 3128
#: URL of the proxy as programs inside see it.
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
#: Where the proxy's unix socket is bound inside the sandbox.
SOCKET_DEST = "/run/lowlevel/egress.sock"
#: Ports allowed when ``Egress.allow_ports`` is not given: HTTP and HTTPS.
DEFAULT_PORTS = (80, 443)
#: Ports whose tunnels must be TLS from the first byte when ``Egress.tls_ports`` is not given: HTTPS.
DEFAULT_TLS_PORTS = (443,)
#: ``dataclasses.field`` metadata: a record's canonical policy leaves the field out while it has
#: its default (:func:`lowlevel.record.canonical.canonical_value`), so a field added later does
#: not change the policy_sha256 of records written before it (or of policies that never set it).
RECORD_OMIT_DEFAULT = {"record": "omit_default"}
#: Where the CA bundle is inside (Debian's ``ca-certificates`` bundle, OpenSSL's default
#: CAfile there); with ``extra_ca_pem`` it is replaced by the system bundle plus those CAs.
CA_BUNDLE_DEST = "/etc/ssl/certs/ca-certificates.crt"
#: Hosts programs reach directly (the sandbox's own loopback), never through the proxy.
NO_PROXY = "localhost,127.0.0.1,::1"
#: /etc entries bound read-only in egress mode: TLS trust only (no resolv.conf, no hosts).
#: ``/etc/ssl/certs`` holds the CA bundle and the hashed certificate links OpenSSL reads (their
#: targets are under ``/usr/share/ca-certificates``), ``/etc/ssl/openssl.cnf`` its configuration;
#: never ``/etc/ssl/private``, the host's keys (a fresh-user trial: a caller in group ``ssl-cert``
#: could read them by name inside). ``/etc/ca-certificates`` is only update-ca-certificates(8)'s
#: configuration, so it is left out.
EGRESS_ETC = ("/etc/ssl/certs", "/etc/ssl/openssl.cnf")

# Compiled on first use (re's cache), not at import: a run without egress never needs them.
_LABEL = r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$"
_INET_ATON_CHARS = r"^[0-9a-fx.]+$"


def normalize_host(name: str) -> str:
    """The canonical form of a host name: lower case, no trailing dot, IDNA (ASCII) labels.

    Args:
        name: a host name as a program or a policy wrote it (``"PyPI.org."``, ``"bücher.de"``).
    Returns:
        ``str``, e.g. ``"pypi.org"``, ``"xn--bcher-kva.de"``.
    Raises:
        ValueError: empty, longer than 253 characters, an empty label, a label over 63
            characters, or characters outside letters, digits, ``-`` and ``_`` once encoded.

    Source: RFC 1035 section 2.3.4 (sizes); RFC 3490 (IDNA, Python's ``idna`` codec).
    """
    if not isinstance(name, str):
        raise ValueError(f"host name must be a str, got {type(name).__name__}")
    host = name.strip()
    if host.endswith(".") and not host.endswith(".."):
        host = host[:-1]
    if not host:
        raise ValueError("empty host name")
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError as err:
            raise ValueError(f"host name {name!r} is not a valid internationalized name: {err}") from None
    host = host.lower()
    if len(host) > 253:
        raise ValueError(f"host name {name[:40]!r}... is longer than 253 characters")
    for label in host.split("."):
        if not re.match(_LABEL, label):
            raise ValueError(f"host name {name!r} has an invalid label {label!r} (letters, digits, '-', '_'; "
                             "1 to 63 characters)")
    return host


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` names when it is an IP literal, else None.

    Accepts the bracketless IPv6 form (``::1``, zone ids refused as not literals) and every
    IPv4 form ``inet_aton(3)`` takes (``127.1``, ``2130706433``, ``0x7f.0.0.1``), because
    ``getaddrinfo`` would turn those into addresses too.
    """
    import ipaddress
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if re.match(_INET_ATON_CHARS, host.lower()):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


#: Non-global IPv4 ranges, most specific first within an overlap: (network, category, label).
#: From the IANA IPv4 Special-Purpose Address Registry (RFC 6890 and its updates: RFC 8190,
#: RFC 6598, RFC 7335, RFC 7526, RFC 8155, RFC 8880), plus multicast 224.0.0.0/4 (RFC 5771)
#: and limited broadcast. Every entry whose "Globally Reachable" is False or N/A is here; the
#: registry's few globally reachable anycast entries inside 192.0.0.0/24 (192.0.0.9 PCP,
#: 192.0.0.10 TURN) are refused with their /24: a sandbox has no business with them.
#: Categories: ``unspecified``, ``loopback``, ``link-local``, ``multicast`` (shown alone),
#: ``private`` (not globally reachable, as :attr:`ipaddress.IPv4Address.is_private` means it
#: since Python 3.12.4) and ``non-global`` (shared address space and the reserved 240/4, which
#: the stdlib treats apart).
#: Ours, not the interpreter's: Python 3.11.2's :mod:`ipaddress` predates the CVE-2024-4032
#: range fixes (gh-113171), so its ``is_global`` says True for ``192.0.0.0/24`` members and
#: more; this table is what decides.
NON_GLOBAL_V4: tuple[tuple[str, str, str], ...] = (
    ("0.0.0.0/32", "unspecified", ""),
    ("0.0.0.0/8", "private", "'this network' 0.0.0.0/8, RFC 791"),
    ("10.0.0.0/8", "private", "private-use 10/8, RFC 1918"),
    ("100.64.0.0/10", "non-global", "shared address space 100.64.0.0/10, RFC 6598"),
    ("127.0.0.0/8", "loopback", ""),
    ("169.254.0.0/16", "link-local", ""),
    ("172.16.0.0/12", "private", "private-use 172.16/12, RFC 1918"),
    ("192.0.0.0/24", "private", "IETF protocol assignments 192.0.0.0/24, RFC 6890"),
    ("192.0.2.0/24", "private", "documentation TEST-NET-1 192.0.2.0/24, RFC 5737"),
    ("192.88.99.0/24", "private", "deprecated 6to4 relay anycast 192.88.99.0/24, RFC 7526"),
    ("192.168.0.0/16", "private", "private-use 192.168/16, RFC 1918"),
    ("198.18.0.0/15", "private", "benchmarking 198.18.0.0/15, RFC 2544"),
    ("198.51.100.0/24", "private", "documentation TEST-NET-2 198.51.100.0/24, RFC 5737"),
    ("203.0.113.0/24", "private", "documentation TEST-NET-3 203.0.113.0/24, RFC 5737"),
    ("224.0.0.0/4", "multicast", ""),
    ("255.255.255.255/32", "private", "limited broadcast, RFC 919"),
    ("240.0.0.0/4", "non-global", "reserved 240.0.0.0/4, RFC 1112"),
)
#: Non-global IPv6 ranges (same shape), from the IANA IPv6 Special-Purpose Address Registry
#: (RFC 6890 and updates: RFC 8215, RFC 9602, RFC 9637, RFC 9780) and the IANA IPv6 Address
#: Space registry: besides these, everything outside global unicast ``2000::/3`` is refused
#: (site-local ``fec0::/10``, RFC 3879, and the unassigned space included). Judged as the IPv4
#: address they carry, before this table (a connect to them reaches that IPv4 address, or a
#: translator does): IPv4-mapped ``::ffff:0:0/96`` (RFC 4291 2.5.5.2), NAT64's well-known
#: prefix ``64:ff9b::/96`` (RFC 6052 section 3.1: it must never carry a non-global IPv4
#: address) and 6to4 ``2002::/16`` (RFC 3056). Refused whole: IPv4-compatible ``::/96``
#: (deprecated, RFC 4291 2.5.5.1), IPv4-translated ``::ffff:0:0:0/96`` (RFC 2765), the
#: local-use NAT64 prefix ``64:ff9b:1::/48`` (RFC 8215: not globally reachable, whatever it
#: embeds), Teredo ``2001::/32`` (RFC 4380) with the rest of ``2001::/23``.
NON_GLOBAL_V6: tuple[tuple[str, str, str], ...] = (
    ("::/128", "unspecified", ""),
    ("::1/128", "loopback", ""),
    ("::/96", "private", "deprecated IPv4-compatible ::/96, RFC 4291 2.5.5.1"),
    ("::ffff:0:0:0/96", "private", "IPv4-translated ::ffff:0:0:0/96, RFC 2765"),
    ("64:ff9b:1::/48", "private", "local-use NAT64 64:ff9b:1::/48, RFC 8215"),
    ("100::/64", "private", "discard-only 100::/64, RFC 6666"),
    ("100:0:0:1::/64", "private", "dummy prefix 100:0:0:1::/64, RFC 9780"),
    ("2001::/32", "private", "Teredo 2001::/32, RFC 4380"),
    ("2001:db8::/32", "private", "documentation 2001:db8::/32, RFC 3849"),
    ("2001::/23", "private", "IETF protocol assignments 2001::/23, RFC 2928"),
    ("3fff::/20", "private", "documentation 3fff::/20, RFC 9637"),
    ("5f00::/16", "private", "SRv6 SIDs 5f00::/16, RFC 9602"),
    ("fc00::/7", "private", "unique local fc00::/7, RFC 4193"),
    ("fe80::/10", "link-local", ""),
    ("fec0::/10", "private", "deprecated site-local fec0::/10, RFC 3879"),
    ("ff00::/8", "multicast", ""),
)


@functools.lru_cache(maxsize=None)
def _tables() -> dict[int, tuple[tuple[int, int, str, str], ...]]:
    """The two tables as ``{version: ((network int, mask int, category, label), ...)}``."""
    import ipaddress
    out: dict[int, tuple[tuple[int, int, str, str], ...]] = {}
    for version, table in ((4, NON_GLOBAL_V4), (6, NON_GLOBAL_V6)):
        rows = []
        for text, category, label in table:
            net = ipaddress.ip_network(text)
            rows.append((int(net.network_address), int(net.netmask), category, label))
        out[version] = tuple(rows)
    return out


def embedded_ipv4(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address an IPv6 address stands for, and the form's name, or None.

    Forms: IPv4-mapped ``::ffff:a.b.c.d`` (RFC 4291), NAT64 well-known prefix
    ``64:ff9b::a.b.c.d`` (RFC 6052) and 6to4 ``2002:AABB:CCDD::/48`` (RFC 3056).
    """
    import ipaddress
    value = int(ip)
    if value >> 32 == 0xFFFF:
        return ipaddress.IPv4Address(value & 0xFFFFFFFF), "IPv4-mapped"
    if value >> 32 == 0x0064FF9B << 64:
        return ipaddress.IPv4Address(value & 0xFFFFFFFF), "NAT64"
    if value >> 112 == 0x2002:
        return ipaddress.IPv4Address((value >> 80) & 0xFFFFFFFF), "6to4"
    return None


def address_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``ip`` is not a public address (``"loopback"``, ``"private (documentation ...)"``...),
    or None when it is.

    Decided by :data:`NON_GLOBAL_V4` and :data:`NON_GLOBAL_V6` (the IANA special-purpose
    registries, kept here rather than taken from the interpreter's :mod:`ipaddress`, whose
    ranges changed with CVE-2024-4032), and for IPv6 the global unicast space ``2000::/3``.
    IPv4 addresses carried in IPv6 ones (mapped, NAT64 well-known prefix, 6to4: see
    :func:`embedded_ipv4`) are judged as that IPv4 address.

    Returns:
        ``None`` (public) or ``str``: a category (``unspecified``, ``loopback``,
        ``link-local``, ``multicast``, ``private``, ``non-global``), with the registry entry in
        parentheses for the last two (``"private (documentation TEST-NET-1 192.0.2.0/24, RFC 5737)"``)
        and for embedded addresses (``"loopback (127.0.0.1 inside ::ffff:7f00:1)"``).
    """
    if ip.version == 6:
        inner = embedded_ipv4(ip)
        if inner is not None:
            kind = address_kind(inner[0])
            return f"{kind.split(' (')[0]} ({inner[0]} inside {ip})" if kind else None
    value = int(ip)
    for net, mask, category, label in _tables()[ip.version]:
        if value & mask == net:
            if category == "link-local" and str(ip) == "169.254.169.254":
                return "link-local (the cloud metadata service)"
            return f"{category} ({label})" if label else category
    if ip.version == 6 and value >> 125 != 1:
        return "private (outside global unicast 2000::/3, IANA IPv6 address space)"
    return None


def _pattern(text: str, field: str) -> str:
    if not isinstance(text, str):
        raise PolicyError(f"Egress.{field}: patterns are str, got {type(text).__name__}: {text!r}")
    raw = text.strip()
    if raw == "*":
        return "*"
    suffix = raw.startswith("*.")
    body = raw[2:] if suffix else raw
    if "*" in body:
        raise PolicyError(f"Egress.{field}: pattern {text!r} is not supported: use an exact name "
                          "('pypi.org'), a suffix pattern ('*.pythonhosted.org') or '*'")
    if "://" in body or "/" in body or ":" in body and ip_literal(body.strip("[]")) is None:
        raise PolicyError(f"Egress.{field}: {text!r} is not a host name: give the name alone "
                          "(no scheme, port or path), e.g. 'pypi.org'; ports go in allow_ports")
    if ip_literal(body.strip("[]")) is not None:
        raise PolicyError(f"Egress.{field}: {text!r} is an IP address: name addresses in allow_cidrs "
                          f"(e.g. allow_cidrs=('{body.strip('[]')}/32',))")
    try:
        name = normalize_host(body)
    except ValueError as err:
        raise PolicyError(f"Egress.{field}: {err}") from None
    return f"*.{name}" if suffix else name


def match(pattern: str, host: str) -> bool:
    """True when normalized ``host`` matches normalized ``pattern`` (see the glossary)."""
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern


def _covers(outer: str, inner: str) -> bool:
    """True when every name ``inner`` matches is matched by ``outer`` (both normalized)."""
    if outer == "*":
        return True
    if inner == "*":
        return False
    if inner.startswith("*."):
        return outer.startswith("*.") and (inner[2:] == outer[2:] or inner[2:].endswith(outer[1:]))
    return match(outer, inner)


@dataclass(frozen=True)
class Decision:
    """One allow/deny verdict.

    Attributes:
        allowed: True to go on (to resolution, or to connect).
        reason: why, for the record and for the 403 body, e.g. ``"matches 'pypi.org'"`` or
            ``"'evil.example' is not on the allowlist (Egress.allow)"``.
        host: the normalized host name, or the address of an IP literal.
        address: the IP literal's address (str), else None.
    """

    allowed: bool
    reason: str
    host: str
    address: str | None = None


@dataclass(frozen=True)
class NetworkAttempt:
    """One connection attempt through the egress proxy, as :attr:`lowlevel.Result.network` lists it.

    Attributes:
        method: ``"CONNECT"`` (a tunnel: HTTPS and anything else) or the HTTP method of a
            plain-HTTP request (``"GET"``...), or ``"?"`` when the request could not be parsed.
        host: the name (or IP literal) the program asked for, normalized when it could be.
        port: the TCP port asked for (0 when unknown).
        address: the address the proxy connected to (or refused), or None when refused
            before resolution.
        allowed: the decision.
        reason: why: the matching pattern, or the rule that refused (see :mod:`lowlevel.spec.egress`).
        bytes_up: payload bytes from the sandbox to the server (bytes).
        bytes_down: payload bytes from the server to the sandbox (bytes).
        error: what ended an allowed connection early: ``"net_bytes"`` (the run's byte cap
            cut it), a connect failure (``"connect: ..."``), or None.
        resolver: ``"system"``, or ``"test-override"`` when a test replaced the resolver
            (:data:`lowlevel.net.resolve.override`).
    """

    method: str
    host: str
    port: int
    address: str | None
    allowed: bool
    reason: str
    bytes_up: int = 0
    bytes_down: int = 0
    error: str | None = None
    resolver: str = "system"


def _tuple_of_str(value: object, field: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise PolicyError(f"Egress.{field} must be a tuple of str, got {value!r} "
                          f"(write {field}=({value!r},))")
    return tuple(value)


@dataclass(frozen=True)
class Egress:
    """Network egress by allowlist, through a host-side HTTP proxy: ``Policy(network=Egress(...))``.

    The sandbox keeps its own network namespace (loopback only). Programs reach the outside
    only through the proxy at :data:`PROXY_URL` (``HTTP_PROXY``, ``HTTPS_PROXY``,
    ``ALL_PROXY`` and lower-case forms set; ``NO_PROXY`` keeps the sandbox's own loopback
    direct). HTTP CONNECT (HTTPS and other TLS, end to end: the proxy reads only the TLS
    ClientHello's server name, which must be the CONNECT name, :meth:`check_server_name`; on
    ``tls_ports`` the tunnel must start with that ClientHello, :meth:`check_not_tls`) and
    plain-HTTP forwarding (one request per connection); no SOCKS, no UDP, no DNS inside. A refused request gets
    ``403`` with the reason in the status line and the body. See the module docstring for
    the rules and :attr:`lowlevel.Result.network` for the report.

    Attributes:
        allow: host patterns the sandbox may reach (exact ``pypi.org``, suffix
            ``*.pythonhosted.org``, or ``*``); normalized (lower case, IDNA), deduplicated
            and sorted on construction. Empty: no name is allowed (``allow_cidrs`` may still
            allow addresses).
        deny: host patterns refused even when ``allow`` matches.
        allow_cidrs: networks (``"10.1.0.0/16"``, ``"::1/128"``) whose addresses are allowed
            although they are not public, and which IP literals may name. Host bits must be
            zero (``ipaddress.ip_network(strict=True)``).
        allow_ports: the TCP ports allowed, default ``(80, 443)``; give the whole set
            (``(80, 443, 8080)``).
        tls_ports: ports whose CONNECT tunnels must start with a TLS ClientHello (its server
            name checked, :meth:`check_server_name`), default ``(443,)``; other bytes first
            there end the tunnel (:meth:`check_not_tls`), and a plain-HTTP request to such a
            port is refused. On other ports a tunnel whose first bytes are not TLS passes
            unchecked (SSH, git, a database protocol), and so does a ClientHello that comes
            after such a prefix: the proxy still enforces the allowed name's checked address and
            port, not the names a server there serves. ``()`` lets any protocol through on every
            port (the behaviour before this field). Ports need not be in ``allow_ports``.
        extra_ca_pem: PEM certificates (``-----BEGIN CERTIFICATE-----`` blocks) the sandbox
            trusts besides the system's: ``/etc/ssl/certs/ca-certificates.crt`` inside becomes
            the host's bundle plus these, and ``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``,
            ``CURL_CA_BUNDLE``, ``PIP_CERT`` and ``NODE_EXTRA_CA_CERTS`` point at it (curl,
            Python's ssl, requests, pip and node then trust them). For a company TLS-inspecting
            proxy or a local HTTPS mirror. Never put a private key here (refused).

    Raises:
        PolicyError: a bad pattern (a URL, a port, an IP address, a ``*`` inside a name), a
            bad CIDR, a port outside 1-65535, or PEM text without a valid certificate.
    """

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    allow_cidrs: tuple[str, ...] = ()
    allow_ports: tuple[int, ...] = DEFAULT_PORTS
    extra_ca_pem: str = ""
    tls_ports: tuple[int, ...] = field(default=DEFAULT_TLS_PORTS, metadata=RECORD_OMIT_DEFAULT)

    def __post_init__(self) -> None:
        import ipaddress
        for name in ("allow", "deny"):
            patterns = _tuple_of_str(getattr(self, name), name)
            object.__setattr__(self, name, tuple(sorted({_pattern(p, name) for p in patterns})))
        cidrs = []
        for text in _tuple_of_str(self.allow_cidrs, "allow_cidrs"):
            if not isinstance(text, str):
                raise PolicyError(f"Egress.allow_cidrs: networks are str, got {text!r}")
            try:
                cidrs.append(ipaddress.ip_network(text.strip(), strict=True))
            except ValueError as err:
                raise PolicyError(f"Egress.allow_cidrs: {text!r} is not a network ({err}); "
                                  "write e.g. '10.1.0.0/16' or '192.0.2.7/32'") from None
        object.__setattr__(self, "allow_cidrs", tuple(str(n) for n in sorted(
            set(cidrs), key=lambda n: (n.version, n.network_address, n.prefixlen))))
        for name in ("allow_ports", "tls_ports"):
            object.__setattr__(self, name, _ports(getattr(self, name), name))
        if not isinstance(self.extra_ca_pem, str):
            raise PolicyError("Egress.extra_ca_pem must be PEM text (str); read the file yourself "
                              "(CLI: --ca-cert FILE)")
        if self.extra_ca_pem:
            _check_ca_pem(self.extra_ca_pem)

    # -- networks ---------------------------------------------------------------------------
    def _networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        import ipaddress
        return [ipaddress.ip_network(c) for c in self.allow_cidrs]

    def _in_cidrs(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
        import ipaddress
        candidates = [ip]
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            candidates.append(ip.ipv4_mapped)
        for net in self._networks():
            if any(c.version == net.version and c in net for c in candidates):
                return str(net)
        return None

    # -- decisions --------------------------------------------------------------------------
    def decide(self, host: str, port: int, *, tunnel: bool) -> Decision:
        """Decide a request by the name (or IP literal) and port it asks for, before resolution.

        Args:
            host: the host part of a CONNECT authority or absolute URL, without brackets.
            port: the TCP port.
            tunnel: a CONNECT (True: its first bytes are checked later, :meth:`check_not_tls`) or
                a plain-HTTP request (False: refused on ``tls_ports``); no default, so no caller
                forgets which.
        Returns:
            A :class:`Decision`; for an allowed IP literal ``address`` is set and no
            resolution is needed.
        """
        shown = host if len(host) <= 80 else host[:77] + "..."
        if port not in self.allow_ports:
            return Decision(False, f"port {port} is not allowed (allowed: "
                            f"{', '.join(map(str, self.allow_ports)) or 'none'}; Egress.allow_ports)", shown)
        if not tunnel and port in self.tls_ports:
            return Decision(False, f"plain HTTP to port {port} is refused: it is a TLS port (Egress.tls_ports); "
                            f"use https:// (a CONNECT tunnel)", shown)
        literal = ip_literal(host)
        if literal is not None:
            net = self._in_cidrs(literal)
            if net is None:
                kind = address_kind(literal)
                what = f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} address" if kind else "an IP address"
                return Decision(False, f"{literal} is {what}: IP literals are refused unless "
                                "Egress.allow_cidrs names them", str(literal), str(literal))
            return Decision(True, f"{literal} is inside allowed network {net}", str(literal), str(literal))
        try:
            name = normalize_host(host)
        except ValueError as err:
            return Decision(False, f"invalid host name: {err}", shown)
        for pattern in self.deny:
            if match(pattern, name):
                return Decision(False, f"{name!r} matches deny pattern {pattern!r} (Egress.deny)", name)
        for pattern in self.allow:
            if match(pattern, name):
                return Decision(True, f"matches {pattern!r}", name)
        return Decision(False, f"{name!r} is not on the allowlist (Egress.allow)", name)

    def check_addresses(self, name: str, addresses: Sequence[str], *,
                        host_addresses: Mapping[str, str] | None = None,
                        assume_public: Collection[str] = ()) -> Decision:
        """Check what ``name`` resolved to: every address must be public and not one of the
        host's own, or be in ``allow_cidrs``.

        Args:
            name: the normalized name (:attr:`Decision.host` of :meth:`decide`).
            addresses: the resolver's answers, in its order (numeric strings).
            host_addresses: the proxy host's own addresses, ``{address (compressed str):
                interface name}`` (loopback ranges may be left out); refused unless
                ``allow_cidrs`` names them.
            assume_public: addresses the classification table is not asked about (the
                TEST-ONLY resolver override's ``pretend_public``,
                :class:`lowlevel.net.resolve.ResolverOverride`); ``allow_cidrs`` and
                ``host_addresses`` still apply to them.
        Returns:
            A :class:`Decision` whose ``address`` is the first answer (allowed) or the first
            refused one.
        """
        import ipaddress
        if not addresses:
            return Decision(False, f"{name!r} did not resolve to any address", name)
        own = host_addresses or {}
        for text in addresses:
            try:
                ip = ipaddress.ip_address(text.split("%", 1)[0])
            except ValueError:
                return Decision(False, f"{name!r} resolved to {text!r}, not an address", name, text)
            if self._in_cidrs(ip) is not None:
                continue
            candidates: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [ip]
            inner = embedded_ipv4(ip) if isinstance(ip, ipaddress.IPv6Address) else None
            if inner is not None:
                candidates.append(inner[0])
            for candidate in candidates:
                where = own.get(str(candidate))
                if where is not None:
                    return Decision(False, f"{name!r} resolves to {ip}, an address of this host "
                                    f"({where}{'' if candidate == ip else f', as {candidate}'}): refused "
                                    "unless Egress.allow_cidrs names it", name, str(ip))
            if text in assume_public:
                continue
            kind = address_kind(ip)
            if kind is not None:
                return Decision(False, f"{name!r} resolves to {ip}, a {kind} address: refused unless "
                                "Egress.allow_cidrs names it", name, str(ip))
        return Decision(True, f"{name!r} resolves to public or allowed addresses", name, addresses[0])

    def check_not_tls(self, host: str, port: int, *, http: bool = False) -> Decision:
        """Decide a tunnel whose first bytes are not a TLS handshake record (another protocol,
        or a ClientHello behind a prefix, which :meth:`check_server_name` would not see).

        Args:
            host: the CONNECT target as decided (:attr:`Decision.host`).
            port: the CONNECT port.
            http: the first bytes are an HTTP request line
                (:func:`lowlevel.net.http_head.starts_http_request`).
        Returns:
            A :class:`Decision`: refused on ``tls_ports``, and for ``http`` on every port (a
            plain-HTTP request in a tunnel names its site in a ``Host`` the proxy never sees: an
            allowed name's address then serves any site hosted there, virtual-host fronting;
            plain HTTP goes to the proxy as ``http://`` requests, whose ``Host`` it sets);
            allowed elsewhere.

        Source: RFC 8446 section 5.1 (every TLS connection starts with a handshake record from
        the client), so on an HTTPS port anything else is not a TLS client; RFC 9110 section
        7.2 (``Host`` selects the site) and 9.3.6 (a tunnel's bytes are opaque to the proxy).
        """
        if port in self.tls_ports:
            return Decision(False, f"the tunnel to port {port} must start with a TLS ClientHello "
                            "(Egress.tls_ports), and its first bytes are not TLS", host)
        if http:
            return Decision(False, f"the tunnel to port {port} carries a plain-HTTP request: its Host would go "
                            "unchecked; send http:// URLs to the proxy itself (HTTP_PROXY), not through CONNECT",
                            host)
        return Decision(True, f"not TLS (port {port} is not in Egress.tls_ports: the server name is not checked)", host)

    def check_server_name(self, host: str, sni: str | None, *, ech: bool = False) -> Decision:
        """Check the server name (SNI) of a tunnel's TLS ClientHello against its CONNECT target.

        A tunnel carries the name it was allowed for: a ClientHello naming another host
        (``CONNECT allowed.example:443`` then SNI ``denied.example``: domain fronting, which a
        server or CDN at the allowed address may honour) is refused. Without SNI the
        ClientHello names no other host and is allowed (the server answers with its default
        certificate, which a client checks against the name it wants). With Encrypted Client
        Hello (RFC 9849) the visible SNI is the ECH public name and the real one is encrypted:
        allowed only when the public name is the CONNECT target. For a CONNECT to an IP
        literal (allowed by ``allow_cidrs``) the SNI may be any name that no ``deny`` pattern
        matches. What the proxy cannot see: the HTTP ``Host`` inside the encrypted tunnel
        (classic fronting: an allowed SNI, another Host) - most CDNs now refuse that mismatch.

        Args:
            host: the CONNECT target as decided (:attr:`Decision.host`: a normalized name or
                the literal's address).
            sni: the ClientHello's host_name (lower case), or None.
            ech: the ClientHello carries an ``encrypted_client_hello`` extension.
        Returns:
            A :class:`Decision`.

        Sources: RFC 6066 section 3 (server_name), RFC 8446 section 4.1.2 (ClientHello),
        RFC 9849 (ECH); Fifield et al., "Blocking-resistant communication through domain
        fronting" (PETS 2015).
        """
        if sni is None:
            return Decision(True, "the TLS ClientHello names no server (no SNI)", host)
        literal = ip_literal(host)
        try:
            name = normalize_host(sni) if ip_literal(sni) is None else str(ip_literal(sni))
        except ValueError:
            return Decision(False, f"the TLS ClientHello's server name {sni[:80]!r} is not a host name", host)
        if name == host:
            return Decision(True, f"TLS server name {name!r} is the CONNECT target", host)
        if literal is not None:
            for pattern in self.deny:
                if match(pattern, name):
                    return Decision(False, f"the TLS ClientHello names {name!r}, which matches deny pattern "
                                    f"{pattern!r} (Egress.deny)", host)
            return Decision(True, f"TLS server name {name!r} for an address allowed by Egress.allow_cidrs", host)
        why = (" (an Encrypted Client Hello shows its ECH public name: turn ECH off for connections through "
               "the proxy)" if ech else "")
        return Decision(False, f"the TLS ClientHello names {name!r} (SNI), not {host!r}, the CONNECT target: "
                        f"a tunnel may carry only the name it was allowed for (domain fronting){why}", host)

    # -- inside the sandbox -----------------------------------------------------------------
    def environment(self) -> dict[str, str]:
        """Variables set inside: the proxy for every scheme, ``NO_PROXY`` for the sandbox's own
        loopback, and with ``extra_ca_pem`` the CA bundle variables."""
        env = {}
        for key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env[key] = env[key.lower()] = PROXY_URL
        env["NO_PROXY"] = env["no_proxy"] = NO_PROXY
        if self.extra_ca_pem:
            for key in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS"):
                env[key] = CA_BUNDLE_DEST
        return env

    # -- narrowing (MCP) --------------------------------------------------------------------
    def narrow(self, *, allow: Sequence[str] | None = None, deny: Sequence[str] = (),
               allow_cidrs: Sequence[str] | None = None, allow_ports: Sequence[int] | None = None) -> Egress:
        """A copy that allows at most what this one allows (for a client narrowing an operator's policy).

        Args:
            allow: patterns, each covered by one of ours (an exact name our pattern matches, or
                a suffix pattern inside one of ours); None keeps ours.
            deny: patterns added to ours.
            allow_cidrs: networks, each inside one of ours; None keeps ours.
            allow_ports: ports, each one of ours; None keeps ours.
        Returns:
            The narrower :class:`Egress` (``extra_ca_pem`` and ``tls_ports`` kept).
        Raises:
            PolicyError: a request reaching beyond this policy (the message names the entry).
        """
        import ipaddress
        narrowed_allow = self.allow
        if allow is not None:
            asked = Egress(allow=tuple(allow)).allow
            for pattern in asked:
                if not any(_covers(ours, pattern) for ours in self.allow):
                    raise PolicyError(f"refused: host pattern {pattern!r} is not within the operator's "
                                      f"allowlist {list(self.allow)}")
            narrowed_allow = asked
        cidrs = self.allow_cidrs
        if allow_cidrs is not None:
            asked_cidrs = Egress(allow_cidrs=tuple(allow_cidrs)).allow_cidrs
            ours = self._networks()
            for text in asked_cidrs:
                net = ipaddress.ip_network(text)
                if not any(net.version == o.version and net.subnet_of(o) for o in ours):  # type: ignore[arg-type]
                    raise PolicyError(f"refused: network {text} is not within the operator's allow_cidrs "
                                      f"{list(self.allow_cidrs)}")
            cidrs = asked_cidrs
        ports = self.allow_ports
        if allow_ports is not None:
            asked_ports = Egress(allow_ports=tuple(allow_ports)).allow_ports
            extra = sorted(set(asked_ports) - set(self.allow_ports))
            if extra:
                raise PolicyError(f"refused: ports {extra} are not among the operator's allow_ports "
                                  f"{list(self.allow_ports)}")
            ports = asked_ports
        return Egress(allow=narrowed_allow, deny=self.deny + tuple(deny), allow_cidrs=cidrs, allow_ports=ports,
                      extra_ca_pem=self.extra_ca_pem, tls_ports=self.tls_ports)

    def describe(self) -> str:
        """One line for notes and refusals: ``"allow ['pypi.org'], ports [80, 443]"``."""
        parts = [f"allow {list(self.allow)}"]
        if self.deny:
            parts.append(f"deny {list(self.deny)}")
        if self.allow_cidrs:
            parts.append(f"cidrs {list(self.allow_cidrs)}")
        parts.append(f"ports {list(self.allow_ports)}")
        if self.tls_ports != DEFAULT_TLS_PORTS:
            parts.append(f"tls ports {list(self.tls_ports)}")
        return ", ".join(parts)


def _ports(ports: object, name: str) -> tuple[int, ...]:
    """``Egress.allow_ports`` / ``Egress.tls_ports`` checked: TCP ports, deduplicated, sorted."""
    if isinstance(ports, (int, str)) or not isinstance(ports, Iterable):
        raise PolicyError(f"Egress.{name} must be a tuple of ports, got {ports!r}")
    checked = set()
    for port in ports:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise PolicyError(f"Egress.{name}: {port!r} is not a TCP port (1-65535)")
        checked.add(port)
    return tuple(sorted(checked))


def _check_ca_pem(pem: str) -> None:
    """Refuse PEM text that holds a private key or no loadable certificate."""
    if "PRIVATE KEY" in pem:
        raise PolicyError("Egress.extra_ca_pem contains a private key: give the CA certificate only "
                          "(a key inside the sandbox lets the program impersonate any server to you)")
    if "-----BEGIN CERTIFICATE-----" not in pem:
        raise PolicyError("Egress.extra_ca_pem holds no '-----BEGIN CERTIFICATE-----' block: give PEM "
                          "certificates (CLI: --ca-cert FILE.pem)")
    import ssl
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem)
    except (ssl.SSLError, ValueError) as err:
        raise PolicyError(f"Egress.extra_ca_pem is not valid PEM certificates: {err}") from None


def egress_from_mapping(data: Mapping[str, object]) -> Egress:
    """Build an :class:`Egress` from a JSON/TOML mapping (lists allowed for the tuples).

    Raises:
        PolicyError: an unknown key or a bad value.
    """
    known = {"allow", "deny", "allow_cidrs", "allow_ports", "extra_ca_pem", "tls_ports"}
    unknown = set(data) - known
    if unknown:
        raise PolicyError(f"unknown egress keys {sorted(unknown)}; known: {sorted(known)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return Egress(**kwargs)  # type: ignore[arg-type]


__all__ = ["CA_BUNDLE_DEST", "DEFAULT_PORTS", "DEFAULT_TLS_PORTS", "Decision", "EGRESS_ETC", "Egress", "NO_PROXY",
           "NON_GLOBAL_V4", "NON_GLOBAL_V6", "NetworkAttempt", "PROXY_PORT", "PROXY_URL", "RECORD_OMIT_DEFAULT",
           "SOCKET_DEST", "address_kind", "egress_from_mapping", "embedded_ipv4", "ip_literal", "match",
           "normalize_host"]
