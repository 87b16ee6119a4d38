"""Per-run workspaces, and reading them back as untrusted output.

A run's workspace is the one writable host directory bound into the sandbox (at
``/workspace``). :func:`create_workspace` makes a fresh one per run under a base directory and
copies the inputs in, so an agent deleting files deletes only its own run's copy.

Everything in a workspace after a run is untrusted: :func:`snapshot`, :func:`list_files` and
:func:`read_file` walk it with ``os.fwalk``/``openat`` relative to directory fds, never follow
a symlink (``O_NOFOLLOW`` on every component), refuse special files (fifos, sockets, devices)
and files with more than one hard link, and cap sizes and entry counts.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import WorkspaceError

#: Cap on the entries a snapshot visits; beyond it the change report is marked incomplete.
MAX_SNAPSHOT_ENTRIES = 100_000
#: Default cap for :func:`read_file` (bytes).
DEFAULT_READ_LIMIT = 16 * 1024 * 1024


@dataclass(frozen=True)
class FileEntry:
    """One entry found in a workspace.

    Attributes:
        path: path relative to the workspace root, ``/``-separated.
        kind: ``"file"``, ``"dir"``, ``"symlink"`` or ``"other"`` (fifo, socket, device).
        size: size in bytes (``lstat``; a symlink's is its target's length).
        mtime_ns: modification time in nanoseconds.
        mode: permission bits.
    """

    path: str
    kind: str
    size: int
    mtime_ns: int
    mode: int


@dataclass(frozen=True)
class Changes:
    """What a run did to its workspace, by relative path (each tuple sorted).

    Attributes:
        added, modified, deleted: relative paths. A modified entry changed size, mtime, mode,
            inode or kind.
        complete: False when the workspace held more than MAX_SNAPSHOT_ENTRIES entries and
            the report covers only part of it.
    """

    added: tuple[str, ...] = ()
    modified: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    complete: bool = True


Snapshot = dict[str, tuple[str, int, int, int, int]]


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _walk(root: str, limit: int = MAX_SNAPSHOT_ENTRIES) -> tuple[list[tuple[str, os.stat_result]], bool]:
    """lstat every entry under root without following symlinks. Returns (entries, complete)."""
    out: list[tuple[str, os.stat_result]] = []
    try:
        walker = os.fwalk(root, follow_symlinks=False)
        for dirpath, dirnames, filenames, dirfd in walker:
            rel_dir = os.path.relpath(dirpath, root)
            for name in dirnames + filenames:
                try:
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                out.append((rel, st))
                if len(out) >= limit:
                    return out, False
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot walk workspace {root}: {err.strerror}") from err
    return out, True


def snapshot(root: str) -> tuple[Snapshot, bool]:
    """Record every entry of ``root``: ``{relpath: (kind, size, mtime_ns, ino, mode)}``, complete."""
    entries, complete = _walk(root)
    return ({rel: (_kind(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino, stat.S_IMODE(st.st_mode))
             for rel, st in entries}, complete)


def diff(before: tuple[Snapshot, bool], after: tuple[Snapshot, bool]) -> Changes:
    """Compare two snapshots of the same workspace."""
    b, bc = before
    a, ac = after
    added = sorted(k for k in a if k not in b)
    deleted = sorted(k for k in b if k not in a)
    modified = sorted(k for k in a if k in b and a[k] != b[k] and a[k][0] != "dir")
    return Changes(tuple(added), tuple(modified), tuple(deleted), bc and ac)


def list_files(root: str) -> list[FileEntry]:
    """List a workspace without following symlinks (at most MAX_SNAPSHOT_ENTRIES entries).

    Raises:
        WorkspaceError: root is missing or unreadable.
    """
    entries, _ = _walk(root)
    return [FileEntry(rel, _kind(st.st_mode), st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))
            for rel, st in sorted(entries, key=lambda e: e[0])]


def _split_rel(relpath: str) -> list[str]:
    if not isinstance(relpath, str) or not relpath or "\0" in relpath:
        raise WorkspaceError(errno.EINVAL, f"invalid workspace path {relpath!r}")
    parts = [p for p in relpath.replace("\\", "/").split("/") if p not in ("", ".")]
    if relpath.startswith("/") or any(p == ".." for p in parts) or not parts:
        raise WorkspaceError(errno.EINVAL, f"workspace path {relpath!r} must be relative, without '..'")
    return parts


def _open_parent(root: str, parts: Sequence[str], create: bool = False) -> int:
    """Open the directory holding parts[-1], component by component with O_NOFOLLOW."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(root: str, relpath: str, max_bytes: int = DEFAULT_READ_LIMIT) -> bytes:
    """Read a regular file of a workspace, treating it as untrusted.

    Args:
        root: host path of the workspace.
        relpath: path relative to the workspace (no ``..``, not absolute).
        max_bytes: refuse files larger than this (bytes).
    Returns:
        The file's content.
    Raises:
        WorkspaceError: the path is invalid, crosses or is a symlink (ELOOP/ENOTDIR), is not a
            regular file, has several hard links, or is larger than ``max_bytes`` (EFBIG).
    """
    parts = _split_rel(relpath)
    try:
        dfd = _open_parent(root, parts)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise WorkspaceError(err.errno, f"refusing {relpath!r}: a symlink is in the way "
                                 "(workspace content is untrusted)") from err
        raise WorkspaceError(err.errno, f"cannot open {relpath!r} in workspace: {err.strerror}") from err
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise WorkspaceError(errno.EINVAL, f"refusing {relpath!r}: not a regular file")
        if st.st_nlink > 1:
            raise WorkspaceError(errno.EMLINK, f"refusing {relpath!r}: it has {st.st_nlink} hard links")
        if st.st_size > max_bytes:
            raise WorkspaceError(errno.EFBIG, f"refusing {relpath!r}: {st.st_size} bytes > cap {max_bytes}")
        data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise WorkspaceError(errno.EFBIG, f"refusing {relpath!r}: larger than cap {max_bytes}")
        return data


