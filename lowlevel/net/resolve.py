"""Name resolution for the egress proxy: one lookup per request, bounded per run, and the check of its answers.

Concept: a name the policy allows is resolved once (``getaddrinfo``, in the proxy's resolver
threads) and the answers are checked (:func:`check_answers`: every one public and not one
of the host's own, :mod:`lowlevel.net.host_addresses`) before the proxy connects to exactly
those addresses, never to the name again (no DNS rebinding between check and connect).
Per run (:class:`RunLookups`): at most :data:`RESOLVE_PER_RUN` lookups hold resolver threads,
:data:`RESOLVE_QUEUE_PER_RUN` wait for one (more: ``503``), each request waits at most
:data:`RESOLVE_TIMEOUT_S` (then ``504``), and requests for a name and port whose lookup is
running share it; so a run whose names never resolve holds a few threads and cannot stall
another run. The process has at most :data:`RESOLVER_THREADS` resolver threads.

The one injection point: :data:`override` (a :class:`ResolverOverride`, None in production).

Sources: getaddrinfo(3); DNS rebinding: Jackson et al., "Protecting Browsers from DNS
Rebinding Attacks" (CCS 2007); asyncio docs (``wrap_future``, ``shield``, ``timeout``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import socket
import threading
from collections.abc import Callable, Sequence

from lowlevel._dataclass import dataclass
from lowlevel.net.host_addresses import host_addresses
from lowlevel.net.http_head import RefusedError
from lowlevel.spec.egress import Decision, Egress

#: How long one name resolution may take, seconds.
RESOLVE_TIMEOUT_S = 10.0
#: Name lookups one run may have running in the resolver threads at once. A lookup that timed
#: out for its request keeps its thread (a thread cannot be stopped) and its slot until the
#: resolver returns, so one run never holds more than this many threads, however many of its
#: lookups hang. Concurrent requests of one run for the same name and port share one lookup.
RESOLVE_PER_RUN = 4
#: Lookups one run may have waiting for one of its slots; beyond that a request gets ``503``.
RESOLVE_QUEUE_PER_RUN = 32
#: Resolver threads of the process (shared by all runs, started as needed); at least
#: ``RESOLVE_PER_RUN`` times the number of runs that may hang their lookups at once.
RESOLVER_THREADS = 64

#: ``resolver(name, port)``: numeric addresses in order, or None for the system resolver.
Resolver = Callable[[str, int], "Sequence[str] | None"]


@dataclass(frozen=True)
class ResolverOverride:
    """A replacement for the system resolver, in force through :data:`override`.

    Attributes:
        lookup: called in a resolver thread with the normalized name and the port; returns
            numeric addresses (str) in order, or None to ask the system resolver instead; may
            raise OSError (then the request gets 502).
        pretend_public: addresses that count as public when ``lookup`` returns them (so a
            test server on 127.0.0.1 can stand for a public host). IP literals and the system
            resolver's answers are never affected.
    """

    lookup: Resolver
    pretend_public: frozenset[str] = frozenset()


#: The injection point for a replacement resolver: None (the system resolver) in production,
#: always. Only the test suite sets it (``override_resolver`` in
#: tests/helpers/scripted_resolver.py), to give allowlisted names the addresses of servers on
#: host loopback. A listener takes the value in force when it is created (a run's whole life).
#: It is no Policy field, so no record, CLI flag, MCP request or environment variable can set
#: it; nothing inside a sandbox can reach it (the sandbox only speaks HTTP to the proxy); every
#: attempt made under it says ``resolver="test-override"`` and the run's notes say so.
override: ResolverOverride | None = None

_pool_lock = threading.Lock()
_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_pool_busy = 0  # lookups running in the pool's threads, every run's (under _pool_lock)


def _resolver_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's resolver threads (at most :data:`RESOLVER_THREADS`, made as needed)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                RESOLVER_THREADS, thread_name_prefix="lowlevel-egress-resolve"))
        return _pool[1]


def _take_pool_thread() -> bool:
    """Count one more lookup in the pool's threads; False when all of them are busy."""
    global _pool_busy
    with _pool_lock:
        if _pool_busy >= RESOLVER_THREADS:
            return False
        _pool_busy += 1
        return True


def _lookup_in_thread(resolver: Resolver | None, name: str, port: int) -> tuple[list[str], bool]:
    """One lookup, in a resolver thread: (answers, whether the override gave them); the
    override first (its None: the system's)."""
    global _pool_busy
    try:
        if resolver is not None:
            answers = resolver(name, port)
            if answers is not None:
                return [str(a) for a in answers], True
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        return [str(info[4][0]) for info in infos], False
    finally:
        with _pool_lock:
            _pool_busy -= 1


