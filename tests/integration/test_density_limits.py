"""What stops a caller from holding more Sessions: a clear lowlevel error, nothing left behind.

Issue 27, item 4 (``bench/density.py`` measures the same limits at full size). Each test drives a
real caller (``python -c`` with lowlevel imported, as root and as the unprivileged test user)
that opens Sessions until a limit stops it, with the limit lowered so that a few Sessions reach
it:

- RLIMIT_NOFILE (a soft limit of 90): the next Session's start, and a command of a live Session
  whose pipes cannot be made, raise LaunchError (errno EMFILE) naming ``RLIMIT_NOFILE`` and how
  to raise it, not a bare OSError; the live Sessions still run commands, and once fds are free
  again the same Session runs the next command. Control: the same caller without the lowered
  limit starts every Session it asks for.
- the per-run uid range of a root caller (``LOWLEVEL_UID_RANGE`` of 3 uids above the default
  range, which other callers' runs rotate through): the fourth Session
  raises UnsupportedError(feature="uid-range") at once; closing one gives its uid back.
- RLIMIT_NPROC (the unprivileged caller; the kernel exempts root): the next Session raises
  LaunchError naming ``RLIMIT_NPROC``.

After each, every Session closed: no process of the caller's is left, its fd count is back to
its baseline (taken after one Session, so the init executable's fd, opened once per process, is
in it), and no fresh workspace is left in its workspace base.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

#: The caller: argv[1] the limit to lower ("nofile", "uids", "nproc", "none"), argv[2] the
#: workspace base, argv[3] how many Sessions at most. Prints one JSON line.
CALLER = r"""
import json, os, resource, sys
import lowlevel
from lowlevel.session import Session
kind, base, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])

def descendants():
    kids = {}
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                stat = open(f"/proc/{n}/stat", "rb").read()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rfind(b")") + 2:].split()[1]), []).append(int(n))
    out, todo = [], list(kids.get(os.getpid(), ()))
    while todo:
        p = todo.pop(); out.append(p); todo.extend(kids.get(p, ()))
    return out

with Session(workspace_base=base, commit=False) as s:
    s.run(["/usr/bin/true"])
