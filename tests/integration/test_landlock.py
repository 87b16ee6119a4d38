"""Landlock, the second wall, and the guard's exact exit status: each attack the mount namespace
lets through (a shared host network, a writable bind Landlock does not list, a host directory fd
passed in) fails with Landlock on and works with it off; ordinary work is unaffected.

Every test taking the ``sandbox`` fixture runs as root and as an unprivileged user.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lowlevel
from lowlevel.host import landlock

from helpers.servers import abstract_unix

pytestmark = pytest.mark.bwrap
ABI = landlock.kernel_abi()
needs_landlock = pytest.mark.skipif(ABI < 1, reason="the kernel has no Landlock")
needs_abi4 = pytest.mark.skipif(ABI < 4, reason="TCP rules need Landlock ABI >= 4 (Linux 6.7)")
needs_abi6 = pytest.mark.skipif(ABI < 6, reason="scopes need Landlock ABI >= 6 (Linux 6.12)")
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="in-process root path")


def _own(sandbox, path: str) -> str:
    """Make ``path`` writable by the sandbox's uid: the user identity's own, or (root callers,
    whose sandbox runs as 65534) world-writable. So only Landlock can refuse a write."""
    if sandbox.user:
        os.chown(path, sandbox.user.pw_uid, sandbox.user.pw_gid)
    else:
        os.chmod(path, 0o777 if os.path.isdir(path) else 0o666)
    return path


# --- 1. the shared host network: host abstract unix sockets ------------------------------------

@pytest.fixture
def abstract_server():
    s = abstract_unix()
    yield s
    s.close()


ABSTRACT_CONNECT = ("import socket, sys\n"
                    "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                    "try:\n"
                    "    s.connect('\\0' + sys.argv[1]); print(s.recv(16).decode())\n"
                    "except OSError as e:\n"
                    "    print('errno', e.errno)\n")


@needs_abi6
def test_host_abstract_socket_unreachable_with_shared_network(sandbox, abstract_server):
    # Control: with Landlock off, the shared network namespace reaches the host's socket.
    off = sandbox.run(["python3", "-c", ABSTRACT_CONNECT, abstract_server.name], network=True,
                      policy_kw={"landlock": False})
    assert off.error is None, off.message
    assert off.out.strip() == "pong"
    assert abstract_server.accepted == 1
    # Attack: the same connect under Landlock (LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET).
    on = sandbox.run(["python3", "-c", ABSTRACT_CONNECT, abstract_server.name], network=True)
    assert on.error is None, on.message
    assert on.out.strip() == f"errno {errno.EPERM}"
    assert abstract_server.accepted == 1
    assert on.raw["landlock_abi"] >= 6


@needs_abi6
def test_abstract_sockets_inside_the_sandbox_still_work(sandbox):
    # Scoping stops sockets made outside the domain only: a server and client inside both work.
    code = ("import socket, os\n"
            "srv = socket.socket(socket.AF_UNIX); srv.bind('\\0inside'); srv.listen(1)\n"
            "if os.fork() == 0:\n"
            "    c = socket.socket(socket.AF_UNIX); c.connect('\\0inside'); c.sendall(b'hi'); os._exit(0)\n"
            "conn, _ = srv.accept(); print(conn.recv(2).decode()); os.wait()\n")
    r = sandbox.run(["python3", "-c", code])
    assert r.exit_code == 0, r.err
    assert r.out.strip() == "hi"


# --- 2. a writable bind outside the allowed set --------------------------------------------------

WRITE_PROBE = ("for p in /opt/unlisted/new /opt/unlisted/existing; do "
               "  (echo attack > $p) 2>/dev/null && echo wrote $p; done; "
               "mkdir /opt/unlisted/dir 2>/dev/null && echo made dir; "
               "rm -f /opt/unlisted/existing 2>/dev/null; "
               "cat /opt/unlisted/existing 2>/dev/null; true")


@needs_landlock
def test_writable_bind_left_out_of_landlock_cannot_be_touched(sandbox):
    host = Path(_own(sandbox, sandbox.workspace()))
    existing = host / "existing"
    existing.write_text("SECRET-CONTENT\n")
    _own(sandbox, str(existing))
    bind = [(str(host), "/opt/unlisted", True)]
    # Attack: the mount is writable (the first wall is wrong), Landlock does not list it.
    on = sandbox.run(["sh", "-c", WRITE_PROBE], binds=bind, policy_kw={"landlock_omit": ["/opt/unlisted"]})
    assert on.error is None, on.message
    assert on.out == ""  # nothing written, no dir made, nothing read
    assert sorted(os.listdir(host)) == ["existing"]
    assert existing.read_text() == "SECRET-CONTENT\n"
    # Control: the same bind, listed as writable, is written (and the file replaced).
    off = sandbox.run(["sh", "-c", WRITE_PROBE], binds=bind)
    assert "wrote /opt/unlisted/new" in off.out
    assert "made dir" in off.out
    assert (host / "new").read_text() == "attack\n"


# --- 3. a host directory fd smuggled in ----------------------------------------------------------

FD_PROBE = ("import os\n"
            "for what, op in [('create', lambda: os.open('smuggled', os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=20)),\n"
            "                 ('mkdir', lambda: os.mkdir('smuggled-dir', dir_fd=20)),\n"
            "                 ('magic-link', lambda: open('/proc/self/fd/20/via-proc', 'w')),\n"
            "                 ('read', lambda: open('/proc/self/fd/20/existing').read()),\n"
            "                 ('list', lambda: os.listdir('/proc/self/fd/20'))]:\n"
            "    try:\n"
            "        op(); print(what, 'ok')\n"
            "    except OSError as e:\n"
            "        print(what, 'errno', e.errno)\n")


@needs_landlock
def test_smuggled_host_directory_fd_cannot_create_files(sandbox):
    host = Path(_own(sandbox, sandbox.workspace()))
    (host / "existing").write_text("SECRET\n")
    _own(sandbox, str(host / "existing"))
    # Attack: the fd reaches a host directory outside every mount of the sandbox.
    on = sandbox.run(["python3", "-c", FD_PROBE], extra_dirs={20: str(host)})
    assert on.error is None, on.message
    lines = dict(line.split(" ", 1) for line in on.out.splitlines())
    assert lines == {"create": f"errno {errno.EACCES}", "mkdir": f"errno {errno.EACCES}",
                     "magic-link": f"errno {errno.EACCES}", "read": f"errno {errno.EACCES}",
                     "list": f"errno {errno.EACCES}"}, on.out
    assert sorted(os.listdir(host)) == ["existing"]
    # (The fd itself keeps what it was opened with: getdents on it still lists the directory.)
    # Control: without Landlock the fd is a way out of the mount namespace.
    off = sandbox.run(["python3", "-c", FD_PROBE], extra_dirs={20: str(host)}, policy_kw={"landlock": False})
    assert "create ok" in off.out and "mkdir ok" in off.out and "read ok" in off.out, off.out
    assert {"smuggled", "smuggled-dir", "via-proc"} <= set(os.listdir(host))


# --- 4. TCP and signals --------------------------------------------------------------------------

BIND = ("import socket\n"
        "s = socket.socket()\n"
        "try:\n"
        "    s.bind(('127.0.0.1', 0)); s.listen(1); print('bound')\n"
        "except OSError as e:\n"
        "    print('errno', e.errno)\n")
CONNECT = ("import socket, sys\n"
           "try:\n"
           "    print(socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5).recv(16).decode())\n"
           "except OSError as e:\n"
           "    print('errno', e.errno)\n")


@needs_abi4
def test_tcp_bind_denied_connect_only_with_network(sandbox, server):
    on = sandbox.run(["python3", "-c", BIND])
    assert on.out.strip() == f"errno {errno.EACCES}"
    off = sandbox.run(["python3", "-c", BIND], policy_kw={"landlock": False})
    assert off.out.strip() == "bound"
    # network=True: connect works (what the network is for), listening on the host's does not.
    net = sandbox.run(["python3", "-c", CONNECT, str(server.port)], network=True)
    assert net.out.strip() == "pong", net.err
    net_bind = sandbox.run(["python3", "-c", BIND], network=True)
    assert net_bind.out.strip() == f"errno {errno.EACCES}"


EGRESS_PORTS = ("import socket\n"
                "for port in (3128, 1):\n"
                "    s = socket.socket()\n"
                "    try:\n"
                "        s.connect(('127.0.0.1', port)); print(port, 'connected')\n"
                "    except OSError as e:\n"
                "        print(port, 'errno', e.errno)\n")


@needs_abi4
def test_egress_mode_connects_to_the_proxy_port_only(sandbox):
    # Egress: the relay (outside the ruleset) listens on 127.0.0.1:3128; the program may connect
    # there and nowhere else (Landlock refuses before the kernel even looks for a listener).
    on = sandbox.run(["python3", "-c", EGRESS_PORTS], egress={"allow": ["example.invalid"]})
    assert on.error is None, on.message
    assert on.out.split("\n")[:2] == ["3128 connected", f"1 errno {errno.EACCES}"], on.out
    off = sandbox.run(["python3", "-c", EGRESS_PORTS], egress={"allow": ["example.invalid"]},
                      policy_kw={"landlock": False})
    assert off.out.split("\n")[:2] == ["3128 connected", f"1 errno {errno.ECONNREFUSED}"], off.out


@needs_abi6
def test_program_cannot_signal_its_guard(sandbox):
    # The guard is outside the program's domain (LANDLOCK_SCOPE_SIGNAL): its report survives.
    r = sandbox.run(["sh", "-c", "kill -KILL $PPID; kill -STOP $PPID; echo $?; exit 3"])
    assert r.error is None, r.message
    assert r.out.strip() == "1"
    assert (r.exit_code, r.term_signal, r.killed_by) == (3, None, None)
    assert "Operation not permitted" in r.err


@needs_abi6
def test_pid1_is_out_of_reach(sandbox):
    # PID 1 runs as the program's uid: the guard in a plain run (not dumpable), bwrap's reaper
    # behind the egress relay (dumpable). Landlock (PID 1 is outside the program's domain) keeps
    # the program from signalling it or reading its /proc entries (ptrace access mode).
    probe = ("cat /proc/1/environ > /dev/null 2>&1 && echo environ; readlink /proc/1/fd/0 > /dev/null 2>&1 && echo fds; "
             "kill -0 1 2>/dev/null && echo signal; true")
    for kw, without in (({}, ["signal"]), ({"egress": {"allow": ["example.invalid"]}}, ["environ", "fds", "signal"])):
        on = sandbox.run(["sh", "-c", probe], **kw)
        assert on.error is None and on.out == "", (kw, on.out, on.message)
        off = sandbox.run(["sh", "-c", probe], policy_kw={"landlock": False}, **kw)
        assert off.out.split() == without, (kw, off.out)


def test_guard_is_pid1_and_survives_the_program_without_landlock(sandbox):
    # In a plain run the guard is the sandbox's PID 1 (bwrap --as-pid-1): even without Landlock
    # the kernel drops the program's signals to it, so the report always comes; and it reaps
    # the orphans the program leaves (no zombie piles up during the run).
    script = ("echo ppid=$PPID; kill -KILL $PPID; kill -TERM -1; "
              "(sleep 0.1 &); sleep 0.5; ps -o stat= | grep -c Z; exit 7")
    r = sandbox.run(["sh", "-c", script], policy_kw={"landlock": False})
    assert r.error is None, r.message
    assert (r.exit_code, r.term_signal, r.killed_by) == (7, None, None), r
    assert r.out.split() == ["ppid=1", "0"], r.out
    assert not any("guard" in n for n in r.notes), r.notes


# --- 5. exit status by fact (issue 10, section 5) ------------------------------------------------

@pytest.mark.parametrize("script, expected", [
    ("exit 152", (152, None, None)),
    ("exit 137", (137, None, None)),
    ("kill -KILL $$", (137, 9, "signal")),
    ("kill -TERM $$", (143, 15, "signal")),
], ids=["exit-152", "exit-137", "sigkill", "sigterm"])
def test_exit_code_and_signal_are_facts(sandbox, script, expected):
    r = sandbox.run(["sh", "-c", script])
    assert r.error is None, r.message
    assert (r.exit_code, r.term_signal, r.killed_by) == expected


def test_real_sigxcpu_reports_cpu(sandbox):
    r = sandbox.run(["sh", "-c", "while :; do :; done"], limits={"cpu_s": 1}, timeout=30)
    assert r.error is None, r.message
    assert (r.exit_code, r.term_signal, r.killed_by) == (152, 24, "cpu")


@ROOT_ONLY
def test_exit_152_in_arun_session_and_pool():
    from lowlevel.sandbox.aio import arun
    r = asyncio.run(arun(["sh", "-c", "exit 152"]))
    assert (r.exit_code, r.term_signal, r.killed_by) == (152, None, None)
    with lowlevel.Session() as s:
        r = s.run(["sh", "-c", "exit 152"])
        assert (r.exit_code, r.term_signal, r.killed_by) == (152, None, None)
    with lowlevel.Pool(size=1) as pool:
        r = pool.run(["sh", "-c", "exit 152"])
        assert (r.exit_code, r.term_signal, r.killed_by) == (152, None, None)


@pytest.mark.parametrize("command, code", [(["/proc/no-such-program"], errno.ENOENT), (["/dev/null"], errno.EACCES)],
                         ids=["enoent", "eacces"])
def test_exec_failure_in_the_guard_is_exec_error(sandbox, command, code):
    # /proc and /dev are opaque to the launcher's precheck: the guard's execvp decides.
    r = sandbox.run(command)
    assert r.error == "ExecError", r
    assert r.errno == code


# --- 6. every entry point is under it ------------------------------------------------------------

@needs_landlock
def test_result_reports_the_abi(sandbox):
    on = sandbox.run(["true"])
    assert on.raw["landlock_abi"] == ABI
    assert "landlock" in on.limits_enforced
    off = sandbox.run(["true"], policy_kw={"landlock": False})
    assert off.raw["landlock_abi"] == 0
    assert "landlock" not in off.limits_enforced
    req = sandbox.run(["true"], policy_kw={"landlock": "require"})
    assert req.exit_code == 0 and req.raw["landlock_abi"] == ABI


@needs_landlock
@ROOT_ONLY
def test_session_and_pool_commands_are_under_landlock(tmp_path):
    host = tempfile_dir()
    policy = lowlevel.Policy(binds=(lowlevel.Bind(host, "/opt/unlisted", writable=True),),
                             landlock_omit=("/opt/unlisted",))
    with lowlevel.Session(policy) as s:
        for _ in range(2):  # every command, not only the first
            r = s.run(["sh", "-c", "echo x > /opt/unlisted/f || exit 9; echo y > /workspace/ok"])
            assert r.exit_code == 9 and "Permission denied" in r.stderr.decode()
            assert r.landlock_abi == ABI and "landlock" in r.limits_enforced
        assert os.listdir(host) == []
        if s._core.run.cow:
            # reset() stacks a fresh overlay on /workspace; Landlock ignores rules on a covered
            # mount point, so the init rebuilds the commands' ruleset: still writable, still walled.
            s.reset()
            r = s.run(["sh", "-c", "echo y > /workspace/after-reset && cat /workspace/after-reset; "
                                   "echo x > /opt/unlisted/f"])
            assert r.stdout == b"y\n" and "Permission denied" in r.stderr.decode(), r
        # Commands share the init's domain (scopes): one can still signal another.
        bg = s.start(["sleep", "30"])
        while bg.pid is None:
            bg.poll()
        assert s.run(["kill", "-TERM", str(bg.pid)]).exit_code == 0
        assert bg.wait(10).term_signal == 15
    with lowlevel.Pool(policy, size=1) as pool:
        r = pool.run(["sh", "-c", "echo x > /opt/unlisted/f"])
        assert r.exit_code != 0 and r.landlock_abi == ABI
    assert os.listdir(host) == []


def tempfile_dir() -> str:
    import tempfile
    path = tempfile.mkdtemp(prefix="ll-", dir="/tmp")
    os.chmod(path, 0o777)
    return path


@needs_landlock
@ROOT_ONLY
def test_cli_landlock_flag():
    import json
    on = subprocess.run([sys.executable, "-m", "lowlevel", "run", "--json", "--", "true"], capture_output=True)
    off = subprocess.run([sys.executable, "-m", "lowlevel", "run", "--json", "--landlock", "off", "--", "true"],
                         capture_output=True)
    assert json.loads(on.stdout)["landlock_abi"] == ABI
    assert json.loads(off.stdout)["landlock_abi"] == 0


@needs_landlock
@ROOT_ONLY
def test_stdout_given_as_a_host_file_can_be_reopened(tmp_path):
    # stdio_fds hands the program a host file as its stdout: reopening it through /dev/stdout (a
    # magic link to a file outside every rule) still works, thanks to the rule the guard adds
    # for the standard streams (a rule for that one inode, with the fd's own access mode).
    os.chmod(tmp_path, 0o755)
    out = tmp_path / "out.txt"
    out.touch()
    out.chmod(0o666)  # the sandbox's uid reopens it
    with open(out, "wb") as f:
        r = lowlevel.run(["sh", "-c", "echo hi > /dev/stdout"], capture=False, stdio_fds=(None, f.fileno(), None), workspace=tempfile_dir())
    assert r.exit_code == 0
    assert out.read_text() == "hi\n"


@needs_landlock
def test_program_may_stack_its_own_ruleset(sandbox):
    # The seccomp profile allows the landlock_* calls: a program sandboxes itself further.
    code = ("import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "attr = (ctypes.c_uint64 * 3)(1 << 1, 0, 0)  # handle WRITE_FILE, grant nothing\n"
            "fd = libc.syscall(444, attr, 8, 0)\n"
            "assert fd >= 0, ctypes.get_errno()\n"
            "assert libc.prctl(38, 1, 0, 0, 0) == 0\n"
            "assert libc.syscall(446, fd, 0) == 0, ctypes.get_errno()\n"
            "try:\n"
            "    open('/workspace/f', 'w'); print('wrote')\n"
            "except PermissionError:\n"
            "    print('denied by my own ruleset')\n")
    r = sandbox.run(["python3", "-c", code])
    assert r.exit_code == 0, r.err
    assert r.out.strip() == "denied by my own ruleset"


# --- 7. ordinary work ------------------------------------------------------------------------------

WORK = r"""
set -e
cd /workspace
python3 -c 'import json, sqlite3, ssl, tempfile; open("py.txt", "w").write("py")'
node -e 'require("fs").writeFileSync("node.txt", "node")'
printf '#include <stdio.h>\nint main(void){puts("c");return 0;}\n' > m.c
gcc -o m m.c
./m > c.txt
git init -q repo
cd repo
git config user.email t@e
git config user.name t
echo a > a
git add a
git commit -qm one
git mv a b
git commit -qm two
cd ..
mkdir -p d1/sub d2
echo m > d1/f
mv d1/f d2/f
mv d1/sub d2/sub
ln d2/f d1/hard
ln -s d2/f sym
echo tmp > /tmp/t
mv /tmp/t /workspace/from-tmp
echo shm > /dev/shm/s
cat /dev/shm/s > /dev/null
mkfifo fifo
rm fifo
python3 - <<'PY'
import zipfile
files = {"llpkg/__init__.py": "X = 42\n",
         "llpkg-1.dist-info/METADATA": "Metadata-Version: 2.1\nName: llpkg\nVersion: 1\n",
         "llpkg-1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
files["llpkg-1.dist-info/RECORD"] = "".join(f"{n},,\n" for n in files) + "llpkg-1.dist-info/RECORD,,\n"
with zipfile.ZipFile("llpkg-1-py3-none-any.whl", "w") as z:
    for name, text in files.items():
        z.writestr(name, text)
PY
python3 -m venv venv
venv/bin/pip install -q --no-index ./llpkg-1-py3-none-any.whl
venv/bin/python -c 'import llpkg; print("pip", llpkg.X)'
echo done
"""


@pytest.mark.slow
@needs_landlock
def test_ordinary_work_is_unaffected(sandbox):
    r = sandbox.run(["bash", "-c", WORK], timeout=240, limits={"cpu_s": 200})
    assert r.error is None, r.message
    assert r.exit_code == 0, (r.out, r.err)
    assert r.out.splitlines()[-2:] == ["pip 42", "done"]
    ws = Path(r.workspace)
    assert (ws / "py.txt").read_text() == "py" and (ws / "node.txt").read_text() == "node"
    assert (ws / "c.txt").read_text() == "c\n"
    assert r.raw["landlock_abi"] == ABI


@pytest.mark.slow
@needs_landlock
@ROOT_ONLY
@pytest.mark.parametrize("abi", [1, 2, 3, 5])
def test_older_abis_keep_ordinary_work(monkeypatch, abi):
    # Best effort down to ABI 1: with ABI 1 a rename across directories fails with EXDEV, which
    # mv and git answer with a copy or a same-directory rename.
    monkeypatch.setattr(landlock, "_ABI_MAX", abi)
    script = WORK.split("python3 - <<'PY'")[0].replace("node -e", "true || node -e") + "echo done\n"
    if abi == 1:  # no LANDLOCK_ACCESS_FS_REFER: a hard link across directories fails (EXDEV)
        script = script.replace("ln d2/f d1/hard", "! ln d2/f d1/hard 2>/dev/null")
    r = lowlevel.run(["bash", "-c", script], timeout=120)
    assert r.exit_code == 0, r.stderr.decode()
    assert r.landlock_abi == abi
    host = tempfile_dir()
    policy = lowlevel.Policy(binds=(lowlevel.Bind(host, "/opt/unlisted", writable=True),),
                             landlock_omit=("/opt/unlisted",))
    denied = lowlevel.run(["sh", "-c", "echo x > /opt/unlisted/f"], policy=policy, timeout=30)
    assert denied.exit_code != 0 and denied.landlock_abi == abi
    assert os.listdir(host) == []
