"""fd-relative file operations on untrusted trees, for every part of the overlay package.

Every path is opened with ``O_NOFOLLOW`` relative to a directory fd: xattrs read through the
directory's ``/proc/self/fd`` link, ``renameat2(2)`` (RENAME_NOREPLACE / RENAME_EXCHANGE),
statx(2) birth times and mount ids, file handles (name_to_handle_at(2)), mount-point checks,
and the iterative removal of a tree (:func:`_remove_tree`) with the commit's temporary names.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import stat
import struct

from lowlevel.workspace.walk import MAX_DEPTH

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: The two xattr namespaces overlayfs keeps its metadata in: ``trusted.`` for mounts made by
#: real root (reading them needs CAP_SYS_ADMIN), ``user.`` for ``userxattr`` mounts.
XATTR_PREFIXES = ("trusted.overlay.", "user.overlay.")


#: Names of the temporary entries a commit makes in the user's directory:
#: ``.lowlevel-commit-<pid>-<n>`` (a new file or directory being built, or an old directory
#: being removed) and ``.lowlevel-commit-<pid>.journal`` at the root (the directories holding
#: them). :func:`cleanup_commit_leftovers` removes those of dead pids. Upper entries with such
#: names are never committed.
LEFTOVER_PREFIX = ".lowlevel-commit-"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_serial = itertools.count(1)


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _lstat(dirfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _listxattr(target: int | str) -> list[str]:
    try:
        return os.listxattr(target, follow_symlinks=isinstance(target, int))
    except OSError as err:
        if err.errno in (errno.ENOTSUP, errno.ENODATA):
            return []
        raise


def _getxattr(target: int | str, attr: str) -> bytes | None:
    try:
        return os.getxattr(target, attr, follow_symlinks=isinstance(target, int))
    except OSError as err:
        if err.errno in (errno.ENOTSUP, errno.ENODATA):
            return None
        raise


def _at(dirfd: int, name: str) -> str:
    # os.*xattr have no dir_fd: go through the directory's /proc magic link; the last
    # component is not followed (follow_symlinks=False).
    return f"/proc/self/fd/{dirfd}/{name}"


# --- renameat2 -----------------------------------------------------------------------------

_libc: Any = None


def _renameat2(dirfd: int, old: str, newdirfd: int, new: str, flags: int) -> None:
    """renameat2(2) (Linux 3.15, glibc 2.28): RENAME_NOREPLACE / RENAME_EXCHANGE.

    Raises OSError (EINVAL where the filesystem does not support the flag).
    """
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        fn = lib.renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        _libc = fn
    if _libc(dirfd, os.fsencode(old), newdirfd, os.fsencode(new), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), new)


# --- statx btime and file handles (ctypes, glibc 2.28) ---------------------------------------

_AT_SYMLINK_NOFOLLOW = 0x100
_STATX_BTIME = 0x800
_syscalls: dict[str, Any] = {}


def _fn(name: str, argtypes: list[Any]) -> Any:
    fn = _syscalls.get(name)
    if fn is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        _syscalls[name] = fn
    return fn


def _btime_ns(dirfd: int, name: str) -> int | None:
    """Birth time of ``name`` (statx(2) ``stx_btime``, Linux 4.11; ext4, tmpfs, xfs, btrfs), or
    None where the filesystem does not record it."""
    try:
        fn = _fn("statx", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p])
    except AttributeError:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statx
    if fn(dirfd, os.fsencode(name), _AT_SYMLINK_NOFOLLOW, _STATX_BTIME, buf) != 0:
        return None
    mask, = struct.unpack_from("<I", buf, 0)
    if not mask & _STATX_BTIME:
        return None
    sec, nsec = struct.unpack_from("<qI", buf, 80)  # stx_btime
    return int(sec) * 1_000_000_000 + int(nsec)


_AT_EMPTY_PATH = 0x1000
_STATX_MNT_ID = 0x1000


def _mount_key(fd: int) -> tuple[str, int]:
    """Which mount ``fd`` is on: ``("mnt", id)`` (statx ``stx_mnt_id``, Linux 5.8), else
    ``("dev", st_dev)`` (a different filesystem only: a bind mount of the same one looks alike)."""
    try:
        fn = _fn("statx", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p])
    except AttributeError:
        fn = None
    if fn is not None:
        buf = ctypes.create_string_buffer(256)  # struct statx
        if fn(fd, b"", _AT_EMPTY_PATH | _AT_SYMLINK_NOFOLLOW, _STATX_MNT_ID, buf) == 0:
            mask, = struct.unpack_from("<I", buf, 0)
            if mask & _STATX_MNT_ID:
                mnt_id, = struct.unpack_from("<Q", buf, 144)  # stx_mnt_id
                return "mnt", int(mnt_id)
    return "dev", os.fstat(fd).st_dev


def _crosses_mount(parent_fd: int, child_fd: int) -> bool:
    """True when directory ``child_fd``, opened below ``parent_fd``, is the root of another mount.

    The copy-on-write lower layer never includes the workspace's submounts (overlayfs lower
    layers and ``open_tree`` without ``AT_RECURSIVE`` stop at them): the sandbox saw the
    directory *below* a mount point, so nothing it did is about what is mounted there, and the
    host side of a commit must never write, delete or list through one.
    """
    return _mount_key(parent_fd) != _mount_key(child_fd)


def _open_dir_here(dirfd: int, name: str) -> int:
    """``openat(dirfd, name, O_DIRECTORY|O_NOFOLLOW)`` that refuses (OSError EXDEV) a directory
    on another mount than ``dirfd``'s (a mount point in the user's directory)."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=dirfd)
    try:
        if _crosses_mount(dirfd, fd):
            raise OSError(errno.EXDEV, "a mount point: lowlevel never works through one", name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _handle(dirfd: int, name: str) -> tuple[int, bytes] | None:
    """``(handle_type, f_handle)`` of ``name`` (name_to_handle_at(2), no symlink followed)."""
    try:
        fn = _fn("name_to_handle_at", [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                                       ctypes.POINTER(ctypes.c_int), ctypes.c_int])
    except AttributeError:
        return None
    size = 128  # MAX_HANDLE_SZ
    buf = ctypes.create_string_buffer(8 + size)  # struct file_handle
    struct.pack_into("<I", buf, 0, size)
    mount_id = ctypes.c_int()
    if fn(dirfd, os.fsencode(name), buf, ctypes.byref(mount_id), 0) != 0:
        return None
    nbytes, htype = struct.unpack_from("<Ii", buf, 0)
    return htype, buf.raw[8:8 + nbytes]


def _copied_up_from(udirfd: int, uname: str, ldirfd: int, lname: str, prefix: str) -> bool:
    """Whether upper entry ``uname`` is a copy-up of exactly the lower inode now at ``lname``.

    Only ``trusted.overlay.origin`` holds the lower inode's file handle (``struct ovl_fb``:
    version, magic 0xfb, len, flags, type, 16-byte uuid, then the handle; fs/overlayfs/
    overlayfs.h); ``userxattr`` overlays store an empty origin, so they never qualify. A
    renamed copy-up carries its old name's origin and does not match.
    """
    if prefix != XATTR_PREFIXES[0]:
        return False
    origin = _getxattr(_at(udirfd, uname), prefix + "origin")
    if not origin or len(origin) < 21 or origin[1] != 0xFB or origin[2] != len(origin) or origin[3] & 0x4:
        return False  # not an ovl_fb, or a handle of an upper inode (OVL_FH_FLAG_PATH_UPPER)
    lower = _handle(ldirfd, lname)
    return lower is not None and lower == (origin[4], origin[21:])


# --- removing trees by fd ------------------------------------------------------------------


def _remove_tree(parent_fd: int, name: str) -> None:
    """Remove ``name`` (any kind; a directory with everything below it) from ``parent_fd``.

    Iterative, never follows a symlink, holds at most MAX_DEPTH + 1 directory fds: a
    directory deeper than that is first renamed up into ``parent_fd`` (under a leftover name)
    and removed afterwards. A caller that is not root makes its own directories ``u+rwx``
    when they block the removal (they are being deleted anyway). A missing ``name`` is fine.

    Raises:
        OSError: an entry could not be removed (it and its parents are left).
    """
    todo = [name]
    while todo:
        top = todo.pop()
        if _unlink_nondir(parent_fd, top):
            continue
        # (parent fd, parent's own parent fd and name, dir name, dir fd, names left)
        stack: list[tuple[int, str, int, list[str]]] = []
        try:
            stack.append((parent_fd, top, *_open_listing(parent_fd, top)))
            while stack:
                pfd, dname, fd, names = stack[-1]
                if not names:
                    stack.pop()
                    os.close(fd)
                    try:
                        os.rmdir(dname, dir_fd=pfd)
                    except FileNotFoundError:
                        pass
                    except PermissionError:
                        if not stack:
                            raise
                        _make_ours_writable(stack[-1][0], stack[-1][1])
                        os.rmdir(dname, dir_fd=pfd)
                    continue
                child = names.pop()
                try:
                    if _unlink_nondir(fd, child):
                        continue
                except PermissionError:
                    _make_ours_writable(pfd, dname)
                    if _unlink_nondir(fd, child):
                        continue
                if len(stack) > MAX_DEPTH:
                    lifted = _temp_name()
                    _renameat2(fd, child, parent_fd, lifted, _RENAME_NOREPLACE)
                    todo.append(lifted)
                    continue
                stack.append((fd, child, *_open_listing(fd, child)))
        finally:
            for _, _, fd, _ in stack:
                os.close(fd)


def _unlink_nondir(dirfd: int, name: str) -> bool:
    """unlink ``name`` unless it is a directory. True if it is gone (or was missing)."""
    try:
        os.unlink(name, dir_fd=dirfd)
        return True
    except FileNotFoundError:
        return True
    except IsADirectoryError:
        return False
    except PermissionError:
        st = _lstat(dirfd, name)
        if st is None:
            return True
        if stat.S_ISDIR(st.st_mode):
            return False  # some filesystems say EPERM for unlink(dir)
        raise


def _open_listing(dirfd: int, name: str) -> tuple[int, list[str]]:
    """Open directory ``name`` (no symlink) and list it; our own unreadable ones are made u+rwx."""
    try:
        fd = _open_dir_here(dirfd, name)
    except PermissionError:
        _make_ours_writable(dirfd, name)
        fd = _open_dir_here(dirfd, name)
    try:
        return fd, os.listdir(fd)
    except PermissionError:
        try:
            _make_ours_writable(dirfd, name)
            return fd, os.listdir(fd)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        os.close(fd)
        raise


def _make_ours_writable(dirfd: int, name: str) -> None:
    """``chmod u+rwx`` a directory we own that blocks its own removal (callers that are not
    root; root needs no such help). Raises PermissionError for anyone else's."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        st = os.fstat(fd)
        if os.geteuid() == 0 or st.st_uid != os.geteuid() or _crosses_mount(dirfd, fd):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
        # fchmod refuses O_PATH fds; chmod through the magic link reaches exactly this inode.
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
    finally:
        os.close(fd)


def _temp_name() -> str:
    return f"{LEFTOVER_PREFIX}{os.getpid()}-{next(_serial)}"
