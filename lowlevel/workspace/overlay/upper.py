"""Reading a run's upper directory: whiteouts, opaque directories, the change report.

:func:`read_changes` turns an overlayfs upper directory into :class:`lowlevel.workspace.Changes`
against the user's directory, in O(entries in the upper) (see :mod:`lowlevel.workspace.overlay`
for what an upper directory holds).
"""

from __future__ import annotations

import errno
import os
import stat

from lowlevel.errors import WorkspaceError
from lowlevel.workspace.changes import Changes
from lowlevel.workspace.overlay.fdops import (
    _DIR_FLAGS,
    XATTR_PREFIXES,
    _at,
    _getxattr,
    _join,
    _listxattr,
    _lstat,
    _open_dir_here,
)
from lowlevel.workspace.walk import MAX_DEPTH, MAX_SNAPSHOT_ENTRIES


def _check_prefix(xattr_prefix: str) -> None:
    if xattr_prefix not in XATTR_PREFIXES:
        raise ValueError(f"xattr_prefix must be one of {XATTR_PREFIXES}, not {xattr_prefix!r}")
    if xattr_prefix.startswith("trusted.") and os.geteuid() != 0:
        raise ValueError("xattr_prefix 'trusted.overlay.' is for overlays mounted by root: trusted.* xattrs "
                         "are readable only with CAP_SYS_ADMIN; an unprivileged caller's userxattr overlay "
                         "uses 'user.overlay.'")


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


def upper_is_empty(upper_fd: int) -> bool:
    """True when the upper directory holds no entry at all: one ``getdents64`` of its root
    returns only ``.`` and ``..``.

    Such an upper changed nothing a commit or :func:`read_changes` would see: every change a
    run can make (a new, modified or copied-up entry, a whiteout of a deletion, an opaque
    directory, an xattr whiteout) is an entry below the root, and the root's own metadata is
    never reported or applied (it belongs to the mount; the root is never opaque: overlayfs
    merges the layer roots, and the program cannot remove its own mount point). Source:
    the kernel's Documentation/filesystems/overlayfs.rst ("whiteouts and opaque directories").

    Args:
        upper_fd: ``O_DIRECTORY`` (or ``O_PATH``) fd on the upper directory; its offset is not
            used (the root is opened anew).
    Raises:
        OSError: the upper directory cannot be opened or listed.
    """
    fd = os.open(".", _DIR_FLAGS, dir_fd=upper_fd)
    try:
        with os.scandir(fd) as it:  # readdir skips . and ..; stops at the first entry
            return next(it, None) is None
    finally:
        os.close(fd)


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
    try:
        if upper_is_empty(upper_fd):
            return Changes()  # nothing written (issue 27: the walk's fds and lists skipped)
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot open the upper directory: {err.strerror}") from err
    reader = _ChangeReader(xattr_prefix, limit)
    try:
        reader.open_roots(upper_fd, lower_fd)
        while reader.stack:
            reader.step()
    except WorkspaceError:
        raise
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot read the upper directory: {err}") from err
    finally:
        reader.close()
    return reader.changes()


