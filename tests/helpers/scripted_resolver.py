"""A scripted resolver for the egress tests (TEST ONLY; see lowlevel.net.egress_proxy.override_resolver_for_tests).

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

import socket
import threading
from collections.abc import Mapping, Sequence


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
