"""Copy-on-write workspaces: read an overlayfs upper directory, commit it, save it. Fds only.

A copy-on-write run mounts overlayfs with the user's directory as the read-only *lower* layer
and a per-run *upper* directory (on a sized tmpfs) taking every write; the sandbox sees the
merged tree. After the run the caller holds two ``O_DIRECTORY`` fds: ``upper_fd`` on the upper
directory (the mount namespace may be gone) and ``lower_fd`` on the user's directory. This
module turns the upper into a change report (:func:`read_changes`), applies it to the user's
directory (:func:`commit`), or copies it aside for the user (:func:`save_upper`) after a
conflict. Nothing here mounts anything.

What an upper directory holds (Documentation/filesystems/overlayfs.rst, "whiteouts and opaque
directories"; checked on Linux 6.18, see ``/work/shared/notes/overlay-workspace.md``):

- every entry the run created or changed, whole (a file appended to is *copied up*: the upper
  holds the full new content);
- a *whiteout* for every lower entry the run removed: a character device 0/0, or (never made
  by overlayfs itself, accepted here) a zero-size regular file with the ``<prefix>whiteout``
  xattr;
- *opaque* directories, ``<prefix>opaque`` = ``"y"``: the lower directory of that name is hidden
  entirely (``rm -rf d && mkdir d``). ``"x"`` is not opaque (it marks a directory holding
  xattr whiteouts);
- renames as delete + add: with ``redirect_dir`` off/nofollow, renaming a lower directory
  fails with EXDEV and ``mv`` copies it, so the upper holds a whiteout at the old name and a
  full copy at the new one. Uppers written with ``redirect_dir=on`` (``<prefix>redirect``) or
  ``metacopy=on`` (``<prefix>metacopy``: the upper file has no data) cannot be read
  correctly from the upper alone and are refused (WorkspaceError EOPNOTSUPP).

``<prefix>`` is ``"trusted.overlay."`` for overlays mounted by real root and ``"user.overlay."``
for ``userxattr`` mounts (unprivileged callers, in a user namespace). Note: on Linux 6.x with
``CONFIG_OVERLAY_FS_REDIRECT_ALWAYS_FOLLOW``, ``redirect_dir=off`` means ``follow``, which the
kernel refuses together with ``userxattr`` ("conflicting options"): mount ``userxattr``
overlays with ``redirect_dir=nofollow``.

Paths: every relative path reported here is built from the names ``os.listdir`` returns for a
directory fd: ``str`` decoded with the filesystem encoding and ``surrogateescape`` (PEP 383),
``/``-separated, without a leading ``./``. A non-UTF-8 name is kept exactly (``os.fsencode(path)``
gives its bytes back) and never crashes the walk; printing such a ``str`` to a strict UTF-8
stream raises, so encode it first.

Everything in an upper directory is untrusted (the sandbox made it). Never followed: every
open uses ``O_NOFOLLOW`` relative to a directory fd (``openat``/``unlinkat``/``renameat2``); no
path is ever walked from ``/``. Only the lower listing of a directory the upper marks opaque is
read (and, by :func:`commit`, the lower subtrees it deletes or replaces): the cost is
O(entries in the upper), never O(the user's directory).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import os
import signal
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lowlevel.errors import CommitConflictError, CommitIncompleteError, LowlevelError, WorkspaceError
from lowlevel.workspace.changes import Changes
from lowlevel.workspace.handover import ACL_XATTRS, SETID_BITS
from lowlevel.workspace.walk import MAX_DEPTH, MAX_SNAPSHOT_ENTRIES

#: The two xattr namespaces overlayfs keeps its metadata in: ``trusted.`` for mounts made by
#: real root (reading them needs CAP_SYS_ADMIN), ``user.`` for ``userxattr`` mounts.
XATTR_PREFIXES = ("trusted.overlay.", "user.overlay.")
#: Names of the temporary entries a commit makes in the user's directory:
#: ``.lowlevel-commit-<pid>-<n>`` (a new file or directory being built, or an old directory
#: being removed) and ``.lowlevel-commit-<pid>.journal`` at the root (the directories holding
#: them). :func:`cleanup_commit_leftovers` removes those of dead pids. Upper entries with such
#: names are never committed.
LEFTOVER_PREFIX = ".lowlevel-commit-"
#: Files written by :func:`save_upper` next to the saved ``tree``.
SAVED_WHITEOUTS = "whiteouts"
SAVED_OPAQUE = "opaque"
SAVED_SKIPPED = "skipped"
#: Files :func:`commit` adds next to a saved ``tree`` when it stopped or found host changes
#: part-way: the relative paths it applied, and those it did not (NUL-terminated each).
SAVED_APPLIED = "applied"
SAVED_NOT_APPLIED = "not-applied"
#: errnos that stop a commit's apply pass (:class:`CommitIncompleteError`): the user's
#: filesystem cannot take more (full, out of quota, file too big for it or past ``max_bytes``)
#: or cannot be written at all (read-only, failing).
STOP_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})
#: Those of STOP_ERRNOS that mean "out of room": a run's commit stopped by one always raises
#: (lowlevel.sandbox.launcher; a read-only workspace where nothing was applied is a warning instead).
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: Cap on hard-linked new files a commit links instead of copying (one O_PATH fd each).
MAX_LINKED = 256

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
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


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    """What identifies one state of an entry: device, inode, type and mode, ctime, mtime, size."""
    return (st.st_dev, st.st_ino, st.st_mode, st.st_ctime_ns, st.st_mtime_ns, st.st_size)


#: fcntl(2) F_SETSIG: the signal a lease break sends (default SIGIO, whose default action
#: kills the process). SIGURG is ignored by default; the owner is cleared right after anyway.
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_serial = itertools.count(1)
_MOUNT_POINT = ("a mount point in the workspace (the sandbox saw the directory below it): never written, deleted "
                "or listed through")


@dataclass(frozen=True)
class CommitReport:
    """What :func:`commit` did to the user's directory.

    Attributes:
        changes: the entries applied (added / modified / deleted relative paths, sorted; a
            deleted directory is listed alone, its contents implied). ``bytes_written`` is the
            upper's allocated bytes (``st_blocks * 512``) of the entries applied.
        bytes_copied: file content copied into the user's directory (bytes).
        skipped: ``(relative path, reason)`` for each upper entry not applied: fifos, sockets
            and devices, reserved names, entries too deep, entries a non-root caller cannot
            write without changing their owner, mount points. (Entries the host changed
            during the commit are not skipped quietly: :func:`commit` raises
            :class:`CommitConflictError` for them after its apply pass.)
        notes: one-line remarks for ``Result.notes`` (what was approximated and why).
    """

    changes: Changes
    bytes_copied: int = 0
    skipped: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()


def _check_prefix(xattr_prefix: str) -> None:
    if xattr_prefix not in XATTR_PREFIXES:
        raise ValueError(f"xattr_prefix must be one of {XATTR_PREFIXES}, not {xattr_prefix!r}")
    if xattr_prefix.startswith("trusted.") and os.geteuid() != 0:
        raise ValueError("xattr_prefix 'trusted.overlay.' is for overlays mounted by root: trusted.* xattrs "
                         "are readable only with CAP_SYS_ADMIN; an unprivileged caller's userxattr overlay "
                         "uses 'user.overlay.'")


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


def _is_whiteout(st: os.stat_result, dirfd: int, name: str, prefix: str, xwhiteouts: bool) -> bool:
    """A 0/0 character device, or (in a directory marked ``<prefix>opaque`` = ``"x"``, as the
    kernel requires) a zero-size regular file with ``<prefix>whiteout``.

    Also refuses a metacopy file (its data lives in the lower layer): a regular file with a
    size but no blocks is the only candidate, so ordinary files cost no xattr read. An empty
    metacopy file would be harmless (there is no data to miss).
    """
    mode = st.st_mode
    if stat.S_ISCHR(mode):
        return st.st_rdev == 0
    if not stat.S_ISREG(mode) or st.st_blocks:
        return False
    if st.st_size:
        if prefix + "metacopy" in _listxattr(_at(dirfd, name)):
            raise WorkspaceError(errno.EOPNOTSUPP, f"upper entry {name!r} is a metacopy file (its data lives in "
                                 "the lower layer): mount the overlay with metacopy=off")
        return False
    return xwhiteouts and prefix + "whiteout" in _listxattr(_at(dirfd, name))


def _dir_flags(fd: int, rel: str, prefix: str) -> tuple[bool, bool]:
    """``(opaque, holds xattr whiteouts)`` of upper directory ``fd``; refuse redirected ones."""
    attrs = _listxattr(fd)
    if prefix + "redirect" in attrs:
        raise WorkspaceError(errno.EOPNOTSUPP, f"upper directory {rel!r} is a redirected (renamed) lower "
                             "directory: mount the overlay with redirect_dir=off (root) or nofollow (userxattr)")
    if prefix + "opaque" not in attrs:
        return False, False
    value = _getxattr(fd, prefix + "opaque")
    return value == b"y", value == b"x"


# --- the change report ---------------------------------------------------------------------


def read_changes(upper_fd: int, lower_fd: int, *, xattr_prefix: str,
                 limit: int = MAX_SNAPSHOT_ENTRIES) -> Changes:
    """What a copy-on-write run changed, read from its upper directory. Changes nothing.

    Classification of each upper entry against the lower entry of the same path:

    - whiteout: ``deleted`` if the lower has the entry (a deleted directory is listed alone:
      its contents are implied and not walked), else ignored.
    - directory: ``added`` if the lower has nothing there; if the lower has a directory, not
      reported unless its permission bits differ (``modified``), and its children are
      compared in turn; if the lower has a non-directory, ``modified`` (a kind change is one
      ``modified`` entry, not deleted + added) and every child is ``added``.
    - opaque directory (``<prefix>opaque`` = ``"y"``), and every directory below one: the lower
      directory of that path is listed and its entries absent from the upper are ``deleted``.
    - anything else (file, symlink, fifo, socket, device): ``modified`` if the lower has an
      entry of that name, whatever its kind, else ``added``. A file merely copied up (opened
      for writing, chmod, touch) counts as modified.

    The upper root's own metadata is never reported (it belongs to the mount, not the run).
    A host change to the lower during the run shows too: a file the host created where the
    run created one is ``modified``; a file the host deleted that the run modified is ``added``.

    Args:
        upper_fd: ``O_DIRECTORY`` fd on the upper directory (not modified, offset unused).
        lower_fd: ``O_DIRECTORY`` fd on the user's directory (the lower layer as the host
            sees it; only stat'ed, and listed under opaque directories).
        xattr_prefix: ``"trusted.overlay."`` (overlay mounted by root) or ``"user.overlay."``
            (``userxattr`` mount).
        limit: paths to report; past it the walk goes on for ``bytes_written`` but records
            no more paths and ``complete`` is False.
    Returns:
        :class:`lowlevel.workspace.Changes` with sorted ``added``/``modified``/``deleted``,
        ``complete`` (False past ``limit`` or MAX_DEPTH levels, or when the run made a
        directory unreadable to an unprivileged caller: such directories are reported but not
        entered), and ``bytes_written``: bytes allocated in the upper
        (``st_blocks * 512`` of every entry below the root, each inode once).
    Raises:
        ValueError: unknown ``xattr_prefix``, or ``trusted.overlay.`` without root.
        WorkspaceError: an fd is not a readable directory, the upper cannot be read, or it
            was written with ``redirect_dir=on`` or ``metacopy=on`` (EOPNOTSUPP).
    """
    _check_prefix(xattr_prefix)
    added: list[str] = []
    modified: list[str] = []
    deleted: list[str] = []
    inodes: set[tuple[int, int]] = set()
    total = 0
    count = 0
    complete = True
    # Each frame: upper dir fd, lower dir fd (None: no lower dir at this path), relative path,
    # names left (reversed), effectively opaque, holds xattr whiteouts.
    stack: list[tuple[int, int | None, str, list[str], bool, bool]] = []

    def record(lst: list[str], rel: str) -> None:
        nonlocal count, complete
        if count < limit:
            lst.append(rel)
            count += 1
        else:
            complete = False

    def enter(ufd: int, lfd: int | None, rel: str, opaque: bool, xwhiteouts: bool) -> None:
        nonlocal complete
        try:
            names = os.listdir(ufd)
            if opaque and lfd is not None:
                present = set(names)
                try:
                    lower_names = sorted(os.listdir(lfd))
                except PermissionError:
                    lower_names = []
                    complete = False  # someone else's unreadable directory: its old entries unknown
                for name in lower_names:
                    if name not in present:
                        record(deleted, _join(rel, name))
        except BaseException:
            os.close(ufd)
            if lfd is not None:
                os.close(lfd)
            raise
        names.reverse()
        stack.append((ufd, lfd, rel, names, opaque, xwhiteouts))

    try:
        try:
            ufd0 = os.open(".", _DIR_FLAGS, dir_fd=upper_fd)
        except OSError as err:
            raise WorkspaceError(err.errno, f"cannot open the upper directory: {err.strerror}") from err
        try:
            lfd0 = os.open(".", _DIR_FLAGS, dir_fd=lower_fd)
        except OSError as err:
            os.close(ufd0)
            raise WorkspaceError(err.errno, f"cannot open the workspace directory: {err.strerror}") from err
        try:
            # The root is never opaque (overlayfs merges the layer roots), but may hold xattr whiteouts.
            root_x = _dir_flags(ufd0, ".", xattr_prefix)[1]
        except BaseException:
            os.close(ufd0)
            os.close(lfd0)
            raise
        enter(ufd0, lfd0, "", False, root_x)
        while stack:
            ufd, lfd, rel_dir, names, opaque, xwhiteouts = stack[-1]
            if not names:
                stack.pop()
                os.close(ufd)
                if lfd is not None:
                    os.close(lfd)
                continue
            name = names.pop()
            ust = _lstat(ufd, name)
            if ust is None:
                continue
            rel = _join(rel_dir, name)
            key = (ust.st_dev, ust.st_ino)
            if key not in inodes:
                inodes.add(key)
                total += ust.st_blocks * 512
            lst = _lstat(lfd, name) if lfd is not None else None
            mode = ust.st_mode
            if not stat.S_ISDIR(mode):
                if _is_whiteout(ust, ufd, name, xattr_prefix, xwhiteouts):
                    if lst is not None:
                        record(deleted, rel)
                else:
                    record(added if lst is None else modified, rel)
                continue
            if lst is None:
                record(added, rel)
            elif not stat.S_ISDIR(lst.st_mode) or stat.S_IMODE(lst.st_mode) != stat.S_IMODE(mode):
                record(modified, rel)
            if len(stack) > MAX_DEPTH:
                complete = False
                continue
            try:
                cfd = os.open(name, _DIR_FLAGS, dir_fd=ufd)
            except PermissionError:
                # The run made it unreadable to its owner (chmod 000), and an unprivileged
                # caller is that owner without CAP_DAC_OVERRIDE: reported, not entered.
                complete = False
                continue
            try:
                is_opaque, child_x = _dir_flags(cfd, rel, xattr_prefix)
                child_opaque = opaque or is_opaque
                clfd = None
                if lst is not None and lfd is not None and stat.S_ISDIR(lst.st_mode):
                    try:
                        clfd = _open_dir_here(lfd, name)
                    except OSError as err:
                        if err.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EXDEV):
                            raise
                        complete = False  # changed meanwhile, unreadable or a mount point: not compared
            except BaseException:
                os.close(cfd)
                raise
            enter(cfd, clfd, rel, child_opaque, child_x)
    except WorkspaceError:
        raise
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot read the upper directory: {err}") from err
    finally:
        for ufd, lfd, _, _, _, _ in stack:
            os.close(ufd)
            if lfd is not None:
                os.close(lfd)
    return Changes(tuple(sorted(added)), tuple(sorted(modified)), tuple(sorted(deleted)), complete, total)


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


# --- leftovers -----------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parse_leftover(name: str) -> tuple[int, bool] | None:
    """``(pid, is_journal)`` for a leftover name, else None."""
    if not name.startswith(LEFTOVER_PREFIX):
        return None
    rest = name[len(LEFTOVER_PREFIX):]
    if rest.endswith(".journal"):
        pid_s, journal = rest[:-len(".journal")], True
    else:
        pid_s, _, serial = rest.partition("-")
        journal = False
        if not serial.isdigit() or not serial.isascii():
            return None
    if not pid_s.isdigit() or not pid_s.isascii() or len(pid_s) > 10:
        return None
    return int(pid_s), journal


def _open_rel(rootfd: int, rel: str) -> int:
    """Open directory ``rel`` below ``rootfd``, component by component, never following a symlink."""
    fd = os.open(".", _DIR_FLAGS, dir_fd=rootfd)
    try:
        for part in rel.split("/") if rel else ():
            if part in ("", ".", ".."):
                raise OSError(errno.EINVAL, "invalid path component", rel)
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def cleanup_commit_leftovers(lower_fd: int) -> list[str]:
    """Remove what commits killed mid-way (SIGKILL, power loss of the process) left behind.

    A commit journals, in ``.lowlevel-commit-<pid>.journal`` at the root of the user's
    directory, every directory where it makes temporary ``.lowlevel-commit-<pid>-<n>``
    entries, before making them. For each journal whose ``pid`` no longer exists (``kill(pid,
    0)`` gives ESRCH; pids are those of the caller's pid namespace), this removes the
    temporary entries of that pid in the journaled directories (whole trees: a half-built
    new directory, or an old directory that was being deleted; see :func:`commit`), then the
    journal. Root-level leftovers of dead pids without a journal go too. A leftover of a pid
    reused by a live process stays until that process exits. Cost: one listing of the root
    plus one per journaled directory. :func:`commit` calls it first.

    Args:
        lower_fd: ``O_DIRECTORY`` fd on the user's directory.
    Returns:
        The relative paths removed (sorted).
    Raises:
        WorkspaceError: the directory cannot be listed, or a leftover cannot be removed.
    """
    removed: list[str] = []
    try:
        rootfd = os.open(".", _DIR_FLAGS, dir_fd=lower_fd)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot open the workspace directory: {err.strerror}") from err
    try:
        names = [n for n in os.listdir(rootfd) if n.startswith(LEFTOVER_PREFIX)]
        dead: dict[int, bool] = {}
        for name in names:
            parsed = _parse_leftover(name)
            if parsed is not None and parsed[0] not in dead:
                dead[parsed[0]] = not _pid_alive(parsed[0])
        for name in sorted(names):
            parsed = _parse_leftover(name)
            if parsed is None or not dead[parsed[0]]:
                continue
            pid, journal = parsed
            if not journal:
                _remove_tree(rootfd, name)
                removed.append(name)
                continue
            fd = os.open(name, _READ_FLAGS, dir_fd=rootfd)
            try:
                data = b""
                while chunk := os.read(fd, 1 << 16):
                    data += chunk
            finally:
                os.close(fd)
            mine = f"{LEFTOVER_PREFIX}{pid}-"
            for raw in sorted(set(data.split(b"\0")) - {b""}):
                rel = os.fsdecode(raw)
                try:
                    dfd = _open_rel(rootfd, rel)
                except OSError:
                    continue  # gone or no longer a directory: nothing of ours can be left in it
                try:
                    for leftover in os.listdir(dfd):
                        p = _parse_leftover(leftover)
                        if leftover.startswith(mine) and p is not None and not p[1]:
                            _remove_tree(dfd, leftover)
                            removed.append(_join(rel, leftover))
                finally:
                    os.close(dfd)
            os.unlink(name, dir_fd=rootfd)
            removed.append(name)
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot remove commit leftovers: {err}") from err
    finally:
        os.close(rootfd)
    return sorted(set(removed))


# --- commit and save -----------------------------------------------------------------------


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


class _Applier:
    """The commit walk. Runs twice over the same upper: a dry pass (``dry=True``: checks,
    conflicts, byte budget, decisions; changes nothing) then the apply pass, which follows
    the dry pass's decisions."""

    def __init__(self, upper_fd: int, target_fd: int, *, prefix: str, since_ns: int | None,
                 new_owner: tuple[int, int] | None, max_bytes: int | None, save: bool) -> None:
        self.upper_fd = upper_fd
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
        return self.since_ns is not None and st.st_ctime_ns > self.since_ns

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
            except KeyboardInterrupt:
                continue
            except OSError:
                self.left_behind = True
            self.pending.pop()

    # -- the walk

    def run(self, dry: bool) -> None:
        self.dry = dry
        self.reset()
        ufd = os.open(".", _DIR_FLAGS, dir_fd=self.upper_fd)
        try:
            tfd = os.open(".", _DIR_FLAGS, dir_fd=self.target_fd)
        except BaseException:
            os.close(ufd)
            raise
        self.stack.append(_Frame(ufd, tfd, "", opaque=False, fresh=self.save))
        try:
            self.stack[0].xwhiteouts = _dir_flags(ufd, ".", self.prefix)[1]
            self.stack[0].names = sorted(os.listdir(ufd), reverse=True)
            while self.stack:
                frame = self.stack[-1]
                if frame.gone:
                    self.delete_lower(frame, frame.gone.pop(), None)
                elif frame.names:
                    self.entry(frame, frame.names.pop())
                else:
                    try:
                        self.leave(frame)
                    finally:
                        self.pop()
        except OSError as err:
            if not dry and err.errno in STOP_ERRNOS:
                # Stopped: the new directories still being built (under temporary names, which
                # finish() removes) hold nothing that was applied.
                heads = tuple(f"{f.rel}/" for f in self.stack if f.fresh and f.temp is not None)
                if heads:
                    for done in (self.added, self.modified, self.deleted):
                        done[:] = [p for p in done if not p.startswith(heads)]
            raise
        finally:
            while self.stack:
                self.pop()
            for fd in self.links.values():
                os.close(fd)
            self.links.clear()

    def pop(self) -> None:
        frame = self.stack.pop()
        os.close(frame.ufd)
        if frame.tfd is not None:
            if any(p[0] == frame.tfd for p in self.pending):
                self.held.append(frame.tfd)  # finish() removes its temporaries, then closes it
            else:
                os.close(frame.tfd)

    def finish(self, rootfd: int) -> None:
        """After the apply pass, however it ended: remove the temporaries still registered
        (all of them when it was interrupted), close what is held, remove the journal unless
        something could not be removed. Retried until done if interrupted (KeyboardInterrupt)."""
        while True:
            try:
                self.abort_cleanup()
                while self.held:
                    fd = self.held.pop()
                    os.close(fd)
                if self.journal_fd is not None:
                    fd, self.journal_fd = self.journal_fd, None
                    os.close(fd)
                if self.journal_name and not self.left_behind:
                    try:
                        os.unlink(self.journal_name, dir_fd=rootfd)
                    except FileNotFoundError:
                        pass
                    self.journal_name = ""
                return
            except KeyboardInterrupt:
                continue

    def push(self, frame: _Frame, lower_names: list[str] | None) -> None:
        """Put ``frame`` (owning its fds from now on) on the stack and list its upper dir."""
        self.stack.append(frame)
        frame.names = sorted(os.listdir(frame.ufd), reverse=True)
        if lower_names is not None:
            present = set(frame.names)
            frame.gone = sorted((n for n in lower_names if n not in present), reverse=True)

    def entry(self, frame: _Frame, name: str) -> None:
        rel = _join(frame.rel, name)
        if self.decided(rel):
            return
        ust = _lstat(frame.ufd, name)
        if ust is None:
            return
        if name.startswith(LEFTOVER_PREFIX):
            self.skip(rel, f"reserved name (lowlevel's commit temporaries start with {LEFTOVER_PREFIX!r})")
            return
        lst = _lstat(frame.tfd, name) if not frame.fresh and frame.tfd is not None else None
        mode = ust.st_mode
        if _is_whiteout(ust, frame.ufd, name, self.prefix, frame.xwhiteouts):
            if self.save:
                self.whiteouts.append(rel)
            elif lst is not None:
                self.delete_lower(frame, name, lst)
            return
        if stat.S_ISDIR(mode):
            self.directory(frame, name, rel, ust, lst)
        elif stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            self.leaf(frame, name, rel, ust, lst)
        else:
            what = ("fifo" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else
                    "character device" if stat.S_ISCHR(mode) else "block device")
            self.skip(rel, f"{what}: special files are never committed")

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
        if lst is not None and not self.touch(rel, lst):
            return
        target = name if frame.fresh else self.temp_in(frame)
        try:
            self.write_leaf(frame, name, target, ust, lst, owner)
            if not frame.fresh:
                self.place(frame.tfd, target, name, lst)
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
            if not attr.startswith("user.") or attr.startswith("user.overlay."):
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

    # -- directories

    def directory(self, frame: _Frame, name: str, rel: str, ust: os.stat_result, lst: os.stat_result | None) -> None:
        if len(self.stack) > MAX_DEPTH:
            self.skip(rel, f"more than {MAX_DEPTH} levels deep: not committed")
            return
        try:
            cfd = os.open(name, _DIR_FLAGS, dir_fd=frame.ufd)
        except PermissionError:
            # Made unreadable by the run itself (chmod 000, a 0300 directory): an unprivileged
            # caller owns it but has no CAP_DAC_OVERRIDE to list it. Its content cannot be
            # known, so the directory is not committed (a root caller's commit copies it).
            self.skip(rel, _UNREADABLE.format(stat.S_IMODE(ust.st_mode)))
            return
        try:
            opaque_here, xwhiteouts = _dir_flags(cfd, rel, self.prefix)
        except BaseException:
            os.close(cfd)
            raise
        if self.save and opaque_here:
            self.opaque_dirs.append(rel)
        if lst is not None and stat.S_ISDIR(lst.st_mode):
            self.existing_dir(frame, name, rel, cfd, ust, lst, frame.opaque or opaque_here)
        else:
            self.new_dir(frame, name, rel, cfd, ust, lst)
        if self.stack[-1].ufd == cfd:
            self.stack[-1].xwhiteouts = xwhiteouts

    def existing_dir(self, frame: _Frame, name: str, rel: str, cfd: int, ust: os.stat_result,
                     lst: os.stat_result, opaque: bool) -> None:
        """A directory in both layers: updated in place (mode; entries below)."""
        assert frame.tfd is not None
        want = stat.S_IMODE(ust.st_mode) & ~SETID_BITS
        if not lst.st_mode & stat.S_IWOTH:
            want &= ~stat.S_IWOTH
        want |= stat.S_IMODE(lst.st_mode) & stat.S_ISGID
        chmod = want != stat.S_IMODE(lst.st_mode)
        mode_key = rel + "\0mode"
        if chmod:
            if self.dry:
                if not self.touch(rel, lst, (frame.ufd, frame.tfd, name)):
                    chmod = False
                elif not self.root and lst.st_uid != self.euid:
                    self.decisions[mode_key] = f"owned by uid {lst.st_uid}: its mode cannot be changed"
                    chmod = False
                else:
                    self.modified.append(rel)
            elif mode_key in self.decisions:
                self.skipped.append((rel, self.decisions[mode_key]))
                chmod = False
            elif not self.touch(rel, lst):
                chmod = False
        try:
            tfd = _open_dir_here(frame.tfd, name)
        except OSError as err:
            os.close(cfd)
            if self.dry and err.errno in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):
                self.conflicts.append(rel)  # swapped on the host since the stat
            elif err.errno == errno.EXDEV:
                self.skip(rel, _MOUNT_POINT)
            else:
                self.skip(rel, f"cannot open it: {err.strerror}")
            return
        child = _Frame(cfd, tfd, rel, opaque=opaque, fresh=False, lst=lst, ust=ust, mode=want if chmod else None)
        self.push(child, os.listdir(tfd) if opaque else None)
        if chmod and not self.dry and want & 0o300 == 0o300:
            # The new mode lets its owner write: set it first, so a directory the run made
            # writable (chmod u+w) takes its new entries even for a caller that is not root.
            self.set_dir_mode(child)

    def set_dir_mode(self, frame: _Frame) -> None:
        assert frame.tfd is not None and frame.mode is not None and frame.ust is not None
        os.fchmod(frame.tfd, frame.mode)
        frame.mode = None
        self.mine(frame.lst)
        self.count(frame.ust)
        self.modified.append(frame.rel)

    def new_dir(self, frame: _Frame, name: str, rel: str, cfd: int, ust: os.stat_result,
                lst: os.stat_result | None) -> None:
        """A directory only the upper has (or replacing a lower non-directory): built
        completely, under a temporary name unless its parent is new too, then placed."""
        if self.dry:
            owner = self.owner_for(lst)
            if (lst is not None and not self.touch(rel, lst)) or not self.can_own(rel, owner):
                os.close(cfd)
                return
            (self.modified if lst is not None else self.added).append(rel)
            self.push(_Frame(cfd, None, rel, opaque=True, fresh=True, lst=lst, ust=ust, name=name), None)
            return
        assert frame.tfd is not None
        if lst is not None and not self.touch(rel, lst):
            os.close(cfd)
            return
        target = name if frame.fresh else self.temp_in(frame)
        try:
            os.mkdir(target, 0o700, dir_fd=frame.tfd)
            tfd = os.open(target, _DIR_FLAGS, dir_fd=frame.tfd)
        except OSError as err:
            os.close(cfd)
            if not frame.fresh:
                self.remove_temp(frame.tfd, target)
            if err.errno in STOP_ERRNOS:
                raise _stop(err, rel) from err
            self.skipped.append((rel, f"cannot create it: {err.strerror}"))
            return
        self.push(_Frame(cfd, tfd, rel, opaque=True, fresh=True, lst=lst, ust=ust, parent_tfd=frame.tfd,
                         temp=None if frame.fresh else target, name=name), None)

    def leave(self, frame: _Frame) -> None:
        """A directory's entries are done: an existing one gets its mode; a new one its
        metadata, and is moved into place."""
        if self.dry or frame.tfd is None or frame.ust is None:
            return
        if not frame.fresh:
            if frame.mode is not None:
                try:
                    self.set_dir_mode(frame)
                except OSError as err:
                    self.skipped.append((frame.rel, f"cannot change its mode: {err.strerror}"))
            return
        rel, ust, lst, tfd = frame.rel, frame.ust, frame.lst, frame.tfd
        try:
            self.copy_xattrs(frame.ufd, tfd)
            owner = self.owner_for(lst)
            if owner is not None:
                cur = os.fstat(tfd)
                if (cur.st_uid, cur.st_gid) != owner:
                    os.fchown(tfd, owner[0] if self.root else -1, owner[1])
            # setgid on a directory only makes new entries inherit its group: keep what mkdir
            # inherited from the parent; never take it (or setuid, or o+w) from the upper.
            want = stat.S_IMODE(ust.st_mode) & ~SETID_BITS
            if lst is None or not lst.st_mode & stat.S_IWOTH:
                want &= ~stat.S_IWOTH
            want |= stat.S_IMODE(os.fstat(tfd).st_mode) & stat.S_ISGID
            os.fchmod(tfd, want)
            os.utime(tfd, ns=(ust.st_atime_ns, ust.st_mtime_ns))
            if frame.temp is not None:
                assert frame.parent_tfd is not None
                self.place(frame.parent_tfd, frame.temp, frame.name, lst)
        except OSError as err:
            if frame.temp is not None and frame.parent_tfd is not None:
                self.remove_temp(frame.parent_tfd, frame.temp)
            head = rel + "/"  # what was recorded inside it was not applied after all
            for done in (self.added, self.modified, self.deleted):
                done[:] = [p for p in done if not p.startswith(head)]
            if isinstance(err, _ChangedOnHostError):
                self.late.append(rel)
                return
            if err.errno in STOP_ERRNOS:
                raise _stop(err, rel) from err
            self.skipped.append((rel, f"cannot finish it: {err.strerror}"))
            return
        self.count(ust)
        (self.modified if lst is not None else self.added).append(rel)

    def report(self) -> CommitReport:
        changes = Changes(tuple(sorted(self.added)), tuple(sorted(self.modified)), tuple(sorted(self.deleted)),
                          True, self.allocated)
        skipped = tuple(sorted(self.skipped))
        notes = list(self.notes)
        if skipped:
            # The change report (read_changes) lists what the run did; say what did not land.
            shown = "; ".join(f"{(p if len(p) <= 120 else p[:60] + '...' + p[-57:])!r}: {why}"
                              for p, why in skipped[:5])
            more = f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
            notes.append(f"commit: {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} of the run not "
                         f"applied ({shown}{more})")
        return CommitReport(changes, self.copied, skipped, tuple(notes))


