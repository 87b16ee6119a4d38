"""The egress decisions (lowlevel/spec/egress.py) and the proxy's request parser, pure: no sandbox, no sockets."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

import lowlevel
from lowlevel.sandbox.argv import Fds, HostFacts, build_argv
from lowlevel.spec.egress import Egress, address_kind, ip_literal, match, normalize_host
from lowlevel.net.http_head import RefusedError, parse_request, starts_http_request
from lowlevel.errors import PolicyError
from lowlevel.spec.policy import Policy
from lowlevel.host.probe import BwrapInfo, HostLayout

# --- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, norm", [
    ("PyPI.org", "pypi.org"), ("pypi.org.", "pypi.org"), ("bücher.example", "xn--bcher-kva.example"),
    ("XN--BCHER-KVA.example", "xn--bcher-kva.example"), ("a\u3002b.example", "a.b.example"),
    ("_dmarc.example", "_dmarc.example"),
])
def test_normalize_host(raw, norm):
    assert normalize_host(raw) == norm


@pytest.mark.parametrize("bad", ["", ".", "a..b", "-a.example", "a-.example", "a b.example", "a/b", "x" * 64 + ".com",
                                 ("a." * 127) + "com", "evil.com\r\nHost: x"])
def test_normalize_host_refuses(bad):
    with pytest.raises(ValueError):
        normalize_host(bad)


@pytest.mark.parametrize("host, addr", [
    ("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("2130706433", "127.0.0.1"), ("0x7f.1", "127.0.0.1"),
    ("127.1", "127.0.0.1"), ("017700000001", "127.0.0.1"), ("169.254.169.254", "169.254.169.254"),
])
def test_ip_literal_every_form_getaddrinfo_accepts(host, addr):
    assert str(ip_literal(host)) == addr


@pytest.mark.parametrize("host", ["pypi.org", "1.2.3.com", "abc.de", "localhost"])
def test_names_are_not_literals(host):
    assert ip_literal(host) is None


@pytest.mark.parametrize("addr, kind", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("192.168.1.1", "private"),
    ("172.16.0.1", "private"), ("fd00::1", "private"), ("169.254.169.254", "link-local (the cloud metadata service)"),
    ("fe80::1", "link-local"), ("224.0.0.1", "multicast"), ("239.1.1.1", "multicast"), ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"), ("100.64.0.1", "non-global"),
    ("192.0.2.1", "private"), ("::ffff:127.0.0.1", "loopback (127.0.0.1 inside ::ffff:7f00:1)"),
    ("2002:7f00:1::", "loopback"), ("64:ff9b::a9fe:a9fe", "link-local"),
    ("93.184.216.34", None), ("2606:4700::1111", None), ("::ffff:93.184.216.34", None),
])
def test_address_kind(addr, kind):
    got = address_kind(ipaddress.ip_address(addr))
    if kind is None:
        assert got is None
    else:
        assert got is not None and got.startswith(kind.split(" (")[0]) and (kind in got or "(" not in kind)


# --- the policy ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, needle", [
    ({"allow": ("https://pypi.org",)}, "not a host name"),
    ({"allow": ("pypi.org:443",)}, "not a host name"),
    ({"allow": ("pypi.org/simple",)}, "not a host name"),
    ({"allow": ("10.0.0.1",)}, "is an IP address"),
    ({"allow": ("[::1]",)}, "is an IP address"),
    ({"allow": ("py*.org",)}, "not supported"),
    ({"allow": ("*pypi.org",)}, "not supported"),
    ({"allow": "pypi.org"}, "tuple of str"),
    ({"allow": (b"pypi.org",)}, "patterns are str"),
    ({"allow_cidrs": ("10.0.0.1/8",)}, "host bits"),
    ({"allow_cidrs": ("nope",)}, "not a network"),
    ({"allow_ports": (0,)}, "not a TCP port"),
    ({"allow_ports": (True,)}, "not a TCP port"),
    ({"allow_ports": 443}, "tuple of ports"),
    ({"tls_ports": 443}, "Egress.tls_ports must be a tuple of ports"),
    ({"tls_ports": (70000,)}, "Egress.tls_ports: 70000 is not a TCP port"),
    ({"extra_ca_pem": "-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----\n"}, "private key"),
    ({"extra_ca_pem": "hello"}, "no '-----BEGIN CERTIFICATE-----'"),
    ({"extra_ca_pem": "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"}, "not valid PEM"),
])
def test_egress_refuses_bad_values(kwargs, needle):
    with pytest.raises(PolicyError, match=needle.replace("*", r"\*").replace("[", r"\[")):
        Egress(**kwargs)


def test_egress_is_canonical_and_hashable():
    a = Egress(allow=("PyPI.org", "*.NPMJS.org", "pypi.org"), allow_ports=(443, 80, 443),
               allow_cidrs=("10.0.0.0/8", "::1/128"))
    b = Egress(allow=["*.npmjs.org", "pypi.org"], allow_cidrs=["::1/128", "10.0.0.0/8"])
    assert a == b and hash(a) == hash(b)
    assert a.allow == ("*.npmjs.org", "pypi.org") and a.allow_ports == (80, 443)


def test_decide_patterns():
    e = Egress(allow=("pypi.org", "*.pythonhosted.org", "bücher.example"), deny=("evil.pythonhosted.org",))
    assert e.decide("PYPI.ORG.", 443, tunnel=True).allowed
    assert e.decide("files.pythonhosted.org", 443, tunnel=True).allowed
    assert e.decide("a.b.pythonhosted.org", 443, tunnel=True).allowed
    assert not e.decide("pythonhosted.org", 443, tunnel=True).allowed  # a suffix pattern does not match its apex
    assert not e.decide("www.pypi.org", 443, tunnel=True).allowed  # an exact name does not match subdomains
    assert not e.decide("pypi.org.evil.example", 443, tunnel=True).allowed
    assert not e.decide("evilpythonhosted.org", 443, tunnel=True).allowed
    assert e.decide("xn--bcher-kva.example", 80, tunnel=True).allowed
    d = e.decide("evil.pythonhosted.org", 443, tunnel=True)
    assert not d.allowed and "deny pattern" in d.reason  # deny wins
    d = e.decide("pypi.org", 22, tunnel=True)
    assert not d.allowed and "port 22 is not allowed" in d.reason
    d = e.decide("nope.example", 443, tunnel=True)
    assert not d.allowed and "not on the allowlist" in d.reason
    assert not e.decide("bad host", 443, tunnel=True).allowed


def test_decide_ip_literals_need_allow_cidrs():
    e = Egress(allow=("*",))
    for host in ("93.184.216.34", "127.0.0.1", "::1", "169.254.169.254", "2130706433"):
        d = e.decide(host, 80, tunnel=True)
        assert not d.allowed and "IP literals are refused" in d.reason
    assert "cloud metadata" in e.decide("169.254.169.254", 80, tunnel=True).reason
    e = Egress(allow_cidrs=("10.1.0.0/16", "93.184.216.34/32"))
    assert e.decide("10.1.2.3", 443, tunnel=True).allowed and e.decide("93.184.216.34", 443, tunnel=True).address == "93.184.216.34"
    assert not e.decide("10.2.0.1", 443, tunnel=True).allowed


def test_check_addresses():
    e = Egress(allow=("*",), allow_cidrs=("10.1.0.0/16",))
    assert e.check_addresses("a.example", ["93.184.216.34", "2606:4700::1111"]).allowed
    assert e.check_addresses("a.example", ["10.1.0.5"]).allowed
    d = e.check_addresses("a.example", ["93.184.216.34", "127.0.0.1"])  # one private answer refuses all
    assert not d.allowed and d.address == "127.0.0.1" and "loopback" in d.reason
    d = e.check_addresses("a.example", ["::ffff:169.254.169.254"])
    assert not d.allowed and "link-local" in d.reason
    assert not e.check_addresses("a.example", []).allowed
    assert e.check_addresses("a.example", ["fe80::1%eth0"]).allowed is False


def test_narrow_never_widens():
    op = Egress(allow=("pypi.org", "*.pythonhosted.org"), deny=("bad.pythonhosted.org",),
                allow_cidrs=("10.0.0.0/8",), allow_ports=(80, 443, 8080))
    n = op.narrow(allow=["files.pythonhosted.org", "*.cdn.pythonhosted.org"], deny=["pypi.org"],
                  allow_cidrs=["10.1.0.0/16"], allow_ports=[443])
    assert n.allow == ("*.cdn.pythonhosted.org", "files.pythonhosted.org")
    assert n.deny == ("bad.pythonhosted.org", "pypi.org") and n.allow_cidrs == ("10.1.0.0/16",)
    assert n.allow_ports == (443,)
    assert op.narrow() == op
    for kwargs, needle in (({"allow": ["evil.example"]}, "allowlist"), ({"allow": ["*"]}, "allowlist"),
                           ({"allow": ["*.org"]}, "allowlist"), ({"allow": ["pythonhosted.org"]}, "allowlist"),
                           ({"allow_cidrs": ["0.0.0.0/0"]}, "allow_cidrs"), ({"allow_ports": [22]}, "allow_ports")):
        with pytest.raises(PolicyError, match=needle):
            op.narrow(**kwargs)
    assert Egress(allow=("*",)).narrow(allow=["*.example"]).allow == ("*.example",)
    strict = Egress(allow=("pypi.org",), tls_ports=(443, 8443))
    assert strict.narrow(allow=["pypi.org"]).tls_ports == (443, 8443)  # a client cannot drop the operator's


def test_tls_ports_decisions():
    """A tunnel that is not TLS first: refused on tls_ports (default 443), allowed elsewhere;
    plain HTTP to a TLS port refused; a CONNECT there decided as any other."""
    e = Egress(allow=("pypi.org",), allow_ports=(22, 80, 443, 8443))
    assert e.tls_ports == (443,)
    d = e.check_not_tls("pypi.org", 443)
    assert not d.allowed and "must start with a TLS ClientHello (Egress.tls_ports)" in d.reason
    assert e.check_not_tls("pypi.org", 22).allowed
    d = e.decide("pypi.org", 443, tunnel=False)
    assert not d.allowed and "plain HTTP to port 443 is refused" in d.reason
    assert e.decide("pypi.org", 443, tunnel=True).allowed and e.decide("pypi.org", 80, tunnel=False).allowed
    none = Egress(allow=("pypi.org",), tls_ports=[])
    assert none.tls_ports == () and none.check_not_tls("pypi.org", 443).allowed
    assert none.decide("pypi.org", 443, tunnel=False).allowed
    more = Egress(allow=("pypi.org",), tls_ports=(8443, 443, 8443))
    assert more.tls_ports == (443, 8443) and not more.check_not_tls("pypi.org", 8443).allowed
    assert "tls ports [443, 8443]" in more.describe() and "tls ports" not in e.describe()


def test_tls_ports_in_the_record_only_when_set():
    """The canonical policy leaves tls_ports out at its default, so a record written before the
    field existed (or a policy that never sets it) keeps its policy_sha256; set, it is written
    and round-trips."""
    from lowlevel.record import canonical_policy, policy_from_canonical, policy_sha256
    default = Policy(network=Egress(allow=("pypi.org",)))
    net = canonical_policy(default)["network"]
    assert sorted(net) == ["allow", "allow_cidrs", "allow_ports", "deny", "extra_ca_pem"]
    strict = Policy(network=Egress(allow=("pypi.org",), tls_ports=(443, 8443)))
    assert canonical_policy(strict)["network"]["tls_ports"] == [443, 8443]
    assert policy_sha256(strict) != policy_sha256(default)
    for p in (default, strict):
        back = policy_from_canonical(canonical_policy(p))
        assert back == p and policy_sha256(back) == policy_sha256(p)


labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
names = st.lists(labels, min_size=1, max_size=4).map(".".join)


@given(names, names)
def test_covers_agrees_with_match(inner, outer):
    """_covers(outer, inner) is what narrow() trusts: every name inner matches, outer matches."""
    from lowlevel.spec.egress import _covers
    for o in (outer, "*." + outer, "*"):
        for i in (inner, "*." + inner):
            if _covers(o, i):
                for sample in (inner, "x." + inner, "a.b." + inner):
                    if match(i, sample):
                        assert match(o, sample), (o, i, sample)


@given(names)
def test_normalize_is_idempotent(name):
    once = normalize_host(name.upper() + ".")
    assert normalize_host(once) == once == name


def test_environment_points_every_client_at_the_proxy():
    env = Egress(allow=("pypi.org",)).environment()
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        assert env[key] == "http://127.0.0.1:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,127.0.0.1,::1"
    assert "SSL_CERT_FILE" not in env
    env = Policy(network=Egress(allow=("pypi.org",)), env={"HTTP_PROXY": "mine"}).environment()
    assert env["HTTP_PROXY"] == "mine" and env["https_proxy"] == "http://127.0.0.1:3128"


# --- the Policy and argv ---------------------------------------------------------------------

INFO = BwrapInfo(path="/usr/bin/bwrap", version=(0, 8, 0), setuid=False,
                 options=frozenset({"--disable-userns", "--size", "--json-status-fd", "--block-fd", "--args"}))
FACTS = HostFacts(bwrap=INFO, layout=HostLayout(symlinks=(), ro_dirs=(), etc_files=()), caller_is_root=False,
                  network_etc=(("/run/resolv.conf", "/etc/resolv.conf"), ("/etc/hosts", "/etc/hosts"),
                               ("/etc/ssl/certs", "/etc/ssl/certs"), ("/etc/ssl/openssl.cnf", "/etc/ssl/openssl.cnf"),
                               ("/etc/ca-certificates", "/etc/ca-certificates")))


def test_egress_argv_keeps_its_own_netns_and_binds_only_tls_trust():
    argv = build_argv(Policy(network=Egress(allow=("pypi.org",))), FACTS, workspace="/w", fds=Fds(),
                      extra_mounts=["--ro-bind", "/tmp/x/proxy.sock", "/run/lowlevel/egress.sock"])
    assert "--share-net" not in argv
    assert "/etc/resolv.conf" not in argv and "/etc/hosts" not in argv and "/etc/ca-certificates" not in argv
    for tls in ("/etc/ssl/certs", "/etc/ssl/openssl.cnf"):
        assert ["--ro-bind", tls, tls] == argv[argv.index(tls) - 1:argv.index(tls) + 2]
    assert "/etc/ssl" not in argv and not any(a.startswith("/etc/ssl/private") for a in argv)
    i = argv.index("/run/lowlevel/egress.sock")
    assert i < argv.index("/")  # mounted before --remount-ro / (nothing can be created after)
    assert argv[argv.index("/") - 1] == "--remount-ro"
    assert "HTTPS_PROXY" in argv


def test_policy_network_values():
    with pytest.raises(PolicyError, match="must be False, True"):
        Policy(network="pypi.org")  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="net_bytes"):
        Policy(network=True, limits=lowlevel.Limits(net_bytes=100))
    Policy(network=Egress(), limits=lowlevel.Limits(net_bytes=100))
    with pytest.raises(PolicyError, match="net_bytes"):
        lowlevel.Limits(net_bytes=0)


def test_canonical_policy_round_trip_and_loosening():
    from lowlevel.record import canonical_policy, policy_from_canonical, policy_loosening
    p = Policy(network=Egress(allow=("pypi.org",), allow_ports=(443,)))
    canon = canonical_policy(p)
    assert canon["network"] == {"allow": ["pypi.org"], "deny": [], "allow_cidrs": [], "allow_ports": [443],
                                "extra_ca_pem": ""}
    assert policy_from_canonical(canon) == p
    assert any("network=Egress(allow ['pypi.org']" in line for line in policy_loosening(p))


# --- the proxy's request parser --------------------------------------------------------------

def test_parse_connect():
    r = parse_request(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n")
    assert (r.method, r.host, r.port, r.head_out) == ("CONNECT", "pypi.org", 443, None)
    r = parse_request(b"CONNECT [::1]:8443 HTTP/1.1\r\n\r\n")
    assert (r.host, r.port) == ("::1", 8443)


def test_parse_absolute_form_is_rewritten_for_the_origin():
    r = parse_request(b"GET http://user:pw@Example.org:8080/a/b?c=1 HTTP/1.1\r\nHost: other.example\r\n"
                      b"Proxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\nConnection: keep-alive\r\n"
                      b"Accept: */*\r\n\r\n")
    assert (r.method, r.host, r.port) == ("GET", "example.org", 8080)
    assert r.head_out == (b"GET /a/b?c=1 HTTP/1.1\r\nHost: example.org:8080\r\nAccept: */*\r\n"
                          b"Connection: close\r\n\r\n")
    r = parse_request(b"GET http://example.org HTTP/1.0\r\n\r\n")
    assert r.port == 80 and r.head_out.startswith(b"GET / HTTP/1.0\r\nHost: example.org\r\n")


def test_parse_origin_form_uses_host():
    r = parse_request(b"GET /x HTTP/1.1\r\nHost: 127.0.0.1:3128\r\n\r\n")
    assert (r.host, r.port) == ("127.0.0.1", 3128)


@pytest.mark.parametrize("head", [
    b"CONNECT pypi.org HTTP/1.1\r\n\r\n", b"CONNECT ::1:443 HTTP/1.1\r\n\r\n", b"CONNECT pypi.org:99999 HTTP/1.1\r\n\r\n",
    b"GET https://pypi.org/ HTTP/1.1\r\n\r\n", b"GET ftp://x/ HTTP/1.1\r\n\r\n", b"GET /x HTTP/1.1\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01\x00\x00\r\n\r\n",
    b"GET / HTTP/2\r\n\r\n", b"get http://x/ HTTP/1.1\r\n\r\n", b"GET http://x/ HTTP/1.1\r\n folded\r\n\r\n",
    b"GET http://x/ HTTP/1.1\r\nBad Header: y\r\n\r\n",
    # Digits str.isdigit() takes and int() refuses: a 400, not a ValueError out of the proxy.
    "CONNECT pypi.org:\u00b9 HTTP/1.1\r\n\r\n".encode("latin-1"),
    "GET http://pypi.org:44\u00b3/ HTTP/1.1\r\n\r\n".encode("latin-1"),
    "POST http://pypi.org/ HTTP/1.1\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"),
])
def test_parse_refuses(head):
    with pytest.raises(RefusedError) as info:
        parse_request(head)
    assert info.value.status == 400


def test_resolver_override_is_test_only():
    """The test resolver is no Policy/Egress field, no CLI flag, not exported, and scoped."""
    import dataclasses

    from helpers.scripted_resolver import override_resolver

    from lowlevel.cli import build_parser
    from lowlevel.net import resolve
    fields = {f.name for f in dataclasses.fields(Egress)} | {f.name for f in dataclasses.fields(Policy)}
    assert not any("resolv" in name for name in fields)
    assert not any("resolv" in name.lower() for name in lowlevel.__all__)
    parser = build_parser()
    helps = parser.format_help() + "".join(
        p.format_help() for a in parser._subparsers._group_actions for p in a.choices.values())  # type: ignore[union-attr]
    assert "resolver" not in helps.lower() and "override" not in helps.lower()
    assert resolve.override is None
    with override_resolver(lambda n, p: ["127.0.0.1"], pretend_public=["127.0.0.1"]):
        assert resolve.override is not None
    assert resolve.override is None


def test_mcp_config_egress_from_toml_and_flags(tmp_path):
    import trustme

    from lowlevel.mcp_server import ServerConfig, Tools
    ca = tmp_path / "ca.pem"
    ca.write_bytes(trustme.CA().cert_pem.bytes())
    toml = tmp_path / "mcp.toml"
    toml.write_text(f'[egress]\nallow = ["pypi.org"]\nallow_ports = [443]\nextra_ca_file = "{ca}"\n'
                    '[limits]\nnet_bytes = 1048576\n')
    cfg = ServerConfig.from_toml(str(toml), workspace_base=str(tmp_path / "ws"))
    assert cfg.egress is not None and cfg.egress.allow == ("pypi.org",) and cfg.egress.allow_ports == (443,)
    assert "BEGIN CERTIFICATE" in cfg.egress.extra_ca_pem and cfg.limits.net_bytes == 1 << 20
    # `lowlevel mcp --allow-host` replaces the allow list and keeps the rest of [egress].
    cfg = ServerConfig.from_toml(str(toml), workspace_base=str(tmp_path / "ws"), egress={"allow": ["*.npmjs.org"]})
    assert cfg.egress is not None and cfg.egress.allow == ("*.npmjs.org",) and cfg.egress.allow_ports == (443,)
    tools = Tools(cfg)
    clamped: list[str] = []
    p = tools.policy_for(network=False, binds=[], memory_bytes=None, cpu_s=None, pids=None, clamped=clamped)
    assert p.network == cfg.egress
    p = tools.policy_for(network=False, binds=[], memory_bytes=None, cpu_s=None, pids=None, clamped=clamped,
                         allow_hosts=["registry.npmjs.org"])
    assert isinstance(p.network, Egress) and p.network.allow == ("registry.npmjs.org",)
    p = tools.policy_for(network=False, binds=[], memory_bytes=None, cpu_s=None, pids=None, clamped=clamped,
                         allow_hosts=[])
    assert p.network is False
    with pytest.raises(PolicyError, match="unknown egress keys"):
        ServerConfig.from_mapping({"egress": {"allow_hosts": ["x"]}})


# --- issue 22 item 3: the classification table and the host's own addresses -------------------

@pytest.mark.parametrize("addr, needle", [
    # forms Python 3.11.2's ipaddress calls global (pre CVE-2024-4032 fixes) or that embed IPv4
    ("fec0::1", "site-local"), ("::7f00:1", "IPv4-compatible"), ("::a9fe:a9fe", "IPv4-compatible"),
    ("::ffff:0:7f00:1", "IPv4-translated"), ("::ffff:0:a9fe:a9fe", "IPv4-translated"),
    ("64:ff9b::7f00:1", "loopback (127.0.0.1 inside 64:ff9b::7f00:1)"),
    ("64:ff9b::a00:1", "private (10.0.0.1 inside"), ("64:ff9b:1::808:808", "local-use NAT64"),
    ("2002:a00:1::", "private (10.0.0.1 inside"), ("2002:c000:201::1", "private (192.0.2.1 inside"),
    ("2001::1", "Teredo"), ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"), ("2001:10::1", "IETF protocol"),
    ("2001:db8::1", "documentation"), ("3fff::1", "documentation"), ("100::1", "discard-only"),
    ("5f00::1", "SRv6"), ("4000::1", "outside global unicast"), ("::2", "IPv4-compatible"),
    ("0.1.2.3", "'this network'"), ("100.64.0.1", "shared address space"), ("192.0.0.9", "IETF protocol"),
    ("192.0.0.170", "IETF protocol"), ("198.18.0.1", "benchmarking"), ("198.19.255.255", "benchmarking"),
    ("240.0.0.1", "reserved"), ("255.255.255.255", "limited broadcast"), ("192.88.99.1", "6to4 relay"),
    ("203.0.113.9", "documentation"), ("198.51.100.1", "documentation"),
])
def test_non_global_table_covers_every_special_form(addr, needle):
    got = address_kind(ipaddress.ip_address(addr))
    assert got is not None and needle in got, (addr, got)


@pytest.mark.parametrize("addr", ["93.184.216.34", "8.8.8.8", "1.1.1.1", "2606:4700::1111", "2a00:1450::1",
                                  "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1", "100.128.0.1",
                                  "198.20.0.1", "192.0.1.1", "223.255.255.1"])
def test_public_addresses_stay_public(addr):
    """Control: the table refuses the special ranges only (their neighbours are public)."""
    assert address_kind(ipaddress.ip_address(addr)) is None


def test_table_not_the_interpreters():
    """The table decides where this interpreter's ipaddress would call a non-global address global."""
    for addr in ("::7f00:1", "::ffff:0:7f00:1", "fec0::1", "64:ff9b:1::1", "5f00::1"):
        assert address_kind(ipaddress.ip_address(addr)) is not None


