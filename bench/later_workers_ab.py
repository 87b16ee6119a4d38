"""arun c8 calls/s with lowlevel.host.later's worker bound at 1 and at 4, interleaved in one process.

    python bench/later_workers_ab.py [BLOCKS]     (default 8 blocks of 120 calls per side)

The one "close later" queue (lowlevel/host/later.py) serves the one-shot teardown (one thread
before) and the disk upper's close (up to 4 before); this showed what more workers cost a
teardown-only load, measured at 65811b4 and ad30514, where quick items could start workers. At
the commit after those, only slow items (the disk closes) may, so on this teardown-only load
both sides run one worker: a control. bench/README.md "Teardown nits".
"""
import asyncio
import statistics
import sys
import time
import lowlevel
from lowlevel.host import later
from lowlevel.sandbox import aio

async def block(n, c):
    sem = asyncio.Semaphore(c)
    async def one():
        async with sem:
            await aio.arun(["/usr/bin/true"])
    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - t)

res = {1: [], 4: []}
lowlevel.run(["/usr/bin/true"])
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    for w in ((1, 4) if i % 2 == 0 else (4, 1)):
        later.drain()
        later.MAX_WORKERS = w
        res[w].append(asyncio.run(block(120, 8)))
        later.drain()
for w, v in res.items():
    print(f"MAX_WORKERS={w}: arun c8 calls/s median {statistics.median(v):.1f} ({', '.join(f'{x:.0f}' for x in v)})")
