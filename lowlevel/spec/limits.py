"""Resource limits for one sandboxed run: rlimits through prlimit(2), and a per-run cgroup.

Glossary:
    rlimit: a per-process ``(soft, hard)`` pair (getrlimit(2)), inherited across fork and exec.
        We set them on bwrap's child with ``resource.prlimit`` while it waits on ``--block-fd``,
        so the program inherits them before its first instruction.
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
    run cgroup: ``<base>/<name>`` in every hierarchy a run needs; created before bwrap starts,
        removed after it ends (:class:`RunCgroup`).

Order of use in the launcher (nothing of the program runs before its limits apply)::

    plan = enforcement_plan(limits)            # UnsupportedError for an unmet ``require``
    cgroup = RunCgroup.create(limits)          # None: no writable hierarchy, rlimits only
    try:
        spawn bwrap --info-fd/--json-status-fd ... --block-fd FD
        pid = child-pid from the info JSON
        if cgroup: cgroup.attach(pid)
        applied = apply_rlimits(pid, limits, cgroup)
        release the block fd; supervise (call cgroup.sample() now and then)
        stats = cgroup.stats() if cgroup else None
    finally:
        if cgroup: cgroup.kill_all(); cgroup.remove()

Sources: getrlimit(2), prlimit(2), cgroups(7); the kernel's
Documentation/admin-guide/cgroup-v2.rst and Documentation/admin-guide/cgroup-v1/{memory,pids,
freezer-subsystem,cpuacct}.rst; systemd's docs/CGROUP_DELEGATION.md.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import math
import os
import re
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: subprocess costs ~1 ms at every import of lowlevel
    import subprocess

from lowlevel.errors import LaunchError, PolicyError, UnsupportedError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Names accepted in :attr:`Limits.require`.
REQUIRABLE = ("cgroup", "cpu", "memory", "pids")

#: The cgroup controllers whose limits we write.
LIMIT_CONTROLLERS = ("memory", "pids", "cpu")

#: Name of our directory under the caller's cgroup (v1) or the v2 root.
BASE_NAME = "lowlevel"

#: Period written with a CPU quota: 100 ms, the kernel's default ``cpu.cfs_period_us``.
CPU_PERIOD_US = 100_000

_INT_MAX = 2**63 - 1

#: The workspace bound when ``Limits.workspace_bytes`` is None: the size of the tmpfs holding the
#: copy-on-write upper layer. The same value as :data:`lowlevel.workspace.cow.DEFAULT_UPPER_BYTES` (a unit
#: test checks; cow.py is not imported here: it is not needed for a run without the overlay).
DEFAULT_WORKSPACE_BYTES = 1 * GiB

#: Default ``Limits.tmp_size_bytes``: the size of ``/tmp`` and, separately, of ``/dev/shm``.
DEFAULT_TMP_SIZE_BYTES = 256 * MiB

#: The program's own share of the default memory limit (heap, stacks, page cache, the kernel's
#: memory for it): what is left when every tmpfs layer is full.
PROGRAM_MEMORY_BYTES = 1 * GiB

#: Default ``Limits.memory_bytes``, 2.5 GiB: :data:`PROGRAM_MEMORY_BYTES` plus the default tmpfs
#: bounds (workspace 1 GiB, ``/tmp`` and ``/dev/shm`` 256 MiB each), whose pages are charged to
#: the run's memory cgroup. With the defaults a write past a tmpfs bound therefore gets ENOSPC
#: before the cgroup's OOM killer fires (issue 25: with 1 GiB for both, ``head -c 1500M
#: /dev/zero > big.bin`` was OOM-killed at 1 GiB of file instead of ENOSPC).
DEFAULT_MEMORY_BYTES = PROGRAM_MEMORY_BYTES + DEFAULT_WORKSPACE_BYTES + 2 * DEFAULT_TMP_SIZE_BYTES

#: Default ``Limits.fsize_bytes``, 2 GiB: above the default workspace bound, so a file that
#: fills the workspace meets ENOSPC, not SIGXFSZ.
DEFAULT_FSIZE_BYTES = 2 * GiB


# --------------------------------------------------------------------------------------------
# Limits: data and validation, no I/O
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run, in bytes and seconds. ``None`` means "no limit".

    Validated on construction; the defaults suit a tool call (a script, a compiler, a test run).

    Attributes:
        cpu_s: CPU seconds per process, ``RLIMIT_CPU``: soft ``ceil(cpu_s)`` delivers SIGXCPU,
            hard one second later SIGKILL. Per *process*, not per run: a program that forks N
            workers gets N times this. The cgroup's total (:meth:`RunCgroup.stats`) lets the
            supervisor enforce a per-run budget. The kernel checks it against utime+stime as
            sampled by the scheduler tick (posix-cpu-timers, ``CPUCLOCK_PROF``), so on a loaded
            or overcommitted host SIGXCPU can come when the exact runtime (the cgroup's) is
            still short of it: 0.87 s for ``cpu_s=1`` measured here at load average 9 on 2 CPUs.
        memory_bytes: memory of the whole run, the files it keeps in its RAM-backed tmpfs
            layers included: the workspace's copy-on-write upper (``workspace_bytes``), ``/tmp``
            and ``/dev/shm`` (``tmp_size_bytes`` each) are tmpfs pages charged to the run's memory
            cgroup like its heap (mm/shmem.c charges a page to the writer's cgroup). cgroup v2
            ``memory.max`` with ``memory.swap.max = 0``; v1 ``memory.limit_in_bytes`` and
            ``memory.memsw.limit_in_bytes`` where swap accounting exists. Past it the kernel's OOM
            killer kills a process of the run (``oom_kill`` in ``memory.events`` /
            ``memory.oom_control``): the program's (its processes get ``oom_score_adj`` 1000, so
            the victim is never bwrap or lowlevel's guard or Session init while a process of the
            program is there to kill; ``LOWLEVEL_NO_OOM_SCORE_ADJ=1`` in ``Policy.env`` turns
            that off, for tests), and the Result says ``killed_by="memory"`` whichever process
            died. The default, :data:`DEFAULT_MEMORY_BYTES` (2.5 GiB), is 1 GiB for the
            program plus the default tmpfs bounds (1 GiB + 256 MiB + 256 MiB), so with the defaults
            a write past a tmpfs bound meets ENOSPC before the memory limit; a smaller value (or
            larger bounds) lets a big write meet the memory limit first (:func:`tmpfs_bytes`
            gives the sum to stay above). Without a memory cgroup the fallback is ``RLIMIT_DATA`` at the
            same value, per process: since Linux 4.7 it counts every private writable mapping
            (heap and anonymous ``mmap``), so allocation fails (``ENOMEM``, ``MAP_FAILED``)
            instead of an OOM kill; unlike ``RLIMIT_AS`` it ignores ``PROT_NONE`` reservations,
            so node and the JVM still start.
        address_space_bytes: ``RLIMIT_AS``, per process, only when set. Trap: V8 (node) and the
            JVM reserve gigabytes of address space up front and fail to start under it.
        pids: processes and threads of the whole run, cgroup ``pids.max`` (bwrap's own init in
            the sandbox counts, so at least 2). Without a pids cgroup the fallback is
            ``RLIMIT_NPROC``, with traps: it counts every process of the real uid (since Linux 5.14
            per user namespace, through ucounts: inside bwrap's fresh user namespace that is
            just the sandbox), and it is not enforced at all for root in the initial user
            namespace or with ``CAP_SYS_RESOURCE``/``CAP_SYS_ADMIN`` (kernel/fork.c). It is
            therefore not set where the pids cgroup applies.
        fsize_bytes: largest file a process may write, ``RLIMIT_FSIZE``: a write past it raises
            SIGXFSZ (fatal unless handled; then ``EFBIG``). Per file, not a disk quota. The
            default, 2 GiB, is above the default workspace bound (1 GiB): a file that fills the
            workspace ends in ENOSPC, not SIGXFSZ (the kernel checks RLIMIT_FSIZE before it
            allocates, so at equal sizes SIGXFSZ would come first).
        nofile: open file descriptors per process, ``RLIMIT_NOFILE`` (at least 3).
        core_bytes: ``RLIMIT_CORE``; 0 disables core dumps.
        cpu_quota: CPU bandwidth in cores (0.5 = half a core), cgroup v2 ``cpu.max`` or v1
            ``cpu.cfs_quota_us`` over a 100 ms period. Throttles, never kills.
        tmp_size_bytes: size of the ``/tmp`` tmpfs (bwrap ``--size``, bwrap >= 0.5.0); used by the
            launcher, not here.
        workspace_bytes: total bytes a run (or a Session, in all) may write into its workspace:
            the size of the tmpfs holding the copy-on-write overlay's upper layer (ENOSPC
            inside beyond it; the host's disk is never used). None: the default,
            :data:`lowlevel.workspace.cow.DEFAULT_UPPER_BYTES` (1 GiB). Where the overlay is unavailable
            (the hand-over fallback) a value raises UnsupportedError.
        net_bytes: egress mode only (``Policy(network=Egress(...))``): payload bytes the run may
            move through the egress proxy, both directions and every connection together, or
            None. The connection that crosses it is cut after exactly this many bytes, the
            others are closed, later requests get 403; :attr:`lowlevel.Result.network` marks the
            cut connection ``error="net_bytes"``. Enforced by the host proxy, not the kernel.
        require: limits that must be enforced by the kernel, else :class:`UnsupportedError`
            before anything runs. Names: ``"memory"``, ``"pids"``, ``"cpu"`` (the cgroup limits
            of ``memory_bytes``, ``pids``, ``cpu_quota``) and ``"cgroup"`` (any per-run
            cgroup: kill-all and CPU accounting).

    Raises:
        PolicyError: a value of the wrong type or out of range; the message names the field.
    """

    cpu_s: float | None = 60.0
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES
    address_space_bytes: int | None = None
    pids: int | None = 256
    fsize_bytes: int | None = DEFAULT_FSIZE_BYTES
    nofile: int | None = 1024
    core_bytes: int = 0
    cpu_quota: float | None = None
    tmp_size_bytes: int | None = DEFAULT_TMP_SIZE_BYTES
    workspace_bytes: int | None = None
    net_bytes: int | None = None
    require: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_seconds("cpu_s", self.cpu_s, minimum=0.001)
        _check_int("memory_bytes", self.memory_bytes, minimum=1 * MiB)
        _check_int("address_space_bytes", self.address_space_bytes, minimum=1 * MiB)
        _check_int("pids", self.pids, minimum=2)
        # bwrap itself writes small files (/etc/passwd) under this limit on some paths.
        _check_int("fsize_bytes", self.fsize_bytes, minimum=4 * KiB)
        _check_int("nofile", self.nofile, minimum=3)
        _check_int("core_bytes", self.core_bytes, minimum=0, optional=False)
        _check_seconds("cpu_quota", self.cpu_quota, minimum=0.01, unit="cores")
        _check_int("tmp_size_bytes", self.tmp_size_bytes, minimum=4 * KiB)
        # The anchor sizes the upper tmpfs with at most 2^50 bytes (native/lowlevel_exec.c).
        _check_int("workspace_bytes", self.workspace_bytes, minimum=64 * KiB, maximum=1 << 50)
        _check_int("net_bytes", self.net_bytes, minimum=1)
        require = self.require
        if isinstance(require, str) or not isinstance(require, (tuple, list)):
            raise PolicyError(f"Limits.require must be a tuple of names from {REQUIRABLE}, "
                              f"got {require!r} (write require=({require!r},))")
        for name in require:
            if name not in REQUIRABLE:
                raise PolicyError(f"Limits.require: unknown name {name!r}; use names from {REQUIRABLE}")
        fields_of = {"memory": "memory_bytes", "pids": "pids", "cpu": "cpu_quota"}
        for name in require:
            if name in fields_of and getattr(self, fields_of[name]) is None:
                raise PolicyError(f"Limits.require contains {name!r} but Limits.{fields_of[name]} is None; "
                                  f"set a value or drop {name!r} from require")
        object.__setattr__(self, "require", tuple(dict.fromkeys(require)))


