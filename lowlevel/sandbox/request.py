"""The one validated description of a call: :class:`RunRequest` (what to run, with what, how long).

Every entry point builds one (:func:`lowlevel.run`, :func:`lowlevel.arun`, :class:`lowlevel.Runner`,
:func:`lowlevel.record.execute_recorded`, the CLI through :func:`lowlevel.run`) and the run core
(:class:`lowlevel.sandbox.launcher.Run`) takes it. It is checked once, when it is made: each bad
value is a :class:`~lowlevel.errors.PolicyError` whose message names the field, before anything
is created (no workspace, no fd, no process). A field an entry point cannot honour is refused
with :meth:`RunRequest.refuse`, never ignored (issue 26: ``run(record=..., commit=False)`` used
to commit).

The Policy is not part of the request: it is the sandbox's description, shared by many calls;
the request is the call's. Host facts (is the command there, is the workspace a directory) are
checked when the run is prepared, not here: this module does no I/O but ``fstat`` of the
``stdio_fds`` it is given.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from lowlevel._dataclass import dataclass
from lowlevel.errors import PolicyError
from lowlevel.spec import validate as _validate

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: Default wall-clock timeout for a run, seconds.
DEFAULT_TIMEOUT_S = 60.0
#: What ``commit`` may be (see :class:`RunRequest`).
COMMIT_MODES = (True, False, "on_success")

InputItem = str | os.PathLike[str] | tuple[str, str]


def check_seconds(value: object, what: str, *, zero: bool) -> float:
    """A finite number of seconds below 2**31: > 0 (``zero`` False) or >= 0 (``zero`` True); the one
    check of every per-call and per-session duration (run, arun, Runner, Session, Pool).

    Raises:
        PolicyError: a bool, not a number, NaN, infinite, 2**31 or more, or out of range.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value < 2**31 \
        and (value >= 0 if zero else value > 0)
    if not ok:
        if zero:
            raise PolicyError(f"{what} must be a number of seconds >= 0 and below 2**31, got {value!r}")
        raise PolicyError(f"{what} must be a finite number of seconds > 0 and below 2**31 (about 68 years) "
                          f"(or None for no {what}), got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _stdio_fds(stdio_fds: Sequence[int | None] | None, *, stdin: bool,
               capture: bool) -> tuple[int | None, int | None, int | None] | None:
    """``stdio_fds``: three open fds (or None each) for the program's 0, 1, 2; None stays None."""
    if stdio_fds is None:
        return None
    fds = tuple(stdio_fds)
    if len(fds) != 3:
        raise PolicyError(f"stdio_fds must be (stdin_fd, stdout_fd, stderr_fd), got {stdio_fds!r}")
    for i, fd in enumerate(fds):
        if fd is None:
            continue
        if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
            raise PolicyError(f"stdio_fds[{i}] must be an open fd number or None, got {fd!r}")
        try:
            os.fstat(fd)
        except OSError as err:
            raise PolicyError(f"stdio_fds[{i}]: fd {fd} is not open ({err.strerror})") from None
    if fds[0] is not None and stdin:
        raise PolicyError("pass stdin bytes or stdio_fds[0], not both")
    if capture and (fds[1] is not None or fds[2] is not None):
        raise PolicyError("capture=True pipes stdout and stderr into the Result: pass stdio_fds[1] "
                          "and stdio_fds[2] only with capture=False")
    return fds[0], fds[1], fds[2]


def check_keep_workspace(keep_workspace: object, workspace: object) -> bool:
    """``keep_workspace``: a bool; False only for a fresh workspace (lowlevel never deletes yours)."""
    if not isinstance(keep_workspace, bool):
        raise PolicyError(f"keep_workspace must be a bool, got {keep_workspace!r}")
    if not keep_workspace and workspace is not None:
        raise PolicyError("keep_workspace=False removes the fresh per-run workspace; it does not go with "
                          "workspace= (lowlevel never deletes your directory)")
    return keep_workspace


