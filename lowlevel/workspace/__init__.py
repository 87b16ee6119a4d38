"""Per-run workspaces, and reading them back as untrusted output.

A run's workspace is the one writable host directory bound into the sandbox (at
``/workspace``). :func:`create_workspace` makes a fresh one per run under a base directory and
copies the inputs in, so an agent deleting files deletes only its own run's copy.

Everything in a workspace after a run is untrusted: :func:`snapshot`, :func:`list_files` and
:func:`read_file` walk it iteratively with ``openat`` relative to directory fds, never follow
a symlink (``O_NOFOLLOW`` on every component), refuse special files (fifos, sockets, devices)
and files with more than one hard link, and cap sizes and entry counts.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import sys
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lowlevel.errors import WorkspaceError

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
        bytes_written: for a copy-on-write (overlay) run, the bytes the run's upper directory
            allocates on its filesystem (sum of ``st_blocks * 512`` over its entries, each
            inode once; see :func:`lowlevel.workspace.overlay.read_changes`); None when not measured.
    """

    added: tuple[str, ...] = ()
    modified: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    complete: bool = True
    bytes_written: int | None = None


Snapshot = dict[str, tuple[str, int, int, int, int]]


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


#: Directory levels below the root that the walks enter. The walks are iterative and hold one
#: fd per level; a directory deeper than this is not entered (see :func:`give_back`).
MAX_DEPTH = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _iter_tree(rootfd: int, *, onerror: Callable[[OSError], None] | None = None,
               too_deep: Callable[[str, str, int], None] | None = None,
               ) -> Generator[tuple[str, str, int, os.stat_result], None, None]:
    """Yield ``(rel, name, dirfd, lstat)`` for every entry below ``rootfd``, top-down.

    Iterative (Python's ``os.fwalk`` recurses: 1,000 nested directories raised RecursionError),
    never follows a symlink, holds at most MAX_DEPTH + 1 directory fds. A directory is
    yielded before it is entered, so the caller may fix its mode first. A directory at
    level MAX_DEPTH + 1 is yielded but not entered: ``too_deep(rel, name, dirfd)`` is called.
    Unlistable directories go to ``onerror`` (``filename`` set to their relative path).
    Closing the generator early closes its fds.
    """
    stack: list[tuple[int, str, list[str]]] = []

    def enter(fd: int, rel: str) -> None:
        try:
            names = os.listdir(fd)
        except OSError as err:
            os.close(fd)
            err.filename = rel or "."
            if onerror is not None:
                onerror(err)
            return
        names.reverse()
        stack.append((fd, rel, names))

    try:
        enter(os.open(".", _DIR_FLAGS, dir_fd=rootfd), "")
        while stack:
            dirfd, rel_dir, names = stack[-1]
            if not names:
                stack.pop()
                os.close(dirfd)
                continue
            name = names.pop()
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            rel = f"{rel_dir}/{name}" if rel_dir else name
            yield rel, name, dirfd, st
            if not stat.S_ISDIR(st.st_mode):
                continue
            if len(stack) > MAX_DEPTH:
                if too_deep is not None:
                    too_deep(rel, name, dirfd)
                continue
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=dirfd)
            except OSError as err:
                if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue  # gone or swapped meanwhile
                err.filename = rel
                if onerror is not None:
                    onerror(err)
                continue
            enter(fd, rel)
    finally:
        for dirfd, _, _ in stack:
            os.close(dirfd)


def _walk(root: str, limit: int = MAX_SNAPSHOT_ENTRIES) -> tuple[list[tuple[str, os.stat_result]], bool]:
    """lstat every entry under root without following symlinks. Returns (entries, complete).

    Incomplete past ``limit`` entries or MAX_DEPTH levels, or when a directory is unlistable.
    """
    out: list[tuple[str, os.stat_result]] = []
    cut: list[object] = []
    rootfd = _open_root(root)
    try:
        walker = _iter_tree(rootfd, onerror=cut.append, too_deep=lambda *a: cut.append(a))
        try:
            for rel, _name, _dirfd, st in walker:
                out.append((rel, st))
                if len(out) >= limit:
                    return out, False
        finally:
            walker.close()
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot walk workspace {root}: {err.strerror}") from err
    finally:
        os.close(rootfd)
    return out, not cut


