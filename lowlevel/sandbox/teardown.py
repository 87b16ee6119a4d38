"""The end of a finished one-shot run off its result path: reap the anchor, remove the run's cgroup.

When a run's Result is built the sandbox is gone (bwrap, the PID 1 of its PID namespace, was reaped
by the anchor: ``zap_pid_ns_processes``), but two things of it remain: the anchor itself, tearing
down its private mount namespace (the overlay, its tmpfs: RCU grace periods, ~0.3-1 ms), and the
run's cgroup directories, which can be removed only once the anchor has left them by exiting.
:meth:`lowlevel.sandbox.launcher.Run.close` used to wait for both before ``lowlevel.run`` returned;
it now hands them to one reaper thread per process (:func:`defer`), which ``wait4``\\s the anchor and
then removes the cgroup (:meth:`lowlevel.host.cgroups.RunCgroup.remove`, which also removes the run
record once every directory is gone).

Why this cannot leak, and cannot weaken a run:

- Nothing of the sandbox runs any more: the hand-over happens only after the anchor's EXIT (or its
  exit) and after bwrap's pidfd reported exit, i.e. no process of the run but the anchor exists.
- The per-run uid lease is an open-file-description lock held by the anchor's own fd
  (:class:`lowlevel.workspace.uids.UidLease`): it is free exactly when the anchor has exited, so the
  uid cannot be leased again while anything of its run exists, whoever reaps the anchor, and when.
- The cgroup's run record (:mod:`lowlevel.host.run_records`) is removed only by ``remove()``, after
  its last directory: a caller killed with teardown pending leaves the record, and ``lowlevel
  cleanup`` (or the next :func:`lowlevel.host.cgroup_detect.detect_cgroups` sweep) removes what it
  names, as for a caller killed mid-run; the anchor dies with the caller (its parent-death signal).
- The process does not exit with teardown pending: an ``atexit`` handler :func:`drain`\\s the queue
  (bounded: ``remove()`` gives up after 2 s per run, as it did inline), and a run once the
  interpreter is exiting (from any exit handler: the main thread has stopped) tears down inline.
- Only pids and cgroup objects cross to the thread, no fd: the Run closes its fds itself.
- A forked child drops the parent's pending items (they are the parent's children and cgroups).

:func:`drain` waits until everything handed over is done: call it before counting this process's
children or cgroup directories (tests/helpers/hygiene.py does).

Sources: wait4(2); cgroups(7) (a cgroup directory with tasks cannot be removed: ``EBUSY``);
fcntl(2) "Open file description locks"; atexit(3).
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time

from lowlevel.host import cgroups as _cgroups
from lowlevel.sandbox.state import log

#: False: :meth:`Run.close` reaps and removes inline, as before (for A/B measurements: bench/).
ENABLED = True

#: How long the exit handler waits for pending teardown, seconds (each run's is bounded: the
#: anchor does nothing but exit, ``RunCgroup.remove`` retries ``EBUSY`` for 2 s).
EXIT_DRAIN_TIMEOUT_S = 30.0

_cond = threading.Condition()
_queue: collections.deque[tuple[int | None, _cgroups.RunCgroup | None]] = collections.deque()
_busy = 0  # items taken by the thread and not finished
_thread: threading.Thread | None = None
_pid = os.getpid()
_exiting = False  # the exit handler ran: later runs (another atexit handler's) tear down inline


def _reset_after_fork() -> None:
    global _cond, _thread, _busy, _pid
    _cond = threading.Condition()
    _queue.clear()
    _busy = 0
    _thread = None
    _pid = os.getpid()


os.register_at_fork(after_in_child=_reset_after_fork)


def finish(pid: int | None, cgroup: _cgroups.RunCgroup | None) -> None:
    """Reap the anchor ``pid`` (blocking: it only tears down), then remove ``cgroup``."""
    if pid is not None:
        try:
            os.wait4(pid, 0)
        except ChildProcessError:
            pass  # reaped by someone else (a SIGCHLD handler waiting for any child)
        except OSError as err:
            log.warning("lowlevel: cannot reap the anchor %s: %s", pid, err)
    if cgroup is not None:
        try:
            cgroup.remove()
        except Exception as err:  # noqa: BLE001 - logged as Run.close logged it; its record stays
            log.warning("lowlevel: cannot remove cgroup: %s", err)


def _work() -> None:
    global _busy
    while True:
        with _cond:
            while not _queue:
                _cond.wait()
            pid, cgroup = _queue.popleft()
            _busy += 1
        try:
            finish(pid, cgroup)
        finally:
            with _cond:
                _busy -= 1
                _cond.notify_all()


def _exit_started() -> bool:
    """True when the interpreter is exiting: teardown handed over now might never be done.

    Our exit handler may never run: registered by an import made inside another exit handler
    (the lazy facade: a process's first run there), it is not called (atexit(3) handlers added
    during the exit are not), and the daemon thread's work dies with the process (the red team
    found such a run's cgroups and record left for ``lowlevel cleanup``). Signs, any of which
    means inline teardown (always correct, only slower): our handler ran; the main thread was
    stopped (``threading._shutdown``, before the exit handlers, when threading was imported
    earlier); the main thread's outermost frame is a function called from C, i.e. an exit
    handler, not a program's ``<module>`` code or runpy's (``python -m``). An embedding that calls
    Python functions from C on its main thread also reads as exiting: it gets inline teardown.
    """
    if _exiting or sys.is_finalizing():
        return True
    main = threading.main_thread()
    if not main.is_alive():
        return True
    frame = sys._current_frames().get(main.ident or -1)
    while frame is not None and frame.f_back is not None:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name != "<module>" and frame.f_globals.get("__name__") != "runpy"


def defer(pid: int | None, cgroup: _cgroups.RunCgroup | None) -> bool:
    """Hand a finished run's anchor ``pid`` (unreaped, or None) and ``cgroup`` (or None) to the
    reaper thread; returns False (nothing handed over: the caller does it inline) when the thread
    cannot start (``pids.max``, ``RLIMIT_NPROC``).

    Call only once no process of the run but the anchor exists (see the module docstring).
    """
    global _thread
    if pid is None and cgroup is None:
        return True
    if _exit_started():
        return False
    with _cond:
        if _thread is None or not _thread.is_alive():
            t = threading.Thread(target=_work, name="lowlevel-teardown", daemon=True)
            try:
                t.start()
            except RuntimeError:
                return False
            _thread = t
        _queue.append((pid, cgroup))
        _cond.notify_all()
    return True


def pending() -> int:
    """How many runs' teardown is handed over and not finished."""
    with _cond:
        return len(_queue) + _busy


def drain(timeout_s: float | None = None) -> bool:
    """Wait until every teardown handed over so far is done; True when it is (False: ``timeout_s``
    seconds passed first)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _cond:
        while _queue or _busy:
            if _thread is None or not _thread.is_alive():
                break  # cannot happen but after a fork, which cleared the queue
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            _cond.wait(left)
        if _queue and os.getpid() == _pid:
            items = list(_queue)
            _queue.clear()
        else:
            items = []
    for pid, cgroup in items:  # no thread to do it: do it here
        finish(pid, cgroup)
    return True


def _at_exit() -> None:
    global _exiting
    _exiting = True
    drain(EXIT_DRAIN_TIMEOUT_S)


atexit.register(_at_exit)

__all__ = ["ENABLED", "EXIT_DRAIN_TIMEOUT_S", "defer", "drain", "finish", "pending"]
