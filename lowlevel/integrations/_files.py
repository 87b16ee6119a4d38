"""Reading and writing files of a live session from *inside* it, with errno-precise errors.

The adapters read and write paths the way the sandbox sees them (``/workspace/...``, ``/tmp/...``)
by running small POSIX ``sh`` scripts in the session: the sandbox's own uid owns what it writes,
any path of its file tree works (``/tmp`` is a tmpfs the host cannot reach by path), and no
host-side path walk ever follows a link the sandboxed code planted. Errors come back as exit
codes ``100 + errno`` and become the matching :class:`OSError` subclass
(``FileNotFoundError``, ``IsADirectoryError``, ``PermissionError``...).

A file is read in chunks no larger than the session's stdout cap (``Policy.stdout_limit_bytes``),
so a file larger than the cap still arrives whole and nothing is silently truncated.
"""

from __future__ import annotations

import errno
import os
import posixpath
from collections.abc import Awaitable, Callable, Sequence

from lowlevel.sandbox.result import Result

#: Where relative paths resolve: the session's workspace as seen inside.
WORKSPACE = "/workspace"
#: Environment for the helper scripts: C messages (parsed as a fallback), a fixed PATH.
SCRIPT_ENV = {"LC_ALL": "C", "PATH": "/usr/bin:/bin"}
_SH = "/bin/sh"

_WRITE = r"""
f=$1
case "$f" in */) exit 121;; esac
d=$(dirname -- "$f")
if [ ! -d "$d" ]; then
  if [ -e "$d" ] || [ -L "$d" ]; then exit 120; fi
  mkdir -p -- "$d" 2>/dev/null || { [ -d "$d" ] || exit 113; }
fi
[ -d "$f" ] && exit 121
if [ -e "$f" ]; then [ -w "$f" ] || exit 113; else [ -w "$d" ] || exit 113; fi
exec cat > "$f"
"""

_READ = r"""
f=$1
case "$f" in */) [ -d "$f" ] && exit 121;; esac
if [ ! -e "$f" ]; then exit 102; fi
[ -d "$f" ] && exit 121
[ -f "$f" ] || exit 122
[ -r "$f" ] || exit 113
size=$(stat -L -c %s -- "$f") || exit 1
echo "$size" >&2
[ "$size" -gt "$2" ] && exit 127
exec head -c "$3" -- "$f"
"""

_READ_MORE = r"""tail -c +"$2" -- "$1" | head -c "$3" """

#: Fallback: a message the failing tool printed (C locale) -> errno.
_MESSAGES = {os.strerror(e): e for e in (errno.ENOENT, errno.EACCES, errno.EISDIR, errno.ENOTDIR, errno.EROFS,
                                          errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ELOOP,
                                          errno.ENAMETOOLONG)}
_MESSAGES["Read-only file system"] = errno.EROFS


def resolve(path: str, cwd: str = WORKSPACE) -> str:
    """``path`` as the sandbox sees it: relative paths resolve against ``cwd``.

    Raises:
        ValueError: an empty path or one with a NUL byte.
    """
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"invalid path {path!r}: give a non-empty path without NUL bytes")
    return path if path.startswith("/") else posixpath.join(cwd, path)


def is_directory_alias(path: str) -> bool:
    """True for ``.``/``..`` (with or without a trailing slash): always a directory."""
    return posixpath.basename(path.rstrip("/")) in (".", "..")


def oserror(code: int, path: str, detail: str = "") -> OSError:
    """The :class:`OSError` subclass for ``code`` (``OSError(errno.ENOENT, ...)`` *is* a
    FileNotFoundError); EROFS becomes a PermissionError (the caller may not write there)."""
    message = os.strerror(code) + (f": {detail}" if detail else "")
    if code == errno.EROFS:
        return PermissionError(code, message, path)
    return OSError(code, message, path)


def _error(result: Result, path: str, what: str) -> OSError:
    status = result.exit_code
    if result.killed_by == "memory":
        # Before the 100 + errno codes: 137 is SIGKILL, not ENOLCK. The note says why (the files
        # in the tmpfs layers count against memory_bytes) and what to raise.
        note = next((n for n in reversed(result.notes) if "OOM killer" in n), "")
        return OSError(errno.ENOMEM, f"{what} failed in the sandbox: killed by the memory limit"
                       + (f": {note}" if note else ""), path)
    if 100 < status < 100 + 134:
        return oserror(status - 100, path)
    text = result.stderr.decode("utf-8", "replace")
    for message, code in _MESSAGES.items():
        if message in text:
            return oserror(code, path)
    if result.killed_by or result.timed_out:
        detail = f"killed ({result.killed_by or 'timeout'})"
    else:
        detail = f"exit status {status}: {text.strip()[-500:]}"
    return OSError(errno.EIO, f"{what} failed in the sandbox: {detail}", path)


def write_argv(path: str) -> list[str]:
    """argv that writes its stdin to ``path`` (absolute), creating parent directories."""
    return [_SH, "-c", _WRITE, "sh", path]


def check_write(result: Result, path: str) -> None:
    """Raise the OSError a failed write reported (IsADirectoryError, PermissionError, ...)."""
    if result.exit_code != 0:
        raise _error(result, path, "write_file")


class FileTooLargeError(Exception):
    """The file is larger than the caller's cap; ``size`` in bytes (-1: it grew while read)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


RunFn = Callable[[Sequence[str]], Awaitable[Result]]


async def read_file(run: RunFn, path: str, max_bytes: int, chunk_bytes: int) -> bytes:
    """Read ``path`` (absolute) through ``run`` (an AsyncSession's run with stdin/env bound).

    Args:
        run: runs an argv in the session and returns its Result.
        path: absolute path inside the sandbox.
        max_bytes: refuse files larger than this.
        chunk_bytes: largest stdout one command may produce (the session's stdout cap).
    Raises:
        FileTooLargeError: the file is larger than ``max_bytes``.
        OSError: FileNotFoundError, IsADirectoryError, PermissionError, or EINVAL (not a
            regular file: a fifo or a device is never read).
    """
    chunk_bytes = max(1, chunk_bytes)
    first = min(chunk_bytes, max_bytes + 1)
    result = await run([_SH, "-c", _READ, "sh", path, str(max_bytes), str(first)])
    if result.exit_code == 127 and result.stderr.split(b"\n")[0].strip().isdigit():
        raise FileTooLargeError(int(result.stderr.split(b"\n")[0]))
    if result.exit_code != 0:
        raise _error(result, path, "read_file")
    data = bytearray(result.stdout)
    target = min(int(result.stderr.split(b"\n")[0]), max_bytes + 1)
    while len(data) < target:
        want = min(chunk_bytes, max_bytes + 1 - len(data))
        result = await run([_SH, "-c", _READ_MORE, "sh", path, str(len(data) + 1), str(want)])
        if result.exit_code != 0:
            raise _error(result, path, "read_file")
        if not result.stdout:
            break  # it shrank while we read
        data += result.stdout
    if len(data) > max_bytes:
        raise FileTooLargeError(-1)
    return bytes(data)
