"""The driver's view: :class:`SandboxActorPool` (the actors, the router, submit/map/run) and
:class:`RemoteSession` (a session on one node of the pool).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lowlevel.errors import PolicyError, SessionError
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Policy
from lowlevel.ray.actor import SandboxActor
from lowlevel.ray.direct import Dispatcher, MapState, OneCall
from lowlevel.ray.inputs import pack_inputs
from lowlevel.ray.router import _Router
from lowlevel.ray.results import (DEFAULT_MAX_INPUT_BYTES, DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_START_TIMEOUT_S,
    INLINE_INPUT_BYTES, LOST, UNSET, Call, ClusterError, NodeStatus, RemoteResult, check_command, log, unwrap_error)


class SandboxActorPool:
    """A pool of sandbox actors across the nodes of a Ray cluster (needs ``ray.init()`` first).

    One actor per alive node (``cpus_per_actor=None``), or ``max(1, node CPUs //
    cpus_per_actor)`` per node. Each actor checks its node at start (``lowlevel doctor``
    and a trial run of ``policy``): a node that fails is reported by :meth:`nodes` and gets
    no calls. :meth:`run`, :meth:`arun`, :meth:`map` and :meth:`amap` send each call from
    the driver straight to the least loaded live actor (``map``: in batches), at most
    ``max_in_flight`` per actor, and re-run the calls of an actor that died
    (:mod:`lowlevel.ray.direct`). :meth:`submit` goes through a router actor on the driver's
    node, which does the same with its own ``max_in_flight`` per actor (the rest wait in the
    router, holding only a reference to their inputs), and takes the fast path's calls when
    every direct slot is taken: an actor holds at most ``2 * max_in_flight`` calls when both
    paths are in use at once.

    Args:
        policy: the default :class:`lowlevel.Policy` for calls and sessions; each node must
            be able to run it. Default ``Policy()``.
        cpus_per_actor: None for one actor per node, else one per this many CPUs of a node.
        concurrency: sandboxes one actor runs at once (its :class:`lowlevel.Runner`'s
            ``max_concurrency``); default ``max(2, 2 * CPUs)`` of the actor's share.
        max_in_flight: calls sent to one actor at once (running plus queued in the actor) by
            each path (the driver's, the router's); default ``2 * concurrency``.
        max_retries: how many times a call is re-run after the actor holding it died.
        nodes: restrict to these Ray node ids (hex); default every alive node.
        max_input_bytes: cap on one call's packed inputs.
        max_output_bytes: cap on the changed files' contents one call carries back.
        workspace_base: parent of the nodes' workspaces (default ``/tmp/lowlevel-<uid>``
            on each node, or ``$LOWLEVEL_WORKSPACE_BASE`` there).
        actor_options: extra ``.options(...)`` for the sandbox actors (e.g. ``num_cpus=4``
            to reserve CPUs in Ray's accounting; default ``num_cpus=0``: sandboxes are not
            Ray tasks, size ``concurrency`` instead).
        start_timeout: seconds to wait for the actors' start checks.
    Raises:
        PolicyError: a bad argument.
        ClusterError: ``reason="start"`` when no node passed its checks (the message lists
            each node's reason); ``RuntimeError`` when Ray is not initialised.
    """

    def __init__(self, policy: Policy | None = None, *, cpus_per_actor: float | None = None,
                 concurrency: int | None = None, max_in_flight: int | None = None, max_retries: int = 3,
                 nodes: Sequence[str] | None = None, max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
                 max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES, workspace_base: str | None = None,
                 actor_options: Mapping[str, Any] | None = None,
                 start_timeout: float = DEFAULT_START_TIMEOUT_S) -> None:
        if not ray.is_initialized():
            raise RuntimeError("SandboxActorPool needs a Ray connection: call ray.init() (or ray.init(address=...)) "
                               "first")
        if policy is not None and not isinstance(policy, Policy):
            raise PolicyError(f"policy must be a lowlevel.Policy, got {type(policy).__name__}")
        for name, value in (("concurrency", concurrency), ("max_in_flight", max_in_flight)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PolicyError(f"{name} must be an int >= 1 or None, got {value!r}")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise PolicyError(f"max_retries must be an int >= 0, got {max_retries!r}")
        for name, value in (("max_input_bytes", max_input_bytes), ("max_output_bytes", max_output_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PolicyError(f"{name} must be a byte count >= 0, got {value!r}")
        if cpus_per_actor is not None and not (isinstance(cpus_per_actor, (int, float)) and cpus_per_actor > 0):
            raise PolicyError(f"cpus_per_actor must be a number > 0 or None, got {cpus_per_actor!r}")
        self.policy = policy or Policy()
        self.max_input_bytes = max_input_bytes
        self.max_output_bytes = max_output_bytes
        self.max_retries = max_retries
        self._concurrency = concurrency
        self._max_in_flight = max_in_flight
        self._cpus_per_actor = cpus_per_actor
        self._workspace_base = workspace_base
        self._actor_options = dict(actor_options or {})
        self._start_timeout = start_timeout
        self._only_nodes = set(nodes) if nodes is not None else None
        self._policy_keys: dict[Policy, str] = {}
        self._default_key: str | None = None
        self._actors: dict[str, tuple[Any, str]] = {}      # key -> (handle, node_id)
        self._node_info: dict[str, NodeStatus] = {}
        self._sessions: set[RemoteSession] = set()
        self._closed = False
        # The router lives and dies with the driver's node (hard affinity: Ray's soft affinity
        # may place it elsewhere, and the driver would then lose every call in flight with a
        # node it does not even use).
        driver_node = ray.get_runtime_context().get_node_id()
        self._router = ray.remote(_Router).options(
            num_cpus=0, max_concurrency=100_000, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=driver_node, soft=False),
        ).remote(max_retries)
        self._direct = Dispatcher(self._router, max_retries)
        self._actor_cls = ray.remote(SandboxActor)
        try:
            self.refresh()
            if not self._actors:
                why = "; ".join(f"node {s.node_id[:12]}: {s.reason}" for s in self._node_info.values())
                raise ClusterError("no node can run sandboxes for this pool: " + (why or "no alive node"), "start")
        except BaseException:
            self.shutdown()
            raise

    # -- membership --------------------------------------------------------------------------
    def _policy_key(self, policy: Policy) -> str:
        """The key calls carry instead of the Policy (19 KB pickled for the default one).

        A new Policy value is registered once with the router, which hands it to every
        actor before this returns (one blocking round trip per distinct Policy); a call
        then names it by key, so the Policy is never pickled per call. The pool's own
        Policy object skips the lookup (hashing a Policy walks every field).
        """
        if policy is self.policy and self._default_key is not None:
            return self._default_key
        key = self._policy_keys.get(policy)
        if key is None:
            key = f"p{len(self._policy_keys)}"
            ray.get(self._router.add_policy.remote(key, policy))
            self._policy_keys[policy] = key
        if policy is self.policy:
            self._default_key = key
        return key

    def refresh(self) -> list[NodeStatus]:
        """Start actors on alive nodes that have none yet (new nodes of an autoscaling cluster).

        Returns:
            The status of the nodes examined this time (see :meth:`nodes`).
        """
        if self._closed:
            raise ClusterError("the pool is shut down", "closed")
        have = {node for _, node in self._actors.values()} | set(self._node_info)
        pending: list[tuple[str, Any, str, int, Any]] = []
        addresses: dict[str, str] = {}
        key = self._policy_key(self.policy)
        for node in ray.nodes():
            node_id = node["NodeID"]
            if not node.get("Alive") or node_id in have:
                continue
            if self._only_nodes is not None and node_id not in self._only_nodes:
                continue
            addresses[node_id] = node.get("NodeManagerAddress", "")
            cpus = float(node.get("Resources", {}).get("CPU", 1.0))
            count = 1 if self._cpus_per_actor is None else max(1, int(cpus // self._cpus_per_actor))
            share = cpus if self._cpus_per_actor is None else min(cpus, float(self._cpus_per_actor))
            concurrency = self._concurrency or max(2, min(64, int(2 * share)))
            in_flight = self._max_in_flight or 2 * concurrency
            config = {"concurrency": concurrency, "max_output_bytes": self.max_output_bytes,
                      "workspace_base": self._workspace_base}
            options = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 10_000,
                       **self._actor_options,
                       "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}
            for i in range(count):
                handle = self._actor_cls.options(**options).remote(config)
                pending.append((f"{node_id}/{i}", handle, node_id, in_flight, handle.start.remote(key, self.policy)))
        examined: dict[str, NodeStatus] = {}
        ready: list[tuple[str, Any, str, int]] = []
        deadline = time.monotonic() + self._start_timeout
        for akey, handle, node_id, in_flight, start_ref in pending:
            try:
                report = ray.get(start_ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as err:  # noqa: BLE001 - the node is reported, not used
                report = {"ok": False, "reason": f"actor did not start: {type(unwrap_error(err)).__name__}: "
                          f"{str(unwrap_error(err)).splitlines()[0] if str(unwrap_error(err)) else ''}", "doctor": None}
            if report["ok"]:
                ready.append((akey, handle, node_id, in_flight))
                self._actors[akey] = (handle, node_id)
            else:
                log.warning("lowlevel.ray: node %s not used: %s", node_id, report["reason"])
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            prev = examined.get(node_id)
            actors = (prev.actors if prev else 0) + (1 if report["ok"] else 0)
            reason = report["reason"] if not report["ok"] else (prev.reason if prev else "")
            examined[node_id] = NodeStatus(node_id, addresses.get(node_id, ""), actors > 0, actors,
                                           "" if actors else reason, report.get("doctor"))
        if ready:
            ray.get(self._router.add.remote(ready))
            self._direct.add(ready)
        self._node_info.update(examined)
        return list(examined.values())

    def nodes(self) -> list[NodeStatus]:
        """Every node the pool examined: used (``ok``) or not, with the reason.

        A node whose actors died since shows ``ok=False`` and ``reason="lost: ..."``.
        """
        status = ray.get(self._router.status.remote())
        self._direct.sync_lost(key for key, _, is_alive, *_ in status["actors"] if not is_alive)
        alive: dict[str, int] = {}
        for _, node_id, is_alive, *_ in status["actors"]:
            alive[node_id] = alive.get(node_id, 0) + (1 if is_alive else 0)
        out = []
        for node_id, info in self._node_info.items():
            if info.ok and alive.get(node_id, 0) == 0:
                info = dataclasses.replace(info, ok=False, actors=0,
                                           reason="lost: " + status["lost"].get(node_id, "actor died"))
            elif info.ok:
                info = dataclasses.replace(info, actors=alive[node_id])
            out.append(info)
        return out

    def stats(self) -> list[dict[str, Any]]:
        """Each live actor's counters (:meth:`SandboxActor.stats`)."""
        refs = [handle.stats.remote() for handle, _ in self._actors.values()]
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=30))
            except Exception:  # noqa: BLE001 - a dead actor has no stats
                pass
        return out

    # -- calls -------------------------------------------------------------------------------
    def _spec(self, command: Sequence[str], policy: Policy | None, limits: Limits | None, stdin: bytes | None,
              timeout: Any, env: Mapping[str, str] | None, cwd: str | None) -> dict[str, Any]:
        if self._closed:
            raise ClusterError("the pool is shut down", "closed")
        if policy is not None and not isinstance(policy, Policy):
            raise PolicyError(f"policy must be a lowlevel.Policy, got {type(policy).__name__}")
        policy = policy or self.policy
        if limits is not None:
            if not isinstance(limits, Limits):
                raise PolicyError(f"limits must be a lowlevel.Limits, got {type(limits).__name__}")
            policy = dataclasses.replace(policy, limits=limits)
        if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
            raise PolicyError(f"stdin must be bytes or None, got {type(stdin).__name__}")
        if stdin is not None and len(stdin) > self.max_input_bytes:
            raise PolicyError(f"stdin is {len(stdin)} bytes > max_input_bytes={self.max_input_bytes}")
        if timeout is not UNSET and timeout is not None and \
                (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
            raise PolicyError(f"timeout must be seconds > 0 or None, got {timeout!r}")
        spec: dict[str, Any] = {"command": check_command(command), "policy_key": self._policy_key(policy),
                                "stdin": bytes(stdin) if stdin is not None else None,
                                "env": dict(env) if env else None, "cwd": cwd}
        if timeout is not UNSET:
            spec["timeout"] = timeout
        return spec

    def _inputs(self, inputs: Any) -> Any:
        """``None``, inline tar bytes, or an ObjectRef of tar bytes."""
        if inputs is None:
            return None
        if isinstance(inputs, ray.ObjectRef):
            return inputs
        data = pack_inputs(inputs, max_bytes=self.max_input_bytes)
        return data if len(data) <= INLINE_INPUT_BYTES else ray.put(data)

    def put_inputs(self, inputs: Any) -> Any:
        """Pack ``inputs`` (as :func:`pack_inputs`) and put them in the object store once.

        Pass the returned ObjectRef as ``inputs=`` to many calls (the same repository for a
        thousand tasks): each node fetches it once.
        """
        return ray.put(pack_inputs(inputs, max_bytes=self.max_input_bytes))

    def submit(self, command: Sequence[str], *, policy: Policy | None = None, inputs: Any = None,
               stdin: bytes | None = None, timeout: float | None = UNSET, limits: Limits | None = None,
               env: Mapping[str, str] | None = None, cwd: str | None = None) -> Any:
        """Run ``command`` in a fresh sandbox on some node; return ``ObjectRef[RemoteResult]`` at once.

        ``ray.get(ref)`` (or ``await ref`` in asyncio) gives the :class:`RemoteResult`, or
        raises a ``RayTaskError`` that is also the lowlevel exception (``ExecError``,
        ``LaunchError``, :class:`ClusterError`...); :meth:`run` and :meth:`arun` raise the
        lowlevel exception itself.

        Args:
            command: program and arguments as seen inside the sandbox.
            policy: this call's Policy (default: the pool's). Sent to each node once.
            inputs: files for the fresh workspace: ``{path: bytes}``, a list of host paths
                on the driver, tar bytes, or an ObjectRef from :meth:`put_inputs`.
            stdin: bytes for the program's stdin (at most ``max_input_bytes``).
            timeout: wall-clock seconds, as :func:`lowlevel.run` (default its default);
                a timed-out call is a Result (``timed_out=True``), never re-run.
            limits: this call's :class:`lowlevel.Limits` (replaces the Policy's).
            env, cwd: as :func:`lowlevel.run` (``cwd`` None: the Policy's working directory).
        Raises (at once, nothing sent):
            PolicyError: a bad argument, inputs over ``max_input_bytes``.
            WorkspaceError: a host path in ``inputs`` is missing.
            ClusterError: the pool is shut down.
        """
        spec = self._spec(command, policy, limits, stdin, timeout, env, cwd)
        box = self._inputs(inputs)
        return self._via_router(spec, box)

    def _via_router(self, spec: dict[str, Any], box: Any, lost_before: tuple[str, ...] = ()) -> Any:
        return self._router.submit.remote(spec, [box] if box is not None else [], lost_before)

    def _prepare(self, command: Sequence[str], policy: Policy | None = None, inputs: Any = None,
                 stdin: bytes | None = None, timeout: float | None = UNSET, limits: Limits | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | None = None) -> tuple[dict[str, Any], Any]:
        """The checked ``(spec, inputs box)`` of one call (as :meth:`submit` checks them)."""
        return self._spec(command, policy, limits, stdin, timeout, env, cwd), self._inputs(inputs)

    def run(self, command: Sequence[str], **kwargs: Any) -> RemoteResult:
        """Run one call and wait; raises the lowlevel exception itself (not Ray's wrapper).

        Arguments, Result and errors as :meth:`submit`; the call goes straight from this
        driver to the least loaded live actor (one Ray hop each way, not the router's two:
        :mod:`lowlevel.ray.direct`), is re-run elsewhere when that actor dies (at most
        ``max_retries`` times, then :class:`ClusterError` ``"node_lost"``), and waits in the
        router when every actor already holds ``max_in_flight`` direct calls.
        """
        call = self._one_call(command, kwargs)
        while True:
            ref = call.send()
            try:
                return call.done(ray.get(ref))
            except BaseException as err:  # noqa: BLE001 - judged in one place: OneCall.failed re-raises
                call.failed(ref, err)  # returns: the actor died, send the call again

    async def arun(self, command: Sequence[str], **kwargs: Any) -> RemoteResult:
        """:meth:`run` for an asyncio driver (awaits the ObjectRef; the loop is never blocked).

        Cancelling the awaiting task cancels the call on its actor (``ray.cancel``).
        """
        call = self._one_call(command, kwargs)
        while True:
            ref = call.send()
            try:
                return call.done(await ref)
            except BaseException as err:  # noqa: BLE001 - judged in one place: OneCall.failed re-raises
                call.failed(ref, err)  # returns: the actor died, send the call again

    def _one_call(self, command: Sequence[str], kwargs: dict[str, Any]) -> OneCall:
        spec, box = self._prepare(command, **kwargs)
        return OneCall(self._direct, spec, box, self._via_router)

    def _check_open(self) -> None:
        if self._closed:
            raise ClusterError("the pool is shut down", "closed")

    def _ping(self) -> str:
        """The fast path of a call without the sandbox (driver -> actor and back): for the bench."""
        slot, _ = self._direct.acquire()
        if slot is None:
            raise ClusterError("no free sandbox actor", "no_nodes")
        try:
            node: str = ray.get(slot.handle.ping.remote())
        finally:
            self._direct.release(slot)
        return node

    def _item(self, item: Any, defaults: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """One call of map/amap (a command or a :class:`Call`) as ``(spec, box)``."""
        if isinstance(item, Call):
            kw = dict(defaults)
            for f in dataclasses.fields(Call):
                value = getattr(item, f.name)
                if f.name != "command" and value is not None and value is not UNSET:
                    kw[f.name] = value
            if item.timeout is None:
                kw["timeout"] = None
            return self._prepare(item.command, **kw)
        return self._prepare(item, **defaults)

    def _map_state(self, calls: Iterable[Sequence[str] | Call], ordered: bool, batch: int | None,
                   return_exceptions: bool, defaults: dict[str, Any]) -> MapState:
        self._check_open()
        if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
            raise PolicyError(f"batch must be an int >= 1 or None, got {batch!r}")
        if batch is None:
            caps = [s.capacity for s in self._direct.slots.values() if s.alive]
            batch = max(1, (min(caps) + 1) // 2) if caps else 1
        return MapState(self._direct, iter(enumerate(calls)), lambda item: self._item(item, defaults),
                        self._via_router, self._direct.capacity(), batch, return_exceptions, ordered)

    def map(self, calls: Iterable[Sequence[str] | Call], *, ordered: bool = True, return_exceptions: bool = False,
            batch: int | None = None, **defaults: Any) -> Iterator[RemoteResult | BaseException]:
        """Run many calls with backpressure; yield their Results (in order, or as they finish).

        At most the pool's total in-flight capacity (``max_in_flight`` x live actors) is
        submitted at a time: inputs are packed and put in the object store only when a
        call's turn comes, so a million-call iterable costs memory for the window only.
        Calls go straight to the actors (as :meth:`run`), up to ``batch`` calls in one Ray
        task (default ``ceil(max_in_flight / 2)``: two batches in flight per actor), each
        re-run elsewhere when its actor dies.

        Args:
            calls: commands (lists of str) or :class:`Call` objects.
            ordered: yield in the order of ``calls`` (True) or of completion (False).
            return_exceptions: yield a call's exception instead of raising it (the lowlevel
                exception, unwrapped); otherwise the first failure raises and the calls
                still in flight are cancelled.
            batch: calls per actor task at most (1: one task per call).
            defaults: :meth:`submit` arguments for every call (``policy``, ``inputs``,
                ``timeout``, ``limits``, ``env``, ``stdin``, ``cwd``).
        Raises:
            PolicyError: a bad argument (``batch``, or a call's, when its turn comes).
        """
        state = self._map_state(calls, ordered, batch, return_exceptions, defaults)
        try:
            while not state.over():
                state.fill()
                if state.pending:
                    ready, _ = ray.wait(list(state.pending), num_returns=1)
                    for ref in ready:
                        state.settle(ref, functools.partial(ray.get, ref))
                yield from state.ready()
        finally:
            state.cancel_all()

    async def amap(self, calls: Iterable[Sequence[str] | Call], *, ordered: bool = True,
                   return_exceptions: bool = False, batch: int | None = None,
                   **defaults: Any) -> AsyncIterator[RemoteResult | BaseException]:
        """:meth:`map` for an asyncio driver: ``async for result in pool.amap(...)``."""
        state = self._map_state(calls, ordered, batch, return_exceptions, defaults)
        futs: dict[asyncio.Future[Any], Any] = {}
        try:
            while not state.over():
                for ref in state.fill():
                    futs[asyncio.wrap_future(ref.future())] = ref
                if futs:
                    finished, _ = await asyncio.wait(list(futs), return_when=asyncio.FIRST_COMPLETED)
                    for fut in finished:
                        state.settle(futs.pop(fut), fut.result)
                for r in state.ready():
                    yield r
        finally:
            state.cancel_all()
            for fut in futs:
                fut.cancel()

    # -- sessions ----------------------------------------------------------------------------
    def open_session(self, policy: Policy | None = None, *, inputs: Any = None, node_id: str | None = None,
                     idle_timeout: float | None = None, total_timeout: float | None = None,
                     track_changes: bool = True) -> "RemoteSession":
        """Start a :class:`lowlevel.Session` on one node; its calls all go to that node's actor.

        Args:
            policy: the session's Policy (default the pool's).
            inputs: files for the session's workspace (as :meth:`submit`).
            node_id: pin to this node (hex id); default the live actor with fewest sessions.
            idle_timeout, total_timeout: as :class:`lowlevel.Session`.
            track_changes: each Result carries the files the command added or modified.
        Raises:
            ClusterError: no live actor (on ``node_id``).
            SessionError: ``reason="node_lost"`` when the node died during the start.
            PolicyError, WorkspaceError, LaunchError, UnsupportedError: as :class:`lowlevel.Session`.
        """
        if self._closed:
            raise ClusterError("the pool is shut down", "closed")
        policy = policy or self.policy
        status = ray.get(self._router.status.remote())
        alive_keys = {key for key, _, alive, *_ in status["actors"] if alive}
        candidates = [(key, handle, node) for key, (handle, node) in self._actors.items()
                      if key in alive_keys and (node_id is None or node == node_id)]
        if not candidates:
            raise ClusterError("no live sandbox actor" + (f" on node {node_id}" if node_id else ""), "no_nodes")
        load: dict[str, int] = {}
        for s in self._sessions:
            load[s._actor_key] = load.get(s._actor_key, 0) + 1
        key, handle, node = min(candidates, key=lambda c: load.get(c[0], 0))
        pkey = self._policy_key(policy)
        packed = pack_inputs(inputs, max_bytes=self.max_input_bytes) if inputs is not None and \
            not isinstance(inputs, ray.ObjectRef) else inputs
        options = {"idle_timeout": idle_timeout, "total_timeout": total_timeout, "track_changes": track_changes}
        try:
            sid = ray.get(handle.session_open.remote(pkey, packed, options))
        except ray.exceptions.RayActorError as err:
            raise SessionError(f"the session's node {node} was lost while it started: {err}", "node_lost") from None
        except ray.exceptions.RayError as err:
            raise unwrap_error(err) from None
        session = RemoteSession(self, key, handle, node, sid)
        self._sessions.add(session)
        return session

    # -- lifecycle ---------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Close every session, cancel calls in flight, kill the actors; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._direct.closed = True
        for s in list(self._sessions):
            s._closed = True
        self._sessions.clear()
        try:
            ray.get(self._router.close.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - best effort
            pass
        refs = [handle.shutdown.remote() for handle, _ in self._actors.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for handle, _ in self._actors.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        try:
            ray.kill(self._router, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        self._actors.clear()

    close = shutdown

    def __enter__(self) -> "SandboxActorPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> "SandboxActorPool":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.shutdown)


class RemoteSession:
    """A :class:`lowlevel.Session` on one node of the pool (from :meth:`SandboxActorPool.open_session`).

    Every call goes to the same actor, hence the same sandbox and workspace. Nothing is
    re-run elsewhere: when the node's actor dies, each call raises
    :class:`lowlevel.SessionError` with ``reason="node_lost"``.

    Attributes:
        node_id: the node the session lives on.
    """

    def __init__(self, pool: SandboxActorPool, actor_key: str, handle: Any, node_id: str, sid: str) -> None:
        self._pool = pool
        self._actor_key = actor_key
        self._handle = handle
        self.node_id = node_id
        self._sid = sid
        self._closed = False

    def _spec(self, command: Sequence[str], stdin: bytes | None, timeout: Any, env: Mapping[str, str] | None,
              cwd: str | None, limits: Limits | None, track_changes: bool | None) -> dict[str, Any]:
        if self._closed:
            raise SessionError("the session is closed", "closed")
        if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
            raise PolicyError(f"stdin must be bytes or None, got {type(stdin).__name__}")
        if limits is not None and not isinstance(limits, Limits):
            raise PolicyError(f"limits must be a lowlevel.Limits, got {type(limits).__name__}")
        spec: dict[str, Any] = {"command": check_command(command), "stdin": bytes(stdin) if stdin else stdin,
                                "env": dict(env) if env else None, "cwd": cwd, "limits": limits,
                                "track_changes": track_changes}
        if timeout is not UNSET:
            spec["timeout"] = timeout
        return spec

    def _lost(self, err: BaseException) -> SessionError:
        self._closed = True
        self._pool._sessions.discard(self)
        return SessionError(f"the session's node {self.node_id} was lost: {type(err).__name__}", "node_lost")

    def submit(self, command: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = UNSET,
               env: Mapping[str, str] | None = None, cwd: str | None = None, limits: Limits | None = None,
               track_changes: bool | None = None) -> Any:
        """Send one command; return ``ObjectRef[RemoteResult]`` (Ray's errors unconverted: prefer :meth:`run`)."""
        return self._handle.session_run.remote(self._sid, self._spec(command, stdin, timeout, env, cwd, limits,
                                                                     track_changes))

    def run(self, command: Sequence[str], **kwargs: Any) -> RemoteResult:
        """Run one command in the session and wait (arguments as :meth:`lowlevel.Session.run`).

        Raises:
            SessionError: ``"node_lost"`` (the node's actor died), ``"closed"``, or the
                session's own reasons (``"init_died"``...).
            ExecError, LaunchError, PolicyError: as :meth:`lowlevel.Session.run`.
        """
        ref = self.submit(command, **kwargs)
        try:
            result: RemoteResult = ray.get(ref)
        except LOST as err:
            raise self._lost(err) from None
        except ray.exceptions.RayError as err:
            raise unwrap_error(err) from None
        return result

    async def arun(self, command: Sequence[str], **kwargs: Any) -> RemoteResult:
        """:meth:`run` for an asyncio driver."""
        ref = self.submit(command, **kwargs)
        try:
            result: RemoteResult = await ref
        except LOST as err:
            raise self._lost(err) from None
        except ray.exceptions.RayError as err:
            raise unwrap_error(err) from None
        return result

    def read_file(self, relpath: str, max_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> bytes:
        """One regular file of the session's workspace (as :func:`lowlevel.workspace.read_file`)."""
        if self._closed:
            raise SessionError("the session is closed", "closed")
        try:
            data: bytes = ray.get(self._handle.session_read.remote(self._sid, relpath, max_bytes))
        except LOST as err:
            raise self._lost(err) from None
        except ray.exceptions.RayError as err:
            raise unwrap_error(err) from None
        return data

    def close(self) -> None:
        """End the session on its node and remove its workspace; idempotent (a lost node is fine)."""
        if self._closed:
            return
        self._closed = True
        self._pool._sessions.discard(self)
        try:
            ray.get(self._handle.session_close.remote(self._sid), timeout=60)
        except Exception:  # noqa: BLE001 - the node may be gone; nothing left to close then
            pass

    def __enter__(self) -> "RemoteSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