class _ChangeReader:
    """The walk of :func:`read_changes`: one frame per upper directory being listed, with the
    lower directory of the same path (None: the lower has none there)."""

    def __init__(self, prefix: str, limit: int) -> None:
        self.prefix = prefix
        self.limit = limit
        self.added: list[str] = []
        self.modified: list[str] = []
        self.deleted: list[str] = []
        self.inodes: set[tuple[int, int]] = set()
        self.total = 0
        self.count = 0
        self.complete = True
        # Each frame: upper dir fd, lower dir fd (None: no lower dir at this path), relative path,
        # names left (reversed), effectively opaque, holds xattr whiteouts.
        self.stack: list[tuple[int, int | None, str, list[str], bool, bool]] = []

    def changes(self) -> Changes:
        return Changes(tuple(sorted(self.added)), tuple(sorted(self.modified)), tuple(sorted(self.deleted)),
                       self.complete, self.total)

    def record(self, lst: list[str], rel: str) -> None:
        if self.count < self.limit:
            lst.append(rel)
            self.count += 1
        else:
            self.complete = False

    def close(self) -> None:
        for ufd, lfd, _, _, _, _ in self.stack:
            os.close(ufd)
            if lfd is not None:
                os.close(lfd)
        self.stack.clear()

    def enter(self, ufd: int, lfd: int | None, rel: str, opaque: bool, xwhiteouts: bool) -> None:
        """List upper directory ``ufd`` (owning both fds from now on); under an opaque one, the
        lower entries absent from the upper are deleted."""
        try:
            names = os.listdir(ufd)
            if opaque and lfd is not None:
                present = set(names)
                try:
                    lower_names = sorted(os.listdir(lfd))
                except PermissionError:
                    lower_names = []
                    self.complete = False  # someone else's unreadable directory: its old entries unknown
                for name in lower_names:
                    if name not in present:
                        self.record(self.deleted, _join(rel, name))
        except BaseException:
            os.close(ufd)
            if lfd is not None:
                os.close(lfd)
            raise
        names.reverse()
        self.stack.append((ufd, lfd, rel, names, opaque, xwhiteouts))

    def open_roots(self, upper_fd: int, lower_fd: int) -> None:
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
            root_x = _dir_flags(ufd0, ".", self.prefix)[1]
        except BaseException:
            os.close(ufd0)
            os.close(lfd0)
            raise
        self.enter(ufd0, lfd0, "", False, root_x)

    def step(self) -> None:
        """Classify the next entry of the top frame (see :func:`read_changes`), or pop the frame."""
        ufd, lfd, rel_dir, names, opaque, xwhiteouts = self.stack[-1]
        if not names:
            self.stack.pop()
            os.close(ufd)
            if lfd is not None:
                os.close(lfd)
            return
        name = names.pop()
        ust = _lstat(ufd, name)
        if ust is None:
            return
        rel = _join(rel_dir, name)
        key = (ust.st_dev, ust.st_ino)
        if key not in self.inodes:
            self.inodes.add(key)
            self.total += ust.st_blocks * 512
        lst = _lstat(lfd, name) if lfd is not None else None
        mode = ust.st_mode
        if not stat.S_ISDIR(mode):
            if _is_whiteout(ust, ufd, name, self.prefix, xwhiteouts):
                if lst is not None:
                    self.record(self.deleted, rel)
            else:
                self.record(self.added if lst is None else self.modified, rel)
            return
        if lst is None:
            self.record(self.added, rel)
        elif not stat.S_ISDIR(lst.st_mode) or stat.S_IMODE(lst.st_mode) != stat.S_IMODE(mode):
            self.record(self.modified, rel)
        if len(self.stack) > MAX_DEPTH:
            self.complete = False
            return
        self.descend(ufd, lfd, name, rel, lst, opaque)

    def descend(self, ufd: int, lfd: int | None, name: str, rel: str, lst: os.stat_result | None,
                opaque: bool) -> None:
        """Enter upper directory ``name`` (and the lower directory of that path, if any)."""
        try:
            cfd = os.open(name, _DIR_FLAGS, dir_fd=ufd)
        except PermissionError:
            # The run made it unreadable to its owner (chmod 000), and an unprivileged
            # caller is that owner without CAP_DAC_OVERRIDE: reported, not entered.
            self.complete = False
            return
        try:
            is_opaque, child_x = _dir_flags(cfd, rel, self.prefix)
            clfd = None
            if lst is not None and lfd is not None and stat.S_ISDIR(lst.st_mode):
                try:
                    clfd = _open_dir_here(lfd, name)
                except OSError as err:
                    if err.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EXDEV):
                        raise
                    self.complete = False  # changed meanwhile, unreadable or a mount point: not compared
        except BaseException:
            os.close(cfd)
            raise
        self.enter(cfd, clfd, rel, opaque or is_opaque, child_x)
