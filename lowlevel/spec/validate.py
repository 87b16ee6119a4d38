"""Checks for every caller-supplied string that ends up in bwrap's argv or a session SPAWN message.

bwrap reads its options NUL-separated from the ``--args`` memfd, and the session init reads
cwd, argv and environment NUL-separated from its SPAWN message. A NUL byte inside one value
would split it into several, so ``cwd="/workspace\\0--bind\\0/\\0/tmp/host"`` became a bind of
the host's root (issue 10, item 1). These functions are the policy edge: :func:`lowlevel.run`,
:class:`lowlevel.Session`, :class:`lowlevel.Policy`, :class:`lowlevel.Bind`, the CLI, the MCP
server and ``lowlevel replay`` call them before anything is created, and every refusal is a
:class:`~lowlevel.errors.PolicyError` naming the field. :func:`lowlevel.sandbox.argv.encode_args`
checks once more, as the last line, right before the bytes are written.

Strings are encoded the way the kernel takes them from Python (:func:`os.fsencode`: UTF-8,
with the ``surrogateescape`` code points U+DC80..U+DCFF standing for raw bytes, so a non-UTF-8
file name given on the command line passes through unchanged). A string that cannot be encoded
(a lone surrogate such as ``"\\ud800"``) is refused too.

Source: bwrap(1) ``--args FD`` ("NUL-separated arguments"); execve(2) (MAX_ARG_STRLEN, 32 pages);
limits.h PATH_MAX.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from lowlevel.errors import PolicyError
from lowlevel.paths import reach_error

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: Longest single argument the kernel passes to a program (MAX_ARG_STRLEN: 32 pages of 4 KiB).
MAX_ARG_BYTES = 32 * 4096
#: Longest path (PATH_MAX, bytes including the terminating NUL on Linux).
MAX_PATH_BYTES = 4096
#: Most arguments one command may have (well under what 2 MiB of argv holds; a bound for records).
MAX_ARGS = 65536
#: Most per-run environment variables.
MAX_ENV = 4096

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _show(value: str, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def text(value: Any, what: str, *, max_bytes: int = MAX_ARG_BYTES, empty: bool = True) -> str:
    """Check one string bound for an argv: a ``str``, no NUL byte, encodable, not too long.

    Args:
        value: the caller's value.
        what: the field's name, for the message (``"cwd"``, ``"env['A']"``...).
        max_bytes: longest encoded length accepted (bytes).
        empty: accept ``""``.
    Returns:
        ``value`` unchanged.
    Raises:
        PolicyError: not a str, contains NUL, a lone surrogate, longer than ``max_bytes``, or empty.
    """
    if not isinstance(value, str):
        raise PolicyError(f"{what} must be a str, got {type(value).__name__}: {value!r:.80}")
    nul = value.find("\0")
    if nul >= 0:
        raise PolicyError(f"{what} contains a NUL byte (at index {nul}): {_show(value)}. A NUL would split it "
                          "into separate bwrap options; remove it")
    try:
        size = len(os.fsencode(value))
    except UnicodeEncodeError as err:
        raise PolicyError(f"{what} cannot be encoded to bytes ({err.reason} at index {err.start}): "
                          f"{_show(value)}") from None
    if size > max_bytes:
        raise PolicyError(f"{what} is {size} bytes long; the limit is {max_bytes}")
    if not empty and not value:
        raise PolicyError(f"{what} must not be empty")
    return value


def sandbox_path(value: Any, what: str) -> str:
    """An absolute path inside the sandbox (cwd, bind destination): :func:`text` rules, PATH_MAX,
    starting with ``/``.

    Raises:
        PolicyError: as :func:`text`, or relative.
    """
    text(value, what, max_bytes=MAX_PATH_BYTES - 1, empty=False)
    if not value.startswith("/"):
        raise PolicyError(f"{what} must be an absolute path inside the sandbox, got {_show(value)}")
    return str(value)


def normalize_abs(path: str) -> str:
    """An absolute path in its one lexical form: ``os.path.normpath`` (``.``, ``..`` and repeated
    slashes collapsed), and a leading ``//`` made ``/`` too.

    POSIX lets exactly two leading slashes mean something implementation-defined, so
    ``os.path.normpath("//usr")`` keeps them; Linux (and bwrap) read ``//usr`` as ``/usr``. A
    check that compares the normpath form (reserved bind dests, a dest inside another bind's
    dest, the host's root) would let ``//usr`` past what ``/usr`` is refused for, and bwrap
    would then mount there: every sandbox path and host path lowlevel compares goes through
    here. Source: POSIX.1-2017 XBD 4.13 Pathname Resolution; Python's ``posixpath.normpath``.
    """
    norm = os.path.normpath(path)
    return "/" + norm.lstrip("/") if norm.startswith("/") else norm


#: Sandbox trees a working directory may never lie in: the kernel's own, where a path component
#: can be a magic link to an open file of bwrap's (``/proc/self/fd/N``, ``/dev/fd/N`` ->
#: ``/proc/self/fd/N``, ``/proc/self/cwd``). bwrap 0.8.0 holds an ``O_PATH`` fd of the *host's*
#: ``/proc`` while it runs ``--chdir``, so ``cwd="/proc/self/fd/3"`` started the program in the
#: host's ``/proc`` with ``..`` the host's ``/``: the class of runc's CVE-2024-21626 ("leaky
#: vessels", GHSA-xr7r-f8xq-vfvv). ``/dev/shm`` is a tmpfs of the sandbox's own and allowed.
CWD_FORBIDDEN = ("/proc", "/sys", "/dev")
CWD_ALLOWED = ("/dev/shm",)


def sandbox_cwd(value: Any, what: str = "cwd") -> str:
    """A working directory inside the sandbox: :func:`sandbox_path`, no ``..`` component, and
    not beneath :data:`CWD_FORBIDDEN` (``/dev/shm`` excepted).

    This is the first of two walls against a working directory that leads out of the
    sandbox (CVE-2024-21626 class): lowlevel never passes the cwd to bwrap's ``--chdir`` (bwrap
    gets ``--chdir /``); the guard (``native/lowlevel_guard.c``) and the session init change
    directory themselves once bwrap has closed its fds, and check with ``getcwd(2)`` that the
    result is inside the sandbox's root before anything runs (a symlink in the workspace that
    points at ``/proc/self/fd/N`` passes this lexical check and is stopped there).

    Returns:
        The path, normalized (``//`` and ``.`` components collapsed).
    Raises:
        PolicyError: as :func:`sandbox_path`; a ``..`` component; a path under ``/proc``,
            ``/sys`` or ``/dev``.
    """
    path = sandbox_path(value, what)
    if ".." in path.split("/"):
        raise PolicyError(f"{what} {_show(path)} must not contain '..': name the directory itself, "
                          "e.g. /workspace/src")
    norm = normalize_abs(path)
    for top in CWD_FORBIDDEN:
        if (norm == top or norm.startswith(top + "/")) and not any(
                norm == ok or norm.startswith(ok + "/") for ok in CWD_ALLOWED):
            raise PolicyError(f"{what} {_show(path)} is under {top}, where a path can lead out of the sandbox "
                              "through a magic link such as /proc/self/fd/N (CVE-2024-21626); use a directory "
                              "of the sandbox's own tree, e.g. /workspace or /tmp")
    return norm


def host_path(value: Any, what: str) -> str:
    """A host path given by the caller (workspace, input, bind source, record): a ``str`` or
    ``os.PathLike`` of str, :func:`text` rules, PATH_MAX, not empty.

    Returns:
        The path as a str (``os.fspath``).
    Raises:
        PolicyError: as :func:`text` (bytes paths are refused: pass str).
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return text(value, what, max_bytes=MAX_PATH_BYTES - 1, empty=False)


def resolve_host(raw: str, what: str) -> tuple[str, os.stat_result]:
    """Host path ``raw`` resolved (``os.path.realpath(strict=True)``) and stat'ed, following links.

    Returns:
        ``(real path, its stat)``.
    Raises:
        PolicyError: it does not exist ("does not exist on the host"), or it cannot be reached by
            this user (EACCES: a directory on its way is not searchable, e.g. another user's
            ``/proc/PID/cwd``), or another resolution error (ELOOP, ENAMETOOLONG): the message
            names ``what``, the path and the reason (:func:`lowlevel.paths.reach_error`).
    """
    try:
        real = os.path.realpath(raw, strict=True)
        return real, os.stat(real)
    except OSError as err:
        why = reach_error(err)[1]
        raise PolicyError(f"{what} {raw!r} {why}" + (" on the host" if why == "does not exist" else "")) from None


def env_name(value: Any, what: str = "environment variable name") -> str:
    """A variable name: letters, digits and ``_``, not starting with a digit (so no ``=``, no NUL).

    Raises:
        PolicyError: anything else.
    """
    if isinstance(value, str) and "\0" in value:
        text(value, what)  # the NUL message
    if not isinstance(value, str) or not _ENV_NAME.fullmatch(value):
        raise PolicyError(f"{what} {value!r:.80} is invalid: use letters, digits and _ (not starting with a digit)")
    return value


def command(value: Any) -> list[str]:
    """A command: a non-empty list (or tuple) of :func:`text` strings, the first non-empty.

    Returns:
        A new list.
    Raises:
        PolicyError: a str instead of a list, an empty list, a non-str argument, a NUL...
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise PolicyError("command must be a non-empty list of strings, e.g. ['python3', 'main.py']")
    if len(value) > MAX_ARGS:
        raise PolicyError(f"command has {len(value)} arguments; the limit is {MAX_ARGS}")
    out = [text(arg, f"command[{i}]") for i, arg in enumerate(value)]
    if not out[0]:
        raise PolicyError("command[0] is empty: name the program to run, e.g. ['python3', 'main.py']")
    return out


_command = command  # run_args's parameter shadows the name


def run_args(*, command: Any, cwd: Any, env: Any = None, workspace: Any = None, workspace_base: Any = None,
             inputs: Any = (), bwrap: Any = None) -> list[str]:
    """Check the arguments of :func:`lowlevel.run` that become paths or argv strings.

    Called by :class:`lowlevel.sandbox.launcher.Run` and by :func:`lowlevel.record.execute_recorded`
    before anything is created. (The environment's names and values are checked by
    :meth:`lowlevel.Policy.environment`.)

    Returns:
        The command as a list.
    Raises:
        PolicyError: the first bad value, named.
    """
    from collections.abc import Mapping

    sandbox_cwd(cwd, "cwd")
    if env is not None and not isinstance(env, Mapping):
        raise PolicyError(f"env must be a mapping of str to str, got {type(env).__name__}")
    if workspace is not None:
        host_path(workspace, "workspace")
    if workspace_base is not None:
        host_path(workspace_base, "workspace_base")
    if bwrap is not None:
        host_path(bwrap, "bwrap")
    if isinstance(inputs, (str, bytes, os.PathLike)) or not isinstance(inputs, (Sequence, tuple)):
        raise PolicyError("inputs must be a list of paths, e.g. ['main.py'], not one path")
    for i, item in enumerate(inputs):
        if isinstance(item, tuple):  # (host path, dest relative to the workspace)
            if len(item) != 2:
                raise PolicyError(f"inputs[{i}] must be a path or a (path, dest) pair, got {item!r:.80}")
            host_path(item[0], f"inputs[{i}][0]")
            text(item[1], f"inputs[{i}][1]", max_bytes=MAX_PATH_BYTES - 1, empty=False)
        else:
            host_path(item, f"inputs[{i}]")
    return _command(command)

__all__ = ["CWD_ALLOWED", "CWD_FORBIDDEN", "MAX_ARGS", "MAX_ARG_BYTES", "MAX_ENV", "MAX_PATH_BYTES", "command",
           "env_name", "host_path", "run_args", "sandbox_cwd", "sandbox_path", "text"]
