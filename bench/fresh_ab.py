"""In-process A/B of one switch of lowlevel's fresh path (issue 27 item 1), interleaved call by call.

    python bench/fresh_ab.py --switch teardown [--calls 400] [--batches 8] [--batch 200] [--command /usr/bin/true]
                             [--phases]

``--calls`` ``lowlevel.run`` calls per side in blocks of 10, a block with the switch off (A, the
old behaviour) then one with it on (B), the order alternating, so the machine's drift hits both alike; then for
``--batches`` rounds, one batch of ``--batch`` ``arun`` calls at concurrency 8 per side, then at
64. Prints wall p50/p90/p99 per side, the caller's own CPU per call (``os.times()`` of this
process: every thread, children excluded) and the sandbox's is not counted (it is the same
processes on both sides). Switches (``--switch``):

- ``teardown``: :mod:`lowlevel.sandbox.teardown` (the anchor's reaping and the cgroup's removal
  off the result path) off (A) / on (B).
- ``json-later``: bwrap's json-status pipe read while the sandbox runs (A) / once it is gone
  (B, :func:`lowlevel.sandbox.drive.json_deferred`).
- ``both``: the two above together.
- ``empty-commit``: the commit and the change list of an upper with no entry walked as any other (A)
  / skipped after one ``getdents64`` of its root (B, :func:`lowlevel.workspace.overlay.upper_is_empty`).
- ``syscalls``: the run's fds closed one by one and every cgroup figure read to a 0-byte read (A) /
  consecutive fds closed with one ``close_range`` and one-record cgroup files read once (B).
- ``round2``: ``empty-commit`` and ``syscalls`` together.

Root or an unprivileged user with user namespaces, as bench/startup.py.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable

import lowlevel
from lowlevel.host import cgroupfs
from lowlevel.sandbox import aio, drive, launcher, teardown
from lowlevel.workspace import overlay as _overlay
from lowlevel.workspace.overlay import commits as _ov_commits
from lowlevel.workspace.overlay import upper as _ov_upper


def _set_teardown(on: bool) -> None:
    teardown.drain()
    teardown.ENABLED = on


_JSON_DEFERRED = drive.json_deferred


def _set_json_later(on: bool) -> None:
    fn = _JSON_DEFERRED if on else (lambda r: False)
    drive.json_deferred = fn
    aio.json_deferred = fn  # type: ignore[attr-defined]


def _set_both(on: bool) -> None:
    _set_teardown(on)
    _set_json_later(on)


_UPPER_IS_EMPTY = _ov_upper.upper_is_empty


def _set_empty_commit(on: bool) -> None:
    fn = _UPPER_IS_EMPTY if on else (lambda fd: False)
    _ov_upper.upper_is_empty = fn  # read_changes
    _ov_commits.upper_is_empty = fn  # type: ignore[attr-defined]  # commit_upper
    _overlay.upper_is_empty = fn  # lowlevel.sandbox.commit's record decision


_CLOSE_FDS, _CG_READ = launcher.close_fds, cgroupfs.read


def _close_one_by_one(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _read_to_eof(path: str, *, one_record: bool = False) -> str:
    return _CG_READ(path)


def _set_syscalls(on: bool) -> None:
    launcher.close_fds = _CLOSE_FDS if on else _close_one_by_one
    cgroupfs.read = _CG_READ if on else _read_to_eof


def _set_round2(on: bool) -> None:
    _set_empty_commit(on)
    _set_syscalls(on)


SWITCHES: dict[str, Callable[[bool], None]] = {"teardown": _set_teardown, "json-later": _set_json_later,
                                               "both": _set_both, "empty-commit": _set_empty_commit,
                                               "syscalls": _set_syscalls, "round2": _set_round2}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


#: ``--phases``: the caller thread's CPU (``time.thread_time()``) in these Run methods, by side.
PHASES = ("prepare", "_spawn", "result", "close")
PHASE_CPU: dict[tuple[bool, str], float] = {}
_SIDE = [False]


def _wrap_phases() -> None:
    from lowlevel.sandbox.launcher import Run
    for name in PHASES:
        fn = getattr(Run, name)

        def timed(self: Run, *a: object, _fn: Callable[..., object] = fn, _name: str = name, **k: object) -> object:
            c = time.thread_time()
            try:
                return _fn(self, *a, **k)
            finally:
                key = (_SIDE[0], _name)
                PHASE_CPU[key] = PHASE_CPU.get(key, 0.0) + time.thread_time() - c
        setattr(Run, name, timed)


def sync_ab(switch: Callable[[bool], None], calls: int, command: list[str], block: int = 10) -> None:
    """Blocks of ``block`` calls per side, alternating (the deferred teardown of one call then
    overlaps the next call of its side, as it does in use); a side's CPU includes its drain."""
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, float] = {False: 0.0, True: 0.0}
    for i in range(max(1, calls // block)):
        for side in ((False, True) if i % 2 == 0 else (True, False)):
            switch(side)
            _SIDE[0] = side
            c0 = _cpu()
            for _ in range(block):
                t0 = time.perf_counter()
                r = lowlevel.run(command)
                wall[side].append((time.perf_counter() - t0) * 1e3)
                assert r.exit_code == 0, r.stderr
                if r.workspace:
                    os.rmdir(r.workspace)
            teardown.drain()
            cpu[side] += _cpu() - c0
    calls = len(wall[False])
    for side in (False, True):
        w = wall[side]
        print(f"run   {'B (on) ' if side else 'A (off)'} p50 {statistics.median(w):6.2f} p90 {_pct(w, .9):6.2f} "
              f"p99 {_pct(w, .99):6.2f} ms  caller CPU {cpu[side] / calls * 1e3:5.2f} ms/call")
    print(f"run   B/A p50 {statistics.median(wall[True]) / statistics.median(wall[False]):.3f}")
    for name in PHASES:
        if (False, name) in PHASE_CPU:
            a, b = (PHASE_CPU[(side, name)] / calls * 1e3 for side in (False, True))
            print(f"run   {name:<8} caller-thread CPU A {a:6.3f}  B {b:6.3f} ms/call")


async def _batch(n: int, conc: int, command: list[str]) -> None:
    sem = asyncio.Semaphore(conc)

    async def one() -> None:
        async with sem:
            r = await aio.arun(command)
        if r.workspace:
            os.rmdir(r.workspace)

    await asyncio.gather(*(one() for _ in range(n)))


def async_ab(switch: Callable[[bool], None], batches: int, batch: int, conc: int, command: list[str]) -> None:
    rate: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, float] = {False: 0.0, True: 0.0}
    for i in range(batches):
        for side in ((False, True) if i % 2 == 0 else (True, False)):
            switch(side)
            c0, t0 = _cpu(), time.perf_counter()
            asyncio.run(_batch(batch, conc, command))
            teardown.drain()
            dt = time.perf_counter() - t0
            cpu[side] += _cpu() - c0
            rate[side].append(batch / dt)
    for side in (False, True):
        print(f"arun c{conc:<2} {'B (on) ' if side else 'A (off)'} {statistics.median(rate[side]):6.1f} calls/s "
              f"caller CPU {cpu[side] / (batches * batch) * 1e3:5.2f} ms/call")
    print(f"arun c{conc:<2} B/A {statistics.median(rate[True]) / statistics.median(rate[False]):.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--command", default="/usr/bin/true")
    ap.add_argument("--phases", action="store_true", help="also the caller thread CPU in 4 Run phases")
    args = ap.parse_args()
    if args.phases:
        _wrap_phases()
    command = [args.command]
    switch = SWITCHES[args.switch]
    lowlevel.run(command)  # warm-up: probes, the seccomp compile
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    if args.calls:
        sync_ab(switch, args.calls, command)
    for conc in (8, 64):
        if args.batches:
            async_ab(switch, args.batches, args.batch, conc, command)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
