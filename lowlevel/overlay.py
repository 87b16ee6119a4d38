"""Interim upper-layer reader/committer (replaced by the full module from the `commit` branch)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass, field

from .errors import WorkspaceError
from .workspace import Changes, _iter_tree

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class CommitConflictError(WorkspaceError):
    """Entries changed on the host during the run."""

    saved_upper: str | None = None
    result: object = None


@dataclass
class CommitReport:
    notes: list[str] = field(default_factory=list)


def _whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def read_changes(upper_fd: int, lower_fd: int, *, xattr_prefix: str) -> Changes:
    added, modified, deleted = [], [], []
    for rel, name, _dirfd, st in _iter_tree(upper_fd):
        try:
            lst = os.stat(rel, dir_fd=lower_fd, follow_symlinks=False)
        except OSError:
            lst = None
        if _whiteout(st):
            deleted.append(rel)
        elif lst is None:
            added.append(rel)
        elif not stat.S_ISDIR(st.st_mode):
            modified.append(rel)
    return Changes(tuple(sorted(added)), tuple(sorted(modified)), tuple(sorted(deleted)))


def commit(upper_fd: int, lower_fd: int, *, xattr_prefix: str, since_ns: int,
           new_owner: tuple[int, int] | None, max_bytes: int | None = None) -> CommitReport:
    report = CommitReport()
    for rel, name, dirfd, st in _iter_tree(upper_fd):
        parent = os.path.dirname(rel)
        try:
            lst = os.stat(rel, dir_fd=lower_fd, follow_symlinks=False)
        except OSError:
            lst = None
        if lst is not None and lst.st_ctime_ns > since_ns:
            raise CommitConflictError(errno.EBUSY, f"{rel} changed on the host during the run")
        if _whiteout(st):
            if lst is not None:
                if stat.S_ISDIR(lst.st_mode):
                    shutil.rmtree(os.path.join(f"/proc/self/fd/{lower_fd}", rel))
                else:
                    os.unlink(rel, dir_fd=lower_fd)
            continue
        mode = stat.S_IMODE(st.st_mode) & ~0o6000
        if stat.S_ISDIR(st.st_mode):
            if lst is None:
                os.mkdir(rel, mode, dir_fd=lower_fd)
                if new_owner:
                    os.chown(rel, *new_owner, dir_fd=lower_fd, follow_symlinks=False)
            continue
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=dirfd)
            if lst is not None:
                os.unlink(rel, dir_fd=lower_fd)
            os.symlink(target, rel, dir_fd=lower_fd)
            continue
        if not stat.S_ISREG(st.st_mode):
            report.notes.append(f"skipped special file {rel}")
            continue
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        tmp = f"{parent}/.lowlevel-commit-{os.getpid()}" if parent else f".lowlevel-commit-{os.getpid()}"
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                      dir_fd=lower_fd)
        try:
            while True:
                b = os.read(src, 1 << 20)
                if not b:
                    break
                os.write(dst, b)
            os.fchmod(dst, mode)
            owner = (lst.st_uid, lst.st_gid) if lst is not None else new_owner
            if owner:
                os.fchown(dst, *owner)
        finally:
            os.close(src)
            os.close(dst)
        os.rename(tmp, rel, src_dir_fd=lower_fd, dst_dir_fd=lower_fd)
    return report


def save_upper(upper_fd: int, dest: str) -> str:
    shutil.copytree(f"/proc/self/fd/{upper_fd}", os.path.join(dest, "upper"), symlinks=True)
    return dest


def clear_dir(fd: int) -> None:
    for name in os.listdir(fd):
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _DIR, dir_fd=fd)
            try:
                clear_dir(sub)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)
