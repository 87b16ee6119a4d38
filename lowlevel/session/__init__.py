"""Session mode: one sandbox, many commands; and a warm Pool of fresh sandboxes.

A :class:`Session` sets the sandbox up once (one bwrap, same Policy, seccomp filter and limits
as :func:`lowlevel.run`) with a small C init as its program (``native/lowlevel_init.c``), then
runs each command inside it at the cost of a fork and an exec. :class:`AsyncSession` is the
asyncio form. A :class:`Pool` keeps N sandboxes started in advance, each with its own fresh
workspace, and gives each call a sandbox of its own: the isolation of ``run`` at close to a
session's latency.

Glossary:
    init: ``lowlevel_init``, the sandbox's program (PID 2, under bwrap's PID-1 reaper). It
        receives commands over a socket, forks a shepherd per command and reaps shepherds.
    shepherd: one per command: a child subreaper that vforks and execs the command, enforces
        its timeout, kills its whole tree when it ends and reports status and rusage.
    command: what the caller asked to run; the leader of its own process group.

Isolation between commands of one session (exactly):
    Shared: the workspace (``/workspace``) and ``/tmp`` and ``/dev/shm`` (one tmpfs each, for the
        session's life); every namespace (mount, PID, network, IPC, UTS, user); the seccomp
        filter; the Landlock TCP rules and scopes (the init's domain); the uid and gid; the
        session's cgroup, hence its ``memory_bytes``, ``pids`` and ``cpu_quota`` limits and its
        CPU/memory accounting (a command that fills memory can get another one OOM-killed); in
        egress mode the proxy, its ``net_bytes`` budget and its report (each Result lists the
        attempts made while its command ran); the environment given to bwrap (each command
        gets the Policy's environment plus its own ``env``, nothing else: the init passes an
        explicit environment to execve).
    Separate: each command runs in its own process group with its own stdin/stdout/stderr
        pipes (outputs are never mixed), its own rlimits (``RLIMIT_CPU``, ``RLIMIT_FSIZE``,
        ``RLIMIT_NOFILE``, ``RLIMIT_CORE``, and ``RLIMIT_DATA``/``RLIMIT_NPROC`` where the
        cgroup does not enforce memory/pids), its own cwd, its own timeout, its own Landlock
        domain for the filesystem rules (the same rules for every command; nested in the
        init's, so commands still signal each other: :mod:`lowlevel.host.landlock`).
    Not isolated: commands run as the same uid in one PID namespace, so a command can see
        the others in ``/proc``, signal them and read their ``/proc/PID/{environ,cmdline}``
        (ptrace, process_vm_* and pidfd_getfd are denied by the seccomp profile). Use a Pool,
        or one ``run`` per call, when calls must not see each other.
    Lifetime: no command outlives its own end: when a command's main process exits, times
        out or is killed, its shepherd SIGKILLs its process group and then every process
        reparented to it (a double-forked ``setsid`` daemon included) until none is left, and
        only then reports. Background commands (:meth:`Session.start`) live until they exit,
        time out, are killed, or the session closes.
    Commit and reset: :meth:`Session.commit` and :meth:`Session.reset` replace the workspace's
        upper layer, so no command runs across one: they wait for the commands :meth:`Session.run`
        started, hold commands submitted meanwhile until they are done, and refuse while a
        background command runs (``running="wait"`` waits for it, ``running="leave"`` leaves it
        in the old layer). A command that exited 0 before or during a commit is in it.
    The init: not dumpable (``PR_SET_DUMPABLE`` 0: no ptrace, no ``/proc/2/fd``), ignores
        every catchable signal, and keeps no command's fds. A command can still SIGKILL or
        SIGSTOP it (same uid; the kernel offers no way to refuse those). Killing it ends the
        session at once (bwrap's PID 1 exits with it and the kernel kills the PID namespace):
        every waiting call and every later one raises :class:`SessionError` with
        ``reason="init_died"``. A stopped init or shepherd is found by the host when a command
        overruns its timeout by :data:`GRACE_S` (or, for a command without timeout, when the
        init's state is ``T``), and the session is then killed (``reason="unresponsive"``).
        Either way the caller never hangs and nothing is left running.

The session ends on :meth:`Session.close`, on the caller's death (bwrap ``--die-with-parent``),
on its idle or total timeout (enforced by the init, which then exits), or on the init's death;
in every case the kernel kills the sandbox's PID namespace, and ``close()`` reaps bwrap and
removes the session's cgroup.

How the init gets in: the host opens the installed ``lowlevel/_lowlevel_init`` (static, mode
0755) once per process and passes the fd to bwrap, which execs ``/proc/self/fd/10``; the init
closes that fd first thing. No bind mount, nothing added to the sandbox's file tree, and the
package's host path need not be reachable by the sandbox's uid (a per-run uid for root callers).

Protocol (``SOCK_SEQPACKET`` socketpair; one record per message; native byte order; layouts in
``native/lowlevel_init.c``):
    host -> init: ``SPAWN`` (header, rlimits, cwd, argv, env; stdio pipes attached with
        ``SCM_RIGHTS``; a body over 128 KiB travels in a memfd), ``SIGNAL`` (id, signo, or
        "kill the tree").
    init/shepherd -> host: ``HELLO`` (version; the kernel attaches the init's host PID with
        ``SO_PASSCRED``), ``STARTED`` (id, PID inside), ``EXIT`` (id, kind, wait status or
        errno and stage, flags timed-out/cancelled, user and system CPU and max RSS of the
        command's tree from ``getrusage(RUSAGE_CHILDREN)``), ``BYE`` (idle/total timeout).
    Output never travels over the socket: the command writes into pipes the host created.

Sources: unix(7) (SOCK_SEQPACKET, SCM_RIGHTS, SO_PASSCRED); prctl(2) (PR_SET_CHILD_SUBREAPER,
Linux 3.4; PR_SET_DUMPABLE); credentials(7) (process groups); bwrap(1).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import os
import resource
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lowlevel.paths import native
from lowlevel.workspace import cow as _cow
from lowlevel.sandbox._interrupts import deferred_interrupts
from lowlevel.host import landlock as _landlock
from lowlevel.spec import limits as _limits
from lowlevel.workspace import overlay as _overlay
from lowlevel.spec import validate as _validate
from lowlevel import workspace as _ws
from lowlevel.sandbox.argv import encode_args
from lowlevel.errors import (CommitIncompleteError, LaunchError, LowlevelError, PolicyError, SessionError,
                             UnsupportedError)
from lowlevel.sandbox.facts import host_facts
from lowlevel.sandbox.failures import ExecError, network_denial_note, pids_note
from lowlevel.sandbox.commit import conflict_dir as _conflict_dir
from lowlevel.sandbox.launcher import SETUP_TIMEOUT_S, Run, _check_command
from lowlevel.sandbox.state import _Capture
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import WORKSPACE_DEST, Policy
from lowlevel.sandbox.request import RunRequest  # noqa: I001
from lowlevel.sandbox.result import Result

log = logging.getLogger("lowlevel")

#: Extra seconds the host waits past a command's timeout before it declares the session
#: unresponsive (the shepherd enforces the timeout itself; this covers a stopped shepherd).
GRACE_S = 2.0
#: How long the host waits for the init's HELLO after bwrap released it, seconds.
HELLO_TIMEOUT_S = 10.0
#: Path of the init executable built at install time (``setup.py`` ``build_ext``).
INIT_PATH = native("_lowlevel_init")

# Fd numbers inside the sandbox (extra_fds of the Run: 9 and up are ours).
_SOCK_FD = 9
_EXE_FD = 10

# Protocol, mirrored from native/lowlevel_init.c.
_PROTO_VERSION = 1
_MSG_SPAWN, _MSG_SIGNAL = 1, 2
_MSG_HELLO, _MSG_STARTED, _MSG_EXIT, _MSG_BYE = 100, 101, 102, 103
_SPAWN_STDIN_PIPE, _SPAWN_BODY_MEMFD = 1, 2
_SIGNAL_TREE = 1
_EXIT_WAIT_STATUS, _EXIT_SETUP_FAILED, _EXIT_SPAWN_FAILED, _EXIT_SHEPHERD_DIED = 0, 1, 2, 3
_EXITF_TIMED_OUT, _EXITF_CANCELLED = 1, 2
_STAGES = {1: "chdir", 2: "setrlimit", 3: "execve", 4: "stdio", 5: "landlock",
           6: "working directory outside the sandbox"}
_BYE_REASONS = {1: "idle_timeout", 2: "total_timeout"}
_SPAWN_HDR = struct.Struct("=IIIIqII")
_RLIM = struct.Struct("=IIQQ")
_SIGNAL = struct.Struct("=IIII")
_SMALL = struct.Struct("=IIII")
_EXIT = struct.Struct("=IIIIIIqqqq")
_MAX_INLINE = 128 * 1024
#: A path that exists in no sandbox: the Pool's warm-up command fails in execve on purpose.
_WARMUP_PROGRAM = "/.lowlevel-warmup-does-not-exist"
_U64 = 2**64 - 1


def init_path() -> str:
    """Path of the ``lowlevel_init`` executable: ``$LOWLEVEL_INIT`` or the one installed.

    Raises:
        UnsupportedError: it is missing (the package was installed without building it).
    """
    path = os.environ.get("LOWLEVEL_INIT") or INIT_PATH
    if not os.access(path, os.X_OK):
        raise UnsupportedError("session-init", f"the session init executable {path} is missing or not "
                               "executable", "reinstall lowlevel (pip install .) with a C compiler present")
    return path


@functools.lru_cache(maxsize=None)
def _init_fd(path: str) -> int:
    """An O_RDONLY fd of the init executable, opened once per process.

    bwrap execs it as ``/proc/self/fd/10``: no bind mount is needed and its host path need
    not be reachable by the sandbox's uid (only its mode, 0755, matters).
    """
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def _rlimit_records(limits: Limits, cgroup: Any) -> tuple[tuple[str, ...], bytes]:
    triples = _limits.rlimits(limits, cgroup)
    names = tuple(name for name, _s, _h in triples)
    data = b"".join(_RLIM.pack(getattr(resource, name), 0, soft & _U64, hard & _U64)
                    for name, soft, hard in triples)
    return names, data


def _env_block(env: Mapping[str, str]) -> tuple[int, bytes]:
    return len(env), encode_args([f"{k}={v}" for k, v in env.items()])  # refuses a NUL: the last line


class _Cmd:
    """Host-side state of one command."""

    def __init__(self, cid: int, argv: list[str], policy: Policy, timeout: float | None,
                 stream: bool) -> None:
        self.id = cid
        self.argv = argv
        self.timeout = timeout
        self.t0 = time.monotonic()
        self.host_deadline = None if timeout is None else self.t0 + timeout + GRACE_S
        self.out = _Capture(policy.stdout_limit_bytes)
        self.err = _Capture(policy.stderr_limit_bytes)
        self.stream = stream
        #: Started with Session.start (a background command): a commit()/reset() refuses,
        #: waits for or leaves it (``running=``); one from run() is always waited for.
        self.background = stream
        self.new_out = bytearray()
        self.new_err = bytearray()
        self.out_r: int | None = None
        self.err_r: int | None = None
        self.stdin_w: int | None = None
        self.stdin_view: memoryview | None = None
        self.pid: int | None = None
        self.done = False
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.rlimit_names: tuple[str, ...] = ()
        self.before: Any = None
        self.net_from = 0  # egress mode: index of the session's first proxy attempt during this command
        self.notes: tuple[str, ...] = ()
        # The session cgroup's (oom_kills, pids.max hits) when the command started, and
        # whether it ever ran alongside another command (then a count may be the other's).
        self.cg_before: tuple[int | None, int | None] = (None, None)
        self.alone = True

    def outcome(self) -> Result:
        """The finished command's Result, or raise the error that ended it."""
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def fds(self) -> list[int]:
        return [fd for fd in (self.out_r, self.err_r, self.stdin_w) if fd is not None]

    def read(self, fd: int) -> None:
        """Drain readable data from one of our output pipes; close it at EOF."""
        is_out = fd == self.out_r
        cap = self.out if is_out else self.err
        while True:
            try:
                data = os.read(fd, 262144)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                os.close(fd)
                if is_out:
                    self.out_r = None
                else:
                    self.err_r = None
                return
            cap.feed(data)
            if self.stream:
                (self.new_out if is_out else self.new_err).extend(data)

    def feed_stdin(self) -> None:
        fd = self.stdin_w
        if fd is None:
            return
        view = self.stdin_view
        try:
            while view:
                view = view[os.write(fd, view[:65536]):]
        except BlockingIOError:
            self.stdin_view = view
            return
        except OSError:
            pass
        os.close(fd)
        self.stdin_w = None
        self.stdin_view = None

    def close_fds(self) -> None:
        for attr in ("out_r", "err_r", "stdin_w"):
            fd = getattr(self, attr)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, attr, None)


