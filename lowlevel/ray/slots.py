"""The slot rules shared by the driver's fast path (:mod:`lowlevel.ray.direct`) and the router
(:mod:`lowlevel.ray.router`): :class:`Slot` (one sandbox actor and its load), :func:`least_loaded`
(which actor a call goes to), :func:`retries_exhausted` (when a call whose actors kept dying
is given up) and :func:`first_line` (how a death is recorded).

Both paths keep a table of their own (the driver's is guarded by a lock, the router's lives on
one event loop), but they choose and give up by the same rule, written here once.

Source: Ray docs "Fault Tolerance: Actors" (an actor that died fails its calls with
``RayActorError``; a fresh-sandbox call is idempotent, so it may be re-run elsewhere).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lowlevel._dataclass import dataclass
from lowlevel.ray.results import ClusterError


@dataclass
class Slot:
    """One sandbox actor as a dispatcher sees it.

    Attributes:
        key: the actor's key in the pool (``"<node_id>/<i>"``).
        handle: its Ray actor handle.
        node_id: the Ray node (hex) it runs on.
        capacity: calls this dispatcher sends it at once at most (``max_in_flight``).
        in_flight: calls this dispatcher has sent it that are not finished.
        dispatched: calls this dispatcher ever sent it (the tie-break of :func:`least_loaded`).
        alive: False once a call on it failed with the actor lost: never used again.
    """

    key: str
    handle: Any
    node_id: str
    capacity: int
    in_flight: int = 0
    dispatched: int = 0
    alive: bool = True


def least_loaded(slots: Iterable[Slot]) -> Slot | None:
    """The live slot with room (``in_flight < capacity``) whose load ``in_flight / capacity`` is
    least; ties go to the one dispatched to least, so sequential calls go round the nodes.
    None when every live slot is full or none is alive. Takes nothing: see :func:`take`."""
    best: Slot | None = None
    for s in slots:
        if s.alive and s.in_flight < s.capacity and (
                best is None or (s.in_flight / s.capacity, s.dispatched)
                < (best.in_flight / best.capacity, best.dispatched)):
            best = s
    return best


def take(slot: Slot, n: int = 1) -> None:
    """Count ``n`` more calls sent to ``slot`` (undone by ``slot.in_flight -= n`` when they end)."""
    slot.in_flight += n
    slot.dispatched += n


def first_line(err: BaseException) -> str:
    """``"<ExceptionType>: <first line of its message>"``: how a lost actor's error is recorded."""
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def retries_exhausted(lost_nodes: list[str], max_retries: int) -> ClusterError | None:
    """ClusterError ``"node_lost"`` once a call's actor died more than ``max_retries`` times
    (``lost_nodes``: the node of each actor that died under it), else None: re-run it."""
    if len(lost_nodes) > max_retries:
        return ClusterError(f"the call's sandbox actor died {len(lost_nodes)} times (nodes {lost_nodes}); "
                            f"max_retries={max_retries}", "node_lost")
    return None
