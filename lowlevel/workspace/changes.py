"""What a run changed in its workspace: entries, snapshots and their difference.

:func:`snapshot` records every entry of a workspace (through the no-follow walk of
:mod:`lowlevel.workspace.walk`); :func:`diff` compares two snapshots into :class:`Changes`.
"""

from __future__ import annotations

import stat

from lowlevel._dataclass import dataclass
from lowlevel.workspace.walk import _walk


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
