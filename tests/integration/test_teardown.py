"""A finished run's teardown off its result path (:mod:`lowlevel.sandbox.teardown`), issue 27.

``lowlevel.run`` returns once the Result is built; the anchor's reaping and the run cgroup's
removal happen on lowlevel's teardown thread. What must hold, observed on real runs:

- after :func:`~lowlevel.sandbox.teardown.drain` nothing of the runs is left: no child (zombie
  anchor), no run cgroup directory, no run record; with the thread switched off (control: the
  old inline path) the same holds right after the call;
- a process that exits right after a run leaves nothing (the exit handler drains), also when
  many runs are still pending, and a run made by an exit handler that runs after lowlevel's
  tears down inline;
- a caller SIGKILLed while teardown is pending leaves its run records, and ``lowlevel cleanup``
  removes every directory they name (the record is what makes that possible: it is removed only
  with the last directory);
- when no thread can start, close() does the teardown inline (nothing pending, nothing left).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

import lowlevel
from lowlevel.host import cgroup_detect as _cgroup_detect
from lowlevel.host import later
from lowlevel.host import run_records
from lowlevel.sandbox import teardown

from helpers.hygiene import children

pytestmark = [pytest.mark.bwrap, pytest.mark.root, pytest.mark.timeout(120)]


def _run_dirs(pid: int) -> list[str]:
    out = []
    for h in _cgroup_detect.detect_cgroups().hierarchies:
        if h.base is not None and os.path.isdir(h.base):
            out += [os.path.join(h.base, d) for d in os.listdir(h.base) if d.startswith(f"run-{pid}-")]
    return out


def _records_of(pid: int, where: str | None = None) -> list[run_records.Record]:
    if where is None:
        return [r for r in run_records.records() if r.pid == pid]
    return [rec for rec in (run_records.load(os.path.join(where, n)) for n in os.listdir(where)) if rec.pid == pid]


@pytest.fixture
def root_with_cgroups() -> None:
    if os.geteuid() != 0:
        pytest.skip("root: the run cgroups of v1 hierarchies")
    if not _cgroup_detect.detect_cgroups().usable:
        pytest.skip("no writable cgroup hierarchy")


def test_drain_finishes_what_the_runs_handed_over(root_with_cgroups: None, tmp_path) -> None:
    teardown.drain()
    for _ in range(20):
        r = lowlevel.run(["/usr/bin/true"], workspace=str(tmp_path))
        assert r.exit_code == 0, r.stderr
    assert teardown.drain(timeout_s=30)
    assert teardown.pending() == 0
    assert children() == []
    assert _run_dirs(os.getpid()) == []
    assert _records_of(os.getpid()) == []


def test_control_inline_teardown_leaves_nothing_at_return(root_with_cgroups: None, tmp_path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    teardown.drain()
    monkeypatch.setattr(teardown, "ENABLED", False)
    r = lowlevel.run(["/usr/bin/true"], workspace=str(tmp_path))
    assert r.exit_code == 0, r.stderr
    assert teardown.pending() == 0
    # No drain: the old path removed everything before run() returned.
    assert _run_dirs(os.getpid()) == []
    assert _records_of(os.getpid()) == []


def test_no_thread_means_inline_teardown(root_with_cgroups: None, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    teardown.drain()
    monkeypatch.setattr(later, "_threads", [])

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    r = lowlevel.run(["/usr/bin/true"], workspace=str(tmp_path))
    monkeypatch.undo()
    assert r.exit_code == 0, r.stderr
    assert teardown.pending() == 0
    assert _run_dirs(os.getpid()) == []
    assert _records_of(os.getpid()) == []


_MANY_THEN_EXIT = """
import asyncio, json, os, sys
import lowlevel
from lowlevel.sandbox import aio, teardown
ws = sys.argv[1]
for _ in range(5):
    lowlevel.run(["/usr/bin/true"], workspace=ws)
async def main():
    await asyncio.gather(*(aio.arun(["/usr/bin/true"], workspace=ws) for _ in range(16)))
asyncio.run(main())
print(json.dumps({"pid": os.getpid(), "pending": teardown.pending()}), flush=True)
"""


def test_exit_right_after_runs_leaves_nothing(root_with_cgroups: None, tmp_path) -> None:
    out = subprocess.run([sys.executable, "-c", _MANY_THEN_EXIT, str(tmp_path)], capture_output=True,
                         text=True, timeout=90, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert _run_dirs(info["pid"]) == []
    assert _records_of(info["pid"]) == []


_RUN_IN_A_LATER_EXIT_HANDLER = """
import atexit, json, os, sys
def late():  # registered before lowlevel's own handler, so it runs after it (atexit is LIFO)
    import lowlevel
    from lowlevel.sandbox import teardown
    lowlevel.run(["/usr/bin/true"], workspace=sys.argv[1])
    print(json.dumps({"pid": os.getpid(), "pending": teardown.pending()}), flush=True)
