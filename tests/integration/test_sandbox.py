"""The main job's security cases, each an attack that must fail plus a control that works.

Every test taking the ``sandbox`` fixture runs as root and as an unprivileged user.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers.hygiene import open_fds

import lowlevel
from lowlevel.workspace import list_files, read_file

pytestmark = pytest.mark.bwrap
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _ws() -> str:
    """A fresh workspace the sandbox's uid can reach (pytest's tmp_path is under a 0700 dir)."""
    import tempfile
    path = tempfile.mkdtemp(prefix="ws-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


@pytest.fixture
def planted_key(sandbox):
    """A fake private key planted in the caller's real ~/.ssh (removed afterwards)."""
    ssh = Path(sandbox.home) / ".ssh"
    created_dir = not ssh.exists()
    ssh.mkdir(mode=0o700, exist_ok=True)
    key = ssh / "id_rsa"
    if key.exists():
        key = ssh / "id_lowlevel_test"
    marker = f"FAKE-PRIVATE-KEY-{os.getpid()}-{time.time_ns()}"
    key.write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{marker}\n-----END OPENSSH PRIVATE KEY-----\n")
    key.chmod(0o600)
    if sandbox.user:
        os.chown(ssh, sandbox.user.pw_uid, sandbox.user.pw_gid)
        os.chown(key, sandbox.user.pw_uid, sandbox.user.pw_gid)
    yield key, marker
    key.unlink()
    if created_dir:
        ssh.rmdir()


def test_host_ssh_key_not_readable(sandbox, planted_key):
    key, marker = planted_key
    # Control: the key is readable on the host by its owner.
    assert marker in key.read_text()
    r = sandbox.run(["sh", "-c", f"cat {key}; cat ~/.ssh/{key.name}; ls -a {key.parent}; "
                     "grep -rs " + marker + " /home /root /etc /tmp /workspace; echo done"])
    assert r.exit_code == 0, r.err
    assert marker not in r.out
    assert "No such file or directory" in r.err
    assert r.out.strip().endswith("done")


def test_system_is_read_only_and_workspace_is_written_on_host(sandbox):
    r = sandbox.run(["sh", "-c", "touch /usr/bin/x; echo usr=$?; touch /etc/x; echo etc=$?; touch /x; echo root=$?; "
                     "echo hello > /workspace/out.txt; echo ws=$?"])
    assert r.exit_code == 0, r.err
    assert "usr=1" in r.out and "etc=1" in r.out and "root=1" in r.out and "ws=0" in r.out
    assert "Read-only file system" in r.err
    assert Path(r.workspace, "out.txt").read_text() == "hello\n"
    assert not Path("/usr/bin/x").exists()
    assert r.changes["added"] == ["out.txt"]


CONNECT = """
import socket, sys
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3)
    print("got", s.recv(4).decode())
except OSError as err:
    print("blocked", type(err).__name__, err.errno)
try:
    socket.getaddrinfo("example.com", 443)
    print("dns ok")
except OSError as err:
    print("dns blocked", err)
"""


def test_no_network_by_default(sandbox, server):
    # Control: the server answers on the host.
    with socket.create_connection(("127.0.0.1", server.port), timeout=3) as s:
        assert s.recv(4) == b"pong"
    before = server.accepted
    r = sandbox.run(["python3", "-c", CONNECT, str(server.port)])
    assert r.exit_code == 0, r.err
    assert "blocked" in r.out.splitlines()[0]
    assert "dns blocked" in r.out
    assert server.accepted == before


def test_network_opt_in_reaches_host_loopback(sandbox, server):
    r = sandbox.run(["python3", "-c", CONNECT, str(server.port)], network=True)
    assert r.exit_code == 0, r.err
    assert r.out.splitlines()[0] == "got pong"


def test_host_environment_secret_absent(sandbox, monkeypatch):
    secret = f"ghp_FAKE{time.time_ns()}"
    monkeypatch.setenv("LOWLEVEL_FAKE_TOKEN", secret)
    r = sandbox.run(["sh", "-c", "env; cat /proc/1/environ | tr '\\0' '\\n'; cat /proc/self/environ"])
    assert r.exit_code == 0, r.err
    assert secret not in r.out and "LOWLEVEL_FAKE_TOKEN" not in r.out
    names = {line.split("=", 1)[0] for line in r.out.splitlines() if "=" in line}
    assert names <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "PWD", "SHLVL", "_"}


