"""A caller that stops, or dies inside a cgroup of its own: the run keeps its deadline, nothing is left.

Issue 23 items 4 and 5. Each test drives a real caller process (``python -c`` with lowlevel
imported, as root and as the unprivileged test user, or the ``lowlevel`` CLI) and observes the
host from outside it:

- a caller SIGSTOPped 0.5 s into a run with ``timeout=2`` of a program that would live 60 s:
  the program's process is gone while the caller is still stopped (the anchor enforces the
  deadline, ``--deadline-ns``), and after SIGCONT the Result says ``timed_out``/``timeout`` and
  its ``wall_time_s`` does not include the stop. Control: the same program without a timeout
  keeps running while its caller is stopped (so the disappearance is the deadline's doing).
  Modes: ``run``, ``arun``, ``Session.run``, ``Pool.run`` (the shepherd's own wall time), the CLI.
- ``arun`` in a caller at its ``pids.max`` (a real pids cgroup): each call raises LaunchError and
  no call's setup runs later, once threads can start again (no workspace, no run cgroup left).
- the anchor or bwrap SIGKILLed from outside mid-run: a killed program (``killed_by="signal"``,
  137, a note), its output and writes delivered, not "sandbox setup failed"; the CLI keeps the
  fresh workspace holding the output.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers.procs import cmdlines, pids_with

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

#: The caller: prints its pid, runs ``sleep SECONDS`` (SECONDS is the trial's marker), prints the Result.
CALLER = r"""
import asyncio, json, os, sys
mode, seconds, timeout = sys.argv[1], sys.argv[2][1:], sys.argv[3]  # "=61.N": not the marker itself
timeout = None if timeout == "none" else float(timeout)
import lowlevel
print(os.getpid(), flush=True)
cmd = ["sleep", seconds]
if mode == "run":
    r = lowlevel.run(cmd, timeout=timeout)
elif mode == "arun":
    from lowlevel.sandbox.aio import arun
    r = asyncio.run(arun(cmd, timeout=timeout))
elif mode == "pool":
    with lowlevel.Pool(size=1) as pool:
        r = pool.run(cmd, timeout=timeout)
else:
    with lowlevel.Session() as s:
        r = s.run(cmd, timeout=timeout)
print(json.dumps({"timed_out": r.timed_out, "killed_by": r.killed_by, "exit_code": r.exit_code,
                  "wall_time_s": r.wall_time_s}), flush=True)
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


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _wait_for(cond, bound_s: float) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def _cont(proc: subprocess.Popen[str], pid: int) -> None:
    """SIGCONT the caller, and runuser above it (which stops itself when its child stops)."""
    for p in {pid, proc.pid}:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _start_caller(argv: list[str]) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd="/")
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), (line, proc.stderr.read() if proc.stderr else "")
    return proc, int(line)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["run", "arun", "session", "pool"])
@pytest.mark.parametrize("identity", ["root", "user"])
def test_stopped_caller_run_ends_at_its_deadline(identity: str, mode: str, request: pytest.FixtureRequest):
    prefix = _prefix(identity, request)
    marker = f"61.{os.getpid()}{time.time_ns() % 10**9:09d}"  # sleep's argument: unique on the host
    proc, pid = _start_caller([*prefix, sys.executable, "-c", CALLER, mode, "=" + marker, "2"])
    try:
        assert _wait_for(lambda: bool(pids_with(marker, whole_arg=True)), 60), "the program never started"
        time.sleep(0.5)
        t_stop = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        assert _wait_for(lambda: _state(pid) == "T", 10)
        # The caller is stopped: only the anchor (or the session's shepherd) can end the program.
        gone = _wait_for(lambda: not pids_with(marker, whole_arg=True), 30)
        assert _state(pid) == "T", "the caller ran meanwhile: the test proves nothing"
        assert gone, f"the program outlived its 2 s deadline by {time.monotonic() - t_stop:.1f} s of caller stop"
        time.sleep(max(0.0, t_stop + 6 - time.monotonic()))  # a stop well past the deadline
        stopped_for = time.monotonic() - t_stop
        _cont(proc, pid)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            _cont(proc, pid)
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["timed_out"] is True and res["killed_by"] == "timeout", res
    assert res["exit_code"] == 128 + signal.SIGKILL, res
    # The wall time measures the command (killed about 2 s in), not the caller's stop.
    # (A wall time counted by the caller would exceed the 0.5 s run before the stop plus the stop.)
    assert res["wall_time_s"] < stopped_for - 1, (res, stopped_for)


