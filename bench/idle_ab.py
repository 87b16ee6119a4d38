"""Does an idle gap before a command cost it? A Session command and the host floor, back to back
against after 0.2 s of sleep, alternating (300 rounds), p50 each.

    python bench/idle_ab.py
"""
from __future__ import annotations

import os
import time

from lowlevel.session import Session


def p50(xs: list[int]) -> float:
    return sorted(xs)[len(xs) // 2] / 1e3


def main() -> int:
    s = Session()
    cmd = ["/usr/bin/true"]
    for _ in range(50):
        s.run(cmd)
    runs: tuple[list[int], list[int]] = ([], [])
    floors: tuple[list[int], list[int]] = ([], [])
    for i in range(300):
        if i % 2:
            time.sleep(0.2)
        t = time.perf_counter_ns()
        os.waitpid(os.posix_spawn(cmd[0], cmd, {}), 0)
        floors[i % 2].append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        s.run(cmd)
        runs[i % 2].append(time.perf_counter_ns() - t)
    print(f"load {os.getloadavg()[0]:.1f}; back to back: floor {p50(floors[0]):.0f}, session {p50(runs[0]):.0f} us; "
          f"after 0.2 s idle: floor {p50(floors[1]):.0f}, session {p50(runs[1]):.0f} us")
    s.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