def test_user_env_is_set(sandbox):
    r = sandbox.run(["sh", "-c", "echo $GREETING $HOME $LANG"], env={"GREETING": "hi"})
    assert r.out.strip() == "hi /workspace C.UTF-8"


@pytest.mark.parametrize("script,code,sig", [("exit 0", 0, None), ("exit 3", 3, None), ("kill -9 $$", 137, 9)])
def test_exit_status_propagates(sandbox, script, code, sig):
    r = sandbox.run(["sh", "-c", script])
    assert r.exit_code == code
    assert r.term_signal == sig
    assert r.killed_by == ("signal" if sig else None)


def test_timeout_kills_sandbox_and_setsid_daemon(sandbox):
    script = ("setsid sh -c 'while :; do date +%s%N >> /workspace/beat; sleep 0.05; done' "
              "</dev/null >/dev/null 2>&1 & sleep 1000")
    t0 = time.monotonic()
    r = sandbox.run(["sh", "-c", script], timeout=1)
    elapsed = time.monotonic() - t0
    assert r.timed_out and r.killed_by == "timeout"
    assert elapsed < 3 + (2 if sandbox.user else 0)  # runuser + interpreter start for the user identity
    beat = Path(r.workspace, "beat")
    assert beat.exists(), "the daemon never ran: the test would prove nothing"
    size = beat.stat().st_size
    time.sleep(0.5)
    assert beat.stat().st_size == size, "the setsid daemon survived the timeout"


def test_daemon_dies_when_program_exits(sandbox):
    script = ("setsid sh -c 'while :; do echo x >> /workspace/beat; sleep 0.05; done' "
              "</dev/null >/dev/null 2>&1 & sleep 0.3; exit 0")
    r = sandbox.run(["sh", "-c", script])
    assert r.exit_code == 0
    size = Path(r.workspace, "beat").stat().st_size
    assert size > 0
    time.sleep(0.4)
    assert Path(r.workspace, "beat").stat().st_size == size


def test_python_example(sandbox):
    files = {"wordfreq.py": (EXAMPLES / "wordfreq.py").read_bytes(),
             "corpus.txt": (EXAMPLES / "corpus.txt").read_bytes()}
    r = sandbox.run(["python3", "wordfreq.py", "corpus.txt", "5"], files=files)
    assert r.exit_code == 0, r.err
    import json
    out = json.loads(Path(r.workspace, "wordfreq.json").read_text())
    assert out["top"][0] == ["the", 8]
    assert "ALLOWED" not in r.out
    assert r.out.count("blocked") == 5


@pytest.mark.skipif(not os.path.exists("/usr/bin/node"), reason="node is not installed (apt-get install nodejs)")
def test_node_example(sandbox):
    files = {"summarize.js": (EXAMPLES / "summarize.js").read_bytes(),
             "data.csv": (EXAMPLES / "data.csv").read_bytes()}
    r = sandbox.run(["node", "summarize.js", "data.csv"], files=files)
    assert r.exit_code == 0, r.err
    import json
    out = json.loads(Path(r.workspace, "summary.json").read_text())
    assert out["bytes"]["sum"] == 7680
    assert "ALLOWED" not in r.out
    assert r.out.count("blocked") == 3


def test_result_collection_does_not_follow_planted_symlink(sandbox, planted_key):
    key, marker = planted_key
    r = sandbox.run(["sh", "-c", f"ln -s {key} leak; ln -s / rootlink; mkdir d; ln -s {key.parent} d/sshdir; "
                     "echo ok > real.txt"])
    assert r.exit_code == 0, r.err
    ws = r.workspace
    kinds = {e.path: e.kind for e in list_files(ws)}
    assert kinds["leak"] == "symlink" and kinds["rootlink"] == "symlink" and kinds["d/sshdir"] == "symlink"
    assert not any(p.startswith("rootlink/") for p in kinds)
    for rel in ("leak", "rootlink/etc/passwd", f"d/sshdir/{key.name}"):
        with pytest.raises(lowlevel.WorkspaceError):
            read_file(ws, rel)
    assert read_file(ws, "real.txt") == b"ok\n"


