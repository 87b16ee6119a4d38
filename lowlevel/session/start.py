"""Bringing a session's sandbox up: bwrap started from a lasting thread, then the init's HELLO.

One concept: the start handshake. The sandbox is a :class:`lowlevel.sandbox.launcher.Run` whose
program is the init (:mod:`lowlevel.session.protocol`); :func:`start_init` spawns it, follows the
launcher's setup reports, and waits for the init to say HELLO (or says why the sandbox never got
that far, as :func:`lowlevel.run` would).
"""

from __future__ import annotations

import functools
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from lowlevel.errors import LaunchError, LowlevelError
from lowlevel.host.fd_limit import FD_EXHAUSTED, open_files_hint
from lowlevel.sandbox.launcher import SETUP_TIMEOUT_S, Run
from lowlevel.session import protocol as proto

#: A start whose sandbox the kernel's OOM killer took before the init said HELLO: the session's
#: own cgroup counted the kill, whichever limit was met (its own, or the caller's memory cgroup
#: that the run cgroups nest in, shared with the caller's other sessions: bench/density.py).
START_OOM_MESSAGE = ("the session's sandbox was killed by the kernel's OOM killer before its init said hello: "
                     "memory is short (the session's Limits(memory_bytes=...), or the memory cgroup of the "
                     "caller, which its other sessions share, or the host's); close sessions or give them more memory")
#: How long bwrap's exit is waited for once the init said nothing (to say why it ended), seconds.
EXIT_REPORT_WAIT_S = 5.0


def start_init(r: Run, sock: socket.socket, child: socket.socket) -> tuple[int, int | None]:
    """Start the session's sandbox (``r``, whose program is the init, ``child`` its end of the
    socketpair, closed here once bwrap holds it) and wait for the init's HELLO on ``sock``.

    Returns ``(landlock_abi, init_host_pid)``: the Landlock ABI the init found (0: none) and its
    PID on the host (from ``SO_PASSCRED``; None if the kernel attached none). ``sock`` is left
    non-blocking without ``SO_PASSCRED``.

    Raises:
        LaunchError: the sandbox did not start within ``SETUP_TIMEOUT_S``, the init said no hello
            within :data:`~lowlevel.session.protocol.HELLO_TIMEOUT_S` after bwrap released it,
            or it speaks another protocol (the message says why, as :func:`lowlevel.run` would).
        WorkspaceError, PolicyError, UnsupportedError: as ``Run.prepare``.
    """
    r.prepare()
    spawn_from_lasting_thread(r.spawn)
    child.close()
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    poller = select.poll()
    assert r.json_r is not None and r.pidfd is not None and r.report is not None
    report_fd = r.report.fileno()
    for fd in (r.json_r, r.pidfd, r.out_r, r.err_r, sock.fileno(), report_fd):
        if fd is not None:
            poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaunchError(f"the session sandbox did not start within {SETUP_TIMEOUT_S:.0f} s",
                              argv=r.full_argv)
        for fd, _ev in poller.poll(left * 1000):
            if fd == report_fd:
                was_ready = r.ready
                r.read_report()
                if r.ready or r.report is None:
                    poller.unregister(fd)
                if r.ready and not was_ready:
                    deadline = time.monotonic() + proto.HELLO_TIMEOUT_S
                continue
            if fd == sock.fileno():
                if not r.ready:
                    r.read_report()  # READY is sent before bwrap starts: it is there
                hello = _hello(r, sock)
                if hello is not None:
                    return hello
                # EOF before HELLO: the init never ran (bwrap, or the anchor before it,
                # failed): say why, as run() does, not "the init exited".
                if r.wait_status is None and readable_within(r.pidfd, EXIT_REPORT_WAIT_S):
                    r.reap()
                while r.read_fd("err_r") or r.read_fd("out_r") or r.read_fd("json_r"):
                    pass
                if r.wait_status is not None and not any("exit-code" in d for d in r._docs()):
                    raise r.setup_error()  # names Limits(memory_bytes=...) when it is too small for a start
                if r.cgroup is not None and (r.cgroup.event_counts()[0] or 0) > 0:
                    raise LaunchError(START_OOM_MESSAGE, argv=r.full_argv)
                raise LaunchError("the session init exited before saying hello"
                                  + (f": {r.err.value()[0].decode('utf-8', 'replace').strip()}"
                                     if r.err.value()[0].strip() else ""), argv=r.full_argv)
            if fd == r.pidfd:
                r.reap()
                while r.read_fd("err_r") or r.read_fd("out_r") or r.read_fd("json_r"):
                    pass
                raise r.setup_error()
            attr = "json_r" if fd == r.json_r else "out_r" if fd == r.out_r else "err_r"
            if not r.read_fd(attr):
                poller.unregister(fd)

