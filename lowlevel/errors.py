"""The whole exception tree of lowlevel.

::

    LowlevelError                  base, never raised itself
    ├── PolicyError(ValueError)    rejected before anything runs; the message says what to change
    ├── WorkspaceError(LowlevelError, OSError)  workspace missing, not a directory, unsafe entry
    │   ├── CommitConflictError    a copy-on-write commit found host changes (EBUSY); ``.conflicts``
    │   └── CommitIncompleteError  a commit stopped part-way (ENOSPC, EDQUOT, EFBIG, EROFS, EIO); ``.saved_upper``
    ├── UnsupportedError           host lacks a feature (bwrap, userns, cgroup, option); ``.feature``
    ├── SeccompError               building the seccomp filter failed; ``.operation``, ``.errno``
    ├── LaunchError(OSError)       bwrap could not start or set up the sandbox; ``.argv``, ``.stderr``
    │   ├── BwrapNotFoundError     no bwrap executable on PATH
    │   └── ExecError              the command is missing (ENOENT) or not executable (EACCES)
    ├── SessionError               a Session ended or broke; ``.reason``
    ├── ImageError                 an image cannot be imported, found or removed (lowlevel.image)
    └── RunFailedError             raised only by ``Result.check()``; ``.result``

The program exiting non-zero, dying on a signal, hitting a limit or a seccomp denial is
*not* an exception: it is a :class:`lowlevel.sandbox.result.Result`.
"""

from __future__ import annotations

import errno as _errno

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any


class LowlevelError(Exception):
    """Base of every exception raised by lowlevel. Never raised itself."""


class PolicyError(LowlevelError, ValueError):
    """A Policy (or a run argument) is invalid or unsafe; nothing ran.

    The message names the offending field and what to pass instead.
    """


class WorkspaceError(LowlevelError, OSError):
    """The workspace is missing, not a directory, or holds an entry we refuse to touch.

    Built as ``WorkspaceError(errno, message)``; ``str()`` is the message alone.

    Attributes:
        saved_upper: when a commit failed (a full or read-only disk, a conflict), the directory
            the changes were saved to, else None.
    """

    saved_upper: str | None = None

    def __str__(self) -> str:
        return str(self.strerror) if self.strerror else super().__str__()


class CommitConflictError(WorkspaceError):
    """The user's directory changed on the host during the run where the commit would write.

    Raised by :func:`lowlevel.workspace.overlay.commit` before it changes anything: every entry
    the commit would replace, delete or chmod was checked first, and one or more had
    ``st_ctime_ns > since_ns``. Also raised
    *after* its apply pass when the host changed entries while they were being applied (``applied``
    is then not None): those entries are left as the host made them, the others were applied.

    Attributes:
        conflicts: the relative paths that changed on the host (sorted; ``str`` with
            surrogateescape, see the module docstring).
        saved_upper: where the run's changes were saved (:func:`lowlevel.workspace.overlay.save_upper`),
            or None. :meth:`with_saved_upper` gives a copy that says so in its message.
        result: the run's :class:`lowlevel.Result` when a run's commit raised it (set by the
            caller that has one), else None.
        applied: None when nothing was changed; after the apply pass, the
            :class:`lowlevel.workspace.Changes` that were applied (and kept).
        not_applied: the relative paths of the run's changes not applied (sorted).
        record: a recorded run's record (the dict :func:`lowlevel.record.execute_recorded` built,
            written by :func:`lowlevel.record.record_run` before it raises), else None.
    Errno: EBUSY. ``str(err)`` is ``err.args[1]``, so a caller may extend the message by
    replacing ``err.args``.
    """

    result: Any = None
    applied: Any = None
    not_applied: tuple[str, ...] = ()
    record: Any = None

    def __init__(self, conflicts: tuple[str, ...], message: str = "", saved_upper: str | None = None) -> None:
        shown = ", ".join(repr(p) for p in conflicts[:10]) + (f" and {len(conflicts) - 10} more"
                                                              if len(conflicts) > 10 else "")
        message = message or (f"commit refused: {len(conflicts)} entr{'y' if len(conflicts) == 1 else 'ies'} of "
                              f"the workspace changed on the host during the run ({shown}); nothing was changed"
                              + (f"; the run's changes were saved to {saved_upper}" if saved_upper else
                                 "; save the run's changes with lowlevel.workspace.overlay.save_upper()"
                                 " or discard them"))
        super().__init__(_errno.EBUSY, message)
        self.conflicts = tuple(conflicts)
        self.saved_upper = saved_upper

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()

    def with_saved_upper(self, path: str) -> CommitConflictError:
        """The same error, saying the run's changes were saved at ``path`` (from :func:`save_upper`)."""
        return CommitConflictError(self.conflicts, saved_upper=path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.conflicts, str(self), self.saved_upper))