def snapshot(root: str) -> tuple[Snapshot, bool]:
    """Record every entry of ``root``: ``{relpath: (kind, size, mtime_ns, ino, mode)}``, complete."""
    entries, complete = _walk(root)
    return ({rel: (_kind(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino, stat.S_IMODE(st.st_mode))
             for rel, st in entries}, complete)


def diff(before: tuple[Snapshot, bool], after: tuple[Snapshot, bool], *, same_inodes: bool = True) -> Changes:
    """Compare two snapshots of the same workspace.

    ``same_inodes=False`` ignores inode numbers (a workspace copied back from a sized tmpfs
    has new inodes everywhere; size, mtime, mode and kind still tell what changed).
    """
    b, bc = before
    a, ac = after
    added = sorted(k for k in a if k not in b)
    deleted = sorted(k for k in b if k not in a)

    def key(entry: tuple[str, int, int, int, int]) -> tuple[object, ...]:
        return entry if same_inodes else (entry[0], entry[1], entry[2], entry[4])

    modified = sorted(k for k in a if k in b and key(a[k]) != key(b[k]) and a[k][0] != "dir")
    return Changes(tuple(added), tuple(modified), tuple(deleted), bc and ac)


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
    hard link.

    The file is opened without ``O_TRUNC`` and checked first: a symlink anywhere on the path
    (``O_NOFOLLOW`` per component), a special file, or a regular file with more than one hard
    link (a name the sandbox may have linked to another file) is refused before one byte
    changes.

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
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         0o644, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise WorkspaceError(err.errno, f"refusing to write {relpath!r}: a symlink is in the way "
                                 "(workspace content is untrusted)") from err
        raise WorkspaceError(err.errno, f"cannot write {relpath!r} in workspace: {err.strerror}") from err
    try:
        with os.fdopen(fd, "wb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise WorkspaceError(errno.EINVAL, f"refusing {relpath!r}: not a regular file")
            if st.st_nlink > 1:
                raise WorkspaceError(errno.EMLINK, f"refusing to write {relpath!r}: it has {st.st_nlink} hard "
                                     "links, so the write would change the other names too")
            os.ftruncate(f.fileno(), 0)
            f.write(data)
            f.flush()
            if uid is not None:
                os.fchown(f.fileno(), uid, gid if gid is not None else -1)
    except WorkspaceError:
        raise
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot write {relpath!r} in workspace: "
                             f"{err.strerror or err}") from err


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


def default_base() -> str:
    """The default parent of per-run workspaces: ``$LOWLEVEL_WORKSPACE_BASE`` or
    ``<tmpdir>/lowlevel-<uid>``."""
    return os.environ.get("LOWLEVEL_WORKSPACE_BASE") or os.path.join(_tempdir(),
                                                                     f"lowlevel-{os.getuid()}")


def _tempdir() -> str:
    """:func:`tempfile.gettempdir` without importing tempfile (~1.5 ms with its dependencies) or
    writing a probe file into ``/tmp`` at each process start: ``$TMPDIR``, ``$TEMP``, ``$TMP``,
    then ``/tmp``, ``/var/tmp``, ``/usr/tmp``, the first that is a directory we may write; the
    current directory else. An application that set ``tempfile.tempdir`` gets that."""
    tf = sys.modules.get("tempfile")
    if tf is not None and getattr(tf, "tempdir", None):
        return str(tf.gettempdir())
    for d in [os.environ.get(v) for v in ("TMPDIR", "TEMP", "TMP")] + ["/tmp", "/var/tmp", "/usr/tmp"]:
        if d and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
            return os.path.abspath(d)
    return os.getcwd()


def ensure_base(base: str) -> str:
    """Create the base dir if needed and check that it is ours and not a symlink.

    Mode 0711: the sandbox's uid (``nobody`` for root callers) can traverse it to reach its
    own run dir but cannot list the other runs.

    Raises:
        WorkspaceError: base exists but is a symlink, not a directory, or owned by someone else
            (a squatted ``/tmp/lowlevel-<uid>``).
    """
    if not isinstance(base, str) or not base or "\0" in base:
        raise WorkspaceError(errno.EINVAL, f"invalid workspace base {base!r}")
    base = os.path.abspath(base)
    real = os.path.realpath(base)
    for sysdir in SYSTEM_DIRS:
        if _inside(sysdir, real):
            # Never chmod (below) or fill a system or shared directory: `workspace_base="/tmp"` as
            # root made /tmp mode 0711.
            raise WorkspaceError(errno.EPERM, f"refusing workspace base {base}: it "
                                 f"{'is' if sysdir == real else 'contains'} the system directory "
                                 f"{sysdir}. Use a dedicated directory, e.g. {os.path.join(sysdir, 'lowlevel')}")
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
    if st.st_mode & stat.S_ISVTX:
        raise WorkspaceError(errno.EPERM, f"refusing workspace base {base}: it is a shared sticky directory "
                             "(like /tmp); use a dedicated directory inside it")
    if stat.S_IMODE(st.st_mode) & 0o022:
        os.chmod(base, 0o711)
    return base


def copy_inputs(root: str, inputs: Iterable[str | os.PathLike[str] | tuple[str, str]]) -> list[str]:
    """Copy files or directories into the workspace root, each under its base name, or at
    the destination given with it.

    Args:
        root: the workspace.
        inputs: each a host path (copied under its base name), or a ``(host path, dest)``
            pair, ``dest`` relative to the workspace (``"data/a.csv"``; parents are created,
            never through a symlink), so inputs keep their relative layout.

    Symlinks inside copied directories are copied as symlinks (not followed). Only regular
    files and directories are copied: a device (``/dev/zero`` never ends), a FIFO or a socket
    is refused.

    Returns:
        The relative names created.
    Raises:
        WorkspaceError: an input is missing or not a regular file or directory, or two inputs
            share a destination, or it exists already, or ``dest`` is absolute or has ``..``
            (EINVAL), or a symlink is in its way.
    """
    created: list[str] = []
    for item in inputs:
        if isinstance(item, tuple):
            src, dest_rel = os.fspath(item[0]), item[1]
            parts = _split_rel(dest_rel)
            name = "/".join(parts)
        else:
            src = os.fspath(item)
            name = os.path.basename(os.path.normpath(src)) if isinstance(src, str) else ""
            parts = [name]
        if not isinstance(src, str) or "\0" in src:
            raise WorkspaceError(errno.EINVAL, f"invalid input path {src!r:.80}")
        if not os.path.lexists(src):
            raise WorkspaceError(errno.ENOENT, f"input {src!r} does not exist")
        if not name or name in ("..", "."):
            raise WorkspaceError(errno.EINVAL, f"input {src!r} has no usable base name")
        try:
            st = os.stat(src)
        except OSError as err:
            raise WorkspaceError(err.errno or errno.EIO, f"cannot copy input {src!r}: {err.strerror}") from err
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise WorkspaceError(errno.EINVAL, f"input {src!r} is a {_file_type(st.st_mode)}, not a regular file "
                                 "or a directory: copy its content into a file first")
        try:
            # The parent is opened component by component with O_NOFOLLOW and the copy goes
            # through its pinned fd: a symlink in the workspace cannot send it elsewhere.
            dfd = _open_parent(root, parts, create=True)
        except OSError as err:
            raise WorkspaceError(err.errno or errno.EIO, f"input {src!r}: cannot make {name!r} in the "
                                 f"workspace: {err.strerror} (a symlink or file in the way?)") from err
        try:
            dest = f"/proc/self/fd/{dfd}/{parts[-1]}"
            if os.path.lexists(dest):
                raise WorkspaceError(errno.EEXIST, f"input {src!r}: {name!r} already exists in the workspace "
                                     "(two inputs with the same name?)")
            try:
                if stat.S_ISDIR(st.st_mode) and not os.path.islink(src):
                    shutil.copytree(src, dest, symlinks=True, copy_function=_copy_regular)
                else:
                    _copy_regular(src, dest)
            except WorkspaceError:
                raise
            except OSError as err:
                sh = sys.modules.get("shutil")  # imported above when copytree ran
                if sh is not None and isinstance(err, sh.Error):
                    errs = err.args[0] if err.args and isinstance(err.args[0], list) else []
                    detail = f"{errs[0][2]}" + (f" (and {len(errs) - 1} more)" if len(errs) > 1 else "") \
                        if errs else err
                    raise WorkspaceError(errno.EIO, f"cannot copy input {src!r}: {detail}") from err
                raise WorkspaceError(err.errno or errno.EIO, f"cannot copy input {src!r}: {err}") from err
        finally:
            os.close(dfd)
        created.append(name)
    return created


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


def _copy_regular(src: str, dst: str) -> str:
    """Copy one regular file (content, mode, times) following a symlink at ``src``, refusing
    anything else: a device (``/dev/zero`` never ends), a FIFO (blocks forever), a socket.
    Opened ``O_NONBLOCK`` and checked with fstat, so a file swapped for a FIFO cannot hang us."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot copy input {src!r}: {err.strerror}") from err
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise WorkspaceError(errno.EINVAL, f"input {src!r} is a {_file_type(st.st_mode)}, not a regular file: "
                                 "refusing to copy it")
        os.set_blocking(f.fileno(), True)
        with open(dst, "xb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
    shutil.copystat(src, dst)
    return dst


#: Name prefix of a fresh workspace its creator removes after the run (the CLI's ``--rm``,
#: ``keep_workspace=False``): ``rm-<pid>-<start time>-``, so that ``lowlevel cleanup`` can
#: remove the ones whose creator died before it could (:func:`disposable_owner`).
DISPOSABLE_PREFIX = "rm-"


def process_start_time(pid: int) -> int | None:
    """``starttime`` (field 22 of /proc/PID/stat, clock ticks since boot) of a live, non-zombie
    process, else None. With the PID, it names one process: a reused PID has another."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def disposable_owner(name: str) -> tuple[int, int] | None:
    """``(pid, start time)`` of the process that made the disposable workspace ``name``
    (a base name starting with :data:`DISPOSABLE_PREFIX`), or None for any other name."""
    parts = name[len(DISPOSABLE_PREFIX):].split("-") if name.startswith(DISPOSABLE_PREFIX) else []
    if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[0]), int(parts[1])


