"""One run's cgroup: how the host will enforce a run's :class:`~lowlevel.spec.limits.Limits`, and the
per-run cgroup that does it (create, write the limits, account, kill all, remove).

Glossary:
    run cgroup: ``<base>/<name>`` in every hierarchy a run needs (the bases come from
        :func:`lowlevel.host.cgroup_detect.detect_cgroups`); created before bwrap starts,
        removed after it ends (:class:`RunCgroup`).

Order of use in the launcher (nothing of the program runs before its limits apply)::

    cgroup = RunCgroup.create(limits)          # UnsupportedError for an unmet ``require``;
                                               # None: no writable hierarchy, rlimits only
    try:
        rlimits(limits, cgroup)                # lowlevel.spec.limits: the exec helper sets them
        tasks, v2_dir = cgroup.join_targets()  # opened by the launcher: the anchor joins the v1
                                               # tasks files, bwrap is cloned into the v2 dir
        spawn; supervise (cgroup.sample(), cgroup.event_counts() now and then)
        stats = cgroup.stats()
    finally:
        cgroup.kill_all(); cgroup.remove()

Sources: cgroups(7); the kernel's Documentation/admin-guide/cgroup-v2.rst and
Documentation/admin-guide/cgroup-v1/{memory,pids,freezer-subsystem,cpuacct}.rst.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import time

from lowlevel._dataclass import dataclass
from lowlevel.errors import UnsupportedError
from lowlevel.host import cgroupfs, run_records
from lowlevel.host.cgroup_detect import CgroupSupport, Hierarchy, detect_cgroups
from lowlevel.spec.limits import Limits, rlimits_for

#: Period written with a CPU quota: 100 ms, the kernel's default ``cpu.cfs_period_us``.
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class EnforcementPlan:
    """What a run with given :class:`Limits` will get on this host. From :func:`enforcement_plan`.

    Attributes:
        cgroups: ``(controller, version)`` for each limit a run cgroup will enforce, e.g.
            ``(("memory", 1), ("pids", 1))``.
        cgroup: True when runs get a cgroup at all (kill-all, CPU time, peak memory).
        rlimits: ``(name, soft, hard)`` triples :func:`lowlevel.spec.limits.rlimits` gives (the exec helper sets them).
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
                           rlimits_for(limits, frozenset(c for c, _ in cgroups)), tuple(not_enforced))


