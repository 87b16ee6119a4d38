"""Start a sandbox under lowlevel's anchor with os.posix_spawn, and supervise it.

The life of one run (:class:`Run`), the same for the sync and the async drivers:

1. ``prepare``: everything that can fail or allocate happens before the spawn, and every fd
   is owned the moment it exists: the workspace (opened once, by fd), the run's host ids (a
   per-run uid lease for root callers, :class:`lowlevel.workspace.cow.UidLease`), the cgroup and an
   O_WRONLY fd on each of its ``cgroup.procs``, the rlimits, the seccomp BPF (compiled once
   per profile), the Policy's static argv (cached) and the fds: an ``--args`` memfd (so a
   long policy never hits E2BIG), the ``--json-status-fd`` pipe, the ``--seccomp`` memfd, the
   ``/etc/passwd``/``/etc/group`` memfds, the stdio pipes and the anchor's report socket.
2. ``spawn``: ``os.posix_spawn`` of the anchor (``native/lowlevel_exec.c``: see
   :func:`lowlevel.sandbox.argv.anchor_argv`) with an empty environment (bwrap's PID 1 keeps the
   environment it was started with, and ``/proc/1/environ`` is readable from the sandbox). The
   file actions dup2 our fds onto fixed numbers; the anchor closes every other inherited fd (a
   leaked directory fd is a path out of any mount namespace). The anchor dies with us (checked
   ``PR_SET_PDEATHSIG``), joins the cgroups, mounts the copy-on-write workspace in a private
   mount namespace, and runs bwrap as PID 1 of a new PID namespace with the rlimits set.
   The program itself is behind the guard (:mod:`lowlevel.host.landlock`): bwrap execs
   ``/proc/self/fd/N`` (the static ``_lowlevel_guard``), which applies the Policy's Landlock
   ruleset to the program and reports its exact wait status on a pipe read in ``result``.
3. handshake: the anchor sends READY with bwrap's pidfd (and the overlay's upper directory)
   before bwrap starts. Limits are in force before any process of the sandbox exists: no
   ``--block-fd`` (bwrap reads EOF on it as "go").
4. supervise: poll the anchor's pidfd, the output pipes and the deadline; at the deadline
   ``pidfd_send_signal(SIGKILL)`` bwrap, the PID 1 of the run's namespace, which makes the
   kernel kill every process of it (a double-forked ``setsid`` daemon included).
5. finish: reap the anchor with ``os.wait4``, wait until bwrap's pidfd reports exit (a PID 1
   exits only after every process of its namespace is gone: ``zap_pid_ns_processes``), read
   cgroup figures, build the :class:`Result`, read the upper layer's changes and commit or
   discard them (:mod:`lowlevel.workspace.overlay`), remove the cgroup.

Fds each run holds in the parent after the handshake: the anchor's pidfd, bwrap's pidfd, the
report socket, the upper directory and the workspace, json-status read end, stdout and stderr
read ends (capture mode), stdin write end (when stdin is bytes), the guard's report pipe.

Sources: bwrap(1) --args, --json-status-fd, --seccomp, --die-with-parent; pidfd_open(2);
pidfd_send_signal(2); posix_spawn(3); prctl(2) PR_SET_PDEATHSIG; pid_namespaces(7).
"""

from __future__ import annotations

import enum
import errno
import fcntl
import functools
import itertools
import json
import logging
import os
import select
import shutil
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lowlevel import workspace as _ws
from lowlevel.errors import (CommitIncompleteError, LaunchError, LowlevelError, PolicyError, UnsupportedError,
                             WorkspaceError)
from lowlevel.host import landlock as _landlock
from lowlevel.host.probe import ETC_ENTRIES
from lowlevel.sandbox import bind_sockets as _bind_sockets
from lowlevel.sandbox import facts as _facts
from lowlevel.sandbox._interrupts import deferred_interrupts
from lowlevel.sandbox.argv import AnchorOverlay as _AnchorOverlay
from lowlevel.sandbox.commit import CommitTarget, commit_upper
from lowlevel.sandbox.argv import (Fds, anchor_argv, build_argv, encode_args, etc_copies, redact_env_values,
                                   setup_paths, static_args)
from lowlevel.sandbox.facts import host_facts
from lowlevel.sandbox.failures import (PROCESS_LIMIT_HINT, ExecError, classify_setup_failure, network_denial_note,
                                       pids_note)
from lowlevel.sandbox.plan import (ARGS_FD, CHILD_FDS, ETC_COPY_FD, EXTRA_FDS_MIN, clamp_to_own_hard_limits, memfd,
                                   open_etc_copy, passwd_group)
from lowlevel.sandbox.precheck import precheck_exec
from lowlevel.sandbox.request import RunRequest
from lowlevel.sandbox.result import Result, classify_kill, decode_exit, wait_status_exit
from lowlevel.spec import limits as _limits
from lowlevel.spec import seccomp as _seccomp
from lowlevel.spec import validate as _validate
from lowlevel.spec.egress import Egress
from lowlevel.spec.policy import WORKSPACE_DEST, Policy
from lowlevel.spec.report import WARNING_PREFIX
from lowlevel.workspace import cow as _cow
from lowlevel.workspace import overlay as _overlay


class _Log:
    """``logging.getLogger("lowlevel")``; ``debug`` takes callables as arguments, called only when
    DEBUG is enabled (the argv's redaction costs nothing otherwise). ``logging`` is imported with
    this module, not on first use: a warning on an error path must not need an import (a file to
    open) when the error is the process's fd limit."""

    _logger = logging.getLogger("lowlevel")

    def debug(self, msg: str, *args: Any) -> None:
        if self._logger.isEnabledFor(logging.DEBUG):
            self._logger.debug(msg, *(a() if callable(a) else a for a in args))

    def info(self, msg: str, *args: Any) -> None:
        self._logger.info(msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self._logger.warning(msg, *args)


log = _Log()


#: Signals reset to their default action in bwrap (and so in the program): Python ignores
#: SIGPIPE and SIGXFSZ, and an ignored disposition survives exec, which would turn a write past
#: RLIMIT_FSIZE into EFBIG instead of a kill and break `yes | head`. The caller may ignore
#: others (SIGINT in a daemon). Source: posix_spawnattr_setsigdefault(3), signal(7).
_DEFAULT_SIGNALS = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                         and s < signal.SIGRTMIN)

#: Serial numbers of this process's run cgroups (``run-<pid>-<hex serial>``).
_CGROUP_SERIAL = itertools.count(1)

#: How long the handshake (bwrap setting up namespaces and mounts) may take, seconds.
SETUP_TIMEOUT_S = 30.0
#: Seconds past a run's deadline at which the anchor kills the sandbox itself (``--deadline-ns``)
#: when the caller has not: a caller stopped (SIGSTOP), stuck or starved of CPU at its deadline.
#: The caller's own kill at the deadline comes first whenever it runs.
ANCHOR_GRACE_S = 0.2
#: How long the drivers wait for the output pipes to reach EOF after the sandbox is gone (they
#: do at once unless a process outside the sandbox holds a copy), seconds.
DRAIN_TIMEOUT_S = 1.0
#: How long bwrap (the sandbox's PID 1) may outlive the anchor's exit (its parent-death signal
#: kills it) before the driver SIGKILLs it itself, then how long it waits for that, seconds.
INIT_EXIT_TIMEOUT_S = 2.0
INIT_KILL_TIMEOUT_S = 10.0


class _Capture:
    """Bounded capture of one output stream: keeps the head and the tail, counts what it drops."""

    __slots__ = ("limit", "head", "tail", "total", "head_cap", "tail_cap")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head_cap = limit // 2
        self.tail_cap = limit - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap + 65536:
                del self.tail[: len(self.tail) - self.tail_cap]

    def value(self) -> tuple[bytes, bool, int]:
        """(data, truncated, dropped_bytes)."""
        if self.total <= self.limit:
            return bytes(self.head + self.tail), False, 0
        tail = self.tail[-self.tail_cap:] if self.tail_cap else b""
        return bytes(self.head + tail), True, self.total - self.limit