class _HeldError(Exception):
    """Internal: a commit()/reset() holds the session's commands; wait for the gate, then retry.

    Raised by :meth:`_Core.submit` and :meth:`_Core.begin_exclusive`; the drivers catch it
    (:meth:`Session.run`, :meth:`AsyncSession.run`...), never the caller."""


#: The ``running=`` values of Session.commit()/reset(): what to do with background commands.
RUNNING_CHOICES = ("refuse", "wait", "leave")


def _check_running(running: object) -> str:
    if not isinstance(running, str) or running not in RUNNING_CHOICES:
        raise PolicyError(f"running must be one of {', '.join(map(repr, RUNNING_CHOICES))}, got {running!r}")
    return running


class _Core:
    """The sandbox, the socket and the command table; no waiting policy (see the drivers).

    The workspace gate: ``commit()`` and ``reset()`` replace the overlay's upper layer (the
    anchor stacks a fresh one: ``native/lowlevel_exec.c``, RESET), and a process that lives
    across that keeps its cwd and its Landlock rule in the old layer: what it writes there
    afterwards is in no commit, and ``/workspace`` fails for it (EACCES under Landlock, which
    ignores a rule on a covered mount point; ESTALE once that layer is unmounted). So a commit or
    reset is *exclusive*: :meth:`begin_exclusive` closes the gate (new commands wait:
    :class:`_HeldError`), the driver waits until the commands in flight have ended (their EXIT comes
    after the shepherd killed their whole tree: nothing of theirs writes afterwards), the
    operation runs (:meth:`exclusive_op`, under ``ws_lock``), and the gate reopens.
    Background commands (``Session.start``) are refused, waited for, or left in the old
    layer, as the caller's ``running=`` says (:meth:`check_background`).
    """

    def __init__(self, policy: Policy | None, *, workspace: str | os.PathLike[str] | None,
                 inputs: Sequence[str | os.PathLike[str]], idle_timeout: float | None,
                 total_timeout: float | None, workspace_base: str | None, bwrap: str | None,
                 track_changes: bool, allow_sensitive_workspace: bool = False,
                 commit: bool | str = True) -> None:
        policy = policy or Policy()
        if not isinstance(policy, Policy):
            raise PolicyError(f"policy must be a lowlevel.Policy, got {type(policy).__name__}")
        for name, value in (("idle_timeout", idle_timeout), ("total_timeout", total_timeout)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise PolicyError(f"{name} must be a number of seconds > 0 or None, got {value!r}")
        self.policy = policy
        self.track_changes = track_changes
        self.idle_timeout = idle_timeout
        self.total_timeout = total_timeout
        # The init itself must not run under RLIMIT_CPU (it lives for thousands of commands):
        # the sandbox gets the Policy's limits without it; each command gets it back.
        self.sandbox_policy = dataclasses.replace(policy, limits=dataclasses.replace(policy.limits, cpu_s=None))
        exe = init_path()
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        # Landlock (lowlevel.host.landlock): the init takes the TCP rules and scopes before its first
        # command; each command restricts itself with the filesystem rules.
        argv = [f"/proc/self/fd/{_EXE_FD}", str(_SOCK_FD), str(_ms(idle_timeout)), str(_ms(total_timeout)),
                str(_EXE_FD), *_landlock.ruleset_args(policy, host_facts(bwrap).layout.ro_dirs,
                                                         host_facts(bwrap).bwrap.options)]
        self.landlock_abi = 0
        self.run = Run(RunRequest(argv, workspace=workspace, inputs=inputs, timeout=None,
                                  workspace_base=workspace_base, allow_sensitive_workspace=allow_sensitive_workspace,
                                  commit=commit),
                       policy=self.sandbox_policy, bwrap=bwrap,
                       extra_fds={_SOCK_FD: child.fileno(), _EXE_FD: _init_fd(exe)}, guard=False, one_shot=False)
        self.run.accept_seen_host_changes = True
        self.run.keep_close_error = True  # close() raises a failed final commit (it is not only logged)
        self.cmds: dict[int, _Cmd] = {}
        self.fd_owner: dict[int, _Cmd] = {}
        self.next_id = 1
        self.failed: SessionError | None = None
        self.closed = False
        self.init_host_pid: int | None = None
        self.lock = threading.Lock()  # command table and socket sends
        #: The workspace gate (see the class docstring): the operation holding it ("commit",
        #: "reset") or None; ``generation`` counts the upper layers replaced so far.
        self.exclusive: str | None = None
        self.generation = 0
        #: Callers whose command the gate held and that have not submitted it yet: the next
        #: commit()/reset() waits for them (else a caller committing in a loop starves them).
        self.queued = 0
        #: Commands out of the table whose Result is still being built (track_changes snapshots
        #: the view): a commit()/reset() waits for them too.
        self.finishing = 0
        self.gate = threading.Condition(self.lock)  # sync callers waiting for the gate to reopen
        #: Called (any thread) when the gate reopens: the async driver wakes its waiters.
        self.on_gate_open: Callable[[], None] | None = None
        self.ws_lock = threading.Lock()  # one workspace operation (commit, reset, diff, close) at a time
        self.fds_version = 0
        self.last_state_check = 0.0
        #: The limits the session's cgroup enforces now (Pool.run rewrites them per call).
        self.cgroup_limits = policy.limits
        #: The cgroup's (oom_kills, pids.max hits) once the init is up: an OOM kill after it names
        #: memory in the SessionError of an init that died.
        self.cg_start: tuple[int | None, int | None] = (None, None)
        try:
            self._start(child)
        except BaseException:
            child.close()
            self.sock.close()
            self.run.close()
            self.run.discard_workspace_if_unused()
            raise
        child.close()
        self.cg_start = self._cg_counts()
        env = self.policy.environment()
        self.env_default = _env_block(env)
        self.rlimit_default = _rlimit_records(policy.limits, self.run.cgroup)
        enforced = getattr(self.run.cgroup, "enforced", ()) if self.run.cgroup is not None else ()
        self.notes = tuple(self.run.notes) + (
            ("cgroup limits and accounting are shared by every command of the session",) if enforced else ()) + (
            (f"Landlock not applied: {_landlock.describe(0)}",)
            if not self.landlock_abi and policy.landlock is not False else ())

    # -- start ---------------------------------------------------------------------------
    def _start(self, child: socket.socket) -> None:
        r = self.run
        r.prepare()
        _spawn_from_lasting_thread(r.spawn)
        child.close()
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        poller = select.poll()
        assert r.json_r is not None and r.pidfd is not None and r.report is not None
        report_fd = r.report.fileno()
        for fd in (r.json_r, r.pidfd, r.out_r, r.err_r, self.sock.fileno(), report_fd):
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
                        deadline = time.monotonic() + HELLO_TIMEOUT_S
                    continue
                if fd == self.sock.fileno():
                    if not r.ready:
                        r.read_report()  # READY is sent before bwrap starts: it is there
                    if self._hello():
                        return
                    # EOF before HELLO: the init never ran (bwrap, or the anchor before it,
                    # failed): say why, as run() does, not "the init exited".
                    if r.wait_status is None and _readable_within(r.pidfd, 5.0):
                        r.reap()
                    while r.read_fd("err_r") or r.read_fd("out_r") or r.read_fd("json_r"):
                        pass
                    if r.wait_status is not None and not any("exit-code" in d for d in r._docs()):
                        raise r.setup_error()
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

    def _hello(self) -> bool:
        """Read the init's HELLO; False at EOF (the init never said it)."""
        data, anc, _flags, _addr = self.sock.recvmsg(64, socket.CMSG_SPACE(12))
        if not data:
            return False
        if len(data) < _SMALL.size:
            raise LaunchError("the session init sent a short hello: reinstall lowlevel", argv=self.run.full_argv)
        mtype, version, _pid, self.landlock_abi = _SMALL.unpack_from(data)
        if mtype != _MSG_HELLO or version != _PROTO_VERSION:
            raise LaunchError(f"the session init speaks protocol {version} (type {mtype}), expected "
                              f"{_PROTO_VERSION}: reinstall lowlevel", argv=self.run.full_argv)
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                self.init_host_pid = struct.unpack("=iII", payload[:12])[0]
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 0)
        self.sock.setblocking(False)
        return True

    # -- submit --------------------------------------------------------------------------
    def submit(self, argv: Sequence[str], *, stdin: bytes | None, timeout: float | None,
               env: Mapping[str, str] | None, cwd: str | None, limits: Limits | None, stream: bool,
               track_changes: bool | None = None) -> _Cmd:
        command = _check_command(argv)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise PolicyError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        if stdin is not None and not isinstance(stdin, (bytes, bytearray, memoryview)):
            raise PolicyError("stdin must be bytes or None")
        if cwd is None:
            cwd = self.policy.workdir or WORKSPACE_DEST
        cwd = _validate.sandbox_cwd(cwd, "cwd")
        if env is not None and not isinstance(env, Mapping):
            raise PolicyError(f"env must be a mapping of str to str, got {type(env).__name__}")
        if limits is not None and not isinstance(limits, Limits):
            raise PolicyError(f"limits must be a lowlevel.Limits or None, got {type(limits).__name__}")
        if self.failed is not None:
            raise self.failed
        generation = self.generation
        if self.exclusive is not None:
            raise _HeldError()  # a commit()/reset() holds new commands: the driver waits, then retries
        call_notes = self.check_call_limits(limits) if limits is not None else ()
        envc, envb = self.env_default if env is None else _env_block(self.policy.environment(env))
        names, rlb = self.rlimit_default if limits is None else _rlimit_records(limits, self.run.cgroup)
        strings = encode_args([cwd, *command]) + envb  # NUL-separated for the init: refuses a NUL
        cmd = _Cmd(0, command, self.policy, timeout, stream)
        cmd.rlimit_names = names
        if self.run.egress is not None:
            cmd.net_from = len(self.run.egress.listener.attempts)
        cmd.notes = call_notes
        if track_changes if track_changes is not None else self.track_changes:
            cmd.before = _ws.snapshot(self.view())
        flags = 0
        send_fds: list[int] = []
        close_after: list[int] = []
        # Every fd below is recorded before a signal handler's exception can fire
        # (lowlevel.sandbox._interrupts): a ^C between os.pipe() and its owner leaked the pair.
        with deferred_interrupts():
            try:
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
                    flags |= _SPAWN_STDIN_PIPE
                out_r, out_w = os.pipe()
                cmd.out_r = out_r
                close_after.append(out_w)
                err_r, err_w = os.pipe()
                cmd.err_r = err_r
                close_after.append(err_w)
                send_fds += [out_w, err_w]
                os.set_blocking(out_r, False)
                os.set_blocking(err_r, False)
                body = rlb + strings
                timeout_ms = -1 if timeout is None else max(1, round(timeout * 1000))
                with self.lock:
                    if self.failed is not None:
                        raise self.failed
                    if self.exclusive is not None or self.generation != generation:
                        # A commit()/reset() began (or ran) since the checks above: the command
                        # would start in a layer being replaced (or its track_changes snapshot
                        # be of the old one). Nothing was sent: wait for the gate and retry.
                        raise _HeldError()
                    cmd.id = self.next_id
                    self.next_id += 1
                    if len(body) > _MAX_INLINE:
                        from lowlevel.sandbox.plan import memfd
                        mfd = memfd("lowlevel-spawn", body)
                        close_after.append(mfd)
                        send_fds.append(mfd)
                        flags |= _SPAWN_BODY_MEMFD
                        body = b""
                    header = _SPAWN_HDR.pack(_MSG_SPAWN, cmd.id, flags, len(rlb) // _RLIM.size, timeout_ms,
                                             len(command), envc)
                    if self.cmds:
                        cmd.alone = False
                        for other in self.cmds.values():
                            other.alone = False
                    if self.run.cgroup is not None:
                        cmd.cg_before = self._cg_counts()
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
            except BaseException:
                cmd.close_fds()
                raise
            finally:
                for fd in close_after:
                    os.close(fd)
        return cmd

    def check_call_limits(self, limits: Limits) -> tuple[str, ...]:
        """Refuse per-command limits the session cannot enforce for one command; return notes.

        rlimits (``cpu_s``, ``fsize_bytes``, ``nofile``, ``core_bytes``,
        ``address_space_bytes``, and the ``RLIMIT_DATA``/``RLIMIT_NPROC`` fallbacks of
        ``memory_bytes``/``pids`` where no cgroup enforces them) are set per command. The
        cgroup's limits (``memory_bytes``, ``pids``, ``cpu_quota`` where its cgroup enforces
        them) bound the whole session, and ``tmp_size_bytes``/``workspace_bytes`` were fixed
        when it started: a command asking for other values gets a PolicyError (never a limit
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
        for name in ("tmp_size_bytes", "workspace_bytes"):
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
        return tuple(n for n in _limits.fallback_notes(limits, cg) if n not in self.notes)

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
        deadline = time.monotonic() + 10.0
        while True:
            try:
                self.sock.sendmsg(parts, anc)
                return
            except BlockingIOError:
                # The init is not reading (stopped?); wait a little for buffer space.
                if time.monotonic() > deadline or not select.select([], [self.sock], [], 1.0)[1] and \
                        self._init_stopped():
                    self._fail_locked("the session's init stopped reading commands (stopped by a "
                                      "command?); the session was killed", "unresponsive")
                    assert self.failed is not None
                    raise self.failed from None
            except (BrokenPipeError, ConnectionResetError) as err:
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
                data = self.sock.recv(256)
            except OSError:
                return None
            if not data:
                return None
            if len(data) == _SMALL.size and _SMALL.unpack(data)[0] == _MSG_BYE:
                return self._bye(data)

    def _bye(self, data: bytes) -> tuple[str, str]:
        reason = _BYE_REASONS.get(_SMALL.unpack(data)[1], "idle_timeout")
        limit = self.idle_timeout if reason == "idle_timeout" else self.total_timeout
        return f"the session ended: its {reason.replace('_', ' ')} of {limit} s passed", reason

    def signal(self, cmd: _Cmd, signo: int, tree: bool) -> None:
        """Ask the init to signal a command's group (tree: SIGKILL its whole tree)."""
        with self.lock:
            if cmd.done or self.failed is not None:
                return
            if tree:
                cmd.cancelled = True
            try:
                self.sock.send(_SIGNAL.pack(_MSG_SIGNAL, cmd.id, int(signo), _SIGNAL_TREE if tree else 0))
            except OSError:
                pass

    # -- receive -------------------------------------------------------------------------
    def on_readable(self) -> None:
        """Drain and dispatch every message waiting on the socket (one reader at a time)."""
        while True:
            try:
                data = self.sock.recv(256)
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
        mtype = struct.unpack_from("=I", data)[0]
        if mtype == _MSG_STARTED and len(data) == _SMALL.size:
            _t, cid, pid, _ = _SMALL.unpack(data)
            cmd = self.cmds.get(cid)
            if cmd is not None:
                cmd.pid = pid
        elif mtype == _MSG_EXIT and len(data) == _EXIT.size:
            fields = _EXIT.unpack(data)
            cmd = self.cmds.get(fields[1])
            if cmd is not None:
                self._finish(cmd, fields)
        elif mtype == _MSG_BYE and len(data) == _SMALL.size:
            with self.lock:
                self._fail_locked(*self._bye(data))
        else:
            with self.lock:
                self._fail_locked(f"malformed message from the session init (type {mtype}, {len(data)} bytes)",
                                  "protocol")

    def _finish(self, cmd: _Cmd, fields: tuple[int, ...]) -> None:
        _t, _cid, kind, status, flags, stage, utime_us, stime_us, maxrss_kib, wall_ns = fields
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
            self._finish_result(cmd, kind, status, flags, stage, utime_us, stime_us, maxrss_kib, wall_ns)
        finally:
            with self.lock:
                self.finishing -= 1

    def _finish_result(self, cmd: _Cmd, kind: int, status: int, flags: int, stage: int, utime_us: int,
                       stime_us: int, maxrss_kib: int, wall_ns: int) -> None:
        # The shepherd's own measure (CLOCK_MONOTONIC, from its fork to the command's end): the
        # host's clock reading here would include any time the caller was stopped or starved.
        wall = wall_ns / 1e9 if wall_ns > 0 else time.monotonic() - cmd.t0
        if kind == _EXIT_SETUP_FAILED:
            stage_name = _STAGES.get(stage, str(stage))
            msg = os.strerror(status)
            if stage == 6:  # STAGE_CWD
                cmd.error = LaunchError(f"the working directory of {cmd.argv[0]!r} resolves outside the sandbox "
                                        "(through a magic link such as /proc/self/fd/N, or a symlink to one: "
                                        "CVE-2024-21626 class); refused before it ran: use a directory of the "
                                        "sandbox's own tree, e.g. /workspace", argv=list(cmd.argv), errno=status)
            elif stage_name == "execve":
                cmd.error = ExecError(f"{cmd.argv[0]}: {msg.lower()} in the sandbox", argv=list(cmd.argv),
                                      errno=status)
            else:
                cmd.error = LaunchError(f"{stage_name} failed for {cmd.argv[0]!r} in the session: {msg}",
                                        argv=list(cmd.argv), errno=status)
        elif kind == _EXIT_SPAWN_FAILED:
            cmd.error = LaunchError(f"the session init could not start {cmd.argv[0]!r}: {os.strerror(status)}",
                                    argv=list(cmd.argv), errno=status)
        elif kind == _EXIT_SHEPHERD_DIED and self._oom_since(cmd):
            # The memory cgroup's OOM killer took the command's shepherd (oom_score_adj 1000 like
            # the command, fewer pages): a verdict on the command's memory, not a broken session.
            cmd.notes += (_limits.memory_kill_note(self.cgroup_limits, "the command's supervisor in the "
                                                   "session (its shepherd), and the command's processes with it",
                                                   session=True),)
            cmd.result = self._result(cmd, status, flags, utime_us, stime_us, maxrss_kib, wall)
        elif kind == _EXIT_SHEPHERD_DIED:
            cmd.error = SessionError(f"the supervisor of {cmd.argv[0]!r} was killed (wait status {status}) "
                                     "by a command of the session; its processes were killed", "unresponsive")
        else:
            cmd.result = self._result(cmd, status, flags, utime_us, stime_us, maxrss_kib, wall)
        cmd.done = True

    def _result(self, cmd: _Cmd, status: int, flags: int, utime_us: int, stime_us: int, maxrss_kib: int,
                wall: float) -> Result:
        term: int | None = None
        if os.WIFSIGNALED(status):
            term = os.WTERMSIG(status)
            exit_code = 128 + term
        else:
            exit_code = os.WEXITSTATUS(status)
        killed_by = None
        cpu = (utime_us + stime_us) / 1e6
        # The cgroup's counters over the command's life, judged as lowlevel.run judges a run:
        # any OOM kill means "memory", a fork refused at pids.max with a failed exit "pids".
        # A command that shared the session with others is charged only if it failed too.
        oom_kills = pids_hits = None
        if self.run.cgroup is not None:
            (oom0, hits0), (oom1, hits1) = cmd.cg_before, self._cg_counts()
            oom_kills = None if oom1 is None else oom1 - (oom0 or 0)
            pids_hits = None if hits1 is None else hits1 - (hits0 or 0)
        failed = exit_code != 0
        if flags & _EXITF_TIMED_OUT:
            killed_by = "timeout"
        elif flags & _EXITF_CANCELLED or cmd.cancelled:
            killed_by = "cancelled"
        elif oom_kills and (cmd.alone or failed):
            killed_by = "memory"
            if not any("OOM killer" in n for n in cmd.notes):
                cmd.notes += (_limits.memory_kill_note(self.cgroup_limits, session=True),)
        elif term == signal.SIGXCPU or (term == signal.SIGKILL and "RLIMIT_CPU" in cmd.rlimit_names
                                        and self.policy.limits.cpu_s is not None
                                        and cpu >= self.policy.limits.cpu_s):
            killed_by = "cpu"
        elif term is not None:
            # The pids limit kills nothing: only a death by a signal after a refused fork is "pids".
            killed_by = "pids" if pids_hits and failed else "signal"
        if pids_hits and failed and killed_by in ("pids", None):
            cmd.notes += (pids_note(self.cgroup_limits.pids, exit_code, term),)
        out, out_t, out_d = cmd.out.value()
        err, err_t, err_d = cmd.err.value()
        changes = _ws.Changes()
        if cmd.before is not None:
            changes = _ws.diff(cmd.before, _ws.snapshot(self.view()))
        cgroup_enforced = tuple(f"cgroup:{c}" for c in self.run.cgroup.enforced) if self.run.cgroup else ()
        enforced = cmd.rlimit_names + cgroup_enforced + (("seccomp",) if self.run.seccomp_loaded else ()) \
            + (("landlock",) if self.landlock_abi else ())
        net_note = network_denial_note(self.policy, self.landlock_abi, exit_code, err)
        network, notes = None, self.notes + cmd.notes + ((net_note,) if net_note else ())
        if self.run.egress is not None:
            # Egress mode: the attempts the session made while this command ran (commands running
            # at the same time share the sandbox's proxy, so each lists the others' too).
            listener = self.run.egress.listener
            network = listener.attempts_since(cmd.net_from)[0]
            notes = notes + tuple(listener.notes())
        return Result(
            exit_code=exit_code, term_signal=term, timed_out=bool(flags & _EXITF_TIMED_OUT), killed_by=killed_by,
            stdout=out, stderr=err, stdout_truncated=out_t, stderr_truncated=err_t,
            stdout_dropped_bytes=out_d, stderr_dropped_bytes=err_d, wall_time_s=wall,
            cpu_user_s=utime_us / 1e6, cpu_system_s=stime_us / 1e6, peak_memory_bytes=None,
            max_rss_bytes=maxrss_kib * 1024, oom_kills=oom_kills, limits_enforced=enforced, changes=changes,
            workspace=self.run.workspace, notes=notes, argv=tuple(cmd.argv), network=network,
            landlock_abi=self.landlock_abi)

    # -- health and failure --------------------------------------------------------------
    def check_health(self, now: float) -> None:
        """Declare the session unresponsive when a command overran its timeout by GRACE_S, or
        when the init is stopped (checked at most every 0.5 s, only while someone waits)."""
        overdue = [c for c in list(self.cmds.values()) if c.host_deadline is not None and now > c.host_deadline]
        if overdue:
            with self.lock:
                self._fail_locked(f"{overdue[0].argv[0]!r} overran its timeout of {overdue[0].timeout} s by "
                                  f"{GRACE_S} s without a report: its supervisor or the session's init was "
                                  "stopped by a command; the session was killed", "unresponsive")
            return
        if now - self.last_state_check >= 0.5:
            self.last_state_check = now
            if self._init_stopped():
                with self.lock:
                    self._fail_locked("the session's init was stopped (SIGSTOP from a command?); the session "
                                      "was killed", "unresponsive")

    def next_health_check(self, now: float) -> float:
        t = now + 0.5
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

    def _oom_since(self, cmd: _Cmd | None = None) -> bool:
        """True when the session cgroup's OOM kill count rose since ``cmd`` started (since the
        session started without one)."""
        before = cmd.cg_before[0] if cmd is not None else self.cg_start[0]
        now = self._cg_counts()[0]
        return now is not None and now > (before or 0)

    def _death_message(self) -> str:
        r = self.run
        if r.pidfd is not None and r.wait_status is None:
            p = select.poll()
            p.register(r.pidfd, select.POLLIN)
            if p.poll(1000):
                r.reap_bwrap() if hasattr(r, "reap_bwrap") else r.reap()
        code = None
        if r.json_r is not None:
            r.read_fd("json_r")
        for doc in r._docs():
            if "exit-code" in doc:
                code = int(doc["exit-code"])
        how = "exited"
        if code is not None and 128 < code <= 192:
            try:
                how = f"was killed by {signal.Signals(code - 128).name}"
            except ValueError:
                how = f"was killed by signal {code - 128}"
        elif code is not None:
            how = f"exited with status {code}"
        if self._oom_since():
            return (f"the session's init {how}: {_limits.memory_kill_note(self.cgroup_limits, 'the init or bwrap')}"
                    "; the session is over: start a new Session, with a larger memory_bytes if its commands need "
                    "more memory or room for files")
        return (f"the session's init {how}: the session is over (a command can kill it: commands run as the "
                "same uid); start a new Session")

    def _fail_locked(self, message: str, reason: str) -> None:
        """Mark the session failed, fail every pending command, kill the sandbox. Holds self.lock."""
        if self.failed is not None:
            return
        self.failed = SessionError(message, reason)
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

    # -- the workspace ------------------------------------------------------------------
    def view(self) -> str:
        """The live workspace as the commands see it (``/proc/PID/root/workspace`` of the init),
        or the host directory once the session is over (or without the overlay)."""
        r = self.run
        if r.cow and not self.closed and self.failed is None and self.init_host_pid is not None:
            return f"/proc/{self.init_host_pid}/root{WORKSPACE_DEST}"
        return r.workspace

    def _need_cow(self, what: str) -> None:
        if not self.run.cow:
            raise UnsupportedError("overlay", f"Session.{what}() needs the copy-on-write workspace, which this "
                                   f"host cannot provide: {'; '.join(self.run.notes)}")
        if self.closed or self.failed is not None:
            raise self.failed or SessionError("the session is closed", "closed")

    def diff(self) -> _ws.Changes:
        self._need_cow("diff")
        with self.ws_lock:
            self._need_cow("diff")
            return self.run.read_changes()

    # -- the workspace gate (see the class docstring) --------------------------------------
    def begin_exclusive(self, what: str) -> None:
        """Close the gate for ``what`` ("commit", "reset"): commands submitted from now on wait.

        Raises:
            _HeldError: another commit()/reset() holds the gate (wait for it, then call again).
            UnsupportedError, SessionError: as :meth:`_need_cow`.
        """
        self._need_cow(what)
        with self.lock:
            if self.failed is not None:
                raise self.failed
            if not self.gate_free():
                raise _HeldError()
            self.exclusive = what

    def gate_free(self) -> bool:
        """No commit()/reset() holds the gate and every command it held has been submitted
        (a commit()/reset() may begin)."""
        return self.exclusive is None and self.queued == 0

    def queue(self, delta: int) -> None:
        """Count a caller whose command the gate held (+1), or that submitted it or gave up (-1)."""
        with self.lock:
            self.queued += delta
            if not self.queued:
                self.gate.notify_all()

    def end_exclusive(self) -> None:
        """Reopen the gate (commands held by it start now) and wake whoever waits for it."""
        with self.lock:
            self.exclusive = None
            self.generation += 1
            self.gate.notify_all()
        callback = self.on_gate_open
        if callback is not None:
            callback()

    def wait_gate(self, exclusive: bool = False) -> None:
        """Block (a sync caller) until no commit()/reset() holds the gate (``exclusive``: and
        :meth:`gate_free`: another may begin), or the session ended."""
        with self.lock:
            while (self.exclusive is not None or (exclusive and self.queued)) and self.failed is None:
                self.gate.wait()

    def check_background(self, what: str, running: str) -> list[_Cmd]:
        """The background commands a ``what`` ("commit"/"reset") with ``running=`` will leave
        in the old layer (``running="leave"``; else none).

        Raises:
            SessionError(reason="busy"): ``running="refuse"`` and background commands
                (:meth:`Session.start`) are still running; the message names them.
        """
        with self.lock:
            background = [c for c in self.cmds.values() if c.background and not c.done]
        if not background or running == "wait":
            return []
        if running == "leave":
            return background
        shown = ", ".join(f"{' '.join(c.argv)[:60]!r}" + (f" (pid {c.pid})" if c.pid is not None else "")
                          for c in background[:5]) + (f" and {len(background) - 5} more" if len(background) > 5
                                                      else "")
        raise SessionError(
            f"{what}() refused: {len(background)} background command{'s' if len(background) > 1 else ''} "
            f"started with Session.start() {'are' if len(background) > 1 else 'is'} still running ({shown}); "
            f"the {what} replaces /workspace's upper layer and a process running across it loses "
            f"/workspace (its later writes would be in no commit). wait() for or kill() them first, "
            f"or call {what}(running='wait') to wait for them, or {what}(running='leave') for commands "
            "that do not use /workspace", "busy")

    def drained(self, running: str) -> bool:
        """True when no command the exclusive operation must wait for is running (with
        ``running="leave"``, background commands are not waited for), or the session ended."""
        if self.failed is not None:
            return True
        with self.lock:
            return not self.finishing and not any(not c.done and not (running == "leave" and c.background)
                                                  for c in self.cmds.values())

    def exclusive_op(self, what: str, left: Sequence[_Cmd]) -> _ws.Changes | None:
        """Run the commit or reset that holds the gate, then reopen it (in every case).

        ``left``: background commands left running in the old layer (``running="leave"``):
        their Results say so in ``notes``. Returns the commit's changes (None for a reset).
        """
        try:
            with self.ws_lock:
                self._need_cow(what)
                out = self._commit() if what == "commit" else None
                if what == "reset":
                    self.run.reset_cow()
            note = (f"this command ran across a Session.{what}() (running='leave'): it kept the old view of "
                    "/workspace, and what it wrote there afterwards is in no commit")
            for cmd in left:
                if note not in cmd.notes:
                    cmd.notes = cmd.notes + (note,)
            return out
        finally:
            self.end_exclusive()

    def _commit(self) -> _ws.Changes:
        r = self.run
        changes = r.read_changes()
        if r.upper_fd is None or r.lower_fd is None:
            return changes
        owner = (r.lower_stat.st_uid, r.lower_stat.st_gid) if r.facts.caller_is_root and r.lower_stat else None
        try:
            report = _overlay.commit(r.upper_fd, r.lower_fd, xattr_prefix=r.xattr_prefix, since_ns=r.since_ns,
                                     new_owner=owner, max_bytes=_cow.commit_budget(r.upper_bytes),
                                     accept_seen_host_changes=True,
                                     save_to=lambda: _conflict_dir(r.workspace_base))
        except (CommitIncompleteError, _overlay.CommitConflictError) as err:
            if err.applied is not None:
                # Stopped part-way (a full disk) or host writes met during the apply pass: what
                # was applied is in the directory, the rest saved at err.saved_upper. The
                # session goes on over the directory as it now is: a second commit of the same
                # upper would meet its own applied entries as host changes.
                r.reset_cow()
            raise
        r.notes.extend(report.notes)
        r.reset_cow()
        return changes

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
        if self.closed:
            return
        self.closed = True
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
                self.run.close()
        err, self.run.close_error = self.run.close_error, None
        if err is not None:
            raise err