@dataclass(frozen=True, eq=False)
class RunRequest:
    """One call: the fields of :func:`lowlevel.run` (see there for each one's meaning), checked.

    Fields (after validation; the constructor takes the same names with looser types):
        command: ``tuple[str, ...]``, non-empty (:func:`lowlevel.spec.validate.command`).
        workspace: host directory (str) bound at ``/workspace``, or None for a fresh one.
        inputs: ``tuple`` of host paths, or ``(host path, dest)`` pairs (dest relative to the
            workspace), copied in before the run.
        timeout: seconds (float) > 0, or None for no limit.
        kill_after: seconds (float) >= 0 of SIGTERM grace at the timeout (``timeout -k``).
        stdin: bytes fed to the program, or None.
        env: read-only mapping of variables set inside on top of the Policy's.
        capture: pipe stdout/stderr into the Result (True) or give the program the caller's fds.
        cwd: normalized sandbox path, or None for the Policy's workdir (else ``/workspace``).
        workspace_base: parent directory of fresh workspaces, or None for the default.
        allow_sensitive_workspace: accept a workspace that would be refused.
        stdio_fds: ``(stdin_fd, stdout_fd, stderr_fd)`` (None each for the default), or None.
        keep_workspace: keep a fresh workspace after the run (False: removed).
        commit: True, False or ``"on_success"``: what happens to the run's changes.
        record: path of a run record to write (only :func:`lowlevel.run` writes records, through
            :func:`lowlevel.record.record_run`), or None.

    Raises:
        PolicyError: the first bad field, named, with what to pass instead. The combinations
            refused: ``stdin`` with ``stdio_fds[0]``; ``capture=True`` with ``stdio_fds[1:]``;
            ``keep_workspace=False`` with ``workspace``; ``record`` with ``commit`` other than
            True, with ``kill_after`` or with ``stdio_fds`` (a record stores stdin as bytes,
            hashes the committed workspace and replays the SIGKILL at the deadline).
    """

    command: Sequence[str]
    workspace: str | os.PathLike[str] | None = None
    inputs: Sequence[InputItem] = ()
    timeout: float | None = DEFAULT_TIMEOUT_S
    kill_after: float = 0.0
    stdin: bytes | None = None
    env: Mapping[str, str] | None = None
    capture: bool = True
    cwd: str | None = None
    workspace_base: str | None = None
    allow_sensitive_workspace: bool = False
    stdio_fds: Sequence[int | None] | None = None
    keep_workspace: bool = True
    commit: bool | str = True
    record: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:  # a list of checks, in the order the old entry points made them
        put = _setter(self)
        put("kill_after", check_seconds(self.kill_after, "kill_after", zero=True))
        if self.record is not None:
            put("record", _validate.host_path(self.record, "record"))
            self.check_recordable()
        if self.timeout is not None:
            put("timeout", check_seconds(self.timeout, "timeout", zero=False))
        if self.stdin is not None:
            if not isinstance(self.stdin, (bytes, bytearray, memoryview)):
                raise PolicyError("stdin must be bytes or None")
            put("stdin", bytes(self.stdin))
        if not isinstance(self.capture, bool):
            raise PolicyError(f"capture must be a bool, got {self.capture!r}")
        put("stdio_fds", _stdio_fds(self.stdio_fds, stdin=self.stdin is not None, capture=self.capture))
        check_keep_workspace(self.keep_workspace, self.workspace)
        if not any(self.commit is m or (isinstance(m, str) and self.commit == m) for m in COMMIT_MODES):
            raise PolicyError(f"commit must be True, False or 'on_success', got {self.commit!r}")
        # The policy edge (issue 10, item 1): every string bound for bwrap's argv is checked here,
        # before anything is created; argv.encode_args checks once more.
        command = _validate.run_args(command=self.command, cwd=self.cwd or "/workspace", env=self.env,
                                     workspace=self.workspace, workspace_base=self.workspace_base,
                                     inputs=self.inputs)
        put("command", tuple(command))
        put("inputs", tuple(self.inputs))
        if self.cwd is not None:
            put("cwd", _validate.sandbox_cwd(self.cwd))
        if self.workspace is not None:
            put("workspace", os.fspath(self.workspace))
        put("env", MappingProxyType(dict(self.env or {})))
        put("allow_sensitive_workspace", bool(self.allow_sensitive_workspace))

    def check_recordable(self) -> None:
        """Refuse what a recorded run cannot honour (:func:`lowlevel.record.execute_recorded`).

        Raises:
            PolicyError: ``commit`` other than True, ``kill_after`` > 0, or ``stdio_fds``.
        """
        if self.commit is not True:
            # The record hashes the workspace after the run's commit, and replay commits: a
            # record of a discarded run would say the opposite of what happened (issue 26: the
            # library used to drop commit= here and commit anyway, as the CLI refuses to).
            raise PolicyError(f"commit={self.commit!r} does not go with record (a record's run commits its "
                              "changes, and replay does): drop one of them")
        if self.kill_after:
            raise PolicyError("kill_after does not go with record (a record replays the SIGKILL at the "
                              "deadline): drop one of them")
        if self.stdio_fds is not None and any(fd is not None for fd in self.stdio_fds):
            raise PolicyError("stdio_fds does not go with record: a record stores stdin as bytes and "
                              "the output it hashes; pass stdin= and capture the output")

    def refuse(self, entry: str, *names: str, why: str) -> None:
        """Raise PolicyError when any field of ``names`` differs from its default.

        For an entry point that cannot honour those fields (``entry``: its name, ``why``: what
        to use instead), so a field is never silently ignored.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in names:
            value = getattr(self, name)
            if name == "env" and not value:
                continue
            if value != defaults[name]:
                raise PolicyError(f"{entry} does not take {name}= ({why})")

    def replace(self, **changes: Any) -> RunRequest:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)


def _setter(obj: object) -> Any:
    """The setter of a frozen dataclass's own ``__post_init__`` (normalized fields)."""
    return lambda name, value: object.__setattr__(obj, name, value)


__all__ = ["COMMIT_MODES", "DEFAULT_TIMEOUT_S", "RunRequest", "check_keep_workspace", "check_seconds"]
