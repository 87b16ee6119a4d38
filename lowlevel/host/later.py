"""Work a finished run leaves for later: lowlevel's one "close later" queue and its worker threads.

Two kinds of work use it, both off a run's result path: :mod:`lowlevel.sandbox.teardown` (reap a
one-shot run's anchor, remove its cgroup) and :func:`lowlevel.workspace.disk_upper.close_later`
(close the disk upper's last fd once the anchor exited: the ext4's unmount, the loop device's
clear). A work item is a callable of no arguments that does only what the kernel would do anyway
when this process dies (reap its children, close its fds) or what ``lowlevel cleanup`` does for it
(remove cgroups named by a run record): so nothing leaks if the process is killed with work pending.

What holds, for every item:

- **Done before exit.** An ``atexit`` handler :func:`drain`\\s the queue (bounded by
  :data:`EXIT_DRAIN_TIMEOUT_S`; every item is bounded on its own), and once the interpreter is
  exiting (our handler ran, the main thread stopped, or the main thread runs an exit handler)
  :func:`defer` refuses (returns False) so the caller does the work inline: daemon threads die
  with the process, and an exit handler registered during the exit is never called (atexit(3)).
- **Fork safety.** A forked child drops the parent's pending items (they are the parent's
  children, cgroups and fds) and starts its own workers on first use.
- **No thread, no loss.** When no worker can start (``pids.max``, ``RLIMIT_NPROC``) :func:`defer`
  returns False: the caller does the work inline.
- **Seen by drain.** :func:`drain` returns once every item handed over so far is done (also the
  ones a worker is running): call it before counting this process's children, cgroups, fds or
  loop devices (tests/helpers/hygiene.py does), and before reporting a resource as exhausted
  that pending work frees (``lowlevel.sandbox.prepare``: the uid leases of exiting anchors).

Workers: daemon threads named ``lowlevel-later``, one started on first use, and another (up to
:data:`MAX_WORKERS`) when a slow item (``defer(..., slow=True)``: a disk upper's 10-40 ms
unmount) finds others still waiting, so such a backlog does not pile up. Quick items (the
teardown) never add one: a teardown-only load keeps one thread, as before the two mechanisms
were merged (more workers cost arun c8 ~3% of its calls/s on this 2-vCPU VM, and 500
concurrent ``arun`` calls must not grow the caller's threads: tests/integration/test_aio.py).

Sources: atexit(3); fork(2) (only the calling thread is copied); ``os.register_at_fork``.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

#: How long the exit handler waits for pending work, seconds (each item is bounded on its own:
#: an anchor does nothing but exit, ``RunCgroup.remove`` retries ``EBUSY`` for 2 s, a disk
#: upper's close waits at most 30 s for its anchor).
EXIT_DRAIN_TIMEOUT_S = 30.0
#: At most this many worker threads per process.
MAX_WORKERS = 4

log = logging.getLogger("lowlevel")

_cond = threading.Condition()  # an RLock: a thread holding it may still defer (tests hold it)
_queue: collections.deque[Callable[[], None]] = collections.deque()
_busy = 0  # items taken by a worker and not finished
_threads: list[threading.Thread] = []
_pid = os.getpid()
_exiting = False  # the exit handler ran: later items (another atexit handler's) are done inline


def _reset_after_fork() -> None:
    global _cond, _busy, _threads, _pid
    _cond = threading.Condition()
    _queue.clear()
    _busy = 0
    _threads = []
    _pid = os.getpid()


os.register_at_fork(after_in_child=_reset_after_fork)


def _run(work: Callable[[], None]) -> None:
    try:
        work()
    except Exception as err:  # noqa: BLE001 - a work item logs its own; this is the last resort
        log.warning("lowlevel: deferred work failed: %s", err)


def _work() -> None:
    global _busy
    while True:
        with _cond:
            while not _queue:
                _cond.wait()
            work = _queue.popleft()
            _busy += 1
        try:
            _run(work)
        finally:
            with _cond:
                _busy -= 1
                _cond.notify_all()


def exit_started() -> bool:
    """True when the interpreter is exiting: work handed over now might never be done.

    Our exit handler may never run: registered by an import made inside another exit handler
    (the lazy facade: a process's first run there), it is not called (atexit(3) handlers added
    during the exit are not), and the daemon threads' work dies with the process (the red team
    found such a run's cgroups and record left for ``lowlevel cleanup``). Signs, any of which
    means inline work (always correct, only slower): our handler ran; the main thread was
    stopped (``threading._shutdown``, before the exit handlers, when threading was imported
    earlier); the main thread's outermost frame is a function called from C, i.e. an exit
    handler, not a program's ``<module>`` code or runpy's (``python -m``). An embedding that calls
    Python functions from C on its main thread also reads as exiting: it gets inline work.
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


def defer(work: Callable[[], None], *, slow: bool = False) -> bool:
    """Hand ``work`` (no arguments; bounded; see the module docstring for what it may do) to a
    worker thread. ``slow``: the item may take tens of ms (a disk upper's unmount), so a backlog
    of items may start another worker (up to :data:`MAX_WORKERS`); the quick ones (a teardown,
    ~0.6 ms) never do: one worker keeps up with them, and more cost CPU (bench/README.md
    "Teardown nits"). Returns False, having handed over nothing, when the interpreter is exiting
    or no worker can start: the caller then does the work inline."""
    global _threads
    if exit_started():
        return False
    with _cond:
        alive = [t for t in _threads if t.is_alive()]
        if not alive or (slow and _queue and len(alive) < MAX_WORKERS):  # none yet, or a slow backlog
            t = threading.Thread(target=_work, name="lowlevel-later", daemon=True)
            try:
                t.start()
            except RuntimeError:
                if not alive:
                    return False  # no worker at all: inline
            else:
                alive.append(t)
        _threads = alive
        _queue.append(work)
        _cond.notify_all()
    return True


def pending() -> int:
    """How many items are handed over and not finished."""
    with _cond:
        return len(_queue) + _busy


def drain(timeout_s: float | None = None) -> bool:
    """Wait until every item handed over so far is done; True when it is (False: ``timeout_s``
    seconds passed first)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _cond:
        while _queue or _busy:
            if not any(t.is_alive() for t in _threads):
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
    for work in items:  # no thread to do it: do it here
        _run(work)
    return True


def _at_exit() -> None:
    global _exiting
    _exiting = True
    drain(EXIT_DRAIN_TIMEOUT_S)


atexit.register(_at_exit)

__all__ = ["EXIT_DRAIN_TIMEOUT_S", "MAX_WORKERS", "defer", "drain", "exit_started", "pending"]