atexit.register(late)
import lowlevel
lowlevel.run(["/usr/bin/true"], workspace=sys.argv[1])
"""


def test_a_run_from_a_later_exit_handler_tears_down_inline(root_with_cgroups: None, tmp_path) -> None:
    out = subprocess.run([sys.executable, "-c", _RUN_IN_A_LATER_EXIT_HANDLER, str(tmp_path)], capture_output=True,
                         text=True, timeout=90, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["pending"] == 0  # lowlevel's exit handler had run: nothing handed to the thread
    assert _run_dirs(info["pid"]) == []
    assert _records_of(info["pid"]) == []


_RUN_THEN_STOP = """
import os, signal, sys
import lowlevel
from lowlevel.host import later
ws = sys.argv[1]
# Keep the teardown thread from finishing anything: every run's teardown stays pending.
later._cond.acquire()
lowlevel.run(["/usr/bin/true"], workspace=ws)
sys.stdout.write(f"{os.getpid()} {later._queue.__len__()}\\n")
sys.stdout.flush()
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_caller_killed_with_teardown_pending_leaves_what_cleanup_removes(root_with_cgroups: None, tmp_path) -> None:
    records = tmp_path / "records"  # this test's own record directory (never /run/lowlevel)
    records.mkdir(mode=0o700)
    ws = tmp_path / "ws"
    ws.mkdir()
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "LOWLEVEL_RECORD_DIR": str(records)}
    proc = subprocess.Popen([sys.executable, "-c", _RUN_THEN_STOP, str(ws)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout is not None
        pid_s, queued = proc.stdout.readline().split()
        pid = int(pid_s)
        assert int(queued) == 1  # handed over, not done
        assert _run_dirs(pid), "the pending run's cgroup should still exist"
        assert _records_of(pid, str(records)), "its run record should still exist"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    cleanup = subprocess.run([sys.executable, "-m", "lowlevel", "cleanup", "--json"], capture_output=True, text=True,
                             timeout=60, env=env, cwd="/")
    assert cleanup.returncode == 0, cleanup.stdout + cleanup.stderr
    assert _run_dirs(pid) == []
    assert _records_of(pid, str(records)) == []


_FIRST_RUN_IN_AN_EXIT_HANDLER = """
import atexit, json, os, sys
def late():
    import lowlevel
    from lowlevel.sandbox import teardown
    handed = []
    real = teardown.defer
    def counted(pid, cgroup):
        done = real(pid, cgroup)
        handed.append(done)
        return done
    teardown.defer = counted  # how many runs were handed to the thread (pending() may be 0 already)
    lowlevel.run(["/usr/bin/true"], workspace=sys.argv[1])
    teardown.drain(30)
    print(json.dumps({"pid": os.getpid(), "pending": sum(handed)}), flush=True)
if sys.argv[2] == "before":
    atexit.register(late)
import lowlevel  # the lazy facade: lowlevel.sandbox.teardown is imported by the first run only
if sys.argv[2] == "after":
    atexit.register(late)
if sys.argv[2] == "control":
    late()
"""


@pytest.mark.parametrize("when", ["before", "after", "control"])
def test_a_first_run_from_an_exit_handler_leaves_nothing(root_with_cgroups: None, tmp_path, when: str) -> None:
    """The process's first run made by an exit handler (registered before or after ``import
    lowlevel``): teardown's own exit handler, registered by that run's import, is never called
    (the red team found its cgroups in every v1 hierarchy and its run record left, for ``lowlevel
    cleanup``). Now such a run tears down inline. Control: the same run from the main program."""
    out = subprocess.run([sys.executable, "-c", _FIRST_RUN_IN_AN_EXIT_HANDLER, str(tmp_path), when],
                         capture_output=True, text=True, timeout=90, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["pending"] == (1 if when == "control" else 0)
    assert _run_dirs(info["pid"]) == []
    assert _records_of(info["pid"]) == []


_FINISH_WHILE_FINALIZING = """
import os, sys
from lowlevel.sandbox import teardown
pid = os.fork()
if pid == 0:
    os._exit(0)
sys.modules.pop("resource", None)
saved, sys.meta_path = sys.meta_path, None  # as during the interpreter's finalization: no import works
try:
    teardown.finish(pid, None)
finally:
    sys.meta_path = saved
print("reaped", not os.path.exists(f"/proc/{pid}"))
"""


def test_teardown_reaps_while_the_interpreter_finalizes() -> None:
    """An arun cancelled by a ^C is closed by its coroutine's finalizer while the interpreter
    shuts down; teardown's reap was ``os.wait4``, which imports ``resource`` for its rusage:
    "ImportError: sys.meta_path is None" and a traceback (a kill campaign's anomaly). The reap
    needs no rusage: ``os.waitpid``. Here the import machinery is switched off as finalization
    does, and the child is reaped."""
    out = subprocess.run([sys.executable, "-c", _FINISH_WHILE_FINALIZING], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0 and out.stdout.strip() == "reaped True", out.stderr
