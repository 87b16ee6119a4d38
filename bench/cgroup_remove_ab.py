"""In-process A/B of ``RunCgroup.remove``'s second rmdir pass (issue 27, the fresh path round 2).

    python bench/cgroup_remove_ab.py [--calls 800]

Before this script's commit, ``remove()`` rmdir'ed every directory of a finished run once and,
all gone, went through them again (each rmdir then ENOENT: a path walk of ~9 components of
cgroupfs per hierarchy). A (old): ``remove()`` plus that second pass, done here by hand; B
(new): ``remove()`` alone. Alternating call by call, on never-entered cgroups
(``RunCgroup.create(Limits())``); prints the CPU (``time.thread_time()``) per removal. Root, or
a user with a writable cgroup.
"""
from __future__ import annotations

import argparse
import os
import time

from lowlevel import Limits
from lowlevel.host.cgroups import RunCgroup


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--calls", type=int, default=800)
    args = ap.parse_args()
    cpu = {False: 0.0, True: 0.0}
    count = {False: 0, True: 0}
    for i in range(args.calls):
        new = i % 2 == 0
        cg = RunCgroup.create(Limits())
        if cg is None:
            raise SystemExit("no writable cgroup on this host")
        paths = [node.path for node in cg.nodes]
        c = time.thread_time()
        cg.remove()
        if not new:
            for path in paths:
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    pass
        cpu[new] += time.thread_time() - c
        count[new] += 1
    for side in (False, True):
        print(f"{'B (new)' if side else 'A (old)'} {cpu[side] / count[side] * 1e3:.3f} ms CPU per remove")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
