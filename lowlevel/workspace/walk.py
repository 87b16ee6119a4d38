"""The fd-relative, no-follow, iterative walk of an untrusted workspace tree.

Every reader of a workspace after a run (snapshots, listings, the hand-back, removal) walks it
with :func:`_iter_tree`: ``openat`` relative to directory fds, ``O_NOFOLLOW`` on every
directory, one fd per level, at most MAX_DEPTH levels entered.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Generator

from lowlevel.errors import WorkspaceError

#: Cap on the entries a snapshot visits; beyond it the change report is marked incomplete.
MAX_SNAPSHOT_ENTRIES = 100_000


#: Directory levels below the root that the walks enter. The walks are iterative and hold one
#: fd per level; a directory deeper than this is not entered (see :func:`give_back`).
MAX_DEPTH = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_root(root: str) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot open workspace {root}: {err.strerror}") from err


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
