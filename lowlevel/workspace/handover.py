"""Handing a workspace to the sandbox's uid for a run and taking it back (no overlay).

Without a copy-on-write overlay the user's directory itself is bound into the sandbox:
:func:`hand_over` snapshots it and (root callers) gives its entries to the sandbox's per-run
uid, journaled on disk first (:mod:`lowlevel.workspace.handover_journal`); :func:`give_back`
strips what the sandbox could abuse (setuid/setgid bits, ``o+w``, POSIX ACLs) and gives
ownership back; :func:`recover` does that for the workspaces of callers that died mid-run.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from lowlevel.errors import WorkspaceError
from lowlevel.host.trust import check_trusted_ancestors
from lowlevel.workspace import handover_journal as _journal
from lowlevel.workspace.changes import Snapshot, _kind
from lowlevel.workspace.handover_journal import Handover
from lowlevel.workspace.walk import MAX_DEPTH, MAX_SNAPSHOT_ENTRIES, _iter_tree, _open_root

#: S_ISUID | S_ISGID: the bits that make an executable run with its owner's or group's ids.
SETID_BITS = stat.S_ISUID | stat.S_ISGID
#: Cap on pre-existing setuid/setgid non-directories pinned with an O_PATH fd during a run
#: (callers whose sandbox runs as their own uid); see :class:`Handover`.
MAX_PINNED = 256


#: The xattrs holding POSIX ACLs. The sandbox may set them on what it owns during the run
#: (``user:65534:rwx``); chown does not clear them, so :func:`give_back` does.
ACL_XATTRS = ("system.posix_acl_access", "system.posix_acl_default")


def _xattr_path(dirfd: int, name: str) -> str:
    # os.*xattr have no dir_fd: go through the directory's /proc magic link; the last
    # component is not followed (follow_symlinks=False).
    return f"/proc/self/fd/{dirfd}/{name}"


def _read_acls(dirfd: int, name: str) -> dict[str, bytes]:
    path = _xattr_path(dirfd, name)
    try:
        present = [a for a in os.listxattr(path, follow_symlinks=False) if a in ACL_XATTRS]
        return {a: os.getxattr(path, a, follow_symlinks=False) for a in present}
    except OSError as err:
        if err.errno in (errno.ENOTSUP, errno.ENODATA):
            return {}
        raise


def _reset_acls(dirfd: int, name: str, recorded: dict[str, bytes] | None) -> bool:
    """Drop the ACLs the run may have set, restoring ``recorded`` ones. True if anything changed."""
    path = _xattr_path(dirfd, name)
    try:
        present = {a: os.getxattr(path, a, follow_symlinks=False)
                   for a in os.listxattr(path, follow_symlinks=False) if a in ACL_XATTRS}
    except OSError as err:
        if err.errno in (errno.ENOTSUP, errno.ENODATA):
            return False
        raise
    recorded = recorded or {}
    changed = False
    for attr in ACL_XATTRS:
        if attr in recorded:
            if present.get(attr) != recorded[attr]:
                os.setxattr(path, attr, recorded[attr], follow_symlinks=False)
                changed = True
        elif attr in present:
            try:
                os.removexattr(path, attr, follow_symlinks=False)
                changed = True
            except OSError as err:
                if err.errno not in (errno.ENOTSUP, errno.ENODATA):
                    raise
    return changed


def hand_over(root: str, *, sandbox_ids: tuple[int, int] | None, empty: bool = False,
              limit: int = MAX_SNAPSHOT_ENTRIES) -> Handover:
    """Snapshot the workspace and make it writable for the sandbox, in one walk.

    For a root caller (``sandbox_ids`` given: the sandbox's host uid and gid):

    - the root directory keeps its owner (the caller's uid if it was the sandbox's) and gets
      group ``sandbox gid`` and mode 0770: the sandbox writes through the group bits and no
      other local user can traverse it, so nothing the sandbox makes (a setuid copy of a
      shell) is reachable from outside while the run is live. The sandbox's uid never owns
      the root, so it cannot ``chmod o+rx`` it.
    - every entry below is given to the sandbox's uid:gid (``fchownat`` without following
      symlinks), except regular files with several hard links (their other names may lie
      outside the workspace) and setuid/setgid non-directories (they keep their owner and
      bits; the sandbox can read and replace them, not change them).

    For other callers (the sandbox runs as the caller's own uid) nothing changes hands; the
    walk records the state and pins the setuid/setgid files (see :class:`Handover`).

    Args:
        root: the workspace (absolute, resolved).
        sandbox_ids: ``(host_uid, host_gid)`` of the sandbox for root callers, else None.
        empty: the workspace was made empty a moment ago (skip the walk).
        limit: entries to record. A root caller's workspace with more is refused (its owners
            could not be given back exactly); others get an incomplete snapshot, and after
            the run every setuid/setgid bit of an unrecorded inode is cleared.
    Returns:
        The :class:`Handover` for :func:`give_back`; ``before`` is the change-report snapshot.
    Raises:
        WorkspaceError: the workspace cannot be walked, or (root callers) has more than
            ``limit`` entries (E2BIG): nothing is left changed.
    """
    if sandbox_ids is not None:
        # A root caller killed mid-run (no give_back) left this workspace handed over: give it
        # back first, or its damaged owners would be recorded as the originals.
        _done, problems = recover(root)
        if problems:
            raise WorkspaceError(errno.EBUSY, f"workspace {root} is still handed to an earlier run's sandbox: "
                                 f"{problems[0]}")
    rootfd = _open_root(root)
    try:
        lock_fd = -1 if sandbox_ids is None else _lock_handover(rootfd, root)
        st = os.fstat(rootfd)
        caller = (os.getuid(), os.getgid())
        owner = st.st_uid if sandbox_ids is None or st.st_uid != sandbox_ids[0] else caller[0]
        h = Handover(root=root, before=({}, True), root_ids=(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)),
                     owners={}, pins={}, sandbox_uid=sandbox_ids[0] if sandbox_ids else None,
                     new_owner=(owner, st.st_gid if owner == st.st_uid else caller[1]), lock_fd=lock_fd)
        if sandbox_ids is not None:
            # Journal ours before the first chown (lowlevel.workspace.handover_journal).
            try:
                h.journal = _journal.Journal.create(h, (st.st_dev, st.st_ino))
            except OSError as err:
                _close_pins(h)
                raise WorkspaceError(err.errno, f"cannot journal the hand-over of {root}: "
                                     f"{err.strerror or err}") from err
            try:
                os.fchown(rootfd, owner, sandbox_ids[1])
                os.fchmod(rootfd, 0o770)
            except OSError as err:
                h.journal.remove()
                _close_pins(h)
                raise WorkspaceError(err.errno, f"cannot hand workspace {root} to the sandbox: {err.strerror}") from err
        if empty:
            return h
        try:
            _hand_over_walk(h, rootfd, sandbox_ids, limit)
        except BaseException:
            give_back(h)
            raise
        return h
    finally:
        os.close(rootfd)


def _hand_over_walk(h: Handover, rootfd: int, sandbox_ids: tuple[int, int] | None, limit: int) -> None:
    snap: Snapshot = {}
    complete = True
    unlisted: list[OSError] = []
    deep: list[str] = []
    walker = _iter_tree(rootfd, onerror=unlisted.append, too_deep=lambda rel, _n, _fd: deep.append(rel))
    try:
        for rel, name, dirfd, st in walker:
            if len(snap) >= limit:
                complete = False
                if sandbox_ids is not None:
                    raise WorkspaceError(errno.E2BIG, f"workspace {h.root} has more than {limit} entries: "
                                         "too many to hand to the sandbox's uid and give back exactly. "
                                         "Use a smaller workspace (copy in what the program needs), "
                                         "or run lowlevel as an unprivileged user")
                break
            mode = st.st_mode
            snap[rel] = (_kind(mode), st.st_size, st.st_mtime_ns, st.st_ino, stat.S_IMODE(mode))
            key = (st.st_dev, st.st_ino)
            h.owners[key] = (st.st_uid, st.st_gid, mode)
            setid_file = bool(mode & SETID_BITS) and not stat.S_ISDIR(mode)
            if setid_file:
                h.stamps[key] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                if h.journal is not None:
                    h.journal.record_stamp(key, h.stamps[key])
            if sandbox_ids is not None:
                if setid_file or (stat.S_ISREG(mode) and st.st_nlink > 1):
                    continue
                if not stat.S_ISLNK(mode):
                    acls = _read_acls(dirfd, name)
                    if acls:
                        h.acls[key] = acls
                        h.journal.record_acls(key, acls)
                h.journal.record_entry(key, st.st_uid, st.st_gid, mode)  # on disk before the chown
                if (st.st_uid, st.st_gid) != sandbox_ids:
                    os.chown(name, *sandbox_ids, dir_fd=dirfd, follow_symlinks=False)
            elif setid_file and len(h.pins) < MAX_PINNED and key not in h.pins:
                pin = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
                pst = os.fstat(pin)
                if (pst.st_dev, pst.st_ino) == key:
                    h.pins[key] = pin
                else:
                    os.close(pin)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot walk workspace {h.root}: {err.strerror}") from err
    finally:
        walker.close()
    if deep and sandbox_ids is not None:
        raise WorkspaceError(errno.ELOOP, f"workspace {h.root} has directories more than {MAX_DEPTH} levels "
                             f"deep ({deep[0]}): too deep to hand to the sandbox's uid and give back exactly")
    if unlisted or deep:
        # A directory we cannot list (a non-root caller's workspace holding someone else's 0700
        # dir) or too deep to enter: its entries are unrecorded, so they count as new after the run.
        if sandbox_ids is not None:
            first = unlisted[0]
            raise WorkspaceError(first.errno or errno.EIO, f"cannot list {first.filename} in workspace {h.root}: "
                                 f"{first.strerror}")
        complete = False
    h.before = (snap, complete)


def give_back(h: Handover, *, limit: int = MAX_SNAPSHOT_ENTRIES) -> tuple[Snapshot, bool]:
    """After the run: strip what the sandbox could abuse and give ownership back. Idempotent.

    Call it only once the sandbox is dead. Walks the whole tree (no cap) relative to
    directory fds, never following a symlink (``fchownat``/``fchmodat`` with
    ``AT_SYMLINK_NOFOLLOW``), and for each entry:

    - an inode that existed before the run (same ``st_dev``/``st_ino``, same file type) gets
      back its uid and gid (root callers), and its setuid/setgid bits as recorded. For a
      non-directory that needs proof that it is the same file, not a new one that reused the
      number: for root callers, that it is not owned by the sandbox's uid (only the sandbox's
      files are; the sandbox cannot chmod others'), otherwise that it was pinned. Without the
      proof the bits are cleared.
    - an inode the run created gets the root's owner and group (root callers), and loses its
      setuid/setgid bits. Every such inode lives inside the sandbox's writable mounts (it was
      made there, and a hard link can only be made inside them), so changing it is safe even
      with ``st_nlink > 1``.
    - other-write (``o+w``) is kept only where the inode had it before the run.
    - the permission bits the program set are kept (a ``chmod +x`` it made stays);
    - for root callers, inodes not owned by the sandbox's uid are left alone: the sandbox
      could not have changed them.

    - POSIX ACLs (root callers): on every inode the sandbox's uid owns (it may have set
      ``user:65534:rwx``; chown keeps ACLs) the two ACL xattrs are removed, or restored to
      what :func:`hand_over` recorded. Unprivileged callers are not cleaned: the sandbox runs
      as the caller, so its ACLs grant only what the caller could grant anyway.
    - a pre-existing setuid/setgid file whose size, mtime or ctime changed (written, e.g.
      through a ``MAP_SHARED`` mapping, which keeps the bits) loses them.
    - a directory more than MAX_DEPTH levels deep is not entered: it is sealed (mode 0700,
      no ACL; ``root:root`` for root callers), noted in ``h.notes``, the snapshot incomplete.

    Then the root directory gets back its uid, gid and mode, and the pins are closed.

    Args:
        h: from :func:`hand_over`.
        limit: entries to record in the returned snapshot.
    Returns:
        The snapshot after the run, as :func:`snapshot` gives (the state once given back),
        or an empty complete one on the second call.
    Raises:
        WorkspaceError: the walk failed, or (root callers) a directory could not be listed:
            the root is still restored and the pins closed. For other callers an unlistable
            directory (someone else's) is logged and the snapshot marked incomplete.
    """
    if h.done:
        return {}, True
    h.done = True
    try:
        rootfd = _open_root(h.root)
    except WorkspaceError:
        _close_pins(h)
        raise
    unlisted: list[OSError] = []
    deep: list[str] = []
    try:
        snap, complete = _give_back_walk(h, rootfd, limit, unlisted, deep)
    finally:
        try:
            _restore_root(h, rootfd)
        finally:
            os.close(rootfd)
            _close_pins(h)
            if h.journal is not None:
                h.journal.close()  # kept on failure: `lowlevel cleanup` retries once we are gone
    if h.journal is not None and not (unlisted and h.sandbox_uid is not None):
        h.journal.remove()
    return snap, _note_unchecked(h, unlisted, deep) and complete and h.before[1]


def _give_back_walk(h: Handover, rootfd: int, limit: int, unlisted: list[OSError],
                    deep: list[str]) -> tuple[Snapshot, bool]:
    """Fix every entry below the root (:func:`_give_back_entry`); seal the directories too deep
    to enter (appended to ``deep``), collect the unlistable ones (``unlisted``). Returns the
    snapshot (at most ``limit`` entries) and whether it holds them all."""
    snap: Snapshot = {}
    complete = True

    def too_deep(rel: str, name: str, dirfd: int) -> None:
        deep.append(rel)
        _seal(h, name, dirfd)

    walker = _iter_tree(rootfd, onerror=unlisted.append, too_deep=too_deep)
    try:
        for rel, name, dirfd, st in walker:
            try:
                mode = _give_back_entry(h, name, dirfd, st)
            except FileNotFoundError:
                continue
            if len(snap) < limit:
                snap[rel] = (_kind(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino, mode)
            else:
                complete = False
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot give back workspace {h.root}: {err.strerror}") from err
    finally:
        walker.close()
    return snap, complete


def _restore_root(h: Handover, rootfd: int) -> None:
    """Give the root directory back its uid, gid and mode (as :func:`hand_over` found them)."""
    try:
        uid, gid, mode = h.root_ids
        cur = os.fstat(rootfd)
        if (cur.st_uid, cur.st_gid) != (uid, gid):
            os.fchown(rootfd, uid, gid)
        if stat.S_IMODE(cur.st_mode) != mode or (cur.st_uid, cur.st_gid) != (uid, gid):
            os.fchmod(rootfd, mode)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot give back workspace {h.root}: {err.strerror}") from err


def _note_unchecked(h: Handover, unlisted: list[OSError], deep: list[str]) -> bool:
    """Report what the walk could not check: an unlistable directory raises for root callers
    (logged for others), a sealed too-deep one goes to ``h.notes``. False when the snapshot
    therefore misses entries."""
    complete = True
    if unlisted:
        first = unlisted[0]
        message = (f"cannot list {first.filename} in workspace {h.root} after the run ({first.strerror}): "
                   "setuid/setgid bits below it were not checked")
        if h.sandbox_uid is not None:
            raise WorkspaceError(first.errno or errno.EIO, message)
        # The sandbox ran as our uid: our own directories were made listable above, so this is
        # someone else's directory (one the caller could not list before the run either).
        logging.getLogger("lowlevel").warning("lowlevel: %s", message)
        complete = False
    if deep:
        who = "root:root" if h.sandbox_uid is not None else "you"
        h.notes.append(f"workspace: {len(deep)} director{'y' if len(deep) == 1 else 'ies'} more than {MAX_DEPTH} "
                       f"levels deep ({deep[0]}) not checked after the run: made mode 0700, owned by {who}, so "
                       "no other user can reach what is below")
        complete = False
    return complete


def _seal(h: Handover, name: str, dirfd: int) -> None:
    """Neutralise a directory too deep to walk: only the caller may enter it (0700, no ACL;
    root callers also take it: ``root:root``). What is below was not checked."""
    try:
        if h.sandbox_uid is not None:
            os.chown(name, os.getuid(), os.getgid(), dir_fd=dirfd, follow_symlinks=False)
        elif os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_uid != os.getuid():
            return  # someone else's: the sandbox (our uid) could not have made it
        _reset_acls(dirfd, name, None)
        os.chmod(name, 0o700, dir_fd=dirfd, follow_symlinks=False)
    except (NotImplementedError, ValueError, FileNotFoundError):
        pass


def _close_pins(h: Handover) -> None:
    for fd in h.pins.values():
        os.close(fd)
    h.pins.clear()
    if h.lock_fd >= 0:
        os.close(h.lock_fd)  # the workspace may be handed over again
        h.lock_fd = -1


def _lock_handover(rootfd: int, root: str) -> int:
    """``flock(LOCK_EX | LOCK_NB)`` on the workspace root for one hand-over; return the fd.

    Raises:
        WorkspaceError: (EBUSY) another live run has it handed over.
    """
    import fcntl
    fd = os.dup(rootfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise WorkspaceError(errno.EBUSY, f"workspace {root} is handed to another live run's sandbox (no "
                                 "copy-on-write overlay here): run one at a time on it, or give each run its "
                                 "own workspace") from err
        raise WorkspaceError(err.errno, f"cannot lock workspace {root}: {err.strerror}") from err
    os.set_inheritable(fd, False)
    return fd


def _give_back_entry(h: Handover, name: str, dirfd: int, st: os.stat_result) -> int:
    """Fix one entry (see :func:`give_back`); return its permission bits afterwards."""
    mode = st.st_mode
    cur = stat.S_IMODE(mode)
    key = (st.st_dev, st.st_ino)
    is_dir = stat.S_ISDIR(mode)
    stamp = h.stamps.get(key)
    # A pre-existing setuid/setgid file whose content or inode changed during the run (a write
    # through MAP_SHARED keeps the bits; only the sandbox could have written it) loses them.
    tampered = stamp is not None and stamp != (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if h.sandbox_uid is not None and st.st_uid != h.sandbox_uid:
        if tampered and cur & SETID_BITS and not stat.S_ISLNK(mode):
            os.chmod(name, cur & ~SETID_BITS, dir_fd=dirfd, follow_symlinks=False)
            return cur & ~SETID_BITS
        return cur
    prev = h.owners.get(key)
    if prev is not None and stat.S_IFMT(prev[2]) != stat.S_IFMT(mode):
        prev = None
    acl_changed = False
    if h.sandbox_uid is not None and not stat.S_ISLNK(mode):
        # The sandbox's uid owned this inode during the run: it may have set ACLs on it.
        acl_changed = _reset_acls(dirfd, name, h.acls.get(key) if prev is not None else None)
    if prev is not None:
        uid, gid, prev_mode = prev
        # A directory's setgid bit grants nothing; a file's needs proof it is the same inode.
        proven = is_dir or (key in h.pins and not tampered)
        want = (cur & ~SETID_BITS) | (prev_mode & SETID_BITS if proven else 0)
        if not prev_mode & stat.S_IWOTH:
            want &= ~stat.S_IWOTH
    else:
        uid, gid = h.new_owner
        want = cur & ~(SETID_BITS | stat.S_IWOTH)
    if is_dir and h.sandbox_uid is None and st.st_uid == os.getuid():
        # A run as our own uid can leave a directory we cannot list (chmod 0311): we must see
        # inside it, so it gets u+rx back.
        want |= stat.S_IRUSR | stat.S_IXUSR
    chowned = False
    if h.sandbox_uid is not None and (st.st_uid, st.st_gid) != (uid, gid):
        os.chown(name, uid, gid, dir_fd=dirfd, follow_symlinks=False)
        chowned = True
    if stat.S_ISLNK(mode):
        return cur
    if want != cur or (chowned and want & SETID_BITS) or acl_changed:
        try:
            os.chmod(name, want, dir_fd=dirfd, follow_symlinks=False)
        except (NotImplementedError, ValueError):
            # glibc's fchmodat(AT_SYMLINK_NOFOLLOW) refuses a symlink (EOPNOTSUPP): the entry
            # was swapped for one since the stat. Symlinks have no mode to fix.
            return cur
    return want


def recover(root: str | None = None) -> tuple[list[str], list[str]]:
    """Give back every workspace a dead root caller left handed over
    (:mod:`lowlevel.workspace.handover_journal`).

    Args:
        root: only this workspace (resolved path), or every journal's.
    Returns:
        ``(given back, problems)``: workspace paths restored, and one line for each journal
        that stayed (its sandbox still runs, a walk failed).
    """
    done: list[str] = []
    problems: list[str] = []
    for path in _journal.pending(root):
        try:
            entry = _journal.load(path)
        except (OSError, ValueError, UnicodeDecodeError) as err:
            problems.append(f"{path}: unreadable journal ({err}); remove it by hand")
            continue
        h, root_key = entry.handover, entry.root_key
        alive = _journal.sandbox_alive(entry)
        if alive is not None:
            problems.append(f"{h.root}: not given back yet, {alive}; try again in a moment")
            continue
        try:
            st = os.lstat(h.root)
        except OSError:
            st = None
        if st is None or not stat.S_ISDIR(st.st_mode) or (root_key is not None
                                                          and (st.st_dev, st.st_ino) != root_key):
            # The workspace is gone, or the path is now another directory or a symlink (replaced
            # meanwhile): what was handed over is not there, so nothing is given back through it.
            _journal.unlink(path)
            continue
        try:
            check_trusted_ancestors(h.root)  # as at the run: no ancestor another user could swap
        except WorkspaceError as err:
            problems.append(f"{h.root}: not given back: {err}")
            continue
        try:
            give_back(h)
        except WorkspaceError as err:
            problems.append(f"{h.root}: {err}")
            continue
        _journal.unlink(path)
        done.append(h.root)
    return done, problems


__all__ = ["ACL_XATTRS", "MAX_PINNED", "SETID_BITS", "Handover", "give_back", "hand_over", "recover"]
