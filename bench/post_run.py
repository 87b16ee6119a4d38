#!/usr/bin/env python3
"""What does ``--record`` cost after the run, when the program makes files that cost it nothing?

Issue 12 item 5: a program that makes N sparse files of S MiB each (``truncate -s``, no blocks
allocated) in milliseconds made the host hash N x S MiB of holes after the run (30-46 s for
200 x 64 MiB), outside ``--timeout``. This runs, interleaved over rounds in one process:

- ``baseline``: ``lowlevel.run`` of that program, no record;
- ``record``: the same with ``record=FILE`` (hashing before and after, writing the record);
- ``record_dense``: the same with one dense file of ``--dense-mib`` MiB instead, to show
  what ordinary hashing costs (bounded by the per-walk budget, 512 MiB / 10 s by default).

and prints per case the median wall time of the whole call and ``record / baseline``.
By default the workspace is bound as it is (``LOWLEVEL_NO_OVERLAY=1``), so what is measured is
the record's own post-run work; ``--overlay`` keeps the copy-on-write workspace, whose commit
then adds its own cost (it copies each file back to the host).
Usage: ``python bench/post_run.py [--files 200] [--mib 64] [--rounds 3] [--overlay] [--json FILE]``.
Never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lowlevel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--dense-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overlay", action="store_true", help="keep the copy-on-write workspace (and its commit)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if not args.overlay:
        os.environ["LOWLEVEL_NO_OVERLAY"] = "1"
    base = tempfile.mkdtemp(prefix="lowlevel-bench-post-run-")
    os.chmod(base, 0o711)
    sparse = ["sh", "-c", f"i=0; while [ $i -lt {args.files} ]; do truncate -s {args.mib}M f$i; i=$((i+1)); done"]
    dense = ["sh", "-c", f"head -c {args.dense_mib << 20} /dev/urandom > dense"]
    cases: dict[str, list[float]] = {"baseline": [], "record": [], "record_dense": []}
    try:
        for rnd in range(args.rounds):
            order = list(cases)
            order = order[rnd % len(order):] + order[:rnd % len(order)]
            for name in order:
                rec = os.path.join(base, f"{name}-{rnd}.json") if name != "baseline" else None
                t0 = time.perf_counter()
                r = lowlevel.run(dense if name == "record_dense" else sparse, record=rec, timeout=300,
                                 workspace_base=os.path.join(base, "ws"))
                cases[name].append(time.perf_counter() - t0)
                if r.exit_code != 0:
                    print(f"{name}: exit {r.exit_code}: {r.stderr[-300:]!r}", file=sys.stderr)
                shutil.rmtree(r.workspace, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in cases.items()}
    out: dict[str, Any] = {"files": args.files, "mib": args.mib, "dense_mib": args.dense_mib, "rounds": args.rounds,
                           "overlay": args.overlay,
                           "median_s": med, "ratio_record_over_baseline": med["record"] / med["baseline"]}
    for k, v in med.items():
        print(f"{k:14s} median {v:8.3f} s")
    print(f"record / baseline: {out['ratio_record_over_baseline']:.2f}x "
          f"({args.files} sparse files of {args.mib} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
