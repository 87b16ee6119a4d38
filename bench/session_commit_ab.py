"""Interleaved A/B of Session.commit()/reset() between two built checkouts of lowlevel.

    python bench/session_commit_ab.py [--pairs 6] [--cycles 100] [--files 20000] BEFORE_DIR AFTER_DIR

Each side is a checkout whose natives are built (``pip install -e .`` or ``python setup.py
build_ext --inplace``); a child process imports lowlevel from it (``PYTHONPATH``) and measures,
in one Session: the first ``reset()`` after ``find /workspace`` walked ``--files`` files of the
workspace (the first overlay's cached entries are what that reset drops), then ``--cycles``
rounds of a 4 KiB write + ``commit()``, then as many of a 4 KiB write + ``reset()``. The sides
run in turn, the order flipping every pair, so machine drift hits both alike. Prints, per side,
the median over the pairs of each child's p50 (ms) and the after/before ratio. Wall time on a
shared VM: read only the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, shutil, statistics, sys, tempfile, time
from lowlevel.session import Session
files, cycles = int(sys.argv[1]), int(sys.argv[2])
ws = tempfile.mkdtemp(prefix="ab-commit-", dir="/tmp")
os.chmod(ws, 0o755)
for i in range(files // 100):
    d = os.path.join(ws, f"d{i}")
    os.mkdir(d)
    for j in range(100):
        open(os.path.join(d, f"f{j}"), "w").close()
out = {}
try:
    with Session(workspace=ws) as s:
        s.run(["sh", "-c", "find /workspace > /dev/null; echo x > /workspace/w"])
        t = time.perf_counter()
        s.reset()
        out["first_reset_after_walk"] = (time.perf_counter() - t) * 1e3
        for what in ("commit", "reset"):
            times = []
            for i in range(cycles):
                s.run(["sh", "-c", f"head -c 4096 /dev/zero > /workspace/{what}{i % 4}"])
                t = time.perf_counter()
                getattr(s, what)()
                times.append((time.perf_counter() - t) * 1e3)
            out[what] = statistics.median(times)
finally:
    shutil.rmtree(ws, ignore_errors=True)
print(json.dumps(out))
"""


def one(checkout: str, files: int, cycles: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": checkout}
    done = subprocess.run([sys.executable, "-c", CHILD, str(files), str(cycles)], env=env, cwd="/",
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--files", type=int, default=20000)
    args = ap.parse_args(argv)
    got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for pair in range(args.pairs):
        order = ("before", "after") if pair % 2 == 0 else ("after", "before")
        for side in order:
            got[side].append(one(getattr(args, side), args.files, args.cycles))
    keys = sorted(got["before"][0])
    for key in keys:
        b = statistics.median(r[key] for r in got["before"])
        a = statistics.median(r[key] for r in got["after"])
        print(f"{key:24s} before {b:7.2f} ms  after {a:7.2f} ms  after/before {a / b:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
