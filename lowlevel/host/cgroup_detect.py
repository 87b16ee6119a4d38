"""Which cgroup hierarchies this process may use, and a writable base in each: cgroup detection.

One concept: finding, once per process, where a run's cgroup can be made (:func:`detect_cgroups`),
including the v2 delegation dance (our own cgroup, a ``systemd-run --scope -p Delegate=yes``
scope) and the sweep of the empty run cgroups a killed caller left. The per-run cgroup itself is
:mod:`lowlevel.host.cgroups`; the file I/O is :mod:`lowlevel.host.cgroupfs`.

Glossary:
    cgroup: a kernel group of processes with shared accounting and limits. Version 1 has one
        hierarchy (mount) per controller or controller set, ``/sys/fs/cgroup/memory`` etc.;
        version 2 has a single hierarchy (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on
        "hybrid" hosts, whose v2 tree then carries only the controllers v1 left over).
    controller: ``memory``, ``pids``, ``cpu`` (limits), ``cpuacct`` and ``freezer`` (v1 only:
        CPU accounting and kill-all). v2 always offers CPU time (``cpu.stat``), ``cgroup.kill``
        (Linux 5.14) and ``cgroup.freeze`` (5.2) without any controller.
    base: the directory our runs are created under, never ``/`` itself: ``<our cgroup>/lowlevel``
        per v1 hierarchy; on v2 ``<root>/lowlevel`` or a delegated subtree (see
        :func:`detect_cgroups`).

Sources: cgroups(7); the kernel's Documentation/admin-guide/cgroup-v2.rst; systemd's
docs/CGROUP_DELEGATION.md; proc(5) (mountinfo).
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import sys
import threading
import time
from collections.abc import Callable

from lowlevel._dataclass import dataclass
from lowlevel.host import cgroupfs

TYPE_CHECKING = False
if TYPE_CHECKING:  # imported where used: subprocess costs ~1 ms at every import of lowlevel
    import subprocess

#: The cgroup controllers whose limits we write.
LIMIT_CONTROLLERS = ("memory", "pids", "cpu")

#: Name of our directory under the caller's cgroup (v1) or the v2 root.
BASE_NAME = "lowlevel"

@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy, as seen by this process.

    Attributes:
        version: 1 or 2.
        mount: mount point, e.g. ``/sys/fs/cgroup/memory`` or ``/sys/fs/cgroup/unified``.
        path: our own cgroup's directory in it (from /proc/self/cgroup).
        controllers: v1: the controllers bound to this mount; v2: those enabled for children of
            ``base`` (a subset of ``cgroup.controllers``), which run cgroups get.
        base: directory for run cgroups, or None when not writable.
        how: how ``base`` was obtained, or why there is none (one line, for reports).
    """

    version: int
    mount: str
    path: str
    controllers: frozenset[str]
    base: str | None
    how: str


@dataclass(frozen=True)
class CgroupSupport:
    """What cgroup hierarchies this process may use. From :func:`detect_cgroups`.

    Attributes:
        hierarchies: every v1 hierarchy carrying a controller we use, and the v2 hierarchy.
    """

    hierarchies: tuple[Hierarchy, ...] = ()

    @property
    def v2(self) -> Hierarchy | None:
        """The v2 hierarchy, writable or not; None when cgroup2 is not mounted."""
        return next((h for h in self.hierarchies if h.version == 2), None)

    @property
    def version(self) -> str | None:
        """``"v2"``, ``"v1"``, ``"hybrid"`` (both mounted) or None (no cgroups)."""
        versions = {h.version for h in self.hierarchies}
        return {frozenset({1}): "v1", frozenset({2}): "v2"}.get(frozenset(versions),
                                                                "hybrid" if versions else None)

    def hierarchy_for(self, controller: str) -> Hierarchy | None:
        """The writable hierarchy that offers ``controller``, v2 first; None if there is none."""
        for version in (2, 1):
            for h in self.hierarchies:
                if h.version == version and h.base is not None and controller in h.controllers:
                    return h
        return None

    @property
    def writable_controllers(self) -> frozenset[str]:
        """Controllers a run cgroup can use (``cpuacct``/``freezer`` count only on v1)."""
        return frozenset(c for h in self.hierarchies if h.base is not None for c in h.controllers)

    @property
    def usable(self) -> bool:
        """True when at least one hierarchy is writable, i.e. runs get a cgroup."""
        return any(h.base is not None for h in self.hierarchies)


