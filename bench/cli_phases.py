"""Where a ``lowlevel run --rm -- /usr/bin/true`` process spends its CPU, phase by phase.

Usage::

    python bench/cli_phases.py [--n 16] [--python OTHER/.venv/bin/python ...] [--json FILE]

Each sample is a fresh interpreter that runs the CLI's steps one after the other and reads
``time.process_time()`` between them: the interpreter's own start-up (``site`` and the editable
install's finder included), ``import lowlevel.cli``, building and parsing ``run``'s options,
importing ``run``'s machinery (:mod:`lowlevel.cli.run_cmd`: everything the run, its failure and
cleanup paths need), the command in this process, and the CPU of its children (anchor, bwrap,
the program: ``RUSAGE_CHILDREN``). CPU, not wall time: on a shared 2-vCPU host it is the figure
load distorts least. Several ``--python`` interpreters (other checkouts' venvs) are run
interleaved, sample by sample, for an A/B. Each gets its own cache directory (``LOWLEVEL_CACHE_DIR``
under a temporary directory, warmed by 2 runs first), so that the host-facts and dataclass caches
of other checkouts on the same host (root shares ``/run/lowlevel/cache``) cannot evict its entries.
Prints the median of each phase (ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PHASES = ("startup", "import_cli", "parser", "import_run", "run_in_caller", "children")

#: The sample: one line of six CPU figures (ms).
CHILD = """
import time, resource
c0 = time.process_time()
import lowlevel.cli
c1 = time.process_time()
from lowlevel.cli.parser import build_parser
a = build_parser("run").parse_args(["run", "--rm", "--", "/usr/bin/true"])
c2 = time.process_time()
from lowlevel.cli.run_cmd import cmd_run
c3 = time.process_time()
code = cmd_run(a)
c4 = time.process_time()
ch = resource.getrusage(resource.RUSAGE_CHILDREN)
assert code == 0, code
print(*(round(1000 * x, 3) for x in (c0, c1 - c0, c2 - c1, c3 - c2, c4 - c3, ch.ru_utime + ch.ru_stime)))
"""


def sample(python: str, cache: str) -> list[float]:
    out = subprocess.run([python, "-c", CHILD], capture_output=True, text=True, cwd="/", timeout=120,
                         env={**os.environ, "LOWLEVEL_CACHE_DIR": cache}, check=True).stdout
    return [float(x) for x in out.split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16, help="samples per interpreter (default 16)")
    ap.add_argument("--python", action="append", help="interpreter(s) to compare (default: this one)")
    ap.add_argument("--json", metavar="FILE", help="write the medians and samples as JSON")
    args = ap.parse_args()
    pythons = args.python or [sys.executable]
    with tempfile.TemporaryDirectory(prefix="cli-phases-") as tmp:
        caches = {py: os.path.join(tmp, f"cache{i}") for i, py in enumerate(pythons)}
        for py in pythons:
            for _ in range(2):
                sample(py, caches[py])
        rows: dict[str, list[list[float]]] = {py: [] for py in pythons}
        for i in range(args.n):
            for py in pythons[i % len(pythons):] + pythons[:i % len(pythons)]:
                rows[py].append(sample(py, caches[py]))
    doc = {}
    print("CPU ms, median of", args.n, ":", " | ".join(PHASES), "| total")
    for py, got in rows.items():
        med = {p: round(statistics.median(col), 2) for p, col in zip(PHASES, zip(*got, strict=True), strict=True)}
        doc[py] = {"median_ms": med, "total_ms": round(sum(med.values()), 2), "samples": got}
        print(py, " | ".join(f"{med[p]:6.2f}" for p in PHASES), f"| {doc[py]['total_ms']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
