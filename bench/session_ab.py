"""Interleaved A/B of session init executables, in one process: where a Session command's time goes.

    python bench/session_ab.py [--calls 1500] [--command /usr/bin/true] [--strace] INIT [INIT...]

One Session per INIT (a ``_lowlevel_init`` build: ``$LOWLEVEL_INIT`` is read at each Session's
start), plus the host floor (``os.posix_spawn`` + ``waitpid``), called in turn (the order flips
every round), so load and drift hit every side alike. Per side: wall p25/p50 and the ratio to
the floor's p50; the sandbox's CPU per command (the session cgroup's v2 ``cpu.stat``
``usage_usec``: init, shepherds, commands; load-robust where wall time is not) and the caller's
(``time.process_time``). ``--strace``: also the system calls per command inside the sandbox
(``strace -c -f`` on the init over 100 commands, the command's own included). Root, cgroup v2
mounted (for the CPU figure). To compare two commits, build each one's init
(``python setup.py build_ext --inplace``) and copy ``lowlevel/_lowlevel_init`` aside.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time

from lowlevel.session import Session


def cg_usec(s: Session) -> int:
    """The session cgroup's CPU so far (µs), or 0 without a v2 node."""
    cg = s._core.run.cgroup
    node = next((n for n in (cg.nodes if cg else ()) if n.version == 2), None)
    if node is None:
        return 0
    for line in open(os.path.join(node.path, "cpu.stat")):
        if line.startswith("usage_usec"):
            return int(line.split()[1])
    return 0


def syscalls_per_command(s: Session, cmd: list[str], n: int = 100) -> float:
    """System calls inside the sandbox per command (strace -c -f on the init)."""
    out = f"/tmp/lowlevel-session-ab-{os.getpid()}.strace"
    st = subprocess.Popen(["strace", "-c", "-f", "-o", out, "-p", str(s._core.init_host_pid)],
                          stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    for _ in range(n):
        s.run(cmd)
    time.sleep(0.2)
    st.send_signal(signal.SIGINT)
    st.wait()
    with open(out) as f:
        total = [line.split() for line in f if line.rstrip().endswith("total")]
    os.unlink(out)
    return int(total[-1][3]) / n if total else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("inits", nargs="+")
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--command", default="/usr/bin/true")
    ap.add_argument("--strace", action="store_true")
    args = ap.parse_args()
    cmd = args.command.split()
    sessions = []
    for path in args.inits:
        os.environ["LOWLEVEL_INIT"] = os.path.abspath(path)
        sessions.append(Session())
    for s in sessions:
        for _ in range(50):
            s.run(cmd)
    wall: list[list[int]] = [[] for _ in sessions]
    floor: list[int] = []
    host = [0] * len(sessions)
    cpu0 = [cg_usec(s) for s in sessions]
    for i in range(args.calls):
        t = time.perf_counter_ns()
        os.waitpid(os.posix_spawn(cmd[0], cmd, {}), 0)
        floor.append(time.perf_counter_ns() - t)
        for k in (range(len(sessions)) if i % 2 == 0 else reversed(range(len(sessions)))):
            p = time.process_time_ns()
            t = time.perf_counter_ns()
            sessions[k].run(cmd)
            wall[k].append(time.perf_counter_ns() - t)
            host[k] += time.process_time_ns() - p

    def q(xs: list[int], f: float) -> float:
        return sorted(xs)[int(len(xs) * f)] / 1e6

    print(f"load {os.getloadavg()[0]:.1f}, floor p50 {q(floor, .5):.3f} ms, {args.calls} calls each")
    for k, path in enumerate(args.inits):
        line = (f"{path}: p25 {q(wall[k], .25):.3f} p50 {q(wall[k], .5):.3f} ms ({q(wall[k], .5) / q(floor, .5):.2f}x "
                f"floor), sandbox CPU {(cg_usec(sessions[k]) - cpu0[k]) / args.calls / 1e3:.3f} ms, "
                f"caller CPU {host[k] / args.calls / 1e6:.3f} ms per command")
        if args.strace:
            line += f", {syscalls_per_command(sessions[k], cmd):.1f} syscalls inside"
        print(line)
    for s in sessions:
        s.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
