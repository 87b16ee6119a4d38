#!/usr/bin/env python3
"""What does the change report of a copy-on-write run cost, and does it grow with the tree?

Builds a lower tree of ``--files`` files (100 directories), mounts overlayfs over it in a
private mount namespace (root: ``unshare --mount``, trusted.overlay.* xattrs; otherwise
``unshare --user --map-root-user --mount`` with ``userxattr``), appends to ``--changed`` files
spread over the tree through the merged dir, unmounts, then measures, interleaved (each
round runs every case once, in a rotated order):

- ``read_changes``: :func:`lowlevel.workspace.overlay.read_changes` on that upper (the target: p50
  <= 5 ms for 100 changed files in a 100,000-file tree);
- ``read_changes_empty``: the same on an empty upper (the floor: opening the two roots);
- ``snapshot``: :func:`lowlevel.workspace.snapshot` of the lower tree, one walk of what the
  hand-over model walks twice per run to report changes (the baseline);
- ``commit``: :func:`lowlevel.workspace.overlay.commit` of the changed files (each round re-applies
  the same upper with a fresh ``since_ns``: 100 files replaced, dry pass included).

Usage: ``python bench/overlay_changes.py [--quick] [--files N] [--changed N] [--rounds N]
[--json FILE]``. Never asserts. JSON: ``{"schema": 1, "params": {...}, "results": [{"name",
"n", "p50_ms", "p90_ms", "mean_ms", "samples_ms"}], "ratios": {"read_changes_vs_snapshot",
"read_changes_vs_empty", "read_changes_100k_target_ms": 5.0}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lowlevel.workspace import overlay

from lowlevel import workspace# noqa: E402

SCHEMA = 1
ROOT = os.geteuid() == 0
PREFIX = "trusted.overlay." if ROOT else "user.overlay."
OPTIONS = ("redirect_dir=off,metacopy=off,index=off" if ROOT else
           "userxattr,redirect_dir=nofollow,metacopy=off,index=off")


def _inner(base: str, options: str, changed: str) -> int:
    """In the new mount namespace: mount, append to the listed files, exit (unmounts)."""
    merged = os.path.join(base, "merged")
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"{options},lowerdir={base}/lower,upperdir={base}/upper,workdir={base}/work", merged], check=True)
    for rel in changed.split(","):
        with open(os.path.join(merged, rel), "a") as f:
            f.write("changed\n")
    return 0


def _build(base: str, files: int, changed: int) -> None:
    for d in ("lower", "upper", "work", "merged", "empty"):
        os.mkdir(os.path.join(base, d))
    per_dir = max(1, files // 100)
    made = 0
    for i in range(100):
        d = os.path.join(base, "lower", f"d{i:03}")
        os.mkdir(d)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        for j in range(per_dir if i < 99 else files - made):
            os.close(os.open(f"f{j:05}.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        made += per_dir
        os.close(fd)
    step = max(1, 100 // max(1, changed))
    targets = [f"d{(k * step) % 100:03}/f{k // 100:05}.txt" for k in range(changed)]
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    ns = [unshare, "--mount", "--propagation", "private"] if ROOT else [unshare, "--user", "--map-root-user", "--mount"]
    subprocess.run([*ns, sys.executable, os.path.abspath(__file__), "--inner", base, OPTIONS,
                    ",".join(targets)], check=True)


def _stats(name: str, samples: list[float]) -> dict[str, object]:
    s = sorted(samples)

    def pct(p: float) -> float:
        k = (len(s) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"name": name, "n": len(s), "p50_ms": round(pct(0.5), 3), "p90_ms": round(pct(0.9), 3),
            "mean_ms": round(statistics.fmean(s), 3), "samples_ms": [round(x, 3) for x in samples]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20,000 files, 5 rounds")
    ap.add_argument("--files", type=int, default=None)
    ap.add_argument("--changed", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--dir", default=None, help="where to build the trees (default: a temp dir in /tmp)")
    ap.add_argument("--inner", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        return _inner(*args.inner)
    files = args.files or (20_000 if args.quick else 100_000)
    rounds = args.rounds or (5 if args.quick else 30)
    base = tempfile.mkdtemp(prefix="bench-overlay-", dir=args.dir)
    try:
        t0 = time.perf_counter()
        _build(base, files, args.changed)
        build_s = time.perf_counter() - t0
        fds = {d: os.open(os.path.join(base, d), os.O_RDONLY | os.O_DIRECTORY) for d in ("lower", "upper", "empty")}
        ch = overlay.read_changes(fds["upper"], fds["lower"], xattr_prefix=PREFIX)
        assert len(ch.modified) == args.changed, ch  # the setup, not the measurement
        cases: dict[str, Callable[[], object]] = {
            "read_changes": lambda: overlay.read_changes(fds["upper"], fds["lower"], xattr_prefix=PREFIX),
            "read_changes_empty": lambda: overlay.read_changes(fds["empty"], fds["lower"], xattr_prefix=PREFIX),
            "snapshot": lambda: workspace.snapshot(os.path.join(base, "lower")),
            "commit": lambda: overlay.commit(fds["upper"], fds["lower"], xattr_prefix=PREFIX,
                                             since_ns=time.time_ns(), new_owner=None),
        }
        samples: dict[str, list[float]] = {k: [] for k in cases}
        names = list(cases)
        for name in names:  # warm-up
            cases[name]()
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t = time.perf_counter_ns()
                cases[name]()
                samples[name].append((time.perf_counter_ns() - t) / 1e6)
        for fd in fds.values():
            os.close(fd)
    finally:
        # remove_workspace, not rmtree: overlayfs leaves work/work mode 000, which an
        # unprivileged owner must chmod before removing
        workspace.remove_workspace(base)
    results = [_stats(k, v) for k, v in samples.items()]
    p50 = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {"read_changes_vs_snapshot": round(p50["read_changes"] / p50["snapshot"], 4),
              "read_changes_vs_empty": round(p50["read_changes"] / p50["read_changes_empty"], 2),
              "read_changes_100k_target_ms": 5.0}
    kind = "root, trusted.overlay." if ROOT else "userxattr"
    print(f"lower: {files} files, {args.changed} changed through a real overlay ({kind}); built in {build_s:.1f} s; "
          f"{rounds} rounds, interleaved; {platform.release()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'case':<20} {'p50 ms':>9} {'p90 ms':>9} {'mean ms':>9}")
    for r in results:
        print(f"{r['name']:<20} {r['p50_ms']:>9} {r['p90_ms']:>9} {r['mean_ms']:>9}")
    print(f"read_changes / snapshot (p50): {ratios['read_changes_vs_snapshot']}; "
          f"read_changes p50 {p50['read_changes']:.3f} ms (target <= 5 ms at 100,000 files)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "params": {"files": files, "changed": args.changed, "rounds": rounds,
                                                    "root": ROOT, "kernel": platform.release()},
                       "results": results, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
