"""The sync driver: :func:`run` (the sandbox layer's, without records) over one
:class:`~lowlevel.sandbox.launcher.Run`, waiting with ``poll(2)`` for what the run asks for: the
anchor's READY (or its early exit), the output pipes, stdin, the deadline, the anchor's EXIT.
:mod:`lowlevel.sandbox.aio` drives the same Run on an event loop.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Mapping, Sequence

from lowlevel.errors import LaunchError
from lowlevel.sandbox.launcher import DRAIN_TIMEOUT_S, SETUP_TIMEOUT_S, Run
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S, RunRequest
from lowlevel.sandbox.result import Result
from lowlevel.spec.policy import Policy


def _remaining(deadline: float | None, cap: float | None = None) -> float | None:
    if deadline is None:
        return cap
    left = max(0.0, deadline - time.monotonic())
    return left if cap is None else min(left, cap)


def _drive_sync(r: Run) -> Result:
    """prepare, spawn, the handshake, the supervision, then the Result (:meth:`Run.result`)."""
    r.prepare()
    r.spawn()
    poller = _handshake(r)
    _supervise(r, poller)
    return r.result()


def _handshake(r: Run) -> select.poll:
    """Wait for the anchor's READY (bwrap's pidfd), reading the pipes meanwhile; the poller
    returned watches the pipes still open.

    Raises:
        LaunchError: the anchor exited before READY (:meth:`Run.setup_error`), or the setup
            took more than :data:`SETUP_TIMEOUT_S` (the sandbox is killed and reaped first).
    """
    setup_deadline = time.monotonic() + SETUP_TIMEOUT_S
    poller = select.poll()
    assert r.report is not None and r.pidfd is not None and r.json_r is not None
    poller.register(r.report.fileno(), select.POLLIN)
    poller.register(r.pidfd, select.POLLIN)
    for fd in (r.out_r, r.err_r, r.json_r):
        if fd is not None:
            poller.register(fd, select.POLLIN)
    while not r.ready:
        left = setup_deadline - time.monotonic()
        if left <= 0:
            r.kill(None)
            r.reap()
            raise LaunchError(f"the sandbox did not finish setting up within {SETUP_TIMEOUT_S:.0f} s",
                              argv=r.full_argv)
        for fd, _ev in poller.poll(left * 1000):
            if r.report is not None and fd == r.report.fileno():
                if not r.read_report() and r.report is None:
                    poller.unregister(fd)
                if r.ready:
                    poller.unregister(fd)
                    break
            elif fd == r.pidfd:
                # The anchor exited before READY: setup failed.
                r.reap()
                while r.read_fd("err_r") or r.read_fd("out_r") or r.read_fd("json_r"):
                    pass
                raise r.setup_error()
            else:
                attr = "out_r" if fd == r.out_r else "err_r" if fd == r.err_r else "json_r"
                if not r.read_fd(attr):
                    poller.unregister(fd)
    return poller


def json_deferred(r: Run) -> bool:
    """Whether bwrap's ``--json-status-fd`` pipe is read only once the sandbox is gone, not while
    it runs: its documents (``child-pid``, then ``exit-code``: a few hundred bytes, far below a
    pipe's 64 KiB, so bwrap never blocks on it) are needed only by the verdict, except the
    ``child-pid`` of an audited run (:meth:`Run.feed_json` attaches the seccomp audit then). Two
    to three wake-ups of the driver per run fewer (issue 27)."""
    return r.json_r is not None and r.audit is None


def _supervise(r: Run, poller: select.poll) -> None:
    """From READY until the sandbox is gone (EXIT, or the anchor's exit) and the pipes are drained:
    feed stdin, read the output, and act on the deadline (:meth:`Run.on_deadline`)."""
    assert r.pidfd is not None
    if r.stdin_w is not None and not r.feed_stdin():
        poller.register(r.stdin_w, select.POLLOUT)
    report_no = -1  # the report socket's fd number while registered (EXIT: the sandbox is gone)
    if r.report is not None:
        report_no = r.report.fileno()
        poller.register(report_no, select.POLLIN)
    json_later = json_deferred(r)
    if json_later:
        assert r.json_r is not None
        poller.unregister(r.json_r)  # read once the sandbox is gone (see json_deferred)
    bwrap_done = False
    while True:
        if bwrap_done and json_later:
            json_later = False
            if r.read_fd("json_r") and r.json_r is not None:  # not at EOF yet: the drain below waits
                poller.register(r.json_r, select.POLLIN)
        open_fds = [fd for fd in (r.out_r, r.err_r, r.json_r, r.stdin_w) if fd is not None]
        if bwrap_done and not open_fds:
            break
        wait = _remaining(r.deadline)
        if bwrap_done:
            # bwrap is gone and the sandbox is dead: the pipes are at EOF or about to be.
            wait = DRAIN_TIMEOUT_S if wait is None else min(wait, DRAIN_TIMEOUT_S)
        events = poller.poll(None if wait is None else wait * 1000)
        if not events:
            if bwrap_done:
                for attr in ("out_r", "err_r", "json_r", "stdin_w"):
                    fd = getattr(r, attr)
                    if fd is not None:
                        poller.unregister(fd)
                        if attr != "stdin_w":
                            r.read_fd(attr)
                        r._close_fd(attr)
                break
            if r.deadline is not None and time.monotonic() >= r.deadline:
                r.on_deadline()
            continue
        for fd, _ev in events:
            if fd == report_no:
                if r.read_exit():
                    poller.unregister(report_no)
                    report_no = -1
                    poller.unregister(r.pidfd)
                    r.reap()  # the sandbox is gone: no wait for the anchor's own teardown
                    bwrap_done = True
                elif r.report is None:  # EOF without EXIT: the anchor's pidfd tells
                    poller.unregister(report_no)
                    report_no = -1
            elif fd == r.pidfd:
                if bwrap_done:
                    continue
                poller.unregister(fd)
                if report_no >= 0:
                    poller.unregister(report_no)
                    report_no = -1
                    r.read_exit()  # sent before it exited: bwrap's own status and rusage
                r.reap()
                bwrap_done = True
            elif fd == r.stdin_w:
                if r.feed_stdin():
                    poller.unregister(fd)
            elif fd in (r.out_r, r.err_r, r.json_r):
                attr = "out_r" if fd == r.out_r else "err_r" if fd == r.err_r else "json_r"
                if not r.read_fd(attr):
                    poller.unregister(fd)
            # else: an fd unregistered earlier in this batch (the report socket)
        if not bwrap_done and r.deadline is not None and time.monotonic() >= r.deadline:
            r.on_deadline()


def run(command: Sequence[str], *, policy: Policy | None = None, workspace: str | os.PathLike[str] | None = None,
        inputs: Sequence[str | os.PathLike[str] | tuple[str, str]] = (), timeout: float | None = DEFAULT_TIMEOUT_S,
        stdin: bytes | None = None, env: Mapping[str, str] | None = None, capture: bool = True,
        cwd: str | None = None, workspace_base: str | None = None,
        record: str | os.PathLike[str] | None = None, allow_sensitive_workspace: bool = False,
        stdio_fds: Sequence[int | None] | None = None, keep_workspace: bool = True,
        commit: bool | str = True, kill_after: float = 0.0) -> Result:
    """:func:`lowlevel.run` without records: the sandbox layer's run (see :func:`lowlevel.api.run`
    for the arguments, the Result and the errors).

    Raises:
        PolicyError: ``record`` is given (records are written a layer above, by
            :func:`lowlevel.record.record_run`: call :func:`lowlevel.run`), or a bad argument.
    """
    request = RunRequest(command, workspace=workspace, inputs=inputs, timeout=timeout, kill_after=kill_after,
                         stdin=stdin, env=env, capture=capture, cwd=cwd, workspace_base=workspace_base,
                         allow_sensitive_workspace=allow_sensitive_workspace, stdio_fds=stdio_fds,
                         keep_workspace=keep_workspace, commit=commit, record=record)
    return run_request(request, policy)


def run_request(request: RunRequest, policy: Policy | None = None,
                started: Callable[[Run], None] | None = None) -> Result:
    """Run one validated :class:`~lowlevel.sandbox.request.RunRequest` under ``policy``
    (default ``Policy()``) and wait for it: the sync driver over :class:`Run`.

    ``started``: called with the :class:`Run` once it is planned, before its sandbox starts
    (a server's shutdown keeps it to :meth:`Run.kill` from another thread; a kill before the
    spawn does nothing, so such a caller kills again until the call returns).

    Raises:
        PolicyError: ``request.record`` is set (see :func:`run`); and the errors of :func:`run`.
    """
    r = Run(request, policy=policy or Policy())
    try:
        if started is not None:
            started(r)  # what it raises ends the run here, cleaned up as any failure
        result = _drive_sync(r)
    except BaseException:
        r.close()
        r.discard_workspace_if_unused()
        r.finish_workspace(None)
        raise
    finally:
        r.close()
    out = r.finish_workspace(result)
    assert out is not None
    return out

__all__ = ["run", "run_request"]