class RunLookups:
    """One run's name lookups (used in the loop thread only).

    Args:
        loop: the proxy's event loop.
        override: the :data:`override` in force when the run's listener was created.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, override: ResolverOverride | None) -> None:
        self.loop = loop
        self.override = override
        self.running = 0
        self.waiting = 0
        self.slots = asyncio.Semaphore(RESOLVE_PER_RUN)
        self.lookups: dict[tuple[str, int], asyncio.Future[tuple[list[str], bool]]] = {}

    async def resolve(self, name: str, port: int) -> tuple[list[str], frozenset[str]]:
        """Resolve ``name`` once: (unique addresses in order, those the override calls public).

        At most :data:`RESOLVE_PER_RUN` lookups of this run hold resolver threads (slots are
        given back when the thread returns, not when the request gives up), at most
        :data:`RESOLVE_QUEUE_PER_RUN` wait for a slot, each request waits at most
        :data:`RESOLVE_TIMEOUT_S` in all; requests for a name and port whose lookup is running
        share it.

        Raises:
            RefusedError: 503 (too many lookups of the run, or every resolver thread busy),
                504 (no answer in time), 502 (the resolver failed); the reason names the name.
        """
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                lookup = self.lookups.get((name, port))
                if lookup is None:
                    lookup = await self._start(name, port)
                answers, from_override = await asyncio.shield(lookup)
        except RefusedError as ref:
            raise RefusedError(ref.status, f"cannot resolve {name!r} now: {ref.reason}") from None
        except TimeoutError:
            raise RefusedError(504, f"cannot resolve {name!r}: no answer within {RESOLVE_TIMEOUT_S:g} s") from None
        except OSError as err:
            raise RefusedError(502, f"cannot resolve {name!r}: {err.strerror or err}") from None
        unique = list(dict.fromkeys(answers))
        if not from_override or self.override is None:
            return unique, frozenset()
        return unique, self.override.pretend_public & set(unique)

    async def _start(self, name: str, port: int) -> asyncio.Future[tuple[list[str], bool]]:
        """Wait for one of the run's slots and a resolver thread, and start the lookup there."""
        if self.slots.locked() and self.waiting >= RESOLVE_QUEUE_PER_RUN:
            raise RefusedError(503, f"too many name lookups of this run at once ({self.running} running, "
                               f"{self.waiting} waiting; at most {RESOLVE_PER_RUN} and {RESOLVE_QUEUE_PER_RUN}): "
                               "retry when they end")
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        if not _take_pool_thread():
            self.slots.release()
            raise RefusedError(503, f"all {RESOLVER_THREADS} resolver threads of the proxy are busy: retry later")
        self.running += 1
        resolver = self.override.lookup if self.override is not None else None
        future = _resolver_pool().submit(_lookup_in_thread, resolver, name, port)
        future.add_done_callback(self._lookup_done)
        lookup = asyncio.wrap_future(future, loop=self.loop)
        self.lookups[(name, port)] = lookup
        lookup.add_done_callback(functools.partial(self._lookup_forget, (name, port)))
        return lookup

    def _lookup_forget(self, key: tuple[str, int], lookup: asyncio.Future[tuple[list[str], bool]]) -> None:
        """A lookup ended (loop thread): later requests ask again; its exception counts as retrieved."""
        if self.lookups.get(key) is lookup:
            del self.lookups[key]
        if not lookup.cancelled():
            lookup.exception()

    def _lookup_done(self, _future: concurrent.futures.Future[tuple[list[str], bool]]) -> None:
        """A resolver thread returned (in that thread): give the run's slot back in the loop."""
        def release() -> None:
            self.running -= 1
            self.slots.release()
        with contextlib.suppress(RuntimeError):  # the loop is gone (interpreter exit)
            self.loop.call_soon_threadsafe(release)


def check_answers(egress: Egress, name: str, addresses: Sequence[str], pretend_public: frozenset[str]) -> Decision:
    """:meth:`Egress.check_addresses` on a name's answers with the host's own addresses
    (:func:`lowlevel.net.host_addresses.host_addresses`, read now); an allowed answer that
    only the override's ``pretend_public`` made public says so in its reason."""
    checked = egress.check_addresses(name, addresses, host_addresses=host_addresses(),
                                     assume_public=pretend_public)
    if checked.allowed and pretend_public:
        return Decision(True, f"{name!r} resolves to addresses the test resolver calls public", name,
                        checked.address)
    return checked


__all__ = ["RESOLVER_THREADS", "RESOLVE_PER_RUN", "RESOLVE_QUEUE_PER_RUN", "RESOLVE_TIMEOUT_S", "Resolver",
           "ResolverOverride", "RunLookups", "check_answers", "override"]
