"""A run cgroup left behind by an interrupted run never blocks the next run of the process.

Run cgroups were named ``run-<pid>-<id(Run object)>``. A KeyboardInterrupt between the cgroup's
``mkdir`` and the Run recording it (or during its removal's EBUSY retries) leaves the directory;
CPython then hands the next Run object the same address, hence the same name, and every such
run failed with ``LaunchError: cannot prepare the sandbox: File exists
(/sys/fs/cgroup/.../run-<pid>-<id>)`` until the process exited (the sweep takes only dead pids'
cgroups). Seen with SIGINT at random instants in the first 12 ms of ``lowlevel.run``.
Here the leak is made on purpose (the cgroup object is dropped without removing it), then the
next Runs must still prepare.
"""

from __future__ import annotations

import gc
import shutil
import tempfile

import pytest

import lowlevel
from lowlevel.sandbox.launcher import Run
from lowlevel.sandbox.request import RunRequest

pytestmark = [pytest.mark.bwrap, pytest.mark.root]


def test_a_leaked_run_cgroup_does_not_collide_with_later_runs() -> None:
    ws = tempfile.mkdtemp(prefix="rt-cg-", dir="/tmp")
    leaked = []
    try:
        policy = lowlevel.Policy()
        for _ in range(20):
            r = Run(RunRequest(["true"], workspace=ws), policy=policy)
            try:
                r.prepare()  # raised LaunchError (EEXIST) once an address came back
                if r.cgroup is None:
                    pytest.skip("no writable cgroup hierarchy here")
                leaked.append(r.cgroup)
                r.cgroup = None  # as if the interrupt hit before close() could remove it
            finally:
                r.close()
            del r
            gc.collect()
        assert len({cg.name for cg in leaked}) == len(leaked)
    finally:
        for cg in leaked:
            cg.remove()
        shutil.rmtree(ws, ignore_errors=True)
