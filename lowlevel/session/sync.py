"""The sync driver of a session: :class:`Session` and its background :class:`Process` handles.

One concept: waiting, with threads. The core (:mod:`lowlevel.session.core`) decides; this
driver waits for it: one caller at a time leads the I/O pump (poll(2) over the init's socket and
every command's pipes, the core's health checks on time), the others wait on a condition for
the leader to report progress. Thread-safe: several threads may run commands of one session.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from lowlevel import workspace as _ws
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S
from lowlevel.sandbox.result import Result
from lowlevel.session.command import Command
from lowlevel.session.core import close_on_exit, Core
from lowlevel.session.gate import check_running, HeldError
from lowlevel.session.handle import ProcessHandle
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Policy

#: How long a caller that does not lead the I/O pump waits before it looks again, seconds (the
#: leader wakes it at once on progress: this bounds a missed wake-up).
FOLLOWER_WAIT_S = 0.05


class Process(ProcessHandle):
    """A command started with :meth:`Session.start`: stream its output, poll, wait, kill.

    Attributes:
        argv: the command as given.
        pid: its PID inside the sandbox (None until the init reports it started).
    """

    def __init__(self, session: "Session", cmd: Command) -> None:
        super().__init__(session, cmd)
        self._session = session

    def poll(self) -> Result | None:
        """Return the Result if the command has finished, else None; never blocks.

        Raises:
            ExecError, LaunchError: the command could not be started.
            SessionError: the session ended before the command did.
        """
        if not self._cmd.done:
            self._session._wait(self._cmd, time.monotonic())
        return self._cmd.outcome() if self._cmd.done else None

    def wait(self, timeout: float | None = None) -> Result:
        """Wait for the command to finish and return its Result.

        Args:
            timeout: seconds to wait (None: until it ends; its own timeout bounds that).
        Raises:
            TimeoutError: still running after ``timeout`` (it keeps running; see :meth:`kill`).
            ExecError, LaunchError, SessionError: as :meth:`poll`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._session._wait(self._cmd, deadline)
        if not self._cmd.done:
            raise TimeoutError(f"{self.argv[0]!r} still running after {timeout} s")
        return self._cmd.outcome()

    def read(self, timeout: float | None = 0) -> tuple[bytes, bytes]:
        """Return ``(stdout, stderr)`` written since the last read, waiting up to ``timeout``
        seconds for something to arrive (0: don't wait; None: until output or the end).

        Returns ``(b"", b"")`` once the command has finished and everything was read.
        """
        cmd = self._cmd
        if not (cmd.new_out or cmd.new_err or cmd.done):
            deadline = None if timeout is None else time.monotonic() + timeout
            self._session._wait(cmd, deadline, until=lambda: bool(cmd.new_out or cmd.new_err))
        return self._take_output()


def _drop_owner(core: Core, fd: int, owner: Command) -> None:
    """Forget ``fd`` (just closed by ``owner``) in the fd table, unless its number already
    belongs to a newer command: between the close and this, another thread's submit may get
    the same number for its pipe, and dropping that entry left the new command's stdout unread
    while it blocked writing it (6 threads piping 300 KB each through ``cat`` hung 1 run in 5:
    test_session.py::test_concurrent_stdin_never_mixed)."""
    with core.lock:
        if core.fd_owner.get(fd) is owner:
            del core.fd_owner[fd]
        core.fds_version += 1


