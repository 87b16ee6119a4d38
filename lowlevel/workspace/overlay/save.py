"""An upper directory that is not committed: saved aside for the user, or cleared.

:func:`save_upper` copies it (with :func:`lowlevel.workspace.overlay.commits.commit`'s rules)
into a fresh directory with the lists of its whiteouts and opaque directories;
:func:`clear_dir` empties a dropped upper layer.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

from lowlevel.errors import WorkspaceError
from lowlevel.workspace.overlay.apply import Applier
from lowlevel.workspace.overlay.fdops import _DIR_FLAGS, XATTR_PREFIXES, _remove_tree, _serial
from lowlevel.workspace.overlay.state import _check_owner
from lowlevel.workspace.overlay.upper import _check_prefix

#: Files written by :func:`save_upper` next to the saved ``tree``.
SAVED_WHITEOUTS = "whiteouts"
SAVED_OPAQUE = "opaque"
SAVED_SKIPPED = "skipped"
#: Files :func:`commit` adds next to a saved ``tree`` when it stopped or found host changes
#: part-way: the relative paths it applied, and those it did not (NUL-terminated each).
SAVED_APPLIED = "applied"
SAVED_NOT_APPLIED = "not-applied"


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
                _save_into(upper_fd, pfd, xattr_prefix, owner, max_bytes)
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


def _save_into(upper_fd: int, pfd: int, xattr_prefix: str, owner: tuple[int, int] | None,
               max_bytes: int | None) -> None:
    """Fill the new save directory ``pfd``: ``tree/`` and the lists (see :func:`save_upper`)."""
    os.mkdir("tree", 0o700, dir_fd=pfd)
    tfd = os.open("tree", _DIR_FLAGS, dir_fd=pfd)
    try:
        work = Applier(upper_fd, tfd, prefix=xattr_prefix, since_ns=None, new_owner=owner,
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
