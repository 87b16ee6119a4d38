"""Applying one non-directory entry: copy a file hole for hole, recreate a symlink, place it
atomically (``RENAME_EXCHANGE``, swapped back when the host touched the old entry), delete one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from lowlevel.workspace.handover import ACL_XATTRS, SETID_BITS
from lowlevel.workspace.overlay.fdops import (
    _READ_FLAGS,
    _RENAME_EXCHANGE,
    _RENAME_NOREPLACE,
    _at,
    _getxattr,
    _join,
    _listxattr,
    _lstat,
    _renameat2,
)
from lowlevel.workspace.overlay.state import (
    _UNREADABLE,
    MAX_LINKED,
    STOP_ERRNOS,
    ApplyState,
    _ChangedOnHostError,
    _Frame,
    _stamp,
    _stop,
    _UnreadableUpperError,
)


class FileApplier(ApplyState):
    """The commit walk's non-directory entries (see the module docstring)."""


    # -- deletions

    def delete_lower(self, frame: _Frame, name: str, lst: os.stat_result | None) -> None:
        """Delete lower entry ``name`` (a whiteout, or absent from an opaque directory)."""
        rel = _join(frame.rel, name)
        if frame.tfd is None or self.decided(rel):
            return
        if lst is None:
            lst = _lstat(frame.tfd, name)
            if lst is None:
                return
        is_dir = stat.S_ISDIR(lst.st_mode)
        if self.dry:
            ok = self.touch(rel, lst)
            if is_dir:  # checked even when the directory itself changed: name every conflict below
                ok = self.check_subtree(frame.tfd, name, rel) and ok
            if ok:
                self.deleted.append(rel)
            return
        if not self.touch(rel, lst):
            return
        try:
            # Checked (and a file leased, see freeze) right before, moved out of sight
            # atomically, checked again, then removed; moved back if the host changed it
            # meanwhile. Killed in between, the path is already gone (its new state) and the
            # leftover is cleaned up later.
            lease = self.freeze(frame.tfd, name, lst)
            try:
                temp = self.temp_in(frame)
                try:
                    _renameat2(frame.tfd, name, frame.tfd, temp, _RENAME_NOREPLACE)
                except FileNotFoundError:
                    self.resolved(frame.tfd, temp)
                    raise _ChangedOnHostError(errno.ENOENT, "removed on the host during the commit", name) from None
                old = _lstat(frame.tfd, temp)
                broken = lease is not None and fcntl.fcntl(lease, fcntl.F_GETLEASE) != fcntl.F_RDLCK
                if old is None or _stamp(old)[:3] + _stamp(old)[4:] != _stamp(lst)[:3] + _stamp(lst)[4:] or broken \
                        or (is_dir and self.subtree_changed(frame.tfd, temp)):
                    try:
                        _renameat2(frame.tfd, temp, frame.tfd, name, _RENAME_NOREPLACE)
                    except OSError:
                        self.note_once("kept-" + rel, f"commit: {rel!r} changed on the host while it was being "
                                       f"deleted and the host made a new one: the changed one is kept as {temp!r}")
                    self.resolved(frame.tfd, temp)
                    raise _ChangedOnHostError(errno.EBUSY, "changed on the host during the commit", name)
                self.mine(lst)
                self.remove_temp(frame.tfd, temp)
                self.dir_left(frame.tfd)
            finally:
                if lease is not None:
                    os.close(lease)
        except _ChangedOnHostError:
            self.late.append(rel)
            return
        except OSError as err:
            if err.errno in STOP_ERRNOS:
                raise _stop(err, rel) from err
            self.skipped.append((rel, f"cannot delete it: {err.strerror}"))
            return
        self.deleted.append(rel)

    # -- files and symlinks

    @staticmethod
    def leaf_mode(ust: os.stat_result, lst: os.stat_result | None) -> int:
        """Permission bits from the upper, minus setuid/setgid, minus o+w unless the old entry had it."""
        want = stat.S_IMODE(ust.st_mode) & ~SETID_BITS
        if lst is None or not lst.st_mode & stat.S_IWOTH:
            want &= ~stat.S_IWOTH
        return want

    def leaf(self, frame: _Frame, name: str, rel: str, ust: os.stat_result, lst: os.stat_result | None) -> None:
        owner = self.owner_for(lst)
        key = (ust.st_dev, ust.st_ino)
        if self.dry:
            if lst is not None:
                assert frame.tfd is not None
                if self.changed_on_host(lst) and self.holds_already(frame, name, ust, lst):
                    self.already.add(rel)
                    self.stamps[rel] = (lst.st_ino, lst.st_ctime_ns)
                    self.modified.append(rel)
                    return
                ok = self.touch(rel, lst, (frame.ufd, frame.tfd, name))
                if stat.S_ISDIR(lst.st_mode):
                    ok = self.check_subtree(frame.tfd, name, rel) and ok
                if not ok:
                    return
            if not self.can_own(rel, owner):
                return
            if stat.S_ISREG(ust.st_mode):
                # As the apply pass will do: data extents only (holes stay holes), and one copy
                # per name except for the first MAX_LINKED hard-linked new inodes, linked.
                linked = ust.st_nlink > 1 and lst is None
                if not (linked and key in self.link_keys):
                    self.planned += min(ust.st_size, ust.st_blocks * 512)
                    if linked and len(self.link_keys) < MAX_LINKED:
                        self.link_keys.add(key)
            (self.modified if lst is not None else self.added).append(rel)
            return
        assert frame.tfd is not None
        if rel in self.already:
            # Left as it is: it already holds the run's version. Changed since the dry pass
            # (or gone): the host's, a late conflict as for any other entry.
            if lst is None:
                self.late.append(rel)
            elif self.touch(rel, lst):
                self.count(ust)
                self.modified.append(rel)
            return
        if lst is not None and not self.touch(rel, lst):
            return
        target = name if frame.fresh else self.temp_in(frame)
        try:
            self.write_leaf(frame, name, target, ust, lst, owner)
            if frame.fresh:
                self.left_so(frame.tfd, name)
            else:
                self.place(frame.tfd, target, name, lst)
                self.dir_left(frame.tfd)
        except OSError as err:
            if not frame.fresh:
                self.remove_temp(frame.tfd, target)
            if isinstance(err, _ChangedOnHostError):
                self.late.append(rel)
                return
            if err.errno in STOP_ERRNOS:
                raise _stop(err, rel) from err
            unreadable = isinstance(err, _UnreadableUpperError)
            self.skipped.append((rel, _UNREADABLE.format(stat.S_IMODE(ust.st_mode)) if unreadable
                                 else f"cannot write it: {err.strerror}"))
            return
        self.count(ust)
        if lst is not None and lst.st_nlink > 1 and not stat.S_ISDIR(lst.st_mode):
            self.notes.append(f"commit: {rel!r} had {lst.st_nlink} hard links: it was replaced by a new file, "
                              "the other names keep the old content")
        (self.modified if lst is not None else self.added).append(rel)

    def holds_already(self, frame: _Frame, name: str, ust: os.stat_result, lst: os.stat_result) -> bool:
        """Dry pass, a user's entry changed since ``since_ns``: True when it already is exactly
        what this commit would make of the upper's ``name``, so leaving it as it is loses
        nothing of the host's and is no conflict.

        A regular file: same size, mtime (the commit sets the upper's, to the nanosecond),
        permission bits (:meth:`leaf_mode`), ``user.*`` xattrs (but ``user.overlay.*``) and
        bytes; a symlink: same target and mtime. This makes a second commit of the same upper
        complete the first: a ``Session.commit()`` interrupted in its apply pass (^C, a SIGTERM
        handler's SystemExit) left part of the entries applied, and the next commit (the
        ``with`` block's ``close()``) met each of them as a host change and refused them all
        (bench/kill_campaign.py, 13 of ~2,500 trials). Anything unreadable, or any difference:
        False (the usual conflict rule decides).
        """
        assert frame.tfd is not None
        if stat.S_IFMT(ust.st_mode) != stat.S_IFMT(lst.st_mode) or ust.st_mtime_ns != lst.st_mtime_ns:
            return False
        try:
            if stat.S_ISLNK(ust.st_mode):
                return os.readlink(name, dir_fd=frame.ufd) == os.readlink(name, dir_fd=frame.tfd)
            if not stat.S_ISREG(ust.st_mode) or ust.st_size != lst.st_size or \
                    stat.S_IMODE(lst.st_mode) != self.leaf_mode(ust, lst):
                return False
            src = os.open(name, _READ_FLAGS, dir_fd=frame.ufd)
            try:
                dst = os.open(name, _READ_FLAGS, dir_fd=frame.tfd)
                try:
                    return _same_file(src, dst, (ust.st_dev, ust.st_ino), lst)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
        except OSError:
            return False

    def write_leaf(self, frame: _Frame, name: str, target: str, ust: os.stat_result,
                   lst: os.stat_result | None, owner: tuple[int, int] | None) -> None:
        """Create ``target`` in the frame's target dir as a copy of upper ``name``."""
        assert frame.tfd is not None
        tfd = frame.tfd
        if stat.S_ISLNK(ust.st_mode):
            os.symlink(os.readlink(name, dir_fd=frame.ufd), target, dir_fd=tfd)
            if owner is not None:
                cur = os.stat(target, dir_fd=tfd, follow_symlinks=False)
                if (cur.st_uid, cur.st_gid) != owner:
                    os.chown(target, owner[0] if self.root else -1, owner[1], dir_fd=tfd, follow_symlinks=False)
            os.utime(target, ns=(ust.st_atime_ns, ust.st_mtime_ns), dir_fd=tfd, follow_symlinks=False)
            return
        key = (ust.st_dev, ust.st_ino)
        linked = ust.st_nlink > 1 and lst is None
        if linked and key in self.links:
            try:
                os.link(f"/proc/self/fd/{self.links[key]}", target, dst_dir_fd=tfd, follow_symlinks=True)
                return
            except OSError:
                pass  # the first name was not placed after all, or EMLINK: copy instead
        try:
            src = os.open(name, _READ_FLAGS, dir_fd=frame.ufd)
        except PermissionError as err:
            raise _UnreadableUpperError(err.errno, err.strerror, name) from None
        try:
            sst = os.fstat(src)
            if (sst.st_dev, sst.st_ino) != key or not stat.S_ISREG(sst.st_mode):
                raise OSError(errno.ESTALE, "upper entry changed while being read", name)
            dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=tfd)
            try:
                self.copy_data(src, dst, name, sst.st_size)
                self.copy_xattrs(src, dst)
                if lst is not None and not frame.fresh and not stat.S_ISLNK(lst.st_mode):
                    acl = _getxattr(_at(tfd, name), ACL_XATTRS[0])
                    if acl is not None:
                        os.setxattr(dst, ACL_XATTRS[0], acl)
                if owner is not None:
                    cur = os.fstat(dst)
                    if (cur.st_uid, cur.st_gid) != owner:
                        os.fchown(dst, owner[0] if self.root else -1, owner[1])
                os.fchmod(dst, self.leaf_mode(ust, lst))
                os.utime(dst, ns=(ust.st_atime_ns, ust.st_mtime_ns))
                if linked and key not in self.links:
                    if len(self.links) < MAX_LINKED:
                        self.links[key] = os.open(target, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tfd)
                    else:
                        self.note_once("links", f"commit: more than {MAX_LINKED} hard-linked new files: the "
                                       "others were copied, not linked")
            finally:
                os.close(dst)
        finally:
            os.close(src)

    def copy_data(self, src: int, dst: int, name: str, size: int) -> None:
        """Copy the first ``size`` bytes of ``src`` (its size when opened: a file that grows
        meanwhile, in a live Session, is not followed) into ``dst``, hole for hole.

        Only data extents are read and written (``lseek`` ``SEEK_DATA``/``SEEK_HOLE``, Linux
        3.1; tmpfs and ext4 support them): a sparse upper file (``truncate -s 1T``, which costs
        the upper nothing) stays sparse, so the host disk pays what the upper paid, never its
        apparent size. Data bytes count against ``max_bytes`` (EFBIG past it).
        """
        pos = 0
        while pos < size:
            try:
                start = os.lseek(src, pos, os.SEEK_DATA)
                end = os.lseek(src, start, os.SEEK_HOLE)
            except OSError as err:
                if err.errno == errno.ENXIO:
                    break  # only a hole from pos to EOF
                if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                start, end = pos, size  # no SEEK_DATA on this filesystem: all data
            if start >= size:
                break
            end = min(end, size)
            if not self.copy_range(src, dst, start, end, name):
                break  # the file shrank meanwhile
            pos = end
        os.ftruncate(dst, min(size, os.fstat(src).st_size))

    def copy_range(self, src: int, dst: int, start: int, end: int, name: str) -> bool:
        """Copy bytes ``[start, end)`` of ``src`` to the same offsets of ``dst``; False at an
        early EOF."""
        os.lseek(dst, start, os.SEEK_SET)
        pos = start
        while pos < end:
            room = min(1 << 20, end - pos)
            if self.max_bytes is not None:
                room = max(1, min(room, self.max_bytes - self.copied + 1))
            try:
                n = os.sendfile(dst, src, pos, room)
            except OSError as err:
                if err.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise
                data = os.pread(src, room, pos)
                n = len(data)
                view = memoryview(data)
                while view:
                    view = view[os.write(dst, view):]
            if n == 0:
                return False
            pos += n
            self.copied += n
            if self.max_bytes is not None and self.copied > self.max_bytes:
                raise OSError(errno.EFBIG, f"byte budget of {self.max_bytes} exceeded", name)
        return True

    def copy_xattrs(self, src: int, dst: int) -> None:
        """``user.*`` xattrs of the upper entry, except ``user.overlay.*`` (overlayfs's own, or
        escaped ones: a later ``userxattr`` overlay of this directory would obey them)."""
        for attr in _listxattr(src):
            if not _copied_xattr(attr):
                continue
            value = _getxattr(src, attr)
            if value is None:
                continue
            try:
                os.setxattr(dst, attr, value)
            except OSError as err:
                if err.errno not in (errno.ENOTSUP, errno.EPERM, errno.E2BIG, errno.ENOSPC, errno.ERANGE):
                    raise
                self.note_once("xattr", f"commit: some user xattrs were not copied ({err.strerror})")

    def place(self, tfd: int, temp: str, name: str, lst: os.stat_result | None) -> None:
        """:meth:`_place`, the entry placed recorded in ``own_stamps`` (:meth:`expect`, :meth:`settle`)."""
        loose = self.expect(tfd, temp)
        try:
            self._place(tfd, temp, name, lst)
        finally:  # an interrupt too: the entry is read while it propagates (a second one leaves it loose)
            self.settle(tfd, name, loose)

    def _place(self, tfd: int, temp: str, name: str, lst: os.stat_result | None) -> None:
        """Move finished ``temp`` to ``name`` atomically: ``name`` is old or new at every instant.

        A new name: ``renameat2(RENAME_NOREPLACE)``. An existing entry ``lst``: checked right
        before (:meth:`freeze`: same inode, ctime, mtime, size; a regular file also leased),
        swapped with ``renameat2(RENAME_EXCHANGE)``, and the entry swapped out checked again
        (same inode, mtime, size, lease unbroken: no host process opened it for writing or
        truncated it in between); if it changed, it is swapped back. Only then is the old entry removed.

        Raises:
            _ChangedOnHostError: ``name`` appeared, went, or changed on the host (or is open there)
                during the commit: it is left as the host made it and ``temp`` is still ours.
            OSError: the rename failed (``temp`` is still ours).
        """
        if lst is None:
            try:
                _renameat2(tfd, temp, tfd, name, _RENAME_NOREPLACE)
            except FileExistsError:
                raise _ChangedOnHostError(errno.EEXIST, "it appeared on the host during the commit", name) from None
            self.resolved(tfd, temp)
            return
        dirs = stat.S_ISDIR(lst.st_mode) or stat.S_ISDIR(os.stat(temp, dir_fd=tfd, follow_symlinks=False).st_mode)
        lease = self.freeze(tfd, name, lst)
        try:
            try:
                _renameat2(tfd, temp, tfd, name, _RENAME_EXCHANGE)
            except FileNotFoundError:
                raise _ChangedOnHostError(errno.ENOENT, "it was removed on the host during the commit", name) from None
            except OSError as err:
                if dirs or err.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                # No RENAME_EXCHANGE on this filesystem: rename(2), checked right before only.
                os.rename(temp, name, src_dir_fd=tfd, dst_dir_fd=tfd)
                self.mine(lst)
                self.resolved(tfd, temp)
                return
            old = _lstat(tfd, temp)
            broken = lease is not None and fcntl.fcntl(lease, fcntl.F_GETLEASE) != fcntl.F_RDLCK
            # rename(2) changes the ctime of what it moves: compared without it.
            if old is None or _stamp(old)[:3] + _stamp(old)[4:] != _stamp(lst)[:3] + _stamp(lst)[4:] or broken \
                    or (stat.S_ISDIR(old.st_mode) and self.subtree_changed(tfd, temp)):
                _renameat2(tfd, temp, tfd, name, _RENAME_EXCHANGE)  # the host's entry goes back
                raise _ChangedOnHostError(errno.EBUSY, "changed on the host during the commit", name)
            self.mine(lst)
            if stat.S_ISDIR(old.st_mode):
                self.remove_temp(tfd, temp)
            else:
                try:
                    os.unlink(temp, dir_fd=tfd)
                    self.resolved(tfd, temp)
                except OSError:
                    self.remove_temp(tfd, temp)
        finally:
            if lease is not None:
                os.close(lease)  # lets go of the lease: a host open(2) waiting on it proceeds