def _spawn_from_lasting_thread(spawn: Callable[[], None]) -> None:
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


def _close_on_exit(close: Callable[[], None], exc: BaseException | None) -> None:
    """``close()`` for ``__exit__``: its error (a failed final commit) is raised, unless the
    block is already raising ``exc``: that one propagates, with the close's error in a note
    (``add_note``, PEP 678) and a warning log, instead of being masked."""
    try:
        close()
    except LowlevelError as err:
        if exc is None:
            raise
        _note_close_failure(exc, err)


def _note_close_failure(exc: BaseException, err: LowlevelError) -> None:
    exc.add_note(f"lowlevel: closing the session failed too: {type(err).__name__}: {err}")
    log.warning("lowlevel: closing the session failed: %s", err)


def _readable_within(fd: int | None, timeout_s: float) -> bool:
    if fd is None:
        return False
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(timeout_s * 1000))


def _ms(seconds: float | None) -> int:
    return 0 if seconds is None else max(1, round(seconds * 1000))


# ---------------------------------------------------------------------------------------------
# sync driver
# ---------------------------------------------------------------------------------------------


class Process:
    """A command started with :meth:`Session.start`: stream its output, poll, wait, kill.

    Attributes:
        argv: the command as given.
        pid: its PID inside the sandbox (None until the init reports it started).
    """

    def __init__(self, session: "Session", cmd: _Cmd) -> None:
        self._session = session
        self._cmd = cmd
        self.argv = tuple(cmd.argv)

    @property
    def pid(self) -> int | None:
        """The command's PID inside the sandbox's PID namespace, None until it started."""
        return self._cmd.pid

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
        out, err = bytes(cmd.new_out), bytes(cmd.new_err)
        cmd.new_out.clear()
        cmd.new_err.clear()
        return out, err

    def send_signal(self, signo: int) -> None:
        """Send ``signo`` to the command's process group (no-op once it has finished)."""
        self._session._core.signal(self._cmd, signo, tree=False)

    def kill(self) -> None:
        """SIGKILL the command's whole tree (its group and every descendant); its Result then
        has ``killed_by="cancelled"``. Returns at once; :meth:`wait` for the Result."""
        self._session._core.signal(self._cmd, signal.SIGKILL, tree=True)