class CommitIncompleteError(WorkspaceError):
    """A copy-on-write commit stopped part-way: the user's filesystem could not take the run's
    changes (ENOSPC, EDQUOT, EFBIG) or could not be written any more (EROFS, EIO).

    Raised by :func:`lowlevel.workspace.overlay.commit` after its apply pass stopped. What it applied
    before stopping is kept (each entry is the old or the new version, never half-written; no
    temporaries are left); the run's changes are saved aside (:func:`lowlevel.workspace.overlay.save_upper`)
    with the lists of what was and was not applied.

    Attributes:
        applied: the :class:`lowlevel.workspace.Changes` applied (and kept).
        not_applied: the relative paths of the run's changes not applied (sorted).
        saved_upper: where the run's changes were saved, or None when saving failed too.
        conflicts: entries the host changed during the commit (left as the host made them).
        result: the run's :class:`lowlevel.Result` when a run's commit raised it, else None.
        record: a recorded run's record (as :class:`CommitConflictError`'s), else None.
    Errno: the filesystem's (``.errno``). ``str(err)`` says where the changes were saved.
    """

    result: Any = None
    record: Any = None

    def __init__(self, code: int, message: str, *, applied: Any = None, not_applied: tuple[str, ...] = (),
                 saved_upper: str | None = None, conflicts: tuple[str, ...] = ()) -> None:
        super().__init__(code, message)
        self.applied = applied
        self.not_applied = tuple(not_applied)
        self.saved_upper = saved_upper
        self.conflicts = tuple(conflicts)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_incomplete, (self.errno, str(self), self.not_applied, self.saved_upper, self.conflicts))


def _rebuild_incomplete(code: int, message: str, not_applied: tuple[str, ...], saved_upper: str | None,
                        conflicts: tuple[str, ...]) -> CommitIncompleteError:
    return CommitIncompleteError(code, message, not_applied=not_applied, saved_upper=saved_upper,
                                 conflicts=conflicts)


class UnsupportedError(LowlevelError):
    """The host lacks a feature the run needs.

    Attributes:
        feature: short name of the missing feature, e.g. ``"userns"``, ``"cgroup:memory"``.
        fix: a one-line hint on how to get it, or ``""``.
    """

    def __init__(self, feature: str, message: str, fix: str = "") -> None:
        super().__init__(message + (f" (fix: {fix})" if fix else ""))
        self.feature = feature
        self.fix = fix

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.feature, str(self.args[0]).split(" (fix: ")[0], self.fix))


class SeccompError(LowlevelError):
    """Building or exporting the seccomp filter failed.

    Attributes:
        operation: the libseccomp call that failed, e.g. ``"seccomp_rule_add"``.
        errno: the positive errno it reported (libseccomp returns ``-errno``).
    """

    def __init__(self, operation: str, errno: int, message: str = "") -> None:
        import os

        detail = message or f"{operation} failed: {os.strerror(errno)} (errno {errno})"
        super().__init__(detail)
        self.operation = operation
        self.errno = errno

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.operation, self.errno, str(self)))


class LaunchError(LowlevelError, OSError):
    """bwrap could not be started, or failed while setting up the sandbox.

    A program that ran and exited non-zero is never a LaunchError.

    Attributes:
        argv: the argv of the process we tried to start (bwrap's own options included).
        stderr: what bwrap printed (its ``bwrap: ...`` message), decoded, or ``""``.
    """

    def __init__(self, message: str, *, argv: list[str] | None = None, stderr: str = "",
                 errno: int | None = None) -> None:
        if errno is not None:
            super().__init__(errno, message)
        else:
            super().__init__(message)
        self.argv = list(argv or [])
        self.stderr = stderr
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_launch_error, (type(self), self.message, self.argv, self.stderr, self.errno))


class BwrapNotFoundError(LaunchError):
    """No ``bwrap`` executable was found (install the ``bubblewrap`` package)."""


class SessionError(LowlevelError):
    """The session ended or broke; the command (if any) has no Result.

    Attributes:
        reason: ``"closed"`` (close() was called), ``"init_died"`` (the init exited or was
            killed, e.g. by a command), ``"unresponsive"`` (the init or a shepherd stopped
            answering: SIGSTOP from a command), ``"idle_timeout"``, ``"total_timeout"``,
            ``"protocol"`` (a malformed message: a bug), ``"busy"`` (``commit()``/``reset()``
            refused while background commands run: nothing changed, the session goes on),
            ``"other_loop"`` (an :class:`lowlevel.AsyncSession` used from an event loop other
            than the one that opened it: nothing changed, the session goes on), ``"forked"``
            (a session used in a child process forked from its owner: the owner's session goes on).
    """

    def __init__(self, message: str, reason: str = "init_died") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.reason))


class ImageError(LowlevelError):
    """An image cannot be imported (bad or hostile archive, bound exceeded, tool missing), found
    or removed. The message names the archive or reference and what to do; a failed import
    leaves nothing in the store."""


def _rebuild_launch_error(cls: type[LaunchError], message: str, argv: list[str], stderr: str,
                          errno: int | None) -> LaunchError:
    return cls(message, argv=argv, stderr=stderr, errno=errno)


__all__ = [
    "BwrapNotFoundError",
    "CommitConflictError",
    "CommitIncompleteError",
    "ImageError",
    "LaunchError",
    "LowlevelError",
    "PolicyError",
    "SeccompError",
    "SessionError",
    "UnsupportedError",
    "WorkspaceError",
]
