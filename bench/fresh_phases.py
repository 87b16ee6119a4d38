"""Where the caller's CPU of one ``lowlevel.run`` goes, phase by phase, and the anchor spawn's stall.

    python bench/fresh_phases.py [--calls 300] [--command /usr/bin/true]

Wraps the phases of :class:`lowlevel.sandbox.launcher.Run` (and the cgroup's create, stats and
remove) with ``time.thread_time()`` (CPU of the thread that runs them: the caller's, or the
teardown thread's for the deferred removal) and prints CPU per call by phase, largest first,
with the whole caller's CPU (``os.times()``: every thread of this process). Then, around each
``os.posix_spawn`` of the anchor: the call's wall time and, read from ``/proc/PID/schedstat``
right after it returns, how long the vfork child waited on a run queue (what the spawn blocks
on when the CPUs are busy), against a bare ``posix_spawn`` of ``/usr/bin/true`` made right
after each run. Nested phases are included in their parents' figures.
"""
from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import time
from collections.abc import Callable
from typing import Any

import lowlevel
from lowlevel.host import cgroups, run_records
from lowlevel.sandbox import drive
from lowlevel.sandbox.launcher import Run

PHASES = ("prepare", "_resolve_workspace", "_prepare_ids", "_prepare_limits", "_prepare_data_fds", "_build_argv",
          "_lay_out_fds", "_spawn", "result", "finish_cow", "_final_changes", "close")
CPU: dict[str, list[float]] = {}


def _wrap(owner: Any, name: str, key: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*a: Any, **k: Any) -> Any:
        c = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            CPU.setdefault(key, []).append((time.thread_time() - c) * 1e3)

    setattr(owner, name, timed)


def _q(v: list[float]) -> str:
    v = sorted(v)
    return f"p50 {statistics.median(v):6.3f} mean {statistics.mean(v):6.3f} p90 {v[int(.9 * len(v))]:6.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--command", default="/usr/bin/true")
    args = ap.parse_args()
    for name in PHASES:
        _wrap(Run, name, name)
    for name in ("create", "stats", "remove"):
        _wrap(cgroups.RunCgroup, name, f"cgroup.{name}")
    for name in ("_handshake", "_supervise"):
        _wrap(drive, name, name)
    for name in ("write", "remove"):
        _wrap(run_records, name, f"run_record.{name}")
    spawns: list[tuple[float, float]] = []
    real_spawn: Callable[..., int] = os.posix_spawn

    def spawn(*a: Any, **k: Any) -> int:
        t = time.perf_counter()
        pid = real_spawn(*a, **k)
        wall = (time.perf_counter() - t) * 1e3
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                waited = int(f.read().split()[1]) / 1e6
        except (OSError, ValueError, IndexError):
            waited = float("nan")
        spawns.append((wall, waited))
        return pid

    os.posix_spawn = spawn
    sigs = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP) and s < signal.SIGRTMIN)
    lowlevel.run([args.command])  # warm-up
    CPU.clear()
    spawns.clear()
    bare: list[float] = []
    t0 = os.times()
    own = 0.0
    for _ in range(args.calls):
        r = lowlevel.run([args.command])
        if r.workspace:
            os.rmdir(r.workspace)
        c = time.thread_time()
        t = time.perf_counter()
        pid = real_spawn("/usr/bin/true", ["true"], {}, setsigdef=sigs, setsid=True)
        bare.append((time.perf_counter() - t) * 1e3)
        os.waitpid(pid, 0)
        own += time.thread_time() - c
    t1 = os.times()
    n = args.calls
    total = (t1.user - t0.user + t1.system - t0.system - own) / n * 1e3
    print(f"load average {os.getloadavg()[0]:.2f}; caller CPU per call (all threads) {total:.2f} ms")
    for key, v in sorted(CPU.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {key:20s} CPU {sum(v) / n:6.3f} ms/call")
    print(f"posix_spawn of the anchor, wall ms:     {_q([w for w, _ in spawns])}")
    print(f"  its vfork child's run-queue wait, ms: {_q([q for _, q in spawns])}")
    print(f"bare posix_spawn of true after a run:   {_q(bare)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
