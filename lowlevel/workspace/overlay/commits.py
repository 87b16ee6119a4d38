"""Committing a run's upper directory into the user's directory: :func:`commit` and the one
commit path of runs and sessions, :func:`commit_upper`.

How :func:`commit` works:

Order: take an exclusive ``flock`` on the user's directory (commits to one directory are
serialised), remove dead commits' leftovers (:func:`cleanup_commit_leftovers`), then a
dry pass over the upper that changes nothing: it finds conflicts, checks the byte budget
and decides what is skipped; then the apply pass.

Conflicts: every lower entry the commit would replace, delete or chmod, and every entry
below a lower directory it would delete or replace, must have ``st_ctime_ns <= since_ns``
(unchanged on the host since the run started); otherwise :class:`CommitConflictError`
and nothing is changed. With ``accept_seen_host_changes=True``, for overlays mounted by
root, an entry the run copied up *after* the host changed it (``trusted.overlay.origin``
holds the lower inode's file handle, it matches ``name_to_handle_at`` of the entry, and
the lower ctime is <= the upper entry's birth time, statx ``stx_btime``) is no conflict:
the run worked on the host's version and nothing of the host's is lost (a file the host
writes into a live Session's directory, then the program edits). ``userxattr``
overlays record no handle (empty origin), and a deleted or newly created entry proves
nothing about what the run saw, so those keep the plain rule. The window: ext4, tmpfs,
xfs and btrfs stamp ctime from a coarse clock (one timer tick: 4 ms at ``CONFIG_HZ=250``;
measured lag up to 2.2 ms here) unless the inode's ctime was read since its last change
(multigrain timestamps, Linux 6.13+). A host change made in the first tick after
``since_ns`` (or, with ``accept_seen_host_changes``, in the tick of the copy-up) may
therefore go unnoticed; any later change is seen. A file the host deleted during the run
that the run modified is re-created (not a conflict: nothing is overwritten).

Host changes during the commit itself (the apply pass): each entry is checked when the
walk reaches it (against the dry pass), and again right before it is replaced or deleted
(device, inode, mode, ctime, mtime, size); a regular file is also leased for that moment
(a read lease, ``F_SETLEASE F_RDLCK``, fcntl(2): refused while a host process has it open
for writing, which is then a conflict; an open(2) for writing or a truncate(2) by another
process waits until the lease is let go). The
replacement is a ``renameat2(RENAME_EXCHANGE)``; the entry swapped out is checked once
more (inode, mtime, size, lease unbroken; a directory's whole subtree: no ctime after
``since_ns``) and swapped back if the host touched it; a deletion is a rename out of
sight, checked, and renamed back the same way. An entry found changed is left as the
host made it: after the apply pass, :class:`CommitConflictError` lists those entries
(``.applied`` says what was applied; the other entries were applied and are kept), with
the run's changes saved aside. Not caught: a host process that already resolved the
path before the swap and is preempted between that lookup and the lease check inside
open(2) (a kernel window of microseconds); where leases are unavailable (a symlink, a
filesystem without them, a file not the caller's without CAP_LEASE), a write through a
descriptor opened before the swap that lands after the last check (as with any
rename-based save, e.g. an editor's).

Out of room (ENOSPC, EDQUOT, EFBIG) or unwritable (EROFS, EIO) during the apply pass:
the pass stops at that entry; what it applied is kept (every entry old or new, the
temporaries removed: nothing is rolled back) and :class:`CommitIncompleteError` is
raised with the run's changes saved aside.

Saved aside (a late conflict, a stop): :func:`save_upper` of the whole upper into
``save_to()`` (default: a fresh ``conflict-*`` directory under
:func:`lowlevel.workspace.default_base`), plus its ``applied`` and ``not-applied`` lists
(:data:`SAVED_APPLIED`, :data:`SAVED_NOT_APPLIED`); the error's ``saved_upper`` names it
(None, and the message says so, when that save failed too).

Applying, per upper entry (paths as in :func:`read_changes`):

- file: content copied (``sendfile``, data extents only: holes stay holes) into
  ``.lowlevel-commit-<pid>-<n>`` in the target
  directory, then ``rename(2)`` over the old name (``renameat2(RENAME_NOREPLACE)`` for a
  new name, ``RENAME_EXCHANGE`` when a directory is on either side, the old one then
  removed): every path is old or new at every instant, never missing. A replaced file's
  other hard links keep the old content (noted).
- symlink: recreated with its target text, never followed.
- new directory: built completely under a temporary name, then renamed into place. An
  existing directory is updated in place (its mode last, or first when the new mode is
  what lets a caller that is not root write into it); an opaque one also loses the lower
  entries absent from the upper.
- whiteout: the lower entry is unlinked; a directory is first renamed to a temporary
  name, then removed.
- fifo, socket, device, a name starting with ``.lowlevel-commit-``: skipped (noted).
- hard links between new files become hard links (up to MAX_LINKED inodes); a link
  between a new file and a replaced one becomes a copy.
- depth: directories more than MAX_DEPTH levels down are skipped.

Metadata: a replaced entry keeps its owner and group and POSIX ACLs (owners of the
user's files are never changed); a new entry gets ``new_owner``. Permission bits come
from the upper minus setuid/setgid, minus ``o+w`` unless the old entry had it (a
directory's setgid bit stays as it was, or as mkdir inherited it). ``user.*`` xattrs
are copied except ``user.overlay.*``; ``trusted.*``, ``security.*`` and the upper's ACLs
never are. mtime and atime come from the upper (directories updated in place keep theirs).
The upper root's own metadata is never applied.

Interruption: killed at any instant (SIGKILL included) every entry of the user's
directory is old or new, none missing, none re-owned; leftovers carry the
``.lowlevel-commit-<pid>-`` names and :func:`cleanup_commit_leftovers` (run by the next
commit) removes them. KeyboardInterrupt or any other exception removes the temporaries
before propagating. The commit is atomic per entry, not as a whole. Committing the same upper
again completes an interrupted commit: a user's file or symlink that already is exactly what this
commit would make of the upper's entry (a file's bytes, size, mtime to the nanosecond, permission
bits and ``user.*`` xattrs; a symlink's target and mtime) is no conflict whatever its ctime, and is
left as it is (writing it again would lose nothing of the host's, but costs a copy). With
``own_stamps`` (a Session's commits), so is an entry the first pass left that the run changed again
before the second commit: the first pass recorded the state it left each entry in (device, inode,
mode, ctime, mtime, size: an entry placed, every entry of a new directory, and each existing
directory whose entries it changed, the last only while its mode and owner are as the commit
knows them), and an entry still in that state was changed by nobody since; any host change moves
its ctime (with multigrain timestamps, Linux 6.13+, to a value no earlier change had: the state
was read; before 6.13, ctimes have a timer tick's granularity, 1-10 ms, and a host change in the
same tick as the commit's read of the entry that keeps its mode, mtime and size leaves the same
stamp). An entry is read right after its rename, even while an interrupt propagates; only a
second interrupt there leaves the one entry known by all of it but the ctime the rename changed
(and its owner), and then for at most ``LOOSE_HORIZON_NS`` (50 ms) after the rename: a host change
to it in those milliseconds that keeps mode, mtime, size and owner (an xattr set, a hard link, a
same-size rewrite with the mtime put back) is taken for the commit's. Still a conflict after an
interrupt: a directory whose entries changed in the instant between the change and the read of
its state (an interrupt there), the host's changes, and, without ``own_stamps``, an entry changed
again by the run. Found by a red-team pass: without the bound, the loose stamp of an interrupted
rename matched that inode at any later ctime, under any name, until the next commit.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
from collections.abc import Callable

from lowlevel.errors import CommitConflictError, CommitIncompleteError, LowlevelError, WorkspaceError
from lowlevel.workspace.changes import Changes
from lowlevel.workspace.cow import commit_budget
from lowlevel.workspace.overlay.apply import Applier, CommitReport
from lowlevel.workspace.overlay.fdops import _DIR_FLAGS
from lowlevel.workspace.overlay.leftovers import cleanup_commit_leftovers
from lowlevel.workspace.overlay.save import SAVED_APPLIED, SAVED_NOT_APPLIED, _write_list, save_upper
from lowlevel.workspace.overlay.state import STOP_ERRNOS, Stamps, _check_owner
from lowlevel.workspace.overlay.upper import _check_prefix, upper_is_empty

#: Those of STOP_ERRNOS that mean "out of room": a run's commit stopped by one always raises
#: (lowlevel.sandbox.launcher; a read-only workspace where nothing was applied is a warning instead).
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _lock(lower_fd: int) -> int:
    """An exclusive flock(2) on a new open file description of the user's directory: commits
    to one directory (from any process) run one after another."""
    fd = os.open(".", _DIR_FLAGS, dir_fd=lower_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _incomplete(work: Applier, report: CommitReport, stopped: OSError | None, upper_fd: int, *,
                save_to: Callable[[], str] | None, xattr_prefix: str, owner: tuple[int, int] | None,
                max_bytes: int | None) -> WorkspaceError:
    """The error for an apply pass that stopped (``stopped``) or met host changes
    (``work.late``): the run's changes saved aside with the lists of what was and was not
    applied (see :func:`commit`)."""
    applied = report.changes
    done = set(applied.added) | set(applied.modified) | set(applied.deleted)
    late = tuple(sorted(set(work.late)))
    planned = set(itertools.chain(*work.planned_changes)) | set(late)
    not_applied = tuple(sorted(p for p in planned if p not in done))
    saved: str | None = None
    try:
        if save_to is not None:
            dest = save_to()
        else:
            import tempfile

            from lowlevel.workspace.create import default_base, ensure_base
            dest = tempfile.mkdtemp(prefix="conflict-", dir=ensure_base(default_base()))
        saved = save_upper(upper_fd, dest, xattr_prefix=xattr_prefix, owner=owner, max_bytes=max_bytes)
        dfd = os.open(saved, _DIR_FLAGS)
        try:
            _write_list(dfd, SAVED_APPLIED, b"".join(os.fsencode(p) + b"\0" for p in sorted(done)), owner)
            _write_list(dfd, SAVED_NOT_APPLIED, b"".join(os.fsencode(p) + b"\0" for p in not_applied), owner)
        finally:
            os.close(dfd)
        where = (f"the run's changes were saved to {saved} ({len(not_applied)} not applied, listed in its "
                 f"{SAVED_NOT_APPLIED!r} file)")
    except (OSError, LowlevelError, ValueError) as err:
        where = f"saving the run's changes failed too ({err}): the {len(not_applied)} entries not applied are lost"
    shown = ", ".join(repr(p) for p in late[:5]) + (f" and {len(late) - 5} more" if len(late) > 5 else "")
    if stopped is not None:
        what = os.strerror(stopped.errno) if stopped.errno else str(stopped)
        at = f" writing {stopped.filename!r}" if stopped.filename else ""
        msg = (f"commit stopped part-way: {what}{at} in the workspace; {len(done)} of the run's {len(planned)} "
               "changed entries were applied and are kept (each entry is old or new, no temporaries are left), "
               f"the rest were not" + (f"; {len(late)} changed on the host meanwhile ({shown})" if late else "")
               + f"; {where}")
        return CommitIncompleteError(stopped.errno or errno.EIO, msg, applied=applied, not_applied=not_applied,
                                     saved_upper=saved, conflicts=late)
    msg = (f"commit: {len(late)} entr{'y' if len(late) == 1 else 'ies'} of the workspace changed on the host during "
           f"the commit ({shown}): left as the host made them, the run's version not applied; the run's other "
           f"{len(done)} changed entries were applied and are kept; {where}")
    conflict = CommitConflictError(late, msg, saved_upper=saved)
    conflict.applied = applied
    conflict.not_applied = not_applied
    return conflict


def commit(upper_fd: int, lower_fd: int, *, xattr_prefix: str, since_ns: int,
           new_owner: tuple[int, int] | None, max_bytes: int | None = None,
           accept_seen_host_changes: bool = False, save_to: Callable[[], str] | None = None,
           own_stamps: Stamps | None = None) -> CommitReport:
    """Apply a run's upper directory to the user's directory, treating the upper as untrusted.

    How it works (order, conflicts, host changes during the commit, out of room, what is
    applied and how, interruption): see the module docstring.

    Args:
        upper_fd: ``O_DIRECTORY`` fd on the run's upper directory (only read).
        lower_fd: ``O_DIRECTORY`` fd on the user's directory (the host's view, not the
            overlay's lower mount).
        xattr_prefix: ``"trusted.overlay."`` or ``"user.overlay."``, as the overlay was mounted.
        since_ns: ``time.time_ns()`` taken just before the sandbox started (ns since the epoch).
        new_owner: ``(uid, gid)`` for new entries (root callers: the workspace root's owner);
            None keeps the caller's. A caller that is not root may name only its own uid and
            groups.
        max_bytes: cap on the file content written into the user's directory (bytes), None
            for none. Checked in the dry pass (WorkspaceError EFBIG, nothing changed) and
            enforced while copying. Files are copied hole for hole (``SEEK_DATA``/``SEEK_HOLE``):
            a sparse file costs its data, not its apparent size. Without a cap, a hostile upper
            can still multiply its data on the host disk: one file hard-linked over many
            existing names is copied once per name (the launcher passes
            :func:`lowlevel.workspace.cow.commit_budget`).
        accept_seen_host_changes: see Conflicts above (root overlays only; default off: any
            host change after ``since_ns`` where the commit writes is a conflict).
        save_to: makes and returns the directory the run's changes are saved into after a
            late conflict or a stop (called at most once); None for the default above.
        own_stamps: for an upper that may be committed again (a live Session's): a dict the
            caller keeps for this upper (:data:`~lowlevel.workspace.overlay.state.Stamps`),
            empty at first, which the apply pass fills with the state (device, inode, mode,
            ctime, mtime, size) of every user's entry it leaves,
            and which a later commit of the same upper reads: an entry still in such a state
            is no host change (see "Interruption" above). None (a run's single commit):
            nothing recorded, one lstat per applied entry saved.
    Returns:
        :class:`CommitReport`.
    Raises:
        CommitConflictError: (EBUSY) host changes: before the apply pass, nothing was changed
            (``.applied`` None); after it (``.applied`` set), the entries the host changed
            during the commit were left as the host made them, the others applied.
        CommitIncompleteError: the apply pass stopped (its errno: ENOSPC, EDQUOT, EFBIG,
            EROFS, EIO); what it applied is kept; see above.
        WorkspaceError: an fd is unusable, the upper is unreadable or was written with
            ``redirect_dir``/``metacopy`` (EOPNOTSUPP), or the content exceeds ``max_bytes``
            (EFBIG): nothing was changed. An error reading the upper during the apply pass
            stops the commit with what was applied so far kept.
        ValueError: bad ``xattr_prefix`` or ``new_owner``.
    """
    _check_prefix(xattr_prefix)
    _check_owner(new_owner, "new_owner")
    lock = _lock(lower_fd)
    try:
        try:
            cleanup_commit_leftovers(lock)
            early: list[str] = []
        except WorkspaceError as err:  # a dead commit's leftover we cannot remove: not this commit's problem
            early = [f"commit: {err}"]
        work = Applier(upper_fd, lock, prefix=xattr_prefix, since_ns=since_ns, new_owner=new_owner,
                       max_bytes=max_bytes, save=False, own_stamps=own_stamps)
        work.accept_seen = accept_seen_host_changes
        _dry_pass(work, max_bytes)
        stopped = _apply_pass(work, lock)
        work.notes[:0] = early
        report = work.report()
        if stopped is not None or work.late:
            raise _incomplete(work, report, stopped, upper_fd, save_to=save_to, xattr_prefix=xattr_prefix,
                              owner=new_owner, max_bytes=max_bytes)
        return report
    except OSError as err:
        if isinstance(err, WorkspaceError):
            raise
        raise WorkspaceError(err.errno or errno.EIO, f"commit stopped: {err}") from err
    finally:
        os.close(lock)


def _dry_pass(work: Applier, max_bytes: int | None) -> None:
    """The pass that changes nothing: conflicts, the byte budget, what is skipped.

    Raises:
        CommitConflictError: entries changed on the host since ``since_ns``.
        WorkspaceError: the walk failed, or the content exceeds ``max_bytes`` (EFBIG).
    """
    try:
        work.run(dry=True)
    except OSError as err:
        if isinstance(err, WorkspaceError):
            raise
        raise WorkspaceError(err.errno or errno.EIO, f"commit refused, nothing was changed: {err}") from err
    if work.conflicts:
        raise CommitConflictError(tuple(sorted(set(work.conflicts))))
    if max_bytes is not None and work.planned > max_bytes:
        raise WorkspaceError(errno.EFBIG, f"commit refused: it would write {work.planned} bytes of file content "
                             "(a file with several names is copied once per name it cannot keep as a hard link), "
                             f"more than the {max_bytes}-byte budget; nothing was changed")
    work.planned_changes = (list(work.added), list(work.modified), list(work.deleted))


def _apply_pass(work: Applier, lock: int) -> OSError | None:
    """The pass that applies what the dry pass decided; returns the STOP_ERRNOS error it
    stopped at (None: it went through). Its temporaries and journal are gone afterwards."""
    stopped: OSError | None = None
    try:
        work.run(dry=False)
    except OSError as err:
        if isinstance(err, WorkspaceError) or err.errno not in STOP_ERRNOS:
            raise
        stopped = err
    finally:
        # finish() to its end even when a KeyboardInterrupt is raised as it is entered: a
        # SIGINT that came in at the end of the apply pass has its Python handler run at the
        # first instruction of the next function called (finish's, before its own retry
        # loop), and the journal was left (1 run in ~4 of
        # test_keyboard_interrupt_leaves_no_temporaries). Inline, not in a helper: the
        # helper's own first instruction would be that place. finish() is idempotent; the
        # interrupt is raised again once it is done.
        interrupted: BaseException | None = None
        while True:
            try:
                work.finish(lock)
                break
            except (KeyboardInterrupt, SystemExit) as err:  # SystemExit: a SIGTERM handler's
                interrupted = interrupted or err
        if interrupted is not None:
            raise interrupted
    return stopped


def _nothing_written(upper_fd: int, xattr_prefix: str, new_owner: tuple[int, int] | None) -> bool:
    """:func:`commit_upper`'s first step: its arguments checked, then True when the upper has no
    entry: the commit would lock, sweep and walk nothing (issue 27: 0.22 ms of a run's CPU). A
    dead commit's leftovers then stay for the next commit that writes, or ``lowlevel cleanup
    --workspace``, as they would if no commit came at all.

    Raises:
        ValueError: bad ``xattr_prefix`` or ``new_owner``.
        WorkspaceError: the upper directory cannot be opened or listed (its errno).
    """
    _check_prefix(xattr_prefix)
    _check_owner(new_owner, "new_owner")
    try:
        return upper_is_empty(upper_fd)
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot open the upper directory: {err.strerror}") from err


def commit_upper(upper_fd: int, lower_fd: int, *, xattr_prefix: str, since_ns: int, upper_bytes: int,
                 new_owner: tuple[int, int] | None, save_to: Callable[[], str], keep_upper: bool,
                 accept_seen_host_changes: bool = False, own_stamps: Stamps | None = None) -> CommitReport:
    """Commit a run's or a session's upper directory into the user's directory: the one commit
    path of :class:`lowlevel.sandbox.launcher.Run` and :class:`lowlevel.Session`, with one error
    model (never a bare OSError).

    :func:`commit` with the byte budget of an upper of ``upper_bytes``
    (:func:`lowlevel.workspace.cow.commit_budget`), then, by what went wrong:

    - stopped part-way, or out of room (ENOSPC, EDQUOT, EFBIG): :class:`CommitIncompleteError`
      as :func:`commit` raised it (what was applied is kept, the run's changes saved aside);
    - unwritable (EROFS, EIO) before anything was applied: :class:`WorkspaceError` with that
      errno (``saved_upper`` where :func:`commit` saved the changes), like every commit that
      fails before it changes anything;
    - host changes (:class:`CommitConflictError`): found during the apply pass, as raised
      (saved aside by :func:`commit`); found before it (nothing applied), the changes are
      saved aside too unless ``keep_upper``;
    - anything else (a read-only or vanished directory, an unreadable upper, the budget):
      :class:`WorkspaceError` with the errno, nothing applied; the changes saved aside unless
      ``keep_upper``.

    Args:
        upper_fd, lower_fd, xattr_prefix, since_ns, new_owner, accept_seen_host_changes, own_stamps: as commit().
        upper_bytes: the size of the upper tmpfs (bytes): the commit writes at most
            :func:`lowlevel.workspace.cow.commit_budget` of it.
        save_to: makes and returns a fresh directory to save the changes into (called once per save).
        keep_upper: the caller keeps the upper after a failure that applied nothing (a Session:
            its changes stay in the session, to commit again or reset), so they are not saved
            aside then; False for a run, whose upper goes with its sandbox.
    An upper with no entry (:func:`~lowlevel.workspace.overlay.upper.upper_is_empty`) is no commit:
    an empty :class:`CommitReport`, the user's directory untouched (not locked, not swept).

    Returns:
        :class:`CommitReport`.
    Raises:
        CommitIncompleteError, CommitConflictError, WorkspaceError: see above; ``saved_upper``
            names where the changes were saved (None when not saved, the message says why).
        ValueError: bad ``xattr_prefix`` or ``new_owner`` (a caller's bug).
    """
    if _nothing_written(upper_fd, xattr_prefix, new_owner):
        return CommitReport(changes=Changes())
    budget = commit_budget(upper_bytes)
    try:
        return commit(upper_fd, lower_fd, xattr_prefix=xattr_prefix, since_ns=since_ns, new_owner=new_owner,
                      max_bytes=budget, accept_seen_host_changes=accept_seen_host_changes, save_to=save_to,
                      own_stamps=own_stamps)
    except CommitIncompleteError as err:
        applied = err.applied
        if err.errno not in NO_ROOM_ERRNOS and applied is not None and \
                not (applied.added or applied.modified or applied.deleted):
            # Nothing applied, the filesystem unwritable (read-only, failing) rather than full:
            # as any commit failing before it changes anything (a run's result() makes it a
            # warning that keeps the exit status; the changes were saved aside).
            failed = WorkspaceError(err.errno or errno.EIO, str(err))
            failed.saved_upper = err.saved_upper
            raise failed from err
        raise
    except CommitConflictError as err:
        if err.applied is None and not keep_upper:  # found by the dry pass: nothing saved yet
            try:
                err.saved_upper = save_upper(upper_fd, save_to(), xattr_prefix=xattr_prefix, owner=new_owner,
                                             max_bytes=budget)
                err.args = err.with_saved_upper(err.saved_upper).args  # the message says where, not how
            except (OSError, LowlevelError) as save_err:
                err.args = (err.args[0], f"{err.args[1]}; saving the run's changes failed too: {save_err}")
        raise
    except OSError as err:
        # A read-only or vanished workspace, an unreadable upper, the budget: nothing applied.
        why = f"cannot write the run's changes into the workspace: {err.strerror or err}"
        kept: str | None = None
        if not keep_upper:
            try:
                kept = save_upper(upper_fd, save_to(), xattr_prefix=xattr_prefix, owner=new_owner, max_bytes=budget)
                why += f"; they were saved to {kept}"
            except (OSError, LowlevelError) as save_err:
                why += f"; saving them failed too: {save_err}"
        failed = WorkspaceError(err.errno or errno.EIO, why)
        failed.saved_upper = kept
        raise failed from err
