"""The driver's fast path to the sandbox actors: :class:`Dispatcher` (slots per actor, kept in the
driver, and what a failed call means), :class:`OneCall` (the attempts of one
:meth:`SandboxActorPool.run` / ``arun``) and :class:`MapState` (the batched dispatch of
:meth:`SandboxActorPool.map` / ``amap``). The sync and async drivers in :mod:`lowlevel.ray.pool`
only wait; every decision (which slot, which errors re-run a call, how often, which actor is
dropped) is made here, with the slot and the choice of :mod:`lowlevel.ray.slots` that the
router uses too.

Why: through the router a call crosses two Ray hops each way (driver -> router -> actor); the
router's share alone cost 4.5 ms of CPU per call on this 2-vCPU host (bench/README.md,
"cluster.py"). The driver already holds every actor's handle, so :meth:`SandboxActorPool.run`,
``arun``, ``map`` and ``amap`` call the actor directly (one hop) and keep their own slot count,
at most ``max_in_flight`` per actor. The router stays for :meth:`SandboxActorPool.submit` (an
ObjectRef that survives its actor's death needs someone to re-run it), for the record of lost
actors (this path reports each death it sees: :meth:`Dispatcher.mark_lost`), and for a call that
finds every direct slot taken (it waits in the router, holding only a reference to its inputs).

Faults are handled as the router handles them: an actor whose call fails with
``RayActorError``/``ObjectLostError`` is marked dead and never used again, and the call (a
fresh sandbox: idempotent) is re-run on another live actor up to ``max_retries`` times; past
that :class:`ClusterError` ``"node_lost"``. The sandbox itself runs in the actor exactly as on
the router path (same :meth:`SandboxActor.run`): only who picks the actor changed.

Batching (``map``/``amap``): Ray has no call-level batching of actor tasks, so a batch is one
actor task, :meth:`SandboxActor.run_batch`, carrying up to ``batch`` calls; the actor runs them
concurrently through its Runner and returns one list. The per-task costs (submission,
(de)serialisation, the actor's event-loop hand-off) are paid once per batch.

Source: Ray docs "Actors" (handles are passable, tasks of one caller run in order),
"Fault Tolerance: Actors" (``RayActorError``), "Tips for first-time users" (batch small tasks).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions

from lowlevel.ray.results import LOST, ClusterError, RemoteResult, log, unwrap_error
from lowlevel.ray.slots import Slot, first_line, least_loaded, retries_exhausted, take


class Dispatcher:
    """The driver's slot table over the pool's sandbox actors (thread-safe: one lock, held only
    for the bookkeeping, never across a Ray call), and the rule for a failed call that
    ``run``, ``arun``, ``map`` and ``amap`` share (:meth:`verdict`, :meth:`rerun`).

    Args:
        router: the pool's router actor handle (told of each death seen here).
        max_retries: re-runs of a call after the actor holding it died.
    """

    def __init__(self, router: Any, max_retries: int) -> None:
        self.router = router
        self.max_retries = max_retries
        self.slots: dict[str, Slot] = {}
        self.lock = threading.Lock()
        self.closed = False   # the pool is shutting down: its actors die on purpose

    def add(self, entries: Iterable[tuple[str, Any, str, int]]) -> None:
        """Take ``(key, handle, node_id, capacity)`` actors into rotation."""
        with self.lock:
            for key, handle, node_id, capacity in entries:
                self.slots[key] = Slot(key, handle, node_id, capacity)

    def capacity(self) -> int:
        """Direct calls the live actors accept at once (at least 1)."""
        with self.lock:
            return max(1, sum(s.capacity for s in self.slots.values() if s.alive))

    def any_alive(self) -> bool:
        with self.lock:
            return any(s.alive for s in self.slots.values())

    def acquire(self, want: int = 1) -> tuple[Slot | None, int]:
        """Take up to ``want`` units of the least loaded live actor with room
        (:func:`lowlevel.ray.slots.least_loaded`); ``(None, 0)`` when every live actor is full
        or none is alive."""
        with self.lock:
            best = least_loaded(self.slots.values())
            if best is None:
                return None, 0
            n = min(want, best.capacity - best.in_flight)
            take(best, n)
            return best, n

    def release(self, slot: Slot, n: int = 1) -> None:
        with self.lock:
            slot.in_flight -= n

    def mark_lost(self, slot: Slot, err: BaseException) -> None:
        """``slot``'s actor died: never use it again here, and tell the router (fire and forget)."""
        with self.lock:
            was_alive, slot.alive = slot.alive, False
        if was_alive and not self.closed:
            log.warning("lowlevel.ray: sandbox actor on node %s lost: %s", slot.node_id, err)
            try:
                self.router.mark_lost.remote(slot.key, first_line(err))
            except Exception:  # noqa: BLE001 - the router gone means the pool is shutting down
                pass

    def sync_lost(self, dead_keys: Iterable[str]) -> None:
        """Mark the actors the router found dead (its ``status()``) dead here too."""
        with self.lock:
            for key in dead_keys:
                if key in self.slots:
                    self.slots[key].alive = False

    def verdict(self, slot: Slot | None, err: BaseException) -> BaseException | None:
        """What a call that failed with Ray error ``err`` on ``slot`` (None: sent through the
        router, which retries by itself) means.

        Returns:
            None when ``slot``'s actor is lost (``RayActorError``/``ObjectLostError``): it is
            marked dead (here and in the router) and the call may be re-run on another
            actor (:meth:`rerun` says whether it still may); otherwise the lowlevel exception
            the caller gets (``err`` unwrapped).
        Raises:
            ClusterError: ``"closed"`` when the pool is shut down (its shutdown cancelled or
                killed the call).
        """
        lost = slot is not None and isinstance(err, LOST)
        if lost and slot is not None:
            self.mark_lost(slot, err)
        if self.closed:
            raise ClusterError("the pool is shut down", "closed")
        return None if lost else unwrap_error(err)

    def rerun(self, lost_nodes: list[str], slot: Slot) -> ClusterError | None:
        """Count ``slot``'s node in a call's ``lost_nodes``; None: re-run it, else the
        ClusterError ``"node_lost"`` it ends with (past ``max_retries``)."""
        lost_nodes.append(slot.node_id)
        return retries_exhausted(lost_nodes, self.max_retries)


