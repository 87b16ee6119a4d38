"""Where a session command's time over the floor goes: the caller's Python, the hand-off, the sandbox.

    python bench/session_split.py [--calls 2000] [--command /usr/bin/true]

One Session and the host floor (``os.posix_spawn`` + ``waitpid``), alternating, in one process.
Per command, from ``time.perf_counter_ns`` stamps the script puts around the session's own
methods (the SPAWN's ``sendmsg`` call and return, ``Core.on_readable``'s entry:
the caller's wake-up by the EXIT, ``run``'s return):

* caller before the send: ``run`` entry -> ``sendmsg`` called (checks, Command, pipes), then the
  ``sendmsg`` itself (it wakes the init),
* in the sandbox: ``sendmsg`` returned -> the caller woke for the EXIT (hand-offs, the init's and
  shepherd's work, the command, the EXIT back),
* caller after the EXIT: woke -> ``run`` returned (recv, drain, close, cgroup counts, Result).

And CPU per command: the caller's (``time.process_time``), the sandbox's (the session cgroup's v2
``cpu.stat`` ``usage_usec``: init, shepherds, commands), the floor's children's
(``RUSAGE_CHILDREN``: what the bare fork/exec/exit of the command costs on the host). The stamps
cost ~1 us each. Root, a cgroup v2 mount (for the sandbox CPU).
"""
from __future__ import annotations

import argparse
import os
import resource
import time

from lowlevel.session import Session
from lowlevel.session import core as _core


def cg_usec(s: Session) -> int:
    """The session cgroup's CPU so far (us), or 0 without a v2 node."""
    cg = s._core.run.cgroup
    node = next((n for n in (cg.nodes if cg else ()) if n.version == 2), None)
    if node is None:
        return 0
    with open(os.path.join(node.path, "cpu.stat")) as f:
        for line in f:
            if line.startswith("usage_usec"):
                return int(line.split()[1])
    return 0


def children_us() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (ru.ru_utime + ru.ru_stime) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--command", default="/usr/bin/true")
    args = ap.parse_args()
    cmd = args.command.split()
    stamps: dict[str, int] = {}
    send, readable = _core.Core._send, _core.Core.on_readable

    def timed_send(self: _core.Core, parts: list[bytes], fds: list[int]) -> None:
        stamps["sending"] = time.perf_counter_ns()
        send(self, parts, fds)
        stamps["sent"] = time.perf_counter_ns()

    def timed_readable(self: _core.Core) -> None:
        stamps.setdefault("woke", time.perf_counter_ns())
        readable(self)

    _core.Core._send = timed_send  # type: ignore[method-assign]
    _core.Core.on_readable = timed_readable  # type: ignore[method-assign]
    s = Session()
    for _ in range(100):
        s.run(cmd)
    floor: list[int] = []
    spans: dict[str, list[int]] = {"before": [], "sendmsg": [], "sandbox": [], "after": [], "wall": []}
    caller_ns = floor_cpu = 0.0
    sandbox0 = cg_usec(s)
    for _ in range(args.calls):
        c0 = children_us()
        t = time.perf_counter_ns()
        os.waitpid(os.posix_spawn(cmd[0], cmd, {}), 0)
        floor.append(time.perf_counter_ns() - t)
        floor_cpu += children_us() - c0
        stamps.clear()
        p = time.process_time_ns()
        t = time.perf_counter_ns()
        s.run(cmd)
        end = time.perf_counter_ns()
        caller_ns += time.process_time_ns() - p
        spans["wall"].append(end - t)
        spans["before"].append(stamps["sending"] - t)
        spans["sendmsg"].append(stamps["sent"] - stamps["sending"])
        spans["sandbox"].append(stamps["woke"] - stamps["sent"])
        spans["after"].append(end - stamps["woke"])
    sandbox_us = (cg_usec(s) - sandbox0) / args.calls
    s.close()

    def p50(xs: list[int]) -> float:
        return sorted(xs)[len(xs) // 2] / 1e3

    n = args.calls
    print(f"load {os.getloadavg()[0]:.1f}, {n} commands each; p50 us")
    print(f"floor: wall {p50(floor):.0f}, children's CPU {floor_cpu / n:.0f} us per command")
    print(f"session: wall {p50(spans['wall']):.0f} ({p50(spans['wall']) / p50(floor):.2f}x floor), caller before "
          f"the send {p50(spans['before']):.0f}, sendmsg {p50(spans['sendmsg']):.0f}, sent -> woken by EXIT "
          f"{p50(spans['sandbox']):.0f}, after the EXIT {p50(spans['after']):.0f}")
    print(f"CPU per command: caller {caller_ns / n / 1e3:.0f} us, sandbox {sandbox_us:.0f} us "
          f"({sandbox_us - floor_cpu / n:+.0f} over the floor's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
