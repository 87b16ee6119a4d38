"""The router actor of a pool (one, on the driver's node): spreads the fresh-sandbox calls of
:meth:`SandboxActorPool.submit` over the live sandbox actors and re-runs the calls of an actor that died;
it also keeps the pool's record of lost actors (the driver's fast path, :mod:`lowlevel.ray.direct`,
reports the deaths it sees here with :meth:`_Router.mark_lost`) and takes the calls the fast path has no
free slot for.

Source: Ray docs "Fault Tolerance: Actors" (``RayActorError``).
"""

from __future__ import annotations

import asyncio
import collections
import os
from typing import Any

import ray
import ray.exceptions

from lowlevel.spec.policy import Policy
from lowlevel.ray.results import LOST, ClusterError, RemoteResult, log
from lowlevel.ray.slots import Slot, first_line, least_loaded, retries_exhausted, take


class _Router:
    """Spreads fresh-sandbox calls over the live actors (least loaded first, at most
    ``capacity`` in flight per actor) and re-runs the calls of an actor that died.

    Runs on one event loop (an async actor): slot bookkeeping needs no lock, only the
    waiters for a free slot are parked on futures.
    """

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries
        self.slots: dict[str, Slot] = {}
        self.policies: dict[str, Policy] = {}
        self.lost: dict[str, str] = {}
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closed = False

    def _wake(self, everyone: bool = False) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                if not everyone:
                    return

    async def add(self, entries: list[tuple[str, Any, str, int]]) -> None:
        """Take new actors into rotation, after giving them every registered Policy."""
        sent: set[str] = set()
        while todo := [k for k in self.policies if k not in sent]:  # add_policy may run meanwhile
            await asyncio.gather(*(handle.add_policy.remote(k, self.policies[k]) for _, handle, _, _ in entries
                                   for k in todo), return_exceptions=True)
            sent.update(todo)
        for key, handle, node_id, capacity in entries:  # no await since the check: none missed
            self.slots[key] = Slot(key, handle, node_id, capacity)
        self._wake(everyone=True)

    async def add_policy(self, key: str, policy: Policy) -> None:
        """Register a Policy with every live actor (once per Policy value per pool).

        An actor that cannot take it (dead) is left to the next call to find out.
        """
        if key in self.policies:
            return
        self.policies[key] = policy
        live = [s for s in self.slots.values() if s.alive]
        await asyncio.gather(*(s.handle.add_policy.remote(key, policy) for s in live), return_exceptions=True)

    async def status(self) -> dict[str, Any]:
        return {"actors": [(s.key, s.node_id, s.alive, s.in_flight, s.capacity, s.dispatched)
                           for s in self.slots.values()], "lost": dict(self.lost),
                "router_node": ray.get_runtime_context().get_node_id(), "router_pid": os.getpid()}

    async def close(self) -> None:
        self.closed = True
        self._wake(everyone=True)

    async def _acquire(self) -> Slot:
        while True:
            if self.closed:
                raise ClusterError("the pool is shut down", "closed")
            best = least_loaded(self.slots.values())
            if best is not None:
                take(best)
                return best
            if not any(s.alive for s in self.slots.values()):
                raise ClusterError("no healthy sandbox actor is left in the pool"
                                   + (f" (lost: {self.lost})" if self.lost else ""), "no_nodes")
            fut = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake()  # pass the wake-up on: this waiter no longer wants the slot
                raise

    def _release(self, slot: Slot) -> None:
        slot.in_flight -= 1
        self._wake()

    def _mark_lost(self, slot: Slot, err: BaseException | str) -> None:
        if slot.alive:
            slot.alive = False
            self.lost[slot.node_id] = err if isinstance(err, str) else first_line(err)
            log.warning("lowlevel.ray: sandbox actor on node %s lost: %s", slot.node_id, err)
            try:
                ray.kill(slot.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._wake(everyone=True)

    async def mark_lost(self, key: str, why: str) -> None:
        """The driver's fast path saw actor ``key`` die (``why``: the error's first line): never use it again.

        No await inside: a later call from the driver (``status``) sees it done (Ray runs one
        caller's actor tasks in submission order).
        """
        slot = self.slots.get(key)
        if slot is not None:
            self._mark_lost(slot, why)

    async def ping(self) -> str:
        """The path of a call without the sandbox (driver -> router -> actor and back): for the bench."""
        slot = await self._acquire()
        try:
            node: str = await slot.handle.ping.remote()
            return node
        finally:
            self._release(slot)

    async def submit(self, spec: dict[str, Any], inputs_box: list[Any],
                     lost_before: tuple[str, ...] = ()) -> RemoteResult:
        """Run one call on the least loaded live actor (waiting for a free slot); re-run it
        elsewhere when its actor dies. ``lost_before``: nodes whose actor already died under this
        call on the driver's fast path (they count against ``max_retries``)."""
        lost_nodes: list[str] = list(lost_before)
        while True:
            slot = await self._acquire()
            ref = slot.handle.run.remote(spec, inputs_box[0] if inputs_box else None)
            try:
                result: RemoteResult = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            except LOST as err:
                self._mark_lost(slot, err)
                lost_nodes.append(slot.node_id)
                gave_up = retries_exhausted(lost_nodes, self.max_retries)
                if gave_up is not None:
                    raise gave_up from None
                continue
            except ray.exceptions.RayTaskError as err:
                cause = getattr(err, "cause", None)
                if isinstance(cause, BaseException):
                    raise cause from None
                raise
            finally:
                self._release(slot)
            result.attempts = len(lost_nodes) + 1
            result.lost_nodes = tuple(lost_nodes)
            return result
