"""A run's record of its connection attempts through the egress proxy.

Concept: every connection a sandbox opens through the proxy is one :class:`Attempt`, mutable
while it runs (the decision, the address, the bytes each way, what ended it) and frozen into
a :class:`lowlevel.spec.egress.NetworkAttempt` for :attr:`lowlevel.Result.network`. A run's
:class:`AttemptLog` keeps at most :data:`MAX_ATTEMPTS` of them (later ones are counted, for a
note), appended in the proxy's loop thread and read from the caller's. :func:`describe_attempt`
is the one-line form logs and the CLI show.
"""

from __future__ import annotations

import threading

from lowlevel.spec.egress import Decision, NetworkAttempt

#: Attempts recorded per run; later ones are counted in a note.
MAX_ATTEMPTS = 10_000


class Attempt:
    """A connection attempt while it runs (mutable, loop thread; see :class:`NetworkAttempt`
    for the fields; ``up``/``down`` are its ``bytes_up``/``bytes_down``)."""

    __slots__ = ("method", "host", "port", "address", "allowed", "reason", "up", "down", "error", "resolver")

    def __init__(self, method: str, host: str, port: int, resolver: str) -> None:
        self.method, self.host, self.port = method, host, port
        self.address: str | None = None
        self.allowed = False
        self.reason = ""
        self.up = self.down = 0
        self.error: str | None = None
        self.resolver = resolver

    def decided(self, d: Decision) -> None:
        """Take a decision's verdict, reason, normalized host and (when it names one) address."""
        self.host = d.host
        self.allowed = d.allowed
        self.reason = d.reason
        if d.address is not None:
            self.address = d.address

    def refused(self, reason: str) -> None:
        """Mark the attempt refused, with ``reason``."""
        self.allowed = False
        self.reason = reason

    def freeze(self) -> NetworkAttempt:
        """The attempt as it is now, immutable."""
        return NetworkAttempt(method=self.method, host=self.host, port=self.port, address=self.address,
                              allowed=self.allowed, reason=self.reason, bytes_up=self.up, bytes_down=self.down,
                              error=self.error, resolver=self.resolver)


class AttemptLog:
    """The attempts of one run, in order (at most :data:`MAX_ATTEMPTS`; ``dropped`` counts the rest).

    Args:
        resolver: what every attempt says answered its lookups: ``"system"`` or
            ``"test-override"`` (:data:`lowlevel.net.resolve.override` was set).
    """

    def __init__(self, resolver: str) -> None:
        self.resolver = resolver
        self.lock = threading.Lock()
        self.attempts: list[Attempt] = []
        self.dropped = 0

    def __len__(self) -> int:
        """Attempts recorded so far (the index the next one gets)."""
        return len(self.attempts)

    def record(self, method: str, host: str, port: int) -> Attempt:
        """A new attempt, recorded when there is room (it is returned either way)."""
        attempt = Attempt(method, host, port, self.resolver)
        with self.lock:
            if len(self.attempts) < MAX_ATTEMPTS:
                self.attempts.append(attempt)
            else:
                self.dropped += 1
        return attempt

    def since(self, index: int) -> tuple[tuple[NetworkAttempt, ...], int]:
        """The attempts recorded from ``index`` on (running ones as they are now), and the next index."""
        with self.lock:
            current = list(self.attempts[index:])
        return tuple(a.freeze() for a in current), index + len(current)


def describe_attempt(a: NetworkAttempt) -> str:
    """One line for logs and the CLI: ``"CONNECT pypi.org:443 -> 151.101.0.223 allowed (matches ...)"``."""
    host = a.host if a.host.isprintable() else repr(a.host)[1:-1]  # a refused name may hold C0/C1 controls
    where = f"{host}:{a.port}" + (f" -> {a.address}" if a.address else "")
    verdict = "allowed" if a.allowed else "DENIED"
    extra = f", {a.bytes_up} B up, {a.bytes_down} B down" if a.allowed else ""
    err = f", {a.error}" if a.error else ""
    return f"{a.method} {where} {verdict} ({a.reason}{extra}{err})"


__all__ = ["MAX_ATTEMPTS", "Attempt", "AttemptLog", "describe_attempt"]