def parse_mountinfo(text: str) -> list[tuple[str, str, str, str]]:
    """Return ``(root, mount_point, fstype, super_options)`` for each cgroup/cgroup2 mount.

    Source: proc(5), /proc/pid/mountinfo: fields after the ``-`` separator are fstype, source,
    super options; octal escapes (``\\040``) are decoded.
    """
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        def unescape(s: str) -> str:
            return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)
        out.append((unescape(fields[3]), unescape(fields[4]), tail[0], tail[2]))
    return out


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """Map ``/proc/self/cgroup`` to ``{controller_list: path}``; v2's key is ``""``.

    Source: cgroups(7), "/proc/[pid]/cgroup": ``hierarchy-ID:controller-list:cgroup-path``.
    """
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[parts[1]] = parts[2]
    return out


#: Controllers that make a v1 hierarchy worth using.
_V1_USED = frozenset({"memory", "pids", "cpu", "cpuacct", "freezer"})

_detect_lock = threading.Lock()
_detected: CgroupSupport | None = None
_holder: subprocess.Popen[bytes] | None = None  # process keeping a systemd-run scope alive


def detect_cgroups(*, refresh: bool = False, sweep: bool = True) -> CgroupSupport:
    """Find the cgroup hierarchies and prepare a writable base in each; cached per process.

    Probes by doing: creates ``<our cgroup>/lowlevel`` in each v1 hierarchy we use (``memory``,
    ``pids``, ``cpu``, ``cpuacct``, ``freezer``) and on v2 enables controllers in
    ``cgroup.subtree_control``. Empty run cgroups left by dead processes of an earlier crash
    are removed. v2 bases, in order:

    1. our cgroup is the root of the hierarchy (root on a host without systemd, a container
       with its own cgroup namespace): ``<root>/lowlevel``;
    2. our cgroup is ours (the root of our cgroup namespace, i.e. a container's; or delegated:
       writable and owned by our non-root uid, or marked with the ``trusted.delegate`` xattr
       systemd >= 251 sets) and we are its only process: we move ourselves into
       ``<our cgroup>/supervisor`` to obey the "no internal processes" rule, then use
       ``<our cgroup>/lowlevel``;
    3. ``systemd-run [--user] --scope -p Delegate=yes`` gives a fresh delegated scope, kept by
       a small holder process that exits when this process does (its stdin is our pipe);
       ``<scope>`` is the base, the holder moves to ``<scope>/holder``;
    4. our cgroup is ours but shared with other processes: ``<our cgroup>/lowlevel`` without
       controllers (kill and CPU time only);
    5. otherwise v2 is not writable and only v1 (if any) or rlimits apply.

    A v2 base without controllers still gives ``cgroup.kill``, ``cgroup.freeze`` and CPU time
    (``cpu.stat``), as on hybrid hosts where v1 holds memory, pids and cpu.

    Args:
        refresh: detect again instead of returning the cached answer.
        sweep: remove the empty run cgroups of dead callers found under the bases (the default).
            ``lowlevel doctor`` and ``cleanup --dry-run`` pass False: they only look.
    Returns:
        A :class:`CgroupSupport`; never raises for a host without cgroups.
    """
    global _detected
    with _detect_lock:
        if _detected is None or refresh:
            try:
                mountinfo = cgroupfs.read("/proc/self/mountinfo")
                own = cgroupfs.read("/proc/self/cgroup")
            except OSError:
                _detected = CgroupSupport()
            else:
                _detected = _detect(mountinfo, own, sweep=sweep)
        return _detected


def _detect(mountinfo: str, proc_cgroup: str, *, euid: int | None = None, pid: int | None = None,
            delegate: Callable[[str, bool], tuple[str, int] | None] | None = None,
            sweep: bool = True) -> CgroupSupport:
    """:func:`detect_cgroups` on given texts; tests pass a fake cgroupfs through ``mountinfo``."""
    euid = os.geteuid() if euid is None else euid
    pid = os.getpid() if pid is None else pid
    delegate = _systemd_delegate if delegate is None else delegate
    own = parse_proc_cgroup(proc_cgroup)
    hierarchies: list[Hierarchy] = []
    seen: set[str] = set()
    for root, mount, fstype, options in parse_mountinfo(mountinfo):
        if fstype == "cgroup2":
            if "" not in own or "v2" in seen:
                continue
            seen.add("v2")
            path = _own_dir(mount, root, own[""])
            hierarchies.append(_prepare_v2(mount, path, euid=euid, pid=pid, delegate=delegate,
                                           own_path=own[""], sweep=sweep))
            continue
        controllers = frozenset(options.split(",")) & _V1_USED
        if not controllers or mount in seen:
            continue
        key = next((k for k in own if k and frozenset(k.split(",")) & controllers), None)
        if key is None:
            continue
        seen.add(mount)
        path = _own_dir(mount, root, own[key])
        base = os.path.join(path, BASE_NAME)
        try:
            cgroupfs.mkdir(base, exist_ok=True)
            if not os.access(base, os.W_OK | os.X_OK):  # made earlier by another user (root)
                raise PermissionError(errno.EACCES, "not writable by us")
        except OSError as err:
            hierarchies.append(Hierarchy(1, mount, path, controllers, None,
                                         f"mkdir {base}: {err.strerror}"))
            continue
        if sweep:
            _sweep(base)
        hierarchies.append(Hierarchy(1, mount, path, controllers, base, "our cgroup"))
    return CgroupSupport(tuple(hierarchies))


