"""Capability probes of the host, each run once per process and cached.

Glossary:
    usr-merged: a host whose ``/bin``, ``/sbin``, ``/lib*`` are symlinks into ``/usr``
        (Debian >= 12, Fedora, Arch). On such hosts the sandbox gets the same symlinks; on
        others the directories are bound read-only.
    setuid bwrap: a bwrap installed setuid root (old distributions). It refuses
        ``--disable-userns`` and cannot be trusted with ``--userns``-style options.

Source: bwrap(1); bubblewrap NEWS for the version each option arrived in.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat

from lowlevel._dataclass import dataclass
from lowlevel.errors import BwrapNotFoundError, LaunchError, UnsupportedError

#: Top-level directories that usr-merged hosts make symlinks into /usr.
MERGED_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True)
class BwrapInfo:
    """What the installed bwrap is and can do.

    Attributes:
        path: absolute path of the bwrap executable.
        version: ``(major, minor, patch)``, e.g. ``(0, 8, 0)``.
        setuid: the executable has the setuid bit (then ``--disable-userns`` is refused).
        options: the long options ``bwrap --help`` lists, e.g. ``frozenset({"--size", ...})``.
    """

    path: str
    version: tuple[int, int, int]
    setuid: bool
    options: frozenset[str]

    def has(self, option: str) -> bool:
        """Return True when ``bwrap --help`` lists ``option`` (e.g. ``"--disable-userns"``)."""
        return option in self.options

    @property
    def can_disable_userns(self) -> bool:
        """``--disable-userns`` works: bwrap >= 0.8.0, listed in --help, and not setuid."""
        return self.has("--disable-userns") and not self.setuid


def _which(name: str) -> str | None:
    """:func:`shutil.which` for a bare name on ``$PATH`` (default ``os.defpath``), without
    importing shutil (which imports bz2, lzma and zlib: ~1 ms at each CLI start)."""
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        cand = os.path.join(d or ".", name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


@functools.lru_cache(maxsize=None)
def bwrap_info(path: str | None = None) -> BwrapInfo:
    """Find bwrap and read its version and options (once per process and path; across
    processes from :mod:`lowlevel.host.hostcache`, keyed by the executable's path, mtime, size,
    inode and mode, so an upgraded bwrap is probed again).

    Args:
        path: an explicit bwrap path, or None to search ``PATH`` (then ``/usr/bin/bwrap``).
    Returns:
        A :class:`BwrapInfo`.
    Raises:
        BwrapNotFoundError: no bwrap executable (install the ``bubblewrap`` package).
        UnsupportedError: bwrap exists but its version could not be read.
    """
    exe = path or _which("bwrap") or ("/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None)
    if not exe or not os.access(exe, os.X_OK):
        raise BwrapNotFoundError(
            "bwrap (bubblewrap) not found on PATH: install it, e.g. `apt-get install bubblewrap`",
            argv=["bwrap"],
        )
    exe = os.path.realpath(exe)
    from lowlevel.host import hostcache
    key = hostcache.file_key(exe)
    cached = hostcache.get("host", f"bwrap:{exe}", key) if key is not None else None
    if isinstance(cached, dict) and key is not None:
        try:
            v = [int(x) for x in cached["version"]]
            opts = frozenset(str(o) for o in cached["options"])
            if len(v) == 3:
                return BwrapInfo(path=exe, version=(v[0], v[1], v[2]), setuid=bool(key[4] & stat.S_ISUID),
                                 options=opts)
        except (KeyError, TypeError, ValueError):
            pass
    import subprocess
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10, env={})
        helptext = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=10, env={})
    except OSError as err:
        if err.errno == errno.EAGAIN:
            raise LaunchError(f"cannot start {exe} --version: {err.strerror}: the caller's process limit is reached "
                              "(RLIMIT_NPROC, `ulimit -u`, or the cgroup's pids.max). Raise it, or run fewer "
                              "sandboxes at once", argv=[exe], errno=err.errno) from err
        raise BwrapNotFoundError(f"cannot execute {exe}: {err.strerror}", argv=[exe],
                                 errno=err.errno) from err
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out.stdout + out.stderr)
    if not m:
        raise UnsupportedError("bwrap", f"cannot parse `{exe} --version` output: {out.stdout!r}")
    version = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    options = frozenset(re.findall(r"^\s+(--[a-z0-9-]+)", helptext.stdout + helptext.stderr, re.M))
    st = os.stat(exe)
    if key is not None and hostcache.file_key(exe) == key:
        hostcache.put("host", f"bwrap:{exe}", key, {"version": list(version), "options": sorted(options)})
    return BwrapInfo(path=exe, version=version, setuid=bool(st.st_mode & stat.S_ISUID), options=options)


@dataclass(frozen=True)
class HostLayout:
    """How the host's root is laid out, for building the read-only base.

    Attributes:
        symlinks: ``(target, name)`` pairs for usr-merged top-level dirs, e.g. ``("usr/bin", "/bin")``.
        ro_dirs: top-level dirs that are real directories and must be bound read-only.
        etc_files: ``/etc`` entries that exist and that interpreters need (bound read-only).
    """

    symlinks: tuple[tuple[str, str], ...]
    ro_dirs: tuple[str, ...]
    etc_files: tuple[str, ...]


#: /etc entries bound read-only when present. Decided by running python3, node, git, gcc and sh
#: under a bare sandbox: none of them *needs* /etc to start, but without these the dynamic
#: loader ignores its cache (slower start), ``/etc/alternatives`` links (cc, editor, awk...)
#: dangle, and TLS/locale lookups fail. No file here holds a secret: /etc/passwd and
#: /etc/group are synthesized per sandbox instead of bound (they list host accounts).
ETC_ENTRIES = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/mime.types",
)


@functools.lru_cache(maxsize=None)
def host_layout() -> HostLayout:
    """Detect usr-merge and the /etc entries present (once per process)."""
    symlinks: list[tuple[str, str]] = []
    ro_dirs: list[str] = []
    for name in MERGED_DIRS:
        path = "/" + name
        if os.path.islink(path):
            target = os.readlink(path)
            real = os.path.realpath(path)
            if real.startswith("/usr/") and os.path.isdir(real):
                symlinks.append((target, path))
            else:
                ro_dirs.append(real if os.path.isdir(real) else path)
        elif os.path.isdir(path):
            ro_dirs.append(path)
    etc = tuple(p for p in ETC_ENTRIES if os.path.exists(p))
    return HostLayout(symlinks=tuple(symlinks), ro_dirs=tuple(ro_dirs), etc_files=etc)


@functools.lru_cache(maxsize=None)
def pidfd_supported() -> bool:
    """True when ``os.pidfd_open`` works here (Linux >= 5.3, Python >= 3.9)."""
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    os.close(fd)
    return True


def require_pidfd() -> None:
    """Raise UnsupportedError unless pidfds work (Linux >= 5.3)."""
    if not pidfd_supported():
        raise UnsupportedError("pidfd", "pidfd_open(2) is not available", "use Linux >= 5.3")


__all__ = ["BwrapInfo", "HostLayout", "bwrap_info", "host_layout", "pidfd_supported", "require_pidfd"]
