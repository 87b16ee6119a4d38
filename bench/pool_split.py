"""Where a Pool.run's time goes: per-method p50 of one sync Pool's calls, spaced (the pool full).

    python bench/pool_split.py [--calls 200] [--settle S]

Wraps Pool.run, Pool._take, the argument checks (``_validate.run_args``), Session.run/_submit/
_wait/_final_commit and Core.submit/on_readable with ``perf_counter_ns`` (the calls of the
pool's background starter, its warm-up commands, are listed apart as ``(bg)``); N calls of
``/usr/bin/true`` after 20 unmeasured, each once the pool is full again, each next to a host
floor (``os.posix_spawn`` + ``waitpid``).
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import threading
import time
from typing import Any

from lowlevel.session import Pool
from lowlevel.session import core as _core
from lowlevel.session import pool as _pool
from lowlevel.session import sync as _sync
from lowlevel.spec import validate as _validate

TIMES: dict[str, list[int]] = collections.defaultdict(list)


def wrap(owner: Any, name: str) -> None:
    """Replace ``owner.name`` by a wrapper that records its wall time under its qualname."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return f(*args, **kwargs)
        finally:
            bg = "" if threading.current_thread() is threading.main_thread() else " (bg)"
            TIMES[f.__qualname__ + bg].append(time.perf_counter_ns() - t)

    setattr(owner, name, timed)


def wait_full(p: Pool) -> None:
    for _ in range(300):
        with p._cond:
            if len(p._ready) >= p.size and not p._starting and not p._retired:
                return
        time.sleep(0.01)


def p50(xs: list[int]) -> float:
    return sorted(xs)[len(xs) // 2] / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--settle", type=float, default=0.0,
                    help="every other call sleeps this long after the pool is full (the teardown's tail): "
                         "Pool.run p50 of both halves is printed apart")
    args = ap.parse_args()
    for owner, names in ((_pool.Pool, ["run", "_take"]), (_validate, ["run_args"]),
                         (_sync.Session, ["run", "_submit", "_wait", "_final_commit"]),
                         (_core.Core, ["submit", "on_readable"])):
        for name in names:
            wrap(owner, name)
    cmd = ["/usr/bin/true"]
    p = Pool(size=2)
    for _ in range(20):
        wait_full(p)
        p.run(cmd)
    TIMES.clear()
    floor = []
    halves: tuple[list[int], list[int]] = ([], [])
    for i in range(args.calls):
        wait_full(p)
        if i % 2:
            time.sleep(args.settle)
        t = time.perf_counter_ns()
        os.waitpid(os.posix_spawn(cmd[0], cmd, {}), 0)
        floor.append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        p.run(cmd)
        halves[i % 2].append(time.perf_counter_ns() - t)
    print(f"load {os.getloadavg()[0]:.1f}, floor p50 {p50(floor):.0f} us")
    if args.settle:
        print(f"Pool.run p50: at once {p50(halves[0]):.0f} us, after {args.settle} s more {p50(halves[1]):.0f} us")
    for k, v in TIMES.items():
        print(f"{k:28s} n={len(v):4d} p50 {p50(v):8.0f} us")
    p.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