fds0 = len(os.listdir("/proc/self/fd"))
if kind == "nofile":
    resource.setrlimit(resource.RLIMIT_NOFILE, (90, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
elif kind == "nproc":
    mine = sum(1 for p in os.listdir("/proc") if p.isdigit() and os.stat(f"/proc/{p}").st_uid == os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (mine + 14, resource.getrlimit(resource.RLIMIT_NPROC)[1]))
out = {"started": 0, "made": 1}  # made: Sessions that started, the first one included
sessions = []
try:
    for _ in range(cap):
        try:
            sessions.append(Session(workspace_base=base, commit=False))
            out["made"] += 1
        except Exception as err:
            out["error"] = [type(err).__name__, str(err), getattr(err, "errno", None), getattr(err, "feature", None)]
            break
    out["started"] = len(sessions)
    if sessions:
        try:
            out["live_runs"] = sessions[-1].run(["/usr/bin/true"]).exit_code
        except Exception as err:  # at the process limit no command can fork either
            out["live_runs"] = [type(err).__name__, str(err)]
    if kind == "nofile" and sessions:
        filler = []
        try:
            while True:
                filler.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            pass
        try:
            sessions[0].run(["/usr/bin/true"])
            out["run_error"] = None
        except Exception as err:
            out["run_error"] = [type(err).__name__, str(err), getattr(err, "errno", None)]
        for fd in filler:
            os.close(fd)
        out["run_after"] = sessions[0].run(["/usr/bin/true"]).exit_code
    if kind == "uids" and sessions:
        sessions.pop(0).close()
        try:
            sessions.append(Session(workspace_base=base, commit=False))
            out["made"] += 1
            out["after_release"] = sessions[-1].run(["/usr/bin/true"]).exit_code
        except Exception as err:
            out["after_release"] = f"{type(err).__name__}: {err}"
finally:
    for s in sessions:
        s.close()
out["left"] = {"processes": descendants(), "fds_over_baseline": len(os.listdir("/proc/self/fd")) - fds0}
print(json.dumps(out), flush=True)
"""


def _prefix(identity: str, request: pytest.FixtureRequest) -> list[str]:
    if identity == "root":
        if os.geteuid() != 0:
            pytest.skip("needs root")
        return []
    if os.geteuid() != 0:
        return []
    user = request.getfixturevalue("test_user")
    return [shutil.which("runuser") or "/usr/sbin/runuser", "-u", user.pw_name, "--"]


def _caller(identity: str, request: pytest.FixtureRequest, kind: str, cap: int,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    prefix = _prefix(identity, request)
    base = tempfile.mkdtemp(prefix="lowlevel-density-test-")
    try:
        if prefix:
            user = request.getfixturevalue("test_user")
            os.chown(base, user.pw_uid, user.pw_gid)
        full_env = dict(os.environ, **(env or {}))
        full_env["PYTHONPATH"] = REPO + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
        if prefix:
            prefix = [*prefix, "env", f"PYTHONPATH={full_env['PYTHONPATH']}",
                      *(f"{k}={v}" for k, v in (env or {}).items())]
        proc = subprocess.run([*prefix, sys.executable, "-c", CALLER, kind, base, str(cap)], capture_output=True,
                              text=True, env=full_env, cwd="/", timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        out["workspaces_left"] = os.listdir(base)
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _nothing_left(out: dict[str, Any]) -> None:
    """No process, no fd; the fresh workspaces of the Sessions that started (kept after close, as
    documented) and no other: a start refused at the limit left none."""
    assert out["left"] == {"processes": [], "fds_over_baseline": 0}, out
    runs = [n for n in out["workspaces_left"] if n.startswith("run-")]
    assert len(runs) == out["made"], out
    assert set(out["workspaces_left"]) - set(runs) <= {".mnt"}, out  # the unprivileged caller's mount point


@pytest.mark.parametrize("identity", ["root", "user"])
def test_open_file_limit_stops_sessions_with_a_clear_error(identity: str, request: pytest.FixtureRequest) -> None:
    out = _caller(identity, request, "nofile", 40)
    kind, message, code = out["error"][:3]
    assert kind == "LaunchError" and code == 24, out  # EMFILE
    assert "RLIMIT_NOFILE" in message and "ulimit -n" in message and "resource.setrlimit" in message, message
    assert 3 <= out["started"] < 40, out
    assert out["live_runs"] == 0, out  # the Sessions started before the limit still work
    kind, message, code = out["run_error"]
    assert kind == "LaunchError" and code == 24 and "RLIMIT_NOFILE" in message, out  # not a bare OSError
    assert out["run_after"] == 0, out  # the same Session runs the next command once fds are free
    _nothing_left(out)


@pytest.mark.parametrize("identity", ["root", "user"])
def test_control_without_the_lowered_limit_every_session_starts(identity: str,
                                                                 request: pytest.FixtureRequest) -> None:
    out = _caller(identity, request, "none", 12)
    assert "error" not in out and out["started"] == 12 and out["live_runs"] == 0, out
    _nothing_left(out)


def test_uid_range_stops_root_sessions_with_a_clear_error(request: pytest.FixtureRequest) -> None:
    from lowlevel.workspace.uids import DEFAULT_UID_RANGE, account_uids
    # Above the default range: runs of the default range (other callers on this host) rotate
    # through every uid of it, so 3 uids inside it could be leased by them meanwhile.
    first = DEFAULT_UID_RANGE[0] + DEFAULT_UID_RANGE[1] + 1024 + os.getpid() % 4096 * 4
    assert not account_uids(first, 3)
    out = _caller("root", request, "uids", 10, env={"LOWLEVEL_UID_RANGE": f"{first}-{first + 2}"})
    kind, message, _code, feature = out["error"]
    assert kind == "UnsupportedError" and feature == "uid-range", out
    assert "LOWLEVEL_UID_RANGE" in message, message
    assert out["started"] == 3 and out["live_runs"] == 0, out
    assert out["after_release"] == 0, out  # a closed Session's uid is leased again
    _nothing_left(out)


def test_process_limit_stops_unprivileged_sessions_with_a_clear_error(request: pytest.FixtureRequest) -> None:
    out = _caller("user", request, "nproc", 40)
    kind, message = out["error"][:2]
    assert kind == "LaunchError" and "RLIMIT_NPROC" in message, out
    assert 1 <= out["started"] < 40, out
    # At the limit a command of a live session may find no fork left either: a LaunchError that
    # names the process limits, not a bare errno.
    assert out["live_runs"] == 0 or (out["live_runs"][0] == "LaunchError"
                                     and "RLIMIT_NPROC" in out["live_runs"][1]), out
    _nothing_left(out)


#: The memory caller: argv[1] its own v1 memory cgroup (made by the test, the limit written),
#: argv[2] the workspace base, argv[3] "keep" for Policy(env={"LOWLEVEL_NO_OOM_SCORE_ADJ": "1"})
#: (the init keeps oom_score_adj 0: the control). Joins the cgroup, opens Sessions until a start
#: fails (at most 150), runs a command in each, prints one JSON line.
MEMORY_CALLER = r"""
import json, os, sys
cg, base, mode = sys.argv[1:4]
with open(os.path.join(cg, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
import lowlevel
from lowlevel.session import Session
policy = lowlevel.Policy(env={"LOWLEVEL_NO_OOM_SCORE_ADJ": "1"} if mode == "keep" else {})
sessions, out = [], {"start_error": None, "session_errors": [], "ok": 0}
try:
    for _ in range(150):
        try:
            sessions.append(Session(policy, workspace_base=base, commit=False))
        except lowlevel.LowlevelError as err:
            out["start_error"] = [type(err).__name__, str(err)]
            break
    out["started"] = len(sessions)
    for s in sessions:
        try:
            s.run(["/usr/bin/true"])
            out["ok"] += 1
        except lowlevel.LowlevelError as err:
            out["session_errors"].append([type(err).__name__, getattr(err, "reason", None), str(err)])
finally:
    for s in sessions:
        s.close()
print(json.dumps(out), flush=True)
"""


def _memory_cgroup(limit_mib: int) -> str:
    """A v1 memory cgroup below the test's own, with a limit: the caller's, which its sessions'
    run cgroups nest in (lowlevel puts them below the caller's own memory cgroup)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a memory cgroup of its own)")
    with open("/proc/self/cgroup") as f:
        own = next((line.split(":", 2)[2].strip() for line in f if ":memory:" in line), None)
    if own is None or not os.path.isdir("/sys/fs/cgroup/memory"):
        pytest.skip("no cgroup v1 memory hierarchy")
    cg = f"/sys/fs/cgroup/memory{own.rstrip('/')}/lowlevel-density-test-{os.getpid()}"
    os.mkdir(cg)
    with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit_mib << 20))
    return cg


def _remove_cgroup(cg: str) -> list[int]:
    """Remove ``cg`` and what lowlevel made below it; the PIDs still in it (none expected)."""
    left = []
    for root, dirs, _files in os.walk(cg, topdown=False):
        with open(os.path.join(root, "cgroup.procs")) as f:
            left += [int(p) for p in f.read().split()]
        if not left:
            os.rmdir(root)
    return left


def _memory_caller(mode: str) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    cg = _memory_cgroup(80)
    base = tempfile.mkdtemp(prefix="lowlevel-density-test-")
    try:
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.run([sys.executable, "-c", MEMORY_CALLER, cg, base, mode], capture_output=True, text=True,
                              env=env, cwd="/", timeout=240)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        deadline = time.monotonic() + 10  # a killed caller's sessions die with it (--die-with-parent)
        while True:
            try:
                left = _remove_cgroup(cg)
            except OSError:
                left = [-1]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    return proc, left


def test_memory_full_kills_sessions_not_their_caller() -> None:
    """80 MiB for the caller and all its sessions: the kernel's OOM killer takes sessions (each
    init has oom_score_adj 900 while idle), each a SessionError naming the OOM killer, or a start
    that says so (or that bwrap ran out of memory); the caller lives to close the rest, nothing is left in the cgroup."""
    proc, left = _memory_caller("adjust")
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    killed = [e for e in out["session_errors"] if e[0] == "SessionError" and "OOM killer" in e[2]]
    start = out["start_error"]
    # A start can also fail before any OOM kill: the kernel refuses bwrap's namespaces (ENOMEM at
    # clone), which lowlevel reports as "ran out of memory" naming memory.max: as clear, as safe.
    assert killed or (start and ("OOM killer" in start[1] or "ran out of memory" in start[1])), out
    assert all(e[0] == "SessionError" for e in out["session_errors"]), out
    assert start is None or start[0] == "LaunchError", out
    assert left == []


def test_control_memory_full_with_the_old_victim_choice_kills_the_caller() -> None:
    """Control: the inits keep oom_score_adj 0 (LOWLEVEL_NO_OOM_SCORE_ADJ=1): the caller, the
    largest process under the limit, is the OOM killer's victim, and every session with it."""
    proc, left = _memory_caller("keep")
    assert proc.returncode == -9, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert left == []


def test_run_at_a_tiny_open_file_limit_names_rlimit_nofile(tmp_path: Path) -> None:
    """A run whose caller's RLIMIT_NOFILE is below the fd table's numbers (F_DUPFD's EINVAL) or
    runs out while preparing (EMFILE) gets one LaunchError naming the limit, at every small limit;
    the control at the usual limit runs."""
    script = (
        "import resource, sys, lowlevel\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "for n in (20, 30, 40):\n"
        "    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))\n"
        "    try:\n"
        "        lowlevel.run(['/bin/true'], workspace_base=sys.argv[1])\n"
        "        print(n, 'ran')\n"
        "    except lowlevel.LaunchError as err:\n"
        "        print(n, err.errno, 'RLIMIT_NOFILE' in str(err))\n"
        "import os\n"
        "print(os.listdir(sys.argv[1]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # Nothing of the refused runs is left (no workspace, no mount dir).
    assert out.stdout.split("\n")[:4] == ["20 24 True", "30 24 True", "40 24 True", "[]"], out.stdout
    control = subprocess.run([sys.executable, "-c", "import lowlevel, sys; "
                              "print(lowlevel.run(['/bin/true'], workspace_base=sys.argv[1]).exit_code)", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert control.stdout.strip() == "0", control.stderr
    assert len(os.listdir(tmp_path)) == 1  # the control's fresh workspace, the caller's to read and remove


@pytest.mark.parametrize("nofile", [8, 10, 12, 14, 16])
def test_cli_run_at_a_tiny_open_file_limit_is_one_line_and_leaves_no_workspace(tmp_path: Path, nofile: int) -> None:
    """`lowlevel run --rm` at `ulimit -n 8`/`10`: an EMFILE from the terminal relay's pipes (or a
    host probe's import) escaped as a Python traceback, exit 1, and left the --rm workspace (the
    red team's finding). Now every small limit is one `lowlevel:` line, exit 125, nothing left in
    the workspace base. Control: the usual limit runs (exit 0) and leaves nothing either."""
    import resource
    lowlevel_cli = os.path.join(os.path.dirname(sys.executable), "lowlevel")
    env = {**os.environ, "LOWLEVEL_WORKSPACE_BASE": str(tmp_path)}

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    out = subprocess.run([lowlevel_cli, "run", "--rm", "--", "/bin/true"], capture_output=True, text=True,
                         timeout=60, env=env, preexec_fn=limit)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 125 and len(lines) == 1 and lines[0].startswith("lowlevel: "), out.stderr
    assert "Too many open files" in lines[0]
    assert os.listdir(tmp_path) == []
    control = subprocess.run([lowlevel_cli, "run", "--rm", "--", "/bin/true"], capture_output=True, text=True,
                             timeout=60, env=env)
    assert control.returncode == 0, control.stderr
    assert os.listdir(tmp_path) == []