def test_own_host_addresses_refused_unless_allow_cidrs():
    own = {"203.0.113.7": "eth0", "2001:4860::7": "eth1"}
    e = Egress(allow=("*",))
    d = e.check_addresses("a.example", ["203.0.113.7"], host_addresses=own, assume_public={"203.0.113.7"})
    assert not d.allowed and "an address of this host (eth0)" in d.reason
    d = e.check_addresses("a.example", ["2001:4860::7"], host_addresses=own)
    assert not d.allowed and "an address of this host (eth1)" in d.reason
    d = e.check_addresses("a.example", ["::ffff:203.0.113.7"], host_addresses=own, assume_public={"::ffff:203.0.113.7"})
    assert not d.allowed and "eth0, as 203.0.113.7" in d.reason
    # control: without the host's list the same answer passes; allow_cidrs lets it through
    assert e.check_addresses("a.example", ["203.0.113.7"], assume_public={"203.0.113.7"}).allowed
    assert Egress(allow=("*",), allow_cidrs=("203.0.113.7/32",)).check_addresses(
        "a.example", ["203.0.113.7"], host_addresses=own).allowed


def test_host_addresses_reads_the_kernel():
    """Every address `ip addr` would show (here /proc/net/if_inet6 and SIOCGIFCONF), loopback left out."""
    import socket as _socket

    from lowlevel.net.host_addresses import host_addresses
    found = host_addresses()
    assert "127.0.0.1" not in found and "::1" not in found
    with open("/proc/net/if_inet6") as f:
        for line in f:
            addr = _socket.inet_ntop(_socket.AF_INET6, bytes.fromhex(line.split()[0]))
            assert addr == "::1" or found.get(addr) == line.split()[5]
    probe = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.254", 9))  # no packet: picks the source address of the default route
        source = probe.getsockname()[0]
    except OSError:
        source = None
    finally:
        probe.close()
    if source and not source.startswith("127."):
        assert source in found


