"""Host-side work on an image's unpacked tree, outside every sandbox (one concept: the tree).

After umoci unpacked a layer set into the import's staging directory, these functions make the
tree safe to share read-only (:func:`neutralize`: no device node, socket, setid bit,
group/other write bit or ``security.capability``; everything owned by the store's owner),
create the mount points bwrap needs (:func:`ensure_placeholders`, :func:`make_workdir`), look the
config's ``User`` up in the image (:func:`user_ids`), check the space an unpack needs, and remove
a tree this package made (:func:`rmtree`). Every walk follows no symlink (fd-relative, through
:func:`lowlevel.rootfs.walk`); paths inside the tree are resolved with
:func:`lowlevel.rootfs.resolve_in_root`.

Sources: CVE-2018-15664 (symlink-exchange races) for the fd-relative walks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Sequence

from lowlevel.errors import ImageError
from lowlevel.rootfs import RESERVED_TOP, resolve_in_root, rootfs_unreachable, walk
from lowlevel.rootfs.store import ETC_PLACEHOLDERS, STORE_ENV, MiB, read_bounded

log = logging.getLogger("lowlevel")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def make_writable_dirs(path: str) -> None:
    """Give u+rwx to every directory below ``path`` (no symlink followed), so a tree holding
    read-only directories (an image's 0555 ``/proc``) can be removed by an unprivileged owner."""
    try:
        rootfd = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    try:
        os.fchmod(rootfd, 0o700)
        for _rel, name, dirfd, st in walk(rootfd, onerror=lambda _r, _e: None):
            if stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
                with contextlib.suppress(OSError):
                    os.chmod(name, stat.S_IMODE(st.st_mode) | 0o700, dir_fd=dirfd, follow_symlinks=False)
    finally:
        os.close(rootfd)


def rmtree(path: str) -> None:
    """Remove a tree this module made (fd-based, never following a symlink)."""
    if not os.path.lexists(path):
        return
    if os.geteuid() != 0:
        make_writable_dirs(path)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        log.warning("lowlevel: could not remove %s completely", path)


def atomic_write(path: str, data: bytes, mode: int = 0o644) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)



def readable_by_others(path: str) -> bool:
    """True when a root caller's sandbox (a per-run uid: "others") can read ``path`` (file or tree)."""
    if rootfs_unreachable(os.path.dirname(path), -1, -1):
        return False
    if os.path.isfile(path):
        return bool(os.stat(path).st_mode & stat.S_IROTH)
    for dirpath, dirnames, filenames in os.walk(path):
        if not os.stat(dirpath).st_mode & (stat.S_IROTH | stat.S_IXOTH) == stat.S_IROTH | stat.S_IXOTH:
            return False
        for f in filenames:
            try:
                if not os.lstat(os.path.join(dirpath, f)).st_mode & stat.S_IROTH:
                    return False
            except OSError:
                return False
        del dirnames[10_000:]
    return True


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (or of the file)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def fs_used(path: str) -> int:
    """Bytes in use on the filesystem of ``path`` (for the unpack estimate)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def check_space(path: str, want_bytes: int, want_entries: int) -> None:
    """Refuse an unpack that cannot fit (content plus a block per entry, and the inodes)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return
    need = want_bytes + want_entries * 4096
    have = st.f_bavail * st.f_frsize
    if need > have:
        raise ImageError(f"not enough space for the image under {path}: it needs about {need // MiB} MiB, "
                         f"{have // MiB} MiB are free. Free space or choose another store (${STORE_ENV})")
    if st.f_files and want_entries > st.f_favail:
        raise ImageError(f"not enough inodes under {path}: the image has {want_entries} entries, "
                         f"{st.f_favail} inodes are free")


def _open_parent(rootfd: int, rel: str) -> tuple[int, str] | None:
    """Fd of the directory holding ``rel`` (no symlink followed) and the leaf name, or None."""
    parts = rel.split("/")
    fd = os.dup(rootfd)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except OSError:
        os.close(fd)
        return None
    return fd, parts[-1]


def neutralize(rootfs: str, devices: Sequence[str], *, fix_caps: bool) -> list[str]:
    """Make the unpacked tree safe to share (see the module docstring); return notes."""

    notes: list[str] = []
    uid, gid = os.geteuid(), os.getegid()
    rootfd = os.open(rootfs, _DIR_FLAGS)
    try:
        if uid == 0:
            os.fchown(rootfd, uid, gid)  # made by the tools' leased uid
        for rel in devices:
            opened = _open_parent(rootfd, rel)
            if opened is None:
                continue
            fd, leaf = opened
            try:
                st = os.lstat(leaf, dir_fd=fd)
                if (stat.S_ISREG(st.st_mode) and st.st_size == 0) or stat.S_ISCHR(st.st_mode) \
                        or stat.S_ISBLK(st.st_mode):
                    os.unlink(leaf, dir_fd=fd)
            except OSError:
                pass
            finally:
                os.close(fd)
        special = 0
        foreign = 0
        for _rel, name, dirfd, st in walk(rootfd):
            mode = st.st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
                os.unlink(name, dir_fd=dirfd)
                special += 1
                continue
            if (st.st_uid, st.st_gid) != (uid, gid):
                if uid != 0:
                    foreign += 1
                else:
                    os.chown(name, uid, gid, dir_fd=dirfd, follow_symlinks=False)
            if stat.S_ISLNK(mode):
                continue
            cur = stat.S_IMODE(mode)
            want = cur & ~(stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH)
            want |= stat.S_IRUSR | (stat.S_IXUSR if stat.S_ISDIR(mode) else 0)
            if want != cur or (uid == 0 and (st.st_uid, st.st_gid) != (uid, gid)):
                os.chmod(name, want, dir_fd=dirfd, follow_symlinks=False)
            if fix_caps and stat.S_ISREG(mode):
                with contextlib.suppress(OSError):
                    os.removexattr(f"/proc/self/fd/{dirfd}/{name}", "security.capability", follow_symlinks=False)
        if special:
            notes.append(f"{special} device nodes or sockets removed from the tree")
        if foreign:
            raise ImageError(f"{foreign} entries of the unpacked tree belong to another user: cannot make it safe")
    except OSError as err:
        raise ImageError(f"cannot neutralise the unpacked tree {rootfs}: {err}") from err
    finally:
        os.close(rootfd)
    return notes