def finish(result: RemoteResult, lost_nodes: list[str]) -> RemoteResult:
    """Stamp how many attempts a call took (as the router does)."""
    result.attempts = len(lost_nodes) + 1
    result.lost_nodes = tuple(lost_nodes)
    return result


class OneCall:
    """The attempts of one :meth:`SandboxActorPool.run` / ``arun`` call: where each goes and what
    its end means. The sync and async drivers only wait for the ObjectRef::

        while True:
            ref = call.send()
            try:
                return call.done(ray.get(ref))     # or: await ref
            except BaseException as err:
                call.failed(ref, err)              # raises, or returns: send again

    Args:
        dispatcher: the pool's slot table.
        spec, box: the call's checked spec and inputs (sent as they are at every attempt).
        via_router: ``(spec, box, lost_nodes) -> ObjectRef`` (the router's ``submit``).
    """

    def __init__(self, dispatcher: Dispatcher, spec: dict[str, Any], box: Any,
                 via_router: Callable[[dict[str, Any], Any, tuple[str, ...]], Any]) -> None:
        self.d = dispatcher
        self.spec = spec
        self.box = box
        self.via_router = via_router
        self.lost: list[str] = []
        self.slot: Slot | None = None

    def send(self) -> Any:
        """Send the call to the least loaded live actor with room; when every slot is taken (or
        every actor is dead), through the router (it queues the call, or says ``no_nodes``)."""
        self.slot, _ = self.d.acquire()
        if self.slot is None:
            return self.via_router(self.spec, self.box, tuple(self.lost))
        return self.slot.handle.run.remote(self.spec, self.box)

    def _free(self) -> Slot | None:
        slot, self.slot = self.slot, None
        if slot is not None:
            self.d.release(slot)
        return slot

    def done(self, result: RemoteResult) -> RemoteResult:
        """The attempt's Result (stamped with the attempts when it went direct)."""
        return result if self._free() is None else finish(result, self.lost)

    def failed(self, ref: Any, err: BaseException) -> None:
        """Getting ``ref`` raised ``err``. Returns when the call is to be sent again (its actor
        died, retries are left); raises otherwise: the lowlevel exception, ClusterError
        ``"node_lost"``/``"closed"``, or ``err`` itself when it is not Ray's (the driver was
        cancelled or interrupted; an ``asyncio.CancelledError`` cancels the call, ``ray.cancel``)."""
        slot = self.slot
        try:
            if not isinstance(err, ray.exceptions.RayError):
                if isinstance(err, asyncio.CancelledError):
                    ray.cancel(ref)
                raise err
            why = self.d.verdict(slot, err)
            if why is None and slot is not None:
                why = self.d.rerun(self.lost, slot)
            if why is not None:
                raise why from None
        finally:
            self._free()


@dataclass
class _Item:
    index: int
    spec: dict[str, Any]
    box: Any
    lost: list[str]


@dataclass
class _Sent:
    items: list[_Item]
    slot: Slot | None      # None: sent through the router (it retries and releases itself)
    batch: bool


