"""asyncio driver: ``await arun(...)``, the same run as :func:`lowlevel.run`, on the event loop.

Each run is the launcher's :class:`~lowlevel.sandbox.launcher.Run` (prepare, spawn, handshake,
supervise, reap, result) driven by loop callbacks instead of ``poll(2)``: the anchor's pidfd,
its report socket and the output pipes are registered with ``loop.add_reader``, stdin with
``loop.add_writer``, the deadline with ``loop.call_later``. No thread per child, no polling
sleeps, nothing in the loop blocks on the child: ``os.wait4`` runs only once the anchor's pidfd
is readable (or it reported EXIT), and the wait for bwrap, the PID 1 of the sandbox's PID
namespace (which :meth:`Run.reap` does with a blocking poll), is an awaited reader on its pidfd.

The blocking steps of a run, ``prepare`` + ``spawn`` (workspace, uid lease, cgroup, fds, and
``posix_spawn`` of the anchor) and ``result`` (it reads, and commits or discards, the run's
upper layer: file work), run in one executor shared by the whole process
(``EXECUTOR_THREADS`` threads, created on first use, never one per child), so the loop keeps
supervising other runs meanwhile. Those threads live as long as the process: the anchor is
tied by ``PR_SET_PDEATHSIG`` to the *thread* that spawned it (see :func:`_executor`).

Glossary:
    anchor pidfd (``Run.pidfd``): ``pidfd_open(2)`` of the anchor we spawned
        (``native/lowlevel_exec.c``); readable when it exits.
    bwrap pidfd (``Run.init_pidfd``): pidfd of bwrap, the PID 1 of the sandbox's PID namespace,
        sent by the anchor with READY; readable once every process of the namespace is gone.
    limiter: an ``asyncio.Semaphore`` bounding the runs that hold fds and processes. A call
        waiting for it holds nothing but its coroutine.

File descriptors, per run (Linux fds in this process; the loop's epoll fd is shared):
    - while ``prepare``/``spawn`` run (in the executor, so at most ``EXECUTOR_THREADS``
      runs at a time): up to ~30 short-lived fds each (args, seccomp, passwd and group
      memfds, the /etc copies, the pipes, the cgroup fds, and their copies moved above the
      child's fd numbers); closed before ``spawn`` returns;
    - from spawn to reap, at most 10: the anchor's pidfd and report socket, bwrap's pidfd
      (after READY), the json-status read end, stdout and stderr read ends
      (``capture=True``), the stdin write end (``stdin`` bytes, until written), the read end
      of the guard's report pipe (:mod:`lowlevel.host.landlock`), and with the copy-on-write
      workspace its lower and upper directories;
    - after the run: none. So ``n`` runs in flight hold at most ``10 * n + 30 *
      EXECUTOR_THREADS`` fds, and a :class:`Runner` with ``max_concurrency=64`` stays under
      800 however many calls wait (the default ``RLIMIT_NOFILE`` soft limit is often 1024).
    Processes: the anchor, bwrap and the sandbox's processes per running run; threads: the
    shared executor's ``EXECUTOR_THREADS``, whatever the number of runs.

Cancellation: cancelling the awaiting task SIGKILLs the sandbox (PID 1, so the whole PID
namespace, and bwrap), waits on the loop until both are gone and bwrap is reaped, removes
the cgroup and closes every fd, then re-raises :class:`asyncio.CancelledError`. A cancel
that arrives while an executor step runs first waits for the step to end (bounded: no step
waits on the program; a cancelled ``prepare`` skips the spawn and drops the fresh
workspace), then does the same. A second
cancellation during that wait falls back to the blocking cleanup of :meth:`Run.close`
(bounded: SIGKILL has already been sent).

Sources: pidfd_open(2) (poll: "readable when the process terminates", Linux 5.3);
asyncio "Watching file descriptors" (``loop.add_reader``); bwrap(1) --json-status-fd.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lowlevel.errors import LaunchError, LowlevelError, PolicyError
from lowlevel.sandbox import teardown as _teardown
from lowlevel.sandbox._interrupts import deferred_interrupts
from lowlevel.sandbox.drive import json_deferred
from lowlevel.sandbox.failures import PROCESS_LIMIT_HINT
from lowlevel.sandbox.launcher import DRAIN_TIMEOUT_S, INIT_EXIT_TIMEOUT_S, INIT_KILL_TIMEOUT_S, SETUP_TIMEOUT_S, Run
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S, RunRequest, check_seconds
from lowlevel.spec.policy import Policy
from lowlevel.sandbox.result import Result

#: Threads of the executor shared by every run of the process (see :func:`_executor`).
EXECUTOR_THREADS = 4

_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_pid = 0


def _ready_now(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


class _Supervision:
    """The loop registrations of one Run: readers, the stdin writer, the deadline timer.

    Callbacks only read, write or record and then wake the driving coroutine; every
    decision is taken in :func:`_drive`, in the order of the sync driver.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, r: Run) -> None:
        self.loop = loop
        self.r = r
        self.readers: set[int] = set()
        self.writer: int | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.wake: asyncio.Future[None] | None = None
        self.bwrap_exited = False
        self.error: BaseException | None = None  # raised by the driver (a callback cannot raise)

    # -- registrations -------------------------------------------------------------------
    def add_reader(self, fd: int | None, callback: Callable[..., None], *args: Any) -> None:
        if fd is not None:
            self.loop.add_reader(fd, callback, *args)
            self.readers.add(fd)

    def remove_reader(self, fd: int) -> None:
        if fd in self.readers:
            self.readers.discard(fd)
            self.loop.remove_reader(fd)

    def detach(self) -> None:
        """Drop every registration (before Run.close closes the fds)."""
        for fd in list(self.readers):
            self.remove_reader(fd)
        if self.writer is not None:
            self.loop.remove_writer(self.writer)
            self.writer = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # -- callbacks -----------------------------------------------------------------------
    def _wakeup(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def on_pipe(self, attr: str) -> None:
        fd = getattr(self.r, attr)
        if fd is None:
            return
        if not self.r.read_fd(attr, close=False):
            # EOF: unregister the number, then close it (closed first, the number could be
            # reused by a pipe an executor thread opens meanwhile).
            self.remove_reader(fd)
            self.r._close_fd(attr)
            self._wakeup()

    def on_report(self) -> None:
        """The anchor's report socket: READY (or EOF when its setup failed)."""
        r = self.r
        sock = r.report
        if sock is None:
            return
        fd = sock.fileno()
        try:
            r.read_report()
        except LowlevelError as err:
            self.error = err
            self.remove_reader(fd)
            self._wakeup()
            return
        if r.ready or r.report is None:
            self.remove_reader(fd)
            self._wakeup()

    def on_exit_report(self) -> None:
        """After READY: the anchor's EXIT (bwrap reaped: the sandbox is gone)."""
        r = self.r
        sock = r.report
        if sock is None:
            return
        fd = sock.fileno()
        if r.read_exit() or r.report is None:
            self.remove_reader(fd)
            if r.exit_reported and r.pidfd is not None:
                self.remove_reader(r.pidfd)
                self.bwrap_exited = True
            self._wakeup()

    def on_bwrap_exit(self) -> None:
        assert self.r.pidfd is not None
        self.remove_reader(self.r.pidfd)
        if self.r.report is not None:
            self.remove_reader(self.r.report.fileno())
            if self.r.ready:
                self.r.read_exit()  # sent before it exited: bwrap's own status and rusage
        self.bwrap_exited = True
        self._wakeup()

    def on_stdin(self) -> None:
        fd = self.r.stdin_w
        if fd is None or self.r.feed_stdin(close=False):
            if self.writer is not None:
                self.loop.remove_writer(self.writer)
                self.writer = None
            self.r._close_fd("stdin_w")
            self._wakeup()

    def on_deadline(self) -> None:
        self.timer = None
        if self.bwrap_exited:
            return
        r = self.r
        if r.kill_after > 0 and not r.terminated:
            # timeout -k: SIGTERM to every process of the sandbox now, SIGKILL kill_after later.
            r.terminate()
            self.timer = self.loop.call_later(r.kill_after, self.on_deadline)
            return
        r.kill("timeout", cgroup_kill=False)

    # -- waiting -------------------------------------------------------------------------
    async def wait(self, timeout_s: float | None = None) -> bool:
        """Sleep until a callback wakes us; False when ``timeout_s`` passed first."""
        fut = self.loop.create_future()
        self.wake = fut
        try:
            if timeout_s is None:
                await fut
                return True
            done, _ = await asyncio.wait([fut], timeout=timeout_s)
            return bool(done)
        finally:
            self.wake = None
            if not fut.done():
                fut.cancel()

    async def readable(self, fd: int, timeout_s: float) -> bool:
        """Await ``fd`` readable (a pidfd: its process exited); False after ``timeout_s``."""
        if _ready_now(fd):
            return True
        # Ours from here on: a registration of this Run's own on the same fd (the anchor's pidfd:
        # on_bwrap_exit) is dropped first, or on_exit_report's remove_reader(pidfd), when the
        # anchor's EXIT came meanwhile, removed this wait's reader and it sat out its whole
        # timeout (a cancelled arun took 12 s to end: bench/kill_campaign_repro.py arun-sigterm).
        self.remove_reader(fd)
        fut: asyncio.Future[None] = self.loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self.loop.add_reader(fd, ready)
        try:
            done, _ = await asyncio.wait([fut], timeout=timeout_s)
            return bool(done)
        finally:
            self.loop.remove_reader(fd)
            if not fut.done():
                fut.cancel()

    async def reap(self) -> None:
        """Async :meth:`Run.reap`: wait4 bwrap (its pidfd is readable), then await PID 1's exit."""
        r = self.r
        if r.pidfd is not None and r.wait_status is None and not self.bwrap_exited:
            await self.readable(r.pidfd, INIT_KILL_TIMEOUT_S + INIT_EXIT_TIMEOUT_S)
        r.reap_bwrap()
        if r.init_pidfd is not None and not await self.readable(r.init_pidfd, INIT_EXIT_TIMEOUT_S):
            try:
                signal.pidfd_send_signal(r.init_pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await self.readable(r.init_pidfd, INIT_KILL_TIMEOUT_S)


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's shared executor for the blocking steps of every Run (created lazily).

    ``EXECUTOR_THREADS`` threads at most, whatever the number of runs, event loops or
    Runners. Never shut down: a pool thread spawns bwrap, and bwrap's ``--die-with-parent``
    (``PR_SET_PDEATHSIG``) fires when the spawning *thread* exits, not the process, so a pool
    thread that exited would kill every sandbox it started. ``ThreadPoolExecutor`` keeps its
    workers until ``shutdown()`` or interpreter exit, and this module keeps a reference for
    the process's lifetime. A forked child (whose copy has no threads) makes its own.

    Source: prctl(2) PR_SET_PDEATHSIG ("the parent" is the thread that created the child);
    bwrap(1) --die-with-parent.
    """
    global _pool, _pool_pid
    pool = _pool
    if pool is not None and _pool_pid == os.getpid():
        return pool
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=EXECUTOR_THREADS,
                                                          thread_name_prefix="lowlevel-aio")
            _pool_pid = os.getpid()
        return _pool


def _submit(fn: Callable[[], None]) -> concurrent.futures.Future[None]:
    """``fn`` on the shared executor, or a LaunchError; never queued to run after a failure.

    ``ThreadPoolExecutor.submit`` queues the work item *before* it starts a thread for it; when
    that thread cannot start (``RuntimeError: can't start new thread``: the caller's
    ``pids.max``, ``RLIMIT_NPROC``) the call raises but the item stays queued, and a worker that
    frees up later runs it: the run's setup (workspace, cgroup, hand-over journal) then happened
    for a call that had already failed, and nothing ever cleaned it (issue 23: three batches of 32
    calls at ``pids.max`` 2-4 left 90 workspaces and 270 cgroup directories). So the item is
    wrapped: once the submission failed it does nothing, unless a worker already started it, in
    which case the call goes on as submitted.

    Called under :class:`~lowlevel.sandbox._interrupts.deferred_interrupts` (both callers are):
    a signal handler's exception (SystemExit from a SIGTERM handler, KeyboardInterrupt) raised
    inside ``submit()`` lands between the work item's queueing and the return (a step that runs
    with nobody awaiting it), or, for the executor's new thread, between its start and its
    registration with concurrent.futures' exit hook, which then never wakes it: the
    interpreter's exit joined that idle thread forever (2 callers in ~900 of
    bench/kill_campaign_repro.py arun-sigterm). 3 us per submission.

    Raises:
        LaunchError: no thread could start for ``fn`` (``errno`` EAGAIN); nothing ran.
    """
    out: concurrent.futures.Future[None] = concurrent.futures.Future()
    lock = threading.Lock()
    state = ["queued"]

    def work() -> None:
        with lock:
            if state[0] == "dropped":
                return
            state[0] = "running"
        if not out.set_running_or_notify_cancel():
            return
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            out.set_exception(err)
        else:
            out.set_result(None)

    try:
        _executor().submit(work)
    except RuntimeError as err:
        with lock:
            if state[0] == "queued":
                state[0] = "dropped"
                raise LaunchError(f"cannot start a thread for the sandbox's setup ({err}): {PROCESS_LIMIT_HINT}",
                                  errno=errno.EAGAIN) from err
        # A worker took it between the queueing and the failure: it runs, its future tells.
    return out


async def _step(fn: Callable[[], None], abort: threading.Event | None = None) -> None:
    """Run one blocking step of a Run in the shared executor; wait for its end even if cancelled.

    A step cannot be interrupted (it may sit in ``posix_spawn`` or a ``cgroup.procs``
    write) and a Run has one driver at a time, so on cancellation we wait until the step is
    over (steps are bounded: none waits on the program) and only then raise
    ``CancelledError``, so the caller kills and reaps whatever the step started. A step that
    failed after the cancellation is dropped in favour of the ``CancelledError``.

    Args:
        fn: the step, called in a pool thread.
        abort: set on cancellation, for a step of several parts to skip the rest.
    """
    # A signal handler's exception that comes while the step is handed to the executor is held
    # back until this coroutine holds the step's future, then raised inside the wait below (it
    # escaped from between the submission and the assignment before: a step ran with nobody
    # waiting for it, so nobody closed what it started).
    held = deferred_interrupts()
    held.__enter__()
    try:
        step = _submit(fn)
        fut = asyncio.wrap_future(step)
        fut.add_done_callback(_retrieved)
    except BaseException:
        held.__exit__(None, None, None)
        raise
    try:
        held.__exit__(None, None, None)  # what came during the submission is raised here
    except BaseException:
        _outlive(step, abort)
        raise
    # Decided on the step's own future (``step``), the loop's copy (``fut``) only wakes us: a
    # signal handler's SystemExit raised inside the loop callback that copies the state over
    # (wrap_future's call_soon_threadsafe) loses that callback, and asyncio.run's cancellation
    # of the tasks left then waited for ``fut`` forever (the caller hung in _cancel_all_tasks
    # with every executor thread idle: 1 in ~700 of bench/kill_campaign_repro.py arun-sigterm).
    cancelled = False
    while not step.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = True
            if abort is not None and not step.done():
                abort.set()
        except BaseException as err:
            if step.done() and not step.cancelled() and step.exception() is err:
                break  # the step's own error: re-raised by step.result() below
            _outlive(step, abort)
            raise
    if cancelled:
        raise asyncio.CancelledError
    step.result()


def _retrieved(fut: asyncio.Future[None]) -> None:
    """Mark a step's loop future retrieved (its outcome is read from the step's own future), so
    asyncio logs no "exception was never retrieved"."""
    if not fut.cancelled():
        fut.exception()


def _outlive(step: concurrent.futures.Future[None], abort: threading.Event | None) -> None:
    """:func:`_step` met an exception from outside its step, which still runs (SystemExit or
    KeyboardInterrupt from a signal handler, GeneratorExit when a pending task's coroutine is
    closed): wait for the step here, blocking (steps are bounded), so whatever it started is on
    the Run for the caller's cleanup; the caller then lets the exception go on. (It broke out
    before and ``fut.result()`` raised InvalidStateError over it: that Run was never closed, and
    its cgroup and record were left to ``lowlevel cleanup``: bench/kill_campaign.py.)"""
    if abort is not None:
        abort.set()
    concurrent.futures.wait([step])


def _start(r: Run, abort: threading.Event) -> None:
    """prepare then spawn, in a pool thread; no spawn once the task was cancelled."""
    r.prepare()
    if not abort.is_set():
        r.spawn()


async def _drive(r: Run, sup: _Supervision) -> Result:
    """The sync driver's steps (:func:`lowlevel.sandbox.drive._drive_sync`), on loop callbacks."""
    abort = threading.Event()
    await _step(functools.partial(_start, r, abort), abort)
    assert r.json_r is not None and r.pidfd is not None and r.report is not None
    # Handshake: wait for the anchor's READY (bwrap's pidfd), or its exit (setup failed).
    sup.add_reader(r.report.fileno(), sup.on_report)
    sup.add_reader(r.json_r, sup.on_pipe, "json_r")
    sup.add_reader(r.out_r, sup.on_pipe, "out_r")
    sup.add_reader(r.err_r, sup.on_pipe, "err_r")
    sup.add_reader(r.pidfd, sup.on_bwrap_exit)
    setup_deadline = time.monotonic() + SETUP_TIMEOUT_S
    while not r.ready:
        if sup.error is not None:
            raise sup.error
        if sup.bwrap_exited:
            # The anchor exited before READY: setup failed.
            sup.detach()
            r.reap_bwrap()
            while r.read_fd("err_r") or r.read_fd("out_r") or r.read_fd("json_r"):
                pass
            raise r.setup_error()
        left = setup_deadline - time.monotonic()
        if left <= 0:
            r.kill(None, cgroup_kill=False)
            await sup.reap()
            raise LaunchError(f"the sandbox did not finish setting up within {SETUP_TIMEOUT_S:.0f} s",
                              argv=r.full_argv)
        await sup.wait(left)
    json_later = json_deferred(r)
    if json_later:
        sup.remove_reader(r.json_r)  # read once the sandbox is gone (drive.json_deferred)
    if r.stdin_w is not None and not r.feed_stdin():
        sup.writer = r.stdin_w
        sup.loop.add_writer(r.stdin_w, sup.on_stdin)
    if r.report is not None:
        sup.add_reader(r.report.fileno(), sup.on_exit_report)
    if r.deadline is not None:
        sup.timer = sup.loop.call_later(max(0.0, r.deadline - time.monotonic()), sup.on_deadline)
    while not sup.bwrap_exited:
        await sup.wait()
    if sup.timer is not None:
        sup.timer.cancel()
        sup.timer = None
    await sup.reap()
    if json_later and r.json_r is not None:
        if r.read_fd("json_r", close=False):
            sup.add_reader(r.json_r, sup.on_pipe, "json_r")  # not at EOF yet: the drain below waits
        else:
            r._close_fd("json_r")
    # The anchor is gone and the sandbox is dead: the pipes are at EOF or about to be.
    while any(fd is not None for fd in (r.out_r, r.err_r, r.json_r, r.stdin_w)):
        if not await sup.wait(DRAIN_TIMEOUT_S):
            sup.detach()
            for attr in ("out_r", "err_r", "json_r", "stdin_w"):
                if getattr(r, attr) is not None:
                    if attr != "stdin_w":
                        r.read_fd(attr)
                    r._close_fd(attr)
            break
    # Building the Result reads (and commits) the run's upper layer: file work, off the loop,
    # while the anchor tears down its mount namespace; then reap it without blocking the loop.
    box: list[Result] = []
    await _step(lambda: box.append(r.result()))
    if r.pidfd is not None and not r.anchor_reaped and not (
            _teardown.ENABLED and r.one_shot and r.exit_reported and r.handover is None):
        # (A finished one-shot run's anchor is reaped by lowlevel.sandbox.teardown: Run.close.)
        await sup.readable(r.pidfd, INIT_KILL_TIMEOUT_S + INIT_EXIT_TIMEOUT_S)
        r.reap_anchor(block=False)
    return box[0]


