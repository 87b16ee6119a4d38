"""KeyboardInterrupt between an fd's arrival in the caller and its registration leaks the fd.

SIGINT at random instants in long-lived callers (``tests``: 80-150 trials per driver) showed
1 Session start in 80 leaking a pipe pair, 1 Pool call in 80 a pipe pair, 1 Session start in
150 a pidfd. CPython raises KeyboardInterrupt at the first check after a C call returns, so an
fd a call just made (``os.pipe``, ``os.pidfd_open``, the ``SCM_RIGHTS`` fds of the anchor's
READY in ``socket.recv_fds``) is lost before ``Run._own`` records it; with the overlay, the
READY's second fd is the upper directory, whose tmpfs stays pinned while the fd lives. The
process's sandbox is still killed and reaped (no process survives: checked by the same trials).

Made deterministic here: a trace function raises KeyboardInterrupt in ``socket.recv_fds`` right
after ``recvmsg`` returned the READY. Not fixed: it needs SIGINT deferred (a handler swap in the
main thread) around every allocate-and-register step of launcher.py and session.py, or the
allocations moved into C; left to the lead.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from types import FrameType
from typing import Any

import pytest

import lowlevel

pytestmark = [pytest.mark.bwrap]


def _fds() -> dict[int, str]:
    out = {}
    for n in os.listdir("/proc/self/fd"):
        try:
            out[int(n)] = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            pass  # the listing's own fd
    return out


@pytest.mark.xfail(strict=True, reason="an fd received or made just before a KeyboardInterrupt is never registered, "
                   "so Run.close() cannot close it (needs SIGINT deferral around allocation: architectural)")
def test_interrupt_right_after_ready_leaks_nothing() -> None:
    ws = tempfile.mkdtemp(prefix="rt-intr-", dir="/tmp")
    try:
        lowlevel.run(["true"], workspace=ws)  # warm: probes, caches
        before = _fds()
        armed = {"hit": False}
        code = socket.recv_fds.__code__
        line = next(n for _, _, n in code.co_lines() if n is not None and n > code.co_firstlineno + 10)

        def tracer(frame: FrameType, event: str, arg: Any) -> Any:
            if frame.f_code is code:
                def local(f: FrameType, ev: str, a: Any) -> Any:
                    if ev == "line" and f.f_lineno >= line and not armed["hit"] and "ancdata" in f.f_locals:
                        armed["hit"] = True
                        raise KeyboardInterrupt
                    return local
                return local
            return None

        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                lowlevel.run(["sleep", "30"], workspace=ws, timeout=60)
        finally:
            sys.settrace(None)
        assert armed["hit"]
        leaked = {fd: what for fd, what in _fds().items() if fd not in before}
        assert not leaked, leaked
    finally:
        shutil.rmtree(ws, ignore_errors=True)