def _copied_xattr(attr: str) -> bool:
    """An xattr a commit copies: ``user.*`` but ``user.overlay.*`` (see :meth:`FileApplier.copy_xattrs`)."""
    return attr.startswith("user.") and not attr.startswith("user.overlay.")


def _user_xattrs(fd: int) -> dict[str, bytes | None]:
    """The xattrs a commit copies (:func:`_copied_xattr`), by name."""
    return {a: _getxattr(fd, a) for a in _listxattr(fd) if _copied_xattr(a)}


def _same_file(src: int, dst: int, key: tuple[int, int], lst: os.stat_result) -> bool:
    """:meth:`FileApplier.holds_already`'s comparison of two open regular files: ``src`` (the
    upper's, inode ``key``) and ``dst`` (the user's, still the inode ``lst`` describes)."""
    sst, dstat = os.fstat(src), os.fstat(dst)
    if (sst.st_dev, sst.st_ino) != key or (dstat.st_dev, dstat.st_ino) != (lst.st_dev, lst.st_ino) \
            or not stat.S_ISREG(dstat.st_mode) or sst.st_size != dstat.st_size:
        return False
    if _user_xattrs(src) != _user_xattrs(dst):
        return False
    pos, size = 0, sst.st_size
    while pos < size:
        chunk = min(1 << 20, size - pos)
        a, b = os.pread(src, chunk, pos), os.pread(dst, chunk, pos)
        if a != b or not a:
            return False
        pos += len(a)
    return True
