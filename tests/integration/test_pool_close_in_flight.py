"""``Pool.close()`` while calls run: their sandboxes are killed and every one is torn down.

A fresh-user trial: close() returned in ~40 ms, the running calls went on to finish normally,
and each of their sandboxes was never torn down afterwards (its anchor, bwrap and init alive,
~30 fds, 3 cgroups, a run record and an ``rm-*`` workspace, until the process exited): nothing
tore down what a call handed back after close. Now close() kills the sandboxes of the calls in
flight, waits for them to hand their sandboxes back and tears every one down before it returns;
those calls raise ``SessionError(reason="closed")``. And cancelling ``Pool.arun`` kills its call's
sandbox (it ran on to its timeout). Driven in a caller of its own (root and the unprivileged
user), which looks at its own descendants, fds, workspace base and run records.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from helpers.identities import identity_prefix

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]

#: The caller: helpers for what it owns (descendants, fds, workspaces, run records), then the trial.
COMMON = r"""
import asyncio, json, os, sys, threading, time
d = sys.argv[1]
records = os.path.join(d, "records")
os.makedirs(records, mode=0o700)
os.environ["LOWLEVEL_RECORD_DIR"] = records
base = os.path.join(d, "base")
os.makedirs(base)
from lowlevel.session import Pool

def descendants():
    kids = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    s = f.read()
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            kids.setdefault(int(s[s.rindex(")") + 2:].split()[1]), []).append((int(p), cmd))
    out, todo = [], [os.getpid()]
    while todo:
        for pid, cmd in kids.get(todo.pop(), []):
            out.append(cmd)
            todo.append(pid)
    return out

def wait_for(cond, bound_s):
    deadline = time.monotonic() + bound_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()

def left(fds0):
    wait_for(lambda: not descendants(), 5)  # a bound: close() should leave none at all
    return {"procs": descendants(), "new_fds": sorted(set(os.listdir("/proc/self/fd")) - fds0),
            "ws": sorted(n for n in os.listdir(base) if not n.startswith(".")), "records": os.listdir(records)}

with Pool(size=1, workspace_base=base, keep_workspace=False) as warm:  # the per-process cached fds
    warm.run(["true"])
wait_for(lambda: not descendants(), 10)
fds0 = set(os.listdir("/proc/self/fd"))
"""

CLOSE = COMMON + r"""
pool = Pool(size=2, workspace_base=base, keep_workspace=False)
calls = {}
def call(i):
    t = time.monotonic()
    try:
        r = pool.run(["sleep", "20"], timeout=60)
        calls[i] = ["Result", r.exit_code, ""]
    except Exception as err:
        calls[i] = [type(err).__name__, getattr(err, "reason", None), str(err)]
    calls[i].append(time.monotonic() - t)
threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
running = wait_for(lambda: descendants().count("sleep 20") == 2, 30)
t = time.monotonic()
pool.close()
close_s = time.monotonic() - t
gone_at_close = [c for c in descendants()]
for t in threads:
    t.join(60)
print(json.dumps({"running": running, "close_s": close_s, "at_close": gone_at_close, "calls": calls,
                  **left(fds0)}))
"""


CANCEL = COMMON + r"""
pool = Pool(size=1, workspace_base=base, keep_workspace=False)
async def main():
    task = asyncio.create_task(pool.arun(["sleep", "20"], timeout=60))
    running = await asyncio.to_thread(wait_for, lambda: "sleep 20" in descendants(), 30)
    task.cancel()
    t = time.monotonic()
    try:
        await task
        outcome = "returned"
    except asyncio.CancelledError:
        outcome = "cancelled"
    cancel_s = time.monotonic() - t
    killed = wait_for(lambda: "sleep 20" not in descendants(), 3)
    after = (await pool.arun(["echo", "next"])).stdout.decode()
    return {"running": running, "outcome": outcome, "cancel_s": cancel_s, "killed": killed, "after": after}
t = time.monotonic()
out = asyncio.run(main())
out["asyncio_run_s"] = time.monotonic() - t
pool.close()
print(json.dumps({**out, **left(fds0)}))
"""


def _trial(script: str, identity: str, request: pytest.FixtureRequest) -> dict[str, object]:
    d = tempfile.mkdtemp(prefix="rt-poolclose-", dir="/tmp")
    try:
        os.chmod(d, 0o755)
        prefix = identity_prefix(identity, request, d)
        proc = subprocess.run([*prefix, sys.executable, "-c", script, d], capture_output=True, text=True,
                              cwd="/", timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("identity", ["root", "user"])
def test_close_kills_and_tears_down_the_calls_in_flight(identity: str, request: pytest.FixtureRequest) -> None:
    out = _trial(CLOSE, identity, request)
    assert out["running"] is True, out
    assert out["close_s"] < 15, out  # bounded: a kill and a teardown per sandbox, not the calls' 20 s
    assert out["at_close"] == [], out  # every sandbox was gone when close() returned
    calls = out["calls"]
    assert isinstance(calls, dict) and len(calls) == 2, out
    for kind, reason, message, elapsed in calls.values():
        assert (kind, reason) == ("SessionError", "closed") and "pool was closed" in message, out
        assert elapsed < 15, out  # killed, not run to its end
    assert (out["procs"], out["new_fds"], out["ws"], out["records"]) == ([], [], [], []), out


@pytest.mark.parametrize("identity", ["root", "user"])
def test_cancelling_arun_kills_its_call(identity: str, request: pytest.FixtureRequest) -> None:
    """Cancelling ``Pool.arun`` only abandoned the thread running the call: the sandbox ran on to
    its timeout and ``asyncio.run`` waited for it at shutdown (unlike ``lowlevel.arun`` and
    ``AsyncSession.run``, whose cancellation kills the command). Now the call's sandbox is killed
    and the task raises CancelledError once it is handed back; the pool serves the next call."""
    out = _trial(CANCEL, identity, request)
    assert out["running"] is True and out["outcome"] == "cancelled", out
    assert out["cancel_s"] < 10 and out["killed"] is True, out  # killed, not left to run its 20 s
    assert out["after"] == "next\n" and out["asyncio_run_s"] < 15, out
    assert (out["procs"], out["new_fds"], out["ws"], out["records"]) == ([], [], [], []), out