def _unsupported_message(name: str, support: CgroupSupport) -> str:
    what = "a writable cgroup" if name == "cgroup" else f"a writable cgroup with the {name} controller"
    seen = "; ".join(f"v{h.version} {h.mount}: {h.how}" + (f" (controllers {','.join(sorted(h.controllers))})"
                                                           if h.base else "")
                     for h in support.hierarchies) or "no cgroup mounted"
    return f"Limits.require has {name!r} but this host offers no {what} ({seen})"



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

        nodes: list[_Node] = []
        record = run_records.write(name, [os.path.join(str(h.base), name) for h in chosen.values()], workspace)
        try:
            for h in chosen.values():
                assert h.base is not None
                path = os.path.join(h.base, name)
                cgroupfs.mkdir(path)
                nodes.append(_Node(h.version, path, h.controllers))
            enforced, files, notes = _write_limits(nodes, limits)
        except BaseException:
            for node in reversed(nodes):
                try:
                    cgroupfs.rmdir(node.path)
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

    @classmethod
    def adopt(cls, name: str, dirs: list[tuple[int, str, frozenset[str]]]) -> "RunCgroup":
        """A RunCgroup for the existing directories ``(version, path, controllers)`` of a run that
        is not this process's (``lowlevel cleanup``'s orphans), for :meth:`kill_all`; no record."""
        return cls(name, [_Node(v, p, c) for v, p, c in dirs], (), (), ())

    def node(self, controller: str) -> _Node | None:
        """The run's directory carrying ``controller`` (v2's for ``"cgroup.kill"``/``"cpu.stat"``)."""
        if controller in ("v2",):
            return next((n for n in self.nodes if n.version == 2), None)
        return next((n for n in self.nodes if controller in n.controllers), None)

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
            found.update(cgroupfs.read_ints(os.path.join(node.path, "cgroup.procs")))
        return sorted(found)

    def sample(self) -> None:
        """Record ``memory.current`` for the peak where ``memory.peak`` is missing (v2 < 5.19).

        Cheap (one read); the supervisor calls it while it waits.
        """
        node = self.node("memory")
        if node is not None and node.version == 2:
            current = cgroupfs.read_int(os.path.join(node.path, "memory.current"))
            if current is not None:
                self._memory_sampled = max(self._memory_sampled, current)

    def stats(self) -> CgroupStats:
        """Read the run's accounting; call it after the run ends, before :meth:`remove`."""
        peak = oom = pids_hit = pids_peak = user = system = None
        mem = self.node("memory")
        if mem is not None and mem.version == 2:
            self.sample()
            peak = cgroupfs.read_int(os.path.join(mem.path, "memory.peak"), one_record=True)
            peak = max(peak or 0, self._memory_sampled) or peak
            oom = cgroupfs.read_keyed(os.path.join(mem.path, "memory.events"), one_record=True).get("oom_kill")
        elif mem is not None:
            peak = cgroupfs.read_int(os.path.join(mem.path, "memory.max_usage_in_bytes"), one_record=True)
            oom = cgroupfs.read_keyed(os.path.join(mem.path, "memory.oom_control"), one_record=True).get("oom_kill")
        pid_node = self.node("pids")
        if pid_node is not None:
            hits = cgroupfs.read_keyed(os.path.join(pid_node.path, "pids.events"), one_record=True).get("max")
            pids_hit = None if hits is None else hits > 0
            pids_peak = cgroupfs.read_int(os.path.join(pid_node.path, "pids.peak"), one_record=True)
        v2 = self.node("v2")
        acct = self.node("cpuacct")
        if v2 is not None:
            stat = cgroupfs.read_keyed(os.path.join(v2.path, "cpu.stat"), one_record=True)
            if "user_usec" in stat:
                user, system = stat["user_usec"] / 1e6, stat.get("system_usec", 0) / 1e6
        elif acct is not None:
            u = cgroupfs.read_int(os.path.join(acct.path, "cpuacct.usage_user"), one_record=True)
            s = cgroupfs.read_int(os.path.join(acct.path, "cpuacct.usage_sys"), one_record=True)
            total = cgroupfs.read_int(os.path.join(acct.path, "cpuacct.usage"), one_record=True)
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
                out[key] = cgroupfs.parse_keyed(os.pread(fd, 4096, 0).decode("ascii", "replace")).get(key)
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
                cgroupfs.write(os.path.join(mem.path, "memory.max"), "max" if value is None else str(value))
            else:
                text = "-1" if value is None else str(value)
                limit, memsw = (os.path.join(mem.path, f) for f in ("memory.limit_in_bytes",
                                                                     "memory.memsw.limit_in_bytes"))
                current = cgroupfs.read_int(limit)
                raising = value is None or (current is not None and value > current)
                extra = [memsw] if os.path.exists(memsw) else []
                for path in (extra + [limit] if raising else [limit] + extra):
                    cgroupfs.write(path, text)
            (enforced.add if value is not None else enforced.discard)("memory")
        pid_node = self.node("pids")
        if pid_node is not None and (limits.pids is not None or "pids" in enforced):
            cgroupfs.write(os.path.join(pid_node.path, "pids.max"), "max" if limits.pids is None else str(limits.pids))
            (enforced.add if limits.pids is not None else enforced.discard)("pids")
        cpu = self.node("cpu")
        if cpu is not None and (limits.cpu_quota is not None or "cpu" in enforced):
            quota = -1 if limits.cpu_quota is None else max(1000, round(limits.cpu_quota * CPU_PERIOD_US))
            if cpu.version == 2:
                cgroupfs.write(os.path.join(cpu.path, "cpu.max"), f"{'max' if quota < 0 else quota} {CPU_PERIOD_US}")
            else:
                cgroupfs.write(os.path.join(cpu.path, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                cgroupfs.write(os.path.join(cpu.path, "cpu.cfs_quota_us"), str(quota))
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
                cgroupfs.write(os.path.join(v2.path, "cgroup.kill"), "1")
            except OSError:
                pass  # fall through to the loop below
        freezer = self.node("freezer")
        while self.pids():
            if freezer is not None:
                self._freeze_kill_thaw(freezer, deadline)
            else:
                for pid in self.pids():
                    cgroupfs.kill(pid)
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def _freeze_kill_thaw(self, freezer: _Node, deadline: float) -> None:
        state = os.path.join(freezer.path, "freezer.state")
        try:
            cgroupfs.write(state, "FROZEN")
            while cgroupfs.read(state).strip() != "FROZEN" and time.monotonic() < deadline:
                time.sleep(0.001)
            for pid in self.pids():
                cgroupfs.kill(pid)
        finally:
            try:
                cgroupfs.write(state, "THAWED")
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
        # A finished run's directories are empty: rmdir first (the kernel refuses a directory
        # with a task, EBUSY, atomically), and read cgroup.procs and kill only when one refused.
        # That skips three opens and reads per run (issue 27).
        gone = self._rmdir_all_once()
        if not gone and self.pids():
            self.kill_all(timeout_s)
        left = []
        for node in () if gone else self.nodes:  # all gone: no second rmdir of each (ENOENT)
            delay = 0.0005
            while True:
                try:
                    cgroupfs.rmdir(node.path)
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
        run_records.remove(self.record)  # only once every directory is gone
        self.record = None

    def _rmdir_all_once(self) -> bool:
        """One rmdir of each directory (a missing one counts as removed); True when all are gone."""
        for node in self.nodes:
            try:
                cgroupfs.rmdir(node.path)
            except FileNotFoundError:
                pass
            except OSError:
                return False  # EBUSY (a task or a child inside) or else: the full path below decides
        return True

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
            cgroupfs.write(os.path.join(node.path, fname), value)
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


__all__ = ["CPU_PERIOD_US", "CgroupStats", "EnforcementPlan", "RunCgroup", "enforcement_plan"]
