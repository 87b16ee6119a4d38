"""Network egress by allowlist: the policy (:class:`Egress`) and its decisions. Pure: no I/O.

``Policy(network=Egress(allow=("pypi.org", "*.npmjs.org")))`` keeps the sandbox in its own
network namespace (loopback only) and gives it one way out: an HTTP proxy that runs on the
host (:mod:`lowlevel.egress_proxy`), reached from inside through a unix socket bound into the
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
    non-public address: loopback (127.0.0.0/8, ::1), private (10/8, 172.16/12, 192.168/16,
        fc00::/7), link-local (169.254.0.0/16 with the cloud metadata service at
        169.254.169.254, fe80::/10), multicast, unspecified (0.0.0.0, ::), and every other
        range Python's :mod:`ipaddress` marks not ``is_global`` (shared 100.64/10,
        documentation, benchmarking, reserved). IPv4 addresses embedded in IPv6 ones
        (``::ffff:127.0.0.1``, 6to4 ``2002::/16``, NAT64 ``64:ff9b::/96``) are judged as the
        IPv4 address they carry.
    IP literal: a request naming an address instead of a name (``CONNECT 10.0.0.5:443``,
        ``http://[::1]/``), in any form ``inet_aton(3)`` accepts (``2130706433``,
        ``0x7f.1``: the same 127.0.0.1 to ``getaddrinfo``).

Rules, in order (the first that refuses wins; each refusal's reason names the rule):
    1. the port is in ``allow_ports`` (default 80 and 443);
    2. an IP literal is refused unless an ``allow_cidrs`` network contains it;
    3. a name is refused when a ``deny`` pattern matches, then unless an ``allow`` pattern does;
    4. every address the name resolves to must be public or inside an ``allow_cidrs`` network;
       one non-public answer refuses the request (a name with a private answer among public
       ones is what a rebinding attack looks like).

Sources: RFC 9110 section 9.3.6 (CONNECT) and 7.1 (absolute-form targets); RFC 6890 and the
IANA special-purpose address registries (what :mod:`ipaddress` ``is_global`` follows);
RFC 3490 (IDNA 2003); the Capital One 2019 breach and AWS IMDSv2 notes for 169.254.169.254;
DNS rebinding: Jackson et al., "Protecting Browsers from DNS Rebinding Attacks" (CCS 2007).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: ~1 ms that a run without egress (nearly all) never pays
    import ipaddress

from .errors import PolicyError

#: TCP port the relay listens on inside the sandbox (127.0.0.1 only), squid's customary port.
PROXY_PORT = 3128
#: URL of the proxy as programs inside see it.
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
#: Where the proxy's unix socket is bound inside the sandbox.
SOCKET_DEST = "/run/lowlevel/egress.sock"
#: Ports allowed when ``Egress.allow_ports`` is not given: HTTP and HTTPS.
DEFAULT_PORTS = (80, 443)
#: Where the CA bundle is inside (Debian's ``ca-certificates`` bundle, OpenSSL's default
#: CAfile there); with ``extra_ca_pem`` it is replaced by the system bundle plus those CAs.
CA_BUNDLE_DEST = "/etc/ssl/certs/ca-certificates.crt"
#: Hosts programs reach directly (the sandbox's own loopback), never through the proxy.
NO_PROXY = "localhost,127.0.0.1,::1"
#: /etc entries bound read-only in egress mode: TLS trust only (no resolv.conf, no hosts).
#: ``/etc/ssl`` holds the CA bundle and the hashed certificate links OpenSSL reads (their
#: targets are under ``/usr/share/ca-certificates``); ``/etc/ca-certificates`` is only
#: update-ca-certificates(8)'s configuration, so it is left out (one bind mount less per run).
EGRESS_ETC = ("/etc/ssl",)

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_INET_ATON_CHARS = re.compile(r"^[0-9a-fx.]+$")


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
        if not _LABEL.match(label):
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
    if _INET_ATON_CHARS.match(host.lower()):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def _nat64(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    import ipaddress
    if ip in ipaddress.ip_network("64:ff9b::/96"):  # NAT64's well-known prefix (RFC 6052)
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why ``ip`` is not a public address (``"loopback"``, ``"private"``...), or None when it is.

    IPv4 addresses carried in IPv6 ones (mapped ``::ffff:0:0/96``, 6to4 ``2002::/16``, NAT64
    ``64:ff9b::/96``) are judged as that IPv4 address.
    """
    import ipaddress
    if isinstance(ip, ipaddress.IPv6Address):
        for inner in (ip.ipv4_mapped, ip.sixtofour, _nat64(ip)):
            if inner is not None:
                kind = address_kind(inner)
                return f"{kind} ({inner} inside {ip})" if kind else None
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local" + (" (the cloud metadata service)" if str(ip) == "169.254.169.254" else "")
    if ip.is_multicast:
        return "multicast"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "non-global (shared, reserved or documentation range)"
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
        reason: why: the matching pattern, or the rule that refused (see :mod:`lowlevel.egress`).
        bytes_up: payload bytes from the sandbox to the server (bytes).
        bytes_down: payload bytes from the server to the sandbox (bytes).
        error: what ended an allowed connection early: ``"net_bytes"`` (the run's byte cap
            cut it), a connect failure (``"connect: ..."``), or None.
        resolver: ``"system"``, or ``"test-override"`` when a test replaced the resolver
            (:func:`lowlevel.egress_proxy.override_resolver_for_tests`).
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
    direct). HTTP CONNECT (HTTPS and other TLS, end to end: the proxy never sees inside the
    tunnel) and plain-HTTP forwarding; no SOCKS, no UDP, no DNS inside. A refused request gets
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
        ports = self.allow_ports
        if isinstance(ports, (int, str)) or not isinstance(ports, Iterable):
            raise PolicyError(f"Egress.allow_ports must be a tuple of ports, got {ports!r}")
        checked = set()
        for port in ports:
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise PolicyError(f"Egress.allow_ports: {port!r} is not a TCP port (1-65535)")
            checked.add(port)
        object.__setattr__(self, "allow_ports", tuple(sorted(checked)))
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
    def decide(self, host: str, port: int) -> Decision:
        """Decide a request by the name (or IP literal) and port it asks for, before resolution.

        Args:
            host: the host part of a CONNECT authority or absolute URL, without brackets.
            port: the TCP port.
        Returns:
            A :class:`Decision`; for an allowed IP literal ``address`` is set and no
            resolution is needed.
        """
        shown = host if len(host) <= 80 else host[:77] + "..."
        if port not in self.allow_ports:
            return Decision(False, f"port {port} is not allowed (allowed: "
                            f"{', '.join(map(str, self.allow_ports)) or 'none'}; Egress.allow_ports)", shown)
        literal = ip_literal(host)
        if literal is not None:
            net = self._in_cidrs(literal)
            if net is None:
                kind = address_kind(literal)
                what = f"a {kind} address" if kind else "an IP address"
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

    def check_addresses(self, name: str, addresses: Sequence[str]) -> Decision:
        """Check what ``name`` resolved to; every address must be public or in ``allow_cidrs``.

        Args:
            name: the normalized name (:attr:`Decision.host` of :meth:`decide`).
            addresses: the resolver's answers, in its order (numeric strings).
        Returns:
            A :class:`Decision` whose ``address`` is the first answer (allowed) or the first
            refused one.
        """
        import ipaddress
        if not addresses:
            return Decision(False, f"{name!r} did not resolve to any address", name)
        for text in addresses:
            try:
                ip = ipaddress.ip_address(text.split("%", 1)[0])
            except ValueError:
                return Decision(False, f"{name!r} resolved to {text!r}, not an address", name, text)
            if self._in_cidrs(ip) is not None:
                continue
            kind = address_kind(ip)
            if kind is not None:
                return Decision(False, f"{name!r} resolves to {ip}, a {kind} address: refused unless "
                                "Egress.allow_cidrs names it", name, str(ip))
        return Decision(True, f"{name!r} resolves to public or allowed addresses", name, addresses[0])

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
            The narrower :class:`Egress` (``extra_ca_pem`` kept).
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
                      extra_ca_pem=self.extra_ca_pem)

    def describe(self) -> str:
        """One line for notes and refusals: ``"allow ['pypi.org'], ports [80, 443]"``."""
        parts = [f"allow {list(self.allow)}"]
        if self.deny:
            parts.append(f"deny {list(self.deny)}")
        if self.allow_cidrs:
            parts.append(f"cidrs {list(self.allow_cidrs)}")
        parts.append(f"ports {list(self.allow_ports)}")
        return ", ".join(parts)


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
    known = {"allow", "deny", "allow_cidrs", "allow_ports", "extra_ca_pem"}
    unknown = set(data) - known
    if unknown:
        raise PolicyError(f"unknown egress keys {sorted(unknown)}; known: {sorted(known)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return Egress(**kwargs)  # type: ignore[arg-type]


__all__ = ["CA_BUNDLE_DEST", "DEFAULT_PORTS", "Decision", "EGRESS_ETC", "Egress", "NO_PROXY", "NetworkAttempt",
           "PROXY_PORT", "PROXY_URL", "SOCKET_DEST", "address_kind", "egress_from_mapping", "ip_literal", "match",
           "normalize_host"]
