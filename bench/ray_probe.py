#!/usr/bin/env python3
"""Where does a ``SandboxActorPool.run`` call's time go beyond the sandbox? (issue 27, Ray round 2)

Starts a private one-node Ray cluster (every file under a fresh temp root, as the tests'
``helpers/ray_cluster.py``; never ``/tmp/ray``; always stopped) and a pool whose actor is a
:class:`lowlevel.ray.SandboxActor` subclass with probe methods that stamp ``time.perf_counter()``
(CLOCK_MONOTONIC: one clock for every process of the machine) at each phase. One process, the
cases interleaved in each round (the order reversed every other round), milliseconds:

- ``local``: ``lowlevel.arun(true)`` in this process (``local_rm``: removing its workspace after,
  which ``bench/cluster.py``'s ``latency_local`` leaves out of its timing and the actor does not);
- ``run``: ``pool.run(true)`` (the fast path as shipped);
- ``stamped``: the same sandbox call made by a probe method straight on the actor handle, split
  into ``st_submit_to_entry`` (``.remote()`` -> the actor's coroutine starts), ``st_sandbox``
  (``Runner.run``), ``st_rm`` (removing the workspace), ``st_remote_result`` (building the
  RemoteResult) and ``st_return_to_got`` (the coroutine returns -> ``ray.get`` returns);
- ``ping``: ``pool._ping()`` (an empty actor method); ``ping_st``: the same with a stamp, split
  into ``there`` and ``back``;
- ``sleepN``: the actor awaits ``asyncio.sleep(N ms)`` then returns a RemoteResult with a stamp:
  ``sleepN_back`` is the return path after the actor (and the driver) idled N ms, no sandbox;
  ``sleep25p`` the same with the driver polling (``ray.wait(timeout=0)``) instead of blocking,
  ``sleep25f`` with ``ref.future().result()`` instead of ``ray.get``, ``sleep25w`` with a task
  waking the actor's event loop every 0.5 ms during the sleep (the loop kept warm); ``tsleepN``
  the same from a plain threaded actor (sync method, ``time.sleep``; no event loop);
- ``defer`` / ``defer_thread``: the sandbox call with the workspace removal put after the reply
  (``call_soon`` on the actor's loop / a thread of its executor), the A/B of moving it off the
  call's path against ``stamped``;
- ``--pipe-control`` (no Ray): a process blocked on a pipe, then on a loopback TCP connection,
  woken by one that slept 0-25 ms;
- once, not per round: Ray's serialization of the RemoteResult in the actor (``ser``: Ray's
  serialization context, pickle protocol 5, bytes).

Usage: ``python bench/ray_probe.py [--rounds N] [--cases a,b,...]``. Never asserts; the machine
is shared, so only the figures of one run side by side mean anything. Findings: bench/README.md,
"Issue 27" -> "Ray, round 2".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import ray  # noqa: E402
from helpers.ray_cluster import private_ray_cluster  # type: ignore[import-not-found]  # noqa: E402

import lowlevel  # noqa: E402
import lowlevel.ray.pool as _pool  # noqa: E402
from lowlevel import workspace as _ws  # noqa: E402
from lowlevel.ray.actor import SandboxActor  # noqa: E402
from lowlevel.ray.results import UNSET, RemoteResult, remote_result  # noqa: E402

CASES = ("local", "run", "stamped", "ping", "ping_st", "sleep0", "sleep5", "sleep25", "sleep25p", "sleep25f",
         "sleep25w", "tsleep0", "tsleep25", "defer", "defer_thread")
COMMAND = ["/usr/bin/true"]
SLEEPER: list[Any] = []   # (ThreadedSleeper handle, a RemoteResult to carry)


class ProbeActor(SandboxActor):
    """The pool's actor plus probe methods (cloudpickled by value into the worker)."""

    async def _sandbox(self, spec: dict[str, Any]) -> Any:
        return await self.runner.run(spec["command"], policy=self._policy(spec["policy_key"]), stdin=spec["stdin"],
                                     env=spec["env"], cwd=spec["cwd"], workspace_base=self._base())

    async def run_stamped(self, spec: dict[str, Any], inputs: bytes | None) -> tuple[RemoteResult, tuple[float, ...]]:
        t0 = time.perf_counter()
        r = await self._sandbox(spec)
        t1 = time.perf_counter()
        _ws.remove_workspace(r.workspace)
        t2 = time.perf_counter()
        out = remote_result(r, self.node_id, ({}, 0, []))
        return out, (t0, t1, t2, time.perf_counter())

    async def run_defer(self, spec: dict[str, Any], inputs: bytes | None) -> RemoteResult:
        r = await self._sandbox(spec)
        asyncio.get_running_loop().call_soon(_ws.remove_workspace, r.workspace)
        return remote_result(r, self.node_id, ({}, 0, []))

    async def run_defer_thread(self, spec: dict[str, Any], inputs: bytes | None) -> RemoteResult:
        r = await self._sandbox(spec)
        asyncio.get_running_loop().run_in_executor(None, _ws.remove_workspace, r.workspace)
        return remote_result(r, self.node_id, ({}, 0, []))

    async def keep(self, spec: dict[str, Any]) -> None:
        self.kept = await self.run(spec, None)

    async def ping_stamped(self) -> float:
        return time.perf_counter()

    async def sleep_stamped(self, ms: int) -> tuple[RemoteResult, float]:
        await asyncio.sleep(ms / 1e3)
        return self.kept, time.perf_counter()

    async def sleep_warm(self, ms: int) -> tuple[RemoteResult, float]:
        done = False

        async def tick() -> None:
            while not done:
                await asyncio.sleep(0.0005)
        ticker = asyncio.get_running_loop().create_task(tick())
        await asyncio.sleep(ms / 1e3)
        done = True
        await ticker
        return self.kept, time.perf_counter()

    def ser(self, n: int) -> tuple[float, float, int]:
        ctx = ray._private.worker.global_worker.get_serialization_context()
        t = time.perf_counter()
        for _ in range(n):
            ctx.serialize(self.kept)
        a = (time.perf_counter() - t) / n * 1e3
        t = time.perf_counter()
        for _ in range(n):
            pickle.dumps(self.kept, protocol=5)
        return round(a, 4), round((time.perf_counter() - t) / n * 1e3, 4), len(pickle.dumps(self.kept, protocol=5))