def _readable(fd: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``fd`` to be readable (a pidfd: the process exited).

    poll(2), not select(2): select cannot take fds >= FD_SETSIZE (1024), which a process
    with hundreds of runs in flight reaches.
    """
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(timeout_s * 1000))


def drop_fresh_workspace(result: Result, note: str = "workspace removed after the run "
                         "(keep_workspace=False)") -> Result:
    """Remove ``result.workspace`` (a fresh one: the caller checked) and say so in the notes;
    a failure to remove is a note too, never an exception that would lose the Result."""
    import dataclasses
    try:
        _ws.remove_workspace(result.workspace)
    except (OSError, LowlevelError) as err:
        note = f"keep_workspace=False: could not remove {result.workspace}: {err}"
    return dataclasses.replace(result, notes=(*result.notes, note))


def _check_command(command: Sequence[str]) -> list[str]:
    return _validate.command(command)


class Phase(enum.IntEnum):
    """The phases of a :class:`Run`, in order (the run only moves forward).

    NEW: made and maybe prepared; nothing runs. SPAWNED: the anchor runs (its pidfd is open),
    bwrap not yet. READY: the anchor sent READY with bwrap's pidfd; bwrap, the sandbox's PID 1,
    runs the program. EXITED: the anchor sent EXIT: bwrap is reaped, every process of the
    sandbox is gone (the Result can be built while the anchor tears its mounts down).
    """

    NEW = 0
    SPAWNED = 1
    READY = 2
    EXITED = 3


class Run:
    """One sandboxed run, driven by :func:`run` (sync) or :func:`lowlevel.sandbox.aio.arun` (async).

    Not thread-safe; one driver per Run. Always ends with :meth:`close` (idempotent), which
    kills whatever is left and closes every fd. Takes the call as a validated
    :class:`~lowlevel.sandbox.request.RunRequest` (its ``record`` must be None: records are
    written a layer above, :func:`lowlevel.record.record_run`), the ``policy``, plus ``bwrap``
    (the bwrap binary, None: found on PATH), ``extra_fds`` (``{fd inside: fd here}``), ``guard``
    (False: bwrap execs the command, no Landlock guard) and ``one_shot`` (False for a Session's
    sandbox, whose workspace is reset and committed while it lives: a fresh workspace then
    keeps its real lower layer).

    Raises:
        PolicyError: ``request`` or ``policy`` of the wrong type, a ``record``, a bad ``bwrap``,
            a reserved ``extra_fds`` number, or a bad environment (:meth:`Policy.environment`).
    """

    def __init__(self, request: RunRequest, *, policy: Policy, bwrap: str | None = None,
                 extra_fds: Mapping[int, int] | None = None, guard: bool = True, one_shot: bool = True) -> None:
        if not isinstance(request, RunRequest):
            raise PolicyError(f"request must be a lowlevel.sandbox.request.RunRequest, got {type(request).__name__}")
        if not isinstance(policy, Policy):
            raise PolicyError(f"policy must be a lowlevel.Policy, got {type(policy).__name__}")
        request.refuse("the sandbox layer (lowlevel.sandbox)", "record",
                       why="lowlevel.run writes records through lowlevel.record.record_run")
        if bwrap is not None:
            _validate.host_path(bwrap, "bwrap")
        self.request = request
        self.command = list(request.command)
        fds = request.stdio_fds
        self.stdio_fds = (fds[0], fds[1], fds[2]) if fds is not None else (None, None, None)
        self.keep_workspace = request.keep_workspace
        self.policy = policy
        self.commit = request.commit
        self.timeout = request.timeout
        self.stdin = request.stdin
        self.capture = request.capture
        self.cwd = _validate.sandbox_cwd(request.cwd or policy.workdir or WORKSPACE_DEST)
        self.env_extra = dict(request.env or {})
        self.environment = policy.environment(self.env_extra)
        self.facts = host_facts(bwrap)
        # {fd number inside: parent fd}; the parent keeps ownership of its fds.
        self.extra_fds = dict(extra_fds or {})
        etc_copy_fds = range(ETC_COPY_FD, ETC_COPY_FD + len(ETC_ENTRIES))
        for child_fd in self.extra_fds:
            if child_fd < EXTRA_FDS_MIN or child_fd in etc_copy_fds:
                raise PolicyError(f"extra_fds: child fd {child_fd} is reserved (use {EXTRA_FDS_MIN} to "
                                  f"{ETC_COPY_FD - 1}, or {etc_copy_fds.stop} and above)")
        self.inputs = list(request.inputs)
        self.workspace_arg = request.workspace
        self.workspace_base = request.workspace_base
        self.allow_sensitive_workspace = request.allow_sensitive_workspace
        self.one_shot = one_shot
        self.guard = guard
        self._init_state()

    def _init_state(self) -> None:
        """The run's state, filled as the run goes: a state table (one line per attribute), kept
        whole in one place rather than split to a function length."""
        policy = self.policy
        self.workspace = ""
        self.owns_workspace = False
        self.handover: _ws.Handover | None = None
        self.workspace_masks: list[str] = []  # hand-over: bwrap masks over the workspace's unix sockets
        self.fds: list[int] = []
        self.pid: int | None = None
        self.pidfd: int | None = None
        self.init_pid: int | None = None
        self.init_pidfd: int | None = None
        self.json_r: int | None = None
        self.stdin_w: int | None = None
        self.out_r: int | None = None
        self.err_r: int | None = None
        self.json_buf = b""
        self.exit_status: dict[str, Any] | None = None
        self.out = _Capture(policy.stdout_limit_bytes)
        self.err = _Capture(policy.stderr_limit_bytes)
        self.cgroup: Any = None
        self.rlimits_applied: tuple[str, ...] = ()
        self.notes: list[str] = []
        self.killed_by: str | None = None
        self.timed_out = False
        self.wait_status: int | None = None
        self.rusage: Any = None
        #: Where the run is (:class:`Phase`). After EXITED the anchor may still be tearing down
        #: its mount namespace; it is reaped by :meth:`reap_anchor` (at the latest in close).
        self.phase = Phase.NEW
        #: Resource facts, orthogonal to the phase: the anchor waited for (``os.wait4``), the
        #: upper layer committed or discarded (:meth:`finish_cow`), :meth:`close` done.
        self.anchor_reaped = False
        #: bwrap or the anchor died by a signal (killed from outside, or by our own kill).
        self.supervisor_signaled = False
        self.t0 = 0.0
        self.t_end = 0.0
        self.deadline: float | None = None
        #: Seconds between the SIGTERM at the deadline and the SIGKILL (``run(kill_after=)``, as
        #: ``timeout -k``); 0: SIGKILL at the deadline.
        self.kill_after = self.request.kill_after
        self.terminated = False
        self.argv: list[str] = []
        self.full_argv: list[str] = []
        self.before: Any = None
        self.stdin_view: memoryview | None = None
        self.closed = False
        self.pre_exec_rlimits: tuple[tuple[str, int, int], ...] = ()
        self.seccomp_loaded = False
        self.audit: Any = None
        self.egress: Any = None  # lowlevel.net.egress_proxy.EgressRun in egress mode
        # The anchor and the copy-on-write workspace.
        self.lease: _cow.UidLease | None = None
        self.host_ids: tuple[int, int] = (0, 0)
        self.cow = False
        self.lower_fd: int | None = None
        self.root_fd: int | None = None  # rootfs_writable over the anchor's overlay: the tree
        self.lower_stat: os.stat_result | None = None
        self.upper_fd: int | None = None
        self.upper_bytes = 0
        self.mnt = ""
        self.cgroup_fds: list[int] = []
        self.cgroup_dir_fd: int | None = None
        self.report: socket.socket | None = None
        self.report_child: socket.socket | None = None
        self.since_ns = 0
        self.pass_fds: tuple[int, ...] = ()
        self.anchor_fds: dict[str, Any] = {}
        self.actions: list[tuple[Any, ...]] = []
        self.committed = False
        #: A Session's long-lived workspace: a host change the sandbox copied up (saw) afterwards
        #: is no conflict (lowlevel.workspace.overlay.commit); a run keeps the plain rule.
        self.accept_seen_host_changes = False
        #: A Session's close() raises what the final commit raised (keep_close_error=True: the
        #: error is kept here, not only logged).
        self.keep_close_error = False
        self.close_error: LowlevelError | None = None
        # The guard (lowlevel.host.landlock): bwrap execs it in place of the command; it applies
        # Landlock and reports the command's exact wait status on status_r. Session passes
        # guard=False (its init does both itself).
        self.guard_prefix: list[str] = []
        self.status_r: int | None = None
        self.guard_report: _landlock.GuardReport | None = None

    @property
    def ready(self) -> bool:
        """READY arrived (bwrap's pidfd is ours): :attr:`phase` >= READY."""
        return self.phase >= Phase.READY

    @property
    def exit_reported(self) -> bool:
        """EXIT arrived (the sandbox is gone): :attr:`phase` is EXITED."""
        return self.phase >= Phase.EXITED

    # -- 1. prepare ----------------------------------------------------------------------
    def _own(self, fd: int) -> int:
        """Record ``fd`` as ours (closed by :meth:`close`) the moment it exists."""
        self.fds.append(fd)
        return fd

    def _pipe(self) -> tuple[int, int]:
        r, w = os.pipe()
        self._own(r)
        self._own(w)
        return r, w

    def prepare(self) -> None:
        """Workspace, ids, cgroup, seccomp and fds; everything that can fail before the spawn.

        Raises:
            LaunchError: a system call failed (fd exhaustion, memfd, pipe...): ``.errno`` says
                which; every fd made so far is owned and closed by :meth:`close`.
            and the errors of :func:`run`.
        """
        try:
            self._resolve_workspace()  # may copy inputs: interruptible
            # The rest makes fds, a uid lease, a cgroup: each recorded as it is made
            # (lowlevel.sandbox._interrupts); ~1 ms.
            with deferred_interrupts():
                self._prepare()
        except LowlevelError:
            raise
        except OSError as err:
            raise LaunchError(f"cannot prepare the sandbox: {err.strerror or err}"
                              + (f" ({err.filename})" if err.filename else ""), errno=err.errno) from err

    def _resolve_workspace(self) -> None:
        if self.workspace_arg is not None:
            ws = os.path.abspath(os.fspath(self.workspace_arg))
            if not os.path.exists(ws):
                raise WorkspaceError(errno.ENOENT, f"workspace {ws} does not exist: create it or omit it "
                                     "to get a fresh per-run workspace")
            if not os.path.isdir(ws) or os.path.islink(ws):
                raise WorkspaceError(errno.ENOTDIR, f"workspace {ws} is not a directory")
            self.workspace = os.path.realpath(ws)
            # Inputs are copied in by path: that needs parents nobody else can rename. Without
            # inputs the workspace is opened once, by fd (_open_lower), and never walked again.
            _ws.check_workspace_path(self.workspace, allow_sensitive=self.allow_sensitive_workspace,
                                     check_ancestors=bool(self.inputs), writable=self.commit is not False)
            if self.inputs:
                _ws.copy_inputs(self.workspace, self.inputs)
        else:
            self.workspace = _ws.create_workspace(self.inputs, self.workspace_base, disposable=not self.keep_workspace)
            self.owns_workspace = True
            try:
                _ws.check_trusted_ancestors(self.workspace)
            except WorkspaceError:
                shutil.rmtree(self.workspace, ignore_errors=True)
                raise

    def _open_lower(self) -> None:
        """Open the workspace once, by fd; everything after the run goes through that fd.

        The path was checked as a string; the fd is then checked to be that very directory
        (``/proc/self/fd`` names what was opened), so a parent renamed in between cannot
        swap another tree in. No later path walk: this is what lets a root caller use a
        workspace below directories another user owns, or below 0700 ones.
        """
        fd = self._own(os.open(self.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if opened != self.workspace:
            raise WorkspaceError(errno.EAGAIN, f"workspace {self.workspace} moved while it was opened (now "
                                 f"{opened!r}): a parent directory was renamed; run again")
        self.lower_stat = os.fstat(fd)
        self.fds.remove(fd)  # closed by close() itself, after the commit
        self.lower_fd = fd

    def _check_rootfs_layout(self, path: str) -> None:
        """The argv's (cached) layout of the tree must still be the tree's, the one the anchor
        overlays included (:func:`lowlevel.rootfs.layout_holds`): a directory swapped for a
        symlink since would make bwrap bind the symlink's host target. Re-read once if not."""
        from lowlevel.rootfs import layout_holds, rootfs_layout
        if layout_holds(rootfs_layout(path), self.root_fd):
            return
        rootfs_layout.cache_clear()
        static_args.cache_clear()
        if not layout_holds(rootfs_layout(path), self.root_fd):
            raise LaunchError(f"Policy.rootfs {path!r} changed while the sandbox was set up (a top-level entry was "
                              "replaced); run again, and keep the tree unchanged while it is in use")

    def _prepare(self) -> None:
        """The steps of :meth:`prepare` after the workspace is resolved, in order; each records
        what it makes (fds, the lease, the cgroup) as it makes it."""
        self._prepare_ids()
        support = self._workspace_model()
        precheck_exec(self.policy, self.workspace, self.command, self.environment, self.cwd,
                      self.facts.layout.etc_files)
        _landlock.require_supported(self.policy)
        bind_source, rootfs_overlay = self._prepare_workspace_mount(support)
        self._prepare_limits()
        fds, data_fds = self._prepare_data_fds()
        if isinstance(self.policy.network, Egress):
            # The host-side proxy and the relay that runs first inside (lowlevel/net/egress_proxy.py).
            from lowlevel.net.egress_proxy import EgressRun
            self.egress = EgressRun.open(self.policy.network, self.policy.limits.net_bytes,
                                         caller_is_root=self.facts.caller_is_root, host_gid=self.host_ids[1])
            self.extra_fds.update(self.egress.child_fds)
            for fd in self.egress.owned_fds:
                self._own(fd)  # closed after the spawn, like ours
        args_fd = self._own(memfd("lowlevel-args", encode_args(self._build_argv(bind_source, fds, rootfs_overlay))))
        self._lay_out_fds(args_fd, fds, data_fds)

    def _prepare_ids(self) -> None:
        """The sandbox's host ids: a per-run uid for root callers (unless pinned), our own otherwise."""
        policy = self.policy
        if self.facts.caller_is_root:
            if policy.host_uid is None:
                self.lease = _cow.UidLease.acquire()
                self.host_ids = (self.lease.uid, self.lease.uid)
            else:
                self.host_ids = (policy.host_uid, policy.host_gid if policy.host_gid is not None
                                 else policy.host_uid)
        else:
            self.host_ids = (os.getuid(), os.getgid())

    def _workspace_model(self) -> _cow.CowSupport:
        """Copy-on-write overlay (``self.cow``) or hand-over; refuses what the hand-over cannot do."""
        support = _cow.cow_support(self.workspace, functools.partial(_facts._probe_cow, self.facts, self.workspace,
                                                                      self.workspace_base))
        if support.transient:
            # Not a fact of the host (and not cached): falling back would change what the
            # caller gets (no discard, no write bound) because of its own limit.
            raise LaunchError(f"cannot check whether the copy-on-write workspace works here: {support.reason}. "
                              "That is a limit of the calling process (open files: `ulimit -n`; memory; "
                              "processes) or an interruption, not of the host: raise the limit and run again",
                              errno=errno.EMFILE if "open files" in support.reason else None)
        self.cow = support.ok
        if not self.cow and self.commit is not True and not self.owns_workspace:
            # The hand-over model writes straight into the caller's directory: there is nothing
            # to discard afterwards. Refused before anything is touched.
            how = "commit=False (--discard)" if self.commit is False else "commit='on_success' (--commit-on-success)"
            raise UnsupportedError("overlay", f"{how} needs the copy-on-write workspace, which is unavailable for "
                                   f"{self.workspace} ({support.reason}): the program would write the directory "
                                   "itself, so its changes could not be discarded; nothing was run",
                                   "run without --discard on a copy of the directory, or see `lowlevel doctor`")
        return support

    def _prepare_workspace_mount(self, support: _cow.CowSupport) -> tuple[str, str | None]:
        """``(the workspace's bind source, the writable root's overlay dir or None)``."""
        policy = self.policy
        rootfs_overlay: str | None = None
        if self.cow:
            self._open_lower()
            self.upper_bytes = policy.limits.workspace_bytes or _cow.DEFAULT_UPPER_BYTES
            self.mnt = _cow.mount_dir(self.workspace_base)
            bind_source = f"{self.mnt}/ws"
            self.notes.append(f"workspace: copy-on-write overlay; the run's writes are bounded to "
                              f"{self.upper_bytes} bytes")
            if policy.rootfs is not None and policy.rootfs_writable:
                # The anchor overlays the whole tree too (lowlevel.rootfs, "Writable root").
                self.root_fd = self._own(os.open(policy.rootfs, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
                                                 | os.O_CLOEXEC))
                rootfs_overlay = f"{self.mnt}/root"
                self.notes.append("root filesystem: copy-on-write overlay, discarded after the run (its writes "
                                  "count in the same bound)")
        else:
            bind_source = self._prepare_handover(support.reason)
        return bind_source, rootfs_overlay

    def _prepare_limits(self) -> None:
        """The run's cgroup (and the fds the anchor joins it by) and its rlimits."""
        policy = self.policy
        root = self.facts.caller_is_root
        # A serial, not id(self): a cgroup an interrupted run left behind must not collide with a
        # later Run object that CPython put at the same address (EEXIST, LaunchError).
        self.cgroup = _limits.RunCgroup.create(policy.limits, f"run-{os.getpid()}-{next(_CGROUP_SERIAL):x}",
                                               workspace=self.workspace)  # recorded: lowlevel.host.run_records
        if self.cgroup is None:
            self.notes.append("no writable cgroup hierarchy: memory, pids and CPU bounded by rlimits only")
        else:
            tasks, v2_dir = self.cgroup.join_targets()
            for path in tasks:
                self.cgroup_fds.append(self._own(os.open(path, os.O_WRONLY | os.O_CLOEXEC)))
            if v2_dir is not None:
                self.cgroup_dir_fd = self._own(os.open(v2_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        triples = _limits.rlimits(policy.limits, self.cgroup)
        if not (root and self.facts.cap_sys_resource):
            triples = clamp_to_own_hard_limits(triples)
        self.pre_exec_rlimits = triples
        self.rlimits_applied = tuple(name for name, _s, _h in triples)
        self.notes.extend(_limits.fallback_notes(policy.limits, self.cgroup))

    def _prepare_data_fds(self) -> tuple[Fds, list[tuple[int, int]]]:
        """The memfds and files bwrap reads (seccomp BPF, /etc/passwd and /etc/group, the /etc
        copies): ``(bwrap's fd numbers, [(fd here, fd in the child), ...])``."""
        policy = self.policy
        if policy.seccomp is not None and policy.seccomp.log:
            # Audit mode: the kernel logs what the profile would deny; read back at the end.
            try:
                self.audit = _seccomp.DenialAudit()
            except UnsupportedError as err:
                self.notes.append(f"seccomp audit unavailable: {err}")
        bpf = _seccomp.compile_bpf(policy.seccomp, compat_32bit=policy.compat_32bit) \
            if policy.seccomp is not None else None
        fds = CHILD_FDS
        seccomp_fd = None
        if bpf:
            seccomp_fd = self._own(_seccomp.bpf_memfd(bpf))
            self.seccomp_loaded = True
        else:
            fds = Fds(json_status=fds.json_status, seccomp=None, passwd=fds.passwd, group=fds.group)
        uid = policy.sandbox_uid if policy.sandbox_uid is not None else self.host_ids[0]
        gid = policy.sandbox_gid if policy.sandbox_gid is not None else self.host_ids[1]
        passwd, group = passwd_group(uid, gid)
        passwd_fd = self._own(memfd("lowlevel-passwd", passwd))
        group_fd = self._own(memfd("lowlevel-group", group))
        etc_fds = [self._own(open_etc_copy(path)) for path in etc_copies(policy, self.facts)]
        data = [(passwd_fd, fds.passwd or 0), (group_fd, fds.group or 0)]
        data += [(fd, ETC_COPY_FD + i) for i, fd in enumerate(etc_fds)]
        if seccomp_fd is not None:
            data.append((seccomp_fd, fds.seccomp or 0))
        return fds, data

    def _build_argv(self, bind_source: str, fds: Fds, rootfs_overlay: str | None) -> list[str]:
        """bwrap's options (``self.argv``), with the checks that the cached parts still hold."""
        policy = self.policy
        tree = None
        if policy.rootfs is not None:
            from lowlevel.rootfs import check_setup_paths, rootfs_layout
            self._check_rootfs_layout(policy.rootfs)
            tree = rootfs_layout(policy.rootfs)
        for bind in policy.binds:  # each source still the one the Policy checked (not swapped since)
            bind.check_unchanged()
        if policy.binds:  # the cached socket masks still cover what they did (lowlevel.sandbox.bind_sockets)
            if _bind_sockets.revalidate(policy, self.facts.caller_is_root):
                static_args.cache_clear()  # it carries the stale masks
        tree_masks: tuple[str, ...] = ()
        if tree is not None and not policy.rootfs_writable:
            # A read-only tree is bound by path: its unix sockets (a live chroot's services) are
            # masked as a bind's are. (A writable root is an overlay, which passes no socket.)
            tree_masks, tree_notes = _bind_sockets.tree_masks(
                tree.path, tree.dirs, _bind_sockets.sandbox_ids(policy, self.facts.caller_is_root))
            self.notes.extend(tree_notes)
        self.argv = build_argv(policy, self.facts, workspace=bind_source, fds=fds,
                               extra_env=self.env_extra or None,
                               extra_mounts=(*(self.egress.mounts if self.egress is not None else ()),
                                             *self.workspace_masks, *tree_masks),
                               rootfs_overlay=rootfs_overlay)
        if tree is not None:
            # No setup path through a symlink of the tree: bwrap would resolve it on the host's
            # tree (/oldroot) while it still holds the host's fds (issue 22 item 1).
            check_setup_paths(tree, setup_paths(self.argv))
        if policy.binds:  # the unix sockets masked in bound directories, and what that leaves open
            self.notes.extend(_bind_sockets.notes(policy, self.facts.caller_is_root, _landlock.planned_abi()))
        # Last line of defence: the --args memfd is NUL-separated, so a NUL inside a value would
        # split it into extra bwrap options. The policy edge refuses them already; encode_args
        # refuses again (LaunchError) right before the bytes are written.
        if self.guard and self.egress is None and self.facts.bwrap.has("--as-pid-1"):
            # The guard is the PID 1 of the sandbox's PID namespace in place of bwrap's reaper
            # (it reaps orphans itself): one process less per run, and the kernel keeps the
            # program from signalling its PID 1 at all. (Egress: the relay comes first.)
            self.argv = [*self.argv, "--as-pid-1"]
        return self.argv

    def _prepare_stdio(self) -> tuple[list[tuple[int, int]], bool]:
        """The program's stdio: ``([(fd here, 0/1/2), ...], stdin from /dev/null)``."""
        stdio: list[tuple[int, int]] = []
        devnull_stdin = False
        if self.stdin is not None:
            in_r, in_w = self._pipe()
            self.stdin_w = in_w
            os.set_blocking(in_w, False)
            self.stdin_view = memoryview(self.stdin)
            stdio.append((in_r, 0))
        elif self.stdio_fds[0] is not None:
            stdio.append((self.stdio_fds[0], 0))
        elif self.capture:
            devnull_stdin = True
        if self.capture:
            out_r, out_w = self._pipe()
            err_r, err_w = self._pipe()
            self.out_r, self.err_r = out_r, err_r
            stdio += [(out_w, 1), (err_w, 2)]
        else:
            stdio += [(fd, i) for i, fd in enumerate(self.stdio_fds) if i and fd is not None]
        return stdio, devnull_stdin

    def _lay_out_fds(self, args_fd: int, fds: Fds, data_fds: list[tuple[int, int]]) -> None:
        """THE fd table of the spawn (:mod:`lowlevel.sandbox.plan`): the json-status pipe, the report
        socket and the stdio, then every fd onto its child number (``self.actions``: posix_spawn's
        dup2s), ``self.pass_fds`` (what the anchor passes on to bwrap) and ``self.anchor_fds``.
        """
        json_r, json_w = self._pipe()
        self.json_r = json_r
        report, report_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.report = report
        self.report_child = report_child
        report.setblocking(False)
        stdio, devnull_stdin = self._prepare_stdio()
        mapping = stdio + [(args_fd, ARGS_FD), (json_w, fds.json_status), *data_fds]
        mapping += [(parent_fd, child_fd) for child_fd, parent_fd in sorted(self.extra_fds.items())]
        if self.guard:
            # The guard's executable and its report pipe, on the first numbers above the others.
            exe_child = max(dst for _src, dst in mapping) + 1
            status_r, status_w = self._pipe()
            self.status_r = status_r
            mapping += [(_landlock.guard_fd(), exe_child), (status_w, exe_child + 1)]
            rules = _landlock.ruleset_args(self.policy, self.facts.layout.ro_dirs, self.facts.bwrap.options)
            self.guard_prefix = _landlock.guard_argv(exe_child, exe_child + 1, rules, cwd=self.cwd)
        self.pass_fds = tuple(sorted(dst for _s, dst in mapping if dst > 2))
        # The anchor's own fds (never passed on to bwrap) go right above bwrap's.
        nxt = max(dst for _s, dst in mapping) + 1
        anchor_fds: dict[str, Any] = {}
        for name, src in (("report", report_child.fileno()), ("lower", self.lower_fd), ("root", self.root_fd),
                          ("lease", self.lease.fd if self.lease is not None else None)):
            if src is not None:
                mapping.append((src, nxt))
                anchor_fds[name] = nxt
                nxt += 1
        anchor_fds["cgroups"] = []
        for src in self.cgroup_fds:
            mapping.append((src, nxt))
            anchor_fds["cgroups"].append(nxt)
            nxt += 1
        if self.cgroup_dir_fd is not None:
            mapping.append((self.cgroup_dir_fd, nxt))
            anchor_fds["cgroup_dir"] = nxt
            nxt += 1
        self.anchor_fds = anchor_fds
        # Move every source above all targets first, so no dup2 clobbers a later source, and
        # no dup2 has src == dst (which would leave FD_CLOEXEC set). Every other fd of ours is
        # O_CLOEXEC (PEP 446), and the anchor closes whatever else it inherited.
        threshold = nxt
        actions: list[tuple[Any, ...]] = []
        if devnull_stdin:
            actions.append((os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0))
        for src, dst in mapping:
            if src < threshold:
                src = self._own(fcntl.fcntl(src, fcntl.F_DUPFD_CLOEXEC, threshold))
            actions.append((os.POSIX_SPAWN_DUP2, src, dst))
        self.actions = actions
        self.json_w = json_w

    def _prepare_handover(self, why: str) -> str:
        """The fallback where the overlay cannot work: hand the workspace over (or size it)."""
        policy = self.policy
        root = self.facts.caller_is_root
        self.notes.append(f"workspace handed over, not copy-on-write: {why}")
        if self.workspace_arg is not None:
            _ws.check_trusted_ancestors(self.workspace)
        if root:
            _ws.check_traversable(self.workspace, *self.host_ids)
        fresh_empty = self.owns_workspace and not self.inputs
        # One walk: the change-report snapshot, the owners to give back, and (root callers) the
        # tree given to the sandbox's uid with the root kept 0770 ours:host_gid; close() (or
        # result()) gives it back and strips setuid/setgid bits (lowlevel.workspace.hand_over).
        # A directory mkdtemp made a moment ago with nothing copied in is empty: no walk.
        if policy.limits.workspace_bytes is not None:
            raise UnsupportedError("workspace-size", "Limits.workspace_bytes bounds the copy-on-write overlay's "
                                   f"upper layer, which is unavailable here ({why})",
                                   "leave workspace_bytes unset (RLIMIT_FSIZE still bounds each file)")
        self.handover = _ws.hand_over(self.workspace, sandbox_ids=self.host_ids if root else None,
                                      empty=fresh_empty)
        self.before = self.handover.before
        # The workspace is bound as it is: mask the host unix sockets in it (lowlevel.sandbox.bind_sockets).
        self.workspace_masks = _bind_sockets.workspace_masks(self.workspace, self.before[0])
        if self.workspace_masks:
            if len(self.workspace_masks) > 3 * _bind_sockets.MAX_MASKS:
                raise LaunchError(f"the workspace holds {len(self.workspace_masks) // 3} unix sockets, more than the "
                                  f"{_bind_sockets.MAX_MASKS} lowlevel masks: remove them, or use a workspace without")
            self.notes.append(f"workspace: masked {len(self.workspace_masks) // 3} unix socket(s) found in it "
                              f"(connecting fails): {', '.join(self.workspace_masks[2::3][:8])}")
        if not self.before[1]:
            self.notes.append("workspace: the snapshot is incomplete, so unix sockets beyond it are not masked")
        return self.workspace

    # -- 2. spawn ------------------------------------------------------------------------
    def anchor_argv(self) -> list[str]:
        """The argv exec'd: ``_lowlevel_exec OPTIONS -- bwrap --args 3 -- COMMAND...``."""
        ov: _AnchorOverlay | None = None
        if self.cow:
            assert self.lower_stat is not None
            ov = _AnchorOverlay(mnt=self.mnt, lower_fd=self.anchor_fds["lower"], upper_bytes=self.upper_bytes,
                                upper_inodes=_cow.upper_inodes(self.upper_bytes),
                                lower_path=None if self.facts.caller_is_root else self.workspace,
                                idmap=(self.lower_stat.st_uid, self.lower_stat.st_gid)
                                if self.facts.caller_is_root else None,
                                root_lower_fd=self.anchor_fds.get("root"),
                                root_lower_path=None if self.facts.caller_is_root or self.root_fd is None
                                else self.policy.rootfs,
                                # A workspace we made a moment ago, nothing copied in: empty.
                                empty_lower=self.one_shot and self.owns_workspace and not self.inputs)
        return anchor_argv(self.facts, _facts._exec_helper(), parent=os.getpid(), report_fd=self.anchor_fds["report"],
                           cgroup_fds=self.anchor_fds["cgroups"], cgroup_dir_fd=self.anchor_fds.get("cgroup_dir"),
                           rlimits=self.pre_exec_rlimits,
                           ids=self.host_ids if self.facts.caller_is_root else None, overlay=ov,
                           keep_fds=(self.anchor_fds["lease"],) if "lease" in self.anchor_fds else (),
                           pass_fds=self.pass_fds, args_fd=ARGS_FD, command=self._inner_command(),
                           # The anchor enforces the deadline too (a stopped caller cannot extend a run).
                           deadline_ns=None if self.deadline is None
                           else round((self.deadline + self.kill_after + ANCHOR_GRACE_S) * 1e9))

    def _inner_command(self) -> list[str]:
        """What bwrap runs: the egress relay (outside Landlock: it listens on the proxy port),
        then the guard, then the command."""
        command = [*self.guard_prefix, *self.command]
        return self.egress.wrap(command) if self.egress is not None else command

    def spawn(self) -> None:
        """posix_spawn the anchor (which execs bwrap) with an empty environment; open its pidfd.

        A signal handler's exception (KeyboardInterrupt) is held back until the anchor's PID
        and pidfd are recorded (lowlevel.sandbox._interrupts), so :meth:`close` can always kill it.

        Raises:
            LaunchError: the spawn or pidfd_open failed; nothing is left running.
        """
        with deferred_interrupts():
            self._spawn()

    def _spawn(self) -> None:
        self.since_ns = time.time_ns()
        self.t0 = time.monotonic()
        if self.timeout is not None:
            self.deadline = self.t0 + self.timeout
        exe_argv = self.anchor_argv()
        i = exe_argv.index("--args")
        self.full_argv = [*exe_argv[:i], *self.argv, *exe_argv[i + 2:]]
        log.debug("lowlevel: spawning %s", lambda: redact_env_values(self.full_argv))
        try:
            # setsid: the host-side bwrap (and the exec helper) leave the caller's session too
            # (bwrap's --new-session detaches only the sandbox's side), so no process lowlevel
            # starts keeps the caller's controlling terminal, and a ^C or hangup there reaches
            # only the caller, which then kills the sandbox in order (issue 12 item 1).
            self.pid = os.posix_spawn(exe_argv[0], exe_argv, {}, file_actions=self.actions,
                                      setsigdef=_DEFAULT_SIGNALS, setsigmask=(), setsid=True)
        except OSError as err:
            hint = f": {PROCESS_LIMIT_HINT}" if err.errno == errno.EAGAIN else ""
            raise LaunchError(f"cannot start {exe_argv[0]}: {err.strerror}{hint}", argv=exe_argv,
                              errno=err.errno) from err
        try:
            self.pidfd = os.pidfd_open(self.pid)
            self.phase = Phase.SPAWNED
        except OSError as err:
            # Not reaped yet, so the PID is still this child: kill and reap it by PID.
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.wait_status = -1
            raise LaunchError(f"pidfd_open of the sandbox failed: {err.strerror}", errno=err.errno) from err
        if self.handover is not None and self.handover.journal is not None:
            self.handover.journal.record_process("anchor", self.pid)  # lowlevel.workspace.handover_journal
        # Close the child's ends in the parent.
        keep = {self.json_r, self.out_r, self.err_r, self.stdin_w, self.lower_fd, self.status_r}
        for fd in list(self.fds):
            if fd not in keep:
                os.close(fd)
                self.fds.remove(fd)
        self.cgroup_fds.clear()
        self.cgroup_dir_fd = None
        if self.lease is not None:
            self.lease.release()  # the anchor holds the lease now, for as long as it lives
        if self.report_child is not None:
            self.report_child.close()
            self.report_child = None
        for rfd in (self.out_r, self.err_r, self.json_r, self.status_r):
            if rfd is not None:
                os.set_blocking(rfd, False)

    # -- 3. handshake --------------------------------------------------------------------
    def read_report(self) -> bool:
        """Read the anchor's READY (non-blocking); return True once the sandbox is ready.

        READY carries bwrap's pidfd (the PID 1 of the run's PID namespace: readable once
        every process of the sandbox is gone) and, with the overlay, the upper directory's fd.
        EOF (the anchor died in its setup) closes the socket: its exit and stderr explain.
        """
        if self.ready or self.report is None:
            return self.ready
        with deferred_interrupts():  # the fds are ours before any KeyboardInterrupt
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self.report, 256, 4)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                msg, fds = b"", []
            for fd in fds:
                self._own(fd)
        if not msg:
            self.report.close()
            self.report = None
            for fd in fds:
                os.close(fd)
                self.fds.remove(fd)
            return False
        want = 2 if self.cow else 1
        if not msg.startswith(b"READY") or len(fds) != want:
            # No fds with READY: the kernel could not install them (MSG_CTRUNC: EMFILE). Without
            # bwrap's pidfd the sandbox cannot be supervised: kill it (the anchor's death takes
            # bwrap, which has not started yet, with it) and say why.
            self.kill(None)
            why = ("the sandbox's fds could not be received (too many open files?)" if msg.startswith(b"READY")
                   else f"the anchor sent {msg[:80]!r}, expected READY: reinstall lowlevel")
            raise LaunchError(why, argv=self.full_argv, errno=errno.EMFILE if msg.startswith(b"READY") else None)
        self.init_pidfd = fds[0]
        self.fds.remove(fds[0])
        if self.handover is not None and self.handover.journal is not None:
            try:
                with open(f"/proc/self/fdinfo/{self.init_pidfd}") as f:
                    bwrap_pid = next(int(line.split()[1]) for line in f if line.startswith("Pid:"))
                self.handover.journal.record_process("bwrap", bwrap_pid)
            except (OSError, StopIteration, ValueError):
                pass  # recovery then waits for the sandbox uid's processes instead
        if len(fds) > 1:
            self.upper_fd = fds[1]
            self.fds.remove(fds[1])  # closed by finish_cow
        self.phase = Phase.READY
        return True

    def read_exit(self) -> bool:
        """After READY: read the anchor's EXIT (non-blocking); return True once it arrived.

        EXIT comes when the anchor has reaped bwrap, i.e. every process of the sandbox is
        gone, and before the anchor's own exit, which tears down its mount namespace (the
        overlay and its tmpfs: ~0.5-1.5 ms here, two expedited RCU grace periods). It carries
        bwrap's wait status and max RSS, so the Result is built meanwhile and the anchor is
        reaped afterwards (:meth:`reap_anchor`). The status recorded is the anchor's own exit
        status as it will be (bwrap's code, or 128+N for a signal N).
        """
        if self.exit_reported or self.report is None or not self.ready:
            return self.exit_reported
        while True:
            try:
                msg = self.report.recv(256)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                msg = b""
            if not msg:
                self.report.close()  # EOF without EXIT: the anchor died; its pidfd tells
                self.report = None
                return False
            if msg.startswith(b"EXIT "):
                break
        try:
            fields = [int(x) for x in msg.split()[1:]]
            status, maxrss = fields[0], fields[1]
        except (ValueError, IndexError):
            return False
        code = os.WTERMSIG(status) + 128 if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self.supervisor_signaled = self.supervisor_signaled or os.WIFSIGNALED(status)  # bwrap killed
        self.wait_status = (code & 0xFF) << 8
        self.rusage = _ExitUsage(maxrss)
        # The end as the anchor measured it (CLOCK_MONOTONIC, time.monotonic's clock): a caller
        # stopped or starved when the run ended must not count its own delay as the run's.
        self.t_end = fields[2] / 1e9 if len(fields) > 2 and fields[2] > 0 else time.monotonic()
        if len(fields) > 3 and fields[3] & 1 and self.killed_by is None:
            # The anchor killed the sandbox at the deadline (--deadline-ns): the caller did not.
            self.killed_by = "timeout"
            self.timed_out = True
        self.phase = Phase.EXITED
        return True

    def reap_anchor(self, *, block: bool = True) -> bool:
        """Reap the anchor once it reported EXIT; True when it is reaped (or was never ours).

        Args:
            block: wait for its exit (its teardown is bounded: it does nothing else).
        """
        if self.anchor_reaped or self.pid is None:
            return True
        try:
            pid, _status, _ru = os.wait4(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            pid = self.pid  # reaped by someone else (a SIGCHLD handler waiting for any child)
        if pid == 0:
            return False
        self.anchor_reaped = True
        return True

    def feed_json(self, data: bytes) -> bool:
        """Feed json-status bytes; return True once the child-pid document has arrived."""
        self.json_buf += data
        if self.init_pid is None:
            doc = self._first_doc()
            if doc is not None and "child-pid" in doc:
                self.init_pid = int(doc["child-pid"])  # in bwrap's PID namespace, not ours
                if self.audit is not None:
                    self._attach_audit()
                return True
        return False

    def _attach_audit(self) -> None:
        """Audit mode: attribute kernel records to the sandbox's PID namespace (bwrap's child)."""
        assert self.audit is not None and self.init_pidfd is not None
        try:
            with open(f"/proc/self/fdinfo/{self.init_pidfd}") as f:
                bwrap_pid = next(int(line.split()[1]) for line in f if line.startswith("Pid:"))
            with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
                child = int(f.read().split()[0])
            self.audit.attach(child)
        except (OSError, StopIteration, ValueError, IndexError) as err:
            self.notes.append(f"seccomp audit: cannot find the sandbox's PID namespace ({err})")

    def _docs(self) -> list[dict[str, Any]]:
        docs = []
        for line in self.json_buf.split(b"\n"):
            line = line.strip()
            if line:
                try:
                    docs.append(json.loads(line))
                except ValueError:
                    pass
        return docs

    def _first_doc(self) -> dict[str, Any] | None:
        if b"\n" not in self.json_buf:
            return None
        docs = self._docs()
        return docs[0] if docs else None

    # -- 4. supervise --------------------------------------------------------------------
    def feed_stdin(self, *, close: bool = True) -> bool:
        """Write what the stdin pipe takes; return True when stdin is done (and closed).

        Args:
            close: close the pipe when done. The async driver passes False and closes it
                itself once the loop no longer watches the fd number.
        """
        if self.stdin_w is None:
            return True
        view = self.stdin_view
        try:
            while view:
                n = os.write(self.stdin_w, view[:65536])
                view = view[n:]
        except BlockingIOError:
            self.stdin_view = view
            return False
        except BrokenPipeError:
            pass
        self.stdin_view = None
        if close:
            self._close_fd("stdin_w")
        return True

    def read_fd(self, which: str, *, close: bool = True) -> bool:
        """Drain readable data from 'out_r', 'err_r' or 'json_r'; return False at EOF.

        Args:
            which: the attribute naming the fd.
            close: close the fd at EOF (the default). The async driver passes False and
                closes it after unregistering it from the loop: a number closed while still
                registered could be reused by a pipe another thread opens meanwhile.
        """
        fd = getattr(self, which)
        if fd is None:
            return False
        while True:
            try:
                data = os.read(fd, 262144)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                if close:
                    self._close_fd(which)
                return False
            if which == "out_r":
                self.out.feed(data)
            elif which == "err_r":
                self.err.feed(data)
            else:
                self.feed_json(data)

    def _close_fd(self, attr: str) -> None:
        fd = getattr(self, attr)
        if fd is not None:
            os.close(fd)
            if fd in self.fds:
                self.fds.remove(fd)
            setattr(self, attr, None)

    def on_deadline(self) -> None:
        """The deadline passed: SIGKILL the sandbox, or with :attr:`kill_after` first SIGTERM
        every process in it and push the deadline back by ``kill_after`` (the next call kills)."""
        if self.kill_after > 0 and not self.terminated and self.deadline is not None:
            self.terminate()
            self.deadline += self.kill_after
            return
        self.kill("timeout")

    def terminate(self) -> None:
        """SIGTERM every process of the sandbox but its PID 1 (the program, what it started, the
        orphans PID 1 adopted): step one of a timeout with a grace, as ``timeout -k`` sends
        SIGTERM, then SIGKILL. Records ``killed_by="timeout"``.

        The processes are the descendants of the sandbox's PID 1 (``/proc/PID/task/*/children``,
        readable by the caller, who owns the sandbox's user namespace); each is signalled
        through a pidfd opened while its parent is still the one it was found under, so a
        recycled PID is never signalled. PID 1 itself (the guard) has no handler and is not
        signalled (the kernel would drop it). Best effort: a process forked during the walk
        gets the SIGKILL of the end of the grace.
        """
        self.terminated = True
        if self.killed_by is None:
            self.killed_by = "timeout"
            self.timed_out = True
        root = _pidfd_pid(self.init_pidfd)
        if root is None:
            return
        todo, seen = [root], {root}
        while todo and len(seen) < 1_000_000:
            parent = todo.pop()
            for pid in _children(parent):
                if pid in seen:
                    continue
                seen.add(pid)
                todo.append(pid)
                try:
                    pfd = os.pidfd_open(pid)
                except OSError:
                    continue
                try:
                    if _ppid(pid) == parent:
                        signal.pidfd_send_signal(pfd, signal.SIGTERM)
                except OSError:
                    pass
                finally:
                    os.close(pfd)

    def kill(self, reason: str | None, *, cgroup_kill: bool = True) -> None:
        """SIGKILL the whole sandbox (its PID 1 takes the PID namespace with it) and bwrap.

        Args:
            reason: recorded as ``killed_by`` (the first reason wins), or None.
            cgroup_kill: also SIGKILL every process in the run's cgroup and wait (up to 2 s,
                blocking) until it is empty. The async driver passes False and instead waits
                on the sandbox-init pidfd without blocking the loop; :meth:`close` still
                empties and removes the cgroup.
        """
        if reason and self.killed_by is None:
            self.killed_by = reason
            if reason == "timeout":
                self.timed_out = True
        for pfd in (self.init_pidfd, self.pidfd):
            if pfd is not None:
                try:
                    signal.pidfd_send_signal(pfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if cgroup_kill and self.cgroup is not None:
            try:
                self.cgroup.kill_all()
            except Exception:  # noqa: BLE001 - best effort, bwrap's death kills the namespace anyway
                pass

    def reap(self) -> None:
        """Reap the anchor (blocking: call once its pidfd is readable) and make sure the sandbox is gone.

        The anchor exits after bwrap, the PID 1 of the run's namespace, whose exit completes only
        once every process of the namespace is gone (``zap_pid_ns_processes``); if the anchor
        was killed instead, bwrap's parent-death signal takes the namespace down: wait for it.
        """
        self.reap_bwrap()
        if self.init_pidfd is not None:
            if not _readable(self.init_pidfd, INIT_EXIT_TIMEOUT_S):
                try:
                    signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _readable(self.init_pidfd, INIT_KILL_TIMEOUT_S)
        elif self.cgroup is not None and self.pid is not None:
            # Killed before READY: whatever the anchor forked is in the run's cgroup.
            try:
                self.cgroup.kill_all()
            except Exception:  # noqa: BLE001 - best effort: the PID namespace dies with bwrap anyway
                pass

    def reap_bwrap(self) -> None:
        """``os.wait4`` bwrap and record its status; blocks unless bwrap's pidfd is readable.

        The first half of :meth:`reap`; the async driver calls it once the loop reports the
        pidfd readable, then waits for the sandbox-init pidfd itself instead of blocking.
        """
        if self.pid is not None and self.wait_status is None:
            _, status, ru = os.wait4(self.pid, 0)
            self.wait_status = status
            self.supervisor_signaled = self.supervisor_signaled or os.WIFSIGNALED(status)  # the anchor killed
            self.rusage = ru
            self.t_end = time.monotonic()
            self.anchor_reaped = True

    def sandbox_alive(self) -> bool:
        """True while the sandbox's PID 1 (and so its PID namespace) still exists."""
        if self.init_pidfd is None:
            return False
        return not _readable(self.init_pidfd, 0)

    # -- 5. finish -----------------------------------------------------------------------
    def result(self) -> Result:
        """Build the Result once bwrap is reaped and the pipes are drained; then commit or discard
        the run's changes (:meth:`finish_cow`).

        Raises:
            ExecError, LaunchError, UnsupportedError: the program never started (the guard's or
                bwrap's report, :meth:`_verdict`).
            CommitConflictError, CommitIncompleteError: see :meth:`finish_cow`.
        """
        rep = self.read_guard_report()
        stats: _limits.CgroupStats | None = None
        if self.cgroup is not None:
            try:
                stats = self.cgroup.stats()
            except OSError as err:
                self.notes.append(f"cgroup figures unavailable: {err}")
        exit_code, term, killed_by = self._verdict(rep, stats)
        out, out_t, out_d = self.out.value()
        errout, err_t, err_d = self.err.value()
        changes = self._final_changes()  # the sandbox is dead: its writes are final
        landlock_abi = rep.abi if rep is not None and rep.started else None
        enforced, denials, network = self._enforced(rep, landlock_abi, exit_code, errout)
        result = Result(
            exit_code=exit_code, term_signal=term, timed_out=self.timed_out, killed_by=killed_by,
            stdout=out, stderr=errout, stdout_truncated=out_t, stderr_truncated=err_t,
            stdout_dropped_bytes=out_d, stderr_dropped_bytes=err_d,
            wall_time_s=(self.t_end or time.monotonic()) - self.t0,
            cpu_user_s=stats.cpu_user_s if stats else None, cpu_system_s=stats.cpu_system_s if stats else None,
            peak_memory_bytes=stats.peak_memory_bytes if stats else None,
            max_rss_bytes=(self.rusage.ru_maxrss * 1024) if self.rusage is not None else None,
            oom_kills=stats.oom_kills if stats else None,
            limits_enforced=enforced, changes=changes, workspace=self.workspace,
            notes=tuple(self.notes), argv=tuple(self.full_argv), seccomp_denials=denials, network=network,
            landlock_abi=landlock_abi,
        )
        if self.cow:
            try:
                self.finish_cow(success=exit_code == 0 and killed_by is None, result=result)
            except (_overlay.CommitConflictError, CommitIncompleteError):
                raise
            except WorkspaceError as err:
                self.notes.append(f"{WARNING_PREFIX}{err}")
            result.notes = tuple(self.notes)
        return result

    def _verdict(self, rep: _landlock.GuardReport | None,
                 stats: _limits.CgroupStats | None) -> tuple[int, int | None, str | None]:
        """``(exit_code, term_signal, killed_by)`` of the program; raises when it never started.

        A list of cases, in order: the guard could not start it; the memory cgroup's OOM killer
        took bwrap or the anchor; the supervisor was killed from outside while it ran; bwrap's
        setup failed; else the program's own end, from the guard's report (its exact wait status)
        or bwrap's exit code.
        """
        docs = self._docs()
        exit_doc = next((d for d in docs if "exit-code" in d), None)
        if rep is not None and rep.fail_stage is not None:
            raise self._guard_failure(rep)
        unexplained = exit_doc is None and not self.timed_out and self.killed_by is None
        if unexplained and stats is not None and stats.oom_kills:
            # The memory cgroup's OOM killer took bwrap or the anchor instead of the program (its
            # files in the tmpfs layers are charged to the run but belong to no process's RSS):
            # a verdict on the program's memory use, not a setup failure (issue 25).
            if rep is not None and not rep.started:
                raise LaunchError(f"the memory limit (memory_bytes={self.policy.limits.memory_bytes}) is too small "
                                  "for the sandbox's own setup: the memory cgroup's OOM killer killed bwrap before "
                                  "the program started; raise memory_bytes", argv=self.full_argv, errno=errno.ENOMEM)
            self.killed_by = "memory"
            self.notes.append(_limits.memory_kill_note(self.policy.limits, "bwrap or lowlevel's anchor (not the "
                                                       "program), the sandbox's outer processes"))
        elif unexplained and self._program_started(rep):
            # bwrap reported its child (or the guard its program) started, then died without an
            # exit code: the anchor or bwrap was killed from outside while the program ran (the
            # program died with them: PID namespace). A killed program, not a setup failure, so
            # its output and workspace are delivered (issue 23).
            self.killed_by = "signal"
            self.notes.append("the sandbox's supervisor (lowlevel's anchor or bwrap, outside the sandbox) was "
                              "killed while the program ran; the program was killed with it")
        elif unexplained:
            stderr, _, _ = self.err.value()
            if self.guard and b"execvp /proc/self/fd/" in stderr:
                raise LaunchError("bwrap could not execute lowlevel's guard (lowlevel/_lowlevel_guard): "
                                  f"{stderr.decode('utf-8', 'replace').strip()}", argv=self.full_argv)
            raise classify_setup_failure(stderr, self.full_argv, self.command)
        term: int | None
        if rep is not None and rep.wait_status is not None:
            # The guard's report: the program's own wait status, a fact (bwrap's exit code says
            # 152 both for "exit 152" and for death by SIGXCPU).
            exit_code, term = wait_status_exit(rep.wait_status)
        else:
            exit_code = int(exit_doc["exit-code"]) if exit_doc is not None else 128 + signal.SIGKILL
            # Without a guard report (the sandbox was killed, or no guard) the code is bwrap's;
            # with a guard, a code above 128 then is the guard's own death by that signal: the
            # guard exits above 128 on its own only after reporting.
            term = decode_exit(exit_code)
            if rep is not None and rep.started and exit_doc is not None and self.killed_by is None:
                if stats is not None and stats.oom_kills:
                    self.notes.append(_limits.memory_kill_note(self.policy.limits, "lowlevel's guard (the program's "
                                                               "parent inside the sandbox), not the program"))
                else:
                    self.notes.append("the guard (the program's parent inside the sandbox) ended before reporting "
                                      f"the program's end (bwrap exit code {exit_code}); the sandbox was torn down")
        killed_by = self.killed_by or self._killed_by(exit_code, term, stats)
        if killed_by == "memory" and not any("OOM killer" in n for n in self.notes):
            self.notes.append(_limits.memory_kill_note(self.policy.limits))
        return exit_code, term, killed_by

    def _final_changes(self) -> _ws.Changes:
        """What the run changed: the upper layer's entries, or the hand-over's snapshot diff."""
        if self.cow:
            return self.read_changes()
        try:
            after = self.give_back_workspace() if self.handover is not None else _ws.snapshot(self.workspace)
        except WorkspaceError as err:
            # The program ran: its exit status and output are delivered, with the failure as a
            # warning (the CLI prints it), never a bare OSError that loses them.
            after = ({}, False)
            self.notes.append(f"{WARNING_PREFIX}the workspace could not be checked and given back after the "
                              f"run ({err}): treat {self.workspace} as untrusted (ownership and setuid/setgid "
                              "bits may be left as the sandbox set them)")
        if self.handover is not None:
            self.notes.extend(self.handover.notes)  # e.g. directories too deep to check, sealed
        return _ws.diff(self.before, after)

    def _enforced(self, rep: _landlock.GuardReport | None, landlock_abi: int | None, exit_code: int,
                  errout: bytes) -> tuple[tuple[str, ...], tuple[str, ...] | None, Any]:
        """``(limits_enforced, seccomp_denials, network)``, with the notes they bring."""
        enforced = tuple(self.rlimits_applied) + tuple(
            f"cgroup:{c}" for c in (self.cgroup.enforced if self.cgroup is not None else ()))
        if self.seccomp_loaded:
            enforced += ("seccomp",)
        if landlock_abi:
            enforced += ("landlock",)
        elif rep is not None and rep.started and self.policy.landlock is not False:
            self.notes.append("Landlock not applied: " + _landlock.describe(0))
        net_note = network_denial_note(self.policy, landlock_abi, exit_code, errout)
        if net_note:
            self.notes.append(net_note)
        denials = None
        if self.audit is not None:
            denials = tuple(self.audit.finish())
            self.audit = None
        network = None
        if self.egress is not None:
            network, egress_notes, egress_enforced = self.egress.finish()
            self.notes.extend(egress_notes)
            enforced += egress_enforced
        return enforced, denials, network

    def _program_started(self, rep: _landlock.GuardReport | None) -> bool:
        """After READY, the sandbox was set up and then killed from outside: the guard reported
        its program started, or bwrap (the anchor's EXIT) or the anchor itself died by a signal
        (bwrap's own setup failures exit 1: never a signal)."""
        return self.ready and ((rep is not None and rep.started) or self.supervisor_signaled)

    def setup_error(self) -> LaunchError:
        """The error for a sandbox that ended before the program started (the anchor exited
        before READY): :func:`classify_setup_failure` of bwrap's stderr, unless the memory
        cgroup's OOM killer fired meanwhile, which is then the cause named (issue 25)."""
        oom = None
        if self.cgroup is not None:
            try:
                oom = self.cgroup.event_counts()[0]
            except OSError:
                pass
        if oom:
            return LaunchError(f"the memory limit (memory_bytes={self.policy.limits.memory_bytes}) is too small for "
                               "the sandbox's own setup: the memory cgroup's OOM killer killed a process of it before "
                               "the program started; raise memory_bytes", argv=self.full_argv, errno=errno.ENOMEM)
        return classify_setup_failure(self.err.value()[0], self.full_argv, self.command)

    def read_guard_report(self) -> _landlock.GuardReport | None:
        """What the guard reported (read once, after bwrap exited); None without a guard."""
        if self.guard_report is None and self.status_r is not None:
            self.guard_report = _landlock.read_report(self.status_r)
            self._close_fd("status_r")
        return self.guard_report

    def _guard_failure(self, rep: _landlock.GuardReport) -> LowlevelError:
        """The error for a program the guard could not start (exec or Landlock failed)."""
        code = rep.fail_errno or 0
        text = self.err.value()[0].decode("utf-8", "replace").strip()
        if rep.fail_stage == _landlock.STAGE_EXEC:
            return ExecError(f"{self.command[0]}: {os.strerror(code).lower()} in the sandbox", argv=self.full_argv,
                             stderr=text, errno=code)
        if rep.fail_stage == _landlock.STAGE_CWD:
            return LaunchError(f"the working directory {self.cwd!r} resolves outside the sandbox (through a magic "
                               "link such as /proc/self/fd/N, or a symlink to one: CVE-2024-21626 class); refused "
                               "before the program ran: use a directory of the sandbox's own tree, e.g. /workspace",
                               argv=self.full_argv, stderr=text, errno=code)
        if rep.fail_stage == _landlock.STAGE_CHDIR:
            return LaunchError(f"cannot change to the working directory {self.cwd!r} in the sandbox: "
                               f"{os.strerror(code)}; create it (e.g. under /workspace) or pass another cwd",
                               argv=self.full_argv, stderr=text, errno=code)
        if rep.fail_stage == _landlock.STAGE_LANDLOCK and code in (errno.EOPNOTSUPP, errno.ENOSYS):
            return UnsupportedError("landlock", "Policy(landlock='require') but Landlock is not available "
                                    "inside the sandbox", "use Policy(landlock=True) for best effort")
        stage = _landlock.STAGES.get(rep.fail_stage or 0, str(rep.fail_stage))
        hint = f" ({PROCESS_LIMIT_HINT})" if code == errno.EAGAIN else ""
        return LaunchError(f"the sandbox's guard could not start {self.command[0]!r}: {stage}: {os.strerror(code)}"
                           f"{hint}", argv=self.full_argv, stderr=text, errno=code)

    # -- copy-on-write workspace ---------------------------------------------------------
    @property
    def xattr_prefix(self) -> str:
        """Where overlayfs keeps its xattrs in the upper: ``trusted.`` (root) or ``user.`` (userxattr)."""
        return "trusted.overlay." if self.facts.caller_is_root else "user.overlay."

    def read_changes(self) -> _ws.Changes:
        """What the run changed so far, from the upper directory (O(changed entries)).

        Raises:
            WorkspaceError: the upper or lower directory could not be read (``.errno``).
        """
        if self.upper_fd is None or self.lower_fd is None:
            return _ws.Changes()
        try:
            return _overlay.read_changes(self.upper_fd, self.lower_fd, xattr_prefix=self.xattr_prefix)
        except LowlevelError:
            raise
        except OSError as err:
            raise WorkspaceError(err.errno, f"cannot read the run's changes: {err.strerror}") from err

    def finish_cow(self, *, success: bool, result: Result | None = None) -> None:
        """Commit or discard the run's upper layer (``commit``), once; then release it.

        Raises:
            CommitConflictError: entries the run changed were also changed on the host during
                the run: nothing was applied (``.applied`` None), the upper layer was saved to the
                path the error gives, and ``.result`` holds the run's Result; or during the
                commit (``.applied`` set: the others were applied, ``.result.changes`` lists them).
            CommitIncompleteError: the workspace's filesystem could not take the changes (full,
                out of quota, read-only): what was applied is kept (``.result.changes``), the
                rest saved at ``.saved_upper``.
            WorkspaceError: the commit failed before applying anything (each entry is old or
                new, never lost).
        """
        if self.committed or self.upper_fd is None or self.lower_fd is None:
            return
        self.committed = True
        do = self.commit is True or (self.commit == "on_success" and success)
        try:
            if not do:
                self.notes.append("changes discarded: the workspace is as it was before the run"
                                  + ("" if self.commit is False else " (commit='on_success' and the run failed)"))
                return
            assert self.lower_stat is not None
            target = CommitTarget(
                upper_fd=self.upper_fd, lower_fd=self.lower_fd, xattr_prefix=self.xattr_prefix,
                since_ns=self.since_ns, upper_bytes=self.upper_bytes, workspace=self.workspace,
                workspace_base=self.workspace_base, accept_seen_host_changes=self.accept_seen_host_changes,
                owner=(self.lower_stat.st_uid, self.lower_stat.st_gid) if self.facts.caller_is_root else None,
                needs_record=self.cgroup is None or self.cgroup.record is None, name=f"commit-{id(self):x}")
            commit_upper(target, result, self.notes)
        finally:
            os.close(self.upper_fd)
            self.upper_fd = None

    def reset_cow(self, timeout_s: float = 10.0) -> None:
        """Drop the upper layer of a live sandbox (a Session): /workspace is the lower tree again.

        The anchor stacks a fresh overlay on the workspace (the mount propagates into the
        sandbox); the old upper's content is removed here to free its share of the bound.

        Raises:
            LaunchError: the anchor refused or did not answer within ``timeout_s``.
        """
        if self.report is None or not self.cow:
            raise LaunchError("this sandbox has no copy-on-write workspace to reset")
        self.report.setblocking(True)
        self.report.settimeout(timeout_s)
        with deferred_interrupts():  # the new upper's fd is ours before any KeyboardInterrupt
            try:
                self.report.send(b"RESET")
                msg, fds, _flags, _addr = socket.recv_fds(self.report, 4096, 2)
            except OSError as err:
                raise LaunchError(f"resetting the workspace failed: {err}",
                                  errno=getattr(err, "errno", None)) from err
            finally:
                self.report.setblocking(False)
            if not msg.startswith(b"RESET_OK") or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise LaunchError("resetting the workspace failed: "
                                  + msg.decode("utf-8", "replace").removeprefix("RESET_ERR ").strip())
            old, self.upper_fd = self.upper_fd, self._own(fds[0])
            self.fds.remove(self.upper_fd)
        self.since_ns = time.time_ns()
        if old is not None:
            try:
                _overlay.clear_dir(old)
            except WorkspaceError as err:
                # A command started before the reset can keep writing into the old layer (its cwd
                # is there) while it is cleared: the reset stands; what it writes there is in no
                # later diff or commit, and goes with the sandbox.
                log.info("lowlevel: the dropped upper layer is still being written to: %s", err)
            finally:
                os.close(old)

    def _killed_by(self, exit_code: int, term: int | None, stats: _limits.CgroupStats | None) -> str | None:
        """:func:`lowlevel.sandbox.result.classify_kill` of the run from its cgroup's figures
        (the CPU total: the cgroup's); a refused fork at ``pids.max`` adds :func:`pids_note`."""
        if stats is not None and not stats.oom_kills and stats.pids_limit_hit:
            self.notes.append(pids_note(self.policy.limits.pids, exit_code, term))
        return classify_kill(term=term, oom=bool(stats is not None and stats.oom_kills),
                             pids_hit=bool(stats is not None and stats.pids_limit_hit),
                             cpu_used_s=None if stats is None else (stats.cpu_user_s or 0) + (stats.cpu_system_s or 0),
                             cpu_limit_s=self.policy.limits.cpu_s, rlimit_cpu="RLIMIT_CPU" in self.rlimits_applied)

    def give_back_workspace(self) -> tuple[Any, bool]:
        """Strip setuid/setgid bits the run left and give the workspace back to its owners.

        Only once the sandbox is dead (:meth:`result` and :meth:`close` call it). Returns the
        snapshot after the run. See :func:`lowlevel.workspace.give_back`.

        Raises:
            WorkspaceError: the walk failed (the root directory is restored regardless).
        """
        assert self.handover is not None
        return _ws.give_back(self.handover)

    def finish_workspace(self, result: Result | None) -> Result | None:
        """``keep_workspace=False``: remove the fresh workspace now that the Result is built
        (or the run failed: ``result`` None). Returns the Result with a note saying so."""
        if self.keep_workspace or not self.owns_workspace or not self.workspace:
            return result
        if result is not None:
            return drop_fresh_workspace(result)
        if os.path.lexists(self.workspace):
            try:
                _ws.remove_workspace(self.workspace)
            except (OSError, LowlevelError) as err:
                log.warning("lowlevel: keep_workspace=False: cannot remove %s: %s", self.workspace, err)
        return None

    def discard_workspace_if_unused(self) -> None:
        """Remove a workspace this Run created when the program never started (setup failed)."""
        rep = self.guard_report
        never_ran = b'"exit-code"' not in self.json_buf or (rep is not None and rep.fail_stage is not None)
        if self.owns_workspace and self.workspace and never_ran and not self.killed_by:
            shutil.rmtree(self.workspace, ignore_errors=True)

    def close(self) -> None:
        """Kill anything left, reap, commit (``commit=True``) or drop the upper layer, remove
        the cgroup, close every fd. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.pid is not None and self.wait_status is None:
                self.kill(None)
                self.reap()
            elif self.init_pidfd is not None and self.sandbox_alive():
                self.kill(None)
                self.reap()
        finally:
            if self.exit_reported:
                self.reap_anchor()  # it left the run's cgroups (and released its lease) on exit
            if self.audit is not None:
                self.audit.close()
                self.audit = None
            if self.egress is not None:
                self.egress.close()
            for fd in self.fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.fds.clear()
            for attr in ("pidfd", "init_pidfd"):
                fd = getattr(self, attr)
                if fd is not None:
                    os.close(fd)
                    setattr(self, attr, None)
            self.json_r = self.stdin_w = self.out_r = self.err_r = self.status_r = None
            if self.upper_fd is not None:
                # Interrupted before result() (an exception, a signal): what the program wrote is
                # kept as commit=True promises; otherwise it is dropped with the upper layer.
                try:
                    self.finish_cow(success=False)
                except LowlevelError as err:
                    if self.keep_close_error:
                        self.close_error = err
                    else:
                        log.warning("lowlevel: %s", err)
            for sock in (self.report, self.report_child):
                if sock is not None:
                    sock.close()
            self.report = self.report_child = None
            if self.lower_fd is not None:
                os.close(self.lower_fd)
                self.lower_fd = None
            if self.lease is not None:
                self.lease.release()
            if self.handover is not None and not self.handover.done:
                try:
                    self.give_back_workspace()
                except WorkspaceError as err:
                    log.warning("lowlevel: %s", err)
            if self.cgroup is not None:
                try:
                    # A ^C (KeyboardInterrupt) arriving mid-removal is held until the cgroup is
                    # gone (remove() is bounded: ~2 s at worst): raised there, it left the run's
                    # cgroup directories behind for as long as this process lives.
                    with deferred_interrupts():
                        self.cgroup.remove()
                except Exception as err:  # noqa: BLE001
                    log.warning("lowlevel: cannot remove cgroup: %s", err)


class _ExitUsage:
    """The part of an rusage the anchor's EXIT reports (``ru_maxrss``, KiB)."""

    __slots__ = ("ru_maxrss",)

    def __init__(self, ru_maxrss: int) -> None:
        self.ru_maxrss = ru_maxrss


def _pidfd_pid(pidfd: int | None) -> int | None:
    """The PID (in our namespace) a pidfd refers to (``Pid:`` of its fdinfo), or None."""
    if pidfd is None:
        return None
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pid:"):
                    pid = int(line.split()[1])
                    return pid if pid > 0 else None
    except (OSError, ValueError):
        pass
    return None


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (every thread's, ``/proc/PID/task/TID/children``; proc(5))."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                found.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def _ppid(pid: int) -> int | None:
    """The parent of ``pid`` (field 4 of ``/proc/PID/stat``, after the ``(comm)``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError):
        return None


__all__ = ["ANCHOR_GRACE_S", "DRAIN_TIMEOUT_S", "INIT_EXIT_TIMEOUT_S", "INIT_KILL_TIMEOUT_S", "Run", "SETUP_TIMEOUT_S",
           "drop_fresh_workspace"]