@pytest.mark.parametrize("identity", ["root", "user"])
def test_stopped_caller_without_timeout_control(identity: str, request: pytest.FixtureRequest):
    """Control: without a deadline nothing ends the program while its caller is stopped."""
    prefix = _prefix(identity, request)
    marker = f"62.{os.getpid()}{time.time_ns() % 10**9:09d}"
    proc, pid = _start_caller([*prefix, sys.executable, "-c", CALLER, "run", "=" + marker, "none"])
    try:
        assert _wait_for(lambda: bool(pids_with(marker, whole_arg=True)), 60), "the program never started"
        os.kill(pid, signal.SIGSTOP)
        time.sleep(4)
        assert pids_with(marker, whole_arg=True), "the program died without a deadline"
    finally:
        os.kill(pid, signal.SIGKILL)
        _cont(proc, pid)
        proc.communicate(timeout=30)
    assert _wait_for(lambda: not pids_with(marker, whole_arg=True), 10)


def test_stopped_cli_run_ends_at_its_deadline():
    if os.geteuid() != 0:
        pytest.skip("root half (the CLI as the user is covered by the library's run)")
    marker = f"63.{os.getpid()}{time.time_ns() % 10**9:09d}"
    cli = [sys.executable, "-m", "lowlevel", "run", "--rm", "--timeout", "2", "--", "sh", "-c", 'exec sleep "${0#=}"',
           "=" + marker]  # the CLI's own command line must not carry the marker
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd="/")
    try:
        assert _wait_for(lambda: bool(pids_with(marker, whole_arg=True)), 60), "the program never started"
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGSTOP)
        gone = _wait_for(lambda: not pids_with(marker, whole_arg=True), 30)
        assert _state(proc.pid) == "T"
        assert gone, "the program outlived its deadline while the CLI was stopped"
        os.kill(proc.pid, signal.SIGCONT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 124, err  # the CLI's code for a timeout
    assert "timed out after 2 s" in err, err


ARUN_AT_PIDS_MAX = r"""
import asyncio, os, sys, time
base = sys.argv[1]
from lowlevel.sandbox.aio import arun
asyncio.run(arun(["true"], workspace_base=base, keep_workspace=False))  # one executor thread now exists
print("ready", flush=True)
sys.stdin.readline()  # the test sets pids.max to what runs now: no thread, no process can start
async def batch():
    return await asyncio.gather(*(arun(["true"], workspace_base=base, keep_workspace=False) for _ in range(32)),
                                return_exceptions=True)
kinds = {}
for _ in range(3):
    for r in asyncio.run(batch()):
        kinds[type(r).__name__] = kinds.get(type(r).__name__, 0) + 1
print(repr(kinds), flush=True)
sys.stdin.readline()  # pids.max lifted: a setup left queued in the executor would run now
time.sleep(3)
print(len(os.listdir(base)), flush=True)
"""


def test_arun_when_no_thread_can_start_leaves_nothing(tmp_path):
    """``arun`` at the caller's ``pids.max`` (a real pids cgroup of its own): each call raises
    LaunchError (EAGAIN), and no call's setup runs later once threads can start again (before:
    RuntimeError, and the queued setups then made 31 workspaces and 31 run cgroups per 96 calls)."""
    if os.geteuid() != 0:
        pytest.skip("makes a cgroup v1 pids directory: needs root")
    with open("/proc/self/mountinfo") as f:
        from lowlevel.host.cgroup_detect import parse_mountinfo
        mounts = [m for _r, m, fs, opts in parse_mountinfo(f.read()) if fs == "cgroup" and "pids" in opts.split(",")]
    if not mounts:
        pytest.skip("no cgroup v1 pids hierarchy")
    cg = os.path.join(mounts[0], f"lowlevel-test-arun-{os.getpid()}-{time.time_ns() % 10**6}")
    os.mkdir(cg)
    base = tmp_path / "base"
    base.mkdir()
    proc = subprocess.Popen(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c",
                             ARUN_AT_PIDS_MAX, str(base)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env(), cwd="/")
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        with open(f"{cg}/pids.current") as f:
            current = f.read().strip()
        with open(f"{cg}/pids.max", "w") as f:
            f.write(current)
        proc.stdin.write("\n")
        proc.stdin.flush()
        kinds = eval(proc.stdout.readline())  # noqa: S307 - a dict repr our own child printed
        with open(f"{cg}/pids.max", "w") as f:
            f.write("max")
        proc.stdin.write("\n")
        proc.stdin.flush()
        left = int(proc.stdout.readline())
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        run_dirs = [d for d in os.listdir(os.path.join(cg, "lowlevel"))
                    if d.startswith("run-")] if os.path.isdir(os.path.join(cg, "lowlevel")) else []
        for parent, dirs, _files in os.walk(cg, topdown=False):
            for d in dirs:
                try:
                    os.rmdir(os.path.join(parent, d))
                except OSError:
                    pass
        os.rmdir(cg)
    assert set(kinds) <= {"LaunchError", "Result"} and sum(kinds.values()) == 96, kinds
    assert "RuntimeError" not in kinds
    assert left == 0, f"{left} workspaces made by setups that ran after their call had failed"
    assert run_dirs == [], run_dirs


KILLED_SUPERVISOR = r"""
import json, os, sys, tempfile
import lowlevel
print(os.getpid(), flush=True)
try:
    r = lowlevel.run(["sh", "-c", 'echo out > f; echo printed; exec sleep "${0#=}"', sys.argv[1]], timeout=120)
    print(json.dumps({"killed_by": r.killed_by, "exit_code": r.exit_code, "stdout": r.stdout.decode(),
                      "notes": list(r.notes), "f": open(os.path.join(r.workspace, "f")).read()}))
except lowlevel.LowlevelError as err:
    print(json.dumps({"error": type(err).__name__, "message": str(err)}))
"""


def _supervisor_of(marker: str, which: str) -> list[int]:
    """PIDs of the anchor (``_lowlevel_exec``) or bwrap of the run whose program has ``marker``."""
    out = []
    for pid, raw in cmdlines():
        argv = raw.split(b"\0")
        if argv and os.path.basename(argv[0]).decode(errors="replace") == which \
                and any(marker.encode() in a for a in argv):
            out.append(pid)
    return out


@pytest.mark.parametrize("which", ["_lowlevel_exec", "bwrap"])
@pytest.mark.parametrize("identity", ["root", "user"])
def test_killed_anchor_or_bwrap_is_a_killed_program_not_a_setup_failure(identity: str, which: str,
                                                                         request: pytest.FixtureRequest):
    prefix = _prefix(identity, request)
    marker = f"65.{os.getpid()}{time.time_ns() % 10**9:09d}"
    proc, _pid = _start_caller([*prefix, sys.executable, "-c", KILLED_SUPERVISOR, "=" + marker])
    try:
        assert _wait_for(lambda: bool(pids_with(marker, whole_arg=True)) and bool(_supervisor_of(marker, which)), 60)
        os.kill(_supervisor_of(marker, which)[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    res = json.loads(out.strip().splitlines()[-1])
    assert "error" not in res, res  # before: LaunchError "sandbox setup failed"
    assert res["killed_by"] == "signal" and res["exit_code"] == 128 + signal.SIGKILL, res
    assert res["stdout"] == "printed\n" and res["f"] == "out\n", res  # output and writes delivered
    assert any("supervisor" in n and "killed" in n for n in res["notes"]), res
    assert _wait_for(lambda: not pids_with(marker, whole_arg=True), 10)


def test_cli_keeps_the_fresh_workspace_when_the_anchor_is_killed():
    if os.geteuid() != 0:
        pytest.skip("root half (the library test covers the user)")
    marker = f"66.{os.getpid()}{time.time_ns() % 10**9:09d}"
    cli = [sys.executable, "-m", "lowlevel", "run", "--", "sh", "-c", 'echo out > f; exec sleep "${0#=}"', "=" + marker]
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd="/")
    try:
        assert _wait_for(lambda: bool(pids_with(marker, whole_arg=True)) and bool(_supervisor_of(marker, "_lowlevel_exec")), 60)
        os.kill(_supervisor_of(marker, "_lowlevel_exec")[0], signal.SIGKILL)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGKILL, err  # before: 125, "sandbox setup failed"
    ws = next(line.split("workspace ", 1)[1].strip() for line in err.splitlines() if "lowlevel: workspace " in line)
    with open(os.path.join(ws, "f")) as f:
        assert f.read() == "out\n"
    shutil.rmtree(ws)
