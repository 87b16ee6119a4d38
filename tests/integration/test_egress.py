"""Network egress by allowlist (``Policy(network=Egress(...))``), end to end, as root and unprivileged.

Real servers on host loopback (tests/helpers/origin_servers.py): plain HTTP, HTTPS with a
trustme test CA, a PEP 503 index and an npm registry stub. The allowlisted test names
(``allowed.test``, ``secure.test``, ...) reach them through the TEST-ONLY resolver override
(``override_resolver`` of tests/helpers/scripted_resolver.py, which sets the proxy's
injection point ``lowlevel.net.resolve.override``), which also marks 127.0.0.1 as "public" for its own
answers only: IP literals and names the system resolver answers (``localhost``, the host
name) are judged as they are. Each refusal is an attack that must fail, next to a control
that works.
"""

from __future__ import annotations

import json
import errno
import os
import secrets
import socket
import ssl
import sys
from pathlib import Path

import pytest

import lowlevel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from origin_servers import WHEEL_NAME, Origin, PipelineOrigin, TlsOrigin  # noqa: E402

pytestmark = pytest.mark.bwrap

TLS_NAMES = ("secure.test", "pypi.test", "npm.test")
NAMES = ("allowed.test", "denied.test") + TLS_NAMES


@pytest.fixture(scope="module")
def origin():
    o = Origin("origin")
    yield o
    o.close()


@pytest.fixture(scope="module")
def tls():
    o = TlsOrigin("tls-origin", TLS_NAMES)
    yield o
    o.close()


def resolver(**extra: object) -> dict:
    answers: dict[str, object] = {name: ["127.0.0.1"] for name in NAMES}
    answers.update(extra)
    return {"answers": answers, "pretend_public": ["127.0.0.1"]}


def egress(*ports: int, allow: tuple[str, ...] = ("allowed.test",), **kw: object) -> dict:
    return {"allow": list(allow), "allow_ports": [80, 443, *ports], **kw}


def attempts(r) -> list[dict]:
    assert r.error is None, r.message
    return r.raw["network"]


def _loopback_name() -> str | None:
    """A name the system resolver maps to a non-public address without any override (the
    host name, from /etc/hosts), or None."""
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return name.lower() if infos and all(
        lowlevel.spec.egress.address_kind(__import__("ipaddress").ip_address(i[4][0])) for i in infos) else None


def test_tls_trust_is_bound_but_never_the_hosts_tls_keys(sandbox, origin):
    """Egress mode binds the CA certificates and OpenSSL's configuration, not all of
    ``/etc/ssl``: its ``private`` directory (the host's TLS keys, 0710 group ``ssl-cert``) was
    bound too, readable by name for a caller in that group (a fresh-user trial). Control: the
    host has ``/etc/ssl/private``; inside only ``certs`` and ``openssl.cnf`` are there, and HTTPS
    trust still works (the other tests here)."""
    if not os.path.isdir("/etc/ssl/private"):
        pytest.skip("no /etc/ssl/private on this host")
    r = sandbox.run(["sh", "-c", "ls -a /etc/ssl; test -s /etc/ssl/certs/ca-certificates.crt && echo bundle"],
                    resolver=resolver(), egress=egress(origin.port))
    assert r.exit_code == 0, r.err
    names = r.out.split()
    assert "private" not in names and "certs" in names and "bundle" in names, names


# --- allowed: curl, urllib, pip, npm ------------------------------------------------------------

URLLIB = """
import sys, urllib.request
for url in sys.argv[1:]:
    print(urllib.request.urlopen(url, timeout=20).read().decode().strip())
"""


def test_allowed_host_with_curl_and_urllib_http_and_https(sandbox, origin, tls):
    plain = f"http://allowed.test:{origin.port}/hello"
    secure = f"https://secure.test:{tls.port}/hello"
    script = f"curl -sS --fail {plain} && curl -sS --fail {secure} && python3 get.py {plain} {secure}"
    r = sandbox.run(["sh", "-c", script], files={"get.py": URLLIB.encode()}, resolver=resolver(),
                    egress=egress(origin.port, tls.port, allow=("allowed.test", "secure.test"),
                                  extra_ca_pem=tls.ca_pem))
    assert r.exit_code == 0, r.err
    assert r.out.splitlines() == ["hello from origin", "hello from tls-origin"] * 2
    seen = attempts(r)
    assert [(a["method"], a["host"], a["allowed"]) for a in seen] == [
        ("GET", "allowed.test", True), ("CONNECT", "secure.test", True)] * 2
    for a in seen:
        assert a["address"] == "127.0.0.1" and a["port"] in (origin.port, tls.port)
        assert a["bytes_down"] > 0 and a["bytes_up"] > 0 and a["error"] is None
        assert a["resolver"] == "test-override" and "matches" in a["reason"]
    assert any("TEST-ONLY resolver" in n for n in r.notes)


def test_test_ca_is_trusted_only_through_extra_ca_pem(sandbox, tls):
    """Control for the trust store option: without extra_ca_pem the same HTTPS request fails
    certificate verification (curl exit 60) while the proxy allowed the tunnel."""
    r = sandbox.run(["curl", "-sS", f"https://secure.test:{tls.port}/hello"], resolver=resolver(),
                    egress=egress(tls.port, allow=("secure.test",)))
    assert r.exit_code == 60, (r.exit_code, r.err)
    assert "certificate" in r.err
    assert [a["allowed"] for a in attempts(r)] == [True]


