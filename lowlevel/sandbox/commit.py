"""Commit a run's copy-on-write upper layer into its workspace, with one error model.

:func:`commit_upper` applies what the run changed (:func:`lowlevel.workspace.overlay.commit`) and
turns every failure into lowlevel's own errors, never a bare ``OSError``: a conflict with host
changes is :class:`~lowlevel.errors.CommitConflictError` (the upper layer saved aside), a
filesystem that took part of the changes :class:`~lowlevel.errors.CommitIncompleteError`, one that
took nothing (read-only, failing) a :class:`~lowlevel.errors.WorkspaceError` with the changes
saved aside. :meth:`lowlevel.sandbox.launcher.Run.finish_cow` calls it; a Session's commit can.
"""

from __future__ import annotations

import dataclasses
import errno
import tempfile

from lowlevel import workspace as _ws
from lowlevel.errors import CommitIncompleteError, LowlevelError, WorkspaceError
from lowlevel.sandbox.result import Result
from lowlevel.spec.report import WARNING_PREFIX
from lowlevel.workspace import cow as _cow
from lowlevel.workspace import overlay as _overlay


@dataclasses.dataclass(frozen=True)
class CommitTarget:
    """What a commit reads and writes.

    Attributes:
        upper_fd, lower_fd: the upper layer and the workspace (directory fds, not closed here).
        xattr_prefix: overlayfs's xattr namespace in the upper (``trusted.overlay.`` for root).
        since_ns: when the run (or the upper layer) started: host changes after it conflict.
        upper_bytes: the upper layer's bound, bytes (the commit's byte budget derives from it).
        workspace, workspace_base: the workspace's path and where conflict copies go.
        accept_seen_host_changes: a Session's rule (a host change the sandbox saw is no conflict).
        owner: ``(uid, gid)`` the new entries get (a root caller's workspace owner), or None.
        needs_record: no cgroup record names the workspace: write a run record for the commit,
            so ``lowlevel cleanup`` finds its temporaries if this process dies mid-way.
        name: the run record's name.
    """

    upper_fd: int
    lower_fd: int
    xattr_prefix: str
    since_ns: int
    upper_bytes: int
    workspace: str
    workspace_base: str | None
    accept_seen_host_changes: bool
    owner: tuple[int, int] | None
    needs_record: bool
    name: str


def conflict_dir(base: str | None) -> str:
    """A fresh directory (ours, 0700) to save a run's upper layer into after a commit conflict."""
    root = _ws.ensure_base(base or _ws.default_base())
    return tempfile.mkdtemp(prefix="conflict-", dir=root)


def commit_upper(t: CommitTarget, result: Result | None, notes: list[str]) -> None:
    """Apply the upper layer to the workspace; the commit's notes go to ``notes``.

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
    # A run without a cgroup record (an unprivileged caller here: no writable cgroup) records
    # its workspace for the commit, so `lowlevel cleanup` finds the commit's temporaries if
    # this caller dies mid-way (lowlevel.host.run_records; found by the caller-kill trials: 42
    # of 42 such kills left them to `cleanup --workspace` only).
    from lowlevel.host import run_records as _run_records
    commit_record = _run_records.write(t.name, [], t.workspace) if t.needs_record else None
    budget = _cow.commit_budget(t.upper_bytes)
    try:
        report = _overlay.commit(t.upper_fd, t.lower_fd, xattr_prefix=t.xattr_prefix, since_ns=t.since_ns,
                                 new_owner=t.owner, max_bytes=budget,
                                 accept_seen_host_changes=t.accept_seen_host_changes,
                                 save_to=lambda: conflict_dir(t.workspace_base))
    except CommitIncompleteError as err:
        applied = err.applied
        if err.errno not in _overlay.NO_ROOM_ERRNOS and applied is not None and \
                not (applied.added or applied.modified or applied.deleted):
            # Nothing applied, the filesystem unwritable (read-only, failing) rather than
            # full: as any commit failing before it changes anything, result() makes it
            # a warning that keeps the exit status (the changes were saved aside).
            raise WorkspaceError(err.errno or errno.EIO, str(err)) from err
        # Stopped part-way, or out of room: saved aside by commit() itself. The Result
        # then lists what was applied, never what was not.
        _applied_only(result, err.applied, notes)
        err.result = result
        raise
    except _overlay.CommitConflictError as err:
        if err.applied is not None:  # found during the apply pass: saved by commit()
            _applied_only(result, err.applied, notes)
            err.result = result
            raise
        try:
            saved = _overlay.save_upper(t.upper_fd, conflict_dir(t.workspace_base), xattr_prefix=t.xattr_prefix,
                                        owner=t.owner, max_bytes=budget)
            err.saved_upper = saved
            err.args = (err.args[0], f"{err.args[1]}; the run's changes were saved to {saved}")
        except (OSError, LowlevelError) as save_err:
            err.args = (err.args[0], f"{err.args[1]}; saving the run's changes failed too: {save_err}")
        err.result = result
        raise
    except OSError as err:
        raise _unwritable(t, err, budget) from err
    finally:
        _run_records.remove(commit_record)
    notes.extend(report.notes)


def _unwritable(t: CommitTarget, err: OSError, budget: int) -> WorkspaceError:
    """A read-only or full workspace: never a bare OSError (result() turns this into a warning
    that keeps the exit status); the run's changes are saved aside first."""
    why = f"cannot write the run's changes into the workspace: {err.strerror or err}"
    kept: str | None = None
    try:
        kept = _overlay.save_upper(t.upper_fd, conflict_dir(t.workspace_base), max_bytes=budget)
        why += f"; they were saved to {kept}"
    except (OSError, LowlevelError) as save_err:
        why += f"; saving them failed too: {save_err}"
    failed = WorkspaceError(err.errno or errno.EIO, why)
    failed.saved_upper = kept
    return failed


def _applied_only(result: Result | None, applied: _ws.Changes | None, notes: list[str]) -> None:
    """A commit that did not complete: ``result.changes`` becomes what it applied."""
    if result is not None and applied is not None:
        result.changes = dataclasses.replace(applied, complete=result.changes.complete)
        notes.append(f"{WARNING_PREFIX}the commit did not complete: Result.changes lists only what was "
                     "applied to the workspace")
        result.notes = tuple(notes)


__all__ = ["CommitTarget", "commit_upper", "conflict_dir"]