class ThreadedSleeper:
    """A plain threaded actor (sync methods, no event loop): the return path without the async
    actor's hand-offs."""

    def sleep_stamped(self, ms: int, payload: Any) -> tuple[Any, float]:
        time.sleep(ms / 1e3)
        return payload, time.perf_counter()


def one(case: str, pool: Any, h: Any, spec: dict[str, Any], loop: asyncio.AbstractEventLoop,
        add: Any) -> None:
    t0 = time.perf_counter()
    if case == "local":
        r = loop.run_until_complete(lowlevel.arun(COMMAND))
        t1 = time.perf_counter()
        _ws.remove_workspace(r.workspace)
        add("local", t1 - t0)
        add("local_rm", time.perf_counter() - t1)
    elif case == "run":
        pool.run(COMMAND)
        add("run", time.perf_counter() - t0)
    elif case == "stamped":
        _, (a0, a1, a2, a3) = ray.get(h.run_stamped.remote(spec, None))
        t4 = time.perf_counter()
        for name, v in (("stamped", t4 - t0), ("st_submit_to_entry", a0 - t0), ("st_sandbox", a1 - a0),
                        ("st_rm", a2 - a1), ("st_remote_result", a3 - a2), ("st_return_to_got", t4 - a3)):
            add(name, v)
    elif case == "ping":
        pool._ping()
        add("ping", time.perf_counter() - t0)
    elif case == "ping_st":
        a = ray.get(h.ping_stamped.remote())
        t4 = time.perf_counter()
        add("ping_st_there", a - t0)
        add("ping_st_back", t4 - a)
    elif case.startswith("tsleep"):
        _, a = ray.get(SLEEPER[0].sleep_stamped.remote(int(case[6:]), SLEEPER[1]))
        add(case + "_back", time.perf_counter() - a)
    elif case.startswith("sleep"):
        ms = int(case[5:].rstrip("fpw"))
        ref = h.sleep_warm.remote(ms) if case.endswith("w") else h.sleep_stamped.remote(ms)
        if case.endswith("p"):
            while not ray.wait([ref], timeout=0)[0]:
                pass
        _, a = ref.future().result() if case.endswith("f") else ray.get(ref)
        add(case + "_back", time.perf_counter() - a)
    elif case in ("defer", "defer_thread"):
        ray.get((h.run_defer if case == "defer" else h.run_defer_thread).remote(spec, None))
        add(case, time.perf_counter() - t0)