def _own_dir(mount: str, mount_root: str, own_path: str) -> str:
    """Our cgroup's directory: /proc/self/cgroup's path made relative to the mount's root."""
    if mount_root != "/" and (own_path == mount_root or own_path.startswith(mount_root + "/")):
        own_path = own_path[len(mount_root):]
    return os.path.normpath(os.path.join(mount, own_path.lstrip("/")))


def _prepare_v2(mount: str, path: str, *, euid: int, pid: int,
                delegate: Callable[[str, bool], tuple[str, int] | None], own_path: str = "",
                sweep: bool = True) -> Hierarchy:
    wanted = cgroupfs.read_words(os.path.join(path, "cgroup.controllers")) & set(LIMIT_CONTROLLERS)
    is_real_root = not os.path.exists(os.path.join(path, "cgroup.type"))  # the root has none
    writable = os.access(os.path.join(path, "cgroup.procs"), os.W_OK)
    # "/" of a cgroup namespace (a container's own cgroup) is ours like a delegated one.
    ours = own_path == "/" or _delegated(path, euid)
    if writable and is_real_root:
        # The root cgroup may hold processes and have controllers enabled for children.
        return _v2_base(mount, path, os.path.join(path, BASE_NAME), wanted, "root cgroup", sweep)
    if writable and ours and cgroupfs.read_ints(os.path.join(path, "cgroup.procs")) == [pid]:
        leaf = os.path.join(path, "supervisor")
        try:
            cgroupfs.mkdir(leaf, exist_ok=True)
            cgroupfs.write(os.path.join(leaf, "cgroup.procs"), str(pid))
        except OSError as err:
            return Hierarchy(2, mount, path, frozenset(), None,
                             f"cannot move ourselves to {leaf}: {err.strerror}")
        return _v2_base(mount, path, os.path.join(path, BASE_NAME), wanted,
                        "delegated own cgroup (we moved to its supervisor/ leaf)", sweep)
    got = delegate(mount, euid != 0)
    if got is not None:
        scope, holder_pid = got
        wanted = cgroupfs.read_words(os.path.join(scope, "cgroup.controllers")) & set(LIMIT_CONTROLLERS)
        leaf = os.path.join(scope, "holder")
        try:
            cgroupfs.mkdir(leaf, exist_ok=True)
            cgroupfs.write(os.path.join(leaf, "cgroup.procs"), str(holder_pid))
        except OSError as err:
            return Hierarchy(2, mount, path, frozenset(), None,
                             f"systemd-run scope {scope}: cannot move the holder: {err.strerror}")
        return _v2_base(mount, scope, scope, wanted, "systemd-run --scope -p Delegate=yes", sweep)
    if writable and ours:
        # Other processes share our cgroup, so no controller can be enabled below it ("no
        # internal processes"); child cgroups without controllers still give kill and CPU time.
        return _v2_base(mount, path, os.path.join(path, BASE_NAME), set(),
                        "own cgroup shared with other processes: no controllers, kill and CPU time only", sweep)
    return Hierarchy(2, mount, path, frozenset(), None,
                     "not writable: run as root, or in a delegated cgroup (systemd-run --user "
                     "--scope -p Delegate=yes), or with a systemd user manager")


def _v2_base(mount: str, parent: str, base: str, wanted: set[str], how: str, sweep: bool = True) -> Hierarchy:
    """Create ``base`` under ``parent`` and enable ``wanted`` controllers for its children."""
    enabled = set()
    try:
        if base != parent:
            _enable(parent, wanted)
            cgroupfs.mkdir(base, exist_ok=True)
        enabled = _enable(base, wanted & cgroupfs.read_words(os.path.join(base, "cgroup.controllers")))
    except OSError as err:
        return Hierarchy(2, mount, parent, frozenset(), None, f"{how}: {base}: {err.strerror}")
    if sweep:
        _sweep(base)
    return Hierarchy(2, mount, parent, frozenset(enabled), base, how)