class Session:
    """One sandbox for many commands (sync). Use as a context manager (one dropped unclosed is
    closed, as :meth:`close` closes it, when garbage-collected; not at the interpreter's exit).

    Args:
        policy: as for :func:`lowlevel.run` (default ``Policy()``): mounts, seccomp filter,
            limits. ``limits.cpu_s`` applies per command (``RLIMIT_CPU``), not to the init;
            the cgroup limits (memory, pids, cpu_quota) apply to the session as a whole.
        workspace: host directory bound at ``/workspace`` (must exist); None makes a fresh
            one under ``workspace_base``, kept after close (``session.workspace``).
        inputs: host files or directories copied into the workspace before the start.
        idle_timeout: end the session after this many seconds with no command running and
            no request (None: never). Enforced by the init.
        total_timeout: end the session this many seconds after it started (None: never).
        workspace_base: parent of fresh workspaces (see :func:`lowlevel.run`).
        allow_sensitive_workspace: accept a ``workspace`` :func:`lowlevel.run` would refuse as
            sensitive (never one below a directory another user controls).
        track_changes: fill ``Result.changes`` for each command (a snapshot of the workspace
            before and after: costs a directory walk per command, so off by default).
        bwrap: an explicit bwrap path.
        commit: what :meth:`close` does with the session's changes (the workspace is the lower
            layer of a copy-on-write overlay; the commands write into a bounded upper layer):
            True (default) applies them to the directory, False drops them. :meth:`commit`,
            :meth:`reset` and :meth:`diff` act on them while the session lives.
        keep_workspace: keep a fresh workspace after :meth:`close` (default, as
            :func:`lowlevel.run`); False removes it once the sandbox is gone (not with
            ``workspace``: lowlevel never deletes your directory; PolicyError).
    Raises:
        PolicyError, WorkspaceError, LaunchError, UnsupportedError: as :func:`lowlevel.run`,
            for the sandbox's start; UnsupportedError(feature="session-init") when the init
            executable was not built.

    Thread-safe: several threads may call :meth:`run` at once (the commands run concurrently
    in the sandbox; one thread at a time moves the I/O for all of them), and :meth:`commit`
    or :meth:`reset` beside them (each waits for the commands in flight and holds new ones).
    """

    def __init__(self, policy: Policy | None = None, *, workspace: str | os.PathLike[str] | None = None,
                 inputs: Sequence[str | os.PathLike[str]] = (), idle_timeout: float | None = None,
                 total_timeout: float | None = None, workspace_base: str | None = None,
                 track_changes: bool = False, bwrap: str | None = None,
                 allow_sensitive_workspace: bool = False, commit: bool | str = True,
                 keep_workspace: bool = True) -> None:
        self._core = Core(policy, workspace=workspace, inputs=inputs, idle_timeout=idle_timeout,
                           total_timeout=total_timeout, workspace_base=workspace_base, bwrap=bwrap,
                           track_changes=track_changes, allow_sensitive_workspace=allow_sensitive_workspace,
                           commit=commit, keep_workspace=keep_workspace)
        self._io_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._handles: list[Process] = []

    @property
    def workspace(self) -> str:
        """The workspace as the commands see it, for host-side reads and writes.

        While the session lives (copy-on-write overlay): ``/proc/PID/root/workspace`` of its
        init, the merged view, valid only until :meth:`close` (a root caller writing there
        creates files owned by root: pass ``uid``/``gid`` = :attr:`host_ids` to
        :func:`lowlevel.workspace.write_file`). Once closed, or without the overlay: the host
        directory (:attr:`directory`). Treat what you read as untrusted output: never
        ``open()`` a path under it, use :func:`lowlevel.workspace.read_file` and
        :func:`~lowlevel.workspace.write_file`. The sandbox controls the entries, and an absolute
        symlink it made (``ln -s /etc/shadow f``), followed from the host through
        ``/proc/PID/root``, resolves against the host's root: proc(5) on ``/proc/PID/root``.
        """
        return self._core.view()

    @property
    def directory(self) -> str:
        """Host path of the directory the session works on (the overlay's lower layer)."""
        return self._core.run.workspace

    @property
    def host_ids(self) -> tuple[int, int]:
        """``(uid, gid)`` the sandbox runs as on the host (a root caller's per-run ids)."""
        return self._core.run.host_ids

    def diff(self) -> _ws.Changes:
        """What the session's commands changed so far (from the upper layer: O(changes)).

        Raises:
            UnsupportedError: no copy-on-write workspace on this host (see ``notes``).
            SessionError: the session is over.
        """
        return self._core.diff()

    def reset(self, *, running: str = "refuse") -> None:
        """Drop every change: ``/workspace`` is the directory as it is on the host again.

        A fresh overlay is stacked on the workspace (the mount propagates into the sandbox).
        The reset is exclusive (as :meth:`commit`): commands that :meth:`run` started (in other
        threads) are waited for, commands submitted meanwhile start after it, and background
        commands (:meth:`start`) still running are handled as ``running`` says. With
        ``Policy.rootfs_writable`` the root filesystem's writable layer is the session's for its
        whole life: ``reset()`` leaves it (a new Session starts from the tree again).

        Args:
            running: background commands still running: ``"refuse"`` (default: SessionError),
                ``"wait"`` (until they end: their own timeouts bound it), or ``"leave"`` (they
                keep the old view: meant for commands that do not use ``/workspace``, such as a
                server in ``/tmp``; see :meth:`commit`).
        Raises:
            SessionError(reason="busy"): background commands are running and ``running`` is
                ``"refuse"``; the message names them (nothing was changed).
            PolicyError: a bad ``running``.
            UnsupportedError: no copy-on-write workspace on this host (see ``notes``).
            SessionError: the session is over. LaunchError: the anchor refused.
        """
        self._exclusive("reset", running)

    def commit(self, *, running: str = "refuse") -> _ws.Changes:
        """Apply the changes so far to the directory, then :meth:`reset` (so the view is the
        directory, now holding them). Returns what was applied.

        Exclusive: the commit first closes the session to new commands (a :meth:`run` or
        :meth:`start` called meanwhile, in any thread, starts once it is over), waits for the
        commands :meth:`run` already started (each bounded by its timeout), then commits and
        stacks the fresh layer. So every command that ended before, or while the commit
        waited, is in it, and none runs across it: a process living across the replaced upper
        layer would keep the old one as its cwd and Landlock rule (``/workspace`` then fails
        for it with EACCES or ESTALE) and its later writes would be in no commit.

        Args:
            running: what to do with background commands (:meth:`start`) still running:
                ``"refuse"`` (default): raise SessionError(reason="busy") naming them (wait()
                for or kill() them first); ``"wait"``: wait until they end (a server without
                timeout: forever); ``"leave"``: commit around them: they keep the old view of
                ``/workspace`` and what they write there afterwards is lost (their Result's
                ``notes`` say so); for commands that do not use the workspace.
        Raises:
            lowlevel.workspace.overlay.CommitConflictError: an entry the session changed was also
                changed on the host since the session started (or since the last commit/reset),
                in a version the session did not see (as root, a file the session copied up
                after the host's change is no conflict: it worked on the host's version and
                nothing of it is lost; :mod:`lowlevel.workspace.overlay.commits`): nothing was applied
                (``.applied`` None), the changes stay in the session; or the host changed
                entries while they were applied (``.applied`` set): those are left as the host
                made them, the rest applied, and the session's view was reset over the
                directory (the run's whole change saved at ``.saved_upper``).
            lowlevel.CommitIncompleteError: the directory's filesystem could not take the
                changes (full, out of quota): ``.applied`` is in the directory, the rest saved
                at ``.saved_upper``; the session's view was reset over the directory.
            lowlevel.WorkspaceError: ``Limits.upper="disk"`` and its host filesystem filled, so
                some writes were lost: nothing was applied, the changes were discarded (reset).
            SessionError(reason="busy"), PolicyError, UnsupportedError, SessionError,
                LaunchError: as :meth:`reset`.
            KeyboardInterrupt, SystemExit: (a signal handler's) raised inside the apply pass
                after the commit's temporaries were removed: part of the changes may be applied
                (each entry old or new); the session still holds them all, and a second
                :meth:`commit` (or :meth:`close` with ``commit=True``) applies the rest (see
                :func:`lowlevel.workspace.overlay.commit`, Interruption).
        """
        changes = self._exclusive("commit", running)
        assert changes is not None
        return changes

    def _final_commit(self) -> _ws.Changes:
        """:meth:`commit` without the fresh layer after it, for a sandbox that runs no more
        commands (:meth:`Pool.run`'s): the anchor's RESET round trip and the new overlay's mount
        are skipped, and :meth:`close` does not commit again. Raises as :meth:`commit`."""
        changes = self._exclusive("final", "refuse")
        assert changes is not None
        return changes

    def _exclusive(self, what: str, running: str) -> _ws.Changes | None:
        """Take the workspace gate, wait for the commands in flight, run ``what`` (see
        :class:`Core`): the sync driver."""
        core = self._core
        check_running(running)
        while True:
            try:
                core.begin_exclusive(what)
                break
            except HeldError:
                core.wait_gate(exclusive=True)
        try:
            # Take in the EXITs already reported (nobody may be pumping: a background command
            # that ended while no thread waited would be refused as still running).
            if self._io_lock.acquire(blocking=False):
                try:
                    if core.usable:
                        core.on_readable()
                finally:
                    with self._cond:
                        self._io_lock.release()
                        self._cond.notify_all()
            left = core.check_background(what, running)
            self._wait_until(lambda: core.drained(running), None)
        except BaseException:
            core.end_exclusive()
            raise
        return core.exclusive_op(what, left)

    @property
    def alive(self) -> bool:
        """False once the session was closed or ended (init death, idle/total timeout).

        Reads what the init reported meanwhile when no other thread is reading (a session that
        its idle timeout ended stayed "alive" until the next command found out: a fresh-user
        trial): one non-blocking ``recv``, no wait."""
        core = self._core
        if core.failed is None and core.usable and self._io_lock.acquire(blocking=False):
            try:
                core.on_readable()
            finally:
                with self._cond:
                    self._io_lock.release()
                    self._cond.notify_all()
        return core.failed is None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        close_on_exit(self.close, exc)

    def run(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
            env: Mapping[str, str] | None = None, cwd: str | None = None, limits: Limits | None = None,
            track_changes: bool | None = None) -> Result:
        """Run one command in the session and wait for it.

        Args:
            argv: program and arguments; a bare name is searched on the command's PATH.
            stdin: bytes fed to its stdin, or None for ``/dev/null``.
            timeout: wall-clock seconds (None: none). On expiry its whole tree is SIGKILLed:
                ``timed_out=True``, ``killed_by="timeout"``; the session stays usable.
            env: variables set on top of the Policy's environment (nothing else is inherited).
            cwd: working directory inside the sandbox.
            limits: per-command limits (default: the Policy's). rlimits apply to this
                command (values above the session's hard limits are lowered to them). The
                cgroup's limits (``memory_bytes``, ``pids``, ``cpu_quota`` where the session's
                cgroup enforces them) bound the session as a whole and ``tmp_size_bytes``/
                ``workspace_bytes`` were fixed at its start: other values there raise
                PolicyError (see :meth:`Core.check_call_limits`); use :class:`Pool` or
                :func:`lowlevel.run` for a per-call memory limit.
            track_changes: override the session's ``track_changes`` for this command.
        Returns:
            A :class:`Result`. ``cpu_user_s``/``cpu_system_s``/``max_rss_bytes`` are the
            command tree's (rusage); ``peak_memory_bytes`` is None (the cgroup is the
            session's); ``oom_kills`` counts the session cgroup's OOM kills while the command
            ran, and ``killed_by`` is ``"memory"`` when there was one (as :func:`lowlevel.run`
            says; with other commands running at the same time only if this one failed too);
            ``argv`` is the command's.
        Raises:
            PolicyError: a bad argument, or a per-command limit the session cannot enforce.
            ExecError: the command was not found (ENOENT) or is not executable (EACCES).
            LaunchError: chdir to ``cwd`` or an rlimit failed (``.errno``).
            SessionError: the session is closed or ended (see the module docstring).
        """
        cmd = self._submit(argv, stdin=stdin, timeout=timeout, env=env, cwd=cwd, limits=limits, stream=False,
                           track_changes=track_changes)
        try:
            self._wait(cmd, None)
        except BaseException:
            self._core.signal(cmd, signal.SIGKILL, tree=True)
            raise
        if cmd.error is not None:
            raise cmd.error
        assert cmd.result is not None
        return cmd.result

    def start(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None,
              env: Mapping[str, str] | None = None, cwd: str | None = None,
              limits: Limits | None = None, track_changes: bool | None = False) -> Process:
        """Start a background command and return its :class:`Process` handle at once.

        Arguments as :meth:`run`, but ``timeout`` defaults to None (a server runs until
        killed) and ``track_changes`` to False (None: the session's; True: the Result's
        ``changes`` list the workspace's changes while it ran, other commands' included).
        Its output is captured (capped as for ``run``) and streamed through
        :meth:`Process.read`. Handles still running are killed by :meth:`close`.

        A sync Session moves output only while some thread is inside :meth:`run` or a
        handle's ``wait``/``read``/``poll``: a background command that writes more than a
        pipe buffer (64 KiB) while nobody calls blocks in ``write`` until the next call (it
        loses nothing). :class:`AsyncSession` reads whenever the event loop runs.

        While it runs, :meth:`commit` and :meth:`reset` refuse (SessionError, reason
        ``"busy"``) unless given ``running="wait"`` or ``running="leave"``: a process living
        across the replaced upper layer would lose ``/workspace``.
        """
        cmd = self._submit(argv, stdin=stdin, timeout=timeout, env=env, cwd=cwd, limits=limits, stream=True,
                           track_changes=track_changes)
        handle = Process(self, cmd)
        self._handles = [h for h in self._handles if not h._cmd.done] + [handle]
        return handle

    def close(self) -> None:
        """Kill every command and the sandbox, reap, commit or drop the changes (``commit=``),
        remove the cgroup. Idempotent.

        Raises:
            lowlevel.workspace.overlay.CommitConflictError: the final commit (``commit=True``) met an entry
                changed on the host: nothing was applied and the changes were saved to
                ``err.saved_upper`` (the message gives the path).
            WorkspaceError: the final commit failed part-way (a full or read-only disk);
                ``err.saved_upper`` is where the changes were saved (or None, said in the message).
            Either comes after everything was torn down (no process, fd or cgroup is left);
            ``with Session(...)`` raises it too, unless the block is already raising: the
            block's exception then propagates with this one in a note (and a warning log).
            KeyboardInterrupt (a ^C, or a signal handler's exception) arriving while the sandbox
            is killed and reaped is held until both are done, and raised after the teardown.
        """
        try:
            self._core.close()
        finally:
            with self._cond:
                self._cond.notify_all()

    def _submit(self, argv: Sequence[str], **kwargs: object) -> Command:
        """:meth:`Core.submit_when_open`, waiting (this thread) while a commit()/reset() holds
        new commands."""
        steps = self._core.submit_when_open(argv, **kwargs)
        try:
            while True:
                next(steps)
                self._core.wait_gate()
        except StopIteration as done:
            cmd: Command = done.value
            return cmd
        finally:
            steps.close()

    # -- the I/O pump: one leader moves everybody's I/O, the others wait for it -------------
    def _wait(self, cmd: Command, deadline: float | None, until: Callable[[], bool] | None = None) -> None:
        self._wait_until(lambda: cmd.done or (until is not None and until()), deadline)

    def _wait_until(self, satisfied: Callable[[], bool], deadline: float | None) -> None:
        while not satisfied():
            with self._cond:
                if satisfied():
                    return
                if not self._io_lock.acquire(blocking=False):
                    left = FOLLOWER_WAIT_S if deadline is None else min(FOLLOWER_WAIT_S, deadline - time.monotonic())
                    if left <= 0:
                        return
                    self._cond.wait(left)
                    continue
            try:
                self._pump(satisfied, deadline)
            finally:
                with self._cond:
                    self._io_lock.release()
                    self._cond.notify_all()
            if deadline is not None and time.monotonic() >= deadline:
                return

    def _pump(self, satisfied: Callable[[], bool], deadline: float | None) -> None:
        core = self._core
        sock_fd = core.sock.fileno() if not core.closed else -1
        poller = select.poll()
        version = -1
        registered: set[int] = set()
        while not satisfied():
            if not core.usable:
                return
            if version != core.fds_version:
                with core.lock:
                    version = core.fds_version
                    wanted = {fd: (select.POLLOUT if fd == c.stdin_w else select.POLLIN)
                              for fd, c in core.fd_owner.items()}
                wanted[sock_fd] = select.POLLIN
                for fd in registered - wanted.keys():
                    poller.unregister(fd)
                for fd, ev in wanted.items():
                    poller.register(fd, ev)  # (re)sets the mask: fd numbers are reused
                registered = set(wanted)
            now = time.monotonic()
            wake = core.next_health_check(now)
            if deadline is not None:
                wake = min(wake, deadline)
            events = poller.poll(max(0.0, wake - now) * 1000)
            done_any = False
            for fd, _ev in events:
                if fd == sock_fd:
                    core.on_readable()
                    done_any = True
                    continue
                owner = core.fd_owner.get(fd)
                if owner is None or fd not in (owner.out_r, owner.err_r, owner.stdin_w):
                    continue
                if fd == owner.stdin_w:
                    owner.feed_stdin()
                    if owner.stdin_w is None:
                        _drop_owner(core, fd, owner)
                else:
                    owner.read(fd)
                    if fd not in (owner.out_r, owner.err_r):
                        _drop_owner(core, fd, owner)
            if done_any:
                with self._cond:
                    self._cond.notify_all()
            now = time.monotonic()
            if not events or now >= wake:
                core.check_health(now)
            if deadline is not None and now >= deadline:
                return

