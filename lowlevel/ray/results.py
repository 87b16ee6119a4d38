"""What :mod:`lowlevel.ray` calls exchange: :class:`Call`, :class:`RemoteResult`, :class:`NodeStatus`,
:class:`ClusterError`, the defaults, and Ray's errors told apart (an actor lost, or the call's own error).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

import ray
import ray.exceptions

from lowlevel._dataclass import dataclass
from lowlevel.errors import LowlevelError, PolicyError
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Policy
from lowlevel.sandbox.result import Result


log = logging.getLogger("lowlevel.ray")

#: Default cap on one call's packed inputs (bytes of the tar archive).
DEFAULT_MAX_INPUT_BYTES = 64 * 1024 * 1024

#: Default cap on the changed files' contents carried back by one call (bytes, all files).
DEFAULT_MAX_OUTPUT_BYTES = 16 * 1024 * 1024

#: Inputs up to this size travel inside the call itself; larger ones go through ``ray.put``.
INLINE_INPUT_BYTES = 64 * 1024

#: Most entries one input archive may hold.
MAX_INPUT_ENTRIES = 100_000

#: How long :class:`SandboxActorPool` waits for its actors' start checks, seconds.
DEFAULT_START_TIMEOUT_S = 300.0

#: Command run with the pool's Policy at actor start (the node must be able to run it).
PROBE_COMMAND = ("true",)

UNSET: Any = object()


class ClusterError(LowlevelError):
    """A call could not be served by the pool; the command (if any) has no Result.

    Attributes:
        reason: ``"node_lost"`` (the call's actor died more than ``max_retries`` times),
            ``"no_nodes"`` (no healthy sandbox actor is left), ``"closed"`` (the pool was
            shut down), ``"start"`` (no node passed its start checks), ``"protocol"`` (a bug).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.reason))


@dataclass
class RemoteResult(Result):
    """A :class:`lowlevel.Result` from a node of the cluster, plus where and how it ran.

    ``workspace`` is ``""``: the node's workspace is removed after the run; its changed
    files travel in ``files``.

    Attributes:
        node_id: Ray node id (hex) of the node that ran the call.
        attempts: 1, or more when the call was re-run after an actor died under it.
        lost_nodes: node ids whose actor died while holding this call (``len == attempts - 1``).
        files: content of each regular file the run added or modified, by workspace-relative
            path (``str``; a non-UTF-8 name is decoded with ``surrogateescape``, so
            ``os.fsencode(name)`` gives its bytes back). Directories, symlinks, special and
            hard-linked files are not carried (listed in ``files_omitted``).
        files_truncated: some changed files were left out (the ``max_output_bytes`` budget,
            or their kind).
        files_dropped_bytes: bytes of regular files left out by the budget.
        files_omitted: paths of changed entries not in ``files``, sorted.
    """

    node_id: str = ""
    attempts: int = 1
    lost_nodes: tuple[str, ...] = ()
    files: dict[str, bytes] = field(default_factory=dict)
    files_truncated: bool = False
    files_dropped_bytes: int = 0
    files_omitted: tuple[str, ...] = ()

    @property
    def retried(self) -> bool:
        """True when the call ran more than once (an actor died under it)."""
        return self.attempts > 1

    def file(self, name: str | bytes) -> bytes:
        """The content of changed file ``name`` (``str`` or raw ``bytes`` path); KeyError if absent."""
        return self.files[os.fsdecode(name) if isinstance(name, bytes) else name]

    def to_json(self) -> dict[str, Any]:
        """As :meth:`lowlevel.Result.to_json`; ``files`` maps each path to its size in bytes."""
        d = super().to_json()
        d["files"] = {k: len(v) for k, v in self.files.items()}
        d["lost_nodes"] = list(self.lost_nodes)
        d["files_omitted"] = list(self.files_omitted)
        d["retried"] = self.retried
        return d


@dataclass(frozen=True)
class NodeStatus:
    """What the pool knows about one node.

    Attributes:
        node_id: Ray node id (hex).
        address: the node's IP address as Ray reports it.
        ok: the node passed its start checks and still has a live actor.
        actors: live sandbox actors on the node.
        reason: why the node is not used (``""`` when ``ok``): failed doctor checks, the
            trial run's error, or ``"lost: ..."`` once its actors died.
        doctor: the node's ``lowlevel doctor`` report (``{"ok", "checks"}``), or None.
    """

    node_id: str
    address: str
    ok: bool
    actors: int
    reason: str = ""
    doctor: dict[str, Any] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Call:
    """One call of :meth:`SandboxActorPool.map`: a command and its own arguments.

    Fields left as None take the ``map`` call's defaults.
    """

    command: Sequence[str]
    inputs: Any = None
    stdin: bytes | None = None
    timeout: float | None = UNSET
    env: Mapping[str, str] | None = None
    policy: Policy | None = None
    limits: Limits | None = None


_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(Result))


def remote_result(result: Result, node_id: str, outputs: tuple[dict[str, bytes], int, list[str]]) -> RemoteResult:
    files, dropped, omitted = outputs
    base = {name: getattr(result, name) for name in _RESULT_FIELDS}
    base["workspace"] = ""
    return RemoteResult(**base, node_id=node_id, files=files, files_truncated=bool(omitted),
                        files_dropped_bytes=dropped, files_omitted=tuple(omitted))


#: Errors that mean "the actor (or its node) is gone": the call may be re-run elsewhere.
LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


def unwrap_error(err: BaseException) -> BaseException:
    """The lowlevel exception inside a Ray error (``RayTaskError.cause``), else ``err``."""
    seen = 0
    while isinstance(err, ray.exceptions.RayTaskError) and seen < 5:
        cause = getattr(err, "cause", None)
        if not isinstance(cause, BaseException):
            break
        err = cause
        seen += 1
    return err


def check_command(command: Sequence[str]) -> list[str]:
    if isinstance(command, (str, bytes)) or not command or \
            not all(isinstance(a, str) and "\0" not in a for a in command):
        raise PolicyError(f"command must be a non-empty list of str without NUL, got {command!r}")
    return list(command)