@pytest.mark.slow
def test_pip_download_from_local_index(sandbox, tls):
    r = sandbox.run(["python3", "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
                     "--index-url", f"https://pypi.test:{tls.port}/simple/", "-d", "dl", "tinypkg"],
                    resolver=resolver(), timeout=120,
                    egress=egress(tls.port, allow=("pypi.test",), extra_ca_pem=tls.ca_pem))
    assert r.exit_code == 0, r.err + r.out
    assert f"dl/{WHEEL_NAME}" in r.changes["added"]
    assert {a["host"] for a in attempts(r)} == {"pypi.test"}
    assert all(a["allowed"] and a["method"] == "CONNECT" for a in attempts(r))


@pytest.mark.slow
def test_npm_install_from_local_registry_stub(sandbox, tls):
    if not os.path.exists("/usr/bin/npm"):
        pytest.fail("npm is missing: .ci/setup installs it (apt-get install npm)")
    r = sandbox.run(["sh", "-c", f"npm install --no-audit --no-fund --no-update-notifier "
                     f"--registry https://npm.test:{tls.port}/ tinynpm && node -e \"console.log(require('tinynpm'))\""],
                    resolver=resolver(), timeout=180, limits={"memory_bytes": 2 << 30},
                    egress=egress(tls.port, allow=("npm.test",), extra_ca_pem=tls.ca_pem))
    assert r.exit_code == 0, r.err + r.out
    assert r.out.strip().endswith("42")
    assert "node_modules/tinynpm/index.js" in r.changes["added"]
    hosts = {(a["host"], a["allowed"]) for a in attempts(r)}
    assert hosts == {("npm.test", True)}


# --- refused -----------------------------------------------------------------------------------

PROBE = """
import json, os, sys, urllib.error, urllib.request
for key in ("no_proxy", "NO_PROXY"):     # send even loopback targets to the proxy
    os.environ.pop(key, None)
out = []
for url in sys.argv[1:]:
    try:
        body = urllib.request.urlopen(url, timeout=20).read().decode()
        out.append([url, "OK", body])
    except urllib.error.HTTPError as e:
        out.append([url, e.code, e.read().decode()])
    except Exception as e:
        out.append([url, "ERR", str(e)])
print(json.dumps(out))
"""


def test_refusals_with_reasons(sandbox, origin):
    """Each of these is refused by the proxy, and the program and Result.network say why.

    Control: the allowed name on the same server and port is fetched in the same run."""
    port = origin.port
    loopback_name = _loopback_name()
    allow = ("allowed.test", "localhost") + ((loopback_name,) if loopback_name else ())
    cases = {
        f"http://allowed.test:{port}/hello": ("OK", "hello from origin"),
        f"http://denied.test:{port}/hello": (403, "'denied.test' is not on the allowlist"),
        f"http://127.0.0.1:{port}/hello": (403, "127.0.0.1 is a loopback address: IP literals are refused"),
        f"http://2130706433:{port}/hello": (403, "127.0.0.1 is a loopback address"),
        f"http://localhost:{port}/hello": (403, "'localhost' resolves to 127.0.0.1, a loopback address"),
        "http://169.254.169.254/latest/meta-data/": (403, "link-local (the cloud metadata service)"),
        "https://169.254.169.254/latest/meta-data/": ("ERR", "403"),
        f"http://[::1]:{port}/hello": (403, "::1 is a loopback address"),
        "http://allowed.test:22/": (403, "port 22 is not allowed"),
    }
    if loopback_name:
        cases[f"http://{loopback_name}:{port}/hello"] = (403, f"'{loopback_name}' resolves to")
    r = sandbox.run(["python3", "probe.py", *cases], files={"probe.py": PROBE.encode()}, resolver=resolver(),
                    egress=egress(port, allow=allow))
    assert r.exit_code == 0, r.err
    results = {url: (status, body) for url, status, body in json.loads(r.out)}
    for url, (status, needle) in cases.items():
        assert results[url][0] == status, (url, results[url])
        assert needle in results[url][1], (url, results[url])
    seen = attempts(r)
    assert len(seen) == len(cases)
    by_url = dict(zip(cases, seen))
    assert by_url[f"http://allowed.test:{port}/hello"]["allowed"]
    for url, a in by_url.items():
        if url.startswith(f"http://allowed.test:{port}"):
            continue
        assert not a["allowed"] and a["bytes_up"] == a["bytes_down"] == 0, (url, a)
        assert a["reason"], a
    assert by_url["https://169.254.169.254/latest/meta-data/"]["method"] == "CONNECT"
    assert "cloud metadata" in by_url["https://169.254.169.254/latest/meta-data/"]["reason"]
    assert by_url[f"http://localhost:{port}/hello"]["address"] == "127.0.0.1"


