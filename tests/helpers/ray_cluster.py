"""A private Ray cluster for the tests: every file under one fresh temp root, always stopped.

Used by tests/integration/test_ray.py's module cluster and by its test that a failed start
leaves nothing running (which runs this module in a subprocess of its own).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from typing import Any

import ray
from ray.cluster_utils import Cluster


def cluster_processes(temp_root: str) -> dict[int, str]:
    """Every live process whose environment has ``RAY_TMPDIR=temp_root`` (all of one private
    cluster's processes inherit it), this one excepted: ``{pid: command line}``, the command
    line's NULs as spaces. Processes that end or cannot be read during the scan are left out."""
    needle = b"\0RAY_TMPDIR=" + os.fsencode(temp_root) + b"\0"
    found: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in b"\0" + f.read():
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def kill_leftovers(temp_root: str) -> list[int]:
    """SIGKILL every process of the private cluster at ``temp_root`` (:func:`cluster_processes`)
    and reap those that are this process's children; return their PIDs. Nothing is found after
    a clean ``Cluster.shutdown()``; after a start that failed half-way, the started processes
    are found here and nowhere else."""
    killed = []
    for pid in cluster_processes(temp_root):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        killed.append(pid)
    for pid in killed:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return killed


@contextlib.contextmanager
def private_ray_cluster(prefix: str, **head_args: Any) -> Iterator[Cluster]:
    """A ``ray.cluster_utils.Cluster`` (head node only; add workers with ``add_node``) whose every
    file is under one fresh temp root, and that is stopped on exit: its driver connection, its
    nodes, and (also when the start failed half-way) any process of it still alive. The temp
    root is ``os.environ["RAY_TMPDIR"]`` while the block runs (:func:`cluster_processes`).

    Why a temp root of its own: ``Cluster`` writes its address file ``ray_current_cluster`` into
    ``$RAY_TMPDIR/ray`` (default ``/tmp/ray``) whatever ``temp_dir`` its nodes get (ray 2.60.0:
    ``cluster_utils.Cluster.add_node`` -> ``_private.utils.write_ray_address`` ->
    ``_common.utils.get_default_ray_temp_dir``), and never creates that directory: on a machine
    that never ran Ray the head's start failed there, its processes already started. With
    ``RAY_TMPDIR`` set to the root (inherited by every node process, so :func:`kill_leftovers`
    finds them) and the nodes' ``temp_dir`` at ``<root>/ray``, nothing is read from or left in
    ``/tmp/ray``; another cluster on the machine is neither seen nor disturbed.
    """
    root = tempfile.mkdtemp(prefix=prefix)
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = root
    cluster = Cluster(initialize_head=False)
    try:
        cluster.add_node(**head_args, temp_dir=os.path.join(root, "ray"))
        yield cluster
    finally:
        try:
            ray.shutdown()
            cluster.shutdown()
        finally:
            kill_leftovers(root)
            if old is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = old
            shutil.rmtree(root, ignore_errors=True)