class Session:
    """One sandbox for many commands (sync). Use as a context manager.

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
                 allow_sensitive_workspace: bool = False, commit: bool | str = True) -> None:
        self._core = _Core(policy, workspace=workspace, inputs=inputs, idle_timeout=idle_timeout,
                           total_timeout=total_timeout, workspace_base=workspace_base, bwrap=bwrap,
                           track_changes=track_changes, allow_sensitive_workspace=allow_sensitive_workspace,
                           commit=commit)
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
        directory (:attr:`directory`). Treat what you read as untrusted output
        (:func:`lowlevel.workspace.read_file`).
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
            lowlevel.workspace.overlay.CommitConflictError: an entry was changed on the host since the
                session started (or since the last commit/reset): nothing was applied
                (``.applied`` None), the changes stay in the session; or the host changed
                entries while they were applied (``.applied`` set): those are left as the host
                made them, the rest applied, and the session's view was reset over the
                directory (the run's whole change saved at ``.saved_upper``).
            lowlevel.CommitIncompleteError: the directory's filesystem could not take the
                changes (full, out of quota): ``.applied`` is in the directory, the rest saved
                at ``.saved_upper``; the session's view was reset over the directory.
            SessionError(reason="busy"), PolicyError, UnsupportedError, SessionError,
                LaunchError: as :meth:`reset`.
        """
        changes = self._exclusive("commit", running)
        assert changes is not None
        return changes

    def _exclusive(self, what: str, running: str) -> _ws.Changes | None:
        """Take the workspace gate, wait for the commands in flight, run ``what`` (see
        :class:`_Core`): the sync driver."""
        core = self._core
        _check_running(running)
        while True:
            try:
                core.begin_exclusive(what)
                break
            except _HeldError:
                core.wait_gate(exclusive=True)
        try:
            # Take in the EXITs already reported (nobody may be pumping: a background command
            # that ended while no thread waited would be refused as still running).
            if self._io_lock.acquire(blocking=False):
                try:
                    if not core.closed and core.failed is None:
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
        """False once the session was closed or ended (init death, idle/total timeout)."""
        return self._core.failed is None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        _close_on_exit(self.close, exc)

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None and not core.closed and not sys.is_finalizing():
            try:
                self.close()
            except Exception:  # noqa: BLE001
                pass

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
                PolicyError (see :meth:`_Core.check_call_limits`); use :class:`Pool` or
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
              limits: Limits | None = None) -> Process:
        """Start a background command and return its :class:`Process` handle at once.

        Arguments as :meth:`run`, but ``timeout`` defaults to None (a server runs until
        killed). Its output is captured (capped as for ``run``) and streamed through
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
                           track_changes=False)
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
        """
        try:
            self._core.close()
        finally:
            with self._cond:
                self._cond.notify_all()

    def _submit(self, argv: Sequence[str], **kwargs: Any) -> _Cmd:
        """:meth:`_Core.submit`, waiting while a commit()/reset() holds new commands (then this
        one goes before the next commit()/reset(): :attr:`_Core.queued`)."""
        core = self._core
        queued = False
        try:
            while True:
                try:
                    return core.submit(argv, **kwargs)
                except _HeldError:
                    if not queued:
                        core.queue(+1)
                        queued = True
                    core.wait_gate()
        finally:
            if queued:
                core.queue(-1)

    # -- the I/O pump: one leader moves everybody's I/O, the others wait for it -------------
    def _wait(self, cmd: _Cmd, deadline: float | None, until: Callable[[], bool] | None = None) -> None:
        self._wait_until(lambda: cmd.done or (until is not None and until()), deadline)

    def _wait_until(self, satisfied: Callable[[], bool], deadline: float | None) -> None:
        while not satisfied():
            with self._cond:
                if satisfied():
                    return
                if not self._io_lock.acquire(blocking=False):
                    left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
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
            if core.closed or core.failed is not None:
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
                        with core.lock:
                            core.fd_owner.pop(fd, None)
                            core.fds_version += 1
                else:
                    owner.read(fd)
                    if fd not in (owner.out_r, owner.err_r):
                        with core.lock:
                            core.fd_owner.pop(fd, None)
                            core.fds_version += 1
            if done_any:
                with self._cond:
                    self._cond.notify_all()
            now = time.monotonic()
            if not events or now >= wake:
                core.check_health(now)
            if deadline is not None and now >= deadline:
                return