def creator_alive(pid: int, start_time: int) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` still runs (a reused PID is
    another process: not alive). Assumes the creator ran in this PID namespace."""
    return process_start_time(pid) == start_time


def create_workspace(inputs: Iterable[str | os.PathLike[str] | tuple[str, str]] = (),
                     base: str | None = None, *, disposable: bool = False) -> str:
    """Make a fresh per-run workspace under ``base`` and copy ``inputs`` into it.

    All or nothing: if a copy fails, the half-made workspace is removed.

    Args:
        inputs: host files or directories, each copied under its base name, or
            ``(path, dest)`` pairs (see :func:`copy_inputs`).
        base: parent directory; default :func:`default_base`.
        disposable: the caller removes it after the run (``--rm``, ``keep_workspace=False``):
            named ``rm-<pid>-<start time>-...`` (:data:`DISPOSABLE_PREFIX`) instead of
            ``run-...``, so that ``lowlevel cleanup`` removes it if the caller dies first.
    Returns:
        The workspace's absolute host path (mode 0700).
    Raises:
        WorkspaceError: see :func:`ensure_base` and :func:`copy_inputs`.
    """
    parent = ensure_base(base or default_base())
    prefix = "run-"
    if disposable:
        started = process_start_time(os.getpid())
        prefix = f"{DISPOSABLE_PREFIX}{os.getpid()}-{started}-" if started is not None else prefix
    try:
        path = _mkdtemp(parent, prefix)
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot create a workspace in {parent}: "
                             f"{err.strerror or err}") from err
    try:
        copy_inputs(path, inputs)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def _mkdtemp(parent: str, prefix: str) -> str:
    """:func:`tempfile.mkdtemp` (mode 0700, a fresh random name, never an existing entry)
    without importing tempfile."""
    for _ in range(100):
        path = os.path.join(parent, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return os.path.abspath(path)
    raise FileExistsError(errno.EEXIST, "no usable temporary directory name found", parent)


def remove_workspace(root: str) -> None:
    """Delete a workspace tree after its run, never following a symlink (``shutil.rmtree``'s
    fd-based walk). A missing tree is fine.

    A run as the caller's own uid can leave directories without ``u+w`` (``chmod 0500 d``)
    that rmtree could not empty: ours get ``u+rwx`` first. Root needs no such help.
    ``shutil.rmtree`` recurses (1,000 nested directories raise RecursionError): directories
    more than MAX_DEPTH levels deep are first moved up to the root, until none is left.

    Raises:
        WorkspaceError: the tree could not be removed entirely.
    """
    try:
        rootfd = _open_root(root)
    except WorkspaceError as err:
        if err.errno == errno.ENOENT:
            return
        raise
    try:
        me = os.getuid()
        if os.geteuid() != 0 and os.fstat(rootfd).st_uid == me:
            os.fchmod(rootfd, stat.S_IMODE(os.fstat(rootfd).st_mode) | stat.S_IRWXU)
        moved = 1
        serial = 0
        while moved:
            moved = 0

            def lift(_rel: str, name: str, dirfd: int) -> None:
                nonlocal moved, serial
                for _ in range(100):
                    serial += 1
                    try:
                        os.rename(name, f".lowlevel-deep-{serial}", src_dir_fd=dirfd, dst_dir_fd=rootfd)
                        moved += 1
                        return
                    except OSError as err:
                        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                            return

            for _rel, name, dirfd, st in _iter_tree(rootfd, too_deep=lift):
                if os.geteuid() != 0 and stat.S_ISDIR(st.st_mode) and st.st_uid == me \
                        and st.st_mode & 0o700 != 0o700:
                    try:
                        os.chmod(name, stat.S_IMODE(st.st_mode) | stat.S_IRWXU, dir_fd=dirfd, follow_symlinks=False)
                    except (OSError, NotImplementedError, ValueError):
                        continue
    except OSError:
        pass  # rmtree below reports what is left
    finally:
        os.close(rootfd)
    try:
        shutil.rmtree(root)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot remove workspace {root}: {err}") from err


def chown_tree(root: str, uid: int, gid: int, *, only_from: int | None = None) -> None:
    """Give the tree to uid:gid without following symlinks (lchown).

    Regular files with several hard links are skipped: changing their owner would change the
    owner of the other names too, which may lie outside the workspace. Iterative; directories
    more than MAX_DEPTH levels deep are given too but not entered.

    Args:
        only_from: when set, change only entries currently owned by this uid.
    """
    def fix(name: str, dir_fd: int | None, st: os.stat_result) -> None:
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            return
        if only_from is not None and st.st_uid != only_from:
            return
        if st.st_uid != uid or st.st_gid != gid:
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)

    st = os.lstat(root)
    fix(root, None, st)
    if not stat.S_ISDIR(st.st_mode):
        return
    rootfd = _open_root(root)
    try:
        for _rel, name, dirfd, st in _iter_tree(rootfd):
            try:
                fix(name, dirfd, st)
            except FileNotFoundError:
                pass
    finally:
        os.close(rootfd)


# --- handing a workspace to the sandbox and taking it back ------------------------------------

#: S_ISUID | S_ISGID: the bits that make an executable run with its owner's or group's ids.
SETID_BITS = stat.S_ISUID | stat.S_ISGID
#: Cap on pre-existing setuid/setgid non-directories pinned with an O_PATH fd during a run
#: (callers whose sandbox runs as their own uid); see :class:`Handover`.
MAX_PINNED = 256

#: Directories that are never a workspace themselves (the workspace is bound read-write and,
#: for root callers, handed to the sandbox's uid for the run). ``/lib`` and ``/bin`` resolve into
#: ``/usr`` on usr-merged hosts; both spellings are here for the others.
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
               "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr",
               "/var", "/var/cache", "/var/lib", "/var/log", "/var/mail", "/var/spool", "/var/tmp")
#: Trees no workspace may lie inside (system files, devices, kernel interfaces, sockets).
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run",
                "/sbin", "/sys", "/usr")


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def workspace_refusal(path: str) -> str | None:
    """Say why host directory ``path`` must not be a workspace, or None.

    Refused: ``/`` and the system directories (:data:`SYSTEM_DIRS`), anything inside a system
    tree (:data:`SYSTEM_TREES`), a directory containing any of those, and whatever
    :func:`lowlevel.spec.policy.sensitive_reason` flags (home directories and anything containing
    one, credential locations, ``/run``, sockets). Behind this: ``lowlevel run --workspace /root``
    as root handed all of ``/root`` to uid 65534 for the run.

    Args:
        path: absolute and resolved (``os.path.realpath``).
    """
    from lowlevel.spec.policy import sensitive_reason  # policy imports seccomp and limits: keep this module light

    reason = sensitive_reason(path)
    if reason:
        return reason
    for sysdir in SYSTEM_DIRS:
        if _inside(sysdir, path):
            what = "is" if sysdir == path else "contains"
            return f"it {what} the system directory {sysdir}"
    for tree in SYSTEM_TREES:
        if _inside(path, tree):
            return f"it is inside the system tree {tree}"
    return None


def check_workspace_path(path: str, *, allow_sensitive: bool = False, check_ancestors: bool = True,
                         writable: bool = True) -> None:
    """Refuse a workspace :func:`workspace_refusal` flags, before anything touches it.

    Args:
        path: absolute and resolved (``os.path.realpath``).
        allow_sensitive: skip the check (API ``allow_sensitive_workspace=True``, CLI
            ``--allow-sensitive``).
        check_ancestors: also :func:`check_trusted_ancestors` (whenever the workspace will be
            reached by path again; a copy-on-write run opens it once, by fd).
        writable: also :func:`check_writable_fs` (whenever the run's changes will be written
            into it: a read-only workspace is fine for a copy-on-write run that commits nothing).
    Raises:
        WorkspaceError: (EPERM) the message says why and how to override.
    """
    if check_ancestors:
        check_trusted_ancestors(path)
    if writable:
        check_writable_fs(path)
    if allow_sensitive:
        return
    reason = workspace_refusal(path)
    if reason:
        raise WorkspaceError(errno.EPERM, f"refusing workspace {path}: {reason}. The workspace is bound "
                             "read-write into the sandbox (and, for a root caller, handed to the sandbox's "
                             "uid for the run): use a dedicated project directory, or pass "
                             "allow_sensitive_workspace=True (CLI: --allow-sensitive) if you really mean it")


def check_writable_fs(path: str) -> None:
    """Refuse a workspace on a read-only file system, before anything runs.

    The workspace is bound read-write and, for root callers, handed to the sandbox's uid and
    back (chown), which a read-only mount refuses with EROFS; the program's writes would fail
    too. Source: statvfs(3) ``ST_RDONLY``.

    Raises:
        WorkspaceError: (EROFS) the message names the mount's state and what to do.
    """
    try:
        readonly = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot check workspace {path}: {err.strerror}") from err
    if readonly:
        raise WorkspaceError(errno.EROFS, f"workspace {path} is on a read-only file system: the sandbox needs a "
                             "writable workspace. Copy the files in with --input (inputs=[...]), or bind the "
                             "directory read-only with --ro (Bind(...)) and keep a fresh workspace")


def check_trusted_ancestors(path: str) -> None:
    """Refuse a workspace whose parent directories someone else could rename or replace.

    Everything lowlevel does to a workspace after the run (giving ownership back, copying a
    sized workspace back) reaches it by path again. If another local user owns, or may write
    to, any directory above it, they can swap that directory for a symlink during the run and
    redirect root's chown/rmtree/rename to ``/etc`` (a confirmed attack). So each ancestor
    must be owned by root or by the caller, and not group/other-writable unless sticky
    (``/tmp``: others cannot rename entries they do not own). The workspace itself may
    belong to anyone: its last component is opened with O_NOFOLLOW.

    Args:
        path: absolute and resolved (``os.path.realpath``).
    Raises:
        WorkspaceError: (EPERM) names the ancestor, its owner and mode, and the fix.
    """
    try:
        found = first_untrusted_dir(path)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot check {err.filename} above workspace {path}: {err.strerror}") from err
    if found is not None:
        cur, st = found
        raise WorkspaceError(errno.EPERM, f"refusing workspace {path}: {cur} (owner uid {st.st_uid}, mode "
                             f"{stat.S_IMODE(st.st_mode):04o}) could be renamed or replaced by another user during "
                             "the run, redirecting what lowlevel does to the workspace afterwards. Use a "
                             "workspace below directories owned by root or by you and not writable by others"
                             + (" (or run lowlevel as that user)" if os.geteuid() == 0 else ""))


def first_untrusted_dir(path: str, *, include_self: bool = False) -> tuple[str, os.stat_result] | None:
    """The first directory another user could rename, replace or fill, from ``path``'s parent
    (``path`` itself first with ``include_self``) up to ``/``, with its lstat; None if none.

    Untrusted: not a directory, owned by neither root nor the caller, or writable by group or
    others, which a sticky bit excuses on an ancestor (``/tmp``: others cannot rename entries
    they do not own) but not on ``path`` itself (anyone could still add or swap its entries).

    Raises:
        OSError: an lstat failed (``filename`` names the directory).
    """
    trusted = {0, os.geteuid()}
    path = path.rstrip("/") or "/"
    cur = path if include_self else os.path.dirname(path) or "/"
    while True:
        st = os.lstat(cur)
        mode = st.st_mode
        itself = include_self and cur == path
        others_write = mode & (stat.S_IWGRP | stat.S_IWOTH) and (itself or not mode & stat.S_ISVTX)
        if st.st_uid not in trusted or not stat.S_ISDIR(mode) or others_write:
            return cur, st
        if cur == "/":
            return None
        cur = os.path.dirname(cur)


@dataclass
class Handover:
    """What :func:`hand_over` changed and saw, for :func:`give_back` after the run.

    Attributes:
        root: the workspace's host path.
        before: the snapshot before the run (``(Snapshot, complete)``, as :func:`snapshot`).
        root_ids: ``(uid, gid, mode)`` of the root directory before the run (mode with its
            special bits).
        owners: ``{(st_dev, st_ino): (uid, gid, st_mode)}`` of every entry below the root
            before the run (the inodes that existed before it).
        pins: ``{(st_dev, st_ino): fd}``: O_PATH fds holding pre-existing setuid/setgid
            non-directories alive while the sandbox (as the caller's own uid) could delete
            them: an inode that cannot be freed cannot have its number reused by a file the
            sandbox makes, so a matching number after the run is the same file.
        sandbox_uid: the host uid the sandbox ran as when it differs from the caller's (root
            callers), else None.
        new_owner: ``(uid, gid)`` given to inodes the run created (the root's owner and group).
        acls: ``{(st_dev, st_ino): {xattr: value}}``: the POSIX ACLs (:data:`ACL_XATTRS`) of
            entries handed to the sandbox's uid that had any before the run (root callers).
        stamps: ``{(st_dev, st_ino): (size, mtime_ns, ctime_ns)}`` of pre-existing
            setuid/setgid non-directories: one whose stamp changed was written (a write
            through a ``MAP_SHARED`` mapping keeps the bits) and loses them.
        notes: what :func:`give_back` could not do exactly (for ``Result.notes``).
        done: True once :func:`give_back` ran.
        journal: root callers: the on-disk record of this hand-over
            (:class:`lowlevel.workspace.handover_journal.Journal`), removed once given back.
        lock_fd: root callers: a ``flock(LOCK_EX)`` on the root directory, held until given
            back (closed with the pins): a second hand-over of the same workspace meanwhile
            would record the first sandbox's owners as the originals and give them back.
    """

    root: str
    before: tuple[Snapshot, bool]
    root_ids: tuple[int, int, int]
    owners: dict[tuple[int, int], tuple[int, int, int]]
    pins: dict[tuple[int, int], int]
    sandbox_uid: int | None
    new_owner: tuple[int, int]
    acls: dict[tuple[int, int], dict[str, bytes]] = field(default_factory=dict)
    stamps: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    done: bool = False
    journal: Any = None
    lock_fd: int = -1


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


def _open_root(root: str) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot open workspace {root}: {err.strerror}") from err


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
        from lowlevel.workspace import handover_journal as _journal
        _done, problems = _journal.recover(root)
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
            from lowlevel.workspace import handover_journal as _journal
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
    snap: Snapshot = {}
    complete = True
    try:
        rootfd = _open_root(h.root)
    except WorkspaceError:
        _close_pins(h)
        raise
    unlisted: list[OSError] = []
    deep: list[str] = []

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
        try:
            uid, gid, mode = h.root_ids
            cur = os.fstat(rootfd)
            if (cur.st_uid, cur.st_gid) != (uid, gid):
                os.fchown(rootfd, uid, gid)
            if stat.S_IMODE(cur.st_mode) != mode or (cur.st_uid, cur.st_gid) != (uid, gid):
                os.fchmod(rootfd, mode)
        except OSError as err:
            raise WorkspaceError(err.errno, f"cannot give back workspace {h.root}: {err.strerror}") from err
        finally:
            os.close(rootfd)
            _close_pins(h)
            if h.journal is not None:
                h.journal.close()  # kept on failure: `lowlevel cleanup` retries once we are gone
    if h.journal is not None and not (unlisted and h.sandbox_uid is not None):
        h.journal.remove()
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
    return snap, complete and h.before[1]


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


__all__ = ["ACL_XATTRS", "MAX_DEPTH", "MAX_PINNED", "SETID_BITS", "SYSTEM_DIRS", "SYSTEM_TREES", "Changes",
           "FileEntry", "Handover", "check_traversable", "check_trusted_ancestors", "check_workspace_path",
           "check_writable_fs",
           "chown_tree", "copy_inputs", "create_workspace", "default_base", "diff", "ensure_base", "give_back",
           "hand_over", "list_files", "make_dir", "make_symlink", "read_file", "remove_workspace", "set_mode",
           "snapshot", "workspace_refusal", "write_file"]
