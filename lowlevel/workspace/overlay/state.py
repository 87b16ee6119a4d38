"""The commit walk's state and its guards against host changes (the base of the applier).

:class:`ApplyState` holds what a commit's dry pass decided and its apply pass did, the
temporaries it made in the user's directory, and the checks that an entry of the user's
directory is still the one the dry pass saw: ctime against ``since_ns``, a copy-up seen by the
run (statx btime + ``trusted.overlay.origin``), the lease and stamp check right before a swap
(:meth:`ApplyState.freeze`), a subtree changed meanwhile.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import stat
import time
from dataclasses import field

from lowlevel._dataclass import dataclass
from lowlevel.workspace.overlay.fdops import (
    LEFTOVER_PREFIX,
    _btime_ns,
    _copied_up_from,
    _join,
    _lstat,
    _open_dir_here,
    _remove_tree,
    _temp_name,
)
from lowlevel.workspace.walk import MAX_DEPTH

#: errnos that stop a commit's apply pass (:class:`CommitIncompleteError`): the user's
#: filesystem cannot take more (full, out of quota, file too big for it or past ``max_bytes``)
#: or cannot be written at all (read-only, failing).
STOP_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


#: Cap on hard-linked new files a commit links instead of copying (one O_PATH fd each).
MAX_LINKED = 256


#: Why an entry the run made unreadable to its owner is not committed (an unprivileged caller
#: is that owner, without CAP_DAC_OVERRIDE; a root caller's commit copies it as it is).
_UNREADABLE = "unreadable in the run's upper layer (mode {:04o}, set by the run): not committed"


class _UnreadableUpperError(OSError):
    """An upper entry the caller may not read (see :data:`_UNREADABLE`)."""


class _ChangedOnHostError(OSError):
    """The user's entry changed (or appeared) on the host during the commit's apply pass: it
    is left as the host made it, and reported as a conflict after the pass."""


def _stop(err: OSError, rel: str) -> OSError:
    """A STOP_ERRNOS error of the apply pass, naming the entry it stopped at."""
    return OSError(err.errno, err.strerror or os.strerror(err.errno or errno.EIO), rel)


#: Entry states (``commit(own_stamps=)``): a full :func:`_stamp` -> 0, or a :func:`_loose_stamp`
#: -> the latest ctime (ns) an entry matching it may have (:data:`LOOSE_HORIZON_NS`).
Stamps = dict[tuple[int, ...], int]

#: How long after an entry's rename into place a :func:`_loose_stamp` of it still matches (ns):
#: the one entry whose rename an interrupt followed before its full stamp was read. A rename
#: later than this (a stalled disk) makes the entry a conflict again: nothing lost, saved aside.
LOOSE_HORIZON_NS = 50_000_000


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    """What identifies one state of an entry: device, inode, type and mode, ctime, mtime, size."""
    return (st.st_dev, st.st_ino, st.st_mode, st.st_ctime_ns, st.st_mtime_ns, st.st_size)


def _loose_stamp(st: os.stat_result) -> tuple[int, ...]:
    """:func:`_stamp` without the ctime (-1 in its place), with owner and group: an entry about
    to be renamed into place, whose ctime the rename will change (see ``own_stamps``)."""
    return (st.st_dev, st.st_ino, st.st_mode, -1, st.st_mtime_ns, st.st_size, st.st_uid, st.st_gid)


#: fcntl(2) F_SETSIG: the signal a lease break sends (default SIGIO, whose default action
#: kills the process). SIGURG is ignored by default; the owner is cleared right after anyway.
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)


_MOUNT_POINT = ("a mount point in the workspace (the sandbox saw the directory below it): never written, deleted "
                "or listed through")


def _check_owner(owner: tuple[int, int] | None, what: str) -> None:
    if owner is not None and os.geteuid() != 0:
        if owner[0] != os.geteuid() or owner[1] not in set(os.getgroups()) | {os.getegid()}:
            raise ValueError(f"{what} {owner} is not yours: a caller that is not root can give new entries "
                             "only its own uid and one of its groups (pass None to keep yours)")


@dataclass
class _Frame:
    """One directory pair being applied: upper ``ufd`` onto target ``tfd``."""

    ufd: int
    tfd: int | None          # target directory (lower dir, or a new dir being built); None in the dry pass
    rel: str
    opaque: bool             # lower entries absent from the upper are deleted
    fresh: bool              # the target is new: no lower content, entries made under their final names
    xwhiteouts: bool = False  # the upper dir is marked as holding xattr whiteouts
    names: list[str] = field(default_factory=list)  # upper names left, reversed
    gone: list[str] = field(default_factory=list)   # opaque: lower names to delete, reversed
    lst: os.stat_result | None = None   # the lower entry this directory replaces or updates
    ust: os.stat_result | None = None
    parent_tfd: int | None = None
    temp: str | None = None  # new directory: its temporary name in a non-fresh parent
    name: str = ""
    mode: int | None = None  # existing directory: permission bits to set when done


class ApplyState:
    """The state of one commit (or save) walk: see the module docstring. Subclassed by
    :class:`lowlevel.workspace.overlay.apply_files.FileApplier` and
    :class:`lowlevel.workspace.overlay.apply.Applier`."""


    def __init__(self, upper_fd: int, target_fd: int, *, prefix: str, since_ns: int | None,
                 new_owner: tuple[int, int] | None, max_bytes: int | None, save: bool,
                 own_stamps: Stamps | None = None) -> None:
        self.upper_fd = upper_fd
        self.own_stamps = own_stamps  # see commit(own_stamps=): None records nothing
        self.dir_modes: dict[tuple[int, int], tuple[int, int, int]] = {}  # see dir_left
        self.target_fd = target_fd
        self.prefix = prefix
        self.since_ns = since_ns
        self.new_owner = new_owner
        self.max_bytes = max_bytes
        self.save = save
        self.euid = os.geteuid()
        self.root = self.euid == 0
        self.groups = set(os.getgroups()) | {os.getegid()}
        self.dry = True
        self.stack: list[_Frame] = []
        self.pending: list[tuple[int, str]] = []     # temporaries to remove if we stop now
        self.left_behind = False                     # a temporary could not be removed
        self.accept_seen = False                     # see commit(accept_seen_host_changes=)
        self.held: list[int] = []                    # dir fds of popped frames with temporaries pending
        self.decisions: dict[str, str] = {}          # rel -> skip reason, decided by the dry pass
        self.stamps: dict[str, tuple[int, int]] = {}  # rel -> (st_ino, st_ctime_ns) seen by the dry pass
        self.already: set[str] = set()               # rel: the host entry already is the run's (dry pass)
        self.ours: set[tuple[int, int]] = set()      # lower inodes this commit changed itself
        self.conflicts: list[str] = []
        self.late: list[str] = []                    # apply pass: entries the host changed meanwhile
        self.planned_changes: tuple[list[str], ...] = ([], [], [])  # the dry pass's added, modified, deleted
        self.journal_fd: int | None = None
        self.journal_name = ""
        self.journaled: set[str] = set()
        self.whiteouts: list[str] = []
        self.opaque_dirs: list[str] = []
        self.added: list[str] = []
        self.modified: list[str] = []
        self.deleted: list[str] = []
        self.skipped: list[tuple[str, str]] = []
        self.notes: list[str] = []
        self.copied = 0
        self.allocated = 0
        self.planned = 0
        self.counted: set[tuple[int, int]] = set()
        self.link_keys: set[tuple[int, int]] = set()
        self.links: dict[tuple[int, int], int] = {}
        self.noted: set[str] = set()

    def reset(self) -> None:
        self.added, self.modified, self.deleted, self.skipped, self.notes = [], [], [], [], []
        self.copied = self.allocated = self.planned = 0
        self.counted, self.link_keys, self.noted = set(), set(), set()

    # -- bookkeeping

    def skip(self, rel: str, reason: str) -> None:
        if self.dry:
            self.decisions[rel] = reason
        else:
            self.skipped.append((rel, reason))

    def decided(self, rel: str) -> bool:
        """Apply pass: the dry pass decided to skip ``rel`` (now recorded as skipped)."""
        if not self.dry and rel in self.decisions:
            self.skipped.append((rel, self.decisions[rel]))
            return True
        return False

    def note_once(self, key: str, text: str) -> None:
        if key not in self.noted:
            self.noted.add(key)
            self.notes.append(text)

    def count(self, ust: os.stat_result) -> None:
        key = (ust.st_dev, ust.st_ino)
        if key not in self.counted:
            self.counted.add(key)
            self.allocated += ust.st_blocks * 512

    def changed_on_host(self, st: os.stat_result) -> bool:
        """Changed since ``since_ns``, and not left so by this upper's own commits (``own_stamps``)."""
        if self.since_ns is None or st.st_ctime_ns <= self.since_ns:
            return False
        own = self.own_stamps
        if not own or _stamp(st) in own:
            return not own
        bound = own.get(_loose_stamp(st))
        return bound is None or st.st_ctime_ns > bound

    # -- own_stamps: the user's entries as this upper's commits left them

    def left_so(self, dirfd: int, name: str) -> None:
        """Apply pass: ``name`` was just written by this commit where nobody else writes (a new
        directory being built under a temporary name): its stamp is this upper's own."""
        if self.own_stamps is not None:
            st = _lstat(dirfd, name)
            if st is not None:
                self.own_stamps[_stamp(st)] = 0

    def expect(self, dirfd: int, temp: str) -> tuple[int, ...] | None:
        """Apply pass, right before ``temp`` (finished) is renamed into place: its stamp but the
        ctime the rename changes (:func:`_loose_stamp`), kept among ``own_stamps`` until
        :meth:`settle` replaces it with the full stamp. Left there only when an interrupt comes
        between the rename and that :meth:`settle`'s lstat, and then matching only ctimes up to
        :data:`LOOSE_HORIZON_NS` from now (a rename's ctime is at most the wall clock then)."""
        if self.own_stamps is None:
            return None
        st = _lstat(dirfd, temp)
        if st is None:
            return None
        loose = _loose_stamp(st)
        self.own_stamps[loose] = time.time_ns() + LOOSE_HORIZON_NS
        return loose

    def settle(self, dirfd: int, name: str, loose: tuple[int, ...] | None) -> None:
        """After :meth:`expect`'s rename was tried (done, failed or interrupted): the entry now
        at ``name`` is recorded by its full stamp if it is the one renamed (another inode, or a
        host change between the rename and this lstat that moved its mtime, size, mode or
        owner: not recorded, a conflict), and the loose stamp is dropped."""
        if self.own_stamps is None or loose is None:
            return
        st = _lstat(dirfd, name)
        if st is not None and _loose_stamp(st) == loose:
            self.own_stamps[_stamp(st)] = 0
        self.own_stamps.pop(loose, None)

    def dir_left(self, dirfd: int, mode_set: bool = False) -> None:
        """Apply pass: this commit just changed the entries of directory ``dirfd`` (placed,
        swapped out or removed one), which moved its ctime and mtime: its stamp now is this
        upper's own, unless its mode or owner is not what this commit knows of it
        (``dir_modes``: a host chmod or chown meanwhile), so a later commit of the same upper
        may still chmod or delete it (an existing directory whose new mode is set last, once
        its entries are in). Not recorded: a host change to it in the microseconds between
        this commit's change and this fstat that leaves its mode and owner (an entry added,
        an ACL or xattr set) is taken for this commit's; only a chmod or a removal can follow.
        ``mode_set``: the commit just set its mode itself: the mode and owner it now has become
        the ones known."""
        if self.own_stamps is None:
            return
        try:
            st = os.fstat(dirfd)
        except OSError:
            return
        if mode_set:
            self.dir_modes[(st.st_dev, st.st_ino)] = (st.st_mode, st.st_uid, st.st_gid)
        want = self.dir_modes.get((st.st_dev, st.st_ino))
        if want is None or want == (st.st_mode, st.st_uid, st.st_gid):
            self.own_stamps[_stamp(st)] = 0

    def touch(self, rel: str, lst: os.stat_result, copy: tuple[int, int, str] | None = None) -> bool:
        """An existing lower entry is about to be replaced, deleted or chmodded.

        Dry pass: a ctime after ``since_ns`` is a conflict, unless ``copy`` (upper dir fd,
        lower dir fd, name) shows the run's entry is a copy-up of this very lower inode
        taken after that change (see :func:`commit`). Apply pass: the entry must be as the
        dry pass saw it (same inode, same ctime) unless this commit changed it itself
        (unlinking one name of a hard-linked file changes the other's ctime); else it
        changed on the host during the commit and is left alone (a late conflict, see
        :func:`commit`).
        """
        if self.dry:
            if self.changed_on_host(lst) and not (copy is not None and self.accept_seen
                                                  and self.seen_by_run(lst, *copy)):
                self.conflicts.append(rel)
                return False
            self.stamps[rel] = (lst.st_ino, lst.st_ctime_ns)
            return True
        seen = self.stamps.get(rel)
        # (Ours by the same inode only: a number freed by this commit's own replacements can be
        # reused by a file the host makes meanwhile, e.g. an editor's save.)
        if seen == (lst.st_ino, lst.st_ctime_ns) or (seen is not None and seen[0] == lst.st_ino
                                                     and (lst.st_dev, lst.st_ino) in self.ours):
            return True
        self.late.append(rel)  # changed on the host during the commit: left as the host made it
        return False

    def seen_by_run(self, lst: os.stat_result, udirfd: int, ldirfd: int, name: str) -> bool:
        """The run's copy of ``name`` was taken (copy-up) from this lower inode at or after its
        last change: the host's change is in the run's version, nothing would be lost."""
        btime = _btime_ns(udirfd, name)
        return btime is not None and lst.st_ctime_ns <= btime and \
            _copied_up_from(udirfd, name, ldirfd, name, self.prefix)

    def mine(self, st: os.stat_result | None) -> None:
        if st is not None:
            self.ours.add((st.st_dev, st.st_ino))

    def owner_for(self, lst: os.stat_result | None) -> tuple[int, int] | None:
        """Owner for a replacement (the old entry's) or a new entry (``new_owner``)."""
        return (lst.st_uid, lst.st_gid) if lst is not None else self.new_owner

    def can_own(self, rel: str, owner: tuple[int, int] | None) -> bool:
        """Dry pass: a caller that is not root can give a new inode only its uid and groups."""
        if self.root or owner is None:
            return True
        if owner[0] != self.euid:
            self.skip(rel, f"owned by uid {owner[0]}: replacing it would make it yours (commit as root)")
            return False
        if owner[1] not in self.groups:
            self.skip(rel, f"group {owner[1]} is not one of yours: replacing it would change its group")
            return False
        return True

    def check_subtree(self, dirfd: int, name: str, rel: str) -> bool:
        """Dry pass, a lower directory to delete or replace: every entry below it must be
        unchanged since the run started (else a conflict), no deeper than MAX_DEPTH, and
        (callers that are not root) removable without touching others' entries."""
        try:
            fd = _open_dir_here(dirfd, name)
        except OSError as err:
            if err.errno in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):
                self.conflicts.append(rel)  # swapped on the host since the stat
            elif err.errno == errno.EXDEV:
                self.skip(rel, _MOUNT_POINT)
            else:
                self.skip(rel, f"cannot list it to delete it: {err.strerror}")
            return False
        ok = True
        stack: list[tuple[int, str, list[str]]] = []
        try:
            stack.append((fd, rel, sorted(os.listdir(fd), reverse=True)))
            while stack:
                dfd, drel, names = stack[-1]
                if not names:
                    stack.pop()
                    os.close(dfd)
                    continue
                child = names.pop()
                crel = _join(drel, child)
                st = _lstat(dfd, child)
                if st is None:
                    continue
                if self.changed_on_host(st):
                    self.conflicts.append(crel)
                    ok = False
                is_dir = stat.S_ISDIR(st.st_mode)
                if not self.root and st.st_uid != self.euid and (is_dir or os.fstat(dfd).st_mode & stat.S_ISVTX):
                    self.skip(rel, f"{crel!r} below it belongs to uid {st.st_uid}: cannot delete it")
                    return False
                if not is_dir:
                    continue
                if len(stack) > MAX_DEPTH:
                    self.skip(rel, f"more than {MAX_DEPTH} levels deep: not checked, so not deleted")
                    return False
                try:
                    cfd = _open_dir_here(dfd, child)
                except OSError as err:
                    if err.errno != errno.EXDEV:
                        raise
                    self.skip(rel, f"{crel!r} below it is {_MOUNT_POINT}")
                    return False
                try:
                    cnames = sorted(os.listdir(cfd), reverse=True)
                except BaseException:
                    os.close(cfd)
                    raise
                stack.append((cfd, crel, cnames))
        except OSError as err:
            self.skip(rel, f"cannot list it to delete it: {err.strerror}")
            return False
        finally:
            for dfd, _, _ in stack:
                os.close(dfd)
        return ok

    # -- temporaries in the user's directory

    def temp_in(self, frame: _Frame) -> str:
        """A new temporary name in the frame's (non-fresh) target directory: the directory is
        journaled first, and the name registered for removal should the commit stop."""
        assert frame.tfd is not None
        if frame.rel not in self.journaled:
            if self.journal_fd is None:
                self.journal_name = f"{LEFTOVER_PREFIX}{os.getpid()}.journal"  # named first: see finish()
                self.journal_fd = os.open(self.journal_name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                                          | os.O_CLOEXEC, 0o600, dir_fd=self.target_fd)
            os.write(self.journal_fd, os.fsencode(frame.rel) + b"\0")
            self.journaled.add(frame.rel)
        name = _temp_name()
        self.pending.append((frame.tfd, name))
        return name

    def resolved(self, dirfd: int, name: str) -> None:
        try:
            self.pending.remove((dirfd, name))
        except ValueError:
            pass

    def remove_temp(self, dirfd: int, name: str) -> None:
        """Remove a temporary now; if that fails it stays registered (abort_cleanup retries,
        and the journal lets :func:`cleanup_commit_leftovers` find it later)."""
        try:
            _remove_tree(dirfd, name)
        except OSError as err:
            self.left_behind = True
            self.note_once("leftover", f"commit: could not remove a temporary entry ({err.strerror}): "
                           "cleanup_commit_leftovers() removes it once this process has exited")
            return
        self.resolved(dirfd, name)

    def abort_cleanup(self) -> None:
        """Remove every temporary still registered: a half-built new entry, or an old entry
        moved aside for deletion (its deletion is then complete). An interrupt retries."""
        while self.pending:
            dirfd, name = self.pending[-1]
            try:
                _remove_tree(dirfd, name)
                self.dir_left(dirfd)
            except KeyboardInterrupt:
                continue
            except OSError:
                self.left_behind = True
            self.pending.pop()


    def freeze(self, tfd: int, name: str, lst: os.stat_result) -> int | None:
        """Right before ``name`` is replaced: it must still be the entry ``lst`` describes (same
        device, inode, mode, ctime, mtime, size), else :class:`_ChangedOnHostError`.

        A regular file is also leased: a read lease, ``F_SETLEASE F_RDLCK`` (fcntl(2),
        "Leases"), is granted only while nobody has the file open for writing (else EAGAIN: a
        host process may be writing it: a conflict; readers are no obstacle), and from then on
        an open(2) for writing or a truncate(2) of it by another process waits until the lease
        is let go, which :meth:`place` sees (``F_GETLEASE`` no longer ``F_RDLCK``) after the swap. The lease
        break signal is SIGURG (ignored by default) and the fd's owner is cleared, so none is
        sent. Returns the leased fd (the caller closes it), or None where no lease can be had
        (a symlink or directory, a filesystem without leases, a file that is not the caller's
        without CAP_LEASE, ``fs.leases-enable=0``): then only the stat checks guard it.
        """
        fd: int | None = None
        if stat.S_ISREG(lst.st_mode):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=tfd)
            except OSError as err:
                if err.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.EWOULDBLOCK, errno.ENOTDIR):
                    raise _ChangedOnHostError(err.errno, "changed on the host during the commit", name) from None
                fd = None
        if fd is not None:
            try:
                if _stamp(os.fstat(fd)) != _stamp(lst):
                    raise _ChangedOnHostError(errno.EBUSY, "changed on the host during the commit", name)
                fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
                fcntl.fcntl(fd, fcntl.F_SETOWN, 0)
            except _ChangedOnHostError:
                os.close(fd)
                raise
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EBUSY):
                    raise _ChangedOnHostError(err.errno, "open on the host during the commit (it may be being written)",
                                         name) from None
                fd = None
        cur = _lstat(tfd, name)
        if cur is None or _stamp(cur) != _stamp(lst):
            if fd is not None:
                os.close(fd)
            raise _ChangedOnHostError(errno.EBUSY, "changed on the host during the commit", name)
        return fd

    def subtree_changed(self, dirfd: int, name: str) -> bool:
        """A lower directory about to be removed (swapped out by :meth:`place`): does anything
        below it have a ctime after ``since_ns`` (written on the host since the run started)?
        Unreadable parts count as changed (never removed unchecked)."""
        if self.since_ns is None:
            return False
        try:
            stack = [_open_dir_here(dirfd, name)]
        except OSError:
            return True
        try:
            while stack:
                fd = stack.pop()
                try:
                    for child in os.listdir(fd):
                        st = _lstat(fd, child)
                        if st is None:
                            continue
                        if self.changed_on_host(st) and (st.st_dev, st.st_ino) not in self.ours:
                            return True
                        if stat.S_ISDIR(st.st_mode):
                            if len(stack) > MAX_DEPTH:
                                return True
                            stack.append(_open_dir_here(fd, child))
                finally:
                    os.close(fd)
        except OSError:
            return True
        finally:
            for fd in stack:
                os.close(fd)
        return False
