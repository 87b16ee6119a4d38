#!/usr/bin/env python3
"""What does a run's cgroup cost per call, and what could a pool of reused cgroups save?

    python bench/cgroup_cost.py [--rounds N] [--per-round M] [--json FILE]

Interleaved (every round runs every case ``--per-round`` times, the case order rotated):

- ``run``: ``lowlevel.run(["/usr/bin/true"])``, default Policy (its cgroup: a directory in
  each v1 hierarchy it uses, or one v2 directory, limits written, the anchor joining it, the
  figures read, the directories removed);
- ``run_no_cgroup``: the same with ``RunCgroup.create`` returning None (rlimits only): the
  whole per-call cost of the cgroup, creation, limit writes, attach, stats and removal
  together, is ``run`` minus this. A pool of reused cgroups could save at most this;
- ``create_remove``: ``RunCgroup.create(Limits())`` and ``remove()`` of an empty cgroup: the
  part a pool would save (it would pay a check that the cgroup is empty and the counter
  resets instead).

Per case: wall p50 and mean (ms), and the CPU of this process and its reaped children
(``resource.getrusage``, ms per call). Memory cgroups are offlined and freed later by kernel
workers, so that part of ``create_remove`` is not in its CPU figure: compare the wall
figures of ``run`` and ``run_no_cgroup``, measured alike. Root or a delegated cgroup only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lowlevel  # noqa: E402
from lowlevel.host import cgroup_detect as _cgroup_detect  # noqa: E402
from lowlevel.host import cgroups as _cgroups  # noqa: E402

_REAL_CREATE = _cgroups.RunCgroup.create
_SERIAL = iter(range(1, 1 << 62))
_WORKSPACES: list[str] = []


def _no_cgroup(*_args: Any, **_kw: Any) -> None:
    return None


def _run(cgroup: bool) -> Callable[[], None]:
    def call() -> None:
        _cgroups.RunCgroup.create = _REAL_CREATE if cgroup else _no_cgroup  # type: ignore[method-assign]
        try:
            r = lowlevel.run(["/usr/bin/true"])
        finally:
            _cgroups.RunCgroup.create = _REAL_CREATE  # type: ignore[method-assign]
        _WORKSPACES.append(r.workspace)
        if r.exit_code != 0:
            raise RuntimeError(f"run failed: {r}")
    return call


def _sweep() -> None:
    """Remove the runs' workspaces (outside the timed calls)."""
    import shutil
    while _WORKSPACES:
        shutil.rmtree(_WORKSPACES.pop(), ignore_errors=True)


def _create_remove() -> None:
    cg = _REAL_CREATE(lowlevel.Limits(), f"{os.getpid()}-bench-cg-{next(_SERIAL):x}")
    if cg is None:
        raise RuntimeError("no writable cgroup hierarchy")
    cg.remove()


def _cpu_ms() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--json", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if _cgroup_detect.detect_cgroups().usable is False:
        print("no writable cgroup hierarchy here: nothing to measure", file=sys.stderr)
        return 2
    cases: dict[str, Callable[[], None]] = {"run": _run(True), "run_no_cgroup": _run(False),
                                            "create_remove": _create_remove}
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, float] = dict.fromkeys(cases, 0.0)
    for f in cases.values():  # warm-up
        for _ in range(3):
            f()
    _sweep()
    names = list(cases)
    load_before = os.getloadavg()
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            f = cases[name]
            c0 = _cpu_ms()
            for _ in range(args.per_round):
                t = time.perf_counter_ns()
                f()
                wall[name].append((time.perf_counter_ns() - t) / 1e6)
            cpu[name] += _cpu_ms() - c0
            _sweep()
    out: dict[str, Any] = {"rounds": args.rounds, "per_round": args.per_round,
                           "cgroup": _cgroup_detect.detect_cgroups().version,
                           "loadavg_before": [round(x, 2) for x in load_before],
                           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "cases": {}}
    print(f"{'case':<14} {'wall p50':>9} {'mean':>8} {'cpu/call':>9}  (ms)")
    for name in names:
        n = len(wall[name])
        row = {"n": n, "wall_p50_ms": round(statistics.median(wall[name]), 3),
               "wall_mean_ms": round(sum(wall[name]) / n, 3), "cpu_ms_per_call": round(cpu[name] / n, 3)}
        out["cases"][name] = row
        print(f"{name:<14} {row['wall_p50_ms']:9.3f} {row['wall_mean_ms']:8.3f} {row['cpu_ms_per_call']:9.3f}")
    r, nc = out["cases"]["run"], out["cases"]["run_no_cgroup"]
    out["cgroup_share_of_run_p50"] = round((r["wall_p50_ms"] - nc["wall_p50_ms"]) / r["wall_p50_ms"], 3)
    out["create_remove_share_of_run_p50"] = round(out["cases"]["create_remove"]["wall_p50_ms"] / r["wall_p50_ms"], 3)
    print(f"cgroup share of run p50: {out['cgroup_share_of_run_p50']}, create+remove alone: "
          f"{out['create_remove_share_of_run_p50']} (load average {out['loadavg_before']} -> {out['loadavg_after']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
