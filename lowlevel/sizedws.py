"""Size-limited workspaces: the run writes into a sized tmpfs, copied back safely afterwards.

``RLIMIT_FSIZE`` bounds one file, not the total a run writes. With
``Limits(workspace_bytes=N)`` the run's ``/workspace`` is a tmpfs of N bytes that lowlevel
mounts on the host (``nosuid,nodev``, mode 0770, owned by the sandbox's ids), fills with the
workspace's content before the run, and copies back into the real workspace after the run,
when no process of the sandbox is left: writes past N fail with ENOSPC inside and the host
disk never sees more than N bytes from the run.

The copy back treats everything as untrusted: regular files, directories and symlinks (as
links, never followed) only; fifos, sockets and devices are skipped; setuid/setgid bits are
dropped; entries are created relative to directory fds with ``O_NOFOLLOW``. It is iterative and
stops at MAX_DEPTH directory levels; hard links stay links and sparse files stay sparse, and
it writes at most N data bytes (files past that are skipped, with a note), so neither can
blow N up on the host disk; the tmpfs's inodes are bounded too. Ownership is given as
:func:`lowlevel.workspace.give_back` does (recorded owners for pre-existing paths, the
workspace root's for new ones, no ``o+w`` on new entries).

Needs root (CAP_SYS_ADMIN in the initial namespaces) to mount; an unprivileged caller gets
:class:`UnsupportedError`. Source: tmpfs(5) ``size=``, mount(2), umount2(2) ``MNT_DETACH``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
import tempfile

from .errors import UnsupportedError, WorkspaceError
from .workspace import SETID_BITS

#: Directory levels copied (in and back); the copy is iterative and holds one fd pair per level.
MAX_DEPTH = 256

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount_tmpfs(target: str, size: int, uid: int, gid: int) -> None:
    # nr_inodes bounds what the run can create besides data (empty files, directories, links
    # each cost an inode and host disk space once copied back).
    opts = f"size={size},nr_inodes={max(1024, size // 1024)},mode=0770,uid={uid},gid={gid}".encode()
    if _libc.mount(b"tmpfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        if err == errno.EPERM:
            raise UnsupportedError("workspace-size", "Limits.workspace_bytes needs root to mount a sized "
                                   "tmpfs for the workspace", "run as root, or drop workspace_bytes and rely "
                                   "on RLIMIT_FSIZE per file")
        raise WorkspaceError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def _umount(target: str) -> None:
    if _libc.umount2(target.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise WorkspaceError(err, f"umount {target}: {os.strerror(err)}")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: ``{relpath: (uid, gid, st_mode)}`` of the workspace's entries before the run.
Owners = dict[str, tuple[int, int, int]]


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The data extents ``(offset, length)`` of a file (SEEK_DATA/SEEK_HOLE): holes cost nothing."""
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as err:
            if err.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end > start:
            out.append((start, end - start))
        pos = max(end, start + 1)
    return out