def _check_int(name: str, value: object, *, minimum: int, optional: bool = True, maximum: int = _INT_MAX) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"Limits.{name} must be an int{' or None' if optional else ''}, got {value!r}")
    if not minimum <= value <= maximum:
        raise PolicyError(f"Limits.{name} must be between {minimum} and {maximum}, got {value}")


def _check_seconds(name: str, value: object, *, minimum: float, unit: str = "seconds") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"Limits.{name} must be a number of {unit} or None, got {value!r}")
    if not math.isfinite(value) or value < minimum or value > 1e9:
        raise PolicyError(f"Limits.{name} must be a finite number of {unit} >= {minimum}, got {value!r}")


# --------------------------------------------------------------------------------------------
# rlimits
# --------------------------------------------------------------------------------------------


def rlimits(limits: Limits, cgroup: "RunCgroup | None" = None) -> tuple[tuple[str, int, int], ...]:
    """Return the rlimits a run gets, as ``(name, soft, hard)`` triples. Pure.

    Args:
        limits: the run's limits.
        cgroup: the run's cgroup, or None. Where it enforces ``memory`` (``pids``), the
            ``RLIMIT_DATA`` (``RLIMIT_NPROC``) fallback is left out.
    Returns:
        Triples in a fixed order, names as in the ``resource`` module, values in the rlimit's
        unit (seconds for ``RLIMIT_CPU``, a count for ``RLIMIT_NOFILE``/``RLIMIT_NPROC``,
        bytes otherwise).
    """
    return _rlimits(limits, frozenset(cgroup.enforced if cgroup is not None else ()))


