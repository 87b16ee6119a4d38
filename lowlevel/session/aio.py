"""The asyncio driver of a session: :class:`AsyncSession` and its :class:`AsyncProcess` handles.

One concept: waiting, on an event loop. The core (:mod:`lowlevel.session.core`) decides; this
driver waits for it: the loop's readers and writers move the init's socket and every command's
pipes, a timer runs the core's health checks, and coroutines wait on futures woken when their
condition holds. The sandbox's start and close, and a commit or reset, run in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from lowlevel import workspace as _ws
from lowlevel.errors import LowlevelError, SessionError
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S
from lowlevel.sandbox.result import Result
from lowlevel.session.command import Command
from lowlevel.session.core import Core, note_close_failure
from lowlevel.session.gate import check_running, HeldError
from lowlevel.session.handle import ProcessHandle
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Policy

log = logging.getLogger("lowlevel")
_T = TypeVar("_T")


async def _in_thread(fn: Callable[[], _T], *, not_run: Callable[[], None] | None = None,
                     unclaimed: Callable[[_T], None] | None = None) -> _T:
    """``fn()`` in a worker thread of the loop's default executor, awaited, with one owner of its
    outcome whatever happens to the awaiting task.

    The executor may be busy (the application's own ``to_thread`` work), so the job can wait
    there for a thread, and a cancelled ``asyncio.to_thread`` is dropped from that queue: it
    never runs. So, cancelled (or the await failed otherwise) before ``fn`` started, it never
    starts and ``not_run()`` is called here; once started, it runs to its end in its thread,
    and a result nobody awaits any more goes to ``unclaimed(result)`` (in that thread, or here
    when it had returned just before the cancellation reached the task).
    """
    lock = threading.Lock()
    state = ["queued"]  # -> "running" -> "done"; or "abandoned" (never to run), "orphaned" (nobody awaits)
    results: list[_T] = []

    def job() -> _T | None:
        with lock:
            if state[0] == "abandoned":
                return None
            state[0] = "running"
        try:
            out = fn()
        except BaseException:
            with lock:
                state[0] = "done"
            raise
        with lock:
            orphaned, state[0] = state[0] == "orphaned", "done"
            results.append(out)
        if orphaned and unclaimed is not None:
            unclaimed(out)
        return out

    try:
        return cast(_T, await asyncio.to_thread(job))
    except BaseException:
        with lock:
            was = state[0]
            state[0] = {"queued": "abandoned", "running": "orphaned"}.get(was, was)
        if was == "queued" and not_run is not None:
            not_run()
        elif was == "done" and results and unclaimed is not None:
            unclaimed(results[0])  # it returned, but the task was cancelled before it resumed
        raise


def _close_unclaimed(core: Core) -> None:
    """Close a session whose start completed after its ``create()`` was cancelled (nobody has it):
    a fresh workspace it made goes too (no command ran in it, and nobody learnt its path)."""
    if core.run.owns_workspace:
        core.run.keep_workspace = False
    try:
        core.close()
    except LowlevelError as err:
        log.warning("lowlevel: closing a session whose start was cancelled: %s", err)


class AsyncProcess(ProcessHandle):
    """Async twin of :class:`Process` (from :meth:`AsyncSession.start`).

    Attributes:
        argv: the command as given (tuple of str).
        pid: its PID inside the sandbox (int), None until the init reports it started.
    :meth:`wait` and :meth:`read` are coroutines; :meth:`poll`, :meth:`send_signal` and
    :meth:`kill` do not block. Results and errors as :class:`Process`.
    """

    def __init__(self, session: "AsyncSession", cmd: Command) -> None:
        super().__init__(session, cmd)
        self._session = session

    def poll(self) -> Result | None:
        """The Result if finished, else None."""
        if not self._cmd.done:
            return None
        return self._cmd.outcome()

    async def wait(self, timeout: float | None = None) -> Result:
        """Wait for the end (``TimeoutError`` after ``timeout`` seconds; it keeps running)."""
        await self._session._wait(self._cmd, timeout)
        return self._cmd.outcome()

    async def read(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """``(stdout, stderr)`` since the last read, waiting up to ``timeout`` for some."""
        cmd = self._cmd
        if not (cmd.new_out or cmd.new_err or cmd.done):
            try:
                await self._session._wait(cmd, timeout, until=lambda: bool(cmd.new_out or cmd.new_err))
            except TimeoutError:
                pass
        return self._take_output()


class AsyncSession:
    """Async form of :class:`Session` (asyncio). ``async with await AsyncSession.create(...)``
    or ``async with AsyncSession(...)`` (the sandbox then starts on ``__aenter__``).

    Arguments, Results and errors as :class:`Session`. One event loop per session; the
    sandbox's start and close run in a worker thread (they wait on bwrap). Dropped unclosed, it
    is closed when garbage-collected, as a :class:`Session` is.
    """

    def __init__(self, policy: Policy | None = None, **kwargs: Any) -> None:
        self._args = (policy, kwargs)
        self._core: Core | None = None
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers: set[int] = set()
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    async def create(cls, policy: Policy | None = None, **kwargs: Any) -> "AsyncSession":
        """Start the sandbox and return the session.

        Args:
            policy, kwargs: as :class:`Session` (``workspace``, ``inputs``, ``idle_timeout``
                and ``total_timeout`` in seconds, ``commit``...).
        Raises:
            PolicyError, WorkspaceError, LaunchError, UnsupportedError: as :class:`Session`.

        Cancelled (``asyncio.wait_for``, a cancelled ``async with`` entry): a start still
        waiting for a thread of the loop's default executor never begins; one under way ends in
        its thread, and the session it started is closed there, as :meth:`close` closes it
        (``commit=`` and ``keep_workspace`` apply): no process, fd or cgroup is left.
        """
        self = cls(policy, **kwargs)
        await self._open()
        return self

    async def _open(self) -> None:
        if self._core is not None:
            return
        policy, kwargs = self._args
        kwargs = {"workspace": None, "inputs": (), "idle_timeout": None, "total_timeout": None,
                  "workspace_base": None, "bwrap": None, "track_changes": False, "commit": True, **kwargs}
        self._core = await _in_thread(lambda: Core(policy, **kwargs), unclaimed=_close_unclaimed)
        self._loop = asyncio.get_running_loop()
        self._core.on_gate_open = self._gate_opened
        self._loop.add_reader(self._core.sock.fileno(), self._on_sock)
        self._readers.add(self._core.sock.fileno())

    async def __aenter__(self) -> "AsyncSession":
        await self._open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:
        """As :meth:`Session.__exit__`: a failed final commit is raised, or noted on the
        exception the block raises."""
        try:
            await self.close()
        except LowlevelError as err:
            if exc is None:
                raise
            note_close_failure(exc, err)

    @property
    def workspace(self) -> str:
        """As :attr:`Session.workspace`."""
        assert self._core is not None
        return self._core.view()

    @property
    def directory(self) -> str:
        """As :attr:`Session.directory`."""
        assert self._core is not None
        return self._core.run.workspace

    @property
    def host_ids(self) -> tuple[int, int]:
        """As :attr:`Session.host_ids`."""
        assert self._core is not None
        return self._core.run.host_ids

    async def diff(self) -> _ws.Changes:
        """As :meth:`Session.diff`."""
        assert self._core is not None
        return await asyncio.to_thread(self._core.diff)

    async def reset(self, *, running: str = "refuse") -> None:
        """As :meth:`Session.reset` (exclusive; the commands in flight are awaited). Cancelled: as
        :meth:`commit`."""
        await self._exclusive("reset", running)

    async def commit(self, *, running: str = "refuse") -> _ws.Changes:
        """As :meth:`Session.commit` (exclusive; the commands in flight are awaited, commands
        submitted meanwhile start after it).

        Cancelled while it waits (for the commands in flight, or for a thread of the loop's
        default executor): nothing is applied and the session takes commands again at once.
        Cancelled once the commit runs in its thread: it runs to its end there (the changes are
        applied), and the session takes commands again when it is done."""
        changes = await self._exclusive("commit", running)
        assert changes is not None
        return changes

    async def _exclusive(self, what: str, running: str) -> _ws.Changes | None:
        """The async driver of :meth:`Session._exclusive`: the waits are on the event loop (which
        moves the commands' I/O meanwhile), the operation itself in a worker thread. Cancelled
        while that runs, the thread still ends the operation and reopens the gate; cancelled
        before it ran (queued behind the executor's other jobs), it never runs and the gate
        reopens here (:func:`_in_thread`)."""
        core = self._core
        assert core is not None
        self._on_own_loop()
        check_running(running)
        while True:
            try:
                core.begin_exclusive(what)
                break
            except HeldError:
                await self._until(core.gate_free, None)
        handed = False
        try:
            self._on_sock()  # EXITs already on the socket (a background command that just ended)
            left = core.check_background(what, running)
            await self._until(lambda: core.drained(running), None)
            handed = True
            return await _in_thread(lambda: core.exclusive_op(what, left), not_run=core.end_exclusive)
        finally:
            if not handed:
                core.end_exclusive()
            self._wake()

    def _on_own_loop(self) -> None:
        """Refuse a call from an event loop other than the one that opened the session: its
        readers and timers live on that loop (a second ``asyncio.run()`` got a bare "Event loop
        is closed": a fresh-user trial)."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise SessionError("this AsyncSession was opened on another event loop (an earlier asyncio.run()?): "
                               "use it on that loop, or open a new session on this one; close() works from any "
                               "loop", "other_loop")

    def _gate_opened(self) -> None:
        """The gate reopened (in any thread): wake the coroutines waiting for it, on the loop."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:
            pass  # the loop is closed: nobody waits on it

    async def _submit(self, argv: Sequence[str], **kwargs: object) -> Command:
        """:meth:`Core.submit_when_open`, awaiting (on the loop) while a commit()/reset() holds
        new commands."""
        core = self._core
        assert core is not None
        self._on_own_loop()
        steps = core.submit_when_open(argv, **kwargs)
        held = False
        try:
            while True:
                next(steps)
                held = True
                await self._until(lambda: core.exclusive is None, None)
        except StopIteration as done:
            cmd: Command = done.value
            return cmd
        finally:
            steps.close()
            if held:
                self._wake()  # a commit()/reset() may wait for the queue to empty

    @property
    def alive(self) -> bool:
        """False before the start, and once the session was closed or ended (as :attr:`Session.alive`)."""
        return self._core is not None and self._core.failed is None

    async def run(self, argv: Sequence[str], *, stdin: bytes | None = None,
                  timeout: float | None = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None,
                  cwd: str | None = None, limits: Limits | None = None,
                  track_changes: bool | None = None) -> Result:
        """As :meth:`Session.run`. Cancelling the task SIGKILLs the command's tree."""
        await self._open()
        assert self._core is not None
        cmd = await self._submit(argv, stdin=stdin, timeout=timeout, env=env, cwd=cwd, limits=limits,
                                 stream=False, track_changes=track_changes)
        self._watch(cmd)
        try:
            await self._wait(cmd, None)
        except BaseException:
            self._core.signal(cmd, signal.SIGKILL, tree=True)
            raise
        if cmd.error is not None:
            raise cmd.error
        assert cmd.result is not None
        return cmd.result

    async def start(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None,
                    env: Mapping[str, str] | None = None, cwd: str | None = None,
                    limits: Limits | None = None, track_changes: bool | None = False) -> AsyncProcess:
        """As :meth:`Session.start`."""
        await self._open()
        assert self._core is not None
        cmd = await self._submit(argv, stdin=stdin, timeout=timeout, env=env, cwd=cwd, limits=limits,
                                 stream=True, track_changes=track_changes)
        self._watch(cmd)
        return AsyncProcess(self, cmd)

    async def close(self) -> None:
        """As :meth:`Session.close`. Cancelled, the close still happens: in its worker thread once
        it started, or in a thread of its own when the cancel came while it waited for one (a
        busy default executor); the await itself ends with the CancelledError."""
        core = self._core
        if core is None or core.closed:
            return
        self._drop_readers()

        def close_anyway() -> None:  # cancelled while queued for an executor thread: close regardless
            threading.Thread(target=core.close, name="lowlevel-session-close").start()

        try:
            await _in_thread(core.close, not_run=close_anyway)
        finally:
            self._wake()

    # -- plumbing ---------------------------------------------------------------------
    def _watch(self, cmd: Command) -> None:
        assert self._loop is not None
        for fd in cmd.fds():
            if fd == cmd.stdin_w:
                self._loop.add_writer(fd, self._on_stdin, cmd)
            else:
                self._loop.add_reader(fd, self._on_pipe, cmd, fd)
            self._readers.add(fd)
        self._arm_timer()

    def _forget(self, fd: int) -> None:
        if fd in self._readers and self._loop is not None:
            self._loop.remove_reader(fd)
            self._loop.remove_writer(fd)
            self._readers.discard(fd)

    def _drop_readers(self) -> None:
        for fd in list(self._readers):
            self._forget(fd)

    def _on_pipe(self, cmd: Command, fd: int) -> None:
        cmd.read(fd)
        if fd not in (cmd.out_r, cmd.err_r):
            self._forget(fd)
            assert self._core is not None
            with self._core.lock:
                if self._core.fd_owner.get(fd) is cmd:  # the number may be a newer command's already
                    del self._core.fd_owner[fd]
        self._wake()

    def _on_stdin(self, cmd: Command) -> None:
        fd = cmd.stdin_w
        cmd.feed_stdin()
        if cmd.stdin_w is None and fd is not None:
            self._forget(fd)

    def _on_sock(self) -> None:
        core = self._core
        assert core is not None
        before = {fd for c in core.cmds.values() for fd in c.fds()}
        core.on_readable()
        after = {fd for c in core.cmds.values() for fd in c.fds()}
        for fd in before - after:
            self._forget(fd)
        if core.failed is not None:
            self._drop_readers()
        self._wake()

    def _wake(self) -> None:
        keep = []
        for pred, fut in self._waiters:
            if fut.done():
                continue
            if pred() or (self._core is not None and self._core.failed is not None):
                fut.set_result(None)
            else:
                keep.append((pred, fut))
        self._waiters = keep
        self._arm_timer()

    def _arm_timer(self) -> None:
        core, loop = self._core, self._loop
        if core is None or loop is None or core.closed or self._timer is not None:
            return
        if not core.cmds:
            return
        now = time.monotonic()
        delay = max(0.0, core.next_health_check(now) - now)
        self._timer = loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        core = self._core
        if core is None or core.closed:
            return
        core.check_health(time.monotonic())
        if core.failed is not None:
            self._drop_readers()
        self._wake()

    async def _wait(self, cmd: Command, timeout: float | None, until: Callable[[], bool] | None = None) -> None:
        try:
            await self._until(lambda: cmd.done or (until is not None and until()), timeout)
        except TimeoutError:
            raise TimeoutError(f"{cmd.argv[0]!r} still running after {timeout} s") from None

    async def _until(self, pred: Callable[[], bool], timeout: float | None) -> None:
        """Wait until ``pred()`` (checked on every wake-up) or the session ended; TimeoutError
        after ``timeout`` seconds (None: no limit)."""
        if pred() or (self._core is not None and self._core.failed is not None):
            return
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append((pred, fut))
        self._arm_timer()
        if timeout is None:
            await fut
        else:
            await asyncio.wait_for(fut, timeout)

