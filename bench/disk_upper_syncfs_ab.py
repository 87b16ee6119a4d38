"""What the disk upper's pre-commit syncfs costs (root): interleaved runs with and without it.

``disk_upper.check_writeback`` flushes the upper before the commit so that a writeback lost to a
full host disk is refused instead of committed corrupt (bench/README.md, Issue 27, "Red team").
This measures wall ms per ``lowlevel.run`` (commit on) writing 0 and N MiB, the check switched
in and out within one process, in alternating order. Usage: ``python bench/disk_upper_syncfs_ab.py
[--pairs 6] [--mib 32]``. Prints one line per size with the medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import lowlevel
from lowlevel.workspace import disk_upper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--mib", type=int, default=32)
    args = ap.parse_args()
    top = tempfile.mkdtemp(prefix="lowlevel-syncfs-ab-", dir="/var/tmp")
    ws, up = os.path.join(top, "ws"), os.path.join(top, "up")
    os.mkdir(ws)
    os.mkdir(up)
    os.environ["LOWLEVEL_UPPER_DIR"] = up
    real = disk_upper.check_writeback
    policy = lowlevel.Policy(limits=lowlevel.Limits(upper="disk", workspace_bytes=max(256, 2 * args.mib) << 20,
                                                    memory_bytes=512 << 20))
    try:
        for mib in (0, args.mib):
            cmd = ["sh", "-c", f"head -c {mib}M /dev/zero > out"] if mib else ["true"]
            got: dict[str, list[float]] = {"syncfs": [], "none": []}
            for i in range(args.pairs):
                for mode in ("syncfs", "none") if i % 2 == 0 else ("none", "syncfs"):
                    disk_upper.check_writeback = real if mode == "syncfs" else (lambda fd: None)
                    t = time.perf_counter()
                    lowlevel.run(cmd, workspace=ws, policy=policy)
                    got[mode].append((time.perf_counter() - t) * 1e3)
                    if os.path.exists(os.path.join(ws, "out")):
                        os.unlink(os.path.join(ws, "out"))
            print(f"{mib} MiB written, commit: wall ms p50 " +
                  ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in got.items()))
    finally:
        disk_upper.check_writeback = real
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
