"""What commits killed mid-way left in the user's directory, and removing it.

A commit names its temporaries ``.lowlevel-commit-<pid>-<n>`` and journals the directories
holding them in ``.lowlevel-commit-<pid>.journal``; :func:`cleanup_commit_leftovers` removes
those of pids that no longer run.
"""

from __future__ import annotations

import errno
import os

from lowlevel.errors import WorkspaceError
from lowlevel.host.procs import pid_alive
from lowlevel.workspace.overlay.fdops import _DIR_FLAGS, _READ_FLAGS, LEFTOVER_PREFIX, _join, _remove_tree


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
                dead[parsed[0]] = not pid_alive(parsed[0])
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
