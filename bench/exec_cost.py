"""What one exec of each of lowlevel's native helpers costs, against a freestanding and a libc baseline.

    python bench/exec_cost.py [--calls N] [--rounds N] [--json FILE]

Each helper is ``posix_spawn``ed with no arguments (it prints its usage line to stderr, sent to
``/dev/null``, and exits) and reaped, ``--calls`` times per round, rounds interleaved; per
executable the medians over the rounds of the wall time per spawn+reap and of the children's
CPU (``getrusage(RUSAGE_CHILDREN)``: user + system, the exec and the process's whole life).
Baselines built here with ``cc``: ``int main(void){return 0;}`` linked static against glibc and
dynamically, and the same as a freestanding static binary (``_start`` calls ``exit_group``; no
libc at all).

Why: every ``lowlevel.run`` execs the anchor (``_lowlevel_exec``, static glibc) on its critical
path (the caller's ``posix_spawn`` blocks until that exec), every sandbox the guard
(``_lowlevel_guard``, freestanding on x86_64/aarch64: native/lowlevel_sys.h), a Session the init
and an egress run the relay (static glibc). What glibc's own start-up costs per exec on this
host is the difference between the static-glibc and the freestanding baselines; on a VM it is
dominated by ``cpuid`` (glibc's ``init_cpu_features`` and cache-size probing: each a VM exit)
and page faults (25 against 5 for the freestanding binary, ``perf stat -e page-faults``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "..", "lowlevel")
HELPERS = ("_lowlevel_exec", "_lowlevel_guard", "_lowlevel_init", "_lowlevel_relay")
EMPTY_C = "int main(void) { return 0; }\n"
FREESTANDING_C = r"""
void _start(void) {
#if defined(__x86_64__)
    __asm__ volatile("mov $231, %eax\n xor %edi, %edi\n syscall");
#elif defined(__aarch64__)
    __asm__ volatile("mov x8, #94\n mov x0, #0\n svc 0");
#endif
    for (;;) {}
}
"""


def build_baselines(tmp: str) -> dict[str, str]:
    """The three baselines, built with ``cc`` in ``tmp``: {label: path} (those that built)."""
    cc = os.environ.get("CC") or shutil.which("cc") or "cc"
    out: dict[str, str] = {}
    for label, source, flags in (("empty, static glibc", EMPTY_C, ["-static"]),
                                 ("empty, dynamic glibc", EMPTY_C, []),
                                 ("empty, freestanding", FREESTANDING_C,
                                  ["-static", "-nostdlib", "-ffreestanding", "-fno-pie", "-no-pie"])):
        src = os.path.join(tmp, f"b{len(out)}.c")
        exe = src[:-2]
        with open(src, "w") as f:
            f.write(source)
        if subprocess.run([cc, "-O2", *flags, "-o", exe, src], capture_output=True).returncode == 0:
            out[label] = exe
    return out


def one_round(path: str, calls: int) -> tuple[float, float]:
    """(wall ms, children's CPU ms) per spawn + reap of ``path``, over ``calls`` spawns."""
    actions = [(os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    for _ in range(calls):
        pid = os.posix_spawn(path, [path], {}, file_actions=actions)
        os.waitpid(pid, 0)
    wall = (time.perf_counter() - t0) / calls * 1e3
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / calls * 1e3
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500, help="spawns per executable and round (default 500)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="exec-cost-") as tmp:
        targets = {name: os.path.realpath(os.path.join(PACKAGE, name)) for name in HELPERS
                   if os.access(os.path.join(PACKAGE, name), os.X_OK)}
        targets.update(build_baselines(tmp))
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in targets}
        for _ in range(args.rounds):
            for label, path in targets.items():
                samples[label].append(one_round(path, args.calls))
        rows = {label: {"wall_ms": round(statistics.median(w for w, _ in s), 4),
                        "cpu_ms": round(statistics.median(c for _, c in s), 4)} for label, s in samples.items()}
    print(f"{'executable':24s} {'wall ms':>9s} {'CPU ms':>9s}   (per spawn + reap, medians of {args.rounds} "
          f"rounds x {args.calls})")
    for label, row in rows.items():
        print(f"{label:24s} {row['wall_ms']:9.3f} {row['cpu_ms']:9.3f}")
    if "empty, static glibc" in rows and "empty, freestanding" in rows:
        glibc = rows["empty, static glibc"]["cpu_ms"] - rows["empty, freestanding"]["cpu_ms"]
        print(f"glibc's static start-up: {glibc:.3f} ms of CPU per exec")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": 1, "calls": args.calls, "rounds": args.rounds, "results": rows,
                       "load_avg": os.getloadavg(), "python": sys.version.split()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
