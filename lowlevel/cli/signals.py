"""Signals during ``lowlevel run``/``replay``/``image import``: SIGTERM, SIGHUP and SIGQUIT become
:class:`Terminated` (as SIGINT is KeyboardInterrupt) so every cleanup runs before the exit 128+N,
and :class:`Interrupted` carries what :func:`lowlevel.cli.main` reports.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType


def is_interrupt(err: BaseException) -> bool:
    """A ``KeyboardInterrupt``, or CPython 3.11's ``RuntimeError("Error calling __set_name__
    ...")`` around one: a ^C while a class statement set up its fields (a dataclass's
    ``field()``: ``type.__new__`` wraps what ``__set_name__`` raised; 3.12 no longer wraps)."""
    return isinstance(err, KeyboardInterrupt) or (
        type(err) is RuntimeError and isinstance(err.__cause__, KeyboardInterrupt))


class Terminated(BaseException):
    """SIGTERM, SIGHUP or SIGQUIT arrived during ``run`` or ``replay``.

    Raised from the signal handler, like KeyboardInterrupt for SIGINT, so every ``finally``
    runs before the CLI exits 128+N: the sandbox is killed and reaped and the workspace given
    back to its owners (with the default action the process would die with the tree still
    owned by the sandbox's uid). A BaseException, so ``except Exception`` cannot swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

#: Signals turned into :class:`Terminated`; SIGINT is KeyboardInterrupt already. SIGQUIT
#: (``^\``) too: its default action would dump core and skip the cleanup (the sandbox left to
#: ``--die-with-parent``, the workspace not given back, the terminal not restored).
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def clean_shutdown() -> Iterator[None]:
    """Turn SIGTERM, SIGHUP and SIGQUIT into :class:`Terminated` while the block runs; restore after.

    The first signal raises; later ones are ignored, so a second SIGTERM cannot cut the
    cleanup short. A signal the caller ignores (``nohup`` ignores SIGHUP) stays ignored.
    Outside the main thread (``signal.signal`` refuses) nothing is installed.
    """
    def handler(signum: int, _frame: FrameType | None) -> None:
        for sig in SHUTDOWN_SIGNALS:
            if sig in old:
                signal.signal(sig, signal.SIG_IGN)
        raise Terminated(signum)

    old: dict[int, object] = {}
    try:
        for sig in SHUTDOWN_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                old[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for signum, previous in old.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]


class SignalRecorder:
    """SIGTERM, SIGHUP, SIGQUIT and SIGINT recorded, not acted on: :attr:`signum` is the first
    one's number (later ones are ignored). For ``lowlevel mcp``, whose server stops by itself on
    a signal (its event loop's own handlers) and must not be killed before or after that: while
    it imports and starts, and while it waits for its calls' last work (a session's commit).
    Main thread only (elsewhere nothing is installed); :meth:`restore` puts the old handlers back.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}
        try:
            for sig in (*SHUTDOWN_SIGNALS, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._record)
        except ValueError:  # not the main thread
            pass

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum

    def pending(self) -> int | None:
        """The first signal recorded, or None."""
        return self.signum

    def restore(self) -> None:
        for sig, previous in self._old.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._old.clear()


class Interrupted(BaseException):
    """SIGINT, SIGTERM, SIGHUP or SIGQUIT ended ``lowlevel run``; carries what main() reports."""

    def __init__(self, signum: int, workspace: str | None, removed: bool) -> None:
        super().__init__(signum)
        self.signum = signum
        self.workspace = workspace
        self.removed = removed
