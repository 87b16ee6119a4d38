"""Workspace cost: does a call cost what it changed, or what the repository holds?

    python bench/workspace.py [--quick] [--json FILE] [--rounds N] [--per-round K]

Cases, each ``lowlevel.run(["/usr/bin/true"], workspace=W)`` (commit on, the default):

- ``ws0``, ``ws10k``, ``ws100k``: W holds 0, 10,000 or 100,000 files (1,000 directories of
  10 or 100 small files), measured in rounds that interleave the three (so drift hits each
  alike), as the caller's identity;
- the same as an unprivileged user (as root the script re-runs itself with ``runuser -u
  lowlevel-test``, the account the test suite creates; skipped when it does not exist);
- ``session_diff_100k``: ``Session.diff()`` after a command changed 100 files of the
  100,000-file tree: the change report alone (``Result.changes`` of a run is the same
  function on its upper layer), reported as ``ratios.changes_100_of_100k_ms_*``;
- ``session_reset_100k``: ``Session.reset()`` after that.

JSON: ``{"schema": 1, "results": [{name, identity, n, p50_ms, p90_ms, samples_ms}],
"ratios": {"ws100k_vs_empty_root", "ws100k_vs_empty_user", ...}, "host": {...}}``.
Targets (issue 11): ws100k_vs_empty <= 1.2 for both identities; a change report of 100 changed
files in a 100,000-file tree <= 5 ms; Session.reset() <= 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import lowlevel  # noqa: E402
from lowlevel import Session# noqa: E402

TEST_USER = "lowlevel-test"


def make_tree(root: Path, files: int) -> None:
    """``files`` small files in directories of at most 100."""
    per_dir = 100 if files >= 10_000 else max(1, files)
    for i in range(files):
        d = root / f"d{i // per_dir:04d}"
        if i % per_dir == 0:
            d.mkdir()
        (d / f"f{i % per_dir:03d}.txt").write_bytes(b"x" * 64)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def summary(name: str, identity: str, samples_s: list[float]) -> dict[str, object]:
    ms = [x * 1000 for x in samples_s]
    return {"name": name, "identity": identity, "n": len(ms), "p50_ms": round(statistics.median(ms), 3),
            "p90_ms": round(pct(ms, 0.9), 3), "samples_ms": [round(x, 3) for x in ms]}


def measure(identity: str, rounds: int, per_round: int, sizes: dict[str, int]) -> list[dict[str, object]]:
    base = Path(tempfile.mkdtemp(prefix="lowlevel-bench-ws-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        trees = {}
        for name, n in sizes.items():
            t = base / name
            t.mkdir()
            make_tree(t, n)
            trees[name] = t
        samples: dict[str, list[float]] = {name: [] for name in sizes}
        for t in trees.values():
            lowlevel.run(["/usr/bin/true"], workspace=t)  # warm: probes, seccomp, page cache
        for _ in range(rounds):
            for name, t in trees.items():
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    r = lowlevel.run(["/usr/bin/true"], workspace=t)
                    samples[name].append(time.perf_counter() - t0)
                    assert r.exit_code == 0, r.stderr
        out = [summary(name, identity, samples[name]) for name in sizes]
        big = trees[max(sizes, key=lambda k: sizes[k])]
        # The change report of a run that modified 100 files of the big tree.
        script = "for d in d00[0-9][0-9]; do echo y >> $d/f000.txt; done"
        resets: list[float] = []
        diffs: list[float] = []
        with Session(workspace=big, commit=False) as s:
            for _ in range(max(3, rounds)):
                s.run(["sh", "-c", script])
                t0 = time.perf_counter()
                d = s.diff()
                diffs.append(time.perf_counter() - t0)
                assert len(d.modified) >= 100, len(d.modified)
                t0 = time.perf_counter()
                s.reset()
                resets.append(time.perf_counter() - t0)
        r = lowlevel.run(["sh", "-c", script], workspace=big, commit=False)
        assert len(r.changes.modified) >= 100
        # Session.diff() is Run.read_changes() on the live upper layer: the change report alone.
        out += [summary("session_diff_100k", identity, diffs), summary("session_reset_100k", identity, resets)]
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--per-round", type=int)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 10)
    per_round = args.per_round or (3 if args.quick else 10)
    sizes = {"ws0": 0, "ws10k": 10_000, "ws100k": 100_000}
    identity = "root" if os.geteuid() == 0 else "user"
    results = measure(identity, rounds, per_round, sizes)
    if args.worker:
        json.dump(results, sys.stdout)
        return 0
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(TEST_USER)
        except KeyError:
            print(f"(no {TEST_USER} account: unprivileged cases skipped; the test suite creates it)",
                  file=sys.stderr)
        else:
            runuser = shutil.which("runuser") or "/usr/sbin/runuser"
            proc = subprocess.run([runuser, "-u", TEST_USER, "--", sys.executable, str(Path(__file__).resolve()),
                                   "--worker", "--rounds", str(rounds), "--per-round", str(per_round)],
                                  capture_output=True, text=True, cwd="/")
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            results += json.loads(proc.stdout)
    p50 = {(r["name"], r["identity"]): float(r["p50_ms"]) for r in results}  # type: ignore[arg-type]
    ratios: dict[str, float | None] = {}
    for who in ("root", "user"):
        if ("ws0", who) in p50:
            ratios[f"ws10k_vs_empty_{who}"] = round(p50[("ws10k", who)] / p50[("ws0", who)], 3)
            ratios[f"ws100k_vs_empty_{who}"] = round(p50[("ws100k", who)] / p50[("ws0", who)], 3)
            ratios[f"session_reset_100k_ms_{who}"] = p50[("session_reset_100k", who)]
            ratios[f"changes_100_of_100k_ms_{who}"] = p50[("session_diff_100k", who)]
    print(f"{'case':22} {'identity':8} {'n':>4} {'p50 ms':>9} {'p90 ms':>9}")
    for r in results:
        print(f"{r['name']:22} {r['identity']:8} {r['n']:>4} {r['p50_ms']:>9} {r['p90_ms']:>9}")
    print("ratios:")
    for k, v in ratios.items():
        print(f"  {k:34} {v}")
    if args.json:
        doc = {"schema": 1, "results": results, "ratios": ratios,
               "host": {"kernel": platform.release(), "lowlevel": lowlevel.__version__,
                        "date": time.strftime("%Y-%m-%d")}}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
