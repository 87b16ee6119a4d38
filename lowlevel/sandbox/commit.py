"""Commit a run's copy-on-write upper layer into its workspace, with one error model.

:func:`commit_run` applies what the run changed (:func:`lowlevel.workspace.overlay.commit_upper`,
the one commit path, which a Session's commit takes too) and turns every failure into
lowlevel's own errors, never a bare ``OSError``: a conflict with host
changes is :class:`~lowlevel.errors.CommitConflictError` (the upper layer saved aside), a
filesystem that took part of the changes :class:`~lowlevel.errors.CommitIncompleteError`, one that
took nothing (read-only, failing) a :class:`~lowlevel.errors.WorkspaceError` with the changes
saved aside. :meth:`lowlevel.sandbox.launcher.Run.finish_cow` calls it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator

from lowlevel import workspace as _ws
from lowlevel._dataclass import dataclass
from lowlevel.errors import CommitIncompleteError
from lowlevel.sandbox.result import Result
from lowlevel.spec.report import WARNING_PREFIX
from lowlevel.workspace import overlay as _overlay


@dataclass(frozen=True)
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
        own_stamps: a Session's record of what its earlier, interrupted commits of this upper
            left (:func:`lowlevel.workspace.overlay.commits.commit`'s ``own_stamps``), or None.
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
    own_stamps: dict[tuple[int, ...], int] | None = None


def conflict_dir(base: str | None) -> str:
    """A fresh directory (ours, 0700) to save a run's upper layer into after a commit conflict."""
    root = _ws.ensure_base(base or _ws.default_base())
    return tempfile.mkdtemp(prefix="conflict-", dir=root)


def commit_run(t: CommitTarget, result: Result | None, notes: list[str]) -> None:
    """Apply a run's upper layer to its workspace (:func:`lowlevel.workspace.overlay.commit_upper`,
    the one commit path with its one error model, shared with a Session); the commit's notes go
    to ``notes``, and an error carries the run's Result (``.result``).

    Raises:
        CommitConflictError: entries the run changed were also changed on the host during
            the run: nothing was applied (``.applied`` None), the upper layer was saved to the
            path the error gives, and ``.result`` holds the run's Result; or during the
            commit (``.applied`` set: the others were applied, ``.result.changes`` lists them).
        CommitIncompleteError: the workspace's filesystem could not take the changes (full,
            out of quota): what was applied is kept (``.result.changes``), the rest saved at
            ``.saved_upper``.
        WorkspaceError: the commit failed before applying anything (read-only, failing: each
            entry is old or new, never lost; the changes saved aside).
    """
    needed = t.needs_record
    if needed:
        try:
            needed = not _overlay.upper_is_empty(t.upper_fd)  # an empty upper writes no temporaries
        except OSError:
            pass  # commit_upper reports it as a WorkspaceError
    with commit_record(needed, t.name, t.workspace):
        _commit_run(t, result, notes)


def _commit_run(t: CommitTarget, result: Result | None, notes: list[str]) -> None:
    try:
        report = _overlay.commit_upper(t.upper_fd, t.lower_fd, xattr_prefix=t.xattr_prefix, since_ns=t.since_ns,
                                       new_owner=t.owner, upper_bytes=t.upper_bytes,
                                       accept_seen_host_changes=t.accept_seen_host_changes,
                                       own_stamps=t.own_stamps, save_to=lambda: conflict_dir(t.workspace_base),
                                       keep_upper=False)
    except (CommitIncompleteError, _overlay.CommitConflictError) as err:
        # The Result then lists what was applied, never what was not (a conflict found before
        # the apply pass applied nothing: err.applied None).
        _applied_only(result, err.applied, notes)
        err.result = result
        raise
    notes.extend(report.notes)


@contextlib.contextmanager
def commit_record(needed: bool, name: str, workspace: str | None) -> Iterator[None]:
    """While a commit runs, a run record naming its workspace when ``needed`` (the run or
    session has no cgroup record: an unprivileged caller without a writable cgroup), so
    ``lowlevel cleanup`` finds the commit's temporaries if the caller dies mid-way
    (:mod:`lowlevel.host.run_records`). Found by the caller-kill trials: 42 of 42 such kills of
    a run, and 2 of 24 of a Session during its commit, left them to ``cleanup --workspace``."""
    from lowlevel.host import run_records as _run_records
    record = _run_records.write(name, [], workspace) if needed and workspace else None
    try:
        yield
    finally:
        _run_records.remove(record)


def _applied_only(result: Result | None, applied: _ws.Changes | None, notes: list[str]) -> None:
    """A commit that did not complete: ``result.changes`` becomes what it applied."""
    if result is not None and applied is not None:
        result.changes = dataclasses.replace(applied, complete=result.changes.complete)
        notes.append(f"{WARNING_PREFIX}the commit did not complete: Result.changes lists only what was "
                     "applied to the workspace")
        result.notes = tuple(notes)


__all__ = ["CommitTarget", "commit_record", "commit_run", "conflict_dir"]