def _enable(cgroup: str, controllers: set[str]) -> set[str]:
    """Enable ``controllers`` in ``cgroup.subtree_control`` one by one; return those enabled."""
    control = os.path.join(cgroup, "cgroup.subtree_control")
    for name in sorted(controllers - cgroupfs.read_words(control)):
        try:
            cgroupfs.write(control, "+" + name)
        except OSError:
            pass  # EBUSY (processes inside), ENOENT (not offered): the controller stays off
    return controllers & cgroupfs.read_words(control)


def _delegated(path: str, euid: int) -> bool:
    """True if ``path`` is delegated to us: owned by our non-root uid, or marked by systemd."""
    try:
        if euid != 0 and os.stat(path).st_uid == euid:
            return True
        for attr in ("trusted.delegate", "user.delegate"):
            try:
                if os.getxattr(path, attr) == b"1":
                    return True
            except OSError:
                pass
    except OSError:
        pass
    return False


#: Exists when systemd is PID 1 (sd_booted(3)); without it systemd-run cannot work.
_SYSTEMD_BOOTED = "/run/systemd/system"

_HOLDER = ("import sys; sys.stdout.write(open('/proc/self/cgroup').read() + '.\\n'); "
           "sys.stdout.flush(); sys.stdin.read()")


def _systemd_delegate(mount: str, user: bool) -> tuple[str, int] | None:
    """Obtain a delegated v2 scope from systemd, once per process; return ``(dir, holder pid)``.

    The holder (``python -c``) runs in the scope until its stdin, our pipe, closes: at our exit,
    even by SIGKILL. ``--collect`` then lets systemd remove the scope and its subtree.
    """
    global _holder
    import shutil
    import subprocess
    exe = shutil.which("systemd-run")
    if exe is None or not os.path.isdir(_SYSTEMD_BOOTED):
        return None
    argv = [exe, *(["--user"] if user else []), "--scope", "--quiet", "--collect",
            "-p", "Delegate=yes", f"--unit=lowlevel-{os.getpid()}-{os.urandom(4).hex()}",
            "--", sys.executable, "-c", _HOLDER]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None
    assert proc.stdout is not None
    out = b""
    deadline = time.monotonic() + 5.0
    import selectors
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not out.endswith(b".\n") and time.monotonic() < deadline:
            if sel.select(max(0.0, deadline - time.monotonic())):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                out += chunk
    proc.stdout.close()
    rel = parse_proc_cgroup(out.decode(errors="replace")).get("")
    if rel is None or not rel.endswith(".scope"):
        _stop_holder(proc)
        return None
    scope = os.path.join(mount, rel.lstrip("/"))
    if not os.access(os.path.join(scope, "cgroup.procs"), os.W_OK):
        _stop_holder(proc)
        return None
    _holder = proc
    atexit.register(_stop_holder, proc)
    return scope, proc.pid


def _stop_holder(proc: subprocess.Popen[bytes]) -> None:
    import subprocess
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: Run names that carry their creator's PID: our default ``<pid>-<n>-<hex>`` and ``run-<pid>-<...>``.
RUN_NAME = re.compile(r"^(?:run-)?(\d+)-[0-9A-Za-z_.-]+\Z")


def _sweep(base: str) -> None:
    """Remove empty run cgroups of processes that no longer exist (a caller killed mid-run).

    Only empty directories go (rmdir(2) refuses the others). A caller in another PID namespace
    sharing this base is invisible here: its run cgroup could be removed between its create and
    its anchor's join, and the join then fails with ENOENT (a LaunchError, never a run without limits).
    """
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        m = RUN_NAME.match(name)
        if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
            rmtree_empty(os.path.join(base, name))


def rmtree_empty(path: str) -> None:
    """rmdir(2) ``path`` and its child cgroups, deepest first; populated ones stay.

    A cgroup directory holds only kernel files besides its children, so rmdir needs no unlink;
    a child still holding a task refuses (EBUSY), and so does every ancestor: left for its
    sandbox to die (--die-with-parent) and the next sweep.
    """
    for parent, dirs, _files in os.walk(path, topdown=False):
        for d in dirs:
            try:
                cgroupfs.rmdir(os.path.join(parent, d))
            except OSError:
                pass
    try:
        cgroupfs.rmdir(path)
    except OSError:
        pass


__all__ = ["BASE_NAME", "CgroupSupport", "Hierarchy", "LIMIT_CONTROLLERS", "RUN_NAME", "detect_cgroups",
           "parse_mountinfo", "parse_proc_cgroup", "rmtree_empty"]