def test_stdin_and_output_capture(sandbox):
    data = os.urandom(300_000)
    r = sandbox.run(["sh", "-c", "cat; echo to-stderr >&2"], stdin=data)
    assert r.stdout == data
    assert r.err == "to-stderr\n"


def test_missing_command_is_exec_error(sandbox):
    r = sandbox.run(["definitely-not-a-command"])
    assert r.error == "ExecError" and r.errno == 2
    r = sandbox.run(["/workspace/nope.sh"])
    assert r.error == "ExecError"


# --- root only: the sandbox must not be host root --------------------------------------------


@pytest.mark.root
def test_root_caller_sandbox_is_not_host_root():
    ws = tempfile.mkdtemp(prefix="lowlevel-notroot-")
    os.chmod(ws, 0o755)
    out: list[lowlevel.Result] = []
    t = threading.Thread(target=lambda: out.append(lowlevel.run(
        ["sh", "-c", "touch mine; echo x > /proc/sys/kernel/core_pattern && echo WROTE-SYSCTL; "
         "echo 1 > /proc/sys/vm/drop_caches && echo WROTE-SYSCTL; sleep 5"], workspace=ws, timeout=3)))
    t.start()
    owner = None
    for _ in range(200):
        if os.path.exists(Path(ws, "mine")):
            owner = os.stat(Path(ws, "mine")).st_uid
            break
        time.sleep(0.01)
    t.join()
    r = out[0]
    assert "WROTE-SYSCTL" not in r.stdout.decode()
    assert r.stderr.decode().count("Permission denied") == 2
    # The run writes into its copy-on-write upper layer (not the directory) as a per-run host
    # uid from lowlevel's range; the commit after the run gives new files the workspace's owner.
    assert owner is None
    from lowlevel.workspace.uids import uid_range
    first, count = uid_range()
    assert r.argv[0].endswith("_lowlevel_exec")
    uid_arg = next(a for a in r.argv if a.startswith("--uid="))
    assert first <= int(uid_arg.split("=")[1]) < first + count
    assert os.stat(Path(ws, "mine")).st_uid == 0
    shutil.rmtree(ws)
    # Control: host root can open the sysctl for writing (we open it, never write it).
    with open("/proc/sys/kernel/core_pattern", "r+"):
        pass


@pytest.mark.root
def test_proc_1_environ_has_no_caller_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWLEVEL_FAKE_TOKEN", "sekrit-123")
    r = lowlevel.run(["sh", "-c", "for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ; done"],
                     workspace=_ws())
    assert b"sekrit-123" not in r.stdout


