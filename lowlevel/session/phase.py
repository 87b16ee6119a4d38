"""The phases of a session's life (:attr:`lowlevel.session.core.Core.phase`).

One concept: where a session is between its start and its close, in one value instead of
booleans: the core moves it forward (never back), the drivers and the gate read it. A child
process forked while sessions were open gets their copies CLOSED (:func:`track`).
"""

from __future__ import annotations

import enum
import os
import weakref
from typing import Any

from lowlevel.errors import SessionError


class Phase(enum.Enum):
    """Where a session is in its life (:attr:`Core.phase`).

    STARTING: the sandbox is being set up (until the init's HELLO). OPEN: commands may run.
    ENDED: the session failed or ended by itself (the init died, idle/total timeout, an
    unresponsive init): :attr:`Core.failed` holds the SessionError every call raises. CLOSED:
    :meth:`Core.close` ran (``failed`` holds its SessionError unless the session had ended).
    """
    STARTING = "starting"
    OPEN = "open"
    ENDED = "ended"
    CLOSED = "closed"


_tracked: weakref.WeakSet[Any] = weakref.WeakSet()


def track(core: Any) -> None:
    """Mark ``core`` (a :class:`lowlevel.session.core.Core`: its ``phase`` and ``failed``) CLOSED
    in any child process forked from now on, with ``failed`` a SessionError(reason="forked").

    Why: the child's copy shares the parent's sandbox (its socket to the init, its pidfds, its
    cgroup): a child that ran commands raced the parent's own, and its close() (or a collection
    of its copy) killed the parent's sandbox, which the parent then reported as "the session's
    init exited" (a fresh-user trial). In the child every call now raises that error and
    close() does nothing; the parent's session is untouched. Source: os.register_at_fork
    (after_in_child runs in the child only, single-threaded: no lock is taken here).
    """
    _tracked.add(core)


def _in_forked_child() -> None:
    for core in list(_tracked):
        if core.phase is not Phase.CLOSED:
            core.failed = SessionError(f"this session belongs to process {os.getppid()}, which forked this one: a "
                                       "forked child cannot use it (open a session of its own)", "forked")
            core.phase = Phase.CLOSED


os.register_at_fork(after_in_child=_in_forked_child)
