"""The CLI's start-up, measured: per-module imports of a real ``lowlevel run``, and an interleaved A/B.

Usage::

    python bench/cli_imports.py profile [--n 9] [--python PY]      # -X importtime, per module
    python bench/cli_imports.py ab --python A/.venv/bin/python --python B/.venv/bin/python [--n 40]

``profile`` runs ``PY -X importtime PY's-lowlevel-script run --rm -- /usr/bin/true`` and
``PY -X importtime -c pass`` ``--n`` times each, alternating, with stderr to a pipe of ours (the
whole process's import lines, the sandbox's own stderr is empty); a run that does not exit 0 is
an error (``python -X importtime -m lowlevel.cli`` used to fail at once with "is a package and
cannot be directly executed", hidden among the import lines: ~89 imports, all of the CLI's
module and none of the run's). Prints every module the run imports beyond ``python -c pass``:
the minimum self time over the runs (us), lowlevel's and the others' sums.

``ab`` alternates, in one loop, ``lowlevel run --rm -- /usr/bin/true`` and ``python -c pass`` of
each interpreter (order rotated per round), ``--n`` rounds after 3 warm-up ones, and prints the
median wall time and CPU (``wait4`` rusage of the child: user + system, its sandbox included)
of each, and the ratio ``cli_vs_python_startup`` (wall, as bench/startup.py's ``cli`` case).

Both give each interpreter its own ``LOWLEVEL_CACHE_DIR`` (a temporary directory, warmed by two
runs first: the host-facts, seccomp and dataclass caches of other checkouts cannot evict its
entries), and first byte-compile the package the interpreter imports (``compileall``): with
``PYTHONDONTWRITEBYTECODE=1`` in the environment (it is in this machine's shells) nothing writes
``__pycache__`` and every process compiles all ~70 modules again, ~150 ms instead of ~40.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RUN = ("run", "--rm", "--", "/usr/bin/true")
_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def _script(python: str) -> str:
    """The ``lowlevel`` console script next to ``python`` (its venv's bin)."""
    return os.path.join(os.path.dirname(python), "lowlevel")


def _prepare(python: str) -> str:
    """Byte-compile the package ``python`` imports; returns its directory."""
    pkg = subprocess.run([python, "-c", "import lowlevel, os; print(os.path.dirname(lowlevel.__file__))"],
                         capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    subprocess.run([python, "-m", "compileall", "-q", pkg], check=True, stdout=subprocess.DEVNULL)
    return pkg


def _importtime(argv: list[str], env: dict[str, str]) -> dict[str, int]:
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd="/")
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.splitlines()[-1:]}")
    return {m.group(4): int(m.group(1)) for m in map(_LINE.match, proc.stderr.splitlines()) if m}


def profile(python: str, n: int) -> None:
    _prepare(python)
    with tempfile.TemporaryDirectory(prefix="cli-imports-") as cache:
        env = {**os.environ, "LOWLEVEL_CACHE_DIR": cache}
        base: dict[str, list[int]] = {}
        full: dict[str, list[int]] = {}
        for _ in range(2):  # warm the private cache (host facts, seccomp filter, dataclass code)
            _importtime([python, _script(python), *RUN], env)
        for _ in range(n):
            for argv, into in (([python, "-X", "importtime", "-c", "pass"], base),
                               ([python, "-X", "importtime", _script(python), *RUN], full)):
                for mod, us in _importtime(argv, env).items():
                    into.setdefault(mod, []).append(us)
    extra = {m: min(v) for m, v in full.items() if m not in base}
    ours = {m: v for m, v in extra.items() if m == "lowlevel" or m.startswith("lowlevel.")}
    print(f"{python}: {len(full)} modules, {len(extra)} beyond `python -c pass`, self time (min of {n}) "
          f"{sum(extra.values()) / 1000:.1f} ms: lowlevel's {len(ours)} {sum(ours.values()) / 1000:.1f} ms, "
          f"others {len(extra) - len(ours)} {(sum(extra.values()) - sum(ours.values())) / 1000:.1f} ms")
    for mod, us in sorted(extra.items(), key=lambda kv: -kv[1]):
        print(f"{us:7d} {mod}")


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd="/")
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)}: exit {proc.returncode}")
    return 1000 * wall, 1000 * (ru.ru_utime + ru.ru_stime)


def ab(pythons: list[str], n: int) -> None:
    caches = [tempfile.mkdtemp(prefix="cli-ab-") for _ in pythons]
    cases = []
    for py, cache in zip(pythons, caches, strict=True):
        _prepare(py)
        env = {**os.environ, "LOWLEVEL_CACHE_DIR": cache}
        cases += [(py, "cli", [_script(py), *RUN], env), (py, "python", [py, "-c", "pass"], env)]
    got: dict[tuple[str, str], list[tuple[float, float]]] = {(c[0], c[1]): [] for c in cases}
    for i in range(n + 3):
        k = i % len(cases)
        for py, name, argv, env in cases[k:] + cases[:k]:
            sample = _timed(argv, env)
            if i >= 3:
                got[(py, name)].append(sample)
    for py in pythons:
        med = {name: tuple(statistics.median(s[j] for s in got[(py, name)]) for j in (0, 1))
               for name in ("cli", "python")}
        print(f"{py}: cli wall {med['cli'][0]:.1f} ms cpu {med['cli'][1]:.1f} ms; python -c pass wall "
              f"{med['python'][0]:.1f} cpu {med['python'][1]:.1f}; cli_vs_python_startup "
              f"{med['cli'][0] / med['python'][0]:.2f} (cpu {med['cli'][1] / med['python'][1]:.2f}); n={n}")
    for cache in caches:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("profile", "ab"))
    ap.add_argument("--python", action="append", help="interpreter(s) (a venv's python with lowlevel installed)")
    ap.add_argument("--n", type=int, help="runs (profile: default 9) or rounds (ab: default 40)")
    args = ap.parse_args()
    pythons = args.python or [sys.executable]
    if args.mode == "profile":
        for py in pythons:
            profile(py, args.n or 9)
    else:
        ab(pythons, args.n or 40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
