"""Reading and writing single workspace files, treating the tree as untrusted.

Every path a caller gives is split and checked (:func:`_split_rel`), then opened component by
component relative to directory fds with ``O_NOFOLLOW`` (:func:`open_dir_at`): a symlink the
sandbox planted is never followed, a special file or a file with several hard links is refused,
sizes are capped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence

from lowlevel.errors import WorkspaceError
from lowlevel.workspace.changes import FileEntry, _kind
from lowlevel.workspace.walk import MAX_DEPTH, _walk

#: Default cap for :func:`read_file` (bytes).
DEFAULT_READ_LIMIT = 16 * 1024 * 1024


def list_files(root: str) -> list[FileEntry]:
    """List a workspace without following symlinks (at most MAX_SNAPSHOT_ENTRIES entries).

    Raises:
        WorkspaceError: root is missing or unreadable.
    """
    entries, _ = _walk(root)
    return [FileEntry(rel, _kind(st.st_mode), st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))
            for rel, st in sorted(entries, key=lambda e: e[0])]


#: Longest workspace path :func:`read_file`, :func:`write_file` and friends take (bytes, PATH_MAX).
MAX_REL_PATH_BYTES = 4095


def _split_rel(relpath: str) -> list[str]:
    """Split a caller's relative workspace path into components.

    Raises:
        WorkspaceError: (EINVAL) not a non-empty str, a NUL, absolute, a ``..`` component,
            longer than PATH_MAX or a component longer than NAME_MAX, or (ELOOP) more than
            MAX_DEPTH + 1 components: the walks do not enter deeper directories, so a
            deeper file could be made but never listed, checked or given back.
    """
    if not isinstance(relpath, str) or not relpath or "\0" in relpath:
        raise WorkspaceError(errno.EINVAL, f"invalid workspace path {relpath!r:.80}")
    try:
        size = len(os.fsencode(relpath))
    except UnicodeEncodeError:
        raise WorkspaceError(errno.EINVAL, f"invalid workspace path {relpath!r:.80}: cannot be encoded") from None
    if size > MAX_REL_PATH_BYTES:
        raise WorkspaceError(errno.ENAMETOOLONG, f"workspace path is {size} bytes long; the limit is "
                             f"{MAX_REL_PATH_BYTES}")
    # A backslash is an ordinary character in a Linux name: "a\\b" is one name, never a/b (a
    # record naming such a file must restore it as it was).
    parts = [p for p in relpath.split("/") if p not in ("", ".")]
    if not parts and not relpath.startswith("/"):
        raise WorkspaceError(errno.EINVAL, f"workspace path {relpath!r:.80} names the workspace itself: name a "
                             "file or directory inside it (e.g. data/file.txt)")
    if relpath.startswith("/") or any(p == ".." for p in parts) or not parts:
        raise WorkspaceError(errno.EINVAL, f"workspace path {relpath!r:.80} must be relative, without '..'")
    if len(parts) > MAX_DEPTH + 1:
        raise WorkspaceError(errno.ELOOP, f"workspace path has {len(parts)} components; the limit is "
                             f"{MAX_DEPTH + 1} (directories deeper than {MAX_DEPTH} levels are never walked)")
    if any(len(os.fsencode(p)) > 255 for p in parts):
        raise WorkspaceError(errno.ENAMETOOLONG, "a workspace path component is longer than 255 bytes (NAME_MAX)")
    return parts


def _open_parent(root: str, parts: Sequence[str], create: bool = False,
                 owner: tuple[int, int] | None = None) -> int:
    """Open the directory holding parts[-1], component by component with O_NOFOLLOW.

    ``create`` makes missing directories (given to ``owner`` when set)."""
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_dir_at(rootfd, parts[:-1], create=create, owner=owner)
    finally:
        os.close(rootfd)


def open_dir_at(dirfd: int, parts: Sequence[str], *, create: bool = False,
                owner: tuple[int, int] | None = None) -> int:
    """Open directory ``parts`` below ``dirfd`` component by component, never through a symlink
    (O_NOFOLLOW each); ``create`` makes missing ones (given to ``owner`` when set). Returns a new
    fd (``dirfd`` stays open). Raises OSError (nothing left open)."""
    fd = os.dup(dirfd)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
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
    """Write ``data`` to a workspace file, creating parent dirs, never through a symlink or a
    hard link, and whole or not at all.

    The content goes to a new file first (``O_TMPFILE``, linked in under a temporary name just
    before the ``rename(2)``; a named temporary where the file system has no ``O_TMPFILE``),
    which then replaces the name in one step: a reader, the sandbox, or a process killed during
    a large write sees the old content or the new, never a mix (an in-place write killed half-way
    left 16 MB of 40 and the old content gone: a fresh-user trial). What the name holds now is
    checked first, without following it: a symlink anywhere on the path (``O_NOFOLLOW`` per
    component), a special file, or a regular file with more than one hard link (a name the
    sandbox may have linked to another file) is refused before one byte changes. A replaced
    file keeps its mode and, without ``uid``, its owner.

    ``uid``/``gid``: owner of the file and of the directories made for it (a root caller
    writing into a live session's workspace passes :attr:`lowlevel.Session.host_ids`).

    Raises:
        WorkspaceError: invalid path (see :func:`read_file`; more than MAX_DEPTH + 1 levels:
            ELOOP), a symlink in the way (ELOOP/ENOTDIR), a non-regular file (EINVAL), a file
            with several hard links (EMLINK), or the write failed (ENOSPC...).
    """
    parts = _split_rel(relpath)
    try:
        dfd = _open_parent(root, parts, create=True,
                           owner=(uid, gid if gid is not None else uid) if uid is not None else None)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise WorkspaceError(err.errno, f"refusing to write {relpath!r}: a symlink is in the way "
                                 "(workspace content is untrusted)") from err
        raise WorkspaceError(err.errno, f"cannot write {relpath!r} in workspace: {err.strerror}") from err
    try:
        _replace(dfd, parts[-1], relpath, data, uid, gid)
    except WorkspaceError:
        raise
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot write {relpath!r} in workspace: "
                             f"{err.strerror or err}") from err
    finally:
        os.close(dfd)


def _existing(dfd: int, name: str, relpath: str) -> os.stat_result | None:
    """What ``name`` holds now (lstat), refused unless absent or a singly-linked regular file."""
    try:
        st = os.lstat(name, dir_fd=dfd)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise WorkspaceError(errno.ELOOP, f"refusing to write {relpath!r}: a symlink is in the way "
                             "(workspace content is untrusted)")
    if not stat.S_ISREG(st.st_mode):
        raise WorkspaceError(errno.EINVAL, f"refusing {relpath!r}: not a regular file")
    if st.st_nlink > 1:
        raise WorkspaceError(errno.EMLINK, f"refusing to write {relpath!r}: it has {st.st_nlink} hard "
                             "links, so the write would change the other names too")
    return st


def _replace(dfd: int, name: str, relpath: str, data: bytes, uid: int | None, gid: int | None) -> None:
    """:func:`write_file`'s new file in directory ``dfd``, renamed over ``name``."""
    old = _existing(dfd, name, relpath)
    tmp = f".lowlevel-write-{os.getpid()}-{os.urandom(6).hex()}"
    try:
        fd = os.open(".", os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        linked = False
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        linked = True
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if old is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(old.st_mode) & 0o777)
            if uid is not None:
                os.fchown(f.fileno(), uid, gid if gid is not None else -1)
            elif old is not None and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                with contextlib.suppress(PermissionError):
                    os.fchown(f.fileno(), old.st_uid, old.st_gid)
            if not linked:
                os.link(f"/proc/self/fd/{f.fileno()}", tmp, dst_dir_fd=dfd, follow_symlinks=True)
                linked = True
        _existing(dfd, name, relpath)  # still what was checked (the sandbox may have swapped it meanwhile)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        linked = False
    finally:
        if linked:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)