# ---------------------------------------------------------------------------------------------
# async driver
# ---------------------------------------------------------------------------------------------


class AsyncProcess:
    """Async twin of :class:`Process` (from :meth:`AsyncSession.start`).

    Attributes:
        argv: the command as given (tuple of str).
        pid: its PID inside the sandbox (int), None until the init reports it started.
    :meth:`wait` and :meth:`read` are coroutines; :meth:`poll`, :meth:`send_signal` and
    :meth:`kill` do not block. Results and errors as :class:`Process`.
    """

    def __init__(self, session: "AsyncSession", cmd: _Cmd) -> None:
        self._session = session
        self._cmd = cmd
        self.argv = tuple(cmd.argv)

    @property
    def pid(self) -> int | None:
        """The command's PID inside the sandbox's PID namespace, None until it started."""
        return self._cmd.pid

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
        out, err = bytes(cmd.new_out), bytes(cmd.new_err)
        cmd.new_out.clear()
        cmd.new_err.clear()
        return out, err

    def send_signal(self, signo: int) -> None:
        """As :meth:`Process.send_signal`."""
        assert self._session._core is not None
        self._session._core.signal(self._cmd, signo, tree=False)

    def kill(self) -> None:
        """As :meth:`Process.kill`."""
        assert self._session._core is not None
        self._session._core.signal(self._cmd, signal.SIGKILL, tree=True)


