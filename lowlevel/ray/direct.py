"""The driver's fast path to the sandbox actors: :class:`Dispatcher` (slots per actor, kept in the
driver) and :class:`MapState` (the batched dispatch of :meth:`SandboxActorPool.map` / ``amap``).

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

import collections
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions

from lowlevel.ray.results import LOST, ClusterError, RemoteResult, log, unwrap_error


@dataclass
class DirectSlot:
    """One sandbox actor as the driver sees it: ``in_flight`` of ``capacity`` direct calls."""

    key: str
    handle: Any
    node_id: str
    capacity: int
    in_flight: int = 0
    dispatched: int = 0
    alive: bool = True


def _first_line(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


class Dispatcher:
    """The driver's slot table over the pool's sandbox actors (thread-safe: one lock, held only
    for the bookkeeping, never across a Ray call).

    Args:
        router: the pool's router actor handle (told of each death seen here).
        max_retries: re-runs of a call after the actor holding it died.
    """

    def __init__(self, router: Any, max_retries: int) -> None:
        self.router = router
        self.max_retries = max_retries
        self.slots: dict[str, DirectSlot] = {}
        self.lock = threading.Lock()
        self.closed = False   # the pool is shutting down: its actors die on purpose

    def add(self, entries: Iterable[tuple[str, Any, str, int]]) -> None:
        """Take ``(key, handle, node_id, capacity)`` actors into rotation."""
        with self.lock:
            for key, handle, node_id, capacity in entries:
                self.slots[key] = DirectSlot(key, handle, node_id, capacity)

    def capacity(self) -> int:
        """Direct calls the live actors accept at once (at least 1)."""
        with self.lock:
            return max(1, sum(s.capacity for s in self.slots.values() if s.alive))

    def any_alive(self) -> bool:
        with self.lock:
            return any(s.alive for s in self.slots.values())

    def acquire(self, want: int = 1) -> tuple[DirectSlot | None, int]:
        """Take up to ``want`` units of the least loaded live actor with room (ties: the one
        dispatched to least, so sequential calls go round the nodes); ``(None, 0)`` when every
        live actor is full or none is alive."""
        with self.lock:
            best: DirectSlot | None = None
            for s in self.slots.values():
                if s.alive and s.in_flight < s.capacity and (
                        best is None or (s.in_flight / s.capacity, s.dispatched)
                        < (best.in_flight / best.capacity, best.dispatched)):
                    best = s
            if best is None:
                return None, 0
            n = min(want, best.capacity - best.in_flight)
            best.in_flight += n
            best.dispatched += n
            return best, n

    def release(self, slot: DirectSlot, n: int = 1) -> None:
        with self.lock:
            slot.in_flight -= n

    def mark_lost(self, slot: DirectSlot, err: BaseException) -> None:
        """``slot``'s actor died: never use it again here, and tell the router (fire and forget)."""
        with self.lock:
            was_alive, slot.alive = slot.alive, False
        if was_alive and not self.closed:
            log.warning("lowlevel.ray: sandbox actor on node %s lost: %s", slot.node_id, err)
            try:
                self.router.mark_lost.remote(slot.key, _first_line(err))
            except Exception:  # noqa: BLE001 - the router gone means the pool is shutting down
                pass

    def sync_lost(self, dead_keys: Iterable[str]) -> None:
        """Mark the actors the router found dead (its ``status()``) dead here too."""
        with self.lock:
            for key in dead_keys:
                if key in self.slots:
                    self.slots[key].alive = False

    def check_retry(self, lost_nodes: list[str]) -> None:
        """Raise ClusterError ``"node_lost"`` once a call's actor died more than ``max_retries`` times."""
        if len(lost_nodes) > self.max_retries:
            raise ClusterError(f"the call's sandbox actor died {len(lost_nodes)} times (nodes {lost_nodes}); "
                               f"max_retries={self.max_retries}", "node_lost")


def finish(result: RemoteResult, lost_nodes: list[str]) -> RemoteResult:
    """Stamp how many attempts a call took (as the router does)."""
    result.attempts = len(lost_nodes) + 1
    result.lost_nodes = tuple(lost_nodes)
    return result


@dataclass
class _Item:
    index: int
    spec: dict[str, Any]
    box: Any
    lost: list[str]


@dataclass
class _Sent:
    items: list[_Item]
    slot: DirectSlot | None      # None: sent through the router (it retries and releases itself)
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
        closed: ``() -> bool``, the pool was shut down.
    """

    def __init__(self, dispatcher: Dispatcher, calls: Iterator[tuple[int, Any]],
                 prepare: Callable[[Any], tuple[dict[str, Any], Any]],
                 via_router: Callable[[dict[str, Any], Any, tuple[str, ...]], Any], window: int, batch: int,
                 return_exceptions: bool, closed: Callable[[], bool]) -> None:
        self.d = dispatcher
        self.calls = calls
        self.prepare = prepare
        self.via_router = via_router
        self.window = window
        self.batch = max(1, batch)
        self.return_exceptions = return_exceptions
        self.closed = closed
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

    def _send(self, items: list[_Item], slot: DirectSlot | None) -> Any:
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
            if self.closed():
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

    def finished(self, ref: Any, value: Any, err: BaseException | None) -> None:
        """Account for a finished task: ``value`` its return, or ``err`` what getting it raised."""
        sent = self.pending.pop(ref)
        self.sent_calls -= len(sent.items)
        if sent.slot is not None:
            self.d.release(sent.slot, len(sent.items))
        if err is not None and self.closed():
            raise ClusterError("the pool is shut down", "closed")  # its shutdown cancelled or killed the call
        if err is not None and sent.slot is not None and isinstance(err, LOST):
            self.d.mark_lost(sent.slot, err)
            for item in sent.items:
                item.lost.append(sent.slot.node_id)
                try:
                    self.d.check_retry(item.lost)
                except ClusterError as gave_up:
                    self._outcome(item.index, gave_up)
                    continue
                self.retry.append(item)
            return
        if err is not None:
            exc = unwrap_error(err)
            for item in sent.items:
                self._outcome(item.index, exc)
            return
        values = value if sent.batch else [value]
        for item, v in zip(sent.items, values, strict=True):
            self._outcome(item.index, finish(v, item.lost) if isinstance(v, RemoteResult) and sent.slot else v)

    def ready(self, ordered: bool, next_out: int) -> tuple[list[RemoteResult | BaseException], int]:
        """The outcomes to yield now, and the next index an ordered map waits for."""
        out: list[RemoteResult | BaseException] = []
        if ordered:
            while next_out in self.done:
                out.append(self.done.pop(next_out))
                next_out += 1
        else:
            out = list(self.done.values())
            self.done.clear()
        return out, next_out

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

