"""The host's processes by command line, read from /proc, for the tests that look for what a
run left behind (issue 26: the same /proc scanner was written in many modules).

proc(5): ``/proc/PID/cmdline`` holds the arguments NUL-separated, each ending in NUL (empty for
a zombie or a kernel thread); a process can end between the listing and the read, which is
then skipped. The test process itself is never reported (its own command line may hold the
marker, e.g. in pytest's ``-k``, and it is never a leftover).
"""

from __future__ import annotations

import os
from collections.abc import Iterator


def cmdlines() -> Iterator[tuple[int, bytes]]:
    """``(pid, raw cmdline)`` of every process but this one that can still be read."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                yield int(name), f.read()
        except OSError:
            continue


def pids_with(marker: str | bytes, *, whole_arg: bool = False) -> list[int]:
    """PIDs whose command line contains ``marker`` (``whole_arg``: as one whole argument)."""
    needle = marker.encode() if isinstance(marker, str) else marker
    if whole_arg:
        return [pid for pid, raw in cmdlines() if b"\0" + needle + b"\0" in b"\0" + raw]
    return [pid for pid, raw in cmdlines() if needle in raw]


def running_exactly(argv: list[str]) -> bool:
    """A process runs exactly ``argv`` (e.g. ``["sleep", MARKER]``: the sandboxed program, not a
    caller whose command line holds the marker inside a longer argument)."""
    want = b"".join(os.fsencode(a) + b"\0" for a in argv)
    return any(raw == want for _pid, raw in cmdlines())


def sleep_running(marker: str) -> bool:
    """A process runs ``sleep MARKER`` exactly (the sandboxed program; not the caller, whose
    command line holds the marker inside one shell argument)."""
    return running_exactly(["sleep", marker])