class AsyncSession:
    """Async form of :class:`Session` (asyncio). ``async with await AsyncSession.create(...)``
    or ``async with AsyncSession(...)`` (the sandbox then starts on ``__aenter__``).

    Arguments, Results and errors as :class:`Session`. One event loop per session; the
    sandbox's start and close run in a worker thread (they wait on bwrap).
    """

    def __init__(self, policy: Policy | None = None, **kwargs: Any) -> None:
        self._args = (policy, kwargs)
        self._core: _Core | None = None
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
        self._core = await asyncio.to_thread(_Core, policy, **kwargs)
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
            _note_close_failure(exc, err)

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
        """As :meth:`Session.reset` (exclusive; the commands in flight are awaited)."""
        await self._exclusive("reset", running)

    async def commit(self, *, running: str = "refuse") -> _ws.Changes:
        """As :meth:`Session.commit` (exclusive; the commands in flight are awaited, commands
        submitted meanwhile start after it)."""
        changes = await self._exclusive("commit", running)
        assert changes is not None
        return changes

    async def _exclusive(self, what: str, running: str) -> _ws.Changes | None:
        """The async driver of :meth:`Session._exclusive`: the waits are on the event loop (which
        moves the commands' I/O meanwhile), the operation itself in a worker thread. Cancelled
        while that runs, the thread still ends the operation and reopens the gate."""
        core = self._core
        assert core is not None
        _check_running(running)
        while True:
            try:
                core.begin_exclusive(what)
                break
            except _HeldError:
                await self._until(core.gate_free, None)
        handed = False
        try:
            self._on_sock()  # EXITs already on the socket (a background command that just ended)
            left = core.check_background(what, running)
            await self._until(lambda: core.drained(running), None)
            handed = True
            return await asyncio.to_thread(core.exclusive_op, what, left)
        finally:
            if not handed:
                core.end_exclusive()
            self._wake()

    def _gate_opened(self) -> None:
        """The gate reopened (in any thread): wake the coroutines waiting for it, on the loop."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:
            pass  # the loop is closed: nobody waits on it

    async def _submit(self, argv: Sequence[str], **kwargs: Any) -> _Cmd:
        core = self._core
        assert core is not None
        queued = False
        try:
            while True:
                try:
                    return core.submit(argv, **kwargs)
                except _HeldError:
                    if not queued:
                        core.queue(+1)
                        queued = True
                    await self._until(lambda: core.exclusive is None, None)
        finally:
            if queued:
                core.queue(-1)
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
                    limits: Limits | None = None) -> AsyncProcess:
        """As :meth:`Session.start`."""
        await self._open()
        assert self._core is not None
        cmd = await self._submit(argv, stdin=stdin, timeout=timeout, env=env, cwd=cwd, limits=limits,
                                 stream=True, track_changes=False)
        self._watch(cmd)
        return AsyncProcess(self, cmd)

    async def close(self) -> None:
        """As :meth:`Session.close`."""
        core = self._core
        if core is None or core.closed:
            return
        self._drop_readers()
        try:
            await asyncio.to_thread(core.close)
        finally:
            self._wake()

    # -- plumbing ---------------------------------------------------------------------
    def _watch(self, cmd: _Cmd) -> None:
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

    def _on_pipe(self, cmd: _Cmd, fd: int) -> None:
        cmd.read(fd)
        if fd not in (cmd.out_r, cmd.err_r):
            self._forget(fd)
            assert self._core is not None
            with self._core.lock:
                self._core.fd_owner.pop(fd, None)
        self._wake()

    def _on_stdin(self, cmd: _Cmd) -> None:
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

    async def _wait(self, cmd: _Cmd, timeout: float | None, until: Callable[[], bool] | None = None) -> None:
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


# ---------------------------------------------------------------------------------------------
# Pool
# ---------------------------------------------------------------------------------------------


class Pool:
    """N sandboxes started in advance; each call gets a fresh one, used once, then destroyed.

    Each sandbox has its own fresh workspace (under ``workspace_base``, kept after use like
    :func:`lowlevel.run`'s: ``Result.workspace``), its own namespaces, ``/tmp`` and cgroup:
    nothing is shared between calls. A background thread starts replacements and tears used
    sandboxes down.

    With the copy-on-write workspace, a call's Result is final when :meth:`run` returns: its
    changes are in ``Result.changes`` and (without a template) committed to its workspace.

    Args:
        policy: as for :func:`lowlevel.run`.
        size: how many sandboxes to keep ready (>= 1).
        workspace_base, bwrap: as for :class:`Session`.
        track_changes: fill ``Result.changes`` where the overlay is unavailable (a snapshot walk
            of the fresh workspace; with the overlay the changes come from its upper layer).
        template: a directory every call starts from: each sandbox gets a fresh copy-on-write
            overlay over it (nothing is copied; the directory is never written: calls' changes
            are reported and discarded). Needs the overlay (UnsupportedError otherwise).
    Raises:
        PolicyError: a bad argument. The first sandbox's start errors surface on the first call.
    """

    def __init__(self, policy: Policy | None = None, *, size: int = 2, workspace_base: str | None = None,
                 bwrap: str | None = None, track_changes: bool = True,
                 template: str | os.PathLike[str] | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise PolicyError(f"Pool size must be an int >= 1, got {size!r}")
        self.policy = policy or Policy()
        self.size = size
        self.template = None if template is None else os.fspath(template)
        self._kwargs: dict[str, Any] = {"workspace_base": workspace_base, "bwrap": bwrap,
                                        "track_changes": track_changes}
        if self.template is not None:
            self._kwargs.update(workspace=self.template, commit=False, track_changes=False)
        self._ready: collections.deque[Session] = collections.deque()
        self._retired: collections.deque[Session] = collections.deque()
        self._starting = 0
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        #: Calls served by a ready sandbox / calls that had to start one themselves.
        self.hits = 0
        self.misses = 0
        self._thread = threading.Thread(target=self._worker, name="lowlevel-pool", daemon=True)
        self._thread.start()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new(self) -> Session:
        s = Session(self.policy, **self._kwargs)
        if self.template is not None and not s._core.run.cow:
            s.close()
            raise UnsupportedError("overlay", "Pool(template=...) needs the copy-on-write workspace: "
                                   + "; ".join(s._core.run.notes))
        try:
            # Warm the path once (the init's first message, allocations, shepherd fork, a
            # failed execve) so the caller's command is not the first through it.
            s.run([_WARMUP_PROGRAM], timeout=10, track_changes=False)
        except ExecError:
            pass
        except BaseException:
            s.close()
            raise
        return s

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._retired and \
                        (len(self._ready) + self._starting >= self.size or self._error is not None):
                    self._cond.wait()
                if self._closed:
                    return
                retire = self._retired.popleft() if self._retired else None
                start = retire is None and len(self._ready) + self._starting < self.size
                if start:
                    self._starting += 1
            if retire is not None:
                try:
                    retire.close()
                except Exception as err:  # noqa: BLE001
                    log.warning("lowlevel: pool teardown failed: %s", err)
                continue
            if start:
                try:
                    s = self._new()
                except BaseException as err:  # noqa: BLE001 - reported on the next call
                    with self._cond:
                        self._starting -= 1
                        self._error = err
                        self._cond.notify_all()
                    continue
                with self._cond:
                    self._starting -= 1
                    if self._closed:
                        closing = s
                    else:
                        closing = None
                        self._ready.append(s)
                    self._cond.notify_all()
                if closing is not None:
                    closing.close()
                    if self.template is None:
                        _ws.remove_workspace(closing.directory)  # started as the pool closed: never used

    def _take(self) -> Session:
        with self._cond:
            if self._closed:
                raise SessionError("the pool is closed", "closed")
            # No notify on a hit: the worker refills when this call is over (run's finally), so
            # starting the replacement (bwrap, cgroup, workspace: CPU and the GIL) does not
            # compete with the call itself.
            while self._ready:
                s = self._ready.popleft()
                if s.alive:
                    self.hits += 1
                    return s
                self._retired.append(s)
            err, self._error = self._error, None
            self.misses += 1
            self._cond.notify_all()
        if err is not None:
            raise err
        return self._new()

    def run(self, argv: Sequence[str], *, inputs: Sequence[str | os.PathLike[str] | tuple[str, str]] = (),
            stdin: bytes | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
            env: Mapping[str, str] | None = None, cwd: str | None = None,
            limits: Limits | None = None) -> Result:
        """Run one command in a fresh sandbox taken from the pool (as :func:`lowlevel.run`).

        Args:
            inputs: host files or directories copied into the sandbox's empty workspace first
                (paths, or ``(path, dest)`` pairs as for :func:`lowlevel.run`).
            limits: this call's limits (default: the Pool's Policy's). The sandbox serves
                this call alone, so its cgroup's ``memory_bytes``, ``pids`` and ``cpu_quota``
                are rewritten to these values first and apply exactly as in
                :func:`lowlevel.run` (where no cgroup enforces them, the rlimit fallbacks
                apply per process, at most the Pool's values); ``tmp_size_bytes`` and
                ``workspace_bytes`` were fixed when the sandbox started and must equal the
                Pool's (else PolicyError).
            Others: as :meth:`Session.run`.
        Raises:
            WorkspaceError: an input is missing or unreadable. Others as :meth:`Session.run`.
        """
        cwd = cwd if cwd is not None else (self.policy.workdir or WORKSPACE_DEST)
        _validate.run_args(command=argv, cwd=cwd, env=env, inputs=inputs)  # before a sandbox is used up
        s = self._take()
        try:
            if limits is not None:
                s._core.set_cgroup_limits(limits)
            if inputs and self.template is not None:
                # Into this call's view (its upper layer), owned as its sandbox.
                names = _ws.copy_inputs(s.workspace, inputs)
                if s._core.run.facts.caller_is_root:
                    for name in dict.fromkeys(n.split("/")[0] for n in names):
                        _ws.chown_tree(os.path.join(s.workspace, name), *s.host_ids)
            elif inputs:
                # Into the directory itself (the overlay's lower layer: this sandbox's fresh,
                # still unvisited workspace), so they are inputs, not changes; the idmapped lower
                # gives them to the sandbox's uid without a chown.
                names = _ws.copy_inputs(s.directory, inputs)
                if s._core.run.facts.caller_is_root and not s._core.run.cow:
                    for name in dict.fromkeys(n.split("/")[0] for n in names):
                        _ws.chown_tree(os.path.join(s.directory, name), *s.host_ids)
                # The call starts from here: its commit must not take the inputs for host changes
                # made during the run (a program that edits or deletes an input got a conflict).
                s._core.run.since_ns = time.time_ns()
            result = s.run(argv, stdin=stdin, timeout=timeout, env=env, cwd=cwd, limits=limits,
                           track_changes=False if s._core.run.cow else None)
            if self.template is not None:
                result.changes = s.diff()  # reported; the template is never written
            elif s._core.run.cow:
                # The Result is final when it is returned: the call's changes are in its workspace.
                result.changes = s.commit()
            return result
        finally:
            with self._cond:
                self._retired.append(s)
                self._cond.notify_all()

    async def arun(self, argv: Sequence[str], **kwargs: Any) -> Result:
        """:meth:`run` in a worker thread, for asyncio callers: same arguments, Result and errors."""
        return await asyncio.to_thread(self.run, argv, **kwargs)

    def close(self) -> None:
        """Stop refilling and destroy every sandbox; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        while self._ready or self._retired:
            unused = bool(self._ready)
            s = (self._ready or self._retired).popleft()
            try:
                s.close()
                if unused and self.template is None:
                    _ws.remove_workspace(s.directory)  # started in advance, never used: nothing to keep
            except Exception as err:  # noqa: BLE001
                log.warning("lowlevel: pool teardown failed: %s", err)


__all__ = ["AsyncProcess", "AsyncSession", "GRACE_S", "Pool", "Process", "Session", "SessionError", "init_path"]