def _rlimits(limits: Limits, enforced: frozenset[str]) -> tuple[tuple[str, int, int], ...]:
    out: list[tuple[str, int, int]] = []
    if limits.cpu_s is not None:
        soft = max(1, math.ceil(limits.cpu_s))
        out.append(("RLIMIT_CPU", soft, soft + 1))  # SIGXCPU at soft, SIGKILL at hard
    if limits.address_space_bytes is not None:
        out.append(("RLIMIT_AS", limits.address_space_bytes, limits.address_space_bytes))
    if limits.memory_bytes is not None and "memory" not in enforced:
        out.append(("RLIMIT_DATA", limits.memory_bytes, limits.memory_bytes))
    if limits.pids is not None and "pids" not in enforced:
        out.append(("RLIMIT_NPROC", limits.pids, limits.pids))
    if limits.fsize_bytes is not None:
        out.append(("RLIMIT_FSIZE", limits.fsize_bytes, limits.fsize_bytes))
    if limits.nofile is not None:
        out.append(("RLIMIT_NOFILE", limits.nofile, limits.nofile))
    out.append(("RLIMIT_CORE", limits.core_bytes, limits.core_bytes))
    return tuple(out)


def apply_rlimits(pid: int, limits: Limits, cgroup: "RunCgroup | None" = None) -> tuple[str, ...]:
    """Set the run's rlimits on ``pid``, bwrap's child blocked on ``--block-fd``.

    Call it after :meth:`RunCgroup.attach` and pass the cgroup, so the memory and pids fallbacks
    (``RLIMIT_DATA``, ``RLIMIT_NPROC``) apply exactly when the cgroup cannot. bwrap reads the
    block fd before it forks the program (and its PID-1 init under ``--unshare-pid``), so
    everything in the sandbox inherits these limits.

    A value above the child's current hard limit is lowered to that hard limit: the stricter
    limit stays in force and an unprivileged caller (who cannot raise a hard limit) does not
    fail.

    Args:
        pid: bwrap's ``child-pid`` (host PID) from ``--info-fd``/``--json-status-fd``.
        limits: the run's limits.
        cgroup: the run's cgroup or None (see :func:`rlimits`).
    Returns:
        Names of the rlimits set, e.g. ``("RLIMIT_CPU", "RLIMIT_FSIZE", ...)``.
    Raises:
        LaunchError: prlimit(2) failed (``ESRCH``: the child is gone; ``EPERM``: it is not ours,
            e.g. a setuid bwrap). The launcher must then kill the child, not release it.

    Source: prlimit(2); ``resource.prlimit`` (Python 3.4).
    """
    applied = []
    for name, soft, hard in rlimits(limits, cgroup):
        which = getattr(resource, name)
        try:
            _, cur_hard = resource.prlimit(pid, which)
            if cur_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, cur_hard), min(hard, cur_hard)
            resource.prlimit(pid, which, (soft, hard))
        except OSError as err:
            raise LaunchError(f"prlimit({pid}, {name}, ({soft}, {hard})) failed: {err.strerror}",
                              errno=err.errno) from err
        applied.append(name)
    return tuple(applied)


# --------------------------------------------------------------------------------------------
# cgroup detection
# --------------------------------------------------------------------------------------------


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
                mountinfo = _read("/proc/self/mountinfo")
                own = _read("/proc/self/cgroup")
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
            _mkdir(base, exist_ok=True)
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
    wanted = _read_words(os.path.join(path, "cgroup.controllers")) & set(LIMIT_CONTROLLERS)
    is_real_root = not os.path.exists(os.path.join(path, "cgroup.type"))  # the root has none
    writable = os.access(os.path.join(path, "cgroup.procs"), os.W_OK)
    # "/" of a cgroup namespace (a container's own cgroup) is ours like a delegated one.
    ours = own_path == "/" or _delegated(path, euid)
    if writable and is_real_root:
        # The root cgroup may hold processes and have controllers enabled for children.
        return _v2_base(mount, path, os.path.join(path, BASE_NAME), wanted, "root cgroup", sweep)
    if writable and ours and _read_ints(os.path.join(path, "cgroup.procs")) == [pid]:
        leaf = os.path.join(path, "supervisor")
        try:
            _mkdir(leaf, exist_ok=True)
            _write(os.path.join(leaf, "cgroup.procs"), str(pid))
        except OSError as err:
            return Hierarchy(2, mount, path, frozenset(), None,
                             f"cannot move ourselves to {leaf}: {err.strerror}")
        return _v2_base(mount, path, os.path.join(path, BASE_NAME), wanted,
                        "delegated own cgroup (we moved to its supervisor/ leaf)", sweep)
    got = delegate(mount, euid != 0)
    if got is not None:
        scope, holder_pid = got
        wanted = _read_words(os.path.join(scope, "cgroup.controllers")) & set(LIMIT_CONTROLLERS)
        leaf = os.path.join(scope, "holder")
        try:
            _mkdir(leaf, exist_ok=True)
            _write(os.path.join(leaf, "cgroup.procs"), str(holder_pid))
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
            _mkdir(base, exist_ok=True)
        enabled = _enable(base, wanted & _read_words(os.path.join(base, "cgroup.controllers")))
    except OSError as err:
        return Hierarchy(2, mount, parent, frozenset(), None, f"{how}: {base}: {err.strerror}")
    if sweep:
        _sweep(base)
    return Hierarchy(2, mount, parent, frozenset(enabled), base, how)


def _enable(cgroup: str, controllers: set[str]) -> set[str]:
    """Enable ``controllers`` in ``cgroup.subtree_control`` one by one; return those enabled."""
    control = os.path.join(cgroup, "cgroup.subtree_control")
    for name in sorted(controllers - _read_words(control)):
        try:
            _write(control, "+" + name)
        except OSError:
            pass  # EBUSY (processes inside), ENOENT (not offered): the controller stays off
    return controllers & _read_words(control)


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
_RUN_NAME = re.compile(r"^(?:run-)?(\d+)-[0-9A-Za-z_.-]+$")


