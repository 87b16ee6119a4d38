"""What a caller holds of one started command, the part both drivers share: its argv and PID,
its new output, and its signals (:class:`lowlevel.Process`, :class:`lowlevel.AsyncProcess`)."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Protocol

from lowlevel.session.command import Command

if TYPE_CHECKING:
    from lowlevel.session.core import Core


class _Owner(Protocol):
    """The session a handle belongs to (sync or asyncio): its core, None before it started."""

    @property
    def _core(self) -> "Core | None": ...


class ProcessHandle:
    """The shared half of :class:`~lowlevel.session.sync.Process` and
    :class:`~lowlevel.session.aio.AsyncProcess`; each driver adds its own ``poll``/``wait``/``read``.

    Attributes:
        argv: the command as given (tuple of str).
    """

    def __init__(self, session: _Owner, cmd: Command) -> None:
        self._owner = session
        self._cmd = cmd
        self.argv = tuple(cmd.argv)

    @property
    def pid(self) -> int | None:
        """The command's PID inside the sandbox's PID namespace, None until it started."""
        return self._cmd.pid

    def _take_output(self) -> tuple[bytes, bytes]:
        """``(stdout, stderr)`` read since the last call (and forgotten)."""
        cmd = self._cmd
        out, err = bytes(cmd.new_out), bytes(cmd.new_err)
        cmd.new_out.clear()
        cmd.new_err.clear()
        return out, err

    def send_signal(self, signo: int) -> None:
        """Send ``signo`` to the command's process group (no-op once it has finished)."""
        core = self._owner._core
        assert core is not None
        core.signal(self._cmd, signo, tree=False)

    def kill(self) -> None:
        """SIGKILL the command's whole tree (its group and every descendant); its Result then
        has ``killed_by="cancelled"``. Returns at once; wait for the Result."""
        core = self._owner._core
        assert core is not None
        core.signal(self._cmd, signal.SIGKILL, tree=True)


__all__ = ["ProcessHandle"]
