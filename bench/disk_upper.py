#!/usr/bin/env python3
"""What does a disk upper (``Limits.upper="disk"``) cost per run against the tmpfs upper, and what RAM does it save?

    python bench/disk_upper.py [--rounds N] [--per-round M] [--big-per-round K] [--json FILE]

Interleaved (every round runs every case, the case order rotated), root only:

- ``run_tmpfs`` / ``run_disk``: ``lowlevel.run(["/usr/bin/true"])`` with the default 1 GiB
  bound on a tmpfs upper / on a disk upper (per-run: an O_TMPFILE, a sparse copy of the ext4
  template, LOOP_CONFIGURE, the anchor's ext4 mount, and at the end its unmount and the loop
  device's autoclear);
- ``open_disk_upper``: the caller's part alone (:func:`lowlevel.workspace.disk_upper.open_disk_upper`
  and the close of its fd, which clears the device);
- ``write64_tmpfs`` / ``write64_disk``: a run writing 64 MiB into /workspace (``head -c 64M``),
  discarded (``--big-per-round`` per round).

Then the parts of one disk upper, each timed alone (``--parts N`` times, 1 GiB): the unnamed file
and the template's copy, LOOP_CONFIGURE, the ext4 mount and its unmount (done here in a private
mount namespace the way the anchor does), the last close (the autoclear), and, for comparison,
a mke2fs of the same image (what a per-run mkfs would cost instead of the template's copy).

Per case: wall p50 and mean (ms), and the CPU of this process and its reaped children
(``resource.getrusage``; the loop device's kernel worker and the ext4 writeback are kernel
threads, in no one's rusage: compare the wall figures too). Then, once: a Session of each
kind writes 64 MiB into its workspace and the session cgroup's ``memory.stat`` is read
(``shmem``: tmpfs pages, unreclaimable without swap; ``cache``/``file``: page cache,
reclaimable).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lowlevel  # noqa: E402
from lowlevel.workspace import disk_upper as _disk_upper  # noqa: E402

MiB = 1 << 20
_WORKSPACES: list[str] = []
POLICIES = {u: lowlevel.Policy(limits=lowlevel.Limits(upper=u)) for u in ("tmpfs", "disk")}
WRITE64 = ["sh", "-c", "head -c 64M /dev/zero > /workspace/f"]


def _run(upper: str, command: list[str]) -> Callable[[], None]:
    def call() -> None:
        r = lowlevel.run(command, policy=POLICIES[upper], commit=False)
        _WORKSPACES.append(r.workspace)
        if r.exit_code != 0:
            raise RuntimeError(f"run failed: {r} {r.stderr!r}")
    return call


def _open_close() -> None:
    os.close(_disk_upper.open_disk_upper(1 << 30).fd)


def _sweep() -> None:
    while _WORKSPACES:
        shutil.rmtree(_WORKSPACES.pop(), ignore_errors=True)


def _cpu_ms() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime) * 1e3


def _memory_stat(session: lowlevel.Session) -> dict[str, int]:
    cg = session._core.run.cgroup
    for node in cg.nodes if cg is not None else ():
        try:
            with open(os.path.join(node.path, "memory.stat")) as f:
                return {k: int(v) for k, v in (line.split() for line in f) if k in
                        ("shmem", "cache", "file", "rss", "anon", "total_shmem")}
        except OSError:
            continue
    return {}


def session_memory() -> dict[str, dict[str, int]]:
    """memory.stat of a Session holding a 64 MiB output, per upper (bytes)."""
    out = {}
    for upper in ("tmpfs", "disk"):
        with lowlevel.Session(policy=POLICIES[upper]) as s:
            r = s.run(WRITE64)
            assert r.exit_code == 0, r
            out[upper] = _memory_stat(s)
    return out


def parts(n: int) -> dict[str, float]:
    """p50 (ms) of each step of a 1 GiB disk upper, in a private mount namespace of this thread."""
    import ctypes
    import tempfile
    libc = ctypes.CDLL(None, use_errno=True)
    size = 1 << 30
    directory = _disk_upper.upper_dir()
    template = _disk_upper._template(size, _disk_upper.inodes_for(size), directory, os.stat(directory).st_dev)
    mnt = tempfile.mkdtemp(prefix="lowlevel-bench-upper-")
    steps: dict[str, list[float]] = {k: [] for k in ("file_and_copy", "loop_configure", "mount", "umount",
                                                     "last_close_autoclear", "mke2fs_instead")}
    try:
        if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS (os.unshare: Python 3.12)
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
        if libc.mount(None, b"/", None, 0x4000 | 0x40000, None) != 0:  # MS_REC | MS_PRIVATE
            raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
        for _ in range(n):
            t0 = time.perf_counter()
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
            os.ftruncate(fd, size)
            _disk_upper._copy_sparse(template, fd)
            t1 = time.perf_counter()
            dev, _name = _disk_upper._bind_loop(fd)
            os.close(fd)
            t2 = time.perf_counter()
            if libc.mount(f"/proc/self/fd/{dev}".encode(), mnt.encode(), b"ext4", 6, b"noinit_itable") != 0:
                raise OSError(ctypes.get_errno(), "mount ext4")
            t3 = time.perf_counter()
            libc.umount2(mnt.encode(), 0)
            t4 = time.perf_counter()
            os.close(dev)
            t5 = time.perf_counter()
            for k, a, b in (("file_and_copy", t0, t1), ("loop_configure", t1, t2), ("mount", t2, t3),
                            ("umount", t3, t4), ("last_close_autoclear", t4, t5)):
                steps[k].append((b - a) * 1e3)
            t6 = time.perf_counter()
            _disk_upper._templates.clear()  # a fresh mke2fs (the template's fd stays open: closed below)
            os.close(_disk_upper._template(size, _disk_upper.inodes_for(size), directory, os.stat(directory).st_dev))
            steps["mke2fs_instead"].append((time.perf_counter() - t6) * 1e3)
    finally:
        os.rmdir(mnt)
    os.close(template)
    return {k: round(statistics.median(v), 3) for k, v in steps.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--big-per-round", type=int, default=2)
    ap.add_argument("--parts", type=int, default=20, help="times each part of a disk upper is measured alone")
    ap.add_argument("--json", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("a disk upper needs a root caller: nothing to measure", file=sys.stderr)
        return 2
    cases: dict[str, tuple[Callable[[], None], int]] = {
        "run_tmpfs": (_run("tmpfs", ["/usr/bin/true"]), args.per_round),
        "run_disk": (_run("disk", ["/usr/bin/true"]), args.per_round),
        "open_disk_upper": (_open_close, args.per_round),
        "write64_tmpfs": (_run("tmpfs", WRITE64), args.big_per_round),
        "write64_disk": (_run("disk", WRITE64), args.big_per_round)}
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, float] = dict.fromkeys(cases, 0.0)
    for f, _n in cases.values():  # warm-up (the ext4 template is made here)
        for _ in range(2):
            f()
    _sweep()
    names = list(cases)
    load_before = os.getloadavg()
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            f, n = cases[name]
            c0 = _cpu_ms()
            for _ in range(n):
                t = time.perf_counter_ns()
                f()
                wall[name].append((time.perf_counter_ns() - t) / 1e6)
            cpu[name] += _cpu_ms() - c0
            _sweep()
    out: dict[str, Any] = {"rounds": args.rounds, "per_round": args.per_round, "big_per_round": args.big_per_round,
                           "loadavg_before": [round(x, 2) for x in load_before],
                           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "cases": {}}
    print(f"{'case':<16} {'wall p50':>9} {'mean':>8} {'cpu/call':>9}  (ms)")
    for name in names:
        n = len(wall[name])
        row = {"n": n, "wall_p50_ms": round(statistics.median(wall[name]), 3),
               "wall_mean_ms": round(sum(wall[name]) / n, 3), "cpu_ms_per_call": round(cpu[name] / n, 3)}
        out["cases"][name] = row
        print(f"{name:<16} {row['wall_p50_ms']:9.3f} {row['wall_mean_ms']:8.3f} {row['cpu_ms_per_call']:9.3f}")
    c = out["cases"]
    out["run_disk_minus_tmpfs_p50_ms"] = round(c["run_disk"]["wall_p50_ms"] - c["run_tmpfs"]["wall_p50_ms"], 3)
    out["session_memory_stat_64MiB"] = session_memory()
    print(f"run_disk - run_tmpfs, p50: {out['run_disk_minus_tmpfs_p50_ms']} ms (load average "
          f"{out['loadavg_before']} -> {out['loadavg_after']})")
    for upper, stat in out["session_memory_stat_64MiB"].items():
        print(f"session holding 64 MiB, {upper} upper: " + ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in stat.items()))
    out["parts_p50_ms"] = parts(args.parts)
    print("parts of a 1 GiB disk upper, p50 ms: " + ", ".join(f"{k} {v}" for k, v in out["parts_p50_ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