# --- issue 22 item 4: TLS server names and one request per plain-HTTP connection ---------------

def _client_hello(server_hostname: str | None) -> bytes:
    """A real ClientHello from this Python's ssl (OpenSSL), with SNI ``server_hostname``."""
    import ssl
    ctx = ssl.create_default_context()
    if server_hostname is None:
        ctx.check_hostname = False
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def test_parse_client_hello_from_openssl():
    from lowlevel.net.tls_sni import parse_client_hello
    hello = _client_hello("Secure.Example.")
    parsed = parse_client_hello(hello)
    assert parsed is not None and parsed.sni == "secure.example" and not parsed.ech
    assert parse_client_hello(hello[:3]) is None and parse_client_hello(hello[:-1]) is None  # needs more
    nosni = parse_client_hello(_client_hello(None))
    assert nosni is not None and nosni.sni is None
    # fragmented over two records (RFC 8446 5.1 allows it)
    body = hello[5:]
    split = hello[:1] + hello[1:3] + len(body[:50]).to_bytes(2, "big") + body[:50] \
        + hello[:1] + hello[1:3] + len(body[50:]).to_bytes(2, "big") + body[50:]
    again = parse_client_hello(split)
    assert again is not None and again.sni == "secure.example"


def test_parse_client_hello_refuses_malformed():
    from lowlevel.net.tls_sni import NotTlsError, parse_client_hello
    with pytest.raises(NotTlsError):
        parse_client_hello(b"GET / HTTP/1.1\r\n")
    hello = bytearray(_client_hello("a.example"))
    with pytest.raises(ValueError):
        parse_client_hello(bytes(hello[:5]) + b"\x02" + bytes(hello[6:]))  # not a ClientHello
    with pytest.raises(ValueError):
        parse_client_hello(b"\x16\x03\x01\x00\x08\x01\x00\x00\x04\x03\x03\x00\x00")  # truncated body
    with pytest.raises(ValueError):
        parse_client_hello(b"\x16\x03\x01\x00\x04\x01\x01\x00\x00")  # over MAX_HELLO_BYTES


