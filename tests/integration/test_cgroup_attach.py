"""The program is in its run's cgroup from its first instruction (the attach precedes the release).

The command is ``cat /proc/self/cgroup``: the first thing the program does is report where
it is. bwrap's ``--unshare-cgroup`` roots the sandbox's cgroup namespace where bwrap's child
was when it was cloned (the caller's cgroup); the launcher then moves that child into the
run's cgroup before it writes the ``--block-fd`` byte, so inside, every hierarchy with a run
directory shows ``/lowlevel/run-<caller pid>-<hex>`` (``/`` would mean "never moved", a
path elsewhere "moved too late or to the wrong place").
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time

import pytest

import lowlevel
from lowlevel.host import cgroup_detect as _cgroup_detect
from lowlevel.sandbox.aio import arun

from helpers.hygiene import settle

pytestmark = [pytest.mark.bwrap, pytest.mark.root, pytest.mark.timeout(60)]


def _hierarchies() -> dict[str, str]:
    """``{controller key in /proc/PID/cgroup: our run-directory base}`` for what a run uses."""
    support = _cgroup_detect.detect_cgroups()
    if not support.usable:
        pytest.skip("no writable cgroup hierarchy here")
    out = {}
    for controller in ("memory", "pids"):
        h = support.hierarchy_for(controller)
        if h is not None and h.version == 1:
            out[controller] = controller
        elif h is not None:
            out[""] = ""
    if support.v2 is not None and support.v2.base is not None:
        out[""] = ""
    return out


def _check(stdout: bytes, keys: dict[str, str]) -> None:
    # bwrap unshares the cgroup namespace after the anchor joined the run's cgroups, so inside,
    # the run's cgroup is the namespace's root: "/" in every hierarchy the run uses. (A
    # process attached later would see a path outside its namespace root: "/..".)
    seen = _cgroup_detect.parse_proc_cgroup(stdout.decode())
    for key in keys:
        assert seen[key] == "/", (key, seen[key], stdout)


def _run_dirs(keys: dict[str, str]) -> list[str]:
    settle()  # the finished runs' cgroups are removed off the result path (lowlevel.sandbox.teardown)
    support = _cgroup_detect.detect_cgroups()
    out = []
    for controller in keys:
        h = support.hierarchy_for(controller or "memory") if controller else support.v2
        if h is not None and h.base is not None:
            out += [os.path.join(h.base, d) for d in os.listdir(h.base) if d.startswith(f"run-{os.getpid()}-")]
    return out


@pytest.mark.parametrize("driver", ["run", "arun"])
def test_first_instruction_runs_in_the_run_cgroup(driver: str):
    keys = _hierarchies()
    assert "memory" in keys or "" in keys
    for _ in range(20):  # the join races nothing, but a regression may be intermittent
        if driver == "run":
            r = lowlevel.run(["cat", "/proc/self/cgroup"])
        else:
            r = asyncio.run(arun(["cat", "/proc/self/cgroup"]))
        shutil.rmtree(r.workspace, ignore_errors=True)
        assert r.exit_code == 0, r.stderr
        _check(r.stdout, keys)


def test_every_process_of_the_sandbox_is_in_the_run_cgroup():
    """Seen from the host while a run lives, in each hierarchy the run uses: bwrap and the
    program are inside; the anchor too in v1 ones (it joins them before forking bwrap), not in
    v2 (bwrap is created in the run's v2 cgroup by clone3(CLONE_INTO_CGROUP): nothing moves)."""
    keys = _hierarchies()
    t = threading.Thread(target=lambda: lowlevel.run(["sleep", "2"]))
    t.start()
    try:
        names: dict[str, set[str]] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (names and all({"bwrap", "sleep"} <= v for v in names.values())):
            for d in _run_dirs(keys):
                try:
                    with open(os.path.join(d, "cgroup.procs")) as f:
                        pids = [int(x) for x in f.read().split()]
                except OSError:
                    continue
                for pid in pids:
                    try:
                        with open(f"/proc/{pid}/comm") as f:
                            names.setdefault(d, set()).add(f.read().strip())
                    except OSError:
                        pass
            time.sleep(0.05)
        support = _cgroup_detect.detect_cgroups()
        v2_base = support.v2.base if support.v2 is not None else None
        assert names, "no run cgroup seen"
        for d, seen in names.items():
            assert {"bwrap", "sleep"} <= seen, (d, seen)
            if v2_base is not None and d.startswith(v2_base + "/"):
                assert "_lowlevel_exec" not in seen, (d, seen)
            else:
                assert "_lowlevel_exec" in seen, (d, seen)
    finally:
        t.join()


def test_control_the_caller_is_not_in_a_run_cgroup():
    with open("/proc/self/cgroup") as f:
        assert "/run-" not in f.read()