def _hello(r: Run, sock: socket.socket) -> tuple[int, int | None] | None:
    """Read the init's HELLO: ``(landlock_abi, init_host_pid)``; None at EOF (the init never said it)."""
    data, anc, _flags, _addr = sock.recvmsg(proto.HELLO_RECV_SIZE, socket.CMSG_SPACE(proto.UCRED.size))
    if not data:
        return None
    hello = proto.decode_hello(data)
    if hello is None:
        raise LaunchError("the session init sent a short hello: reinstall lowlevel", argv=r.full_argv)
    if hello.mtype != proto.MSG_HELLO or hello.version != proto.PROTO_VERSION:
        raise LaunchError(f"the session init speaks protocol {hello.version} (type {hello.mtype}), expected "
                          f"{proto.PROTO_VERSION}: reinstall lowlevel", argv=r.full_argv)
    pid = proto.sender_pid(anc)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 0)
    sock.setblocking(False)
    return hello.landlock_abi, pid



def spawn_from_lasting_thread(spawn: Callable[[], None]) -> None:
    """Call ``spawn`` (which starts bwrap) in a thread that lives as long as the process.

    bwrap's ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, and "the parent" is the *thread*
    that created the child: a Session created in a worker thread died with that thread (and
    ``alive`` still said True). A Session outlives its creator, so bwrap is spawned from the
    process-wide executor of :mod:`lowlevel.sandbox.aio`, whose threads are never shut down (see
    :func:`lowlevel.sandbox.aio._executor`); the main thread spawns itself (it lives as long as the
    process). Source: prctl(2) PR_SET_PDEATHSIG; bwrap(1) --die-with-parent.
    """
    me = threading.current_thread()
    if me is threading.main_thread() or me.name.startswith("lowlevel-aio"):
        spawn()  # lives as long as the process already (and never wait on our own executor)
        return
    from lowlevel.sandbox.aio import _executor
    _executor().submit(spawn).result()


def readable_within(fd: int | None, timeout_s: float) -> bool:
    """True when ``fd`` (None: never) turns readable within ``timeout_s`` seconds."""
    if fd is None:
        return False
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(timeout_s * 1000))


_P = ParamSpec("_P")
_R = TypeVar("_R")


def explain_fd_exhaustion(what: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a session step that makes fds in the caller (a start, a command's pipes) so that
    running out of them (EMFILE, ENFILE: a plain OSError, or the launcher's LaunchError) raises
    a LaunchError saying ``what`` failed, the caller's limits and what to do
    (:func:`lowlevel.host.fd_limit.open_files_hint`), with the same errno. Other errors, and
    lowlevel's other exception types, pass unchanged. Measured need: ``bench/density.py``
    (a soft RLIMIT_NOFILE of 1024 stops a caller near 90 Sessions)."""
    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def explained(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return fn(*args, **kwargs)
            except OSError as err:
                if (err.errno not in FD_EXHAUSTED or "RLIMIT_NOFILE" in str(err)
                        or (isinstance(err, LowlevelError) and not isinstance(err, LaunchError))):
                    raise
                raise LaunchError(f"{what} ({err.strerror or err}): {open_files_hint(err.errno)}",
                                  errno=err.errno) from err
        return explained
    return wrap
