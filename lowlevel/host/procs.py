"""Facts about host processes read from ``/proc``: one concept, which process a PID names now.

Source: proc(5), ``/proc/[pid]/stat``.
"""

from __future__ import annotations


def process_start_time(pid: int) -> int | None:
    """``starttime`` (field 22 of /proc/PID/stat, clock ticks since boot) of a live, non-zombie
    process, else None. With the PID, it names one process: a reused PID has another."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])
