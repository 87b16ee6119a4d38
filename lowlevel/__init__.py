"""lowlevel: run untrusted programs in a bubblewrap sandbox with seccomp, rlimits and cgroups.

Quick start::

    import lowlevel
    result = lowlevel.run(["python3", "-c", "print(6 * 7)"])
    assert result.stdout == b"42\\n"

See :func:`lowlevel.run`, :class:`lowlevel.Policy` and :class:`lowlevel.Result`; images and root
filesystems: :mod:`lowlevel.image`, :mod:`lowlevel.rootfs`.
"""

from .egress import Egress, NetworkAttempt
from .errors import (BwrapNotFoundError, CommitConflictError, CommitIncompleteError, ImageError, LaunchError,
                     LowlevelError, PolicyError, SeccompError, SessionError, UnsupportedError, WorkspaceError)
from .launcher import ExecError, run
from .limits import Limits
from .policy import Bind, Policy
from .result import Result, RunFailedError
from .seccomp import DEFAULT_PROFILE, SeccompProfile
from .workspace import Changes

__version__ = "0.1.0"

#: Names served lazily by :func:`__getattr__`: the asyncio API imports asyncio (~30 ms),
#: which ``import lowlevel`` (and the CLI) should not pay.
_LAZY = {"Runner": "aio", "arun": "aio", "AsyncProcess": "session", "AsyncSession": "session",
         "Pool": "session", "Process": "session", "Session": "session"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lowlevel' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AsyncProcess",
    "AsyncSession",
    "Bind",
    "BwrapNotFoundError",
    "Changes",
    "CommitConflictError",
    "CommitIncompleteError",
    "DEFAULT_PROFILE",
    "Egress",
    "ExecError",
    "ImageError",
    "LaunchError",
    "Limits",
    "LowlevelError",
    "NetworkAttempt",
    "Policy",
    "PolicyError",
    "Pool",
    "Process",
    "Result",
    "RunFailedError",
    "Runner",
    "SeccompError",
    "SeccompProfile",
    "Session",
    "SessionError",
    "UnsupportedError",
    "WorkspaceError",
    "arun",
    "run",
]