def _sweep(base: str) -> None:
    """Remove empty run cgroups of processes that no longer exist (a caller killed mid-run).

    Only empty directories go (rmdir(2) refuses the others). A caller in another PID namespace
    sharing this base is invisible here: its run cgroup could be removed between its create and
    attach, and its attach then fails with ENOENT (a LaunchError, never a run without limits).
    """
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        m = _RUN_NAME.match(name)
        if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
            _rmtree_empty(os.path.join(base, name))


def _rmtree_empty(path: str) -> None:
    """rmdir(2) ``path`` and its child cgroups, deepest first; populated ones stay.

    A cgroup directory holds only kernel files besides its children, so rmdir needs no unlink;
    a child still holding a task refuses (EBUSY), and so does every ancestor: left for its
    sandbox to die (--die-with-parent) and the next sweep.
    """
    for parent, dirs, _files in os.walk(path, topdown=False):
        for d in dirs:
            try:
                _rmdir(os.path.join(parent, d))
            except OSError:
                pass
    try:
        _rmdir(path)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# Enforcement plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnforcementPlan:
    """What a run with given :class:`Limits` will get on this host. From :func:`enforcement_plan`.

    Attributes:
        cgroups: ``(controller, version)`` for each limit a run cgroup will enforce, e.g.
            ``(("memory", 1), ("pids", 1))``.
        cgroup: True when runs get a cgroup at all (kill-all, CPU time, peak memory).
        rlimits: ``(name, soft, hard)`` triples :func:`apply_rlimits` will set.
        not_enforced: ``(limit, reason)`` for each requested limit that has no kernel
            enforcement here or only a weaker fallback, e.g.
            ``(("memory", "no memory cgroup: RLIMIT_DATA per process instead"),)``.
    """

    cgroups: tuple[tuple[str, int], ...]
    cgroup: bool
    rlimits: tuple[tuple[str, int, int], ...]
    not_enforced: tuple[tuple[str, str], ...]


def enforcement_plan(limits: Limits, support: CgroupSupport | None = None) -> EnforcementPlan:
    """Say how ``limits`` will be enforced here, before anything runs.

    Args:
        limits: the run's limits.
        support: the host's cgroups; default :func:`detect_cgroups`.
    Returns:
        An :class:`EnforcementPlan`.
    Raises:
        UnsupportedError: a name in ``limits.require`` cannot be enforced; ``.feature`` is
            ``"cgroup:<name>"`` and the message says what is missing.
    """
    support = detect_cgroups() if support is None else support
    wanted = {"memory": limits.memory_bytes, "pids": limits.pids, "cpu": limits.cpu_quota}
    cgroups, not_enforced = [], []
    for controller, value in wanted.items():
        if value is None:
            continue
        h = support.hierarchy_for(controller)
        if h is not None:
            cgroups.append((controller, h.version))
        else:
            fallback = {"memory": "RLIMIT_DATA per process instead",
                        "pids": "RLIMIT_NPROC per uid instead (not enforced for root)",
                        "cpu": "no CPU bandwidth limit"}[controller]
            not_enforced.append((controller, f"no writable {controller} cgroup: {fallback}"))
    for name in limits.require:
        ok = support.usable if name == "cgroup" else any(c == name for c, _ in cgroups)
        if not ok:
            raise UnsupportedError(f"cgroup:{name}", _unsupported_message(name, support),
                                   fix="run as root, or under systemd-run --user --scope -p Delegate=yes")
    return EnforcementPlan(tuple(cgroups), support.usable,
                           _rlimits(limits, frozenset(c for c, _ in cgroups)), tuple(not_enforced))


def _unsupported_message(name: str, support: CgroupSupport) -> str:
    what = "a writable cgroup" if name == "cgroup" else f"a writable cgroup with the {name} controller"
    seen = "; ".join(f"v{h.version} {h.mount}: {h.how}" + (f" (controllers {','.join(sorted(h.controllers))})"
                                                           if h.base else "")
                     for h in support.hierarchies) or "no cgroup mounted"
    return f"Limits.require has {name!r} but this host offers no {what} ({seen})"


# --------------------------------------------------------------------------------------------
# Per-run cgroup
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupStats:
    """Accounting of one run cgroup; None where this host cannot tell.

    Attributes:
        peak_memory_bytes: highest memory use of the run: v2 ``memory.peak`` (Linux 5.19), else
            the highest ``memory.current`` sampled; v1 ``memory.max_usage_in_bytes``.
        oom_kills: processes the OOM killer killed in the run because of its memory limit:
            v2 ``oom_kill`` in ``memory.events``; v1 ``oom_kill`` in ``memory.oom_control``
            (Linux 4.13).
        pids_limit_hit: a fork/clone failed at ``pids.max`` (``max`` in ``pids.events``).
        pids_peak: most tasks at once (``pids.peak``, Linux 6.1 v1 / 6.13 v2), or None.
        cpu_user_s, cpu_system_s: CPU seconds of every process of the run, dead or alive:
            v2 ``user_usec``/``system_usec`` in ``cpu.stat``; v1 ``cpuacct.usage``
            (nanoseconds) split in the ratio of ``cpuacct.usage_user``/``cpuacct.usage_sys``. The
            reliable source under bwrap, whose sandboxed program is not a child of ours
            (os.wait4 cannot see it).
    """

    peak_memory_bytes: int | None = None
    oom_kills: int | None = None
    pids_limit_hit: bool | None = None
    pids_peak: int | None = None
    cpu_user_s: float | None = None
    cpu_system_s: float | None = None


@dataclass
class _Node:
    """The run's directory in one hierarchy."""

    version: int
    path: str
    controllers: frozenset[str]


_counter = itertools.count(1)