def test_inherited_fd_not_open_inside():
    """A caller whose own parent left an inheritable directory fd 5 open must not leak it."""
    code = (
        "import os, lowlevel, tempfile\n"
        "assert os.get_inheritable(5)\n"
        "ws = tempfile.mkdtemp(dir='/tmp'); os.chmod(ws, 0o755)\n"
        "r = lowlevel.run(['sh', '-c', 'ls /proc/self/fd; ls -l /proc/self/fd/5 && echo OPEN'], workspace=ws)\n"
        "print(r.stdout.decode())\n"
    )
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Control: the child really holds fd 5, a directory fd that would be a way out.
        ctl = subprocess.run([sys.executable, "-c", "import os; print(os.readlink('/proc/self/fd/5'))"],
                             close_fds=False, preexec_fn=lambda: os.dup2(fd, 5),
                             capture_output=True, text=True)
        assert ctl.stdout.strip() == "/"
        p = subprocess.run([sys.executable, "-c", code], close_fds=False, preexec_fn=lambda: os.dup2(fd, 5),
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert "OPEN" not in p.stdout
        assert sorted(int(x) for x in p.stdout.split() if x.isdigit()) == [0, 1, 2, 3]
    finally:
        os.close(fd)


def test_no_fd_leak_after_runs(tmp_path):
    # The guard executable's fd, opened once per process and kept for every later run (bwrap
    # execs it through /proc/self/fd/N), is no leak: open_fds() leaves it out (helpers/hygiene.py).
    before = sorted(open_fds())
    for _ in range(20):
        lowlevel.run(["true"], workspace=_ws())
    with pytest.raises(lowlevel.ExecError):
        lowlevel.run(["nope-nope"], workspace=_ws())
    assert sorted(open_fds()) == before


def test_cli_runs_example_and_exit_codes(tmp_path):
    exe = [sys.executable, "-m", "lowlevel"]
    p = subprocess.run([*exe, "run", "--input", str(EXAMPLES / "wordfreq.py"), "--input", str(EXAMPLES / "corpus.txt"),
                        "--", "python3", "wordfreq.py", "corpus.txt"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    ws = p.stderr.split("lowlevel: workspace ")[1].split()[0]
    assert Path(ws, "wordfreq.json").exists()
    assert subprocess.run([*exe, "run", "--", "sh", "-c", "exit 5"], capture_output=True).returncode == 5
    assert subprocess.run([*exe, "run", "--timeout", "0.5", "--", "sleep", "10"], capture_output=True).returncode == 124
    p = subprocess.run([*exe, "run", "--", "no-such-cmd"], capture_output=True, text=True)
    assert p.returncode == 127 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    p = subprocess.run([*exe, "run", "--workspace", str(tmp_path / "missing"), "--", "true"], capture_output=True,
                       text=True)
    assert p.returncode == 125 and "does not exist" in p.stderr and "Traceback" not in p.stderr
    if os.geteuid() == 0:
        # tmp_path sits under a 0700 dir the sandbox's uid cannot traverse: the sandbox reaches the
        # workspace through the overlay the anchor mounts, never through the host path.
        assert stat.S_IMODE(os.stat(tmp_path.parent.parent).st_mode) & 0o001 == 0
        p = subprocess.run([*exe, "run", "--workspace", str(tmp_path), "--", "sh", "-c", "echo hi > from-sandbox"],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        assert (tmp_path / "from-sandbox").read_text() == "hi\n"
    p = subprocess.run([*exe, "run", "--workspace", str(tmp_path / "missing"), "--", "true"], capture_output=True,
                       text=True)
    assert p.returncode == 125 and "does not exist" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([*exe, "run", "--json", "--", "sh", "-c", "printf 'a\\377b'"], capture_output=True, text=True)
    import json
    assert json.loads(p.stdout)["stdout"] == "a\ufffdb"


@pytest.mark.root
def test_seccomp_audit_mode_reports_denials():
    """Log mode lets the calls through and the Result names what the default profile would deny."""
    probe = "import ctypes; l = ctypes.CDLL(None); print(l.syscall(101, 0, 0, 0, 0))"  # ptrace(PTRACE_TRACEME)
    audited = lowlevel.run(["python3", "-c", probe],
                           policy=lowlevel.Policy(seccomp=lowlevel.DEFAULT_PROFILE.with_log()))
    assert audited.stdout == b"0\n"
    assert audited.seccomp_denials is not None and "ptrace" in audited.seccomp_denials
    enforced = lowlevel.run(["python3", "-c", probe])
    assert enforced.stdout == b"-1\n" and enforced.seccomp_denials is None


SETID_PROBE = """
import os, stat, sys
results = []
open("f", "w").close()
for label, fn in [
    ("chmod-suid", lambda: os.chmod("f", 0o4755)),
    ("chmod-sgid", lambda: os.chmod("f", 0o2755)),
    ("fchmod-suid", lambda: os.fchmod(os.open("f", os.O_RDONLY), 0o4755)),
    ("open-creat-suid", lambda: os.open("g", os.O_CREAT | os.O_WRONLY, 0o4755)),
    ("mknod-suid", lambda: os.mknod("h", stat.S_IFREG | 0o4755)),
    ("chmod-plain", lambda: os.chmod("f", 0o755)),
]:
    try:
        fn()
        results.append(label + "=ok")
    except PermissionError:
        results.append(label + "=EPERM")
modes = [oct(os.stat(p).st_mode & 0o7777) for p in ("f",)]
print(" ".join(results), *modes)
"""


def test_setuid_files_cannot_be_made(sandbox, tmp_path):
    # Control: outside the sandbox the same probe makes setuid files.
    ctl = subprocess.run([sys.executable, "-c", SETID_PROBE], cwd=tmp_path, capture_output=True, text=True)
    assert "chmod-suid=ok" in ctl.stdout and "open-creat-suid=ok" in ctl.stdout
    r = sandbox.run(["python3", "-c", SETID_PROBE])
    assert r.exit_code == 0, r.err
    for label in ("chmod-suid", "chmod-sgid", "fchmod-suid", "open-creat-suid", "mknod-suid"):
        assert f"{label}=EPERM" in r.out
    assert "chmod-plain=ok" in r.out and r.out.split()[-1] == "0o755"
    assert not any(os.stat(p).st_mode & (0o4000 | 0o2000) for p in Path(r.workspace).iterdir())


def test_dev_is_read_only_but_devices_and_shm_work(sandbox):
    r = sandbox.run(["sh", "-c", "echo x > /dev/fill; echo dev=$?; echo x > /dev/null; echo null=$?; "
                     "echo x > /dev/shm/s; echo shm=$?; head -c 4 /dev/urandom | wc -c"])
    assert "dev=2" in r.out and "null=0" in r.out and "shm=0" in r.out and r.out.split()[-1] == "4"


@pytest.mark.parametrize("prog,code", [("/etc/passwd", 126), ("/usr", 126), ("/tmp/nope", 127),
                                        ("nope-not-here", 127)])
def test_cli_exec_failures_exit_126_127_without_json(prog, code):
    p = subprocess.run([sys.executable, "-m", "lowlevel", "run", "--", prog], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == code, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def test_not_found_hint_blames_only_a_dangling_symlink(sandbox):
    """A missing command reached through ``/bin -> usr/bin`` (PATH's last entry) is "command not
    found", not "the symlink /bin -> usr/bin points outside"; a link whose own target is missing
    (a virtualenv's python linked to an interpreter the sandbox lacks) is named."""
    r = sandbox.run(["lowlevel-no-such-cmd"])
    assert (r.error, r.errno) == ("ExecError", 2), r.message
    assert "command not found in the sandbox" in r.message and "symlink" not in r.message
    ws = sandbox.workspace()
    os.symlink("/opt/lowlevel-test-nowhere/bin/python3", ws / "python")
    r = sandbox.run(["./python", "-V"], workspace=str(ws))
    assert (r.error, r.errno) == ("ExecError", 2), r.message
    assert "the symlink /workspace/python -> /opt/lowlevel-test-nowhere/bin/python3 points outside" in r.message


@pytest.mark.skipif(os.geteuid() != 0, reason="root callers only: their sandbox runs as a per-run uid")
def test_bind_source_the_sandbox_uid_cannot_reach_says_what_to_do(tmp_path):
    """A root caller binds a directory below a 0700 parent: bwrap, already the per-run uid,
    cannot open it. The error says why and what to do (not only bwrap's "Can't find source path")."""
    private = Path(tempfile.mkdtemp(prefix="bindsrc-", dir="/tmp"))  # 0700, owned by root
    try:
        (private / "data").mkdir()
        policy = lowlevel.Policy(binds=(lowlevel.Bind(str(private / "data")),))
        with pytest.raises(lowlevel.LaunchError) as err:
            lowlevel.run(["true"], policy=policy, workspace=_ws())
        assert err.value.errno == errno.EACCES
        assert "traversable by others" in str(err.value) and "Can't find source path" in str(err.value)
        os.chmod(private, 0o711)  # control: traversable, the same bind works
        assert lowlevel.run(["ls", str(private / "data")], policy=policy, workspace=_ws()).exit_code == 0
    finally:
        shutil.rmtree(private)


@pytest.mark.parametrize("args", [["--timeout", "inf"], ["--timeout", "1e300"], ["--fsize", "0"],
                                  ["--tmp-size", "1.5"], ["--memory", "12Q"]])
def test_cli_bad_values_one_line_no_traceback(args):
    p = subprocess.run([sys.executable, "-m", "lowlevel", "run", *args, "--", "true"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode in (2, 125), p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("deterministic", [False, True])
def test_git_commit_in_workspace_root(deterministic):
    script = ("git init -q . && git -c user.name=a -c user.email=a@example.com commit -q --allow-empty -m x "
              "&& git log --oneline | wc -l")
    r = lowlevel.run(["sh", "-c", script], policy=lowlevel.Policy(deterministic=deterministic))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == b"1"


def _echo_after(argv: list[str]) -> bool:
    import pty
    import termios
    pid, fd = pty.fork()
    if pid == 0:  # child: exec only
        os.execv(argv[0], argv)
    status = os.waitpid(pid, 0)[1]
    try:
        echo = bool(termios.tcgetattr(fd)[3] & termios.ECHO)
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    return echo


def test_cli_restores_the_terminal_a_program_left_raw():
    script = "stty -echo raw; exit 0"
    # Control: the same program run directly leaves the terminal without echo.
    assert _echo_after(["/bin/sh", "-c", script]) is False
    assert _echo_after([sys.executable, "-m", "lowlevel", "run", "--rm", "--", "sh", "-c", script]) is True


@pytest.mark.root
def test_arun_as_unprivileged_user(test_user):
    """The async API on the non-root path: cleared env, workspace-only writes, timeout."""
    code = (
        "import asyncio, os, tempfile, lowlevel\n"
        "ws = tempfile.mkdtemp(dir='/tmp')\n"
        "async def main():\n"
        "    ok = await lowlevel.arun(['sh', '-c', 'echo hi > out; touch /usr/x; env | wc -l'], workspace=ws)\n"
        "    slow = await lowlevel.arun(['sleep', '100'], workspace=ws, timeout=0.5)\n"
        "    print(ok.exit_code, ok.stdout.decode().strip(), open(os.path.join(ws, 'out')).read().strip(),\n"
        "          slow.killed_by, 'Read-only' in ok.stderr.decode())\n"
        "asyncio.run(main())\n"
    )
    import shutil
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    p = subprocess.run([runuser, "-u", test_user.pw_name, "--", sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin", "LOWLEVEL_FAKE_X": "1"})
    assert p.returncode == 0, p.stderr
    exit_code, env_lines, out, killed_by, ro = p.stdout.split()
    assert exit_code == "0" and out == "hi" and killed_by == "timeout" and ro == "True"
    assert int(env_lines) <= 7


def test_session_workspace_checks_match_run():
    with pytest.raises(lowlevel.WorkspaceError, match="system directory"):
        lowlevel.Session(workspace="/usr")
    ws = _ws()
    with lowlevel.Session(workspace=ws, allow_sensitive_workspace=True) as s:
        assert s.run(["sh", "-c", "echo ok > f; cat f"]).stdout == b"ok\n"


@pytest.mark.root
def test_a_real_accounts_uid_is_never_leased(monkeypatch):
    """LOWLEVEL_UID_RANGE over /etc/passwd: the account's uid is skipped (a sandbox running as a
    real user's uid would own that user's files); a range of accounts only is refused."""
    import pwd
    acct = pwd.getpwnam("nobody").pw_uid
    free = next(u for u in range(acct + 1, acct + 100) if not _has_account(u))
    monkeypatch.setenv("LOWLEVEL_UID_RANGE", f"{acct}-{free}")
    uids = set()
    for _ in range(3):
        r = lowlevel.run(["true"], workspace=_ws())
        uids.add(int(next(a for a in r.argv if a.startswith("--uid=")).split("=")[1]))
    assert acct not in uids and uids <= set(range(acct + 1, free + 1)), uids
    monkeypatch.setenv("LOWLEVEL_UID_RANGE", f"{acct}-{acct}")
    with pytest.raises(lowlevel.UnsupportedError, match="can be a per-run uid: each is an account.s uid"):
        lowlevel.run(["true"], workspace=_ws())


def _has_account(uid: int) -> bool:
    import pwd
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


@pytest.mark.root
def test_a_real_groups_gid_is_never_leased(monkeypatch):
    """The per-run uid is the sandbox's gid too: a gid /etc/group gives a group (and no account
    uses as a uid) is skipped, or the sandbox would get that group's access (a 0640 file of
    group utmp, shadow...). Control: a leased id outside every group cannot read it."""
    import grp
    import pwd
    accounts = {e.pw_uid for e in pwd.getpwall()}
    gid = next((g.gr_gid for g in grp.getgrall() if g.gr_gid not in accounts and g.gr_gid > 0), None)
    if gid is None:
        pytest.skip("no group here without an account of the same id")
    data = tempfile.mkdtemp(prefix="rt-gid-", dir="/tmp")
    try:
        os.chmod(data, 0o755)
        with open(os.path.join(data, "f"), "w") as f:
            f.write("group secret\n")
        os.chown(os.path.join(data, "f"), 0, gid)
        os.chmod(os.path.join(data, "f"), 0o640)
        policy = lowlevel.Policy(binds=(lowlevel.Bind(data, "/data"),))
        monkeypatch.setenv("LOWLEVEL_UID_RANGE", f"{gid}-{gid}")
        with pytest.raises(lowlevel.UnsupportedError, match=r"a group.s gid \(/etc/passwd, /etc/group or NSS\)"):
            lowlevel.run(["cat", "/data/f"], policy=policy, workspace=_ws())
        free = next(u for u in range(2_000_000_000, 2_000_000_100) if u not in accounts)
        monkeypatch.setenv("LOWLEVEL_UID_RANGE", f"{free}-{free}")
        r = lowlevel.run(["sh", "-c", "id -g; cat /data/f"], policy=policy, workspace=_ws())
        assert r.stdout == f"{free}\n".encode() and r.exit_code != 0, r  # control: no group, no access
    finally:
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.root
def test_a_workspace_base_inside_a_system_tree_is_refused_before_anything_is_made():
    """``workspace_base="/boot/lowlevel"`` (API) ran its fresh workspaces in /boot, and
    LOWLEVEL_WORKSPACE_BASE=/etc/lowlevel (CLI) made /etc/lowlevel/run-* before refusing it and
    left both. In a private mount namespace with empty tmpfs mounts over /boot and /mnt (never
    the host's): each base in /boot is refused and nothing appears there; the control, a base
    under /mnt (a system directory, but no system tree), runs, and so does the default base when
    TMPDIR is /dev/shm (a tmpfs of the namespace's own there too)."""
    code = (
        "import os, lowlevel, sys\n"
        "for base in ('/boot/lowlevel', '/boot'):\n"
        "    try:\n"
        "        lowlevel.run(['true'], workspace_base=base)\n"
        "        sys.exit('ran under ' + base)\n"
        "    except lowlevel.WorkspaceError as err:\n"
        "        assert 'system tree /boot' in str(err) or 'system directory /boot' in str(err), err\n"
        "assert os.listdir('/boot') == [], os.listdir('/boot')\n"
        "os.makedirs('/mnt/ok', exist_ok=True)\n"
        "r = lowlevel.run(['true'], workspace_base='/mnt/ok/lowlevel')\n"
        "assert r.exit_code == 0 and r.workspace.startswith('/mnt/ok/lowlevel/'), r\n"
        "os.environ['TMPDIR'] = '/dev/shm'  # the user's own temp place under /dev: still a default base\n"
        "r = lowlevel.run(['true'])\n"
        "assert r.exit_code == 0 and r.workspace.startswith('/dev/shm/lowlevel-0/'), r\n"
        "print('ok')\n")
    script = ("mount -t tmpfs none /boot && mount -t tmpfs none /mnt && mount -t tmpfs none /dev/shm && "
              f"exec {sys.executable} -c \"$0\"")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, code],
                       capture_output=True, text=True, timeout=120, cwd="/", env=env)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