def _elsewhere(virtual: str) -> bool:
    return virtual.split("/")[1] in RESERVED_TOP


def ensure_placeholders(rootfs: str) -> list[str]:
    """Create the empty :data:`ETC_PLACEHOLDERS` the image lacks; return notes."""

    notes = []
    for rel in ETC_PLACEHOLDERS:
        host = resolve_in_root(rootfs, "/" + rel, _elsewhere)
        if host is None:
            raise ImageError(f"the image's /{rel} resolves into a directory the sandbox provides itself "
                             "(/proc, /dev, /sys, /tmp, /workspace): cannot run it")
        if host:
            if not stat.S_ISREG(os.lstat(host).st_mode):
                raise ImageError(f"the image's /{rel} is not a regular file: cannot mount over it")
            continue
        parent = resolve_in_root(rootfs, "/" + os.path.dirname(rel), _elsewhere)
        if parent is None:
            raise ImageError(f"the image's /{os.path.dirname(rel)} resolves outside its tree: cannot run it")
        if parent == "":
            # No /etc at all: make it (resolve again: the path may go through a dangling symlink).
            parent = os.path.join(rootfs, os.path.dirname(rel))
            if os.path.lexists(parent):
                raise ImageError(f"the image's /{os.path.dirname(rel)} is a dangling symlink: cannot run it")
            os.mkdir(parent, 0o755)
        elif not os.path.isdir(parent) or os.path.islink(parent):
            raise ImageError(f"the image's /{os.path.dirname(rel)} is not a directory: cannot run it")
        try:
            fd = os.open(os.path.join(parent, os.path.basename(rel)),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:  # there, but resolving to nothing: a dangling symlink (never followed)
            raise ImageError(f"the image's /{rel} is a dangling symlink: cannot mount over it") from None
        os.close(fd)
        notes.append(f"created an empty /{rel} (the sandbox mounts its own over it)")
    return notes


def make_workdir(rootfs: str, workdir: str) -> str:
    """Create ``workdir`` inside the tree when missing (never through a symlink).

    Returns:
        ``"made"``, ``"exists"``, or ``"blocked"``: missing, and a symlink, a file or ``..`` on
        its way kept it from being made (the image is left as it is; a run there fails on its
        cwd unless given another).
    """
    where = resolve_in_root(rootfs, workdir, _elsewhere)
    if where is None:
        return "blocked"  # into a directory the sandbox provides (/tmp, /proc...): not the image's
    if where != "":
        return "exists"
    rootfd = os.open(rootfs, _DIR_FLAGS)
    fd = os.dup(rootfd)
    try:
        for part in [p for p in workdir.split("/") if p and p != "."]:
            if part == "..":
                return "blocked"
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                return "blocked"  # a symlink or a file on the way: leave it as the image has it
            os.close(fd)
            fd = nfd
        return "made"
    finally:
        os.close(fd)
        os.close(rootfd)


def _parse_db(rootfs: str, rel: str) -> list[list[str]]:
    host = resolve_in_root(rootfs, "/" + rel, _elsewhere)
    if not host:
        return []
    try:
        text = read_bounded(host, 16 * MiB, f"/{rel}").decode("utf-8", "replace")
    except ImageError:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def user_ids(rootfs: str, user: str, notes: list[str]) -> tuple[int, int] | None:
    """The ``(uid, gid)`` Docker would run ``User`` as, looked up in the image (None: unknown)."""
    def idnum(text: str) -> int | None:
        if text.isdigit() and int(text) < 2**32 - 1:
            return int(text)
        return None

    if not user:
        return (0, 0)
    name, _, group = user.partition(":")
    passwd = _parse_db(rootfs, "etc/passwd")
    uid = idnum(name)
    gid: int | None = None
    entry = next((p for p in passwd if len(p) >= 4 and (p[0] == name or (uid is not None and p[2] == name))), None)
    if uid is None:
        if entry is None or idnum(entry[2]) is None:
            notes.append(f"config User {user!r}: no such user in the image's /etc/passwd")
            return None
        uid = idnum(entry[2])
    if group:
        gid = idnum(group)
        if gid is None:
            g = next((p for p in _parse_db(rootfs, "etc/group") if len(p) >= 3 and p[0] == group), None)
            gid = idnum(g[2]) if g else None
            if gid is None:
                notes.append(f"config User {user!r}: no such group in the image's /etc/group")
                return None
    else:
        gid = idnum(entry[3]) if entry is not None else 0
        if gid is None:
            gid = 0
    assert uid is not None
    return (uid, gid)


__all__ = ["atomic_write", "check_space", "ensure_placeholders", "fs_used", "make_workdir", "neutralize",
           "readable_by_others", "rmtree", "tree_bytes", "user_ids"]
