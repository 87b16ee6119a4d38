"""The session's core: its sandbox, its socket to the init, its command table and its phase.

One concept: the state of one session and every decision about it, with no waiting policy
(the drivers wait: :mod:`lowlevel.session.sync` with threads and poll(2),
:mod:`lowlevel.session.aio` on an asyncio loop). :class:`Core` starts the sandbox with the init
as its program (:mod:`lowlevel.session.start`), submits commands (checks, pipes, a SPAWN),
dispatches the init's reports into Results, judges the session's health and moves its
:class:`~lowlevel.session.phase.Phase`, and closes it. The wire format is
:mod:`lowlevel.session.protocol`; the workspace gate that makes a commit or reset exclusive is
:mod:`lowlevel.session.gate`; the Result of a finished command is assembled by
:func:`lowlevel.session.outcome.command_result`.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence

from lowlevel import workspace as _ws
from lowlevel.errors import LaunchError, LowlevelError, PolicyError, SessionError, UnsupportedError
from lowlevel.host import landlock as _landlock
from lowlevel.sandbox import landlock_rules as _landlock_rules
from lowlevel.sandbox._interrupts import deferred_interrupts
# Private names of lowlevel.sandbox.launcher (its engineer is reshaping them): the argv check and
# the memfd of a large SPAWN body.
from lowlevel.sandbox.facts import host_facts, planned_policy
from lowlevel.sandbox.launcher import Run
from lowlevel.sandbox.plan import memfd as _memfd
from lowlevel.sandbox.request import RunRequest, check_seconds
from lowlevel.sandbox.result import Result
from lowlevel.session import protocol as proto
from lowlevel.session.command import Command
from lowlevel.session.gate import HeldError, WorkspaceGate
from lowlevel.session.outcome import (command_result, image_removed_error, init_death_message, shepherd_died_error,
                                      start_error)
from lowlevel.session.phase import Phase, track
from lowlevel.session.start import explain_fd_exhaustion, readable_within, start_init
from lowlevel.spec import limits as _limits
from lowlevel.spec import validate as _validate
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import WORKSPACE_DEST, Policy

log = logging.getLogger("lowlevel")

#: How often the host looks at the init's state (stopped?) while someone waits, seconds.
HEALTH_CHECK_S = 0.5
#: How long a full socket buffer is waited on before the init's state is looked at, seconds.
SEND_POLL_S = 1.0
#: How long bwrap's exit is waited for once the socket closed (the init died), seconds.
DEATH_REAP_WAIT_S = 1.0


def _check_session_args(policy: Policy | None, idle_timeout: float | None,
                        total_timeout: float | None) -> Policy:
    """The session's Policy (default ``Policy()``), its timeouts checked.

    Raises:
        PolicyError: not a Policy, or a timeout that is not a number of seconds > 0 or None.
    """
    policy = planned_policy(Policy() if policy is None else policy)  # the image store, the tree's checks
    for name, value in (("idle_timeout", idle_timeout), ("total_timeout", total_timeout)):
        if value is not None:
            check_seconds(value, name, zero=False)  # finite, > 0, below 2**31 (as run's timeout)
    return policy


def _check_call_args(argv: Sequence[str], stdin: bytes | None, timeout: float | None,
                     env: Mapping[str, str] | None, cwd: str, limits: Limits | None) -> tuple[list[str], str]:
    """One command's arguments checked as :func:`lowlevel.run` checks them, through the same
    :class:`~lowlevel.sandbox.request.RunRequest` (the fields a session command has: command,
    stdin, timeout, env, cwd): ``(argv as a list, cwd normalized)``.

    The usual call (a list or tuple of plain ``str``, no env, stdin None or bytes, a plain
    cwd) goes through :func:`_checked_plain`, which remembers the answers for the last few
    argvs (a session runs the same commands again and again: the checks cost ~50 us).

    Raises:
        PolicyError: a bad argv, timeout, stdin, cwd, env or limits (the message says which).
    """
    if limits is not None and not isinstance(limits, Limits):
        raise PolicyError(f"limits must be a lowlevel.Limits or None, got {type(limits).__name__}")
    if env is None and type(cwd) is str and type(argv) in (list, tuple) and all(type(a) is str for a in argv) \
            and (stdin is None or type(stdin) is bytes) and (timeout is None or type(timeout) in (int, float)):
        command, checked_cwd = _checked_plain(tuple(argv), timeout, cwd)
        return list(command), checked_cwd
    request = RunRequest(argv, stdin=stdin, timeout=timeout, env=env, cwd=cwd)
    return list(request.command), request.cwd or _validate.sandbox_cwd(cwd, "cwd")


@functools.lru_cache(maxsize=256, typed=True)
def _checked_plain(argv: tuple[str, ...], timeout: float | None, cwd: str) -> tuple[tuple[str, ...], str]:
    """:func:`_check_call_args` of exactly these values (plain ``str``, ``int``/``float``: immutable,
    so an answer cannot go stale; ``typed``: 1 and 1.0 and True are three keys). A refusal
    raises and is not remembered. The stdin check (bytes or None) is made by the caller; the
    answer holds no stdin, env or mutable object, so nothing is shared between commands."""
    request = RunRequest(argv, timeout=timeout, cwd=cwd)
    return tuple(request.command), request.cwd or _validate.sandbox_cwd(cwd, "cwd")


def _open_pipes(cmd: Command, stdin: bytes | None, send_fds: list[int], close_after: list[int]) -> int:
    """Create the command's stdio pipes: our ends go to ``cmd``, the init's to ``send_fds``
    (closed here after the send: ``close_after``). Returns the SPAWN flags they set.
    Call under :func:`deferred_interrupts` (every fd is recorded at once)."""
    flags = 0
    if stdin is not None:
        in_r, in_w = os.pipe()
        close_after.append(in_r)
        cmd.stdin_w = in_w
        os.set_blocking(in_w, False)
        cmd.stdin_view = memoryview(bytes(stdin))
        # Fill the pipe now, before the fd is visible to the thread moving I/O (two
        # writers on one pipe would interleave); the rest goes on POLLOUT.
        cmd.feed_stdin()
        send_fds.append(in_r)
        flags |= proto.SPAWN_STDIN_PIPE
    out_r, out_w = os.pipe()
    cmd.out_r = out_r
    close_after.append(out_w)
    err_r, err_w = os.pipe()
    cmd.err_r = err_r
    close_after.append(err_w)
    send_fds += [out_w, err_w]
    os.set_blocking(out_r, False)
    os.set_blocking(err_r, False)
    return flags


class Core(WorkspaceGate):
    """The sandbox, the socket and the command table; no waiting policy (see the drivers).

    Its workspace part (the live view, diff, and the gate that makes a commit or reset
    exclusive) is :class:`lowlevel.session.gate.WorkspaceGate`; its life is :attr:`phase`.
    """

    @explain_fd_exhaustion("cannot start the session")
    def __init__(self, policy: Policy | None, *, workspace: str | os.PathLike[str] | None,
                 inputs: Sequence[str | os.PathLike[str]], idle_timeout: float | None,
                 total_timeout: float | None, workspace_base: str | None, bwrap: str | None,
                 track_changes: bool, allow_sensitive_workspace: bool = False,
                 commit: bool | str = True, keep_workspace: bool = True) -> None:
        policy = _check_session_args(policy, idle_timeout, total_timeout)
        self.policy = policy
        self.track_changes = track_changes
        self.idle_timeout = idle_timeout
        self.total_timeout = total_timeout
        self.phase = Phase.STARTING
        track(self)  # a forked child's copy is CLOSED there (lowlevel.session.phase)
        # The init itself must not run under RLIMIT_CPU (it lives for thousands of commands):
        # the sandbox gets the Policy's limits without it; each command gets it back.
        # And it holds more fds than a command (proto.INIT_NOFILE_HEADROOM); each command gets the
        # Policy's RLIMIT_NOFILE back too.
        facts = host_facts(bwrap)
        self.sandbox_policy = dataclasses.replace(policy, limits=dataclasses.replace(
            policy.limits, cpu_s=None,
            nofile=proto.init_nofile(policy.limits.nofile, facts.caller_is_root and facts.cap_sys_resource)))
        exe = proto.init_path()
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        # Landlock (lowlevel.host.landlock): the init takes the TCP rules and scopes before its first
        # command; each command restricts itself with the filesystem rules.
        argv = proto.init_argv(idle_timeout, total_timeout,
                               _landlock_rules.ruleset_args(policy, facts.layout.ro_dirs, facts.bwrap.options))
        self.landlock_abi = 0
        self.run = Run(RunRequest(argv, workspace=workspace, inputs=inputs, timeout=None,
                                  workspace_base=workspace_base, allow_sensitive_workspace=allow_sensitive_workspace,
                                  commit=commit, keep_workspace=keep_workspace),
                       policy=self.sandbox_policy, bwrap=bwrap,
                       extra_fds={proto.SOCK_FD: child.fileno(), proto.EXE_FD: proto.init_fd(exe)}, guard=False,
                       one_shot=False)
        self.run.accept_seen_host_changes = True
        self.run.keep_close_error = True  # close() raises a failed final commit (it is not only logged)
        self._init_tables()
        try:
            self.landlock_abi, self.init_host_pid = start_init(self.run, self.sock, child)
        except BaseException:
            child.close()
            self.sock.close()
            self.run.close()
            self.run.discard_workspace_if_unused()
            raise
        child.close()
        self.phase = Phase.OPEN
        self._init_defaults()

    def _init_tables(self) -> None:
        """The command table, the workspace gate's state and the locks (before the start)."""
        self.cmds: dict[int, Command] = {}
        self.fd_owner: dict[int, Command] = {}
        self.next_id = 1
        self.failed: SessionError | None = None
        self.init_host_pid: int | None = None
        self.lock = threading.Lock()  # command table and socket sends
        self._init_gate()
        self.fds_version = 0
        self.last_state_check = 0.0
        #: The limits the session's cgroup enforces now (Pool.run rewrites them per call).
        self.cgroup_limits = self.policy.limits
        #: The cgroup's (oom_kills, pids.max hits) once the init is up: an OOM kill after it names
        #: memory in the SessionError of an init that died.
        self.cg_start: tuple[int | None, int | None] = (None, None)
        #: The counts read as the last command's Result was built, when it left none running and
        #: nothing since could have moved them (no command, limit rewrite, commit or reset: each
        #: bumps ``cg_epoch`` or the gate's ``generation``): the next command's start counts,
        #: without reading the cgroup's files again. None: read them.
        self.cg_idle: tuple[int | None, int | None] | None = None
        self.cg_epoch = 0

    def _init_defaults(self) -> None:
        """What the init's start settles: the cgroup's counts, each command's default environment
        and rlimits, and the notes every Result of the session carries."""
        policy = self.policy
        self.cg_start = self._cg_counts()
        self.env_default = proto.env_block(policy.environment())
        self.rlimit_default = proto.rlimit_records(policy.limits, self.run.cgroup)
        enforced = getattr(self.run.cgroup, "enforced", ()) if self.run.cgroup is not None else ()
        self.notes = tuple(self.run.notes) + (
            ("cgroup limits and accounting are shared by every command of the session",) if enforced else ()) + (
            (f"Landlock not applied: {_landlock.describe(0)}",)
            if not self.landlock_abi and policy.landlock is not False else ())

    @property
    def closed(self) -> bool:
        """:meth:`close` ran (:attr:`phase` is CLOSED)."""
        return self.phase is Phase.CLOSED

    @property
    def usable(self) -> bool:
        """Commands may run: the session is open, neither closed nor ended."""
        return self.phase is Phase.OPEN

    # -- submit --------------------------------------------------------------------------
    @explain_fd_exhaustion("cannot start the command")
    def submit(self, argv: Sequence[str], *, stdin: bytes | None, timeout: float | None,
               env: Mapping[str, str] | None, cwd: str | None, limits: Limits | None, stream: bool,
               track_changes: bool | None = None) -> Command:
        """Check a command's arguments, create its pipes and send its SPAWN; return its state.

        Raises:
            PolicyError: a bad argument, or a per-command limit the session cannot enforce.
            SessionError: the session is closed or ended.
            HeldError: a commit()/reset() holds new commands (the driver waits, then retries:
                :meth:`submit_when_open`).
        """
        if cwd is None:
            cwd = self.policy.workdir or WORKSPACE_DEST
        command, cwd = _check_call_args(argv, stdin, timeout, env, cwd, limits)
        if self.failed is not None:
            raise self.failed
        generation = self.generation
        if self.exclusive is not None:
            raise HeldError()  # a commit()/reset() holds new commands: the driver waits, then retries
        cmd, envc, rlb, strings = self._new_cmd(command, timeout, env, cwd, limits, stream, track_changes)
        send_fds: list[int] = []
        close_after: list[int] = []
        # Every fd below is recorded before a signal handler's exception can fire
        # (lowlevel.sandbox._interrupts): a ^C between os.pipe() and its owner leaked the pair.
        with deferred_interrupts():
            try:
                flags = _open_pipes(cmd, stdin, send_fds, close_after)
                with self.lock:
                    self._send_spawn(cmd, generation, flags, rlb, strings, envc, send_fds, close_after)
            except BaseException:
                cmd.close_fds()
                raise
            finally:
                for fd in close_after:
                    os.close(fd)
        return cmd

    def submit_when_open(self, argv: Sequence[str], **kwargs: object) -> Generator[None, None, Command]:
        """:meth:`submit`, retried while a commit()/reset() holds new commands: the one waiting
        loop both drivers run. Each ``yield`` asks the driver to wait until the gate reopens
        (``exclusive`` is None, or the session ended), its way; the generator's return value
        is the command. Counted in :attr:`queued` while held, so it goes before the next
        commit()/reset(); closing the generator (the driver's wait raised) uncounts it."""
        queued = False
        try:
            while True:
                try:
                    return self.submit(argv, **kwargs)  # type: ignore[arg-type]
                except HeldError:
                    if not queued:
                        self.queue(+1)
                        queued = True
                yield
        finally:
            if queued:
                self.queue(-1)

    def _new_cmd(self, command: list[str], timeout: float | None, env: Mapping[str, str] | None, cwd: str,
                 limits: Limits | None, stream: bool,
                 track_changes: bool | None) -> tuple[Command, int, bytes, bytes]:
        """The command's host-side state and the SPAWN body's parts: ``(cmd, envc, rlimit
        records, strings)``; takes the workspace snapshot of ``track_changes``.

        Raises:
            PolicyError: a NUL in an argument or the environment, or limits the session cannot
                enforce for one command (:meth:`check_call_limits`).
        """
        call_notes = self.check_call_limits(limits) if limits is not None else ()
        envc, envb = self.env_default if env is None else proto.env_block(self.policy.environment(env))
        names, rlb = self.rlimit_default if limits is None else proto.rlimit_records(limits, self.run.cgroup,
                                                                                     self._bounds().get("RLIMIT_NOFILE"))
        strings = proto.spawn_strings(cwd, command, envb)  # NUL-separated for the init: refuses a NUL
        cmd = Command(0, command, self.policy, timeout, stream)
        cmd.rlimit_names = names
        if self.run.egress is not None:
            cmd.net_from = len(self.run.egress.listener.attempts)
        cmd.notes = call_notes
        if track_changes if track_changes is not None else self.track_changes:
            cmd.before = _ws.snapshot(self.view())
        return cmd, envc, rlb, strings

    def _send_spawn(self, cmd: Command, generation: int, flags: int, rlb: bytes, strings: bytes, envc: int,
                    send_fds: list[int], close_after: list[int]) -> None:
        """Give ``cmd`` its id, enter it in the table and send its SPAWN (holds self.lock).

        Raises:
            SessionError: the session ended meanwhile (nothing was sent).
            HeldError: a commit()/reset() began (or ran) since :meth:`submit` checked: the
                command would start in a layer being replaced (or its track_changes snapshot
                be of the old one). Nothing was sent: the driver waits for the gate and retries.
        """
        if self.failed is not None:
            raise self.failed
        if self.exclusive is not None or self.generation != generation:
            raise HeldError()
        cmd.id = self.next_id
        self.next_id += 1
        body = rlb + strings
        if len(body) > proto.MAX_INLINE:
            mfd = _memfd("lowlevel-spawn", body)
            close_after.append(mfd)
            send_fds.append(mfd)
            flags |= proto.SPAWN_BODY_MEMFD
            body = b""
        if cmd.stream:
            flags |= proto.SPAWN_STARTED  # a background command's handle shows its pid
        header = proto.spawn_header(cmd.id, flags, len(rlb), cmd.timeout, len(cmd.argv), envc)
        if self.cmds:
            cmd.alone = False
            for other in self.cmds.values():
                other.alone = False
        if self.run.cgroup is not None:
            idle = self.cg_idle if not self.cmds else None
            cmd.cg_before = idle if idle is not None else self._cg_counts()
        self.cg_idle = None
        self.cg_epoch += 1
        self.cmds[cmd.id] = cmd
        for fd in cmd.fds():
            self.fd_owner[fd] = cmd
        self.fds_version += 1
        try:
            self._send([header, body], send_fds)
        except BaseException:
            self.cmds.pop(cmd.id, None)
            for fd in cmd.fds():
                self.fd_owner.pop(fd, None)
            raise

    def check_call_limits(self, limits: Limits) -> tuple[str, ...]:
        """Refuse per-command limits the session cannot enforce for one command; return notes.

        rlimits (``cpu_s``, ``fsize_bytes``, ``nofile``, ``core_bytes``,
        ``address_space_bytes``, and the ``RLIMIT_DATA``/``RLIMIT_NPROC`` fallbacks of
        ``memory_bytes``/``pids`` where no cgroup enforces them) are set per command. The
        cgroup's limits (``memory_bytes``, ``pids``, ``cpu_quota`` where its cgroup enforces
        them) bound the whole session, and ``tmp_size_bytes``/``workspace_bytes``/``upper`` were
        fixed when it started: a command asking for other values gets a PolicyError (never a limit
        silently not applied). :meth:`Pool.run` rewrites its sandbox's cgroup for the call
        first (each call has a sandbox of its own), so there they apply.

        Raises:
            PolicyError: a value the session cannot apply to one command (the message says
                what to do).
            UnsupportedError: ``limits.require`` names a limit this session does not enforce.
        """
        cg = self.run.cgroup
        enforced = frozenset(cg.enforced) if cg is not None else frozenset()
        current = self.cgroup_limits
        for name, controller, cgfile in (("memory_bytes", "memory", "memory.max"), ("pids", "pids", "pids.max"),
                                         ("cpu_quota", "cpu", "cpu.max")):
            if controller in enforced and getattr(limits, name) != getattr(current, name):
                raise PolicyError(
                    f"per-command limits.{name}={getattr(limits, name)!r} cannot be enforced in a Session: its "
                    f"cgroup ({cgfile}) bounds all its commands together, at {getattr(current, name)!r}. Set it "
                    "on the Session's Policy, or use Pool.run or lowlevel.run for a per-call limit "
                    "(dataclasses.replace(session_policy.limits, ...) keeps the session's values)")
        for name in ("tmp_size_bytes", "workspace_bytes", "upper"):
            if getattr(limits, name) != getattr(self.policy.limits, name):
                raise PolicyError(f"per-command limits.{name}={getattr(limits, name)!r} cannot apply: the "
                                  "session's mounts were made at its start with "
                                  f"{getattr(self.policy.limits, name)!r}; set it on the Session's or Pool's Policy")
        for name in limits.require:
            ok = cg is not None if name == "cgroup" else name in enforced
            if not ok:
                raise UnsupportedError(f"cgroup:{name}", f"limits.require has {name!r} but this session's "
                                       f"cgroup does not enforce it (enforced: {sorted(enforced) or 'none'})")
        if limits == self.policy.limits:
            return ()
        # The init sets each command's rlimits under the sandbox's hard limits (the session's,
        # applied before bwrap): above them it lowers the value, which is said here, as run() does.
        bounds = self._bounds()
        lowered = tuple(_limits.lowered_note(name, hard, bounds[name], "the session's hard limit", "command")
                        for name, _soft, hard in _limits.rlimits(limits, cg) if name in bounds and hard > bounds[name])
        return lowered + tuple(n for n in _limits.fallback_notes(limits, cg) if n not in self.notes)

    def _bounds(self) -> dict[str, int]:
        """The session's hard rlimits, which no command's may exceed: the sandbox's, applied before
        bwrap, but ``RLIMIT_NOFILE`` the Policy's (the init's is higher: proto.INIT_NOFILE_HEADROOM)."""
        bounds = {name: hard for name, _soft, hard in self.run.pre_exec_rlimits}
        if "RLIMIT_NOFILE" in bounds and self.policy.limits.nofile is not None:
            bounds["RLIMIT_NOFILE"] = min(bounds["RLIMIT_NOFILE"], self.policy.limits.nofile)
        return bounds

    def set_cgroup_limits(self, limits: Limits) -> None:
        """Rewrite the session cgroup's memory, pids and CPU limits (:meth:`Pool.run`, whose
        sandbox serves one call). Controllers the cgroup does not enforce keep their rlimit
        fallback, applied per command.

        Raises:
            LaunchError: the cgroup refused a value (``EBUSY``: memory in use above it).
        """
        cg = self.run.cgroup
        if cg is None or limits == self.cgroup_limits:
            return
        with self.lock:  # a lower memory.max can OOM-kill: the counts must be read afresh
            self.cg_idle = None
            self.cg_epoch += 1
        try:
            cg.update_limits(limits)
        except OSError as err:
            raise LaunchError(f"cannot set the pool sandbox's cgroup limits for this call: {err}",
                              errno=err.errno) from err
        self.cgroup_limits = limits

    def _cg_counts(self) -> tuple[int | None, int | None]:
        cg = self.run.cgroup
        if cg is None:
            return None, None
        try:
            counts: tuple[int | None, int | None] = cg.event_counts()
        except OSError:
            return None, None
        return counts

    def _send(self, parts: list[bytes], fds: list[int]) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
        deadline = time.monotonic() + proto.SEND_TIMEOUT_S
        while True:
            try:
                self.sock.sendmsg(parts, anc)
                return
            except BlockingIOError:
                # The init is not reading (stopped?); wait a little for buffer space.
                if time.monotonic() > deadline or not select.select([], [self.sock], [], SEND_POLL_S)[1] and \
                        self._init_stopped():
                    self._fail_locked("the session's init stopped reading commands (stopped by a "
                                      "command?); the session was killed", "unresponsive")
                    assert self.failed is not None
                    raise self.failed from None
            except OSError as err:
                if err.errno != errno.ETOOMANYREFS:
                    if isinstance(err, (BrokenPipeError, ConnectionResetError)):
                        self._init_gone(err)
                    raise
                raise LaunchError(f"cannot pass the command's pipes to the session's init: {proto.TOO_MANY_REFS}",
                                  errno=err.errno) from None

    def _init_gone(self, err: OSError) -> None:
        """The init's end of the socket is closed: fail the session with why, and raise that."""
        bye = self._pending_bye()
        if bye is not None:
            self._fail_locked(*bye)
        self._fail_locked(self._death_message(), "init_died")
        assert self.failed is not None
        raise self.failed from err

    def _pending_bye(self) -> tuple[str, str] | None:
        """The (message, reason) of a BYE still queued on the socket (the init ended itself)."""
        while True:
            try:
                data = self.sock.recv(proto.RECV_SIZE)
            except OSError:
                return None
            if not data:
                return None
            msg = proto.decode(data)
            if isinstance(msg, proto.Bye):
                return self._bye(msg)

    def _bye(self, msg: proto.Bye) -> tuple[str, str]:
        reason = msg.reason
        limit = self.idle_timeout if reason == "idle_timeout" else self.total_timeout
        return f"the session ended: its {reason.replace('_', ' ')} of {limit} s passed", reason

    def signal(self, cmd: Command, signo: int, tree: bool) -> None:
        """Ask the init to signal a command's group (tree: SIGKILL its whole tree)."""
        with self.lock:
            if cmd.done or self.failed is not None:
                return
            if tree:
                cmd.cancelled = True
            try:
                self.sock.send(proto.signal_msg(cmd.id, signo, tree))
            except OSError:
                pass

    # -- receive -------------------------------------------------------------------------
    def on_readable(self) -> None:
        """Drain and dispatch every message waiting on the socket (one reader at a time)."""
        while True:
            try:
                data = self.sock.recv(proto.RECV_SIZE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                with self.lock:
                    self._fail_locked(self._death_message(), "init_died")
                return
            self._dispatch(data)

    def _dispatch(self, data: bytes) -> None:
        msg = proto.decode(data)
        if isinstance(msg, proto.Started):
            cmd = self.cmds.get(msg.cid)
            if cmd is not None:
                cmd.pid = msg.pid
        elif isinstance(msg, proto.ExitReport):
            cmd = self.cmds.get(msg.cid)
            if cmd is not None:
                self._finish(cmd, msg)
        elif isinstance(msg, proto.Bye):
            with self.lock:
                self._fail_locked(*self._bye(msg))
        else:
            with self.lock:
                self._fail_locked(f"malformed message from the session init (type {proto.message_type(data)}, "
                                  f"{len(data)} bytes)", "protocol")

    def _finish(self, cmd: Command, report: proto.ExitReport) -> None:
        # The shepherd reported only after the command's whole tree was dead: what is in the
        # pipes is all there is. Drain without waiting for EOF (another command of the session
        # could hold a copy of our pipe through /proc/PID/fd).
        owned = cmd.fds()
        for fd in (cmd.out_r, cmd.err_r):
            if fd is not None:
                cmd.read(fd)
        with self.lock:
            self.cmds.pop(cmd.id, None)
            for fd in owned:
                if self.fd_owner.get(fd) is cmd:
                    del self.fd_owner[fd]
            self.fds_version += 1
            cmd.close_fds()
            self.finishing += 1  # a commit()/reset() waits until its Result is built (drained())
        try:
            self._finish_result(cmd, report)
        finally:
            with self.lock:
                self.finishing -= 1
                seen = cmd.cg_after
                if seen is not None and seen[0] == (self.cg_epoch, self.generation) and not self.cmds:
                    self.cg_idle = seen[1]

    def _finish_result(self, cmd: Command, report: proto.ExitReport) -> None:
        """Settle ``cmd`` from its EXIT: its Result, or the error that ended it."""
        # The shepherd's own measure (CLOCK_MONOTONIC, from its fork to the command's end): the
        # host's clock reading here would include any time the caller was stopped or starved.
        wall = report.wall_ns / 1e9 if report.wall_ns > 0 else time.monotonic() - cmd.t0
        error = start_error(cmd, report.kind, report.status, report.stage)
        if error is not None:
            cmd.error = image_removed_error(self.policy, error)
        elif report.kind == proto.EXIT_SHEPHERD_DIED and self._oom_since(cmd):
            # The memory cgroup's OOM killer took the command's shepherd (oom_score_adj 1000 like
            # the command, fewer pages): a verdict on the command's memory, not a broken session.
            cmd.notes += (_limits.memory_kill_note(self.cgroup_limits, "the command's supervisor in the "
                                                   "session (its shepherd), and the command's processes with it",
                                                   session=True),)
            cmd.result = self._result(cmd, report.status, report.flags, report.utime_us, report.stime_us,
                                      report.maxrss_kib, wall)
        elif report.kind == proto.EXIT_SHEPHERD_DIED:
            cmd.error = shepherd_died_error(cmd, report.status)
        else:
            cmd.result = self._result(cmd, report.status, report.flags, report.utime_us, report.stime_us,
                                      report.maxrss_kib, wall)
        cmd.done = True

    def _result(self, cmd: Command, status: int, flags: int, utime_us: int, stime_us: int, maxrss_kib: int,
                wall: float) -> Result:
        """Gather the session's side of a finished command's Result (the cgroup's counts over its
        life, its changes, the egress attempts) for :func:`command_result`, which judges it."""
        oom_kills = pids_hits = None
        if self.run.cgroup is not None:
            epoch = (self.cg_epoch, self.generation)
            (oom0, hits0), (oom1, hits1) = cmd.cg_before, self._cg_counts()
            cmd.cg_after = (epoch, (oom1, hits1))
            oom_kills = None if oom1 is None else oom1 - (oom0 or 0)
            pids_hits = None if hits1 is None else hits1 - (hits0 or 0)
        changes = _ws.Changes()
        if cmd.before is not None:
            changes = _ws.diff(cmd.before, _ws.snapshot(self.view()))
        cgroup_enforced = tuple(f"cgroup:{c}" for c in self.run.cgroup.enforced) if self.run.cgroup else ()
        enforced = cmd.rlimit_names + cgroup_enforced + (("seccomp",) if self.run.seccomp_loaded else ()) \
            + (("landlock",) if self.landlock_abi else ())
        network, network_notes = None, ()
        if self.run.egress is not None:
            # Egress mode: the attempts the session made while this command ran (commands running
            # at the same time share the sandbox's proxy, so each lists the others' too).
            listener = self.run.egress.listener
            network = listener.attempts_since(cmd.net_from)[0]
            network_notes = tuple(listener.notes())
        return command_result(cmd, status=status, flags=flags, utime_us=utime_us, stime_us=stime_us,
                              maxrss_kib=maxrss_kib, wall_s=wall, oom_kills=oom_kills, pids_hits=pids_hits,
                              policy=self.policy, cgroup_limits=self.cgroup_limits, enforced=enforced,
                              landlock_abi=self.landlock_abi, session_notes=self.notes, changes=changes,
                              network=network, network_notes=network_notes, workspace=self.run.workspace)

    # -- health and failure --------------------------------------------------------------
    def check_health(self, now: float) -> None:
        """Declare the session unresponsive when a command overran its timeout by
        :data:`~lowlevel.session.protocol.GRACE_S`, or when the init is stopped (checked at most
        every :data:`HEALTH_CHECK_S`, only while someone waits)."""
        overdue = [c for c in list(self.cmds.values()) if c.host_deadline is not None and now > c.host_deadline]
        if overdue:
            with self.lock:
                self._fail_locked(f"{overdue[0].argv[0]!r} overran its timeout of {overdue[0].timeout} s by "
                                  f"{proto.GRACE_S} s without a report: its supervisor or the session's init was "
                                  "stopped by a command; the session was killed", "unresponsive")
            return
        if now - self.last_state_check >= HEALTH_CHECK_S:
            self.last_state_check = now
            if self._init_stopped():
                with self.lock:
                    self._fail_locked("the session's init was stopped (SIGSTOP from a command?); the session "
                                      "was killed", "unresponsive")

    def next_health_check(self, now: float) -> float:
        t = now + HEALTH_CHECK_S
        for c in list(self.cmds.values()):
            if c.host_deadline is not None:
                t = min(t, c.host_deadline + 0.001)
        return t

    def _init_stopped(self) -> bool:
        pid = self.init_host_pid
        if pid is None or self.failed is not None:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
        return state in (b"T", b"t")

    def _oom_since(self, cmd: Command | None = None) -> bool:
        """True when the session cgroup's OOM kill count rose since ``cmd`` started (since the
        session started without one)."""
        before = cmd.cg_before[0] if cmd is not None else self.cg_start[0]
        now = self._cg_counts()[0]
        return now is not None and now > (before or 0)

    def _death_message(self) -> str:
        r = self.run
        if r.wait_status is None and readable_within(r.pidfd, DEATH_REAP_WAIT_S):
            r.reap_bwrap() if hasattr(r, "reap_bwrap") else r.reap()
        code = None
        if r.json_r is not None:
            r.read_fd("json_r")
        for doc in r._docs():
            if "exit-code" in doc:
                code = int(doc["exit-code"])
        return init_death_message(code, self.cgroup_limits if self._oom_since() else None)

    def _fail_locked(self, message: str, reason: str) -> None:
        """Mark the session failed, fail every pending command, kill the sandbox. Holds self.lock."""
        if self.failed is not None:
            return
        self.failed = SessionError(message, reason)
        self.phase = Phase.ENDED
        oom = reason == "init_died" and self._oom_since()
        for cmd in list(self.cmds.values()):
            for fd in (cmd.out_r, cmd.err_r):
                if fd is not None:
                    cmd.read(fd)
            cmd.close_fds()
            if oom and self._oom_since(cmd):
                # Killed with the init by the memory limit: the command's verdict is a Result
                # (killed_by="memory"); the session's later calls get the SessionError.
                cmd.notes += (message,)
                cmd.before = None
                cmd.result = self._result(cmd, signal.SIGKILL, 0, 0, 0, 0, time.monotonic() - cmd.t0)
            else:
                cmd.error = self.failed
            cmd.done = True
        self.cmds.clear()
        self.fd_owner.clear()
        self.fds_version += 1
        self.gate.notify_all()
        try:
            self.run.kill(None)
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Kill the sandbox and everything in it, reap bwrap, commit or drop the session's
        changes (``commit=``), remove the cgroup, close every fd. Idempotent.

        Raises:
            lowlevel.workspace.overlay.CommitConflictError: ``commit=True`` and the final commit met an
                entry changed on the host: nothing was applied; the changes were saved to
                ``.saved_upper`` (None if saving failed too: the message says why).
            WorkspaceError: the final commit failed part-way (a full or read-only disk); the
                changes were saved to ``.saved_upper`` where possible.
            Either is raised after everything was torn down: no process, fd or cgroup is left.
        """
        if self.phase is Phase.CLOSED:
            return
        self.phase = Phase.CLOSED
        with self.lock:
            if self.failed is None:
                self.failed = SessionError("the session is closed", "closed")
            for cmd in list(self.cmds.values()):
                cmd.close_fds()
                cmd.error = self.failed
                cmd.done = True
            self.cmds.clear()
            self.fd_owner.clear()
            self.gate.notify_all()
        with self.ws_lock:  # a commit()/reset() under way in another thread finishes first
            try:
                self.sock.close()
            finally:
                try:
                    self.run.close()
                finally:
                    self._drop_fresh_workspace()
        err, self.run.close_error = self.run.close_error, None
        if err is not None:
            raise err

    def __del__(self) -> None:
        """Collected open (its Session or AsyncSession was dropped without close()): closed as
        :meth:`close` closes it, ``commit=`` and ``keep_workspace`` applied; an error of its
        final commit is logged (nobody is there to raise it to). Not at the interpreter's exit,
        where the modules it needs may be gone already (the sandbox dies with the process: its
        anchor's parent-death signal; ``lowlevel cleanup`` removes what is left)."""
        if getattr(self, "phase", Phase.CLOSED) in (Phase.OPEN, Phase.ENDED) and not sys.is_finalizing():
            try:
                self.close()
            except LowlevelError as err:
                log.warning("lowlevel: closing a session nobody closed: %s", err)
            except Exception:  # noqa: BLE001 (a finalizer raises nothing)
                pass

    def _drop_fresh_workspace(self) -> None:
        """``keep_workspace=False``: remove the session's fresh workspace once its sandbox is gone
        (named ``rm-...``: ``lowlevel cleanup`` removes it if this process dies first). A failure
        is logged, never raised over the close's own outcome."""
        run = self.run
        if run.keep_workspace or not run.owns_workspace or not run.workspace or not os.path.lexists(run.workspace):
            return
        try:
            _ws.remove_workspace(run.workspace)
        except (OSError, LowlevelError) as err:
            log.warning("lowlevel: keep_workspace=False: cannot remove %s: %s", run.workspace, err)


def close_on_exit(close: Callable[[], None], exc: BaseException | None) -> None:
    """``close()`` for ``__exit__``: its error (a failed final commit) is raised, unless the
    block is already raising ``exc``: that one propagates, with the close's error in a note
    (``add_note``, PEP 678) and a warning log, instead of being masked."""
    try:
        close()
    except LowlevelError as err:
        if exc is None:
            raise
        note_close_failure(exc, err)


def note_close_failure(exc: BaseException, err: LowlevelError) -> None:
    """Note ``err`` (closing the session failed) on ``exc``, the exception already propagating, and log it."""
    exc.add_note(f"lowlevel: closing the session failed too: {type(err).__name__}: {err}")
    log.warning("lowlevel: closing the session failed: %s", err)
