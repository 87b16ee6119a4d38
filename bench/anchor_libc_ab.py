"""A/B of the anchor linked against glibc or musl, inside ``lowlevel.run`` (root or not).

    python bench/anchor_libc_ab.py [--rounds N] [--per-block N]

Builds ``native/lowlevel_exec.c`` twice into a temporary directory (``cc -static``, glibc;
``musl-gcc -static``), then alternates blocks of ``lowlevel.run(["/usr/bin/true"])`` with each
copied over ``lowlevel/_lowlevel_exec`` (the order flips every round; two warm-up runs after
each swap, since the copy-on-write probe's cache is keyed by the anchor file), and restores the
installed anchor at the end, whatever happens. Per side: the wall p50 and mean of the calls, and
the CPU of the whole sandbox chain per call (``RUSAGE_CHILDREN`` of this process: the anchor is
its child and is reaped here, bwrap, the guard and the program below it). See bench/README.md
"exec_cost.py" for why the libc matters (glibc's start-up ``cpuid``s on a VM).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import lowlevel  # noqa: E402
from lowlevel.sandbox import teardown  # noqa: E402
from lowlevel.sandbox.facts import EXEC_HELPER_PATH  # noqa: E402
from lowlevel.workspace import remove_workspace  # noqa: E402

SOURCE = os.path.join(HERE, "..", "native", "lowlevel_exec.c")


def build(tmp: str) -> dict[str, str]:
    out = {}
    for side, cc in (("glibc", shutil.which("cc") or "cc"), ("musl", shutil.which("musl-gcc"))):
        if cc is None:
            sys.exit("musl-gcc is not installed (apt-get install musl-tools)")
        exe = os.path.join(tmp, side)
        subprocess.run([cc, "-O2", "-std=gnu11", "-static", "-o", exe, SOURCE], check=True)
        out[side] = exe
    return out


def use(path: str) -> None:
    tmp = EXEC_HELPER_PATH + ".ab"
    shutil.copy2(path, tmp)
    os.replace(tmp, EXEC_HELPER_PATH)


def block(n: int) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for _ in range(n):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        r = lowlevel.run(["/usr/bin/true"])
        walls.append(time.perf_counter() - t0)
        teardown.drain()  # the anchor reaped: its CPU (and its children's) counted here
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        remove_workspace(r.workspace)
    return walls, cpus


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--per-block", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="anchor-ab-") as tmp:
        installed = os.path.join(tmp, "installed")
        shutil.copy2(EXEC_HELPER_PATH, installed)
        sides = build(tmp)
        res: dict[str, tuple[list[float], list[float]]] = {side: ([], []) for side in sides}
        try:
            for rnd in range(args.rounds):
                for side in (("glibc", "musl") if rnd % 2 == 0 else ("musl", "glibc")):
                    use(sides[side])
                    block(2)
                    w, c = block(args.per_block)
                    res[side][0].extend(w)
                    res[side][1].extend(c)
        finally:
            use(installed)
    for side, (w, c) in res.items():
        print(f"{side:6s} run p50 {statistics.median(w) * 1e3:7.3f} ms  mean {statistics.mean(w) * 1e3:7.3f} ms  "
              f"sandbox-chain CPU {statistics.mean(c) * 1e3:6.3f} ms/call  n={len(w)}")
    g, m = res["glibc"], res["musl"]
    print(f"p50 musl/glibc {statistics.median(m[0]) / statistics.median(g[0]):.3f}; CPU saved "
          f"{(statistics.mean(g[1]) - statistics.mean(m[1])) * 1e3:.3f} ms/call; load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