def pipe_control(n: int, tcp: bool) -> None:
    """The kernel alone (no Ray): a process blocked in read() on a pipe (``tcp``: a loopback TCP
    connection with TCP_NODELAY, as gRPC's), woken by a child that slept 0 / 1 / 5 / 25 ms
    before writing its stamp; the reader's wake-up latency, ms."""
    import socket
    sleeps = (0, 1, 5, 25)
    if tcp:
        srv = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
        for sock in (a, b):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        r1, w2, w1, r2 = b.fileno(), b.fileno(), a.fileno(), a.fileno()  # child: b, parent: a
    else:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        if not tcp:
            os.close(w1)
        while got := os.read(r1, 8):
            time.sleep(int.from_bytes(got, "little") / 1e3)
            os.write(w2, time.perf_counter_ns().to_bytes(8, "little"))
        os._exit(0)
    out: dict[int, list[float]] = {s: [] for s in sleeps}
    for i in range(n):
        for ms in (sleeps if i % 2 == 0 else sleeps[::-1]):
            os.write(w1, ms.to_bytes(8, "little"))
            sent = int.from_bytes(os.read(r2, 8), "little")
            out[ms].append((time.perf_counter_ns() - sent) / 1e6)
    if tcp:
        a.shutdown(socket.SHUT_WR)
    else:
        os.close(w1)
    os.waitpid(pid, 0)
    for ms, v in out.items():
        v.sort()
        print(f"{'tcp' if tcp else 'pipe'} wake after the writer slept {ms:>2} ms: p50 {v[len(v) // 2]:.3f}  "
              f"p90 {v[9 * len(v) // 10]:.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=150, help="interleaved rounds (default 150)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    ap.add_argument("--pipe-control", action="store_true", help="only the kernel's wake-up control (no Ray)")
    args = ap.parse_args(argv)
    if args.pipe_control:
        pipe_control(args.rounds, tcp=False)
        pipe_control(args.rounds, tcp=True)
        return
    cases = args.cases.split(",")
    _pool.SandboxActor = ProbeActor  # type: ignore[attr-defined]  # the pool's actor class, for this process only
    print(f"load {os.getloadavg()[0]:.1f} before")
    with private_ray_cluster("llray-probe-", num_cpus=1, object_store_memory=100 << 20, include_dashboard=False,
                             _system_config={"worker_niceness": 0}) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        with _pool.SandboxActorPool(concurrency=4, max_in_flight=8) as pool:
            h = next(iter(pool._actors.values()))[0]
            spec = pool._spec(COMMAND, None, None, None, UNSET, None, None)
            ray.get(h.keep.remote(spec))
            if any(c.startswith("tsleep") for c in cases):
                SLEEPER[:] = [ray.remote(ThreadedSleeper).options(num_cpus=0, max_concurrency=4).remote(),
                              pool.run(COMMAND)]
            rows: dict[str, list[float]] = {}

            def add(name: str, seconds: float) -> None:
                rows.setdefault(name, []).append(seconds * 1e3)

            loop = asyncio.new_event_loop()
            try:
                for _ in range(10):
                    pool.run(COMMAND)
                for i in range(args.rounds):
                    for case in (cases if i % 2 == 0 else cases[::-1]):
                        one(case, pool, h, spec, loop, add)
            finally:
                loop.close()
            print("ser (Ray's serialization ms, pickle ms, bytes):", ray.get(h.ser.remote(2000)))
    print(f"load {os.getloadavg()[0]:.1f} after")
    for name, ms in rows.items():
        s = sorted(ms)
        print(f"{name:<22} p50 {s[len(s) // 2]:8.3f}  p10 {s[len(s) // 10]:8.3f}  p90 {s[9 * len(s) // 10]:8.3f}")


if __name__ == "__main__":
    main()
