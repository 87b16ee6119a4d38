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


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def dying(pid: int) -> bool:
    """``pid`` is on its way out: gone, a zombie, in an uninterruptible sleep (D: e.g. its last
    write to a loop-backed ext4 under load), or with a SIGKILL pending (proc(5): State, SigPnd,
    ShdPnd), as opposed to a process that kept running (S/R, no kill pending): a leak."""
    st = _status(pid)
    if not st:
        return True
    if st.get("State", "")[:1] in ("Z", "X", "D"):
        return True
    return any((int(st.get(k, "0"), 16) >> 8) & 1 for k in ("SigPnd", "ShdPnd"))  # bit 9: SIGKILL


def describe(pids: list[int]) -> list[str]:
    """``pid State Name PPid SigPnd/ShdPnd`` of each, to tell a slow death from a leak."""
    out = []
    for pid in pids:
        st = _status(pid)
        out.append(f"{pid} {st.get('State', '(gone)')} {st.get('Name', '')} ppid={st.get('PPid', '')} "
                   f"pnd={st.get('SigPnd', '')}/{st.get('ShdPnd', '')}" if st else f"{pid} (gone)")
    return out


def survivors(marker: str, *, bound_s: float = 5.0, dying_bound_s: float = 60.0) -> list[int]:
    """The processes with ``marker`` still there after ``bound_s`` seconds, or, while every one
    left is :func:`dying`, after up to ``dying_bound_s``: a process still running normally at
    ``bound_s`` is reported at once (a leak), a slow death on a loaded host is waited for."""
    import time

    start = time.monotonic()
    while True:
        left = pids_with(marker)
        if not left:
            return []
        waited = time.monotonic() - start
        if waited >= dying_bound_s or (waited >= bound_s and not all(dying(p) for p in left)):
            return left
        time.sleep(0.02)