class _Copier:
    """One untrusted copy, iterative (no recursion), at most MAX_DEPTH directory levels deep.

    Hard links stay hard links (within the copy), sparse files stay sparse, and with a
    ``budget`` the data bytes written stop at it: a file that does not fit is skipped and noted.
    """

    def __init__(self, *, ids: tuple[int, int] | None = None, owners: Owners | None = None,
                 new_owner: tuple[int, int] | None = None, budget: int | None = None,
                 record: Owners | None = None, refuse_deep: bool = False) -> None:
        self.ids = ids                  # every entry to these ids (the copy in)
        self.owners = owners            # the copy back: recorded owners of pre-existing paths
        self.new_owner = new_owner      # ... and the owner of new ones
        self.budget = budget
        self.record = record
        self.refuse_deep = refuse_deep
        self.used = 0
        self.links: dict[tuple[int, int], str] = {}
        self.skipped: list[str] = []
        self.too_deep: list[str] = []

    def _ids_mode(self, rel: str, st: os.stat_result) -> tuple[tuple[int, int] | None, int]:
        mode = stat.S_IMODE(st.st_mode) & ~SETID_BITS  # never setuid/setgid on a copied file
        if self.owners is None or self.new_owner is None:
            return self.ids, mode
        prev = self.owners.get(rel)
        if prev is not None and stat.S_IFMT(prev[2]) == stat.S_IFMT(st.st_mode):
            if not prev[2] & stat.S_IWOTH:
                mode &= ~stat.S_IWOTH
            if stat.S_ISDIR(st.st_mode):
                mode |= prev[2] & stat.S_ISGID  # a directory's setgid bit grants nothing
            return (prev[0], prev[1]), mode
        return self.new_owner, mode & ~stat.S_IWOTH

    def notes(self) -> list[str]:
        out = []
        if self.skipped:
            out.append(f"workspace copy back: {len(self.skipped)} file(s) skipped, over the workspace_bytes "
                       f"budget (hard links, sparse files): {', '.join(self.skipped[:10])}"
                       + (" ..." if len(self.skipped) > 10 else ""))
        if self.too_deep:
            out.append(f"workspace copy back: content more than {MAX_DEPTH} directories deep was not copied "
                       f"back: below {', '.join(self.too_deep[:5])}" + (" ..." if len(self.too_deep) > 5 else ""))
        return out

    def copy(self, src_root: str, dst_root: str) -> None:
        src_fd = os.open(src_root, _DIR_FLAGS)
        try:
            dst_fd = os.open(dst_root, _DIR_FLAGS)
        except BaseException:
            os.close(src_fd)
            raise
        # Each level: (src dir fd, dst dir fd, rel dir, remaining names); at most MAX_DEPTH + 1 levels.
        stack: list[tuple[int, int, str, list[str]]] = [(src_fd, dst_fd, "", sorted(os.listdir(src_fd),
                                                                                   reverse=True))]
        self.root_fd = dst_fd
        try:
            while stack:
                sfd, dfd, rel_dir, names = stack[-1]
                if not names:
                    stack.pop()
                    os.close(sfd)
                    os.close(dfd)
                    continue
                name = names.pop()
                rel = f"{rel_dir}/{name}" if rel_dir else name
                child = self._entry(sfd, dfd, name, rel, len(stack))
                if child is not None:
                    stack.append((child[0], child[1], rel, sorted(os.listdir(child[0]), reverse=True)))
        finally:
            for sfd, dfd, _, _ in stack:
                os.close(sfd)
                os.close(dfd)

    def _entry(self, sfd: int, dfd: int, name: str, rel: str, depth: int) -> tuple[int, int] | None:
        try:
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if self.record is not None:
            self.record[rel] = (st.st_uid, st.st_gid, st.st_mode)
        ids, mode = self._ids_mode(rel, st)
        if stat.S_ISDIR(st.st_mode):
            if depth > MAX_DEPTH:
                if self.refuse_deep:
                    raise WorkspaceError(errno.ELOOP, f"workspace has directories more than {MAX_DEPTH} levels "
                                         f"deep ({rel}): too deep for a size-limited workspace")
                self.too_deep.append(rel)
                return None
            try:
                os.mkdir(name, 0o700, dir_fd=dfd)
            except FileExistsError:
                pass
            nsfd = os.open(name, _DIR_FLAGS, dir_fd=sfd)
            try:
                ndfd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                os.fchmod(ndfd, mode)  # root writes into it regardless of its mode
                if ids is not None:
                    os.fchown(ndfd, *ids)
            except BaseException:
                os.close(nsfd)
                raise
            return nsfd, ndfd
        if stat.S_ISREG(st.st_mode):
            self._file(sfd, dfd, name, rel, st, ids, mode)
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=sfd)
            if self.budget is not None and self.used + len(target) > self.budget:
                self.skipped.append(rel)
                return None
            self.used += len(target)
            os.symlink(target, name, dir_fd=dfd)
            if ids is not None:
                os.chown(name, *ids, dir_fd=dfd, follow_symlinks=False)
        # fifos, sockets, devices: skipped (never opened)
        return None

    def _file(self, sfd: int, dfd: int, name: str, rel: str, st: os.stat_result,
              ids: tuple[int, int] | None, mode: int) -> None:
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in self.links:
            try:
                os.link(self.links[key], name, src_dir_fd=self.root_fd, dst_dir_fd=dfd, follow_symlinks=False)
                return
            except OSError:
                pass  # (a path too long): copy it as a file of its own, within the budget
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
        try:
            extents = _extents(fd, st.st_size)
            data = sum(length for _, length in extents)
            if self.budget is not None and self.used + data > self.budget:
                self.skipped.append(rel)
                return
            self.used += data
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=dfd)
            try:
                for offset, length in extents:
                    os.lseek(out, offset, os.SEEK_SET)
                    while length > 0:
                        n = os.sendfile(out, fd, offset, length)
                        if n <= 0:
                            break
                        offset += n
                        length -= n
                os.ftruncate(out, st.st_size)
                os.fchmod(out, mode)
                if ids is not None:
                    os.fchown(out, *ids)
                os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(out)
        finally:
            os.close(fd)
        if st.st_nlink > 1:
            self.links.setdefault(key, rel)