def _hello_with_extensions(extensions: bytes) -> bytes:
    body = b"\x03\x03" + bytes(32) + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00"
    body += len(extensions).to_bytes(2, "big") + extensions
    hs = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + len(hs).to_bytes(2, "big") + hs


def _sni_ext(*names: bytes) -> bytes:
    entries = b"".join(b"\x00" + len(n).to_bytes(2, "big") + n for n in names)
    data = len(entries).to_bytes(2, "big") + entries
    return b"\x00\x00" + len(data).to_bytes(2, "big") + data


def test_parse_client_hello_handmade_forms():
    from lowlevel.net.tls_sni import parse_client_hello
    hello = parse_client_hello(_hello_with_extensions(_sni_ext(b"a.example")))
    assert hello is not None and hello.sni == "a.example"
    ech = parse_client_hello(_hello_with_extensions(_sni_ext(b"public.example") + b"\xfe\x0d\x00\x00"))
    assert ech is not None and ech.ech and ech.sni == "public.example"
    for bad in (_sni_ext(b"a.example", b"b.example"),                     # two host_names
                _sni_ext(b"a.example") + _sni_ext(b"b.example"),          # the extension twice
                _sni_ext(b"caf\xc3\xa9.example"), _sni_ext(b"")):
        with pytest.raises(ValueError):
            parse_client_hello(_hello_with_extensions(bad))


