"""cgroupfs I/O: the few system calls the cgroup code makes on ``/sys/fs/cgroup`` files.

One concept: how a cgroup file is read or written (one ``write(2)``, no ``O_CREAT``; an
unbuffered read that owns its fd). :mod:`lowlevel.host.cgroup_detect` and
:mod:`lowlevel.host.cgroups` call these through the module (``cgroupfs.write(...)``), so a test
can stand in a fake kernel by replacing them here once (tests/unit/test_limits.py).

Source: cgroups(7); the kernel's Documentation/admin-guide/cgroup-v2.rst ("Interface Files").
"""

from __future__ import annotations

import os
import signal

#: What a ``max`` in a cgroup file reads as (``pids.max``, ``memory.max``...): the largest int64.
MAX = 2**63 - 1


def mkdir(path: str, exist_ok: bool = False) -> None:
    """mkdir(2) ``path`` mode 0755 (a new cgroup); ``exist_ok``: an existing one is fine.

    Raises:
        OSError: EEXIST (unless ``exist_ok``), EACCES, ENOENT...
    """
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        if not exist_ok:
            raise


def rmdir(path: str) -> None:
    """rmdir(2) ``path`` (a cgroup; EBUSY while it holds a task or a child)."""
    os.rmdir(path)


def write(path: str, text: str) -> None:
    """One write(2) of ``text``, no O_CREAT: cgroupfs files exist or the feature is missing."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read(path: str, *, one_record: bool = False) -> str:
    """The whole file as ASCII text (undecodable bytes replaced).

    ``one_record``: the file is one record of the kernel's seq_file (a counter or a flat-keyed
    file whose ``seq_show`` prints it all at once: ``memory.max_usage_in_bytes``,
    ``memory.oom_control``, ``pids.events``, ``pids.peak``, ``cpu.stat``), so a read that returns
    less than it asked for got the end of it and the read(2) that would return 0 is skipped
    (fs/seq_file.c ``seq_read_iter``: the record is formatted whole, then copied out up to the
    caller's count). Not for multi-record files (``cgroup.procs``, ``/proc/self/mountinfo``),
    where a read stops short before a record that does not fit.

    Raises:
        OSError: the file cannot be opened or read.
    """
    # An unbuffered binary open() (no text wrapper for a file of a few bytes: a run reads about
    # eight of them), not a bare os.open: the FileIO owns the fd (O_CLOEXEC) from the instant
    # the C call returns, so a signal handler's exception (^C's KeyboardInterrupt) raised before
    # the ``with`` is entered drops its last reference, which closes it; os.open's int was
    # lost (one fd per run interrupted while its cgroup's figures were read).
    with open(path, "rb", buffering=0) as f:
        chunks = []
        while chunk := f.read(65536):
            chunks.append(chunk)
            if one_record and len(chunk) < 65536:
                break
    return b"".join(chunks).decode("ascii", "replace")


def read_words(path: str) -> set[str]:
    """The whitespace-separated words of ``path`` (``cgroup.controllers``...); empty if unreadable."""
    try:
        return set(read(path).split())
    except OSError:
        return set()


def read_int(path: str, *, one_record: bool = False) -> int | None:
    """One number (``max`` reads as :data:`MAX`); None if unreadable or not a number.
    ``one_record``: as :func:`read`."""
    try:
        text = read(path, one_record=one_record).strip()
    except OSError:
        return None
    return MAX if text == "max" else int(text) if text.isdigit() else None


def read_ints(path: str) -> list[int]:
    """Whitespace-separated numbers (``cgroup.procs``, ``tasks``); empty if unreadable."""
    try:
        return [int(w) for w in read(path).split()]
    except (OSError, ValueError):
        return []


def read_keyed(path: str, *, one_record: bool = False) -> dict[str, int]:
    """Parse ``key value`` lines (``memory.events``, ``cpu.stat``, ``memory.oom_control``);
    ``one_record``: as :func:`read`."""
    try:
        return parse_keyed(read(path, one_record=one_record))
    except OSError:
        return {}


def parse_keyed(text: str) -> dict[str, int]:
    """``{key: value}`` of the ``key value`` lines of ``text`` whose value is a number."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def kill(pid: int) -> None:
    """SIGKILL ``pid``; a process already gone (or not ours) is ignored."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
