"""lowlevel: run untrusted programs in a bubblewrap sandbox with seccomp, rlimits and cgroups.

Quick start::

    import lowlevel
    result = lowlevel.run(["python3", "-c", "print(6 * 7)"])
    assert result.stdout == b"42\\n"

See :func:`lowlevel.run`, :class:`lowlevel.Policy` and :class:`lowlevel.Result`; images and root
filesystems: :mod:`lowlevel.image`, :mod:`lowlevel.rootfs`.
"""

# First thing, with modules Python itself has loaded already (no import can be interrupted
# first): when this process is the lowlevel command, a ^C while the package imports prints the
# CLI's one-line notice instead of a KeyboardInterrupt traceback (lowlevel._startup).
import sys as _sys  # noqa: I001
import _signal  # type: ignore[import-not-found]  # the C module: `signal` would import enum first

_STARTUP_NOTICE = "SIGINT: interrupted while starting; nothing was run"
_STARTUP_JSON = ('{\n  "errno": null,\n  "error": "Interrupted",\n  "exit_status": 130,\n  "message": "'
                 + _STARTUP_NOTICE + '",\n  "signal": "SIGINT",\n  "workspace": null\n}\n')
if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _main_file = getattr(_sys.modules.get("__main__"), "__file__", None) or ""
    _orig = list(getattr(_sys, "orig_argv", ()))
    if (_sys.argv and _sys.argv[0].rsplit("/", 1)[-1] == "lowlevel" and _main_file == _sys.argv[0]) \
            or any(a == "-m" and _orig[i + 1:i + 2] == ["lowlevel"] for i, a in enumerate(_orig)):
        def _startup_sigint(signum: int, _frame: object) -> None:
            # No import here: the interrupted one may be half done (lowlevel._startup).
            import posix
            try:
                _argv = _sys.argv[1:]
                if "--json" in (_argv[:_argv.index("--")] if "--" in _argv else _argv):
                    posix.write(1, _STARTUP_JSON.encode())
                posix.write(2, f"lowlevel: {_STARTUP_NOTICE}\n".encode())
            finally:
                posix._exit(128 + signum)
        try:
            _signal.signal(_signal.SIGINT, _startup_sigint)
        except ValueError:  # not the main thread: not the command starting
            pass
    del _main_file, _orig
from lowlevel.spec.egress import Egress, NetworkAttempt  # noqa: E402
from lowlevel.errors import (BwrapNotFoundError, CommitConflictError, CommitIncompleteError, ImageError,  # noqa: E402
                     LaunchError, LowlevelError, PolicyError, SeccompError, SessionError, UnsupportedError,
                     WorkspaceError)
from lowlevel.api import run  # noqa: E402
from lowlevel.sandbox.failures import ExecError  # noqa: E402
from lowlevel.spec.limits import Limits  # noqa: E402
from lowlevel.spec.policy import Bind, Policy  # noqa: E402
from lowlevel.sandbox.result import Result, RunFailedError  # noqa: E402
from lowlevel.spec.seccomp import DEFAULT_PROFILE, SeccompProfile  # noqa: E402
from lowlevel.workspace import Changes  # noqa: E402

from lowlevel.version import __version__ as __version__  # noqa: E402  (re-exported)
from lowlevel import _dataclass  # noqa: E402

_dataclass.save()  # the dataclasses' code compiled by this import, for the next process (lowlevel._dataclass)

#: Names served lazily by :func:`__getattr__`: the asyncio API imports asyncio (~30 ms),
#: which ``import lowlevel`` (and the CLI) should not pay.
_LAZY = {"Runner": "sandbox.aio", "arun": "sandbox.aio", "AsyncProcess": "session.aio", "AsyncSession": "session.aio",
         "Pool": "session.pool", "Process": "session.sync", "Session": "session.sync"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lowlevel' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    _dataclass.save()
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
