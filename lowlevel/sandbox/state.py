"""The state of one run (:class:`RunState`): what :class:`lowlevel.sandbox.launcher.Run` holds.

A :class:`~lowlevel.sandbox.launcher.Run` is one class made of four layers, each in its module:
this state (the attributes, the :class:`Phase`, the owned-fd helpers), its workspace side
(:mod:`lowlevel.sandbox.run_workspace`), its preparation (:mod:`lowlevel.sandbox.prepare`), the
Result (:mod:`lowlevel.sandbox.finish`), and the process supervision itself
(:mod:`lowlevel.sandbox.launcher`). Also the bounded output capture (:class:`_Capture`).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket

from lowlevel import workspace as _ws
from lowlevel.errors import LowlevelError
from lowlevel.host import landlock as _landlock
from lowlevel.sandbox.argv import HostFacts
from lowlevel.sandbox.request import RunRequest
from lowlevel.spec.policy import Policy
from lowlevel.workspace import uids as _uids

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any


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

class _ExitUsage:
    """The part of an rusage the anchor's EXIT reports (``ru_maxrss``, KiB)."""

    __slots__ = ("ru_maxrss",)

    def __init__(self, ru_maxrss: int) -> None:
        self.ru_maxrss = ru_maxrss


class RunState:
    """The attributes of a run (set by :class:`lowlevel.sandbox.launcher.Run`'s constructor and
    :meth:`_init_state`), its phase, and the helpers that own its fds."""

    request: RunRequest
    command: list[str]
    stdio_fds: tuple[int | None, int | None, int | None]
    keep_workspace: bool
    policy: Policy
    commit: bool | str
    timeout: float | None
    stdin: bytes | None
    capture: bool
    cwd: str
    env_extra: dict[str, str]
    environment: dict[str, str]
    facts: HostFacts
    extra_fds: dict[int, int]
    inputs: list[Any]
    workspace_arg: str | os.PathLike[str] | None
    workspace_base: str | None
    allow_sensitive_workspace: bool
    one_shot: bool
    guard: bool

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
        self.egress: Any = None  # lowlevel.net.egress_run.EgressRun in egress mode
        # The anchor and the copy-on-write workspace.
        self.lease: _uids.UidLease | None = None
        self.host_ids: tuple[int, int] = (0, 0)
        self.cow = False
        self.lower_fd: int | None = None
        self.root_fd: int | None = None  # rootfs_writable over the anchor's overlay: the tree
        self.lower_stat: os.stat_result | None = None
        self.upper_fd: int | None = None
        self.upper_bytes = 0
        self.upper_dev_fd: int | None = None  # Limits.upper="disk": the loop device (lowlevel.workspace.disk_upper)
        self.mnt = ""
        self.cgroup_fds: list[int] = []
        self.cgroup_dir_fd: int | None = None
        self.report: socket.socket | None = None
        self.report_child: socket.socket | None = None
        self.since_ns = 0
        #: What this upper's commits left in the user's directory (a Session's: committed again
        #: after an interrupted commit; lowlevel.workspace.overlay.commits.commit(own_stamps=)).
        #: Emptied with the upper (reset_cow).
        self.own_stamps: dict[tuple[int, ...], int] = {}
        self.pass_fds: tuple[int, ...] = ()
        self.anchor_fds: dict[str, Any] = {}
        self.actions: list[tuple[Any, ...]] = []
        self.committed = False
        #: A run's upper had no entry once its sandbox was dead (RunWorkspace._final_changes): an
        #: empty upper is then looked at once (no change walk, and finish_cow makes no commit); a
        #: non-empty one is looked at again by the walk and the commit (a few us). None: not looked at.
        self.upper_empty: bool | None = None
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

    def _close_fd(self, attr: str) -> None:
        fd = getattr(self, attr)
        if fd is not None:
            os.close(fd)
            if fd in self.fds:
                self.fds.remove(fd)
            setattr(self, attr, None)

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


__all__ = ["Phase", "RunState", "log"]