def make_dir(root: str, relpath: str, mode: int = 0o755) -> None:
    """Create directory ``relpath`` (and its parents) in a workspace, never through a symlink.

    An existing directory is fine; a symlink or a file in the way is an error.

    Raises:
        WorkspaceError: invalid path (absolute, ``..``), or a non-directory in the way.
    """
    parts = _split_rel(relpath)
    try:
        dfd = _open_parent(root, parts, create=True)
        try:
            try:
                os.mkdir(parts[-1], mode, dir_fd=dfd)
            except FileExistsError:
                pass
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot make directory {relpath!r} in workspace: {err.strerror}") from err
    if not stat.S_ISDIR(st.st_mode):
        raise WorkspaceError(errno.ENOTDIR, f"refusing {relpath!r}: something else than a directory is there")


def make_symlink(root: str, relpath: str, target: str) -> None:
    """Create symlink ``relpath`` -> ``target`` in a workspace (parents must exist; no symlink crossed).

    The target text is stored as is: it is only ever resolved inside the sandbox, and this
    module's readers never follow symlinks.

    Raises:
        WorkspaceError: invalid path, a symlink in the way, or the name exists.
    """
    parts = _split_rel(relpath)
    if not isinstance(target, str) or not target or "\0" in target:
        raise WorkspaceError(errno.EINVAL, f"invalid symlink target {target!r} for {relpath!r}")
    try:
        dfd = _open_parent(root, parts)
        try:
            os.symlink(target, parts[-1], dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot make symlink {relpath!r} in workspace: {err.strerror}") from err


def set_mode(root: str, relpath: str, mode: int) -> None:
    """chmod a workspace entry that is not a symlink, never through or at a symlink.

    Raises:
        WorkspaceError: invalid path, a symlink in the way or at ``relpath`` (ELOOP).
    """
    parts = _split_rel(relpath)
    try:
        dfd = _open_parent(root, parts)
        try:
            if stat.S_ISLNK(os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False).st_mode):
                raise WorkspaceError(errno.ELOOP, f"refusing to chmod {relpath!r}: it is a symlink")
            try:
                os.chmod(parts[-1], mode, dir_fd=dfd, follow_symlinks=False)
            except (NotImplementedError, ValueError) as err:  # swapped for a symlink meanwhile
                raise WorkspaceError(errno.ELOOP, f"refusing to chmod {relpath!r}: it is a symlink") from err
        finally:
            os.close(dfd)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot chmod {relpath!r} in workspace: {err.strerror}") from err
