"""A scripted resolver for the egress tests (TEST ONLY; see lowlevel.egress_proxy.override_resolver_for_tests).

``ScriptedResolver({"pypi.test": ["127.0.0.1"], "rebind.test": [["127.0.0.1"], ["127.0.0.2"]]})``
answers each name from the table: a list of addresses answers every call alike; a list of lists
answers the n-th call with the n-th list (the last one from then on), as a DNS-rebinding server
would. Names not in the table go to the system resolver (``None``). ``calls`` counts lookups per name.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence


class ScriptedResolver:
    def __init__(self, answers: Mapping[str, Sequence[object]]) -> None:
        self.answers = {k: list(v) for k, v in answers.items()}
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, name: str, port: int) -> list[str] | None:
        with self.lock:
            if name not in self.answers:
                return None
            n = self.calls.get(name, 0)
            self.calls[name] = n + 1
            table = self.answers[name]
            if table and isinstance(table[0], (list, tuple)):
                return [str(a) for a in table[min(n, len(table) - 1)]]  # type: ignore[union-attr]
            return [str(a) for a in table]