def _adopt_init(r: Run, sup: _Supervision) -> None:
    """Cancelled mid-handshake: take bwrap's pidfd if the anchor already sent READY.

    Then the kill and the wait cover the whole sandbox, not the anchor alone. Before READY,
    bwrap has not started (the anchor execs it only after sending READY), and the anchor's
    death takes whatever it forked with it (parent-death signal, PID namespace).
    """
    if r.ready or r.report is None:
        return
    fd = r.report.fileno()
    r.read_report()
    if r.ready or r.report is None:
        sup.remove_reader(fd)


async def _arun(r: Run) -> Result:
    loop = asyncio.get_running_loop()
    try:
        result: Result | None = await _arun_kept(r, loop)
    except BaseException:
        if not r.keep_workspace and r.owns_workspace:
            # keep_workspace=False: gone on failure and cancellation too (off the loop: a big tree).
            await asyncio.shield(_off_loop(lambda: None if r.finish_workspace(None) else None))
        raise
    if not r.keep_workspace:
        box: list[Result | None] = []
        await _off_loop(lambda: box.append(r.finish_workspace(result)))
        result = box[0]
    assert result is not None
    return result


async def _off_loop(fn: Callable[[], None]) -> None:
    """``fn`` in the shared executor; on the loop itself when no thread can start (bounded file
    work that must happen: the removal of a disposable workspace)."""
    try:
        with deferred_interrupts():  # see _submit
            fut = _submit(fn)
    except LaunchError:
        fn()
        return
    await asyncio.wrap_future(fut)


