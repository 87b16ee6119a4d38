"""lowlevel.ray on a real multi-node Ray cluster started on this machine.

One module-scoped ``ray.cluster_utils.Cluster``: a head node and two workers, each with its
own resources label, 1 CPU and an 80 MiB object store. The second worker is started with
``LOWLEVEL_WORKSPACE_BASE`` pointing into ``/proc`` (a node whose sandboxes cannot get a
workspace: the actor's ``lowlevel doctor`` fails its "sandbox runs" check there): the pool
must report it and never use it. The node-failure test (the
last one using the cluster) kills the good worker's raylet mid-batch.

Health checks are tightened (GCS notices a dead raylet in ~2 s instead of ~30 s) only to
keep the suite fast; nothing in lowlevel.ray depends on it.

Skipped cleanly when the ``ray`` extra is not installed; ``.ci/setup`` installs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from helpers.ray_cluster import private_ray_cluster  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import lowlevel  # noqa: E402
from lowlevel.ray import Call, ClusterError, RemoteResult, SandboxActorPool  # noqa: E402

pytestmark = [pytest.mark.bwrap]

HERE = Path(__file__).resolve().parent.parent
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
               "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}
ALL_BYTES = bytes(range(256))


class Nodes:
    def __init__(self, cluster: Cluster, head: str, good: str, broken: str) -> None:
        self.cluster, self.head, self.good, self.broken = cluster, head, good, broken


def _node_id(node) -> str:
    return node.node_id if hasattr(node, "node_id") else node.unique_id


@pytest.fixture(scope="module")
def nodes():
    if not shutil.which("bwrap"):
        pytest.skip("bwrap is not installed")
    with private_ray_cluster("llray-", **NODE, resources={"head": 1}, include_dashboard=False, no_monitor=True,
                             _system_config=FAST_HEALTH) as cluster:
        good = cluster.add_node(**NODE, resources={"good": 1})
        # A node where no sandbox can run (env_vars: the raylet's environment, inherited by its
        # workers): its workspace base cannot be created.
        bad = cluster.add_node(**NODE, resources={"broken": 1}, env_vars={"LOWLEVEL_WORKSPACE_BASE": "/dev/null/nope"})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield Nodes(cluster, _node_id(cluster.head_node), _node_id(good), _node_id(bad))


@pytest.fixture(scope="module")
def pool(nodes):
    p = SandboxActorPool(concurrency=2, max_in_flight=3, max_retries=2)
    yield p
    p.shutdown()


def _sandbox_children(pid: int) -> list[str]:
    """Command lines of the live descendants of ``pid`` (a Ray worker holding sandboxes)."""
    out = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    for child in f.read().split():
                        todo.append(int(child))
                        with open(f"/proc/{child}/cmdline", "rb") as c:
                            out.append(c.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


def test_node_that_cannot_run_sandboxes_is_reported_not_used(nodes, pool):
    status = {s.node_id: s for s in pool.nodes()}
    assert status[nodes.head].ok and status[nodes.good].ok
    bad = status[nodes.broken]
    assert not bad.ok and bad.actors == 0
    assert "sandbox runs" in bad.reason and "cannot create workspace base /dev/null/nope" in bad.reason
    assert bad.doctor is not None and bad.doctor["ok"] is False
    results = ray.get([pool.submit(["true"]) for _ in range(12)])
    assert {r.node_id for r in results} <= {nodes.head, nodes.good}


@pytest.mark.slow
def test_pool_with_no_usable_node_says_why(nodes):
    with pytest.raises(ClusterError) as err:
        SandboxActorPool(nodes=[nodes.broken], concurrency=1)
    assert err.value.reason == "start"
    assert nodes.broken[:12] in str(err.value) and "cannot create workspace base" in str(err.value)


def test_calls_spread_across_nodes(nodes, pool):
    results = ray.get([pool.submit(["sh", "-c", "sleep 0.3"]) for _ in range(8)])
    assert all(r.ok for r in results)
    used = [r.node_id for r in results]
    assert set(used) == {nodes.head, nodes.good}
    assert min(used.count(nodes.head), used.count(nodes.good)) >= 3  # least-loaded, not all on one


def test_result_identical_to_local_run(nodes, pool, tmp_path: Path):
    script = (b"import os, sys\n"
              b"data = open('in.txt', 'rb').read()\n"
              b"open('out.bin', 'wb').write(data[::-1])\n"
              b"open('in.txt', 'ab').write(b'!')\n"
              b"os.remove('gone.txt')\n"
              b"os.makedirs('new/dir')\n"
              b"open('new/dir/f', 'w').write(os.environ.get('ANSWER', '?'))\n"
              b"print('out', len(data)); print('err', file=sys.stderr); sys.exit(3)\n")
    inputs = {"main.py": script, "in.txt": b"hello\n", "gone.txt": b"bye"}
    policy = lowlevel.Policy(env={"ANSWER": "42"})
    src = tmp_path / "src"
    src.mkdir()
    for name, data in inputs.items():
        (src / name).write_bytes(data)
    local = lowlevel.run(["python3", "main.py"], policy=policy, inputs=sorted(src.iterdir()), timeout=30)
    remote = pool.run(["python3", "main.py"], policy=policy, inputs=inputs, timeout=30)
    assert isinstance(remote, RemoteResult) and isinstance(remote, lowlevel.Result)
    for name in ("exit_code", "stdout", "stderr", "timed_out", "killed_by", "term_signal", "changes",
                 "stdout_truncated", "seccomp_denials"):
        assert getattr(remote, name) == getattr(local, name), name
    assert remote.exit_code == 3 and remote.stdout == b"out 6\n"
    assert remote.changes.deleted == ("gone.txt",)
    for rel in ("out.bin", "in.txt", "new/dir/f"):
        assert remote.files[rel] == (Path(local.workspace) / rel).read_bytes(), rel
    assert set(remote.files) == {"out.bin", "in.txt", "new/dir/f"}
    assert remote.files_omitted == () and not remote.files_truncated
    assert remote.workspace == "" and remote.attempts == 1 and not remote.retried
    assert remote.node_id in (nodes.head, nodes.good)
    lowlevel.workspace.remove_workspace(local.workspace)


def test_inputs_and_outputs_byte_exact_with_non_utf8_names(pool):
    inputs = {b"caf\xe9/\xff.bin": ALL_BYTES, b"sub/\x80\x81": ALL_BYTES[::-1], "run.sh": b"#!/bin/sh\nexit 0\n"}
    code = ("import os, hashlib\n"
            "for d, _, fs in os.walk(b'.'):\n"
            "    for f in sorted(fs):\n"
            "        p = os.path.join(d, f)[2:]\n"
            "        data = open(p, 'rb').read()\n"
            "        print(p.hex(), hashlib.sha256(data).hexdigest())\n"
            "        open(b'copy-' + p.replace(b'/', b'_'), 'wb').write(data)\n"
            "open(b'\\xfe\\xfdnew', 'wb').write(bytes(range(255, -1, -1)) * 3)\n")
    r = pool.run(["python3", "-c", code], inputs=inputs, timeout=30)
    assert r.exit_code == 0, r.stderr
    import hashlib
    seen = dict(line.split() for line in r.stdout.decode().splitlines())
    for name, data in inputs.items():
        raw = os.fsencode(name) if isinstance(name, str) else name
        assert seen[raw.hex()] == hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()
    assert r.file(b"copy-caf\xe9_\xff.bin") == ALL_BYTES
    assert r.file(b"copy-sub_\x80\x81") == ALL_BYTES[::-1]
    assert r.file(b"\xfe\xfdnew") == bytes(range(255, -1, -1)) * 3
    assert os.fsencode(next(k for k in r.files if k.endswith("new"))) == b"\xfe\xfdnew"


def test_output_cap_reports_truncation(nodes):
    with SandboxActorPool(nodes=[nodes.head], concurrency=1, max_output_bytes=1000) as small:
        r = small.run(["sh", "-c", "head -c 600 /dev/zero > a; head -c 600 /dev/zero > b; "
                                   "head -c 100 /dev/zero > c; ln -s a l"], timeout=30)
    assert r.exit_code == 0, r.stderr
    assert set(r.files) == {"a", "c"} and r.files["a"] == b"\0" * 600
    assert r.files_truncated and r.files_dropped_bytes == 600
    assert r.files_omitted == ("b", "l")


def test_timed_out_call_is_a_result_never_retried(pool):
    r = pool.run(["sleep", "30"], timeout=0.5)
    assert r.timed_out and r.killed_by == "timeout"
    assert r.attempts == 1 and r.lost_nodes == ()


def test_errors_are_lowlevel_errors(pool):
    with pytest.raises(lowlevel.ExecError):
        pool.run(["/no/such/program"])
    ref = pool.submit(["/no/such/program"])
    with pytest.raises(lowlevel.ExecError):  # Ray's RayTaskError is also the lowlevel class
        ray.get(ref)
    with pytest.raises(lowlevel.PolicyError):
        pool.submit("true")
    with pytest.raises(lowlevel.PolicyError, match="max_input_bytes"):
        pool.submit(["true"], inputs={"big": b"x" * (pool.max_input_bytes + 1)})
    with pytest.raises(lowlevel.PolicyError):
        pool.submit(["true"], inputs={"../up": b"x"})


def test_policy_travels_unchanged_and_seccomp_compiles_once_per_actor(pool):
    before = {s["node_id"]: s for s in pool.stats()}
    denied = lowlevel.DEFAULT_PROFILE.with_extra_deny("mkdir")
    policy = lowlevel.Policy(env={"X": "1"}, seccomp=denied, limits=lowlevel.Limits(nofile=77))
    results = [pool.run(["sh", "-c", "echo $X; ulimit -n; mkdir d"], policy=policy, timeout=30) for _ in range(6)]
    for r in results:
        assert r.stdout == b"1\n77\n"
        assert b"Operation not permitted" in r.stderr  # the extra deny rule reached the node
    # The same Policy value sent again as a fresh copy: no new compile anywhere.
    copy = lowlevel.Policy(env={"X": "1"}, seccomp=lowlevel.DEFAULT_PROFILE.with_extra_deny("mkdir"),
                           limits=lowlevel.Limits(nofile=77))
    ray.get([pool.submit(["true"], policy=copy) for _ in range(6)])
    after = {s["node_id"]: s for s in pool.stats()}
    for node, s in after.items():
        grew = s["seccomp_cache_entries"] - before[node]["seccomp_cache_entries"]
        assert grew == 1, (node, grew)          # one compile for the new profile, on each actor
        assert s["policies"] - before[node]["policies"] == 1
    # per-call limits replace the Policy's
    assert pool.run(["sh", "-c", "ulimit -n"], limits=lowlevel.Limits(nofile=55)).stdout == b"55\n"


def test_map_backpressure_order_and_exceptions(pool):
    calls = [["sh", "-c", f"sleep 0.05; echo {i}"] for i in range(24)]
    outs = [r.stdout for r in pool.map(calls, timeout=30)]
    assert outs == [f"{i}\n".encode() for i in range(24)]
    assert max(s["peak_in_flight"] for s in pool.stats()) <= 3  # max_in_flight per actor
    mixed = [Call(["true"]), Call(["/no/such"]), Call(["cat"], stdin=b"in"), ["sh", "-c", "exit 4"]]
    got = list(pool.map(mixed, return_exceptions=True))
    assert got[0].exit_code == 0 and isinstance(got[1], lowlevel.ExecError)
    assert got[2].stdout == b"in" and got[3].exit_code == 4
    unordered = list(pool.map([["echo", str(i)] for i in range(6)], ordered=False))
    assert sorted(r.stdout for r in unordered) == sorted(f"{i}\n".encode() for i in range(6))
    with pytest.raises(lowlevel.ExecError):
        list(pool.map([["true"], ["/no/such"]]))


def test_asyncio_driver(pool):
    async def main():
        r1 = await pool.arun(["echo", "a"])
        r2 = await pool.submit(["echo", "b"])                   # an ObjectRef is awaitable
        rs = [r async for r in pool.amap([["echo", str(i)] for i in range(8)])]
        with pytest.raises(lowlevel.ExecError):
            await pool.arun(["/no/such"])
        tick = 0

        async def ticker():
            nonlocal tick
            while True:
                await asyncio.sleep(0.01)
                tick += 1

        t = asyncio.create_task(ticker())
        await pool.arun(["sleep", "0.5"])
        t.cancel()
        return r1, r2, rs, tick

    r1, r2, rs, tick = asyncio.run(main())
    assert r1.stdout == b"a\n" and r2.stdout == b"b\n"
    assert [r.stdout for r in rs] == [f"{i}\n".encode() for i in range(8)]
    assert tick >= 10  # the loop kept running while the call was remote


def _router_dispatched(pool) -> int:
    return sum(d for *_, d in ray.get(pool._router.status.remote())["actors"])


def test_run_and_map_go_straight_to_the_actors_in_batches(pool):
    """run/arun/map/amap call the actors from the driver (the router sees none of them); map
    sends several calls per actor task; submit still goes through the router (control)."""
    before_router = _router_dispatched(pool)
    before = pool.stats()
    assert pool.run(["echo", "x"]).stdout == b"x\n"
    assert asyncio.run(pool.arun(["echo", "y"])).stdout == b"y\n"
    outs = [r.stdout for r in pool.map([["echo", str(i)] for i in range(12)], batch=3)]
    assert outs == [f"{i}\n".encode() for i in range(12)]

    async def amap():
        return [r.stdout async for r in pool.amap([["echo", str(i)] for i in range(6)], batch=2)]

    assert asyncio.run(amap()) == [f"{i}\n".encode() for i in range(6)]
    after = pool.stats()
    assert _router_dispatched(pool) == before_router  # none went through the router
    assert sum(s["calls"] for s in after) - sum(s["calls"] for s in before) == 2 + 12 + 6
    batches = sum(s["batches"] for s in after) - sum(s["batches"] for s in before)
    # each first fill sends a batch to each of the 2 actors; a batch holds >= 2 calls (a lone one is a plain run)
    assert 2 + 2 <= batches <= 12 // 2 + 6 // 2
    assert max(s["peak_in_flight"] for s in after) <= 3 * 2  # max_in_flight per path (direct, router)
    ray.get(pool.submit(["true"]))
    assert _router_dispatched(pool) == before_router + 1  # control: submit uses the router
    with pytest.raises(lowlevel.PolicyError, match="batch"):
        list(pool.map([["true"]], batch=0))


def test_run_waits_in_the_router_when_every_direct_slot_is_taken(pool):
    capacity = pool._direct.capacity()
    held: list = []
    holder = threading.Thread(target=lambda: held.extend(pool.map([["sleep", "2"]] * capacity, timeout=30)))
    holder.start()
    try:
        deadline = time.monotonic() + 30
        while sum(s.in_flight for s in pool._direct.slots.values() if s.alive) < capacity:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        before_router = _router_dispatched(pool)
        assert pool.run(["echo", "queued"]).stdout == b"queued\n"
        assert _router_dispatched(pool) == before_router + 1
    finally:
        holder.join(60)
    assert len(held) == capacity and all(r.exit_code == 0 for r in held)


@pytest.mark.slow
def test_killed_actor_under_the_fast_path_reruns_its_calls(nodes):
    """SIGKILL one actor's worker while map (batched) and arun calls run on it: each of its calls
    is re-run on the other actor (attempts 2, lost_nodes), the pool reports the node lost, and
    none of the dead actor's sandboxes is left."""
    token = f"llkill{os.getpid()}x{time.monotonic_ns()}"
    two = SandboxActorPool(nodes=[nodes.head, nodes.good], concurrency=2, max_in_flight=4, max_retries=1)
    try:
        victim_pid = next(s["pid"] for s in two.stats() if s["node_id"] == nodes.good)
        mapped: list = []
        mapper = threading.Thread(target=lambda: mapped.extend(
            two.map([["sh", "-c", f"sleep 2; echo {token}-{i}"] for i in range(4)], batch=2, timeout=60)))
        mapper.start()
        deadline = time.monotonic() + 30
        while not all(s["in_flight"] == 2 for s in two.stats()):
            assert time.monotonic() < deadline
            time.sleep(0.02)

        async def aruns():
            return await asyncio.gather(*(two.arun(["sh", "-c", f"sleep 1; echo {token}-a{i}"], timeout=60)
                                          for i in range(2)))

        arunner = threading.Thread(target=lambda: mapped.extend(asyncio.run(aruns())))
        arunner.start()
        while not all(s["in_flight"] == 3 for s in two.stats()):  # one arun on each actor
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(victim_pid, signal.SIGKILL)
        mapper.join(120)
        arunner.join(120)
        outs = sorted(r.stdout for r in mapped)
        assert outs == sorted([f"{token}-{i}\n".encode() for i in range(4)]
                              + [f"{token}-a{i}\n".encode() for i in range(2)])
        retried = [r for r in mapped if r.retried]
        assert len(retried) == 3  # the victim's batch of 2 and its arun
        for r in retried:
            assert r.attempts == 2 and r.lost_nodes == (nodes.good,) and r.node_id == nodes.head
        status = {s.node_id: s for s in two.nodes()}
        assert not status[nodes.good].ok and status[nodes.good].reason.startswith("lost")
        assert {two.run(["true"]).node_id for _ in range(3)} == {nodes.head}
    finally:
        two.shutdown()
    deadline = time.monotonic() + 20
    while subprocess.run(["pgrep", "-f", token], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a sandbox of the killed actor outlived it"
        time.sleep(0.2)


@pytest.mark.slow
def test_shutdown_under_a_direct_call_says_closed_and_leaves_no_sandbox(nodes):
    token = f"llshut{os.getpid()}x{time.monotonic_ns()}"
    small = SandboxActorPool(nodes=[nodes.head], concurrency=1)
    got: dict = {}

    def call():
        try:
            got["result"] = small.run(["sh", "-c", f"sleep 30; echo {token}"], timeout=60)
        except BaseException as err:  # noqa: BLE001 - the test looks at it
            got["err"] = err

    caller = threading.Thread(target=call)
    caller.start()
    try:
        deadline = time.monotonic() + 30
        while not any(s["running"] for s in small.stats()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert subprocess.run(["pgrep", "-f", token], capture_output=True).returncode == 0  # control
    finally:
        small.shutdown()
        caller.join(60)
    assert "result" not in got and isinstance(got["err"], ClusterError) and got["err"].reason == "closed"
    deadline = time.monotonic() + 20
    while subprocess.run(["pgrep", "-f", token], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the sandbox outlived its pool"
        time.sleep(0.2)


def test_session_is_pinned_to_one_node(nodes, pool):
    with pool.open_session(inputs={"seed.txt": b"0"}) as s:
        assert s.node_id in (nodes.head, nodes.good)
        for i in range(1, 5):
            r = s.run(["sh", "-c", f"echo {i} >> seed.txt; cat seed.txt"])
            assert r.node_id == s.node_id
        assert r.stdout == b"01\n2\n3\n4\n"
        assert r.files["seed.txt"] == b"01\n2\n3\n4\n"   # changed files travel back
        assert s.read_file("seed.txt") == b"01\n2\n3\n4\n"
        results = [pool.run(["true"]) for _ in range(4)]  # fresh calls are not pinned
        assert {x.node_id for x in results} == {nodes.head, nodes.good}
    with pytest.raises(lowlevel.SessionError) as err:
        s.run(["true"])
    assert err.value.reason == "closed"
    with pool.open_session(node_id=nodes.good) as s2:
        assert s2.node_id == nodes.good and s2.run(["true"]).node_id == nodes.good
    with pytest.raises(ClusterError):
        pool.open_session(node_id=nodes.broken)


@pytest.mark.slow
def test_killed_raylet_mid_batch_loses_no_call(nodes, pool):
    """Kills the "good" worker's raylet: keep this the module's last test using the cluster."""
    victim = nodes.good
    token = f"lltok{os.getpid()}x{time.monotonic_ns()}"
    pids = {s["node_id"]: s["pid"] for s in pool.stats()}
    # the router stays on the driver's node: losing another node never loses the router
    assert ray.get(pool._router.status.remote())["router_node"] == ray.get_runtime_context().get_node_id()
    session = pool.open_session(node_id=victim)
    assert session.run(["true"]).node_id == victim
    refs = [pool.submit(["sh", "-c", f"sleep 1; echo {token}-{i}"], timeout=60) for i in range(8)]
    mapped: list = []   # the driver's fast path (map: straight to the actors, in batches), at the same time
    mapper = threading.Thread(target=lambda: mapped.extend(
        pool.map([["sh", "-c", f"sleep 1; echo {token}-m{i}"] for i in range(6)], timeout=60)))
    mapper.start()
    deadline = time.monotonic() + 30
    # more than the router's max_in_flight=3 on the victim: some of the map's calls are there too
    while not any(s["running"] and s["in_flight"] > 3 for s in pool.stats() if s["node_id"] == victim):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert subprocess.run(["pgrep", "-f", token], capture_output=True).returncode == 0  # control
    next(n for n in nodes.cluster.worker_nodes if _node_id(n) == victim).kill_raylet()
    results = ray.get(refs, timeout=240)
    assert [r.stdout for r in results] == [f"{token}-{i}\n".encode() for i in range(8)]
    retried = [r for r in results if r.retried]
    assert retried, "no call was in flight on the killed node"
    for r in retried:
        assert r.attempts == 2 and r.lost_nodes == (victim,) and r.node_id == nodes.head
    assert all(not r.timed_out for r in results)
    mapper.join(240)
    assert [r.stdout for r in mapped] == [f"{token}-m{i}\n".encode() for i in range(6)]
    for r in mapped:  # a direct call running on the victim may still finish there (its worker outlives
        # the raylet for a moment and answers the driver directly); one that did not is re-run on the head
        assert (r.attempts, r.lost_nodes, r.node_id) in ((1, (), victim), (1, (), nodes.head),
                                                        (2, (victim,), nodes.head)), r
    # run() after the loss: never on the dead node (whichever path saw the death first)
    assert {pool.run(["true"]).node_id for _ in range(4)} == {nodes.head}
    with pytest.raises(lowlevel.SessionError) as err:
        session.run(["true"])
    assert err.value.reason == "node_lost"
    status = {s.node_id: s for s in pool.nodes()}
    assert not status[victim].ok and status[victim].reason.startswith("lost")
    # later calls avoid the dead node
    assert {r.node_id for r in ray.get([pool.submit(["true"]) for _ in range(4)])} == {nodes.head}
    # nothing of the batch is left running anywhere, and the survivor holds no sandbox
    deadline = time.monotonic() + 20
    while subprocess.run(["pgrep", "-f", token], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a sandbox process of the batch outlived it"
        time.sleep(0.2)
    # the last calls' anchors are reaped by the actor's one-shot teardown thread just after their
    # Results (lowlevel.sandbox.teardown): a zombie (empty cmdline) may stand for a moment, not for good
    while (left := _sandbox_children(pids[nodes.head])) and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    assert left == []


@pytest.mark.slow
def test_unprivileged_user_driver(test_user: pwd.struct_passwd):
    """The whole path as an unprivileged user: its own one-node Ray, bwrap mapping its uid."""
    temp_dir = tempfile.mkdtemp(prefix="llray-u-")
    os.chown(temp_dir, test_user.pw_uid, test_user.pw_gid)
    script = r"""
import json, os, sys, ray
import lowlevel
from lowlevel.ray import SandboxActorPool
ray.init(address="local", num_cpus=1, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
         _temp_dir=sys.argv[1])
with SandboxActorPool(concurrency=2) as pool:
    r = pool.run(["sh", "-c", "id -u; cat in; printf x > $(printf 'o\\376')"],
                 inputs={b"in": bytes(range(256))}, timeout=30)
    s = pool.open_session()
    s2 = s.run(["sh", "-c", "echo s > f; cat f"])
    s.close()
print(json.dumps({"exit": r.exit_code, "stdout": r.stdout.hex(), "files": {os.fsencode(k).hex(): v.hex()
       for k, v in r.files.items()}, "node": r.node_id, "notes": list(r.notes), "session": s2.stdout.hex(),
       "uid": os.getuid()}))
ray.shutdown()
"""
    try:
        proc = subprocess.run([RUNUSER, "-u", test_user.pw_name, "--", sys.executable, "-c", script, temp_dir],
                              capture_output=True, timeout=240, cwd="/",
                              env={"PATH": os.environ["PATH"], "HOME": test_user.pw_dir, "LANG": "C.UTF-8",
                                   # nothing of this Ray goes to (or comes from) /tmp/ray
                                   "RAY_TMPDIR": temp_dir})
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    d = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert d["uid"] == test_user.pw_uid
    assert d["exit"] == 0
    assert bytes.fromhex(d["stdout"]) == f"{test_user.pw_uid}\n".encode() + bytes(range(256))
    assert d["files"] == {b"o\xfe".hex(): b"x".hex()}
    assert bytes.fromhex(d["session"]) == b"s\n"


FAILED_START = r"""
import json, os, shutil, sys, tempfile
sys.path.insert(0, sys.argv[1])
import ray._private.utils
from ray.cluster_utils import Cluster
from hygiene import children
from ray_cluster import kill_leftovers, private_ray_cluster

def fail(*args, **kwargs):  # Cluster writes the address file after the head's processes started
    raise FileNotFoundError(2, "No such file or directory (injected)", "/tmp/ray/ray_current_cluster")

ray._private.utils.write_ray_address = fail
head = {"num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False, "no_monitor": True}
out = {}
root = tempfile.mkdtemp(prefix="llray-ctl-")
os.environ["RAY_TMPDIR"] = root
try:  # control: the bare Cluster, as the fixture had it
    Cluster(initialize_head=True, head_node_args={**head, "temp_dir": os.path.join(root, "ray")})
except FileNotFoundError:
    out["control_failed"] = True
out["control_children"] = len(children())
out["control_killed"] = len(kill_leftovers(root))
del os.environ["RAY_TMPDIR"]
shutil.rmtree(root, ignore_errors=True)
try:
    with private_ray_cluster("llray-fail-", **head):
        out["entered"] = True
except FileNotFoundError as err:
    out["error"] = str(err)
out["children"] = children()
out["ray_tmpdir"] = os.environ.get("RAY_TMPDIR")
print(json.dumps(out))
"""


@pytest.mark.slow
def test_cluster_whose_start_fails_leaves_no_process():
    """A head whose start fails after its processes started (as on a machine without /tmp/ray,
    before the fixture had a temp root of its own) leaves none of them behind: their children
    of the test process failed three unrelated hygiene tests. Control: ray's bare Cluster leaves
    them running."""
    proc = subprocess.run([sys.executable, "-c", FAILED_START, str(HERE / "helpers")], capture_output=True,
                          timeout=240, cwd="/")
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    d = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert d["control_failed"] and d["control_children"] > 0 and d["control_killed"] > 0  # control
    assert "entered" not in d and "injected" in d["error"]
    assert d["children"] == []
    assert d["ray_tmpdir"] is None


@pytest.mark.slow
def test_bench_cluster_quick_json_schema(tmp_path):
    """bench/cluster.py starts its own cluster (here 1 then 2 nodes): validate its JSON with tiny N."""
    out = tmp_path / "cluster.json"
    proc = subprocess.run([sys.executable, str(HERE.parent / "bench" / "cluster.py"), "--quick", "--calls", "8",
                           "--concurrency", "2", "--latency-calls", "3", "--nodes", "2", "--cpu-calls", "3",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == 2 and {"results", "ratios", "targets", "host", "config"} <= set(doc)
    got = {(r["name"], r["nodes"]) for r in doc["results"]}
    names = ("local", "cluster", "cluster_router", "latency_local", "latency_cluster", "latency_ray_path",
             "latency_cluster_router", "latency_ray_router_path")
    assert got == {(name, count) for name in names for count in (1, 2)}
    for r in doc["results"]:
        if r["name"] in ("local", "cluster", "cluster_router"):
            assert r["errors"] == 0 and r["n"] == 8 and r["calls_per_s"] > 0
        else:
            assert r["n"] == 3 and 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
    for k in ("cluster_vs_local_calls_per_s", "added_latency_p50_ms", "ray_path_p50_ms",
              "cluster_2nodes_vs_1node_calls_per_s"):
        assert isinstance(doc["ratios"][k], float), k
    for sfx in ("1node", "2nodes"):
        for k in ("cluster_vs_local_calls_per_s", "cluster_router_vs_local_calls_per_s", "added_latency_p50_ms",
                  "added_latency_router_p50_ms", "added_latency_paired_p50_ms", "ray_path_p50_ms",
                  "ray_router_path_p50_ms"):
            assert isinstance(doc["ratios"][f"{k}_{sfx}"], float), (k, sfx)
    assert not any(k.startswith("_") for k in doc["ratios"])
    cpu = doc["cpu_ms_per_call"]
    assert set(cpu) == {"local_arun", "cluster_run", "cluster_router_run", "cluster_map", "cluster_map_batch1",
                        "cluster_router_map"}
    for per in cpu.values():
        assert {"driver", "router", "actor", "raylet", "gcs", "total"} <= set(per) and per["total"] >= 0
