"""A scripted resolver for the egress tests, and :func:`override_resolver`, which puts a resolver in force.

``with override_resolver(resolver, pretend_public=("127.0.0.1",)):`` sets the egress proxy's one
injection point, :data:`lowlevel.net.resolve.override`, for the runs started inside (each
listener takes the value in force when it is created), and restores the previous value after.
Attempts made under it carry ``resolver="test-override"`` and the run's notes say so.

``ScriptedResolver({"pypi.test": ["127.0.0.1"], "rebind.test": [["127.0.0.1"], ["127.0.0.2"]]})``
answers each name from the table: a list of addresses answers every call alike; a list of lists
answers the n-th call with the n-th list (the last one from then on), as a DNS-rebinding server
would. Names not in the table go to the system resolver (``None``). ``calls`` counts lookups per name.

``blocking=(".never.test",)``: names ending so never answer: each lookup waits (holding its
resolver thread) until ``release`` is set, then fails as an unknown name would
(``socket.gaierror``); ``blocked`` counts the lookups waiting now. Set ``release`` before the
process ends, or its resolver threads never finish.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from lowlevel.net import resolve


@contextlib.contextmanager
def override_resolver(resolver: Callable[[str, int], Sequence[str] | None], *,
                      pretend_public: Sequence[str] = ()) -> Iterator[None]:
    """Answer the egress proxy's name lookups with ``resolver(name, port)`` in this process.

    Args:
        resolver: called in a resolver thread with the normalized name and the port; returns
            numeric addresses (str) in order, or None to ask the system resolver instead; may
            raise OSError (then the request gets 502).
        pretend_public: addresses that count as public when ``resolver`` returns them (so a
            test server on 127.0.0.1 can stand for a public host). IP literals and the system
            resolver's answers are never affected.
    """
    previous = resolve.override
    resolve.override = resolve.ResolverOverride(resolver, frozenset(pretend_public))
    try:
        yield
    finally:
        resolve.override = previous


class ScriptedResolver:
    def __init__(self, answers: Mapping[str, Sequence[object]], blocking: Sequence[str] = ()) -> None:
        self.answers = {k: list(v) for k, v in answers.items()}
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()
        self.blocking = tuple(blocking)
        self.release = threading.Event()
        self.blocked = 0

    def __call__(self, name: str, port: int) -> list[str] | None:
        if self.blocking and name.endswith(self.blocking):
            with self.lock:
                self.calls[name] = self.calls.get(name, 0) + 1
                self.blocked += 1
            try:
                self.release.wait()
            finally:
                with self.lock:
                    self.blocked -= 1
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        with self.lock:
            if name not in self.answers:
                return None
            n = self.calls.get(name, 0)
            self.calls[name] = n + 1
            table = self.answers[name]
            if table and isinstance(table[0], (list, tuple)):
                return [str(a) for a in table[min(n, len(table) - 1)]]  # type: ignore[union-attr]
            return [str(a) for a in table]
