"""A/B of the ``lowlevel`` command between two checkouts, with one venv: each side's code comes
first on ``PYTHONPATH`` (the venv's editable finder comes after it), the console script is run
by the path you give (relative to ``--cwd``, as the README runs it), rounds interleaved, the
order reversed every other round, a private ``LOWLEVEL_CACHE_DIR`` per side after warm-up runs.
Prints the wall and CPU (``wait4`` rusage of the process and its children) medians, and the
same for ``python -c pass`` (the ratio's denominator).

    python bench/cli_checkout_ab.py --a /path/to/old --b /path/to/new --rounds 30

A checkout needs the native helpers (``lowlevel/_lowlevel_*``, ``lowlevel/host/_native*.so``):
copy them from a built tree. Used for bench/README.md "Issue 27", "The CLI, round 3".
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _one(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(argv, env=env, check=True, cwd=cwd, stdout=subprocess.DEVNULL)
    wall = (time.perf_counter() - t) * 1000
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="checkout A (its directory goes first on PYTHONPATH)")
    p.add_argument("--b", required=True, help="checkout B")
    p.add_argument("--script", default=".venv/bin/lowlevel", help="the console script, as typed (default %(default)s)")
    p.add_argument("--cwd", default=os.getcwd(), help="where it is run from (default: here)")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # .pyc written, as users have
    caches = tempfile.mkdtemp(prefix="cli-ab-")
    sides = {"A": args.a, "B": args.b, "python -c pass": None}
    wall: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}

    def run(key: str) -> tuple[float, float]:
        repo = sides[key]
        if repo is None:
            return _one([sys.executable, "-c", "pass"], base, args.cwd)
        cache = os.path.join(caches, key)
        os.makedirs(cache, 0o700, exist_ok=True)
        env = dict(base, PYTHONPATH=repo, LOWLEVEL_CACHE_DIR=cache)
        return _one([args.script, "run", "--rm", "--", "/usr/bin/true"], env, args.cwd)

    for key in sides:
        for _ in range(3):
            run(key)
    for i in range(args.rounds):
        for key in (list(sides) if i % 2 else list(sides)[::-1]):
            w, c = run(key)
            wall[key].append(w)
            cpu[key].append(c)
    py = statistics.median(cpu["python -c pass"])
    for key in sides:
        w, c = statistics.median(wall[key]), statistics.median(cpu[key])
        print(f"{key:15s} wall p50 {w:7.1f} ms  cpu p50 {c:7.1f} ms  cpu / python {c / py:.2f}")


if __name__ == "__main__":
    main()
