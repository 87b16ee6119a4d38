"""Test-only stand-ins for what the launcher does through the anchor and the exec helper: put a
plain child process (gated on stdin, as bwrap's child blocks on ``--block-fd``) into a run cgroup,
and set the run's rlimits on it with prlimit(2).

The launcher never moves a process: the anchor joins the v1 ``tasks`` files and bwrap is cloned
into the v2 directory (:meth:`lowlevel.host.cgroups.RunCgroup.join_targets`), and the exec helper
sets the rlimits before it execs bwrap. Tests of the cgroup and rlimit machinery alone
(tests/unit/test_limits.py, tests/integration/test_limits_cgroup.py) use these instead.
"""

from __future__ import annotations

import os
import resource

from lowlevel.errors import LaunchError
from lowlevel.host import cgroupfs
from lowlevel.host.cgroups import RunCgroup
from lowlevel.spec.limits import Limits, rlimits


def attach(cgroup: RunCgroup, pid: int) -> None:
    """Move ``pid`` into the run's directory in every hierarchy (a write to each ``cgroup.procs``).

    Children it forks afterwards are born inside. Memory it already used stays charged where it
    was (v2 never moves charges; v1 only with ``memory.move_charge_at_immigrate``).

    Raises:
        LaunchError: writing ``cgroup.procs`` failed (``ESRCH``: the process is gone; ``EBUSY``/``EPERM``).
    """
    for node in cgroup.nodes:
        target = os.path.join(node.path, "cgroup.procs")
        try:
            cgroupfs.write(target, str(pid))
        except OSError as err:
            raise LaunchError(f"write {pid} to {target} failed: {err.strerror}", errno=err.errno) from err


def apply_rlimits(pid: int, limits: Limits, cgroup: RunCgroup | None = None) -> tuple[str, ...]:
    """Set the run's rlimits (:func:`lowlevel.spec.limits.rlimits`) on ``pid`` with prlimit(2).

    A value above the child's current hard limit is lowered to that hard limit (an unprivileged
    caller cannot raise one). Call it after :func:`attach`, passing the cgroup, so the memory and
    pids fallbacks apply exactly when the cgroup cannot.

    Returns:
        Names of the rlimits set, e.g. ``("RLIMIT_CPU", "RLIMIT_FSIZE", ...)``.
    Raises:
        LaunchError: prlimit(2) failed (``ESRCH``: the child is gone; ``EPERM``: not ours).
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