async def _arun_kept(r: Run, loop: asyncio.AbstractEventLoop) -> Result:
    sup = _Supervision(loop, r)
    try:
        return await _drive(r, sup)
    except asyncio.CancelledError:
        if r.pid is None:
            r.close()
            r.discard_workspace_if_unused()  # cancelled before the spawn: nothing ran
        elif r.wait_status is None:
            _adopt_init(r, sup)
            r.kill("cancelled", cgroup_kill=False)
            try:
                await sup.reap()
            except asyncio.CancelledError:
                pass  # cancelled again: Run.close() below kills and reaps, blocking briefly
        raise
    except BaseException:
        sup.detach()
        r.close()
        r.discard_workspace_if_unused()  # as lowlevel.run: drop a fresh workspace when nothing ran
        raise
    finally:
        sup.detach()
        r.close()


async def arun(command: Sequence[str], *, policy: Policy | None = None,
               workspace: str | os.PathLike[str] | None = None,
               inputs: Sequence[str | os.PathLike[str] | tuple[str, str]] = (),
               timeout: float | None = DEFAULT_TIMEOUT_S, stdin: bytes | None = None,
               env: Mapping[str, str] | None = None, capture: bool = True, cwd: str | None = None,
               workspace_base: str | None = None, limiter: asyncio.Semaphore | None = None,
               allow_sensitive_workspace: bool = False, keep_workspace: bool = True,
               kill_after: float = 0.0, commit: bool | str = True,
               stdio_fds: Sequence[int | None] | None = None,
               record: str | os.PathLike[str] | None = None) -> Result:
    """Run ``command`` in a fresh bwrap sandbox without blocking the event loop.

    The same run, arguments and :class:`~lowlevel.sandbox.result.Result` as :func:`lowlevel.run`
    (see there), plus ``limiter``, except ``record``. The Policy's argv, seccomp BPF and host
    probes are computed once per process and shared by every call.

    Args:
        command: program and arguments as seen inside, e.g. ``["python3", "main.py"]``.
        policy: the sandbox description; default ``Policy()``.
        workspace, inputs, timeout, stdin, env, capture, cwd, workspace_base, allow_sensitive_workspace,
            keep_workspace, commit, stdio_fds: as :func:`lowlevel.run` (``inputs`` may hold
            ``(host path, dest)`` pairs; ``keep_workspace=False`` removes the fresh workspace in
            the shared executor once the Result is built; the commit runs there too).
            ``timeout`` (seconds, None for none) counts from the spawn; on expiry the sandbox is
            SIGKILLed and the Result has ``timed_out=True``.
        kill_after: seconds of grace at the timeout, as :func:`lowlevel.run` (``timeout -k``):
            > 0 sends SIGTERM to every process of the sandbox at the deadline and SIGKILLs it
            ``kill_after`` seconds later; 0 (default) SIGKILLs at once.
        record: refused (PolicyError): a record's hashing and input store are synchronous file
            work; call :func:`lowlevel.record.record_run` in an executor instead.
        limiter: an ``asyncio.Semaphore`` shared by the calls it should bound; the call
            waits for it before allocating anything (no fd, no process, no workspace).
            None: no bound (each run in flight holds up to 10 fds; see the module docstring).
    Returns:
        A :class:`~lowlevel.sandbox.result.Result`.
    Raises:
        asyncio.CancelledError: the task was cancelled; the sandbox was killed and reaped
            and its fds closed first.
        PolicyError, WorkspaceError, ExecError, BwrapNotFoundError, LaunchError,
        UnsupportedError: as :func:`lowlevel.run`.
    """
    if limiter is not None and not isinstance(limiter, asyncio.Semaphore):
        raise TypeError(f"limiter must be an asyncio.Semaphore or None, got {type(limiter).__name__}")
    request = RunRequest(command, workspace=workspace, inputs=inputs, timeout=timeout, kill_after=kill_after,
                         stdin=stdin, env=env, capture=capture, cwd=cwd, workspace_base=workspace_base,
                         allow_sensitive_workspace=allow_sensitive_workspace, stdio_fds=stdio_fds,
                         keep_workspace=keep_workspace, commit=commit, record=record)
    request.refuse("lowlevel.arun", "record", why="call lowlevel.record.record_run in an executor")
    return await arun_request(request, policy, limiter=limiter)


