"""Size-limited workspaces: the run writes into a sized tmpfs, copied back safely afterwards.

``RLIMIT_FSIZE`` bounds one file, not the total a run writes. With
``Limits(workspace_bytes=N)`` the run's ``/workspace`` is a tmpfs of N bytes that lowlevel
mounts on the host (``nosuid,nodev``, mode 0770, owned by the sandbox's ids), fills with the
workspace's content before the run, and copies back into the real workspace after the run,
when no process of the sandbox is left: writes past N fail with ENOSPC inside and the host
disk never sees more than N bytes from the run.

The copy back treats everything as untrusted: regular files, directories and symlinks (as
links, never followed) only; fifos, sockets and devices are skipped; setuid/setgid bits are
dropped; entries are created relative to directory fds with ``O_NOFOLLOW``.

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

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount_tmpfs(target: str, size: int, uid: int, gid: int) -> None:
    opts = f"size={size},mode=0770,uid={uid},gid={gid}".encode()
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


def _copy_untrusted(src_root: str, dst_root: str, uid: int | None = None, gid: int | None = None) -> None:
    """Copy src_root's content into dst_root (which exists), without following anything."""
    src_fd = os.open(src_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    dst_fd = os.open(dst_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _copy_dir(src_fd, dst_fd, uid, gid)
    finally:
        os.close(src_fd)
        os.close(dst_fd)


def _copy_dir(src_fd: int, dst_fd: int, uid: int | None, gid: int | None) -> None:
    for name in os.listdir(src_fd):
        st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        mode = stat.S_IMODE(st.st_mode) & 0o1777  # never setuid/setgid
        if stat.S_ISDIR(st.st_mode):
            try:
                os.mkdir(name, 0o700, dir_fd=dst_fd)
            except FileExistsError:
                pass
            sfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
            try:
                dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dst_fd)
            except OSError:
                os.close(sfd)
                raise
            try:
                _copy_dir(sfd, dfd, uid, gid)
                os.fchmod(dfd, mode)
                if uid is not None:
                    os.fchown(dfd, uid, gid if gid is not None else -1)
            finally:
                os.close(sfd)
                os.close(dfd)
        elif stat.S_ISREG(st.st_mode):
            sfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
            try:
                dfd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                              dir_fd=dst_fd)
                try:
                    while os.sendfile(dfd, sfd, None, 1 << 30) > 0:
                        pass
                    os.fchmod(dfd, mode)
                    if uid is not None:
                        os.fchown(dfd, uid, gid if gid is not None else -1)
                    os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
                finally:
                    os.close(dfd)
            finally:
                os.close(sfd)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
            if uid is not None:
                os.chown(name, uid, gid if gid is not None else -1, dir_fd=dst_fd, follow_symlinks=False)
        # fifos, sockets, devices: skipped (never opened)


class SizedWorkspace:
    """A sized tmpfs standing in for a workspace during one run.

    Usage: ``sw = SizedWorkspace.mount(workspace, size, uid, gid)``; bind ``sw.path`` at
    ``/workspace``; after the sandbox is gone, ``sw.finish()`` (copies back and unmounts);
    on any error path ``sw.discard()`` (unmounts, copies nothing).

    Raises:
        UnsupportedError: the caller may not mount (not root).
        WorkspaceError: the mount or the copy in failed (nothing is left mounted).
    """

    def __init__(self, workspace: str, path: str, uid: int, gid: int) -> None:
        self.workspace = workspace
        self.path = path
        self.uid = uid
        self.gid = gid
        self.mounted = True

    @classmethod
    def mount(cls, workspace: str, size: int, uid: int, gid: int,
              entry_ids: tuple[int, int] | None = None) -> "SizedWorkspace":
        """Mount the tmpfs beside ``workspace`` and copy the workspace's content in.

        Args:
            workspace: the real workspace (host path); left untouched until :meth:`finish`.
            size: tmpfs size, bytes.
            uid, gid: owner and group of the tmpfs root (mode 0770): the caller and the
                sandbox's gid, so the sandbox writes through the group and cannot chmod it.
            entry_ids: owner of the copied entries (the sandbox's host ids), or None to keep ours.
        """
        parent = os.path.dirname(workspace.rstrip("/"))
        path = tempfile.mkdtemp(prefix=".sized-", dir=parent)
        try:
            _mount_tmpfs(path, size, uid, gid)
        except BaseException:
            os.rmdir(path)
            raise
        sw = cls(workspace, path, uid, gid)
        try:
            _copy_untrusted(workspace, path, *(entry_ids or (None, None)))
        except OSError as err:
            sw.discard()
            if err.errno == errno.ENOSPC:
                raise WorkspaceError(errno.ENOSPC, f"the workspace's inputs do not fit in "
                                     f"workspace_bytes={size}") from err
            raise
        return sw

    def finish(self) -> None:
        """Replace the workspace's content with the tmpfs's (untrusted copy), then unmount."""
        if not self.mounted:
            return
        try:
            staging = tempfile.mkdtemp(prefix=".copyback-", dir=os.path.dirname(self.workspace.rstrip("/")))
            try:
                _copy_untrusted(self.path, staging)
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