def write_file(root: str, relpath: str, data: bytes, *, uid: int | None = None, gid: int | None = None) -> None:
    """Write ``data`` to a workspace file, creating parent dirs, never through a symlink.

    Raises:
        WorkspaceError: invalid path, a symlink or non-regular file in the way.
    """
    parts = _split_rel(relpath)
    try:
        dfd = _open_parent(root, parts, create=True)
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK, 0o644, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot write {relpath!r} in workspace: {err.strerror}") from err
    with os.fdopen(fd, "wb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise WorkspaceError(errno.EINVAL, f"refusing {relpath!r}: not a regular file")
        f.write(data)
        if uid is not None:
            os.fchown(f.fileno(), uid, gid if gid is not None else -1)


def default_base() -> str:
    """The default parent of per-run workspaces: ``$LOWLEVEL_WORKSPACE_BASE`` or
    ``<tmpdir>/lowlevel-<uid>``."""
    return os.environ.get("LOWLEVEL_WORKSPACE_BASE") or os.path.join(tempfile.gettempdir(),
                                                                     f"lowlevel-{os.getuid()}")


def ensure_base(base: str) -> str:
    """Create the base dir if needed and check that it is ours and not a symlink.

    Mode 0711: the sandbox's uid (``nobody`` for root callers) can traverse it to reach its
    own run dir but cannot list the other runs.

    Raises:
        WorkspaceError: base exists but is a symlink, not a directory, or owned by someone else
            (a squatted ``/tmp/lowlevel-<uid>``).
    """
    base = os.path.abspath(base)
    try:
        os.makedirs(base, 0o711, exist_ok=True)
        st = os.lstat(base)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot create workspace base {base}: {err.strerror}") from err
    if not stat.S_ISDIR(st.st_mode):
        raise WorkspaceError(errno.ENOTDIR, f"workspace base {base} is not a directory (or is a symlink)")
    if st.st_uid != os.getuid():
        raise WorkspaceError(errno.EPERM, f"workspace base {base} is owned by uid {st.st_uid}, not by us "
                             f"({os.getuid()}); remove it or set LOWLEVEL_WORKSPACE_BASE")
    if stat.S_IMODE(st.st_mode) & 0o022:
        os.chmod(base, 0o711)
    return base


def copy_inputs(root: str, inputs: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Copy files or directories into the workspace root, each under its base name.

    Symlinks inside copied directories are copied as symlinks (not followed).

    Returns:
        The relative names created.
    Raises:
        WorkspaceError: an input is missing, or two inputs share a base name, or it exists already.
    """
    created: list[str] = []
    for item in inputs:
        src = os.fspath(item)
        name = os.path.basename(os.path.normpath(src))
        if not os.path.lexists(src):
            raise WorkspaceError(errno.ENOENT, f"input {src!r} does not exist")
        if not name or name in ("..", "."):
            raise WorkspaceError(errno.EINVAL, f"input {src!r} has no usable base name")
        dest = os.path.join(root, name)
        if os.path.lexists(dest):
            raise WorkspaceError(errno.EEXIST, f"input {src!r}: {name!r} already exists in the workspace "
                                 "(two inputs with the same name?)")
        try:
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dest, symlinks=True)
            else:
                shutil.copy2(src, dest, follow_symlinks=True)
        except OSError as err:
            raise WorkspaceError(err.errno or errno.EIO, f"cannot copy input {src!r}: {err}") from err
        created.append(name)
    return created


def create_workspace(inputs: Iterable[str | os.PathLike[str]] = (), base: str | None = None) -> str:
    """Make a fresh per-run workspace under ``base`` and copy ``inputs`` into it.

    All or nothing: if a copy fails, the half-made workspace is removed.

    Args:
        inputs: host files or directories, each copied under its base name.
        base: parent directory; default :func:`default_base`.
    Returns:
        The workspace's absolute host path (mode 0700).
    Raises:
        WorkspaceError: see :func:`ensure_base` and :func:`copy_inputs`.
    """
    parent = ensure_base(base or default_base())
    path = tempfile.mkdtemp(prefix="run-", dir=parent)
    try:
        copy_inputs(path, inputs)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def chown_tree(root: str, uid: int, gid: int, *, only_from: int | None = None) -> None:
    """Give the tree to uid:gid without following symlinks (lchown).

    Regular files with several hard links are skipped: changing their owner would change the
    owner of the other names too, which may lie outside the workspace.

    Args:
        only_from: when set, change only entries currently owned by this uid.
    """
    def fix(name: str, dir_fd: int | None) -> None:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            return
        if only_from is not None and st.st_uid != only_from:
            return
        if st.st_uid != uid or st.st_gid != gid:
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)

    fix(root, None)
    for _dirpath, dirnames, filenames, dirfd in os.fwalk(root, follow_symlinks=False):
        for name in dirnames + filenames:
            try:
                fix(name, dirfd)
            except FileNotFoundError:
                pass


def check_traversable(path: str, uid: int, gid: int) -> None:
    """Check that uid:gid can reach ``path`` (execute permission on each ancestor).

    bwrap resolves bind sources as the user it runs as, so a root caller's workspace under a
    0700 directory (``/root/...``) is unreachable for ``nobody``.

    Raises:
        WorkspaceError: an ancestor blocks traversal; the message names it and the fix.
    """
    cur = os.path.dirname(os.path.abspath(path))
    while True:
        st = os.stat(cur)
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            raise WorkspaceError(errno.EACCES, f"workspace {path} is not reachable by the sandbox's uid {uid}: "
                                 f"{cur} is mode {stat.S_IMODE(st.st_mode):04o}. Put the workspace under a "
                                 f"world-traversable directory or run `chmod o+x {cur}`")
        if cur == "/":
            return
        cur = os.path.dirname(cur)


__all__ = ["Changes", "FileEntry", "check_traversable", "chown_tree", "copy_inputs", "create_workspace",
           "default_base", "diff", "ensure_base", "list_files", "read_file", "snapshot", "write_file"]
