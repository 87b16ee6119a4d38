"""Resource limits of one sandboxed run, as data: :class:`Limits`, its defaults, and the pure
functions that read it (the rlimit table, the tmpfs sum, the notes that explain a fallback or a
memory kill). No I/O: how the host enforces them is :mod:`lowlevel.host.cgroups` (the per-run
cgroup, :func:`~lowlevel.host.cgroups.enforcement_plan`) and :mod:`lowlevel.host.cgroup_detect`.

Glossary:
    rlimit: a per-process ``(soft, hard)`` pair (getrlimit(2)), inherited across fork and exec.
        :func:`rlimits` gives the table; the launcher's exec helper (``native/lowlevel_exec.c``:
        setrlimit before it execs bwrap; prlimit(1) without it) sets them, so the program
        inherits them before its first instruction.
    cgroup: a kernel group of processes with shared accounting and limits (cgroups(7)): where a
        memory, pids or cpu cgroup is writable, it enforces ``memory_bytes``, ``pids`` and
        ``cpu_quota`` for the whole run, and the rlimit fallbacks (``RLIMIT_DATA``,
        ``RLIMIT_NPROC``) are left out.

Sources: getrlimit(2), prlimit(2), cgroups(7); tmpfs(5); the kernel's
Documentation/admin-guide/cgroup-v2.rst and Documentation/admin-guide/cgroup-v1/memory.rst.
"""

from __future__ import annotations

import math

from lowlevel._dataclass import dataclass
from lowlevel.errors import PolicyError

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Protocol
else:
    Protocol = object  # Enforcing is a Protocol for the type checker only (no isinstance on it)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Names accepted in :attr:`Limits.require`.
REQUIRABLE = ("cgroup", "cpu", "memory", "pids")

_INT_MAX = 2**63 - 1

#: The workspace bound when ``Limits.workspace_bytes`` is None: the size of the tmpfs holding the
#: copy-on-write upper layer. The same value as :data:`lowlevel.workspace.cow.DEFAULT_UPPER_BYTES` (a unit
#: test checks; cow.py is not imported here: it is not needed for a run without the overlay).
DEFAULT_WORKSPACE_BYTES = 1 * GiB