def test_dns_rebinding_gets_one_lookup_per_request(sandbox):
    """A resolver that answers a public address first and a private one the second time: the
    proxy asks once per request and connects to the address it checked, so the first request
    reaches the "public" server and the second is refused; the internal service on the private
    address is never contacted. (127.0.0.1 plays the public host, 127.0.0.2 the internal one.)"""
    public = Origin("public", "127.0.0.1")
    try:
        internal = Origin("internal", "127.0.0.2", public.port)
    except OSError as err:
        public.close()
        pytest.skip(f"cannot listen on 127.0.0.2:{public.port}: {err}")
    try:
        url = f"http://rebind.test:{public.port}/hello"
        r = sandbox.run(["sh", "-c", f"curl -sS {url}; curl -sS {url}"],
                        resolver=resolver(**{"rebind.test": [["127.0.0.1"], ["127.0.0.2"]]}),
                        egress=egress(public.port, allow=("rebind.test",)))
        assert r.exit_code == 0, r.err
        assert r.out.startswith("hello from public\n")
        assert "rebind.test' resolves to 127.0.0.2, a loopback address" in r.out
        assert internal.hits == 0 and public.hits == 1
        assert r.raw["resolver_calls"] == {"rebind.test": 2}
        first, second = attempts(r)
        assert first["allowed"] and first["address"] == "127.0.0.1"
        assert not second["allowed"] and second["address"] == "127.0.0.2"
    finally:
        public.close()
        internal.close()


DIRECT = """
import socket, sys
for target in (("127.0.0.1", int(sys.argv[1])), "\\0" + sys.argv[2]):
    fam = socket.AF_INET if isinstance(target, tuple) else socket.AF_UNIX
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(target)
        print("CONNECTED")
    except OSError as e:
        print(type(e).__name__)
"""


def test_host_loopback_and_abstract_sockets_unreachable(sandbox, server):
    name = f"lowlevel-egress-test-{secrets.token_hex(6)}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0" + name)
    abstract.listen(4)
    try:
        # Control: both listeners work from the host.
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect("\0" + name)
        c.close()
        r = sandbox.run(["python3", "direct.py", str(server.port), name], files={"direct.py": DIRECT.encode()},
                        egress=egress(allow=("*",)))
        assert r.exit_code == 0, r.err
        # The TCP connect is refused by the empty loopback, or first by Landlock (ABI >= 4 lets
        # an egress program connect to the relay's port only).
        tcp = "PermissionError" if (r.raw.get("landlock_abi") or 0) >= 4 else "ConnectionRefusedError"
        assert r.out.split() == [tcp, "ConnectionRefusedError"]
        assert attempts(r) == []
    finally:
        abstract.close()


def test_net_bytes_cap_cuts_a_large_download(sandbox, origin):
    cap = 1 << 20
    url = f"http://allowed.test:{origin.port}/bytes/{8 << 20}"
    r = sandbox.run(["sh", "-c", f"curl -sS -o big {url}; echo curl=$?; curl -sS {url.replace('bytes/8388608', 'hello')}"],
                    resolver=resolver(), egress=egress(origin.port), limits={"net_bytes": cap})
    assert r.exit_code == 0, r.err
    assert "curl=0" not in r.out
    assert "net_bytes cap" in r.out  # the next request is refused with the reason
    first, second = attempts(r)
    assert first["allowed"] and first["error"] == "net_bytes"
    assert first["bytes_up"] + first["bytes_down"] == cap
    assert not second["allowed"] and "net_bytes" in second["reason"]
    size = os.path.getsize(os.path.join(r.workspace, "big"))
    assert 0 < size < cap
    assert "net_bytes" in r.limits_enforced
    assert any("net_bytes cap" in n for n in r.notes)


def test_nothing_of_the_host_stays_open_inside(sandbox):
    """The relay closes the fd it was exec'd through; the program gets only its stdio (control:
    the same listing without egress)."""
    code = "import os; print(sorted(os.listdir('/proc/self/fd')))"
    plain = sandbox.run(["python3", "-c", code])
    r = sandbox.run(["python3", "-c", code], egress=egress(allow=("pypi.org",)))
    assert r.exit_code == 0 == plain.exit_code, r.err
    assert r.out == plain.out == "['0', '1', '2', '3']\n"


def test_no_dns_inside(sandbox):
    code = ("import os, socket\nprint(os.path.exists('/etc/resolv.conf'))\n"
            "try:\n    socket.getaddrinfo('pypi.org', 443)\n    print('RESOLVED')\n"
            "except socket.gaierror as e:\n    print('gaierror')\n")
    r = sandbox.run(["python3", "-c", code], egress=egress(allow=("pypi.org",)))
    assert r.exit_code == 0, r.err
    assert r.out.split() == ["False", "gaierror"]


# --- the other entry points: session, arun, CLI, record, MCP (root identity, in-process) ---------

@pytest.fixture
def scripted():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from scripted_resolver import ScriptedResolver, override_resolver
    res = ScriptedResolver({name: ["127.0.0.1"] for name in NAMES})
    with override_resolver(res, pretend_public=("127.0.0.1",)):
        yield res


_CREATED: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _remove_workspaces():
    yield
    import shutil
    while _CREATED:
        shutil.rmtree(_CREATED.pop(), ignore_errors=True)


def _ws() -> str:
    """A fresh workspace the sandbox's uid can reach, removed when the module ends."""
    import tempfile
    path = tempfile.mkdtemp(prefix="ws-egress-", dir="/tmp")
    os.chmod(path, 0o755)
    _CREATED.append(path)
    return path


