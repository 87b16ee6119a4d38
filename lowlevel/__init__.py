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
# CLI's one-line notice instead of a KeyboardInterrupt traceback (lowlevel._startup). The two
# definitions open the try block: neither checks for pending signals (only calls, backward jumps
# and function entries do), so a SIGINT that lands before the handler is armed (during the checks
# or the _signal.signal call itself) is a KeyboardInterrupt raised inside the try, and gets the
# same notice. The constants come first: they make no call either.
_STARTUP_NOTICE = "SIGINT: interrupted while starting; nothing was run"
_STARTUP_JSON = ('{\n  "errno": null,\n  "error": "Interrupted",\n  "exit_status": 130,\n  "message": "'
                 + _STARTUP_NOTICE + '",\n  "signal": "SIGINT",\n  "workspace": null\n}\n')
try:
    def _startup_sigint(signum: int, _frame: object) -> None:
        # No import of ours here: the interrupted one may be half done (lowlevel._startup).
        import posix
        import sys
        try:
            _argv = sys.argv[1:]
            if "--json" in (_argv[:_argv.index("--")] if "--" in _argv else _argv):
                posix.write(1, _STARTUP_JSON.encode())
            posix.write(2, f"lowlevel: {_STARTUP_NOTICE}\n".encode())
        finally:
            posix._exit(128 + signum)

    def _is_the_command() -> bool:
        """Whether this process's main program is lowlevel's own command (not a library caller):
        the console script (run by any path: Python makes ``__main__.__file__`` absolute, so
        ``.venv/bin/lowlevel`` has a relative ``argv[0]``), or ``python -m lowlevel[.cli]``."""
        import posix  # the C module: no frame of another module runs in this window (os may be unloaded: -S)
        import sys
        main_file = getattr(sys.modules.get("__main__"), "__file__", None) or ""
        orig = list(getattr(sys, "orig_argv", ()))
        argv0 = sys.argv[0] if sys.argv else ""
        if argv0.rsplit("/", 1)[-1] == "lowlevel" and main_file:
            if main_file == argv0:
                return True
            try:  # the same file
                named, main = posix.stat(argv0), posix.stat(main_file)
                if (named.st_dev, named.st_ino) == (main.st_dev, main.st_ino):
                    return True
            except OSError:
                pass
        return any(a == "-m" and orig[i + 1:i + 2] in (["lowlevel"], ["lowlevel.cli"]) for i, a in enumerate(orig))

    import _signal  # type: ignore[import-not-found]  # the C module: `signal` would import enum first
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler and _is_the_command():
        try:
            _signal.signal(_signal.SIGINT, _startup_sigint)
        except ValueError:  # not the main thread: not the command starting
            pass
except KeyboardInterrupt:
    if _is_the_command():
        _startup_sigint(2, None)  # exits 130
    raise
from lowlevel.version import __version__ as __version__  # noqa: E402  (re-exported)

# The public names are attributes served by __getattr__ (PEP 562) from the module that defines
# them, imported on first use: ``lowlevel --version``, ``--help``, ``doctor``... do not pay the
# run machinery's ~50 ms of imports, and a ``lowlevel.run`` imports it all (its failure and
# cleanup paths included: docs/architecture.md) before its sandbox starts. Type checkers read
# the imports below.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from lowlevel.api import run as run
    from lowlevel.errors import (BwrapNotFoundError as BwrapNotFoundError, CommitConflictError as CommitConflictError,
                                 CommitIncompleteError as CommitIncompleteError, ImageError as ImageError,
                                 LaunchError as LaunchError, LowlevelError as LowlevelError,
                                 PolicyError as PolicyError, SeccompError as SeccompError,
                                 SessionError as SessionError, UnsupportedError as UnsupportedError,
                                 WorkspaceError as WorkspaceError)
    from lowlevel.sandbox.aio import Runner as Runner, arun as arun
    from lowlevel.sandbox.failures import ExecError as ExecError
    from lowlevel.sandbox.result import Result as Result, RunFailedError as RunFailedError
    from lowlevel.session.aio import AsyncProcess as AsyncProcess, AsyncSession as AsyncSession
    from lowlevel.session.pool import Pool as Pool
    from lowlevel.session.sync import Process as Process, Session as Session
    from lowlevel.spec.egress import Egress as Egress, NetworkAttempt as NetworkAttempt
    from lowlevel.spec.limits import Limits as Limits
    from lowlevel.spec.policy import Bind as Bind, Policy as Policy
    from lowlevel.spec.seccomp import DEFAULT_PROFILE as DEFAULT_PROFILE, SeccompProfile as SeccompProfile
    from lowlevel.workspace import Changes as Changes

#: Where each public name is defined (module under ``lowlevel``).
_LAZY = {"run": "api", "Egress": "spec.egress", "NetworkAttempt": "spec.egress", "ExecError": "sandbox.failures",
         "Limits": "spec.limits", "Bind": "spec.policy", "Policy": "spec.policy", "Result": "sandbox.result",
         "RunFailedError": "sandbox.result", "DEFAULT_PROFILE": "spec.seccomp", "SeccompProfile": "spec.seccomp",
         "Changes": "workspace",
         **dict.fromkeys(("BwrapNotFoundError", "CommitConflictError", "CommitIncompleteError", "ImageError",
                          "LaunchError", "LowlevelError", "PolicyError", "SeccompError", "SessionError",
                          "UnsupportedError", "WorkspaceError"), "errors"),
         # the asyncio API imports asyncio (~30 ms), which a sync caller (and the CLI) should not pay
         "Runner": "sandbox.aio", "arun": "sandbox.aio", "AsyncProcess": "session.aio", "AsyncSession": "session.aio",
         "Pool": "session.pool", "Process": "session.sync", "Session": "session.sync"}


def __getattr__(name: str) -> object:
    import importlib

    module = _LAZY.get(name)
    if module is None:
        if name.startswith("_"):
            raise AttributeError(f"module 'lowlevel' has no attribute {name!r}")
        try:  # a subpackage not imported yet (``lowlevel.sandbox``), as an eager package would have it
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'lowlevel' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    from lowlevel import _dataclass
    _dataclass.save()  # the dataclasses' code compiled by that import, for the next process (lowlevel._dataclass)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
