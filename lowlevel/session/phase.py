"""The phases of a session's life (:attr:`lowlevel.session.core.Core.phase`).

One concept: where a session is between its start and its close, in one value instead of
booleans: the core moves it forward (never back), the drivers and the gate read it.
"""

from __future__ import annotations

import enum


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
