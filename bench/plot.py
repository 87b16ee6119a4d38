#!/usr/bin/env python3
"""Draw a ``bench/startup.py`` JSON: latency distributions and throughput per concurrency.

    python bench/plot.py FILE.json [-o FILE.svg]

Needs matplotlib (``pip install -e '.[bench]'``). One figure, four panels:

1. ``/usr/bin/true``, every sync case at concurrency 1 (``floor``, ``seed_bwrap``,
   ``raw_bwrap``, ``run``, ``session``, ...): the CDF of its latency samples on a log time
   axis, so the floor, the seed recipe, raw bwrap and lowlevel sit side by side;
2. the same for ``/usr/bin/python3 -c pass``;
3. the ``cli`` case (whole processes: ``lowlevel run --rm -- /usr/bin/true``, ``python -c
   pass``, ``python -c 'import lowlevel.cli'``), when the JSON has it;
4. ``calls_per_s`` against concurrency (log-log) for each asyncio case of ``/usr/bin/true``
   (``seed_bwrap``, ``raw_bwrap``, ``arun``, ``session``, ``pool``).

The title carries the host, the commit and the load average of the run. ``-o`` defaults to
FILE with ``.svg`` for ``.json``; the format follows the extension (``.png``, ``.pdf``, ...).
Exits 2 with a message when matplotlib is missing or FILE is not a startup.py JSON (schema 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

#: Cases drawn in the CDF panels, in legend order (others in the JSON are drawn after them).
_ORDER = ("floor", "subprocess", "guard_floor", "seed_bwrap", "raw_bwrap", "run_bare", "run_no_landlock", "run",
          "run_egress", "image", "session", "session_no_landlock", "image_session", "pool")
#: Emphasised: the floor, the seed recipe, raw bwrap and lowlevel.run (and arun, its async form).
_MAIN = {"floor": "black", "seed_bwrap": "tab:green", "raw_bwrap": "tab:blue", "run": "tab:red", "arun": "tab:red"}
#: One colour per other case, the same in every panel.
_OTHER = {"subprocess": "tab:gray", "guard_floor": "tab:olive", "run_bare": "tab:pink", "run_no_landlock": "salmon",
          "run_egress": "tab:brown", "image": "tab:cyan", "session": "tab:purple", "session_no_landlock": "plum",
          "image_session": "teal", "pool": "tab:orange"}


def _color(name: str) -> str | None:
    return _MAIN.get(name) or _OTHER.get(name)
_CLI = (("cli", "lowlevel run --rm -- /usr/bin/true", "tab:red"),
        ("cli_import", "python -c 'import lowlevel.cli'", "tab:orange"),
        ("python_startup", "python -c pass", "black"))


def _log_time_axis(ax: Any) -> None:
    """Log x axis labelled in plain milliseconds (1, 2, 5, 10, ...), minor ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _cdf(ax: Any, samples: list[float], label: str, color: str | None, bold: bool) -> None:
    xs = sorted(samples)
    n = len(xs)
    ys = [(i + 1) / n for i in range(n)]
    ax.step(xs, ys, where="post", label=label, color=color, linewidth=2.0 if bold else 1.0,
            alpha=1.0 if bold else 0.75)


def _latency_panel(ax: Any, results: list[dict[str, Any]], command: str) -> None:
    rows = [r for r in results if r["command"] == command and r["driver"] == "sync" and r["concurrency"] == 1
            and not r["skipped"] and r.get("samples_ms")]
    rank = {n: i for i, n in enumerate(_ORDER)}
    rows.sort(key=lambda r: rank.get(r["name"], len(rank)))
    for r in rows:
        _cdf(ax, r["samples_ms"], f"{r['name']} (p50 {r['p50_ms']:.2f})", _color(r["name"]), r["name"] in _MAIN)
    _log_time_axis(ax)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("latency per call, ms (log)")
    ax.set_ylabel("fraction of calls")
    ax.set_title(f"{command}: sync, concurrency 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def _cli_panel(ax: Any, cli: dict[str, Any] | None) -> None:
    if not cli:
        ax.text(0.5, 0.5, "no cli case in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    for key, label, color in _CLI:
        samples = cli.get(f"{key}_samples_ms")
        if samples:
            _cdf(ax, samples, f"{label} (p50 {cli[f'{key}_p50_ms']:.1f})", color, key == "cli")
    _log_time_axis(ax)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("whole process, ms (log)")
    ax.set_ylabel("fraction of calls")
    ratio = cli.get("cli_vs_python_startup")
    ax.set_title(f"CLI: cli_vs_python_startup {ratio}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def _throughput_panel(ax: Any, results: list[dict[str, Any]], command: str) -> None:
    series: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        if r["command"] == command and r["driver"] == "asyncio" and not r["skipped"] and r.get("calls_per_s"):
            series.setdefault(r["name"], []).append((r["concurrency"], r["calls_per_s"]))
    for name, pts in sorted(series.items(), key=lambda kv: _ORDER.index(kv[0]) if kv[0] in _ORDER else 99):
        pts.sort()
        ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=name, color=_color(name),
                linewidth=2.0 if name in _MAIN else 1.0)
    ax.set_xscale("log", base=2)
    conc = sorted({c for pts in series.values() for c, _ in pts})
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("concurrent callers (asyncio)")
    ax.set_ylabel("calls/s (log)")
    ax.set_title(f"{command}: throughput per concurrency")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot(doc: dict[str, Any], out: str) -> None:
    """Write the figure of startup.py JSON ``doc`` to ``out`` (format from its extension)."""
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text: a smaller SVG, searchable labels
    import matplotlib.pyplot as plt

    results = doc["results"]
    commands = list(dict.fromkeys(r["command"] for r in results))
    fig, axes = plt.subplots(2, 2, figsize=(15, 11))
    first = commands[0] if commands else "/usr/bin/true"
    _latency_panel(axes[0][0], results, first)
    if len(commands) > 1:
        _latency_panel(axes[0][1], results, commands[1])
    else:
        axes[0][1].set_axis_off()
    _cli_panel(axes[1][0], doc.get("cli"))
    _throughput_panel(axes[1][1], results, first)
    h = doc.get("host", {})
    load = h.get("loadavg_before")
    fig.suptitle(f"bench/startup.py: kernel {h.get('kernel')}, bwrap {h.get('bwrap')}, {h.get('cpus')} CPUs, "
                 f"cgroup {h.get('cgroup')}, root={h.get('caller_is_root')}, commit {h.get('commit')}, "
                 f"{h.get('date')}" + (f", load average before {load[0]}" if load else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("json", metavar="FILE.json", help="a bench/startup.py --json output")
    ap.add_argument("-o", "--output", metavar="FILE.svg", help="figure to write (default: FILE with .svg)")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench/plot.py needs matplotlib: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    try:
        with open(args.json) as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        print(f"cannot read {args.json}: {err}", file=sys.stderr)
        return 2
    if not isinstance(doc, dict) or doc.get("schema") != 1 or not isinstance(doc.get("results"), list):
        print(f"{args.json} is not a bench/startup.py JSON (schema 1)", file=sys.stderr)
        return 2
    out = args.output or (os.path.splitext(args.json)[0] + ".svg")
    plot(doc, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
