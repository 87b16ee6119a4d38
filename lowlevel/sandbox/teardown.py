"""The end of a finished one-shot run off its result path: reap the anchor, remove the run's cgroup.

When a run's Result is built the sandbox is gone (bwrap, the PID 1 of its PID namespace, was reaped
by the anchor: ``zap_pid_ns_processes``), but two things of it remain: the anchor itself, tearing
down its private mount namespace (the overlay, its tmpfs: RCU grace periods, ~0.3-1 ms), and the
run's cgroup directories, which can be removed only once the anchor has left them by exiting.
:meth:`lowlevel.sandbox.launcher.Run.close` used to wait for both before ``lowlevel.run`` returned;
it now hands them to lowlevel's worker threads (:func:`defer`, :mod:`lowlevel.host.later`): one
``wait4``\\s the anchor and then removes the cgroup (:meth:`lowlevel.host.cgroups.RunCgroup.remove`,
which also removes the run record once every directory is gone).

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
- The process does not exit with teardown pending, a forked child drops the parent's, and a run
  whose teardown cannot be handed over (no thread can start, the interpreter is exiting) tears
  down inline: the queue is :mod:`lowlevel.host.later`'s, shared with the disk upper's close
  (:func:`lowlevel.workspace.disk_upper.close_later`), which guarantees these for every item
  (an ``atexit`` drain bounded by its ``EXIT_DRAIN_TIMEOUT_S``; ``remove()`` gives up after 2 s
  per run, as it did inline).
- Only pids and cgroup objects cross to the thread, no fd: the Run closes its fds itself.

:func:`drain` waits until everything handed over is done (the disk uppers' closes too): call it
before counting this process's children, cgroup directories, fds or loop devices
(tests/helpers/hygiene.py does).

Sources: wait4(2); cgroups(7) (a cgroup directory with tasks cannot be removed: ``EBUSY``);
fcntl(2) "Open file description locks"; atexit(3).
"""

from __future__ import annotations

import functools
import os

from lowlevel.host import cgroups as _cgroups
from lowlevel.host import later as _later
from lowlevel.sandbox.state import log

#: False: :meth:`Run.close` reaps and removes inline, as before (for A/B measurements: bench/).
ENABLED = True

#: How long the exit handler waits for pending teardown, seconds (:mod:`lowlevel.host.later`'s).
EXIT_DRAIN_TIMEOUT_S = _later.EXIT_DRAIN_TIMEOUT_S

#: :func:`lowlevel.host.later.pending` and :func:`~lowlevel.host.later.drain`: the one queue.
pending = _later.pending
drain = _later.drain


def finish(pid: int | None, cgroup: _cgroups.RunCgroup | None) -> None:
    """Reap the anchor ``pid`` (blocking: it only tears down), then remove ``cgroup``."""
    if pid is not None:
        try:
            # waitpid, not wait4: wait4 imports ``resource`` for its rusage, which fails once the
            # interpreter is finalizing (an arun's close run by its coroutine's finalizer after a
            # ^C: "ImportError: sys.meta_path is None", a kill campaign's traceback), and no
            # rusage of the anchor is needed.
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # reaped by someone else (a SIGCHLD handler waiting for any child)
        except OSError as err:
            log.warning("lowlevel: cannot reap the anchor %s: %s", pid, err)
    if cgroup is not None:
        try:
            cgroup.remove()
        except Exception as err:  # noqa: BLE001 - logged as Run.close logged it; its record stays
            log.warning("lowlevel: cannot remove cgroup: %s", err)


def defer(pid: int | None, cgroup: _cgroups.RunCgroup | None) -> bool:
    """Hand a finished run's anchor ``pid`` (unreaped, or None) and ``cgroup`` (or None) to the
    worker threads (:func:`lowlevel.host.later.defer`); returns False (nothing handed over: the
    caller does it inline) when no thread can start (``pids.max``, ``RLIMIT_NPROC``) or the
    interpreter is exiting.

    Call only once no process of the run but the anchor exists (see the module docstring).
    """
    if pid is None and cgroup is None:
        return True
    return _later.defer(functools.partial(finish, pid, cgroup))


__all__ = ["ENABLED", "EXIT_DRAIN_TIMEOUT_S", "defer", "drain", "finish", "pending"]
