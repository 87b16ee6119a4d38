"""lowlevel.sandbox._interrupts.deferred_interrupts: every original handler comes back and no held
signal is lost, even when an original handler raises while the block ends."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

from lowlevel.sandbox import _interrupts
from lowlevel.sandbox._interrupts import SIGNALS, deferred_interrupts


class BoomError(Exception):
    pass


def boom(_signum: int, _frame: FrameType | None) -> None:
    raise BoomError


@pytest.fixture
def handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_signal_raising_while_handlers_are_restored_leaves_none_behind(
        handlers: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal arrives right after its handler is back, and that handler raises (a
    KeyboardInterrupt, in life) before the other handlers are back: they were left recording
    into the finished block, so those signals never reached their handlers again."""
    signal.signal(signal.SIGUSR1, boom)
    signal.signal(signal.SIGUSR2, boom)
    before = {s: signal.getsignal(s) for s in SIGNALS}
    real = _interrupts._signal.signal  # what the block calls (the signal module's C core)
    fired: list[int] = []

    def restoring(sig: int, handler: Any) -> Any:
        old = real(sig, handler)
        if handler is boom and not fired:
            fired.append(sig)
            os.kill(os.getpid(), sig)  # delivered at the next bytecode boundary, inside the restore
        return old

    with pytest.raises(BoomError):
        with deferred_interrupts():
            monkeypatch.setattr(_interrupts._signal, "signal", restoring)
    monkeypatch.undo()
    assert fired
    assert {s: signal.getsignal(s) for s in SIGNALS} == before


def test_held_signals_after_one_whose_handler_raises_still_arrive(handlers: None) -> None:
    got: list[int] = []
    signal.signal(signal.SIGUSR1, boom)
    signal.signal(signal.SIGUSR2, lambda s, _f: got.append(s))
    with pytest.raises(BoomError):
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
            assert got == []  # held
    assert got == [signal.SIGUSR2]
    # Control: outside a block, each arrives at once.
    os.kill(os.getpid(), signal.SIGUSR2)
    assert got == [signal.SIGUSR2, signal.SIGUSR2]
