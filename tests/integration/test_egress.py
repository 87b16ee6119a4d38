"""Network egress by allowlist (``Policy(network=Egress(...))``), end to end, as root and unprivileged.

Real servers on host loopback (tests/helpers/origin_servers.py): plain HTTP, HTTPS with a
trustme test CA, a PEP 503 index and an npm registry stub. The allowlisted test names
(``allowed.test``, ``secure.test``, ...) reach them through the TEST-ONLY resolver override
(``lowlevel.egress_proxy.override_resolver_for_tests``, driven by
tests/helpers/scripted_resolver.py), which also marks 127.0.0.1 as "public" for its own
answers only: IP literals and names the system resolver answers (``localhost``, the host
name) are judged as they are. Each refusal is an attack that must fail, next to a control
that works.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from pathlib import Path

import pytest

import lowlevel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from origin_servers import WHEEL_NAME, Origin, TlsOrigin  # noqa: E402

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
        lowlevel.egress.address_kind(__import__("ipaddress").ip_address(i[4][0])) for i in infos) else None


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
        assert r.out.split() == ["ConnectionRefusedError", "ConnectionRefusedError"]
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
    from scripted_resolver import ScriptedResolver

    from lowlevel.egress_proxy import override_resolver_for_tests
    res = ScriptedResolver({name: ["127.0.0.1"] for name in NAMES})
    with override_resolver_for_tests(res, pretend_public=("127.0.0.1",)):
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
    """The relay starts the program the way bwrap's execvp does (a script without "#!" runs with
    /bin/sh), passes its exit status through, and reports an exec failure like a shell (127)."""
    # files= writes 0644: make it executable first, as a program would.
    r = sandbox.run(["sh", "-c", "chmod +x s && ./s 3"], files={"s": b'echo "from sh: $1"; exit "$1"\n'},
                    egress=egress())
    assert (r.exit_code, r.out) == (3, "from sh: 3\n"), r.err
    r = sandbox.run(["sh", "-c", "kill -TERM $$"], egress=egress())
    assert r.exit_code == 128 + 15 and r.term_signal == 15
    r = sandbox.run(["/proc/self/no-such-program"], egress=egress())
    assert r.exit_code == 127 and "lowlevel-relay: execvp /proc/self/no-such-program" in r.err
