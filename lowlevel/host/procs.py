"""Host processes: is a given process (pid + start time) or any process of a uid still running.

A PID alone does not name a process: once it exits its number may be reused. The pair
``(pid, starttime)`` (field 22 of ``/proc/PID/stat``, proc(5)) does, so every record lowlevel
leaves on disk for a later ``lowlevel cleanup`` (run records, hand-over journals, disposable
workspace names, image import staging directories) stores both, and these functions answer
whether that process still runs. All read ``/proc`` of the caller's PID namespace.
"""

from __future__ import annotations

import os


def process_start_time(pid: int) -> int | None:
    """``starttime`` (field 22 of /proc/PID/stat, clock ticks since boot) of a live, non-zombie
    process, else None. With the PID, it names one process: a reused PID has another."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` (clock ticks since boot, as
    :func:`process_start_time`) still runs (a reused PID is another process: not alive).
    Assumes the process ran in this PID namespace."""
    return process_start_time(pid) == start_time


def pid_alive(pid: int) -> bool:
    """Whether some process has PID ``pid`` (``kill(pid, 0)``, kill(2); a process we may not
    signal counts as alive; a zombie too). This process is alive."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def uid_runs_a_process(uid: int) -> bool:
    """Whether any process visible in ``/proc`` has ``uid`` as its real, effective, saved or
    filesystem uid (the ``Uid:`` line of ``/proc/PID/status``, proc(5))."""
    want = str(uid).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if want in line.split()[1:]:
                            return True
                        break
        except OSError:
            continue
    return False


__all__ = ["pid_alive", "process_alive", "process_start_time", "uid_runs_a_process"]