async def arun_request(request: RunRequest, policy: Policy | None = None, *,
                       limiter: asyncio.Semaphore | None = None) -> Result:
    """:func:`arun` of one validated :class:`~lowlevel.sandbox.request.RunRequest` (its
    ``record`` must be None: PolicyError otherwise), under ``limiter`` if given."""
    if limiter is None:
        return await _arun(Run(request, policy=policy or Policy()))
    async with limiter:
        return await _arun(Run(request, policy=policy or Policy()))


class Runner:
    """Many :func:`arun` calls under one concurrency cap, with shared defaults.

    ::

        async with lowlevel.Runner(max_concurrency=8) as runner:
            results = await asyncio.gather(*(runner.run(["python3", "-c", code]) for code in codes))

    Calls beyond ``max_concurrency`` wait (holding no fd) until a slot frees. Leaving the
    ``async with`` block (or :meth:`aclose`) cancels the calls still in flight and waits
    until their sandboxes are killed and reaped, so no sandbox outlives the block.

    Args:
        max_concurrency: runs allowed at once, >= 1. Each holds at most 10 fds and its
            sandbox's processes; 2-4x the CPU count keeps the CPUs busy for short runs.
        policy, timeout, workspace_base, env, keep_workspace: defaults for :meth:`run` (a
            call's own arguments win). ``keep_workspace=False`` removes each call's fresh
            workspace once its Result is built (see :func:`lowlevel.run`).
    Raises:
        PolicyError: ``max_concurrency`` is not an int >= 1, or a bad ``timeout`` (a ValueError too).
    """

    def __init__(self, max_concurrency: int, *, policy: Policy | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT_S, workspace_base: str | None = None,
                 env: Mapping[str, str] | None = None, keep_workspace: bool = True) -> None:
        if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
            raise PolicyError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if timeout is not None:
            check_seconds(timeout, "timeout", zero=False)  # checked here, not at the first call
        self.max_concurrency = max_concurrency
        self.defaults: dict[str, Any] = {"policy": policy, "timeout": timeout, "workspace_base": workspace_base,
                                         "env": env, "keep_workspace": keep_workspace}
        self._limiter = asyncio.Semaphore(max_concurrency)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Calls that hold a slot now (0 <= in_flight <= max_concurrency)."""
        return self.max_concurrency - self._limiter._value  # noqa: SLF001 - Semaphore has no public count

    async def run(self, command: Sequence[str], **kwargs: Any) -> Result:
        """:func:`arun` under this Runner's cap and defaults; same arguments except ``limiter``.

        Raises:
            RuntimeError: the Runner is closed.
            TypeError: ``limiter`` was passed.
        """
        if self._closed:
            raise RuntimeError("Runner is closed")
        if "limiter" in kwargs:
            raise TypeError("Runner.run takes no limiter: the Runner's own bounds the call")
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            return await arun(command, **{**self.defaults, **kwargs}, limiter=self._limiter)
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def aclose(self) -> None:
        """Refuse new calls, cancel those in flight and wait for their cleanup."""
        self._closed = True
        me = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not me and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> "Runner":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["DRAIN_TIMEOUT_S", "Runner", "arun", "arun_request"]
