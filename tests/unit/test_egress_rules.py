"""The egress decisions (lowlevel/egress.py) and the proxy's request parser, pure: no sandbox, no sockets."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

import lowlevel
from lowlevel.argv import Fds, HostFacts, build_argv
from lowlevel.egress import Egress, address_kind, ip_literal, match, normalize_host
from lowlevel.egress_proxy import _RefusedError, parse_request
from lowlevel.errors import PolicyError
from lowlevel.policy import Policy
from lowlevel.probe import BwrapInfo, HostLayout

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
    assert e.decide("PYPI.ORG.", 443).allowed
    assert e.decide("files.pythonhosted.org", 443).allowed
    assert e.decide("a.b.pythonhosted.org", 443).allowed
    assert not e.decide("pythonhosted.org", 443).allowed  # a suffix pattern does not match its apex
    assert not e.decide("www.pypi.org", 443).allowed  # an exact name does not match subdomains
    assert not e.decide("pypi.org.evil.example", 443).allowed
    assert not e.decide("evilpythonhosted.org", 443).allowed
    assert e.decide("xn--bcher-kva.example", 80).allowed
    d = e.decide("evil.pythonhosted.org", 443)
    assert not d.allowed and "deny pattern" in d.reason  # deny wins
    d = e.decide("pypi.org", 22)
    assert not d.allowed and "port 22 is not allowed" in d.reason
    d = e.decide("nope.example", 443)
    assert not d.allowed and "not on the allowlist" in d.reason
    assert not e.decide("bad host", 443).allowed


def test_decide_ip_literals_need_allow_cidrs():
    e = Egress(allow=("*",))
    for host in ("93.184.216.34", "127.0.0.1", "::1", "169.254.169.254", "2130706433"):
        d = e.decide(host, 80)
        assert not d.allowed and "IP literals are refused" in d.reason
    assert "cloud metadata" in e.decide("169.254.169.254", 80).reason
    e = Egress(allow_cidrs=("10.1.0.0/16", "93.184.216.34/32"))
    assert e.decide("10.1.2.3", 443).allowed and e.decide("93.184.216.34", 443).address == "93.184.216.34"
    assert not e.decide("10.2.0.1", 443).allowed


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


labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
names = st.lists(labels, min_size=1, max_size=4).map(".".join)


@given(names, names)
def test_covers_agrees_with_match(inner, outer):
    """_covers(outer, inner) is what narrow() trusts: every name inner matches, outer matches."""
    from lowlevel.egress import _covers
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
                               ("/etc/ssl", "/etc/ssl"), ("/etc/ca-certificates", "/etc/ca-certificates")))


def test_egress_argv_keeps_its_own_netns_and_binds_only_tls_trust():
    argv = build_argv(Policy(network=Egress(allow=("pypi.org",))), FACTS, workspace="/w", fds=Fds(),
                      extra_mounts=["--ro-bind", "/tmp/x/proxy.sock", "/run/lowlevel/egress.sock"])
    assert "--share-net" not in argv
    assert "/etc/resolv.conf" not in argv and "/etc/hosts" not in argv and "/etc/ca-certificates" not in argv
    assert ["--ro-bind", "/etc/ssl", "/etc/ssl"] == argv[argv.index("/etc/ssl") - 1:argv.index("/etc/ssl") + 2]
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
])
def test_parse_refuses(head):
    with pytest.raises(_RefusedError) as info:
        parse_request(head)
    assert info.value.status == 400


def test_resolver_override_is_test_only():
    """The test resolver is no Policy/Egress field, no CLI flag, not exported, and scoped."""
    import dataclasses

    from lowlevel import egress_proxy
    from lowlevel.cli import build_parser
    fields = {f.name for f in dataclasses.fields(Egress)} | {f.name for f in dataclasses.fields(Policy)}
    assert not any("resolv" in name for name in fields)
    assert not any("resolv" in name.lower() for name in lowlevel.__all__)
    parser = build_parser()
    helps = parser.format_help() + "".join(
        p.format_help() for a in parser._subparsers._group_actions for p in a.choices.values())  # type: ignore[union-attr]
    assert "resolver" not in helps.lower() and "override" not in helps.lower()
    assert egress_proxy._resolver_override is None
    with egress_proxy.override_resolver_for_tests(lambda n, p: ["127.0.0.1"], pretend_public=["127.0.0.1"]):
        assert egress_proxy._resolver_override is not None
    assert egress_proxy._resolver_override is None


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
