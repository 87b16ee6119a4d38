"""A signal handler's exception (^C's KeyboardInterrupt) at the worst instant leaks nothing.

SIGINT at random instants in long-lived callers showed 1 Session start in 80 leaking a pipe
pair, 1 Pool call in 80 a pipe pair, 1 Session start in 150 a pidfd: CPython runs the Python
handler at the first bytecode boundary after a C call returns, so an fd a call just made
(``os.pipe``, ``os.pidfd_open``, the ``SCM_RIGHTS`` fds of the anchor's READY in
``socket.recv_fds``), or the anchor's PID from ``os.posix_spawn``, was lost before ``Run``
recorded it. lowlevel.sandbox._interrupts holds the handlers back around those steps.

Made deterministic here: a profile function sends the process a real SIGINT
(``signal.raise_signal``) right as the chosen call returns, so Python's handler runs at that
exact point. Control: the same profile hook outside a deferred block loses an ``os.pipe()``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
from helpers.hygiene import children, open_fds, settle

import lowlevel

pytestmark = [pytest.mark.bwrap]


@contextmanager
def _sigint_when_returning(target: Any, nth: int = 1) -> Iterator[dict[str, int]]:
    """SIGINT this process as the ``nth`` call of ``target`` (a builtin or a Python function)
    returns."""
    code = getattr(target, "__code__", None)

    def hit(frame: FrameType, event: str, arg: Any) -> bool:
        return (event == "c_return" and arg is target) or (event == "return" and code is not None
                                                           and frame.f_code is code)
    with _sigint_at(hit, nth) as state:
        yield state


@contextmanager
def _sigint_at(hit: Any, nth: int) -> Iterator[dict[str, int]]:
    """Count the profiler events ``hit(frame, event, arg)`` accepts; with ``nth`` > 0, SIGINT
    this process at the ``nth`` of them."""
    state = {"calls": 0, "sent": 0}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if not state["sent"] and hit(frame, event, arg):
            state["calls"] += 1
            if state["calls"] == nth:
                state["sent"] = 1
                signal.raise_signal(signal.SIGINT)

    sys.setprofile(profile)
    try:
        yield state
    finally:
        sys.setprofile(None)


def _leaks_nothing(call: Callable[[], Any], target: Any, nth: int = 1) -> None:
    before = open_fds()
    with _sigint_when_returning(target, nth) as state:
        with pytest.raises(KeyboardInterrupt):
            call()
    assert state["sent"], f"{target} was not called {nth} time(s)"
    leaked = {fd: what for fd, what in open_fds().items() if fd not in before}
    assert not leaked, leaked
    deadline = time.monotonic() + 5
    while children() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert children() == [], "a process of the sandbox outlived the interrupted call"


@pytest.fixture
def ws() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="intr-", dir="/tmp")
    try:
        lowlevel.run(["true"], workspace=path)  # warm: probes, caches
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(("target", "nth"), [
    (os.pipe, 1), (os.pipe, 3), (os.posix_spawn, 1), (os.pidfd_open, 1), (socket.recv_fds, 1),
], ids=["pipe1", "pipe3", "posix_spawn", "pidfd_open", "ready"])
def test_run_interrupted_right_after_an_fd_is_made(ws: str, target: Any, nth: int) -> None:
    _leaks_nothing(lambda: lowlevel.run(["sleep", "30"], workspace=ws, timeout=60), target, nth)


def test_session_start_interrupted_at_ready(ws: str) -> None:
    def start() -> None:
        with lowlevel.Session(workspace=ws):
            pass
    start()  # warm: the init executable's fd is opened once per process, and kept
    _leaks_nothing(start, socket.recv_fds)


@pytest.mark.parametrize("nth", [1, 2])
def test_session_command_interrupted_right_after_its_pipes(ws: str, nth: int) -> None:
    with lowlevel.Session(workspace=ws) as s:
        s.run(["true"])  # warm
        before = open_fds()
        with _sigint_when_returning(os.pipe, nth) as state:
            with pytest.raises(KeyboardInterrupt):
                s.run(["true"])
        assert state["sent"]
        assert s.run(["echo", "still serving"]).stdout == b"still serving\n"
    # The interrupted command's pipes belonged to the session (the command may have been sent
    # already); the session's close took them with its own.
    leaked = {fd: what for fd, what in open_fds().items() if fd not in before}
    assert not leaked, leaked


def test_control_an_undeferred_pipe_is_lost() -> None:
    before = open_fds()
    with _sigint_when_returning(os.pipe):
        with pytest.raises(KeyboardInterrupt):
            r, w = os.pipe()
    leaked = [fd for fd in open_fds() if fd not in before]
    assert len(leaked) == 2  # the attack works where nothing holds the handler back
    for fd in leaked:
        os.close(fd)


@contextmanager
def _sigint_at_open_in(code: Any, nth: int) -> Iterator[dict[str, int]]:
    """Count the files ``code`` (a function's code) opens (``os.open`` or ``open``); with
    ``nth`` > 0, SIGINT this process as the ``nth`` of those calls returns."""
    opens = (os.open, open)
    with _sigint_at(lambda frame, event, arg: event == "c_return" and frame.f_code is code
                    and any(arg is o for o in opens), nth) as state:
        yield state


# The interrupted open's file object is closed by its last reference going: Python says so
# (ResourceWarning, "unclosed file"), which is the point.
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_run_interrupted_while_its_cgroup_figures_are_read(ws: str) -> None:
    """After the program, the run reads its cgroups' figures (peak memory, pids, CPU): one file
    each, opened and closed by ``lowlevel.host.cgroupfs.read``. A SIGINT as any of those opens
    returns leaks nothing (a bare ``os.open`` lost its fd: 1 run in ~10 under random SIGINTs)."""
    from lowlevel.host import cgroupfs
    code = cgroupfs.read.__code__
    with _sigint_at_open_in(code, 0) as counted:
        lowlevel.run(["true"], workspace=ws)
    if counted["calls"] == 0:
        pytest.skip("no cgroup of the run is read here (no writable cgroup hierarchy)")
    for nth in range(1, counted["calls"] + 1):
        before = open_fds()
        with _sigint_at_open_in(code, nth) as state:
            with pytest.raises(KeyboardInterrupt):
                lowlevel.run(["true"], workspace=ws)
        assert state["sent"], nth
        leaked = {fd: what for fd, what in open_fds().items() if fd not in before}
        assert not leaked, (nth, leaked)
        # The removal of the run's cgroup reads cgroup.procs too: a ^C there left the
        # directories for the life of this process (and failed later tests' hygiene checks).
        assert not _run_cgroups_of(os.getpid()), (nth, _run_cgroups_of(os.getpid()))


def _run_cgroups_of(pid: int) -> list[str]:
    if pid == os.getpid():
        settle()  # the finished runs' cgroups are removed off the result path (lowlevel.sandbox.teardown)
    from lowlevel.host import cgroup_detect
    left = []
    for h in cgroup_detect.detect_cgroups().hierarchies:
        if h.base is not None and os.path.isdir(h.base):
            left += [os.path.join(h.base, e) for e in os.listdir(h.base) if e.startswith(f"run-{pid}-")]
    return left