def test_session_results_list_their_own_attempts(origin, scripted):
    policy = lowlevel.Policy(network=lowlevel.Egress(allow=("allowed.test",), allow_ports=(origin.port,)))
    with lowlevel.Session(policy, workspace=_ws()) as s:
        ok = s.run(["curl", "-sS", f"http://allowed.test:{origin.port}/hello"])
        bad = s.run(["curl", "-sS", f"http://denied.test:{origin.port}/hello"])
        quiet = s.run(["true"])
    assert ok.stdout == b"hello from origin\n"
    assert [(a.host, a.allowed) for a in ok.network] == [("allowed.test", True)]
    assert [(a.host, a.allowed) for a in bad.network] == [("denied.test", False)]
    assert quiet.network == ()


def test_arun_reports_network(origin, scripted):
    import asyncio
    policy = lowlevel.Policy(network=lowlevel.Egress(allow=("allowed.test",), allow_ports=(origin.port,)))
    r = asyncio.run(lowlevel.arun(["curl", "-sS", f"http://allowed.test:{origin.port}/hello"], policy=policy,
                                  workspace=_ws()))
    assert r.stdout == b"hello from origin\n"
    assert [(a.method, a.host, a.allowed) for a in r.network] == [("GET", "allowed.test", True)]


def test_cli_allow_host_json_and_network_warnings(origin, scripted, capsys):
    from lowlevel.cli import main

    code = main(["run", "--workspace", _ws(), "--allow-host", "allowed.test", "--allow-port", str(origin.port),
                 "--json", "--", "curl", "-sS", f"http://allowed.test:{origin.port}/hello"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert code == 0 and doc["stdout"] == "hello from origin\n"
    assert [(a["host"], a["allowed"]) for a in doc["network"]] == [("allowed.test", True)]
    assert "warning" not in err
    # --tls-port: plain HTTP to that port is refused (the rule is the CLI's too), 443 stays one.
    code = main(["run", "--workspace", _ws(), "--allow-host", "allowed.test", "--allow-port", str(origin.port),
                 "--tls-port", str(origin.port), "--json", "--", "curl", "-sSf", f"http://allowed.test:{origin.port}/hello"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 22 and "it is a TLS port (Egress.tls_ports)" in doc["network"][0]["reason"], doc["network"]
    # Bare --network: the host network, with a one-line warning; --network=host: no warning.
    assert main(["run", "--workspace", _ws(), "--network", "--json", "--", "true"]) == 0
    out, err = capsys.readouterr()
    assert len([line for line in err.splitlines() if "warning" in line]) == 1 and "host's whole network" in err
    assert json.loads(out)["network"] is None  # the host network: nothing goes through the proxy
    assert main(["run", "--workspace", _ws(), "--network=host", "--json", "--", "true"]) == 0
    assert "warning" not in capsys.readouterr().err
    # --allow-host with the host network is a contradiction.
    assert main(["run", "--network=host", "--allow-host", "x.test", "--", "true"]) == 125  # a usage error: lowlevel's own errors exit 125


def test_record_lists_network_and_replays_policy(origin, scripted, tmp_path):
    import jsonschema

    from lowlevel.record import load_record, policy_from_canonical
    rec = tmp_path / "run.json"
    policy = lowlevel.Policy(network=lowlevel.Egress(allow=("allowed.test", "*.example.org"),
                                                      allow_ports=(origin.port,)),
                             limits=lowlevel.Limits(net_bytes=1 << 20))
    lowlevel.run(["curl", "-sS", f"http://allowed.test:{origin.port}/hello"], policy=policy, workspace=_ws(),
                 record=rec)
    doc = load_record(rec)
    schema = json.loads((Path(__file__).resolve().parents[2] / "docs" / "record-schema.json").read_text())
    jsonschema.validate(doc, schema)
    assert [(a["host"], a["allowed"]) for a in doc["network"]] == [("allowed.test", True)]
    assert policy_from_canonical(doc["policy"]) == policy


def test_mcp_operator_allowlist_narrowed_by_client(origin, scripted):
    from lowlevel.errors import PolicyError
    from lowlevel.mcp_server import ServerConfig, Tools

    config = ServerConfig.from_mapping({"workspace_base": os.path.join(_ws(), "mcp"),
                                        "egress": {"allow": ["allowed.test", "*.example.org"],
                                                   "allow_ports": [origin.port]}})
    tools = Tools(config)
    try:
        out = tools.run(["curl", "-sS", f"http://allowed.test:{origin.port}/hello"])
        assert out["stdout"] == "hello from origin\n"
        assert [(a["host"], a["allowed"]) for a in out["network"]] == [("allowed.test", True)]
        # Narrowed by the client: allowed.test is no longer on the run's list.
        out = tools.run(["curl", "-sS", f"http://allowed.test:{origin.port}/hello"], allow_hosts=["a.example.org"])
        assert "not on the allowlist" in out["stdout"]
        assert [a["allowed"] for a in out["network"]] == [False]
        # Widening is refused before anything runs.
        with pytest.raises(PolicyError, match="not within the operator's allowlist"):
            tools.run(["true"], allow_hosts=["evil.test"])
        with pytest.raises(PolicyError, match="host network"):
            tools.run(["true"], network=True)
    finally:
        tools.close()


CONCURRENT = """
import sys, urllib.request
first = urllib.request.urlopen(sys.argv[1], timeout=30)         # open (headers read), body pending
second = len(urllib.request.urlopen(sys.argv[1], timeout=30).read())  # while the first is open
print([len(first.read()), second])
"""


def test_relay_copies_when_no_pipe_can_be_made(sandbox, origin):
    """With RLIMIT_NOFILE 16 the relay (fds 0-4 its own, then 6 per connection: two sockets and
    two pipes) has no fd left for the second connection's second pipe and moves those bytes
    through its buffer instead: same bytes, same report."""
    url = f"http://allowed.test:{origin.port}/bytes/{3 << 20}"
    r = sandbox.run(["python3", "get.py", url], files={"get.py": CONCURRENT.encode()}, resolver=resolver(),
                    egress=egress(origin.port), limits={"nofile": 16})
    assert r.exit_code == 0, r.err
    assert r.out.strip() == str([3 << 20] * 2)
    assert [a["allowed"] for a in attempts(r)] == [True] * 2
    assert all(a["bytes_down"] > 3 << 20 for a in attempts(r))


def test_proxy_copies_where_splice_is_missing(origin, scripted, monkeypatch):
    """The host proxy's fallback (no os.splice): the same download, the same count."""
    monkeypatch.delattr("os.splice")
    policy = lowlevel.Policy(network=lowlevel.Egress(allow=("allowed.test",), allow_ports=(origin.port,)))
    r = lowlevel.run(["sh", "-c", f"curl -sS -o big http://allowed.test:{origin.port}/bytes/{3 << 20} && wc -c < big"],
                     policy=policy, workspace=_ws())
    assert r.stdout.strip() == str(3 << 20).encode(), r.stderr
    (a,) = r.network
    assert a.allowed and a.bytes_down > 3 << 20 and a.error is None


def test_relay_runs_the_command_as_bwrap_would(sandbox):
    """The relay starts the program (behind the guard, lowlevel.host.landlock) the way bwrap's execvp
    does (a script without "#!" runs with /bin/sh), passes its exit status through, and an exec
    failure is an ExecError as in every other mode (the guard reports the errno)."""
    # files= writes 0644: make it executable first, as a program would.
    r = sandbox.run(["sh", "-c", "chmod +x s && ./s 3"], files={"s": b'echo "from sh: $1"; exit "$1"\n'},
                    egress=egress())
    assert (r.exit_code, r.out) == (3, "from sh: 3\n"), r.err
    r = sandbox.run(["sh", "-c", "kill -TERM $$"], egress=egress())
    assert r.exit_code == 128 + 15 and r.term_signal == 15
    r = sandbox.run(["/proc/self/no-such-program"], egress=egress())
    assert r.error == "ExecError" and r.errno == errno.ENOENT, r


# --- issue 22 item 3: the host's own addresses and the special address forms ---------------------

def _own_ipv4() -> str:
    from lowlevel.net.host_addresses import host_addresses
    own = sorted(a for a in host_addresses() if ":" not in a)
    if not own:
        pytest.fail("this host has no non-loopback IPv4 address to test the own-address rule with")
    return own[0]


def test_own_host_address_refused(sandbox):
    """A name resolving to the proxy host's own non-loopback address, which the test resolver
    even calls public (as a public address of a cloud VM would be), reached a service bound to
    0.0.0.0 on the host (the Ray dashboard, CVE-2023-48022). Refused, also as IPv4-mapped.
    Control: the same server through allow_cidrs naming that address is fetched."""
    own = _own_ipv4()
    server = Origin("host-service", "0.0.0.0")
    try:
        socket.create_connection((own, server.port), timeout=5).close()  # the host reaches it
        names = {"own.test": [own], "mapped.test": [f"::ffff:{own}"]}
        res = {"answers": names, "pretend_public": [own, f"::ffff:{own}"]}
        urls = [f"http://{n}:{server.port}/hello" for n in names]
        r = sandbox.run(["python3", "probe.py", *urls], files={"probe.py": PROBE.encode()}, resolver=res,
                        egress=egress(server.port, allow=tuple(names)))
        assert r.exit_code == 0, r.err
        out = json.loads(r.out)
        assert [o[1] for o in out] == [403, 403], out
        assert "an address of this host" in out[0][2] and "an address of this host" in out[1][2], out
        assert all(not a["allowed"] and "an address of this host" in a["reason"] for a in attempts(r))
        assert server.hits == 0
        # control: allowed by allow_cidrs, the same name and server answer
        r = sandbox.run(["python3", "probe.py", urls[0]], files={"probe.py": PROBE.encode()}, resolver=res,
                        egress=egress(server.port, allow=("own.test",), allow_cidrs=[f"{own}/32"]))
        assert r.exit_code == 0, r.err
        assert json.loads(r.out)[0][1:] == ["OK", "hello from host-service\n"]
        assert server.hits == 1
    finally:
        server.close()


SPECIAL_FORMS = {
    "compat.test": ("::7f00:1", "IPv4-compatible"), "translated.test": ("::ffff:0:7f00:1", "IPv4-translated"),
    "sitelocal.test": ("fec0::1", "site-local"), "nat64.test": ("64:ff9b::7f00:1", "127.0.0.1 inside"),
    "nat64local.test": ("64:ff9b:1::7f00:1", "local-use NAT64"), "sixtofour.test": ("2002:7f00:1::", "127.0.0.1 inside"),
    "teredo.test": ("2001::7f00:1", "Teredo"), "thisnet.test": ("0.0.0.1", "'this network'"),
    "shared.test": ("100.64.0.1", "shared address space"), "ietf.test": ("192.0.0.9", "IETF protocol"),
    "bench.test": ("198.18.0.1", "benchmarking"), "reserved.test": ("240.0.0.1", "reserved"),
}


def test_special_address_forms_refused(sandbox, origin):
    """Each special form a resolver can answer is refused with its registry entry; control: a
    name answering the test's "public" address in the same run is fetched."""
    answers = {name: [addr] for name, (addr, _) in SPECIAL_FORMS.items()}
    urls = [f"http://allowed.test:{origin.port}/hello"] + [f"http://{n}:{origin.port}/hello" for n in SPECIAL_FORMS]
    r = sandbox.run(["python3", "probe.py", *urls], files={"probe.py": PROBE.encode()}, resolver=resolver(**answers),
                    egress=egress(origin.port, allow=("*.test",)))
    assert r.exit_code == 0, r.err
    out = json.loads(r.out)
    assert out[0][1:] == ["OK", "hello from origin\n"]
    for (name, (addr, needle)), (_url, status, body) in zip(SPECIAL_FORMS.items(), out[1:]):
        assert status == 403 and needle in body and "resolves to" in body, (name, addr, body)
    assert [a["allowed"] for a in attempts(r)] == [True] + [False] * len(SPECIAL_FORMS)


# --- issue 22 item 4: deny bypassed by pipelining and by TLS fronting ------------------------------

PIPELINE = """
import socket, sys
port = int(sys.argv[1])
heads = {
    "get": f"GET http://allowed.test:{port}/a HTTP/1.1\\r\\nHost: allowed.test:{port}\\r\\n\\r\\n",
    "post": f"POST http://allowed.test:{port}/a HTTP/1.1\\r\\nHost: allowed.test:{port}\\r\\nContent-Length: 5\\r\\n\\r\\nhello",
}
second = f"GET /b HTTP/1.1\\r\\nHost: denied.test:{port}\\r\\n\\r\\n"
for kind, first in heads.items():
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall((first + second).encode())
    got = b""
    while True:
        data = s.recv(65536)
        if not data:
            break
        got += data
    print(kind, repr(got.decode().split("\\r\\n\\r\\n", 1)[-1]), got.count(b"HTTP/1.1 "))
"""


def test_deny_not_bypassed_by_pipelining(sandbox):
    """A second request pipelined on one plain-HTTP connection named a denied host in Host:
    only the first was checked and the upstream (one that answers pipelined requests and
    ignores Connection: close) served both. Now the connection carries one request: the
    second is recorded as refused and never reaches the server. Control: sent from the host
    straight to the server, the same bytes get both requests served."""
    server = PipelineOrigin()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /a HTTP/1.1\r\nHost: allowed.test\r\n\r\nGET /b HTTP/1.1\r\nHost: denied.test\r\n\r\n")
            got = b""
            while got.count(b"served") < 2:
                got += s.recv(65536)
        assert server.hosts == ["allowed.test", "denied.test"]
        server.hosts.clear()
        r = sandbox.run(["python3", "pipe.py", str(server.port)], files={"pipe.py": PIPELINE.encode()},
                        resolver=resolver(), egress=egress(server.port, allow=("*.test",), deny=("denied.test",)))
        assert r.exit_code == 0, r.err
        assert r.out.splitlines() == [f"get 'served allowed.test:{server.port} GET 0\\n' 1",
                                      f"post 'served allowed.test:{server.port} POST 5\\n' 1"]
        assert server.hosts == [f"allowed.test:{server.port}"] * 2
        seen = attempts(r)
        assert [(a["host"], a["allowed"]) for a in seen] == [("allowed.test", True), ("denied.test", False)] * 2
        for a in seen[1::2]:
            assert "pipelined" in a["reason"] and "deny pattern 'denied.test'" in a["reason"], a
    finally:
        server.close()


FRONT = """
import json, socket, ssl, sys
port, target = int(sys.argv[1]), sys.argv[2]
out = {}
for sni in sys.argv[3:]:
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(f"CONNECT {target}:{port} HTTP/1.1\\r\\nHost: {target}:{port}\\r\\n\\r\\n".encode())
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        head += s.recv(1)
    ctx = ssl.create_default_context()
    name = None if sni == "-" else sni
    if name is None:
        ctx.check_hostname = False
    try:
        t = ctx.wrap_socket(s, server_hostname=name)
        t.sendall(f"GET /hello HTTP/1.1\\r\\nHost: {name or target}\\r\\nConnection: close\\r\\n\\r\\n".encode())
        body = b""
        while (data := t.recv(65536)):
            body += data
        out[sni] = ["OK", body.decode().split("\\r\\n\\r\\n", 1)[1]]
    except (ssl.SSLError, OSError) as e:
        out[sni] = ["ERR", str(e)]
print(json.dumps(out))
"""


def test_deny_not_bypassed_by_tls_fronting(sandbox):
    """CONNECT to an allowed name, then a ClientHello whose SNI (and Host) is a denied one that
    the same server also serves: refused with a TLS unrecognized_name alert, the server never
    gets the handshake. Controls: the host completes that very handshake directly (the server
    serves the denied name); inside, the SNI matching the CONNECT name and a ClientHello
    without SNI pass."""
    front = TlsOrigin("front", ("secure.test", "denied.test"))
    try:
        ctx = ssl.create_default_context(cadata=front.ca_pem)
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="denied.test") as direct:
            assert direct.version()  # the handshake for the denied name completes
        hits = front.hits
        r = sandbox.run(["python3", "front.py", str(front.port), "secure.test", "secure.test", "denied.test", "-"],
                        files={"front.py": FRONT.encode()}, resolver=resolver(),
                        egress=egress(front.port, allow=("*.test",), deny=("denied.test",), extra_ca_pem=front.ca_pem))
        assert r.exit_code == 0, r.err
        out = json.loads(r.out)
        assert out["secure.test"] == ["OK", "hello from front\n"]
        assert out["-"] == ["OK", "hello from front\n"]
        assert out["denied.test"][0] == "ERR" and "UNRECOGNIZED_NAME" in out["denied.test"][1], out
        assert front.hits == hits + 2
        first, fronted, nosni = attempts(r)
        assert first["allowed"] and "is the CONNECT target" in first["reason"]
        assert not fronted["allowed"] and "names 'denied.test' (SNI), not 'secure.test'" in fronted["reason"]
        assert fronted["bytes_up"] == 0
        assert nosni["allowed"] and "no SNI" in nosni["reason"]
    finally:
        front.close()


TUNNEL = """
import json, socket, sys
port, out = sys.argv[1], []
for first in sys.argv[2:]:
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(f"CONNECT allowed.test:{port} HTTP/1.1\\r\\n\\r\\n".encode() + first.encode().replace(b"|", b"\\r\\n"))
    b = b""
    try:
        while (d := s.recv(65536)):
            b += d
    except OSError as e:
        b += repr(e).encode()
    out.append(b.decode(errors="replace").split("\\r\\n\\r\\n", 1)[-1][:200])
    s.close()
print(json.dumps(out))
"""


def test_a_tunnel_carrying_plain_http_is_refused(sandbox, origin):
    """The attack (virtual-host fronting, found by a fresh-user trial): CONNECT to an allowed
    name on a port outside ``tls_ports`` (80 by default), then a plain-HTTP request naming any
    other site in ``Host``: the proxy never saw that Host, and a server hosting several sites at
    the allowed address served the other one. Now a tunnel whose first line is an HTTP request
    line ends before a byte goes up, in the lenient forms a server accepts too (empty lines
    first, tabs, HTTP/0.9, the HTTP/2 preface)."""
    firsts = ["GET /hello HTTP/1.1|Host: other.test||", "||GET\t/hello\tHTTP/1.1|Host: other.test||",
              "GET /hello|", "PRI * HTTP/2.0||SM||"]
    r = sandbox.run(["python3", "t.py", str(origin.port), *firsts], files={"t.py": TUNNEL.encode()},
                    resolver=resolver(), egress=egress(origin.port))
    assert r.exit_code == 0, r.err
    assert json.loads(r.out) == ["", "", "", ""], r.out  # nothing from the origin
    tries = attempts(r)
    assert len(tries) == 4 and not any(a["allowed"] for a in tries), tries
    assert all("carries a plain-HTTP request" in a["reason"] and a["bytes_up"] == 0 for a in tries), tries


def test_a_tunnel_of_another_protocol_passes(sandbox, origin):
    """Control: a tunnel whose first bytes are neither TLS nor an HTTP request line (a line
    protocol's greeting, an SSH banner) reaches the server as before: the origin, an HTTP
    server, answers it with its own 400; and plain HTTP through the proxy itself (an http://
    URL, absolute form) is still forwarded."""
    r = sandbox.run(["python3", "t.py", str(origin.port), "SSH-2.0-OpenSSH_9.2p1 Debian-2|", "EHLO x|"],
                    files={"t.py": TUNNEL.encode()}, resolver=resolver(), egress=egress(origin.port))
    assert r.exit_code == 0, r.err
    assert all("Error code: 400" in reply for reply in json.loads(r.out)), r.out  # the origin's own answer
    tries = attempts(r)
    assert [a["allowed"] for a in tries] == [True, True] and all(a["bytes_up"] > 0 for a in tries), tries
    url = f"http://allowed.test:{origin.port}/hello"
    r = sandbox.run(["python3", "-c", f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"],
                    resolver=resolver(), egress=egress(origin.port))
    assert r.exit_code == 0 and r.out == "hello from origin\n\n", (r.out, r.err)


FIRST_BYTES = """
import json, socket, ssl, sys
port = int(sys.argv[1])
out = []
for prefix in sys.argv[2:]:
    inc, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello_of = ssl.create_default_context().wrap_bio(inc, outgoing, server_hostname="denied.test")
    try:
        hello_of.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = outgoing.read()  # a real ClientHello naming denied.test (SNI)
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(f"CONNECT secure.test:{port} HTTP/1.1\\r\\nHost: secure.test:{port}\\r\\n\\r\\n".encode())
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        head += s.recv(1)
    s.sendall(prefix.encode().replace(b"\\\\n", b"\\r\\n") + hello)
    reply = b""
    try:
        while (data := s.recv(65536)):
            reply += data
    except OSError as e:
        reply += repr(e).encode()
    out.append([head.split(b"\\r\\n")[0].decode(), reply[:1].hex()])
    s.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("tls_ports", [(), "the port"], ids=["tls_ports-none", "tls_ports-this-port"])
def test_tls_port_tunnel_must_start_with_the_client_hello(sandbox, tls_ports):
    """The attack: CONNECT to an allowed name on an HTTPS port, then a PROXY-protocol line and
    a ClientHello naming a denied host behind it. The SNI check reads only a tunnel's first
    bytes, so with the port outside ``Egress.tls_ports`` (the control, ``tls_ports=()``) the
    prefix and the fronted ClientHello reach the server unchecked (bytes up, the attempt
    "not TLS"); with the port in ``tls_ports`` the tunnel ends before a byte goes up. A
    ClientHello first on the same TLS port is still checked by name (denied.test: the
    unrecognized_name alert, record type 0x15) in both."""
    front = TlsOrigin("first-bytes", ("secure.test", "denied.test"))
    try:
        ports = [front.port] if tls_ports else []
        r = sandbox.run(["python3", "first.py", str(front.port), "PROXY TCP4 192.0.2.1 192.0.2.2 1 2\\n", ""],
                        files={"first.py": FIRST_BYTES.encode()}, resolver=resolver(),
                        egress=egress(front.port, allow=("*.test",), deny=("denied.test",), tls_ports=ports))
        assert r.exit_code == 0, r.err
        (prefixed_head, _), (plain_head, plain_reply) = json.loads(r.out)
        assert prefixed_head == plain_head == "HTTP/1.1 200 Connection established"
        assert plain_reply == "15"  # a TLS alert record: the fronted ClientHello was read and refused
        prefixed, plain = attempts(r)
        assert not plain["allowed"] and "names 'denied.test' (SNI)" in plain["reason"], plain
        assert plain["bytes_up"] == 0
        if tls_ports:
            assert not prefixed["allowed"], prefixed
            assert "must start with a TLS ClientHello (Egress.tls_ports)" in prefixed["reason"], prefixed
            assert prefixed["bytes_up"] == 0, prefixed
        else:
            assert prefixed["allowed"] and "not TLS" in prefixed["reason"], prefixed
            assert prefixed["bytes_up"] > 200, prefixed  # the prefix and the ClientHello went up
    finally:
        front.close()


def test_plain_http_to_a_tls_port_is_refused(sandbox, origin):
    """Plain HTTP (an absolute-URL request, no tunnel) to a port of ``Egress.tls_ports`` is
    refused with the rule's reason before any connection; control: the same request with the
    port outside ``tls_ports`` is served."""
    url = f"http://allowed.test:{origin.port}/hello"
    for ports, want in (([origin.port], (403, "it is a TLS port (Egress.tls_ports)")),
                        ([443], ("OK", "hello from origin"))):
        r = sandbox.run(["python3", "probe.py", url], files={"probe.py": PROBE.encode()}, resolver=resolver(),
                        egress=egress(origin.port, tls_ports=ports))
        assert r.exit_code == 0, r.err
        [(_, status, body)] = json.loads(r.out)
        assert status == want[0] and want[1] in body, (ports, status, body)
        [a] = attempts(r)
        assert a["allowed"] == (want[0] == "OK"), a
        if not a["allowed"]:
            assert a["bytes_up"] == a["bytes_down"] == 0, a


# --- issue 22 item 5: one run's lookups cannot stall another's ------------------------------------

def test_flooding_run_does_not_stall_another(sandbox):
    """Run A floods the shared proxy with 120 CONNECTs to names that never resolve (their
    lookups hang in the resolver threads); run B in the same process then fetches a name that
    resolves and succeeds, while A's lookups still hang (B started after A's program saw its
    refusals; the resolver is released only after B). A's excess requests are refused at once
    with the reason, and so is A's own request for B's name (the control: the same request
    that B gets answered is refused for the run that used up its lookups). Root in a
    subprocess, the test user through runuser: the same driver, tests/helpers/egress_fairness.py."""
    import subprocess

    from lowlevel.net import resolve
    driver = Path(__file__).resolve().parents[1] / "helpers" / "egress_fairness.py"
    root = str(Path(__file__).resolve().parents[2])
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": root, "HOME": sandbox.home}
    argv = [sys.executable, str(driver)]
    if sandbox.user is not None:
        import shutil
        argv = [shutil.which("runuser") or "/usr/sbin/runuser", "-u", sandbox.user.pw_name, "--", *argv]
    proc = subprocess.run(argv, capture_output=True, env=env, cwd="/", timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out = json.loads(proc.stdout)
    assert out["blocked_when_b_started"] == resolve.RESOLVE_PER_RUN  # A's lookups hung while B ran
    assert out["b_stdout"] == "hello from b\n"
    assert [x[:2] for x in out["b_network"]] == [["b.test", True]]
    a = json.loads(out["a_stdout"])
    flood = 120
    assert len(a["refused"]) == out["expect"] == flood - resolve.RESOLVE_PER_RUN - resolve.RESOLVE_QUEUE_PER_RUN
    for line in a["refused"] + [a["probe"]]:
        assert line.startswith("HTTP/1.1 503 ") and "too many name lookups of this run at once" in line, line
    assert "'b.test'" in a["probe"]
    assert a["late"] == flood - len(a["refused"])
    refusals = [x for x in out["a_network"] if "too many name lookups" in x[2]]
    assert len(refusals) == len(a["refused"]) + 1 and not any(x[1] for x in out["a_network"])