def _check_owner(owner: tuple[int, int] | None, what: str) -> None:
    if owner is not None and os.geteuid() != 0:
        if owner[0] != os.geteuid() or owner[1] not in set(os.getgroups()) | {os.getegid()}:
            raise ValueError(f"{what} {owner} is not yours: a caller that is not root can give new entries "
                             "only its own uid and one of its groups (pass None to keep yours)")


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


def _incomplete(work: _Applier, report: CommitReport, stopped: OSError | None, upper_fd: int, *,
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

            from lowlevel.workspace import default_base, ensure_base
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
           accept_seen_host_changes: bool = False, save_to: Callable[[], str] | None = None) -> CommitReport:
    """Apply a run's upper directory to the user's directory, treating the upper as untrusted.

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
    before propagating. The commit is atomic per entry, not as a whole.

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
        work = _Applier(upper_fd, lock, prefix=xattr_prefix, since_ns=since_ns, new_owner=new_owner,
                        max_bytes=max_bytes, save=False)
        work.accept_seen = accept_seen_host_changes
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
            interrupted: KeyboardInterrupt | None = None
            while True:
                try:
                    work.finish(lock)
                    break
                except KeyboardInterrupt as err:
                    interrupted = interrupted or err
            if interrupted is not None:
                raise interrupted
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


def save_upper(upper_fd: int, dest: str, *, xattr_prefix: str | None = None,
               owner: tuple[int, int] | None = None, max_bytes: int | None = None) -> str:
    """Copy a run's upper directory aside (after a conflict), with the rules of :func:`commit`.

    Makes a new directory ``<dest>/lowlevel-upper-<pid>-<n>`` (mode 0700), holding:

    - ``tree/``: the upper's files, directories and symlinks (no setuid/setgid bits, no
      ``o+w``, ``user.*`` xattrs except ``user.overlay.*``, mtimes kept, symlinks never
      followed, hard links kept, at most MAX_DEPTH levels); the upper root's metadata is not;
    - ``whiteouts``: the relative paths the run deleted, each followed by a NUL byte (the
      bytes of the name as on disk, ``find -print0`` style);
    - ``opaque``: the relative paths of opaque directories (the lower directory's old
      contents were replaced by the directory in ``tree/``), NUL-terminated;
    - ``skipped``: for each entry not copied (fifos, sockets, devices, too deep),
      ``path\\0reason\\0``.

    Args:
        upper_fd: ``O_DIRECTORY`` fd on the upper directory (only read).
        dest: an existing host directory the caller trusts (its parents are not checked).
        xattr_prefix: as for :func:`commit`; None: as lowlevel mounts overlays, ``trusted.overlay.``
            for root, ``user.overlay.`` otherwise.
        owner: ``(uid, gid)`` for everything made (root callers: the workspace's owner), or
            None for the caller's.
        max_bytes: cap on the file content written (bytes; sparse files are copied sparse,
            and only their data counts), None for none; past it WorkspaceError EFBIG and the
            half-made copy is removed.
    Returns:
        The path of the new directory.
    Raises:
        WorkspaceError: ``dest`` is unusable, the upper cannot be read; the half-made copy is
            removed.
        ValueError: bad ``xattr_prefix`` or ``owner``.
    """
    if xattr_prefix is None:
        xattr_prefix = XATTR_PREFIXES[0] if os.geteuid() == 0 else XATTR_PREFIXES[1]
    _check_prefix(xattr_prefix)
    _check_owner(owner, "owner")
    try:
        dfd = os.open(dest, _DIR_FLAGS)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot open {dest}: {err.strerror}") from err
    name = ""
    try:
        for _ in range(100):
            name = f"lowlevel-upper-{os.getpid()}-{next(_serial)}"
            try:
                os.mkdir(name, 0o700, dir_fd=dfd)
                break
            except FileExistsError:
                continue
        try:
            pfd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                os.mkdir("tree", 0o700, dir_fd=pfd)
                tfd = os.open("tree", _DIR_FLAGS, dir_fd=pfd)
                try:
                    work = _Applier(upper_fd, tfd, prefix=xattr_prefix, since_ns=None, new_owner=owner,
                                    max_bytes=max_bytes, save=True)
                    work.run(dry=False)
                    if owner is not None:
                        os.fchown(tfd, *owner)
                finally:
                    os.close(tfd)
                for fname, items in ((SAVED_WHITEOUTS, work.whiteouts), (SAVED_OPAQUE, work.opaque_dirs)):
                    _write_list(pfd, fname, b"".join(os.fsencode(p) + b"\0" for p in sorted(items)), owner)
                _write_list(pfd, SAVED_SKIPPED, b"".join(os.fsencode(p) + b"\0" + os.fsencode(r) + b"\0"
                                                         for p, r in sorted(work.skipped)), owner)
                if owner is not None:
                    os.fchown(pfd, *owner)
            finally:
                os.close(pfd)
        except BaseException:
            _remove_tree(dfd, name)
            raise
    except OSError as err:
        if isinstance(err, WorkspaceError):
            raise
        raise WorkspaceError(err.errno or errno.EIO, f"cannot save the upper directory to {dest}: {err}") from err
    finally:
        os.close(dfd)
    return os.path.join(dest, name)


def clear_dir(fd: int) -> None:
    """Remove everything inside directory ``fd`` (it stays, empty): e.g. a dropped upper layer.

    Iterative and by fd like :func:`commit`'s removals: never follows a symlink, any depth,
    directories of the caller's that block their removal are made ``u+rwx`` first.

    Raises:
        WorkspaceError: an entry could not be removed (the rest is still removed).
    """
    try:
        dfd = os.open(".", _DIR_FLAGS, dir_fd=fd)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot open the directory to clear it: {err.strerror}") from err
    first: OSError | None = None
    try:
        for name in os.listdir(dfd):
            try:
                _remove_tree(dfd, name)
            except OSError as err:
                first = first or err
    finally:
        os.close(dfd)
    if first is not None:
        raise WorkspaceError(first.errno or errno.EIO, f"cannot clear the directory: {first}")


def _write_list(dirfd: int, name: str, data: bytes, owner: tuple[int, int] | None) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dirfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if owner is not None:
            os.fchown(fd, *owner)
    finally:
        os.close(fd)


def iter_saved_list(path: str) -> Iterator[str]:
    """The relative paths of a :func:`save_upper` list file (``whiteouts`` or ``opaque``), as
    ``str`` with surrogateescape."""
    with open(path, "rb") as f:
        data = f.read()
    for raw in data.split(b"\0")[:-1]:
        yield os.fsdecode(raw)


__all__ = ["LEFTOVER_PREFIX", "MAX_LINKED", "SAVED_OPAQUE", "SAVED_SKIPPED", "SAVED_WHITEOUTS", "XATTR_PREFIXES",
           "CommitConflictError", "CommitReport", "cleanup_commit_leftovers", "clear_dir", "commit",
           "iter_saved_list", "read_changes", "save_upper"]
