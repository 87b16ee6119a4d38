#!/usr/bin/env python3
"""What does running through a Ray cluster cost per call? (``lowlevel.ray.SandboxActorPool``)

On one machine, with a real Ray cluster started here (``ray.cluster_utils.Cluster``: a head
node, then a second and a third node, ``--nodes``), measures for ``/usr/bin/true`` at each size:

- ``local``: ``lowlevel.Runner(max_concurrency=C x nodes)`` driving ``arun`` in this process
  (each fresh workspace removed after its call, as the actors do);
- ``cluster``: the same calls through ``SandboxActorPool.map`` (one actor per node, each with
  ``concurrency=C``): the driver's fast path straight to the actors, batched;
- ``cluster_router``: the same calls through ``SandboxActorPool.submit`` (driver -> router ->
  actor) with the same window: the path ``map`` took before the fast path;
- ``latency``: sequential calls (concurrency 1), one of each in turn: ``local`` (``await
  arun``), ``cluster`` (``pool.run``: driver -> actor), ``ray_path`` (that hop with no sandbox),
  ``cluster_router`` (``ray.get(pool.submit(...))``: the old ``run``) and ``ray_router_path``
  (driver -> router -> actor and back, no sandbox), the order reversed every other round so
  machine drift hits all alike.

The Ray workers (actors, hence their sandboxes) run at ``--worker-niceness`` (default 0, like
the bench process; Ray's own default is 15, which on a machine shared with other work makes
the cluster side slower for a reason that is not lowlevel's).

Throughput cases alternate too (local, cluster, router, then the reverse) over ``--rounds`` rounds;
``calls_per_s`` is calls over the wall time of the case's batches. On one machine both nodes
share the same CPUs: the ratios measure the cluster path's overhead, not scaling.

Usage: ``python bench/cluster.py [--quick] [--json FILE] [--calls N] [--concurrency C]``.
Never asserts. JSON schema: bench/README.md ("cluster.py").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# The tests' private Ray cluster (tests/helpers/ray_cluster.py), imported where Ray is.
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))

import lowlevel  # noqa: E402
from lowlevel.workspace import remove_workspace  # noqa: E402

SCHEMA = 2
COMMAND = ["/usr/bin/true"]
TARGETS = {"cluster_vs_local_calls_per_s": 0.8, "added_latency_p50_ms": 3.0}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100)."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def _local_batch(n: int, concurrency: int) -> tuple[float, int]:
    runner = lowlevel.Runner(concurrency)
    errors = 0

    async def one() -> None:
        nonlocal errors
        try:
            r = await runner.run(COMMAND)
        except lowlevel.LowlevelError:
            errors += 1
            return
        remove_workspace(r.workspace)
        if r.exit_code != 0:
            errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return time.perf_counter() - t0, errors


def local_batch(n: int, concurrency: int) -> tuple[float, int]:
    return asyncio.run(_local_batch(n, concurrency))


def cluster_batch(pool: Any, n: int) -> tuple[float, int]:
    """``n`` calls through ``SandboxActorPool.map`` (the driver's fast path, batched)."""
    errors = 0
    t0 = time.perf_counter()
    for r in pool.map([COMMAND] * n, ordered=False, return_exceptions=True):
        if isinstance(r, BaseException) or r.exit_code != 0:
            errors += 1
    return time.perf_counter() - t0, errors


def router_batch(pool: Any, n: int) -> tuple[float, int]:
    """``n`` calls through ``SandboxActorPool.submit`` (the router, two Ray hops each way) with
    the same window as ``map``: what ``map`` did before the fast path."""
    import ray

    errors = 0
    window = pool._direct.capacity()
    todo = n
    pending: list[Any] = []
    t0 = time.perf_counter()
    while todo or pending:
        while todo and len(pending) < window:
            pending.append(pool.submit(COMMAND))
            todo -= 1
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            try:
                if ray.get(ref).exit_code != 0:
                    errors += 1
            except ray.exceptions.RayError:
                errors += 1
    return time.perf_counter() - t0, errors


LATENCY_CASES = ("latency_local", "latency_cluster", "latency_ray_path", "latency_cluster_router",
                 "latency_ray_router_path")


def latency(pool: Any, n: int) -> dict[str, list[float]]:
    """Sequential calls, one of each case in turn (order reversed every other round so drift
    hits all alike), milliseconds each: local ``arun``; ``pool.run`` (driver -> actor); the same
    hop with no sandbox; ``ray.get(pool.submit(...))`` (driver -> router -> actor, the old
    ``run``); the router's round trip with no sandbox."""
    import ray

    out: dict[str, list[float]] = {name: [] for name in LATENCY_CASES}
    loop = asyncio.new_event_loop()
    try:
        for i in range(n):
            for which in (LATENCY_CASES if i % 2 == 0 else LATENCY_CASES[::-1]):
                t0 = time.perf_counter()
                if which == "latency_local":
                    r = loop.run_until_complete(lowlevel.arun(COMMAND))
                    elapsed = time.perf_counter() - t0
                    remove_workspace(r.workspace)
                    out[which].append(elapsed * 1e3)
                    continue
                if which == "latency_cluster":
                    pool.run(COMMAND)
                elif which == "latency_ray_path":
                    pool._ping()
                elif which == "latency_cluster_router":
                    ray.get(pool.submit(COMMAND))
                else:
                    ray.get(pool._router.ping.remote())
                out[which].append((time.perf_counter() - t0) * 1e3)
    finally:
        loop.close()
    return out


def _suffix(count: int) -> str:
    return f"{count}node{'s' if count > 1 else ''}"


def measure(pool: Any, count: int, n: int, rounds: int, c: int, n_lat: int,
            results: list[dict[str, Any]], ratios: dict[str, float | None]) -> None:
    """The throughput cases (interleaved over ``rounds``) and the latency cases of one cluster size."""
    cluster_batch(pool, 4 * c * count)  # warm-up: actors, policy, first runs
    router_batch(pool, 2 * c * count)
    local_batch(4 * c * count, c * count)
    cases = {"local": lambda: local_batch(n, c * count), "cluster": lambda: cluster_batch(pool, n),
             "cluster_router": lambda: router_batch(pool, n)}
    drivers = {"local": "Runner.run (asyncio)", "cluster": "SandboxActorPool.map (direct, batched)",
               "cluster_router": "SandboxActorPool.submit (router), same window"}
    wall = dict.fromkeys(cases, 0.0)
    errs = dict.fromkeys(cases, 0)
    for r in range(rounds):
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            w, e = cases[name]()
            wall[name] += w
            errs[name] += e
    cps = {name: n * rounds / wall[name] for name in cases}
    for name in cases:
        results.append({"name": name, "nodes": count, "concurrency": c * count, "n": n * rounds,
                        "calls_per_s": round(cps[name], 2), "errors": errs[name], "driver": drivers[name]})
    sfx = _suffix(count)
    ratios[f"cluster_vs_local_calls_per_s_{sfx}"] = round(cps["cluster"] / cps["local"], 3)
    ratios[f"cluster_router_vs_local_calls_per_s_{sfx}"] = round(cps["cluster_router"] / cps["local"], 3)
    ratios[f"_cluster_calls_per_s_{sfx}"] = cps["cluster"]
    if not n_lat:
        return
    lat = latency(pool, n_lat)
    for name, ms in lat.items():
        results.append({"name": name, "nodes": count, "concurrency": 1, "n": len(ms),
                        "p50_ms": round(percentile(ms, 50), 3), "p90_ms": round(percentile(ms, 90), 3),
                        "p99_ms": round(percentile(ms, 99), 3), "samples_ms": [round(x, 3) for x in ms]})
    p50 = {name: percentile(ms, 50) for name, ms in lat.items()}
    ratios[f"added_latency_p50_ms_{sfx}"] = round(p50["latency_cluster"] - p50["latency_local"], 3)
    ratios[f"added_latency_router_p50_ms_{sfx}"] = round(p50["latency_cluster_router"] - p50["latency_local"], 3)
    # the median of the per-round differences (each round's cluster call next to its local one):
    # less noisy than the difference of two medians on a loaded host
    paired = [cl - lo for cl, lo in zip(lat["latency_cluster"], lat["latency_local"], strict=True)]
    ratios[f"added_latency_paired_p50_ms_{sfx}"] = round(percentile(paired, 50), 3)
    ratios[f"latency_cluster_vs_local_p50_{sfx}"] = round(p50["latency_cluster"] / p50["latency_local"], 3)
    ratios[f"ray_path_p50_ms_{sfx}"] = round(p50["latency_ray_path"], 3)
    ratios[f"ray_router_path_p50_ms_{sfx}"] = round(p50["latency_ray_router_path"], 3)


CPU_CASES = ("local_arun", "cluster_run", "cluster_router_run", "cluster_map", "cluster_map_batch1",
             "cluster_router_map")


def _cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` in seconds (proc(5) ``stat`` fields 14-17:
    the reaped sandbox processes count in their parent's c-fields)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _cluster_processes(temp_dir: str, pool: Any) -> dict[int, str]:
    """Every process of the bench's cluster (its environment has ``RAY_TMPDIR=temp_dir``) by role."""
    import ray
    from ray_cluster import cluster_processes

    actors = {s["pid"] for s in pool.stats()}
    router = ray.get(pool._router.status.remote())["router_pid"]
    roles: dict[int, str] = {os.getpid(): "driver"}
    for pid, cmd in cluster_processes(temp_dir).items():
        roles[pid] = ("actor" if pid in actors else "router" if pid == router else "raylet" if "raylet" in cmd
                      else "gcs" if "gcs_server" in cmd else "other_ray")
    return roles


def cpu_per_call(pool: Any, temp_dir: str, n: int) -> dict[str, dict[str, float]]:
    """CPU milliseconds per call by process role (driver, router, actor incl. its sandboxes,
    raylet, gcs, other Ray processes) for each path, ``n`` calls each; robust to the host's load
    where wall time is not."""
    roles = _cluster_processes(temp_dir, pool)
    loop = asyncio.new_event_loop()

    def local() -> None:
        for _ in range(n):
            remove_workspace(loop.run_until_complete(lowlevel.arun(COMMAND)).workspace)

    import ray
    cases = {"local_arun": local,
             "cluster_run": lambda: [pool.run(COMMAND) for _ in range(n)],
             "cluster_router_run": lambda: [ray.get(pool.submit(COMMAND)) for _ in range(n)],
             "cluster_map": lambda: cluster_batch(pool, n),
             "cluster_map_batch1": lambda: list(pool.map([COMMAND] * n, batch=1)),
             "cluster_router_map": lambda: router_batch(pool, n)}
    out: dict[str, dict[str, float]] = {}
    try:
        for name in CPU_CASES:
            before = {pid: _cpu_s(pid) for pid in roles}
            cases[name]()
            per: dict[str, float] = {}
            for pid, role in roles.items():
                per[role] = per.get(role, 0.0) + (_cpu_s(pid) - before[pid]) * 1e3 / n
            per["total"] = sum(per.values())
            out[name] = {k: round(v, 3) for k, v in per.items()}
    finally:
        loop.close()
    return out


def host_info() -> dict[str, Any]:
    import ray

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    return {"kernel": platform.release(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "ray": ray.__version__, "lowlevel": lowlevel.__version__, "caller_is_root": os.geteuid() == 0,
            "load_avg_before": os.getloadavg()[0], "commit": commit, "date": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 calls per case, 1 round, 30 latency pairs")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    ap.add_argument("--calls", type=int, help="calls per throughput case and round (default 1000)")
    ap.add_argument("--rounds", type=int, help="rounds of the throughput cases (default 2; --quick 1)")
    ap.add_argument("--concurrency", type=int, default=4, help="sandboxes per node at once (default 4)")
    ap.add_argument("--latency-calls", type=int, help="sequential latency pairs (default 200; --quick 30)")
    ap.add_argument("--cpu-calls", type=int, help="calls per path of the CPU-per-call profile, on the largest "
                    "cluster (default 200; --quick 50; 0: skip)")
    ap.add_argument("--nodes", type=int, default=3, help="measure clusters of 1..N nodes (default 3)")
    ap.add_argument("--worker-niceness", type=int, default=0,
                    help="nice value of the Ray workers, hence of the actors and their sandboxes (Ray's own "
                         "default is 15; default here 0, the driver's, so both sides compete for the CPUs alike)")
    args = ap.parse_args(argv)
    n = args.calls or (200 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 2)
    n_lat = args.latency_calls if args.latency_calls is not None else (30 if args.quick else 200)
    c = args.concurrency
    if args.cpu_calls is None:
        args.cpu_calls = 50 if args.quick else 200

    import ray
    from ray_cluster import private_ray_cluster

    from lowlevel.ray import SandboxActorPool

    host = host_info()
    started = time.perf_counter()
    node_args = {"num_cpus": 1, "object_store_memory": 100 << 20}
    results: list[dict[str, Any]] = []
    ratios: dict[str, float | None] = {}
    cpu: dict[str, dict[str, float]] = {}
    # Every file of the cluster under one fresh temp root (not /tmp/ray), and every process of it
    # stopped at the end, also after a failed start: the tests' private cluster.
    with private_ray_cluster("llray-bench-", **node_args, include_dashboard=False,
                             _system_config={"worker_niceness": args.worker_niceness}) as cluster:
        temp_dir = os.environ["RAY_TMPDIR"]
        ray.init(address=cluster.address, log_to_driver=False)
        for count in range(1, args.nodes + 1):
            if count > 1:
                cluster.add_node(**node_args)
                cluster.wait_for_nodes()
            nodes = [nd["NodeID"] for nd in ray.nodes() if nd["Alive"]]
            with SandboxActorPool(nodes=nodes, concurrency=c, max_in_flight=2 * c) as pool:
                measure(pool, count, n, rounds, c, n_lat, results, ratios)
                if args.cpu_calls and count == args.nodes:
                    cpu = cpu_per_call(pool, temp_dir, args.cpu_calls)
    largest = _suffix(args.nodes)
    ratios["cluster_vs_local_calls_per_s"] = ratios[f"cluster_vs_local_calls_per_s_{largest}"]
    if n_lat:
        ratios["added_latency_p50_ms"] = ratios[f"added_latency_p50_ms_{largest}"]
        ratios["ray_path_p50_ms"] = ratios[f"ray_path_p50_ms_{largest}"]
    if args.nodes > 1:
        ratios[f"cluster_{largest}_vs_1node_calls_per_s"] = round(
            float(ratios[f"_cluster_calls_per_s_{largest}"] or 0) / float(ratios["_cluster_calls_per_s_1node"] or 1), 3)
    for key in [k for k in ratios if k.startswith("_")]:
        del ratios[key]
    doc = {"schema": SCHEMA, "results": results, "ratios": ratios, "cpu_ms_per_call": cpu, "targets": TARGETS,
           "host": host,
           "config": {"quick": args.quick, "calls": n, "rounds": rounds, "concurrency_per_node": c,
                      "latency_calls": n_lat, "nodes": args.nodes, "command": COMMAND,
                      "worker_niceness": args.worker_niceness,
                      "duration_s": round(time.perf_counter() - started, 1), "argv": sys.argv[1:]}}
    print(f"{'case':<24} {'nodes':>5} {'conc':>4} {'n':>6} {'calls/s':>9} {'p50 ms':>8} {'p90 ms':>8}")
    for r in results:
        cps = f"{r['calls_per_s']:.1f}" if "calls_per_s" in r else "-"
        print(f"{r['name']:<24} {r['nodes']:>5} {r['concurrency']:>4} {r['n']:>6} {cps:>9} "
              f"{r.get('p50_ms', '-'):>8} {r.get('p90_ms', '-'):>8}")
    for k, v in ratios.items():
        print(f"{k}: {v}")
    if cpu:
        roles = ["driver", "router", "actor", "raylet", "gcs", "other_ray", "total"]
        print(f"CPU ms per call ({args.nodes} nodes): " + " ".join(f"{r:>9}" for r in roles))
        for name, per in cpu.items():
            print(f"  {name:<22}" + " ".join(f"{per.get(r, 0.0):>9.2f}" for r in roles))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
