"""Hold back Python-level signal handlers while a resource is made and recorded.

CPython runs a Python signal handler (``KeyboardInterrupt`` from SIGINT, a framework's SIGTERM
handler raising ``SystemExit``...) at the first bytecode boundary after the C signal handler
ran, in the main thread: that can be right after ``os.pipe()``, ``os.posix_spawn()`` or the
``recvmsg`` of the anchor's READY returned and before their result is stored where
:meth:`lowlevel.sandbox.launcher.Run.close` finds it. The exception then loses the fd (or the anchor's
PID), measured at 1 Session start in 80 and 1 Pool call in 80 under random SIGINTs.

:class:`deferred_interrupts` closes that window: inside it, each of :data:`SIGNALS` whose
handler is a Python callable is swapped for one that only records the signal; on exit the
original handlers are restored and each recorded signal is handed to its original handler, in
arrival order (so the ``KeyboardInterrupt`` arrives right after the block, with everything it
allocated already owned). Only the main thread runs Python handlers, so elsewhere it does
nothing. Blocks using it are short (no waits on the sandboxed program); a blocking system call
inside is retried after the recorded signal (PEP 475), so the signal is delivered after it.

Source: the ``signal`` module documentation ("Execution of Python signal handlers"), PEP 475.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the C module behind signal (no stub)
import signal
import threading
from types import FrameType, TracebackType

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: Signals whose Python handlers are held back (SIG_DFL and SIG_IGN ones are left alone).
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM,
           signal.SIGUSR1, signal.SIGUSR2)
_SIGNAL_NUMBERS = tuple(int(sig) for sig in SIGNALS)


class deferred_interrupts:  # noqa: N801 (used as a context manager, like contextlib's)
    """``with deferred_interrupts(): fd = os.pipe(); owner.append(fd)`` — atomic under signals.

    Re-entrant (an inner block records into the outer one). Exceptions of the original handlers
    are raised from ``__exit__``, after the block's own cleanup.
    """

    __slots__ = ("saved", "pending")

    def __init__(self) -> None:
        self.saved: dict[int, Any] = {}
        self.pending: list[tuple[int, FrameType | None]] = []

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append((signum, frame))

    def __enter__(self) -> deferred_interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self
        try:
            # _signal: the signal module's functions without their enum conversions (~27 enum
            # constructions per run, a tenth of a millisecond), same semantics.
            for sig in _SIGNAL_NUMBERS:
                handler = _signal.getsignal(sig)
                if callable(handler):
                    _signal.signal(sig, self._record)
                    self.saved[sig] = handler
        except BaseException:
            self.__exit__(None, None, None)  # an original handler raised: hand over what we held
            raise
        return self

    def _restore(self) -> BaseException | None:
        """Put every original handler back, even if one of them (already back) raises meanwhile:
        a KeyboardInterrupt between two ``signal.signal`` calls left the later signals recorded
        into this finished block forever (a SIGTERM then never reached its handler). Returns
        the first exception raised meanwhile."""
        items = list(self.saved.items())
        self.saved.clear()
        first: BaseException | None = None
        while items:
            try:
                while items:
                    sig, handler = items[-1]
                    _signal.signal(sig, handler)
                    items.pop()
            except BaseException as err:  # noqa: BLE001 (raised by our caller once all are back)
                first = err if first is None else first
        return first

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        originals = dict(self.saved)
        raised = self._restore()
        pending, self.pending = self.pending, []
        for i, (signum, frame) in enumerate(pending):
            try:
                originals[signum](signum, frame)
            except BaseException:
                for later, _frame in pending[i + 1:]:
                    signal.raise_signal(later)  # their own handlers run them next, none is lost
                raise
        if raised is not None:
            raise raised