#: Default ``Limits.tmp_size_bytes``: the size of ``/tmp`` and, separately, of ``/dev/shm``.
DEFAULT_TMP_SIZE_BYTES = 256 * MiB
#: Where a run's copy-on-write upper layer lives (``Limits.upper``): ``"tmpfs"`` (RAM, the
#: default) or ``"disk"`` (a per-run loop device, root callers: :mod:`lowlevel.workspace.disk_upper`).
UPPERS = ("tmpfs", "disk")
#: Smallest ``workspace_bytes`` of a disk upper: mke2fs needs room for its metadata.
MIN_DISK_UPPER_BYTES = 8 * MiB

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
            workers gets N times this. The cgroup's total (:meth:`lowlevel.host.cgroups.RunCgroup.stats`) lets the
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
            inside beyond it; the host's disk is never used). A Session's ``commit()`` and
            ``reset()`` give back the space (and inodes) of the changes they apply or drop. None: the default,
            :data:`lowlevel.workspace.cow.DEFAULT_UPPER_BYTES` (1 GiB). Where the overlay is unavailable
            (the hand-over fallback) a value raises UnsupportedError.
        upper: where that upper layer lives, one of :data:`UPPERS`. ``"tmpfs"`` (the default):
            RAM, charged to the run's memory cgroup. ``"disk"``: a fresh ext4 on a per-run loop
            device whose unnamed, sparse backing file (in ``$LOWLEVEL_UPPER_DIR``, default
            /var/tmp) is exactly ``workspace_bytes`` long: the same hard bound (ENOSPC inside; a
            little of it goes to ext4's metadata), on disk, so large outputs and many
            sandboxes do not hold RAM; nothing stays behind when the caller dies (loop(4)
            LO_FLAGS_AUTOCLEAR, open(2) O_TMPFILE). Root callers only (a loop device and an
            ext4 mount need CAP_SYS_ADMIN): others get UnsupportedError, as does the hand-over
            fallback. At least :data:`MIN_DISK_UPPER_BYTES`.
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
    upper: str = "tmpfs"

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
        if not isinstance(self.upper, str) or self.upper not in UPPERS:
            raise PolicyError(f"Limits.upper must be one of {UPPERS}, got {self.upper!r}")
        if self.upper == "disk" and self.workspace_bytes is not None and self.workspace_bytes < MIN_DISK_UPPER_BYTES:
            raise PolicyError(f"Limits.workspace_bytes must be at least {MIN_DISK_UPPER_BYTES} with upper='disk' "
                              f"(ext4's metadata needs room), got {self.workspace_bytes}")
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


class Enforcing(Protocol):
    """What the functions here read of a run's cgroup (:class:`lowlevel.host.cgroups.RunCgroup`):
    the controllers whose limit it wrote, ``("memory", "pids", "cpu")`` at most."""

    @property
    def enforced(self) -> tuple[str, ...]: ...


def rlimits(limits: Limits, cgroup: Enforcing | None = None) -> tuple[tuple[str, int, int], ...]:
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
    return rlimits_for(limits, frozenset(cgroup.enforced if cgroup is not None else ()))


def rlimits_for(limits: Limits, enforced: frozenset[str]) -> tuple[tuple[str, int, int], ...]:
    """:func:`rlimits` given the set of controllers a cgroup enforces (``{"memory", "pids"}``). Pure."""
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


def fallback_notes(limits: Limits, cgroup: Enforcing | None) -> tuple[str, ...]:
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
    default then: half the host's RAM). With ``upper="disk"`` the workspace is not RAM: only
    ``/tmp`` and ``/dev/shm`` count. Pure."""
    if limits.tmp_size_bytes is None:
        return None
    workspace = 0 if limits.upper == "disk" else (limits.workspace_bytes or DEFAULT_WORKSPACE_BYTES)
    return workspace + 2 * limits.tmp_size_bytes


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
        # The program's own memory first: most kills are that (an allocation), and the tmpfs
        # advice is for the other case, a large write (the new-user pass read it as "raise
        # memory_bytes to 1.5 GiB" for a heap allocation).
        return (f"{what} ({limit}): the program's memory, with any files it wrote in /workspace, /tmp and "
                "/dev/shm (RAM, counted against the same limit), went past it. If those files were large: "
                f"the tmpfs bounds allow up to {tmpfs} bytes (workspace_bytes + 2 x tmp_size_bytes), more than "
                "memory_bytes, so a large write meets the memory limit before ENOSPC; give memory_bytes more "
                f"than {tmpfs} bytes plus what the program needs, or lower those bounds")
    return (f"{what} ({limit}, of which the tmpfs bounds take up to {tmpfs} bytes: workspace_bytes + 2 x "
            "tmp_size_bytes; files there are RAM and count against it)")


def lowered_note(name: str, asked: int, bound: int, bound_is: str, who: str) -> str:
    """The "warning:" note of an rlimit lowered to what could be set: ``RLIMIT_NOFILE 99999999
    is above this caller's hard limit (20000): the sandbox runs with 20000`` (``bound_is``:
    whose limit the bound is; ``who``: "sandbox" for a run, "command" for a Session's)."""
    from lowlevel.spec.report import WARNING_PREFIX
    return f"{WARNING_PREFIX}{name} {asked} is above {bound_is} ({bound}): the {who} runs with {bound}"


__all__ = [
    "CPU_QUOTA_FALLBACK_NOTE",
    "DEFAULT_FSIZE_BYTES",
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_TMP_SIZE_BYTES",
    "DEFAULT_WORKSPACE_BYTES",
    "Enforcing",
    "GiB",
    "KiB",
    "Limits",
    "MEMORY_FALLBACK_NOTE",
    "MIN_DISK_UPPER_BYTES",
    "MiB",
    "PIDS_FALLBACK_NOTE",
    "PROGRAM_MEMORY_BYTES",
    "REQUIRABLE",
    "VERDICT_NOTE_PREFIXES",
    "fallback_notes",
    "lowered_note",
    "memory_kill_note",
    "rlimits",
    "rlimits_for",
    "tmpfs_bytes",
]