class SizedWorkspace:
    """A sized tmpfs standing in for a workspace during one run.

    Usage: ``sw = SizedWorkspace.mount(workspace, size, uid, gid)``; bind ``sw.path`` at
    ``/workspace``; after the sandbox is gone, ``sw.finish()`` (copies back and unmounts);
    on any error path ``sw.discard()`` (unmounts, copies nothing). ``finish()`` returns notes.

    Raises:
        UnsupportedError: the caller may not mount (not root).
        WorkspaceError: the mount or the copy in failed (nothing is left mounted).
    """

    def __init__(self, workspace: str, path: str, uid: int, gid: int, size: int = 0) -> None:
        self.workspace = workspace
        self.path = path
        self.uid = uid
        self.gid = gid
        self.size = size
        self.mounted = True
        #: ``{relpath: (uid, gid, st_mode)}`` of the workspace before the run (see :meth:`finish`).
        self.owners: Owners = {}
        #: Owner and group of entries the run created: the workspace root's.
        self.new_owner = (uid, gid)

    @classmethod
    def mount(cls, workspace: str, size: int, uid: int, gid: int,
              entry_ids: tuple[int, int] | None = None) -> "SizedWorkspace":
        """Mount the tmpfs beside ``workspace`` and copy the workspace's content in.

        Args:
            workspace: the real workspace (host path); left untouched until :meth:`finish`.
            size: tmpfs size, bytes (also bounds its inodes: ``nr_inodes=max(1024, size // 1024)``).
            uid, gid: owner and group of the tmpfs root (mode 0770): the caller and the
                sandbox's gid, so the sandbox writes through the group and cannot chmod it.
            entry_ids: owner of the copied entries (the sandbox's host ids), or None to keep ours.
        Raises:
            WorkspaceError: the inputs do not fit (ENOSPC), or the workspace is more than
                MAX_DEPTH directories deep (ELOOP): its deeper content could not come back.
        """
        parent = os.path.dirname(workspace.rstrip("/"))
        path = tempfile.mkdtemp(prefix=".sized-", dir=parent)
        try:
            _mount_tmpfs(path, size, uid, gid)
        except BaseException:
            os.rmdir(path)
            raise
        sw = cls(workspace, path, uid, gid, size)
        try:
            st = os.stat(workspace, follow_symlinks=False)
            sw.new_owner = (st.st_uid, st.st_gid)
            _Copier(ids=entry_ids, record=sw.owners, refuse_deep=True).copy(workspace, path)
        except OSError as err:
            sw.discard()
            if err.errno == errno.ENOSPC:
                raise WorkspaceError(errno.ENOSPC, f"the workspace's inputs do not fit in "
                                     f"workspace_bytes={size}") from err
            raise
        except BaseException:
            sw.discard()
            raise
        return sw

    def finish(self) -> list[str]:
        """Replace the workspace's content with the tmpfs's (untrusted copy), then unmount.

        The copy back: at most MAX_DEPTH directory levels (deeper content is dropped), hard
        links kept as links, sparse files kept sparse, at most ``size`` data bytes in all
        (files past it are skipped), so the host disk gets no more than the tmpfs held.
        Ownership follows :func:`lowlevel.workspace.give_back`: a path that existed before the
        run gets its recorded uid and gid (and keeps ``o+w`` only if it had it), a new one the
        workspace root's owner and group without ``o+w``; no file is setuid/setgid.

        Returns:
            Notes for ``Result.notes`` (what was skipped), empty when everything came back.
        """
        if not self.mounted:
            return []
        copier = _Copier(owners=self.owners, new_owner=self.new_owner, budget=self.size)
        try:
            staging = tempfile.mkdtemp(prefix=".copyback-", dir=os.path.dirname(self.workspace.rstrip("/")))
            try:
                copier.copy(self.path, staging)
                for name in os.listdir(self.workspace):
                    target = os.path.join(self.workspace, name)
                    if os.path.isdir(target) and not os.path.islink(target):
                        shutil.rmtree(target)
                    else:
                        os.unlink(target)
                for name in os.listdir(staging):
                    os.rename(os.path.join(staging, name), os.path.join(self.workspace, name))
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        finally:
            self.discard()
        return copier.notes()

    def discard(self) -> None:
        """Unmount and remove the tmpfs mount point (its content is dropped). Idempotent."""
        if self.mounted:
            _umount(self.path)
            self.mounted = False
            try:
                os.rmdir(self.path)
            except OSError:
                pass


__all__ = ["SizedWorkspace"]
