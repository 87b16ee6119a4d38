"""Run sandboxed calls across a Ray cluster: :class:`SandboxActorPool` (``pip install '.[ray]'`` in the checkout).

In Ray's terms (``ray.util.ActorPool``): a pool of actors, one per node (or one per
``cpus_per_actor`` CPUs), each holding a :class:`lowlevel.Runner` with bounded concurrency.
``run``/``arun``/``map``/``amap`` call the actors straight from the driver (one Ray hop each
way; ``map`` several calls per actor task: :mod:`lowlevel.ray.direct`); a router actor on the
driver's node serves ``submit`` (an ObjectRef whose call is re-run if its actor dies), keeps the
record of lost actors, and queues the calls that find every direct slot taken. The core package
never imports Ray; only this module does.

::

    import ray, lowlevel
    from lowlevel.ray import SandboxActorPool

    ray.init(address="auto")
    with SandboxActorPool(lowlevel.Policy()) as pool:
        ref = pool.submit(["python3", "main.py"], inputs={"main.py": b"print(6 * 7)"}, timeout=10)
        result = ray.get(ref)                      # a RemoteResult (a lowlevel.Result)
        result.stdout, result.node_id, result.files, result.attempts
        for r in pool.map([["python3", "-c", f"print({i})"] for i in range(1000)]):
            ...
        with pool.open_session() as s:             # one sandbox, pinned to one node
            s.run(["git", "init"]); s.run(["git", "status"])

Data flow: a call's inputs travel as bytes (a tar archive, GNU format, at most
``max_input_bytes``) through Ray's object store, never as host paths: the node may not have
them. On the node the actor unpacks them into a fresh workspace (fd-relative, no symlink
followed, no ``..``, only regular files, directories and symlinks, no setuid bits), runs the
command with :meth:`lowlevel.Runner.run`, reads back the files the run added or modified
(regular files only, at most ``max_output_bytes`` in all: :attr:`RemoteResult.files`, with
``files_truncated`` / ``files_dropped_bytes`` / ``files_omitted`` like stdout's truncation
report), and removes the workspace. The Result also names the node (``node_id``).

Faults (Ray's own fault-tolerance vocabulary):
    - A sandbox actor that dies (its node lost, its raylet killed, the worker crashed) fails
      its in-flight calls with ``RayActorError``; the driver (fast path) or the router
      (``submit``) marks the actor dead (for both), never uses it again, and re-runs each
      of those calls on another live actor, up to
      ``max_retries`` times. A fresh-sandbox call is idempotent (fresh workspace, inputs
      shipped with the call), so a re-run is safe; the Result says so: ``attempts`` > 1,
      ``lost_nodes`` lists the nodes that died under it. Past ``max_retries``:
      :class:`ClusterError` ``reason="node_lost"``.
    - A call whose sandbox timed out is a Result with ``timed_out=True``: it is returned
      as is, never re-run. Only the death of the actor holding it re-runs a call.
    - A session lives in one sandbox on one node: when that node's actor dies, every call
      on it raises :class:`lowlevel.SessionError` with ``reason="node_lost"`` (never re-run
      elsewhere: the session's state is gone).
    - A node whose host cannot run the pool's Policy (``lowlevel doctor`` fails a required
      check, or a trial run with the Policy fails) is reported by :meth:`SandboxActorPool.nodes`
      and gets no calls.

Policies are values: each distinct :class:`lowlevel.Policy` is pickled (unchanged) to each
actor once per pool, through the router, and calls name it by a short key (the default
Policy pickles to ~19 KB and takes ~1 ms to unpickle: not a per-call cost); the actor compiles
its seccomp filter once (the per-process cache of :func:`lowlevel.host.seccomp_filter.compile_bpf`), at
start for the pool's Policy.

Sources: Ray docs "Actors", "AsyncIO / Concurrency for Actors", "Fault Tolerance: Actors"
(``RayActorError``, ``max_restarts``/``max_task_retries``), "Scheduling"
(``NodeAffinitySchedulingStrategy``), ``ray.util.ActorPool``; tar(5) (GNU format).
"""

from __future__ import annotations

try:
    import ray  # noqa: F401 - the check: every module of this package needs Ray
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError("lowlevel.ray needs Ray: pip install '.[ray]' in the lowlevel checkout") from _err

from lowlevel.ray.actor import SandboxActor  # noqa: E402
from lowlevel.ray.inputs import collect_outputs, pack_inputs, unpack_inputs  # noqa: E402
from lowlevel.ray.pool import RemoteSession, SandboxActorPool  # noqa: E402
from lowlevel.ray.results import (DEFAULT_MAX_INPUT_BYTES, DEFAULT_MAX_OUTPUT_BYTES, Call, ClusterError,  # noqa: E402
                                  NodeStatus, RemoteResult)

__all__ = ["DEFAULT_MAX_INPUT_BYTES", "DEFAULT_MAX_OUTPUT_BYTES", "Call", "ClusterError", "NodeStatus",
           "RemoteResult", "RemoteSession", "SandboxActor", "SandboxActorPool", "collect_outputs", "pack_inputs",
           "unpack_inputs"]
