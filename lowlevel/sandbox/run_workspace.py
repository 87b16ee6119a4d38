"""A run's workspace side: resolve and open the workspace, the hand-over fallback, read the
copy-on-write upper layer's changes, commit or discard them (:mod:`lowlevel.sandbox.commit`),
reset a live sandbox's layer (a Session), and remove a disposable workspace.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket
import time

from lowlevel import workspace as _ws
from lowlevel.errors import LaunchError, LowlevelError, UnsupportedError, WorkspaceError
from lowlevel.paths import unreachable
from lowlevel.sandbox import bind_sockets as _bind_sockets
from lowlevel.sandbox._interrupts import deferred_interrupts
from lowlevel.sandbox.argv import static_args
from lowlevel.sandbox.commit import CommitTarget, commit_run
from lowlevel.sandbox.result import Result
from lowlevel.sandbox.state import RunState, log
from lowlevel.spec.report import WARNING_PREFIX
from lowlevel.workspace import overlay as _overlay

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from collections.abc import Callable, Iterable
    from typing import Any


def drop_fresh_workspace(result: Result, note: str = "workspace removed after the run "
                         "(keep_workspace=False)") -> Result:
    """Remove ``result.workspace`` (a fresh one: the caller checked) and say so in the notes;
    a failure to remove is a note too, never an exception that would lose the Result."""
    try:
        _ws.remove_workspace(result.workspace)
    except (OSError, LowlevelError) as err:
        note = f"keep_workspace=False: could not remove {result.workspace}: {err}"
    return dataclasses.replace(result, notes=(*result.notes, note))


def fresh_workspace(inputs: Iterable[Any], base: str | None, *, disposable: bool, own: Callable[[str], None],
                    check: Callable[[str], None] | None = None) -> str:
    """A fresh workspace (:func:`lowlevel.workspace.create_workspace`) handed to ``own`` in the
    same step, under :class:`deferred_interrupts`: a signal handler's exception between the mkdir
    and its record left the workspace to ``lowlevel cleanup`` (bench/kill_campaign.py ``cli_rm``:
    1 in 30 trials of ``lowlevel run --rm``). Then ``inputs`` are copied in and ``check`` runs,
    both interruptible (the copies may take long): on any failure, an interrupt too, the
    workspace is removed, ``own("")`` called and the error raised (all or nothing).

    Returns:
        The workspace's path.
    Raises:
        WorkspaceError: from :func:`~lowlevel.workspace.create_workspace` or
            :func:`~lowlevel.workspace.copy_inputs`; and what ``check`` raises.
    """
    with deferred_interrupts():
        path = _ws.create_workspace((), base, disposable=disposable)
        own(path)
    try:
        _ws.copy_inputs(path, inputs)
        if check is not None:
            check(path)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        own("")
        raise
    return path


class RunWorkspace(RunState):
    """The workspace side of a run (see the module docstring)."""

    def _resolve_workspace(self) -> None:
        if self.workspace_arg is not None:
            ws = os.path.abspath(os.fspath(self.workspace_arg))
            missing = unreachable(ws)
            if missing is not None:
                code, why = missing
                raise WorkspaceError(code, f"workspace {ws} {why}" + (": create it or omit it to get a fresh "
                                     "per-run workspace" if code == errno.ENOENT else ""))
            if os.path.islink(ws):
                raise WorkspaceError(errno.ENOTDIR, f"workspace {ws} is a symbolic link (to "
                                     f"{os.readlink(ws)!r}), which is not followed: pass the directory "
                                     "it names itself")
            if not os.path.isdir(ws):
                raise WorkspaceError(errno.ENOTDIR, f"workspace {ws} is not a directory")
            self.workspace = os.path.realpath(ws)
            # Inputs are copied in by path: that needs parents nobody else can rename. Without
            # inputs the workspace is opened once, by fd (_open_lower), and never walked again.
            _ws.check_workspace_path(self.workspace, allow_sensitive=self.allow_sensitive_workspace,
                                     check_ancestors=bool(self.inputs), writable=self.commit is not False)
            if self.inputs:
                _ws.copy_inputs(self.workspace, self.inputs)
        else:
            fresh_workspace(self.inputs, self.workspace_base, disposable=not self.keep_workspace,
                            own=self._own_fresh, check=_ws.check_trusted_ancestors)

    def _own_fresh(self, path: str) -> None:
        """:func:`fresh_workspace`'s record: the fresh workspace is this run's (``""``: none)."""
        self.workspace, self.owns_workspace = path, bool(path)

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
            if self.policy.limits.upper == "disk":
                from lowlevel.workspace.disk_upper import check_writeback
                check_writeback(self.upper_fd)  # a full host disk lost some of the run's writes: refuse
            if self.upper_empty:
                return  # an upper with no entry is no commit (commit_upper would return at once)
            target = CommitTarget(
                upper_fd=self.upper_fd, lower_fd=self.lower_fd, xattr_prefix=self.xattr_prefix,
                since_ns=self.since_ns, upper_bytes=self.upper_bytes, workspace=self.workspace,
                workspace_base=self.workspace_base, accept_seen_host_changes=self.accept_seen_host_changes,
                owner=(self.lower_stat.st_uid, self.lower_stat.st_gid) if self.facts.caller_is_root else None,
                needs_record=self.cgroup is None or self.cgroup.record is None, name=f"commit-{id(self):x}",
                own_stamps=self.own_stamps or None)  # a Session's final commit after an interrupted one
            commit_run(target, result, self.notes)
        finally:
            if self.policy.limits.upper == "disk":
                from lowlevel.workspace.disk_upper import close_later
                # The unmount and the loop device's clear, off the caller's path and the anchor's exit.
                close_later(self.upper_fd, None if self.anchor_reaped else self.pid)
            else:
                os.close(self.upper_fd)
            self.upper_fd = None

    def reset_cow(self, timeout_s: float = 10.0) -> None:
        """Drop the upper layer of a live sandbox (a Session): /workspace is the lower tree again.

        The old upper's content is removed here first, to free its share of the bound; then the
        anchor stacks a fresh overlay on the workspace (the mount propagates into the sandbox:
        no cached view of the cleared layer is left) and removes the old layer's directories.
        In that order, a RESET finds the bound's inodes free for the new layer's directories
        (a session that had used them all could not commit: "mkdir upper.N: No space left on
        device", after the commit had applied), and no old layer keeps any of them.

        Raises:
            LaunchError: the anchor refused or did not answer within ``timeout_s``, or is gone
                (``errno`` EPIPE or ECONNRESET: the sandbox was killed); the old layer is cleared
                all the same (a commit had applied it; a reset drops it).
            KeyboardInterrupt (a signal handler's exception) arriving during the RESET round
                trip: held until the new layer is in force, the old one's fd closed and the commit
                baseline (``since_ns``, ``own_stamps``) moved to it, then raised.
        """
        if self.report is None or not self.cow:
            raise LaunchError("this sandbox has no copy-on-write workspace to reset")
        if self.upper_fd is not None:
            try:
                _overlay.clear_dir(self.upper_fd)
            except WorkspaceError as err:
                # A command left running across the reset (running="leave") can keep writing
                # into the old layer (its cwd is there) while it is cleared: the reset stands;
                # what it writes there is in no later diff or commit, and goes with the sandbox.
                log.info("lowlevel: the dropped upper layer is still being written to: %s", err)
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
            if not msg and not fds:  # EOF: the anchor is gone, and the sandbox with it
                raise LaunchError("resetting the workspace failed: the sandbox's anchor closed its socket (the "
                                  "sandbox is gone)", errno=errno.EPIPE)
            if not msg.startswith(b"RESET_OK") or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise LaunchError("resetting the workspace failed: "
                                  + msg.decode("utf-8", "replace").removeprefix("RESET_ERR ").strip())
            old, self.upper_fd = self.upper_fd, self._own(fds[0])
            self.fds.remove(self.upper_fd)
            # In the block too: a ^C raised at its end skipped them (the old upper's fd stayed open
            # for the session's life, and the next commit compared the host's entries with stamps
            # and a time of the dropped layer).
            self.since_ns = time.time_ns()
            self.own_stamps.clear()
            if old is not None:
                os.close(old)

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

    def _final_changes(self) -> _ws.Changes:
        """What the run changed: the upper layer's entries, or the hand-over's snapshot diff."""
        if self.cow:
            if self.upper_fd is not None and self.lower_fd is not None:
                try:
                    self.upper_empty = _overlay.upper_is_empty(self.upper_fd)
                except OSError:
                    pass  # read_changes reports it as a WorkspaceError
                if self.upper_empty:
                    return _ws.Changes()  # nothing written: no walk, and finish_cow no commit
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


__all__ = ["RunWorkspace", "drop_fresh_workspace"]