def test_check_server_name():
    e = Egress(allow=("*.example",), deny=("denied.example",), allow_cidrs=("10.0.0.0/8",))
    assert e.check_server_name("a.example", "a.example").allowed
    assert e.check_server_name("a.example", None).allowed  # no SNI: names no other host
    d = e.check_server_name("a.example", "denied.example")
    assert not d.allowed and "names 'denied.example' (SNI), not 'a.example'" in d.reason
    d = e.check_server_name("a.example", "b.example")  # another allowed name: still not the CONNECT's
    assert not d.allowed and "domain fronting" in d.reason
    d = e.check_server_name("a.example", "public.example", ech=True)
    assert not d.allowed and "Encrypted Client Hello" in d.reason
    assert e.check_server_name("10.1.2.3", "mirror.internal").allowed
    d = e.check_server_name("10.1.2.3", "denied.example")
    assert not d.allowed and "deny pattern" in d.reason
    assert not e.check_server_name("a.example", "a b").allowed


def test_parse_request_body_length():
    r = parse_request(b"POST http://a.example/x HTTP/1.1\r\nContent-Length: 5\r\n\r\n")
    assert r.body_len == 5
    assert parse_request(b"GET http://a.example/x HTTP/1.1\r\n\r\n").body_len == 0
    assert parse_request(b"POST http://a.example/ HTTP/1.1\r\nContent-Length: 7, 7\r\n\r\n").body_len == 7
    for head, status in ((b"POST http://a.example/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
                         (b"POST http://a.example/ HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
                         (b"POST http://a.example/ HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400)):
        with pytest.raises(RefusedError) as info:
            parse_request(head)
        assert info.value.status == status


def test_parse_client_hello_waits_for_the_first_byte():
    from lowlevel.net.tls_sni import parse_client_hello
    assert parse_client_hello(b"") is None


@pytest.mark.parametrize("head", [
    # the red-team's smuggle: a bare LF inside a header value starts a second request at an
    # origin that takes LF as a line end (Python's http.server does)
    b"GET http://allowed.test/first HTTP/1.1\r\nX-A: a\n\nGET /second HTTP/1.1\nHost: denied.test\n\r\n\r\n",
    b"GET http://allowed.test/ HTTP/1.1\r\nX-A: a\rb\r\n\r\n",
    b"GET http://allowed.test/ HTTP/1.1\r\nX-A: a\x00b\r\n\r\n",
    b"GET http://allowed.test/ HTTP/1.1\r\nX-A: a\r\n b\r\n\r\n",      # obs-fold
    b"GET http://allowed.test/ HTTP/1.1\r\n\r\nHost: denied.test\r\n\r\n",  # a blank line inside
    b"GET http://allowed.test/\n HTTP/1.1\r\n\r\n",
])
def test_request_heads_with_bare_line_ends_or_controls_are_refused(head: bytes) -> None:
    """Issue 22 item 4, the red-team's follow-up: no second request hides in a header value."""
    with pytest.raises(RefusedError) as err:
        parse_request(head)
    assert err.value.status == 400


def test_a_clean_head_with_tabs_passes() -> None:
    """Control: HTAB inside a value is allowed (RFC 9112 field values), CRLF line ends pass."""
    r = parse_request(b"GET http://allowed.test/x HTTP/1.1\r\nX-A: a\tb\r\nAccept: */*\r\n\r\n")
    assert r.host == "allowed.test" and b"X-A: a\tb\r\n" in (r.head_out or b"")


def test_a_refused_ip_literal_is_named_with_the_right_article() -> None:
    """The proxy said "0.0.0.0 is a unspecified address"."""
    e = Egress(allow=("example.org",))
    assert "0.0.0.0 is an unspecified address" in e.decide("0.0.0.0", 443, tunnel=True).reason
    assert "127.0.0.1 is a loopback address" in e.decide("127.0.0.1", 443, tunnel=True).reason


def test_cli_tls_port_builds_the_egress_tls_ports():
    from lowlevel import cli
    from lowlevel.cli import run_cmd
    parser = cli.build_parser()
    for extra, want in (([], (443,)), (["--allow-port", "8443", "--tls-port", "8443"], (443, 8443)),
                        (["--tls-port", "none"], ()), (["--tls-port", "NONE"], ())):
        args = parser.parse_args(["run", "--allow-host", "a.example", *extra, "--", "true"])
        network = run_cmd.policy_from_args(args).network
        assert isinstance(network, Egress) and network.tls_ports == want, (extra, network)


@pytest.mark.parametrize("first, verdict", [
    (b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n", True),
    (b"\r\n\r\nGET / HTTP/1.1\r\n", True),                 # empty lines a server skips (RFC 9112 2.2)
    (b"GET\t/x\tHTTP/1.1\r\n", True), (b"GET  /x  HTTP/1.0\n", True), (b"get / http/1.1\n", True),
    (b"GET /x\r\n", True),                                  # HTTP/0.9
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", True),            # the HTTP/2 preface
    (b"G", None), (b"GET /", None), (b"GET /x HTTP/1.1", None), (b"", None), (b"EHLO x", None),
    (b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3\r\n", False), (b"EHLO mail.test\r\n", False),
    (b"*1\r\n$4\r\nPING\r\n", False), (b"0032git-upload-pack /p.git\x00host=x\x00", False),
    (b"\x00\x00\x00\x08\x04\xd2\x16/", False), (b"\x16\x03\x01\x02\x00", False), (b"GET /\x00 HTTP/1.1\r\n", False),
])
def test_starts_http_request(first: bytes, verdict: bool | None) -> None:
    """What a tunnel's first bytes are: an HTTP request line (refused in a tunnel), another
    protocol (passes), or the start of a request line (the proxy reads on)."""
    assert starts_http_request(first) is verdict


def test_a_tab_in_the_request_line_is_refused() -> None:
    """``urlsplit`` drops a TAB inside an absolute URL: the host checked was the one with the
    TAB dropped while the origin got a path cut at the wrong place (a fresh-user trial); now a
    TAB anywhere in the request line is a 400. Control: the same request with spaces parses."""
    for line in (b"GET http://local\thost:8000/secret HTTP/1.1", b"GET http://localhost:8000/a\tb HTTP/1.1",
                 b"GET\thttp://localhost/ HTTP/1.1"):
        with pytest.raises(RefusedError, match="TAB in the request line"):
            parse_request(line + b"\r\n\r\n")
    assert parse_request(b"GET http://localhost:8000/secret HTTP/1.1\r\n\r\n").head_out.startswith(b"GET /secret ")


def test_a_refused_host_name_with_control_characters_is_shown_escaped() -> None:
    """The CLI's ``egress:`` lines printed a refused name's C0/C1 controls raw (U+009B is a
    terminal's CSI: a fresh-user trial); now escaped as repr does. Control: a plain name as is."""
    from lowlevel.net.attempts import describe_attempt
    from lowlevel.spec.egress import NetworkAttempt
    bad = NetworkAttempt(method="CONNECT", host="evil\x9b31m\x1b[2J.test", port=443, address=None, allowed=False,
                         reason="not on the allowlist", bytes_up=0, bytes_down=0, error=None, resolver="system")
    line = describe_attempt(bad)
    assert "\x9b" not in line and "\x1b" not in line and "evil\\x9b31m\\x1b[2J.test:443" in line
    ok = NetworkAttempt(method="CONNECT", host="pypi.org", port=443, address=None, allowed=False,
                        reason="x", bytes_up=0, bytes_down=0, error=None, resolver="system")
    assert describe_attempt(ok).startswith("CONNECT pypi.org:443 DENIED")