class MapState:
    """The dispatch of one ``map``/``amap``: which calls go where, in batches, and what each
    finished task means. The sync and async drivers only wait (``ray.wait`` / ``asyncio.wait``).

    Args:
        dispatcher: the pool's slot table.
        calls: ``enumerate``-d calls, each turned into ``(spec, box)`` by ``prepare`` only when
            its turn comes (inputs are packed then, never all at once).
        prepare: ``item -> (spec, box)``; raises PolicyError etc. (not caught: as ``submit``).
        via_router: ``(spec, box, lost_nodes) -> ObjectRef`` (the router's ``submit``).
        window: calls in flight plus finished-but-not-yielded at most.
        batch: calls per actor task at most.
        return_exceptions: keep a call's exception as its outcome instead of raising it.
        ordered: :meth:`ready` gives the outcomes in the order of ``calls`` (else as they end).
    """

    def __init__(self, dispatcher: Dispatcher, calls: Iterator[tuple[int, Any]],
                 prepare: Callable[[Any], tuple[dict[str, Any], Any]],
                 via_router: Callable[[dict[str, Any], Any, tuple[str, ...]], Any], window: int, batch: int,
                 return_exceptions: bool, ordered: bool) -> None:
        self.d = dispatcher
        self.calls = calls
        self.prepare = prepare
        self.via_router = via_router
        self.window = window
        self.batch = max(1, batch)
        self.return_exceptions = return_exceptions
        self.ordered = ordered
        self.next_out = 0   # ordered: the index the caller waits for
        self.exhausted = False
        self.retry: collections.deque[_Item] = collections.deque()
        self.pending: dict[Any, _Sent] = {}
        self.done: dict[int, RemoteResult | BaseException] = {}
        self.sent_calls = 0

    def _outcome(self, index: int, value: RemoteResult | BaseException) -> None:
        if isinstance(value, BaseException) and not self.return_exceptions:
            raise value
        self.done[index] = value

    def _take(self, n: int, new_ok: bool) -> list[_Item]:
        out: list[_Item] = []
        while len(out) < n and self.retry:
            out.append(self.retry.popleft())
        while new_ok and len(out) < n and not self.exhausted:
            try:
                index, item = next(self.calls)
            except StopIteration:
                self.exhausted = True
                break
            spec, box = self.prepare(item)
            out.append(_Item(index, spec, box, []))
        return out

    def _send(self, items: list[_Item], slot: Slot | None) -> Any:
        if slot is None:
            ref = self.via_router(items[0].spec, items[0].box, tuple(items[0].lost))
        elif len(items) == 1:
            ref = slot.handle.run.remote(items[0].spec, items[0].box)
        else:
            # the inputs as top-level arguments: Ray resolves ObjectRefs there (not inside a list)
            ref = slot.handle.run_batch.remote([i.spec for i in items], *[i.box for i in items])
        self.pending[ref] = _Sent(items, slot, slot is not None and len(items) > 1)
        self.sent_calls += len(items)
        return ref

    def fill(self) -> list[Any]:
        """Send what the window and the free slots allow; return the new ObjectRefs.

        A call to re-run (its actor died) goes first and regardless of the window (it was
        counted in it when first sent): an ordered map may be waiting for exactly that one.
        """
        new: list[Any] = []
        while True:
            room = self.window - self.sent_calls - len(self.done)
            new_ok = not self.exhausted and room > 0
            if not self.retry and not new_ok:
                break
            if self.d.closed:
                raise ClusterError("the pool is shut down", "closed")
            slot, n = self.d.acquire(min(self.batch, max(room, len(self.retry))))
            if slot is None and self.pending:
                break  # every slot taken: wait for one of ours
            items = self._take(n if slot is not None else 1, new_ok)
            if slot is not None and len(items) < n:
                self.d.release(slot, n - len(items))
            if not items:
                break
            # slot None and nothing of ours in flight: other callers hold the slots (or every
            # actor is dead): the router queues the call, or says no_nodes
            new.append(self._send(items, slot))
        return new

    def settle(self, ref: Any, get: Callable[[], Any]) -> None:
        """Account for the finished task ``ref``; ``get()`` gives its return (``ray.get``, a done
        future's ``result``) or raises the Ray error that ended it."""
        try:
            value, err = get(), None
        except ray.exceptions.RayError as exc:
            value, err = None, exc
        self.finished(ref, value, err)

    def finished(self, ref: Any, value: Any, err: BaseException | None) -> None:
        """Account for a finished task: ``value`` its return, or ``err`` what getting it raised
        (judged by :meth:`Dispatcher.verdict`: its calls re-run, or end with the exception)."""
        sent = self.pending.pop(ref)
        self.sent_calls -= len(sent.items)
        if sent.slot is not None:
            self.d.release(sent.slot, len(sent.items))
        if err is not None:
            why = self.d.verdict(sent.slot, err)
            for item in sent.items:
                gave_up = why if why is not None or sent.slot is None else self.d.rerun(item.lost, sent.slot)
                if gave_up is None:
                    self.retry.append(item)
                else:
                    self._outcome(item.index, gave_up)
            return
        values = value if sent.batch else [value]
        for item, v in zip(sent.items, values, strict=True):
            self._outcome(item.index, finish(v, item.lost) if isinstance(v, RemoteResult) and sent.slot else v)

    def ready(self) -> list[RemoteResult | BaseException]:
        """The outcomes to yield now."""
        out: list[RemoteResult | BaseException] = []
        if self.ordered:
            while self.next_out in self.done:
                out.append(self.done.pop(self.next_out))
                self.next_out += 1
        else:
            out = list(self.done.values())
            self.done.clear()
        return out

    def over(self) -> bool:
        return self.exhausted and not self.retry and not self.pending and not self.done

    def cancel_all(self) -> None:
        for ref, sent in list(self.pending.items()):
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - already finished or its actor is gone
                pass
            if sent.slot is not None:
                self.d.release(sent.slot, len(sent.items))
        self.pending.clear()

