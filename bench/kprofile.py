#!/usr/bin/env python3
"""Where does a fresh sandbox's time go, as the kernel sees it?

    python bench/kprofile.py [--calls N] [--modes seed,raw,run,run_no_overlay] [--out DIR] [--json FILE]

Runs ``--calls`` sequential calls of each mode, interleaved (mode order rotated each round),
under ``perf record -a`` (root; ``apt-get install linux-perf``) with the scheduler and syscall
tracepoints and kernel call chains on every context switch, then prints, per mode and per
call (means):

- the **timeline** of one call: caller start -> anchor exec -> bwrap exec -> guard exec ->
  program exec -> program exit -> bwrap gone -> anchor gone -> caller done, from the
  ``sched_process_exec``/``sched_process_exit`` events and the last context switch of each
  exiting task (an exit's own work: namespace and mm teardown, runs after its exit event);
- **CPU** per process role (caller, anchor, bwrap, bwrap's child, guard, program, kernel
  threads), from the context switches, and the time each role spent **runnable but waiting**
  for a CPU (the host's other load) and **blocked**;
- where blocked time went: the kernel call chain at each switch-out (``schedule`` and the
  wait helpers skipped), summed per chain;
- the syscalls of each role by total time.

Modes: ``seed`` (the seed recipe of ``startup.py``), ``raw`` (``startup.py``'s ``raw_bwrap``),
``run`` (``lowlevel.run`` with the default Policy), ``run_no_overlay`` (the same with
``LOWLEVEL_NO_OVERLAY=1``: the workspace bound as it is), ``run_disk`` (``Limits(upper="disk")``).
Kernel-thread CPU is what all kernel threads did during the calls (the machine's other jobs
included): compare modes, not absolutes.
perf's own overhead inflates syscall-heavy roles; the comparisons are between modes measured
alike, in the same minute.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

MODES = ("seed", "raw", "run", "run_no_overlay", "run_disk")

#: Frames that only say "this task sleeps": skipped when naming why it blocked.
_SCHED_FRAMES = re.compile(r"^(__schedule|schedule|schedule_idle|schedule_timeout|schedule_hrtimeout_range"
                           r"|schedule_hrtimeout_range_clock|schedule_preempt_disabled|io_schedule|"
                           r"__wait_for_common|wait_for_completion\w*|__wait_rcu_gp|preempt_schedule\w*|"
                           r"__cond_resched|_cond_resched|rwsem_down_\w+|__down\w*|down_\w+|"
                           r"percpu_rwsem_wait|__percpu_down_\w+|percpu_down_\w+|mutex_lock\w*|"
                           r"__mutex_lock\w*|do_nanosleep|hrtimer_nanosleep|irqentry_exit\w*|"
                           r"asm_\w+|exit_to_user_mode\w*|syscall_exit_to_user_mode\w*|do_syscall_64|"
                           r"entry_SYSCALL_64\w*)$")


# --- driving (runs under perf) ------------------------------------------------------------------

def drive(calls: int, modes: list[str], out: str, src: str | None = None) -> None:
    """Run the calls; write ``[{mode, t0, t1, pid}]`` (CLOCK_MONOTONIC ns) to ``out``."""
    if src:
        sys.path.insert(0, src)  # another checkout's lowlevel (built in place): a before/after
    import lowlevel
    import startup  # bench/startup.py: the same seed and raw cases (its lowlevel is the one above)

    cmd = ["/usr/bin/true"]
    seed, raw = startup.SeedBwrap(cmd), startup.RawBwrap(cmd)

    def run_call() -> None:
        r = lowlevel.run(cmd)
        workspaces.append(r.workspace)

    def run_no_overlay() -> None:
        os.environ["LOWLEVEL_NO_OVERLAY"] = "1"
        try:
            run_call()
        finally:
            del os.environ["LOWLEVEL_NO_OVERLAY"]

    disk = lowlevel.Policy(limits=lowlevel.Limits(upper="disk"))

    def run_disk() -> None:  # Limits.upper="disk" (issue 27): the upper on a loop device
        r = lowlevel.run(cmd, policy=disk)
        workspaces.append(r.workspace)

    workspaces: list[str] = []
    fns = {"seed": seed.call, "raw": raw.call, "run": run_call, "run_no_overlay": run_no_overlay,
           "run_disk": run_disk}
    for m in modes:  # warm-up, unrecorded windows
        for _ in range(3):
            fns[m]()
    windows = []
    for i in range(calls):
        k = i % len(modes)
        for m in modes[k:] + modes[:k]:
            t0 = time.monotonic_ns()
            fns[m]()
            t1 = time.monotonic_ns()
            windows.append({"mode": m, "t0": t0, "t1": t1})
            # Outside the window (which ends 2 ms after t1, for exit tails): the workspace's
            # removal, then a pause so deferred kernel work of this call ends before the next.
            time.sleep(0.003)
            while workspaces:
                shutil.rmtree(workspaces.pop(), ignore_errors=True)
            time.sleep(0.002)
    seed.close()
    raw.close()
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "windows": windows}, f)


# --- parsing perf script ------------------------------------------------------------------------

_HEAD = re.compile(r"^\s*(?P<comm>.*?)\s+(?P<pid>-?\d+)/(?P<tid>-?\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<time>\d+\.\d+):\s+"
                   r"(?P<event>[\w:]+):\s*(?P<trace>.*)$")
_KV = re.compile(r"(\w+)=(\S+)")


def parse(path: str) -> list[dict[str, Any]]:
    """perf script text -> events ``{comm, pid, tid, cpu, t (ns), event, trace, stack}``."""
    proc = subprocess.Popen(["perf", "script", "-i", path, "-F", "comm,pid,tid,cpu,time,event,trace,ip,sym",
                             "--ns"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            errors="replace")
    assert proc.stdout is not None
    events: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in proc.stdout:
        m = _HEAD.match(line)
        if m:
            s, _, ns = m["time"].partition(".")
            cur = {"comm": m["comm"], "pid": int(m["pid"]), "tid": int(m["tid"]), "cpu": int(m["cpu"]),
                   "t": int(s) * 1_000_000_000 + int(ns.ljust(9, "0")[:9]), "event": m["event"],
                   "trace": m["trace"], "stack": []}
            events.append(cur)
        elif cur is not None and line.strip():
            parts = line.split()
            if len(parts) >= 2:
                cur["stack"].append(parts[1].split("+")[0])
    proc.wait()
    events.sort(key=lambda e: e["t"])  # per-CPU buffers: perf script is not strictly in order
    return events


# --- analysis -----------------------------------------------------------------------------------

def _syscall_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for hdr in ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"):
        if os.path.exists(hdr):
            with open(hdr) as f:
                for line in f:
                    m = re.match(r"#define __NR_(\w+)\s+(\d+)", line)
                    if m:
                        names[int(m.group(2))] = m.group(1)
            break
    return names


def _why(stack: list[str]) -> str:
    frames = [f for f in stack if not _SCHED_FRAMES.match(f) and not f.startswith("[")]
    return " < ".join(frames[:4]) or "?"


class Analysis:
    def __init__(self, events: list[dict[str, Any]], driver: int, windows: list[dict[str, Any]]) -> None:
        self.sysname = _syscall_names()
        self.windows = windows
        self.driver = driver
        # Process tree: every tgid forked (transitively) from the driver.
        self.parent: dict[int, int] = {}
        self.role: dict[int, str] = {}     # tid -> role (updated on exec)
        self.ours: set[int] = {driver}
        self.role[driver] = "caller"
        for e in events:
            if e["event"] == "sched:sched_process_fork":
                kv = dict(_KV.findall(e["trace"]))
                parent, child = int(kv["pid"]), int(kv["child_pid"])
                if parent in self.ours:
                    self.ours.add(child)
                    self.parent[child] = parent
        self.events = events

    def _role_after_exec(self, tid: int, filename: str, comm: str) -> str:
        base = os.path.basename(filename)
        if base == "_lowlevel_exec":
            return "anchor"
        if base == "bwrap":
            par = self.role.get(self.parent.get(tid, -1), "")
            return "bwrap-child" if par.startswith("bwrap") else "bwrap"
        if filename.startswith("/proc/self/fd/") or base == "_lowlevel_guard":
            return "guard"
        if base in ("true", "python3"):
            return "program"
        return base

    def run(self) -> dict[str, Any]:
        w_iter = iter(sorted(self.windows, key=lambda w: w["t0"]))
        wins = sorted(self.windows, key=lambda w: w["t0"])
        starts = [w["t0"] for w in wins]
        import bisect

        def window_of(t: int) -> dict[str, Any] | None:
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= wins[i]["t1"] + 2_000_000:  # +2 ms: the exit tails after the call
                return wins[i]
            return None

        del w_iter
        per_mode: dict[str, dict[str, Any]] = {}
        for w in wins:
            w["marks"] = {}
        running: dict[int, tuple[int, int]] = {}   # cpu -> (tid, since)
        off: dict[int, tuple[int, str, str]] = {}   # tid -> (since, state, why)
        sys_in: dict[int, tuple[int, int]] = {}     # tid -> (nr, since)
        exited: dict[int, int] = {}                 # tid -> exit event time
        acc: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        blocked: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        syscalls: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        sys_n: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

        def role(tid: int, comm: str) -> str | None:
            if tid in self.ours:
                return self.role.get(tid) or self.role.get(self.parent.get(tid, -1), "?") + "/fork"
            if tid == 0:
                return None
            if comm.startswith(("kworker", "rcu", "ksoftirq", "migration", "kthreadd", "cpuhp")):
                return "kthreads"
            return None

        for e in self.events:
            t, ev, tid = e["t"], e["event"], e["tid"]
            w = window_of(t)
            mode = w["mode"] if w is not None else None
            if ev == "sched:sched_process_exec":
                kv = dict(_KV.findall(e["trace"]))
                if tid in self.ours and tid != self.driver:
                    r = self._role_after_exec(tid, kv.get("filename", ""), e["comm"])
                    self.role[tid] = r
                    if w is not None:
                        w["marks"].setdefault(f"exec {r}", t)
            elif ev == "sched:sched_process_fork":
                kv = dict(_KV.findall(e["trace"]))
                child = int(kv["child_pid"])
                if child in self.ours and child not in self.role:
                    pr = self.role.get(int(kv["pid"]), "?")
                    self.role[child] = pr if pr.endswith("/fork") else pr + "/fork"
            elif ev == "sched:sched_process_exit":
                if tid in self.ours:
                    exited[tid] = t
                    if w is not None:
                        w["marks"].setdefault(f"exit {self.role.get(tid, '?')}", t)
            elif ev == "sched:sched_switch":
                kv = dict(_KV.findall(e["trace"]))
                cpu = e["cpu"]
                prev, nxt = int(kv["prev_pid"]), int(kv["next_pid"])
                state = kv.get("prev_state", "R")
                if cpu in running:
                    rt, since = running.pop(cpu)
                    if rt == prev:
                        pw = window_of(since)
                        r = role(prev, kv.get("prev_comm", ""))
                        if pw is not None and r is not None:
                            acc[pw["mode"]][f"cpu {r}"] += t - since
                if prev != 0:
                    if state.startswith(("X", "Z", "I")) or (prev in exited and state not in ("R", "R+")):
                        if prev in exited and w is not None and prev in self.ours:
                            r = self.role.get(prev, "?")
                            w["marks"].setdefault(f"gone {r}", t)
                            acc[mode or "-"][f"exit {r}"] += t - exited[prev]
                    off[prev] = (t, state, _why(e["stack"]) if not state.startswith("R") else "preempted")
                running[cpu] = (nxt, t)
                if nxt in off:
                    since, st, why = off.pop(nxt)
                    r = role(nxt, kv.get("next_comm", ""))
                    pw = window_of(since)
                    if pw is not None and r is not None and r != "kthreads":
                        key = "runnable" if st.startswith("R") else "blocked"
                        acc[pw["mode"]][f"{key} {r}"] += t - since
                        if key == "blocked":
                            blocked[pw["mode"]][f"{r}: {why}"] += t - since
            elif ev == "raw_syscalls:sys_enter" and tid in self.ours:
                m = re.match(r"NR (\d+)", e["trace"])
                if m:
                    sys_in[tid] = (int(m.group(1)), t)
            elif ev == "raw_syscalls:sys_exit" and tid in self.ours:
                got = sys_in.pop(tid, None)
                if got is not None and w is not None:
                    nr, since = got
                    r = self.role.get(tid, "?")
                    name = self.sysname.get(nr, str(nr))
                    syscalls[w["mode"]][f"{r}: {name}"] += t - since
                    sys_n[w["mode"]][f"{r}: {name}"] += 1
        for m in sorted({w["mode"] for w in wins}):
            mw = [w for w in wins if w["mode"] == m]
            n = len(mw)
            walls = sorted((w["t1"] - w["t0"]) / 1e6 for w in mw)
            marks: dict[str, list[float]] = collections.defaultdict(list)
            for w in mw:
                for k, v in w["marks"].items():
                    marks[k].append((v - w["t0"]) / 1e6)
            per_mode[m] = {
                "n": n, "wall_p50_ms": round(statistics.median(walls), 3),
                "wall_mean_ms": round(sum(walls) / n, 3),
                "timeline_ms": {k: round(statistics.median(v), 3) for k, v in
                                sorted(marks.items(), key=lambda kv: statistics.median(kv[1]))},
                "per_call_ms": {k: round(v / n / 1e6, 3) for k, v in sorted(acc[m].items())},
                "blocked_ms": {k: round(v / n / 1e6, 3) for k, v in blocked[m].most_common(25)},
                "syscalls_ms": {k: [round(v / n / 1e6, 4), round(sys_n[m][k] / n, 2)]
                                for k, v in syscalls[m].most_common(40)},
            }
        return per_mode


def report(doc: dict[str, Any]) -> None:
    for mode, d in doc.items():
        print(f"\n=== {mode}: n={d['n']} wall p50 {d['wall_p50_ms']} ms, mean {d['wall_mean_ms']} ms")
        print("  timeline (median ms from the call's start):")
        for k, v in d["timeline_ms"].items():
            print(f"    {v:8.3f}  {k}")
        print("  per call (mean ms): CPU on-CPU, runnable (waiting for a CPU), blocked; exit = exit event -> gone")
        for k, v in d["per_call_ms"].items():
            print(f"    {v:8.3f}  {k}")
        print("  blocked, by kernel call chain (mean ms per call):")
        for k, v in d["blocked_ms"].items():
            print(f"    {v:8.3f}  {k}")
        print("  syscalls (mean ms per call, calls per call):")
        for k, (v, c) in d["syscalls_ms"].items():
            print(f"    {v:8.4f}  {c:6.1f}  {k}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100, help="calls per mode (default 100)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
    ap.add_argument("--out", help="keep perf.data and the windows here (default: a temp dir, removed)")
    ap.add_argument("--json", help="write the per-mode figures as JSON")
    ap.add_argument("--no-syscalls", action="store_true",
                    help="leave out the syscall tracepoints (much less overhead: timelines closer to the truth)")
    ap.add_argument("--src", help="import lowlevel from this checkout (built in place) instead of this one")
    ap.add_argument("--drive", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if args.drive:
        drive(args.calls, modes, args.drive, args.src)
        return 0
    if shutil.which("perf") is None:
        print("needs perf (apt-get install linux-perf) and root", file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="kprofile-")
    os.makedirs(out, exist_ok=True)
    data, wfile = os.path.join(out, "perf.data"), os.path.join(out, "windows.json")
    events = ["-e", "sched:sched_switch/call-graph=fp/"]
    tracepoints = ["sched:sched_process_fork", "sched:sched_process_exec", "sched:sched_process_exit"]
    if not args.no_syscalls:
        tracepoints += ["raw_syscalls:sys_enter", "raw_syscalls:sys_exit"]
    for ev in tracepoints:
        events += ["-e", f"{ev}/call-graph=no/"]
    env = dict(os.environ, PYTHONPATH=HERE)
    cmd = ["perf", "record", "-q", "-k", "mono", "-m", "16M", "-o", data, *events, "-a", "--",
           sys.executable, os.path.abspath(__file__), "--drive", wfile, "--calls", str(args.calls),
           "--modes", ",".join(modes), *(["--src", os.path.abspath(args.src)] if args.src else [])]
    subprocess.run(cmd, check=True, env=env)
    with open(wfile) as f:
        w = json.load(f)
    doc = Analysis(parse(data), w["pid"], w["windows"]).run()
    report(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
