"""Where lowlevel's own files are: the package directory and the native executables in it.

The static executables (``native/*.c``, built by ``setup.py``; the CFFI extension is ``lowlevel/host/_native*.so``)
live at the top of the package whichever subpackage uses them; every module finds them here.
Also the caller's own cache directory (:func:`cache_dir`), at the bottom of the layers so that
every layer may cache (:mod:`lowlevel.host.hostcache`, :mod:`lowlevel._dataclass`).
"""
from __future__ import annotations

import os
import stat
import threading

#: The ``lowlevel`` package directory (absolute).
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def native(name: str) -> str:
    """Absolute path of the file ``name`` at the top of the package (``_lowlevel_guard``...)."""
    return os.path.join(PACKAGE_DIR, name)


def cache_enabled() -> bool:
    """False when ``LOWLEVEL_NO_CACHE`` is set (to anything non-empty): no on-disk cache at all
    (host facts, :mod:`lowlevel.host.hostcache`; dataclass code, :mod:`lowlevel._dataclass`)."""
    return not os.environ.get("LOWLEVEL_NO_CACHE")


def cache_dir(create: bool = True) -> str | None:
    """lowlevel's per-caller cache directory (made 0700 when missing), or None when there is none we trust.

    Root ``/run/lowlevel/cache`` (tmpfs: gone at reboot); others ``$XDG_RUNTIME_DIR/lowlevel``
    when that is set and ours, else ``~/.cache/lowlevel``; ``LOWLEVEL_CACHE_DIR`` overrides. The
    directory must be ours (the caller's euid) and mode 0700: what is cached there (a compiled
    seccomp filter, code objects) is trusted as much as lowlevel's own files.
    """
    path = configured_cache_dir()
    if path is None:
        return None
    if create:
        try:
            os.makedirs(path, 0o700, exist_ok=True)
        except OSError:
            return None
    return path if _ours(path, directory=True, private=True) else None


def configured_cache_dir() -> str | None:
    """The path :func:`cache_dir` would use (None: the cache is off or has no place), whether or
    not it exists or is trusted: what a workspace must not contain
    (:func:`lowlevel.workspace.checks.check_workspace_path`)."""
    if not cache_enabled():
        return None
    path = os.environ.get("LOWLEVEL_CACHE_DIR")
    if path:
        return path
    if os.geteuid() == 0:
        return "/run/lowlevel/cache"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _ours(runtime, directory=True):
        return os.path.join(runtime, "lowlevel")
    if os.environ.get("HOME"):
        return os.path.join(os.environ["HOME"], ".cache", "lowlevel")
    return None


def _ours(path: str, *, directory: bool, private: bool = False) -> bool:
    """``path`` (not a symlink) belongs to us and nobody else may write it (``private``: 0700)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    mode = stat.S_IMODE(st.st_mode)
    return kind_ok and st.st_uid == os.geteuid() and not mode & (0o077 if private else 0o022)


def read_cache_file(name: str, max_bytes: int) -> bytes | None:
    """The bytes of ``name`` in :func:`cache_dir` when we may trust them, else None.

    Trusted: a regular file (the last component opened with ``O_NOFOLLOW``), owned by our euid,
    not writable by group or others, at most ``max_bytes``: what the cache holds (a compiled
    seccomp filter, code objects) is trusted as much as lowlevel's own files. Never raises.
    """
    d = cache_dir(create=False)
    if d is None:
        return None
    try:
        fd = os.open(os.path.join(d, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
                and st.st_size <= max_bytes):
            return None
        return os.read(fd, st.st_size + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def write_cache_file(name: str, data: bytes) -> bool:
    """Replace ``name`` in :func:`cache_dir` (made 0700 when missing) by ``data``, atomically: a
    private temporary file (``O_EXCL | O_NOFOLLOW``, 0600) renamed over it, so a reader sees the old
    file or the new one, never half. False (nothing left behind) when there is no trusted cache
    directory or a write failed; never raises."""
    d = cache_dir()
    if d is None:
        return False
    path = os.path.join(d, name)
    try:
        write_private_atomically(path, data, f"{path}.{os.getpid()}.{threading.get_ident()}.tmp", exclusive=True)
        return True
    except OSError:
        return False


def write_private_atomically(path: str, data: bytes, tmp: str, *, exclusive: bool) -> None:
    """Write ``data`` to the new private file ``tmp`` (0600, ``O_NOFOLLOW``; ``exclusive``:
    ``O_EXCL``, else ``O_TRUNC`` over a stale one) and rename it over ``path``: a reader sees the
    old file or the whole new one. Raises OSError after removing ``tmp``. Used by
    :func:`write_cache_file` and the record's input store (lowlevel/record/hashing.py)."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC) | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def unreachable(path: str) -> tuple[int, str] | None:
    """None when host path ``path`` exists (``lstat``: a symlink counts), else
    :func:`reach_error` of the failure. So a message says "does not exist" only when that is so
    (``--workspace /proc/1/cwd`` as a user said it of a directory that was only out of reach)."""
    try:
        os.lstat(path)
        return None
    except OSError as err:
        return reach_error(err)


def reach_error(err: OSError) -> tuple[int, str]:
    """``(errno, why)`` for a host path that failed with ``err``: ENOENT/ENOTDIR "does not
    exist", EACCES/EPERM "cannot be reached by this user (STRERROR): a directory on its way is
    not searchable, or it is another user's", anything else "cannot be reached (STRERROR)"."""
    import errno
    code = err.errno or errno.EIO
    if code in (errno.ENOENT, errno.ENOTDIR):
        return code, "does not exist"
    if code in (errno.EACCES, errno.EPERM):
        return code, (f"cannot be reached by this user ({err.strerror}): a directory on its way is not "
                      "searchable, or it is another user's")
    return code, f"cannot be reached ({err.strerror})"
