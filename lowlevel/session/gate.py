"""The session's workspace while it lives: its view, its diff, and the gate of commit and reset.

One concept: the workspace gate. ``commit()`` and ``reset()`` replace the overlay's upper layer (the
anchor stacks a fresh one: ``native/lowlevel_exec.c``, RESET), and a process that lives
across that keeps its cwd and its Landlock rule in the old layer: what it writes there
afterwards is in no commit, and ``/workspace`` fails for it (EACCES under Landlock, which
ignores a rule on a covered mount point; ESTALE once that layer is unmounted). So a commit or
reset is *exclusive*: :meth:`begin_exclusive` closes the gate (new commands wait:
:class:`HeldError`), the driver waits until the commands in flight have ended (their EXIT comes
after the shepherd killed their whole tree: nothing of theirs writes afterwards), the
operation runs (:meth:`exclusive_op`, under ``ws_lock``), and the gate reopens.
Background commands (``Session.start``) are refused, waited for, or left in the old
layer, as the caller's ``running=`` says (:meth:`check_background`).

The gate is part of the core (:class:`lowlevel.session.core.Core` inherits
:class:`WorkspaceGate`); its waits are the drivers' (:mod:`lowlevel.session.sync`,
:mod:`lowlevel.session.aio`), which catch :class:`HeldError`.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence

from lowlevel import workspace as _ws
from lowlevel.errors import (CommitIncompleteError, LaunchError, PolicyError, SessionError, UnsupportedError,
                             WorkspaceError)
# A private name of lowlevel.sandbox.launcher (its engineer is reshaping it): where a commit's
# conflicting changes are saved.
from lowlevel.sandbox.commit import commit_record
from lowlevel.sandbox.commit import conflict_dir as _conflict_dir
from lowlevel.sandbox.launcher import Run
from lowlevel.session.command import Command
from lowlevel.session.phase import Phase
from lowlevel.spec.policy import WORKSPACE_DEST
from lowlevel.workspace import overlay as _overlay


class HeldError(Exception):
    """Internal: a commit()/reset() holds the session's commands; wait for the gate, then retry.

    Raised by :meth:`Core.submit` and :meth:`Core.begin_exclusive`; the drivers catch it
    (:meth:`Session.run`, :meth:`AsyncSession.run`...), never the caller."""


#: The ``running=`` values of Session.commit()/reset(): what to do with background commands.
RUNNING_CHOICES = ("refuse", "wait", "leave")


def check_running(running: object) -> str:
    """``running`` if it is one of :data:`RUNNING_CHOICES`.

    Raises:
        PolicyError: it is not.
    """
    if not isinstance(running, str) or running not in RUNNING_CHOICES:
        raise PolicyError(f"running must be one of {', '.join(map(repr, RUNNING_CHOICES))}, got {running!r}")
    return running


class WorkspaceGate:
    """The workspace part of :class:`lowlevel.session.core.Core` (see the module docstring)."""

    # Set by Core, of which this is a part.
    run: Run
    lock: threading.Lock
    phase: Phase
    failed: SessionError | None
    cmds: dict[int, Command]
    init_host_pid: int | None
    _death_message: Callable[[], str]
    _fail_locked: Callable[[str, str], None]

    def _init_gate(self) -> None:
        """The gate's state, open (call once ``self.lock`` exists: the gate's condition uses it)."""
        #: The workspace gate (see the module docstring): the operation holding it ("commit",
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

    def view(self) -> str:
        """The live workspace as the commands see it (``/proc/PID/root/workspace`` of the init),
        or the host directory once the session is over (or without the overlay)."""
        r = self.run
        if r.cow and self.phase is Phase.OPEN and self.init_host_pid is not None:
            return f"/proc/{self.init_host_pid}/root{WORKSPACE_DEST}"
        return r.workspace

    def _need_cow(self, what: str) -> None:
        if not self.run.cow:
            raise UnsupportedError("overlay", f"Session.{what}() needs the copy-on-write workspace, which this "
                                   f"host cannot provide: {'; '.join(self.run.notes)}")
        if self.phase is not Phase.OPEN:
            raise self.failed or SessionError("the session is closed", "closed")

    def diff(self) -> _ws.Changes:
        self._need_cow("diff")
        with self.ws_lock:
            self._need_cow("diff")
            return self.run.read_changes()

    def begin_exclusive(self, what: str) -> None:
        """Close the gate for ``what`` ("commit", "reset"): commands submitted from now on wait.

        Raises:
            HeldError: another commit()/reset() holds the gate (wait for it, then call again).
            UnsupportedError, SessionError: as :meth:`_need_cow`.
        """
        self._need_cow(what)
        with self.lock:
            if self.failed is not None:
                raise self.failed
            if not self.gate_free():
                raise HeldError()
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

    def check_background(self, what: str, running: str) -> list[Command]:
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

    def exclusive_op(self, what: str, left: Sequence[Command]) -> _ws.Changes | None:
        """Run the commit or reset that holds the gate, then reopen it (in every case).

        ``what``: "commit", "reset", or "final" (a commit without the fresh layer after it:
        the last workspace operation of a sandbox that serves no more commands, a Pool's).
        ``left``: background commands left running in the old layer (``running="leave"``):
        their Results say so in ``notes``. Returns the commit's changes (None for a reset).
        """
        try:
            with self.ws_lock:
                self._need_cow(what)
                try:
                    out = self._commit(reset=what == "commit") if what in ("commit", "final") else None
                    if what == "reset":
                        self.run.reset_cow()
                except LaunchError as err:
                    if err.errno not in (errno.EPIPE, errno.ECONNRESET):
                        raise
                    raise self._sandbox_gone(what) from err
            note = (f"this command ran across a Session.{what}() (running='leave'): it kept the old view of "
                    "/workspace, and what it wrote there afterwards is in no commit")
            for cmd in left:
                if note not in cmd.notes:
                    cmd.notes = cmd.notes + (note,)
            return out
        finally:
            self.end_exclusive()

    def _sandbox_gone(self, what: str) -> SessionError:
        """The error of a commit or reset whose sandbox died under it (the anchor's socket closed:
        bwrap, the anchor or the init was killed): the session is failed, and says why."""
        applied = f"the changes were applied to {self.run.workspace}, but " if what in ("commit", "final") else ""
        with self.lock:
            self._fail_locked(f"Session.{what}(): {applied}the sandbox is gone: {self._death_message()}", "init_died")
        assert self.failed is not None
        return self.failed

    def _commit(self, reset: bool = True) -> _ws.Changes:
        """Apply the upper layer to the directory; then stack a fresh layer (``reset``), or, for
        the final commit, mark the run committed: its close must not apply the same upper again
        (it would meet its own applied entries as host changes)."""
        r = self.run
        if r.upper_fd is None or r.lower_fd is None:
            return _ws.Changes()  # what read_changes() gives there: nothing to apply
        owner = (r.lower_stat.st_uid, r.lower_stat.st_gid) if r.facts.caller_is_root and r.lower_stat else None
        if r.policy.limits.upper == "disk":
            from lowlevel.workspace.disk_upper import check_writeback
            try:
                check_writeback(r.upper_fd)  # a full host disk lost some writes: commit none of them
            except WorkspaceError:
                r.reset_cow()  # a second commit() would find no error and apply the corrupt layer
                raise
        try:
            with commit_record(r.cgroup is None or r.cgroup.record is None, f"commit-{id(r):x}", r.workspace):
                report = _overlay.commit_upper(r.upper_fd, r.lower_fd, xattr_prefix=r.xattr_prefix,
                                               since_ns=r.since_ns, new_owner=owner, upper_bytes=r.upper_bytes,
                                               accept_seen_host_changes=True, own_stamps=r.own_stamps,
                                               save_to=lambda: _conflict_dir(r.workspace_base), keep_upper=True)
        except (CommitIncompleteError, _overlay.CommitConflictError) as err:
            if err.applied is not None:
                # Stopped part-way (a full disk) or host writes met during the apply pass: what
                # was applied is in the directory, the rest saved at err.saved_upper. The
                # session goes on over the directory as it now is: a second commit of the same
                # upper would meet its own applied entries as host changes.
                self._after_commit(reset)
            raise
        r.notes.extend(report.notes)
        self._after_commit(reset)
        return report.changes

    def _after_commit(self, reset: bool) -> None:
        r = self.run
        if reset:
            r.reset_cow()
            return
        # The final commit: the run is committed (its close() must not apply the upper again) and
        # the upper's fd is released now; the layer itself goes with the sandbox.
        r.committed = True
        if r.upper_fd is not None:
            os.close(r.upper_fd)
            r.upper_fd = None