class RunCgroup:
    """One run's cgroup, a directory in each hierarchy the run uses. One per run.

    Use :meth:`create`; as a context manager, leaving kills what is left and removes it.

    Attributes:
        name: the run's directory name under each base.
        nodes: the run's directories (internal layout; read-only).
        enforced: controllers whose limit was written, ``("memory", "pids", "cpu")`` at most.
        limit_files: the files written, by their own names, e.g. ``("memory.max",
            "memory.swap.max", "pids.max")`` on v2 or ``("memory.limit_in_bytes",
            "memory.memsw.limit_in_bytes", "pids.max")`` on v1.
        notes: one line per limit that could not be written, or was only partly.
    """

    def __init__(self, name: str, nodes: list[_Node], enforced: tuple[str, ...],
                 limit_files: tuple[str, ...], notes: tuple[str, ...]) -> None:
        self.name = name
        self.nodes = tuple(nodes)
        self.enforced = enforced
        self.limit_files = limit_files
        self.notes = notes
        self._memory_sampled = 0
        self._removed = False
        self._event_fds: dict[str, int] | None = None
        #: Where :mod:`lowlevel.host.run_records` recorded the directories (None: no record).
        self.record: str | None = None

    def __repr__(self) -> str:
        return f"<RunCgroup {self.name} enforced={self.enforced} nodes={[n.path for n in self.nodes]}>"

    @classmethod
    def create(cls, limits: Limits, name: str | None = None, *,
               support: CgroupSupport | None = None, workspace: str | None = None) -> "RunCgroup | None":
        """Create the run's cgroup and write its limits, before bwrap starts.

        Creates a directory in: the hierarchy of each limit set (``memory``, ``pids``,
        ``cpu``); the memory hierarchy even without a memory limit (peak memory); v2 if writable
        (``cgroup.kill``, ``cpu.stat``), else v1 ``cpuacct`` (CPU time) and ``freezer``
        (kill-all).

        Args:
            limits: the run's limits.
            name: directory name, ``[A-Za-z0-9_.-]{1,64}``; default ``<pid>-<n>-<hex>``. Names
                of the form ``<pid>-...`` or ``run-<pid>-...`` are swept by the next
                :func:`detect_cgroups` once that PID is gone (a caller killed mid-run).
            support: the host's cgroups; default :func:`detect_cgroups`.
            workspace: the run's workspace, kept in the run's record (``lowlevel cleanup``
                then checks it for commit temporaries if the caller dies).
        The directories are recorded (:mod:`lowlevel.host.run_records`) before the first is made,
        and the record removed by :meth:`remove`, so ``lowlevel cleanup`` finds them after the
        caller's death wherever its own cgroup put them.
        Returns:
            The RunCgroup, or None when no hierarchy is writable (rlimits only) and nothing in
            ``limits.require`` needs one.
        Raises:
            UnsupportedError: ``limits.require`` names a limit this host cannot enforce, or
                whose write failed; nothing is left behind.
            ValueError: a bad ``name``.
            OSError: creating a directory failed (e.g. ``EEXIST`` for a reused name).
        """
        support = detect_cgroups() if support is None else support
        enforcement_plan(limits, support)  # raises for an unmet require
        if name is None:
            name = f"{os.getpid()}-{next(_counter)}-{os.urandom(3).hex()}"
        elif not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name in (".", ".."):
            raise ValueError(f"RunCgroup name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
        if not support.usable:
            return None

        wanted = {"memory": True, "pids": limits.pids is not None, "cpu": limits.cpu_quota is not None}
        chosen: dict[str, Hierarchy] = {}  # mount -> hierarchy
        for controller, needed in wanted.items():
            h = support.hierarchy_for(controller)
            if needed and h is not None:
                chosen[h.mount] = h
        v2 = support.v2
        if v2 is not None and v2.base is not None:
            chosen[v2.mount] = v2
        else:
            for controller in ("cpuacct", "freezer"):
                h = support.hierarchy_for(controller)
                if h is not None:
                    chosen[h.mount] = h

        from lowlevel.host import run_records
        nodes: list[_Node] = []
        record = run_records.write(name, [os.path.join(str(h.base), name) for h in chosen.values()], workspace)
        try:
            for h in chosen.values():
                assert h.base is not None
                path = os.path.join(h.base, name)
                _mkdir(path)
                nodes.append(_Node(h.version, path, h.controllers))
            enforced, files, notes = _write_limits(nodes, limits)
        except BaseException:
            for node in reversed(nodes):
                try:
                    _rmdir(node.path)
                except OSError:
                    pass
            run_records.remove(record)
            raise
        self = cls(name, nodes, enforced, files, notes)
        self.record = record
        missing = [r for r in limits.require if r != "cgroup" and r not in enforced]
        if missing:
            self.remove()
            raise UnsupportedError(f"cgroup:{missing[0]}", f"writing the {missing[0]} limit failed: "
                                   + "; ".join(notes))
        return self

    def node(self, controller: str) -> _Node | None:
        """The run's directory carrying ``controller`` (v2's for ``"cgroup.kill"``/``"cpu.stat"``)."""
        if controller in ("v2",):
            return next((n for n in self.nodes if n.version == 2), None)
        return next((n for n in self.nodes if controller in n.controllers), None)

    def attach(self, pid: int) -> None:
        """Move ``pid`` (bwrap's blocked child) into the run's directory in every hierarchy.

        Children it forks afterwards are born inside. Memory it already used stays charged
        where it was (v2 never moves charges; v1 only with ``memory.move_charge_at_immigrate``).

        Raises:
            LaunchError: writing ``cgroup.procs`` failed (``ESRCH``: the process is gone;
                ``EBUSY``/``EPERM``); the launcher must kill the child, not release it.
        """
        for node in self.nodes:
            target = os.path.join(node.path, "cgroup.procs")
            try:
                _write(target, str(pid))
            except OSError as err:
                raise LaunchError(f"write {pid} to {target} failed: {err.strerror}",
                                  errno=err.errno) from err

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` of the run's directory in every hierarchy: the anchor joins each
        (writes ``"0"``, its own PID, to an fd the launcher opens), so every process of the
        sandbox is born inside. Opened by the caller: on cgroup v2 the write permission is
        checked against the opener's credentials (cgroup-v2.rst, "Delegation Containment")."""
        return [os.path.join(node.path, "cgroup.procs") for node in self.nodes]

    def join_targets(self) -> tuple[list[str], str | None]:
        """What the anchor joins, and how: ``(v1 tasks files, v2 directory or None)``.

        v1: the ``tasks`` file of the run's directory in each v1 hierarchy: the anchor, single
        threaded, writes ``"0"`` (itself) to each, a thread moving itself, which the kernel does
        without taking ``cgroup_threadgroup_rwsem`` for writing, so without the RCU grace
        period a ``cgroup.procs`` write waits for (8.7 ms p50 measured here, against 0.03 ms:
        bench/README.md). v2: the run's directory, opened ``O_DIRECTORY`` by the caller; bwrap
        is created in it with ``clone3(CLONE_INTO_CGROUP)`` (Linux 5.7), so no process is ever
        moved on v2. The files are opened by the caller: write permission is checked against
        the opener's credentials (cgroup-v2.rst, "Delegation Containment"; v1 checks the
        opener's euid against the task's). Sources: kernel/cgroup/cgroup.c
        ``cgroup_procs_write_start`` ("If we migrate a single thread, we don't care about
        threadgroup stability ... we can skip the global lock") and ``cgroup_css_set_fork``;
        clone(2) ``CLONE_INTO_CGROUP``.
        """
        v1 = [os.path.join(node.path, "tasks") for node in self.nodes if node.version == 1]
        v2 = next((node.path for node in self.nodes if node.version == 2), None)
        return v1, v2

    def pids(self) -> list[int]:
        """PIDs (host namespace) of the processes in the run, from every ``cgroup.procs``."""
        found: set[int] = set()
        for node in self.nodes:
            found.update(_read_ints(os.path.join(node.path, "cgroup.procs")))
        return sorted(found)

    def sample(self) -> None:
        """Record ``memory.current`` for the peak where ``memory.peak`` is missing (v2 < 5.19).

        Cheap (one read); the supervisor calls it while it waits.
        """
        node = self.node("memory")
        if node is not None and node.version == 2:
            current = _read_int(os.path.join(node.path, "memory.current"))
            if current is not None:
                self._memory_sampled = max(self._memory_sampled, current)

    def stats(self) -> CgroupStats:
        """Read the run's accounting; call it after the run ends, before :meth:`remove`."""
        peak = oom = pids_hit = pids_peak = user = system = None
        mem = self.node("memory")
        if mem is not None and mem.version == 2:
            self.sample()
            peak = _read_int(os.path.join(mem.path, "memory.peak"))
            peak = max(peak or 0, self._memory_sampled) or peak
            oom = _read_keyed(os.path.join(mem.path, "memory.events")).get("oom_kill")
        elif mem is not None:
            peak = _read_int(os.path.join(mem.path, "memory.max_usage_in_bytes"))
            oom = _read_keyed(os.path.join(mem.path, "memory.oom_control")).get("oom_kill")
        pid_node = self.node("pids")
        if pid_node is not None:
            hits = _read_keyed(os.path.join(pid_node.path, "pids.events")).get("max")
            pids_hit = None if hits is None else hits > 0
            pids_peak = _read_int(os.path.join(pid_node.path, "pids.peak"))
        v2 = self.node("v2")
        acct = self.node("cpuacct")
        if v2 is not None:
            stat = _read_keyed(os.path.join(v2.path, "cpu.stat"))
            if "user_usec" in stat:
                user, system = stat["user_usec"] / 1e6, stat.get("system_usec", 0) / 1e6
        elif acct is not None:
            u = _read_int(os.path.join(acct.path, "cpuacct.usage_user"))
            s = _read_int(os.path.join(acct.path, "cpuacct.usage_sys"))
            total = _read_int(os.path.join(acct.path, "cpuacct.usage"))
            if u is not None and s is not None:
                # usage_user/usage_sys come from tick samples and overshoot; cpuacct.usage is the
                # exact runtime: split it in their proportion (what cputime_adjust() does).
                if total is not None and u + s > 0:
                    u, s = total * u // (u + s), total * s // (u + s)
                user, system = u / 1e9, s / 1e9
        return CgroupStats(peak, oom, pids_hit, pids_peak, user, system)

    def event_counts(self) -> tuple[int | None, int | None]:
        """``(oom_kills, pids_max_hits)`` so far: the two counters of :meth:`stats` that say why
        a process died, read before and after each command of a Session to tell which limit it
        met. None where this cgroup cannot tell. The two files stay open (until :meth:`remove`)
        and are re-read with ``pread`` at offset 0, which regenerates a cgroupfs file: about
        10 us instead of 90 us for open+read+close on this host."""
        if self._event_fds is None:
            self._event_fds = {}
            mem = self.node("memory")
            pid_node = self.node("pids")
            for key, node, fname in (("oom_kill", mem, "memory.events" if mem is not None and mem.version == 2
                                      else "memory.oom_control"), ("max", pid_node, "pids.events")):
                if node is not None:
                    try:
                        self._event_fds[key] = os.open(os.path.join(node.path, fname), os.O_RDONLY | os.O_CLOEXEC)
                    except OSError:
                        pass
        out: dict[str, int | None] = {"oom_kill": None, "max": None}
        for key, fd in self._event_fds.items():
            try:
                out[key] = _parse_keyed(os.pread(fd, 4096, 0).decode("ascii", "replace")).get(key)
            except OSError:
                pass
        return out["oom_kill"], out["max"]

    def _close_event_fds(self) -> None:
        for fd in (self._event_fds or {}).values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._event_fds = None

    def update_limits(self, limits: Limits) -> tuple[str, ...]:
        """Rewrite the memory, pids and CPU-bandwidth limits of a live cgroup, for one call of
        a pre-started sandbox (:class:`lowlevel.session.Pool`, where the cgroup serves one call).

        Each limit is written where this cgroup has a directory with that controller (the
        memory one always exists; pids and cpu ones when the first limits asked for them); a
        None value removes the limit (``max``, ``-1``). :attr:`enforced` is updated to match,
        so :func:`rlimits` adds the rlimit fallback exactly where the cgroup does not enforce.
        On v1 ``memory.memsw.limit_in_bytes`` must stay >= ``memory.limit_in_bytes``, so
        the order of the two writes follows the direction of the change.

        Returns:
            The controllers now enforced (the new :attr:`enforced`).
        Raises:
            OSError: a write failed (``EBUSY``: the new memory limit is below what the
                cgroup uses and cannot be reclaimed).
        """
        enforced = set(self.enforced)
        mem = self.node("memory")
        if mem is not None and (limits.memory_bytes is not None or "memory" in enforced):
            value = limits.memory_bytes
            if mem.version == 2:
                _write(os.path.join(mem.path, "memory.max"), "max" if value is None else str(value))
            else:
                text = "-1" if value is None else str(value)
                limit, memsw = (os.path.join(mem.path, f) for f in ("memory.limit_in_bytes",
                                                                     "memory.memsw.limit_in_bytes"))
                current = _read_int(limit)
                raising = value is None or (current is not None and value > current)
                extra = [memsw] if os.path.exists(memsw) else []
                for path in (extra + [limit] if raising else [limit] + extra):
                    _write(path, text)
            (enforced.add if value is not None else enforced.discard)("memory")
        pid_node = self.node("pids")
        if pid_node is not None and (limits.pids is not None or "pids" in enforced):
            _write(os.path.join(pid_node.path, "pids.max"), "max" if limits.pids is None else str(limits.pids))
            (enforced.add if limits.pids is not None else enforced.discard)("pids")
        cpu = self.node("cpu")
        if cpu is not None and (limits.cpu_quota is not None or "cpu" in enforced):
            quota = -1 if limits.cpu_quota is None else max(1000, round(limits.cpu_quota * CPU_PERIOD_US))
            if cpu.version == 2:
                _write(os.path.join(cpu.path, "cpu.max"), f"{'max' if quota < 0 else quota} {CPU_PERIOD_US}")
            else:
                _write(os.path.join(cpu.path, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(cpu.path, "cpu.cfs_quota_us"), str(quota))
            (enforced.add if limits.cpu_quota is not None else enforced.discard)("cpu")
        self.enforced = tuple(c for c in ("memory", "pids", "cpu") if c in enforced)
        return self.enforced

    def kill_all(self, timeout_s: float = 2.0) -> None:
        """SIGKILL every process in the run, including daemons that left the session.

        v2: ``cgroup.kill`` (Linux 5.14), atomic against forks. Else v1 ``freezer``: freeze,
        SIGKILL every PID in ``cgroup.procs``, thaw (frozen tasks cannot fork; they die on
        thaw). Else SIGKILL in a loop until ``cgroup.procs`` is empty (``pids.max`` bounds a
        fork race). Returns once ``cgroup.procs`` is empty or ``timeout_s`` passed.

        Source: cgroup-v2.rst "cgroup.kill"; cgroup-v1/freezer-subsystem.rst.
        """
        deadline = time.monotonic() + timeout_s
        v2 = self.node("v2")
        if v2 is not None and os.path.exists(os.path.join(v2.path, "cgroup.kill")):
            try:
                _write(os.path.join(v2.path, "cgroup.kill"), "1")
            except OSError:
                pass  # fall through to the loop below
        freezer = self.node("freezer")
        while self.pids():
            if freezer is not None:
                self._freeze_kill_thaw(freezer, deadline)
            else:
                for pid in self.pids():
                    _kill(pid)
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def _freeze_kill_thaw(self, freezer: _Node, deadline: float) -> None:
        state = os.path.join(freezer.path, "freezer.state")
        try:
            _write(state, "FROZEN")
            while _read(state).strip() != "FROZEN" and time.monotonic() < deadline:
                time.sleep(0.001)
            for pid in self.pids():
                _kill(pid)
        finally:
            try:
                _write(state, "THAWED")
            except OSError:
                pass

    def remove(self, timeout_s: float = 2.0) -> None:
        """Remove the run's directories; idempotent, safe after a failed run.

        Kills what is still inside first, then retries ``rmdir`` while exiting tasks drain
        (``EBUSY``) until ``timeout_s``.

        Raises:
            OSError: ``EBUSY`` after ``timeout_s``; the message lists the directories left.
        """
        self._close_event_fds()
        if self._removed:
            return
        deadline = time.monotonic() + timeout_s
        if self.pids():
            self.kill_all(timeout_s)
        left = []
        for node in self.nodes:
            delay = 0.0005
            while True:
                try:
                    _rmdir(node.path)
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        left.append(node.path)
                        break
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
        if left:
            raise OSError(errno.EBUSY, f"run cgroup(s) still busy after {timeout_s}s: {', '.join(left)}")
        self._removed = True
        from lowlevel.host import run_records
        run_records.remove(self.record)  # only once every directory is gone
        self.record = None

    def __enter__(self) -> "RunCgroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
        self.remove()


def _write_limits(nodes: list[_Node], limits: Limits) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Write the limit files; return ``(enforced controllers, files written, notes)``."""
    enforced: list[str] = []
    files: list[str] = []
    notes: list[str] = []

    def put(node: _Node, fname: str, value: str, *, optional: bool = False, record: bool = True) -> bool:
        try:
            _write(os.path.join(node.path, fname), value)
        except FileNotFoundError:
            if not optional:
                notes.append(f"{fname}: missing")
            return False
        except OSError as err:
            notes.append(f"write {value} to {os.path.join(node.path, fname)}: {err.strerror}")
            return False
        if record:
            files.append(fname)
        return True

    mem = next((n for n in nodes if "memory" in n.controllers), None)
    if mem is not None and limits.memory_bytes is not None:
        value = str(limits.memory_bytes)
        if mem.version == 2:
            if put(mem, "memory.max", value):
                enforced.append("memory")
                if not put(mem, "memory.swap.max", "0", optional=True):
                    notes.append("memory.swap.max missing (no swap accounting): swap is not bounded")
        elif put(mem, "memory.limit_in_bytes", value):
            enforced.append("memory")
            # memsw (memory+swap) must be >= limit_in_bytes, so it is written second.
            if not put(mem, "memory.memsw.limit_in_bytes", value, optional=True):
                notes.append("memory.memsw.limit_in_bytes missing (swapaccount=0): swap is not bounded")
    pid_node = next((n for n in nodes if "pids" in n.controllers), None)
    if pid_node is not None and limits.pids is not None:
        if put(pid_node, "pids.max", str(limits.pids)):
            enforced.append("pids")
    cpu = next((n for n in nodes if "cpu" in n.controllers), None)
    if cpu is not None and limits.cpu_quota is not None:
        quota = max(1000, round(limits.cpu_quota * CPU_PERIOD_US))  # kernel minimum 1 ms
        if cpu.version == 2:
            ok = put(cpu, "cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            ok = put(cpu, "cpu.cfs_period_us", str(CPU_PERIOD_US), record=False) \
                and put(cpu, "cpu.cfs_quota_us", str(quota))
        if ok:
            enforced.append("cpu")
    return tuple(enforced), tuple(files), tuple(notes)


#: What the ``RLIMIT_DATA`` fallback of ``memory_bytes`` bounds, and what it does not (issue
#: 12 item 7). Source: getrlimit(2) RLIMIT_DATA (Linux 4.7: "the process's data segment
#: (initialized data, uninitialized data, and heap)" plus private writable mappings,
#: ``may_expand_vm``/``is_data_mapping`` in mm/mmap.c); tmpfs(5).
MEMORY_FALLBACK_NOTE = (
    "memory_bytes is RLIMIT_DATA per process here (no writable memory cgroup): it bounds each "
    "process's heap and private writable mappings (malloc, private anonymous and private file "
    "mmap, thread stacks), not MAP_SHARED or memfd memory, not files in /tmp and /dev/shm "
    "(tmp_size_bytes bounds those), not the page cache or kernel memory, and not the sum over "
    "several processes; an allocation past it fails (ENOMEM, MemoryError) instead of an OOM "
    "kill, so killed_by is never 'memory'. For the cgroup's verdict require it "
    "(Limits(require=('memory',)) refuses to run without the cgroup); address_space_bytes "
    "(RLIMIT_AS) also bounds shared mappings, per process, counting reserved address space too")
PIDS_FALLBACK_NOTE = (
    "pids is RLIMIT_NPROC here (no writable pids cgroup): it counts the processes and threads of "
    "the uid in the sandbox's user namespace, and is not enforced for a root caller")
CPU_QUOTA_FALLBACK_NOTE = "cpu_quota is not enforced here (no writable cpu cgroup)"


def fallback_notes(limits: Limits, cgroup: RunCgroup | None) -> tuple[str, ...]:
    """One note per limit a run asked for that the cgroup does not enforce, saying exactly
    what bounds it instead (:data:`MEMORY_FALLBACK_NOTE`...). Empty when the cgroup enforces
    them all. Pure."""
    enforced = frozenset(cgroup.enforced if cgroup is not None else ())
    notes = []
    if limits.memory_bytes is not None and "memory" not in enforced:
        notes.append(MEMORY_FALLBACK_NOTE)
    if limits.pids is not None and "pids" not in enforced:
        notes.append(PIDS_FALLBACK_NOTE)
    if limits.cpu_quota is not None and "cpu" not in enforced:
        notes.append(CPU_QUOTA_FALLBACK_NOTE)
    return tuple(notes)


#: How the notes that explain a verdict start (:func:`memory_kill_note`,
#: :func:`lowlevel.sandbox.failures.pids_note`, :func:`lowlevel.sandbox.failures.network_denial_note`, a Session
#: init's death by the OOM killer): the CLI prints them, MCP results carry them. They name limits
#: and policy, never host paths.
VERDICT_NOTE_PREFIXES = ("the memory cgroup's OOM killer", "the pids limit was hit", "connect() refused by the sandbox",
                         "the session's init")


def tmpfs_bytes(limits: Limits) -> int | None:
    """The sum of the run's RAM-backed tmpfs bounds, in bytes: the workspace's upper layer
    (``workspace_bytes``, default :data:`DEFAULT_WORKSPACE_BYTES`) plus ``/tmp`` and ``/dev/shm``
    (``tmp_size_bytes`` each). Their pages are charged to the run's memory cgroup, so a
    ``memory_bytes`` above this sum (plus what the program itself needs) lets a full tmpfs end
    in ENOSPC rather than an OOM kill. None when ``tmp_size_bytes`` is None (bwrap's tmpfs
    default then: half the host's RAM). Pure."""
    if limits.tmp_size_bytes is None:
        return None
    return (limits.workspace_bytes or DEFAULT_WORKSPACE_BYTES) + 2 * limits.tmp_size_bytes


def memory_kill_note(limits: Limits, killed: str | None = None, *, session: bool = False) -> str:
    """The note of a run (or Session command) that met the memory cgroup's limit: what was
    killed, and how ``memory_bytes`` relates to the tmpfs bounds (both numbers), so the caller
    can tell "the program used too much memory" from "its files in /workspace, /tmp or /dev/shm
    filled the memory limit before their own bound". ``killed``: which process the OOM killer
    took when it was not the program (``"bwrap"``, ``"the guard"``...). ``session``: the note
    of a Session's command, whose files outlive it: it says how to free their memory. Pure."""
    what = (f"the memory cgroup's OOM killer killed {killed}" + ("" if session else ", so the sandbox was torn down")
            if killed else f"the memory cgroup's OOM killer killed a process of the {'session' if session else 'run'}")
    if session:
        what += (
            "; files the session wrote keep their memory until removed (Session.reset() drops the workspace's "
            "changes from the host), so later commands may meet the limit too")
    mem, tmpfs = limits.memory_bytes, tmpfs_bytes(limits)
    limit = f"memory_bytes={mem}" if mem is not None else "the memory limit"
    if tmpfs is None:
        return (f"{what} ({limit}); files in /workspace, /tmp and /dev/shm are RAM and count against it "
                "(tmp_size_bytes=None leaves /tmp and /dev/shm unbounded)")
    if mem is not None and mem <= tmpfs:
        return (f"{what} ({limit}, at most the tmpfs bounds of {tmpfs} bytes: workspace_bytes + 2 x "
                "tmp_size_bytes); files in /workspace, /tmp and /dev/shm are RAM and count against it, so a "
                "large write can meet the memory limit before ENOSPC: give memory_bytes more than "
                f"{tmpfs} bytes plus what the program needs")
    return (f"{what} ({limit}, of which the tmpfs bounds take up to {tmpfs} bytes: workspace_bytes + 2 x "
            "tmp_size_bytes; files there are RAM and count against it)")


def limits_enforced(rlimits_applied: Iterable[str], cgroup: RunCgroup | None) -> tuple[str, ...]:
    """The ``Result.limits_enforced`` value: rlimit names then cgroup files, each by its own name.

    E.g. ``("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE",
    "memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "pids.max")`` on this v1 host as root;
    ``("RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_NPROC", ...)`` with rlimits only.
    """
    return tuple(rlimits_applied) + (cgroup.limit_files if cgroup is not None else ())


# --------------------------------------------------------------------------------------------
# cgroupfs I/O (module functions so tests can stand in a fake kernel)
# --------------------------------------------------------------------------------------------


def _mkdir(path: str, exist_ok: bool = False) -> None:
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        if not exist_ok:
            raise


def _rmdir(path: str) -> None:
    os.rmdir(path)


def _write(path: str, text: str) -> None:
    """One write(2) of ``text``, no O_CREAT: cgroupfs files exist or the feature is missing."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    # An unbuffered binary open() (no text wrapper for a file of a few bytes: a run reads about
    # eight of them), not a bare os.open: the FileIO owns the fd (O_CLOEXEC) from the instant
    # the C call returns, so a signal handler's exception (^C's KeyboardInterrupt) raised before
    # the ``with`` is entered drops its last reference, which closes it; os.open's int was
    # lost (one fd per run interrupted while its cgroup's figures were read).
    with open(path, "rb", buffering=0) as f:
        chunks = []
        while chunk := f.read(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode("ascii", "replace")


def _read_words(path: str) -> set[str]:
    try:
        return set(_read(path).split())
    except OSError:
        return set()


def _read_int(path: str) -> int | None:
    try:
        text = _read(path).strip()
    except OSError:
        return None
    return _INT_MAX if text == "max" else int(text) if text.isdigit() else None


def _read_ints(path: str) -> list[int]:
    try:
        return [int(w) for w in _read(path).split()]
    except (OSError, ValueError):
        return []


def _read_keyed(path: str) -> dict[str, int]:
    """Parse ``key value`` lines (``memory.events``, ``cpu.stat``, ``memory.oom_control``)."""
    try:
        return _parse_keyed(_read(path))
    except OSError:
        return {}


def _parse_keyed(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


__all__ = [
    "DEFAULT_FSIZE_BYTES",
    "DEFAULT_MEMORY_BYTES",
    "CgroupStats",
    "CgroupSupport",
    "EnforcementPlan",
    "GiB",
    "Hierarchy",
    "KiB",
    "Limits",
    "MiB",
    "RunCgroup",
    "apply_rlimits",
    "detect_cgroups",
    "enforcement_plan",
    "limits_enforced",
    "memory_kill_note",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "rlimits",
    "tmpfs_bytes",
]
