"""A/B of two commits of lowlevel: bench/startup.py's cases run alternately, same machine, same minute.

    python bench/ab.py --before REV --after REV [--pairs 8] [--per-round 30] [--json FILE]

Each commit gets a clean checkout and a venv of its own under a temporary directory (``git
worktree add --detach``, ``pip install -e .``: the natives are built per checkout). Then, for
``--pairs`` pairs, ``bench/startup.py`` runs once in each checkout with ``--only`` the compared
cases and one round (the order within a pair alternates: before-after, after-before, ...), so
drift of the machine hits both sides alike. Each side's figure for a case is the median over the
pairs of that run's p50; the ratio printed is after / before (below 1.0: faster after). The cases
(issue 26's "speed no worse" check): ``run`` (sync, concurrency 1), ``arun`` at concurrency 8,
``session`` (sync) and ``pool`` (sync), on ``/usr/bin/true``.

Needs what bench/startup.py needs (bwrap, root or an unprivileged user with user namespaces) and
network access to the package index for the two venvs (a warm pip cache makes it ~1 min each).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

#: (case name, concurrency, driver) compared, as bench/startup.py's JSON ``results`` rows name them.
CASES = (("run", 1, "sync"), ("arun", 8, "asyncio"), ("session", 1, "sync"), ("pool", 1, "sync"))
COMMAND = "/usr/bin/true"


def checkout(repo: str, rev: str, where: str) -> str:
    """A detached worktree of ``rev`` at ``where`` with its own venv; returns its python."""
    subprocess.run(["git", "-C", repo, "worktree", "add", "-q", "--detach", where, rev], check=True)
    subprocess.run([sys.executable, "-m", "venv", os.path.join(where, ".venv")], check=True)
    py = os.path.join(where, ".venv", "bin", "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "-e", where], check=True, cwd=where)
    return py


def one(py: str, where: str, per_round: int) -> dict[tuple[str, int, str], float]:
    """One bench/startup.py run in checkout ``where``: {case: p50 ms}."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        only = ",".join(sorted({c[0] for c in CASES}))
        subprocess.run([py, os.path.join(where, "bench", "startup.py"), "--quick", "--only", only, "--rounds", "1",
                        "--per-round", str(per_round), "--concurrency", "1,8", "--command", COMMAND,
                        "--cli", "0", "--download-rounds", "0", "--soak", "0", "--json", out.name],
                       check=True, cwd=where, stdout=subprocess.DEVNULL)
        rows = json.load(open(out.name))["results"]
    got = {}
    for r in rows:
        key = (r["name"], r["concurrency"], r["driver"])
        if key in CASES and not r["skipped"]:
            got[key] = r["p50_ms"]
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--before", required=True, help="git revision A")
    ap.add_argument("--after", default="HEAD", help="git revision B (default HEAD)")
    ap.add_argument("--pairs", type=int, default=8, help="alternating pairs of runs (default 8)")
    ap.add_argument("--per-round", type=int, default=30, help="calls per case per run (default 30)")
    ap.add_argument("--json", metavar="FILE", help="write the per-pair figures and the summary as JSON")
    args = ap.parse_args(argv)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="lowlevel-ab.") as tmp:
        sides = {}
        try:
            for label, rev in (("before", args.before), ("after", args.after)):
                where = os.path.join(tmp, label)
                sides[label] = (checkout(repo, rev, where), where)
            samples: dict[str, list[dict[tuple[str, int, str], float]]] = {"before": [], "after": []}
            for i in range(args.pairs):
                order = ("before", "after") if i % 2 == 0 else ("after", "before")
                for label in order:
                    samples[label].append(one(*sides[label], args.per_round))
                print(f"pair {i + 1}/{args.pairs} done", file=sys.stderr)
        finally:
            for _py, where in sides.values():
                subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", where], check=False)
    summary: list[dict[str, Any]] = []
    print(f"{'case':<18} {'before p50 ms':>14} {'after p50 ms':>13} {'after/before':>13}")
    for case in CASES:
        a = [s[case] for s in samples["before"] if case in s]
        b = [s[case] for s in samples["after"] if case in s]
        if not a or not b:
            print(f"{case[0]} c{case[1]}: no samples")
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        name = f"{case[0]} c{case[1]} {case[2]}"
        print(f"{name:<18} {ma:>14.3f} {mb:>13.3f} {mb / ma:>13.3f}")
        summary.append({"case": name, "before_p50_ms": ma, "after_p50_ms": mb, "ratio": round(mb / ma, 4),
                        "before_samples": a, "after_samples": b})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": args.before, "after": args.after, "pairs": args.pairs,
                       "per_round": args.per_round, "cases": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
