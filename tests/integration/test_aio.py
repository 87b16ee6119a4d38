"""lowlevel.arun / Runner: the same Results as lowlevel.run, cancellation, fds, the bench's JSON.

No pytest-asyncio: each test drives its own loop with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.hygiene import children, fd_numbers
from helpers.procs import pids_with

import lowlevel
from lowlevel.sandbox.aio import Runner, arun

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def _comparable(r: lowlevel.Result) -> dict:
    """The Result's fields that must not depend on the driver (paths and times differ)."""
    def scrub(b: bytes) -> bytes:
        return b.replace(r.workspace.encode(), b"<ws>")

    return {"exit_code": r.exit_code, "term_signal": r.term_signal, "timed_out": r.timed_out,
            "killed_by": r.killed_by, "stdout": scrub(r.stdout), "stderr": scrub(r.stderr),
            "changes": r.changes, "limits_enforced": r.limits_enforced, "notes": r.notes}


def both(command: list[str], **kw) -> tuple[lowlevel.Result, lowlevel.Result]:
    """Run ``command`` with run and with arun; return both Results (workspaces removed after)."""
    sync = lowlevel.run(command, **kw)
    asy = asyncio.run(arun(command, **kw))
    for r in (sync, asy):
        if "workspace" not in kw:
            shutil.rmtree(r.workspace, ignore_errors=True)
    return sync, asy


# -- the main job's security cases, through both drivers --------------------------------------

def test_workspace_only_writes_same_as_run():
    script = ("touch /usr/bin/x; echo usr=$?; touch /etc/x; echo etc=$?; touch /x; echo root=$?; "
              "echo hello > /workspace/out.txt; echo ws=$?; cat /workspace/out.txt")
    sync, asy = both(["sh", "-c", script])
    assert _comparable(asy) == _comparable(sync)
    assert asy.exit_code == 0, asy.stderr
    out = asy.stdout.decode()
    assert "usr=1" in out and "etc=1" in out and "root=1" in out and "ws=0" in out and "hello" in out
    assert asy.changes.added == ("out.txt",)
    assert not Path("/usr/bin/x").exists()


CONNECT = """
import socket, sys
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3)
    print("got", s.recv(4).decode())
except OSError as err:
    print("blocked", type(err).__name__, err.errno)
"""


def test_no_network_same_as_run(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=3) as c:  # control
        assert c.recv(4) == b"pong"
    before = server.accepted
    sync, asy = both(["python3", "-c", CONNECT, str(server.port)])
    assert _comparable(asy) == _comparable(sync)
    assert asy.stdout.startswith(b"blocked"), asy.stdout
    assert server.accepted == before


def test_no_host_home_same_as_run(tmp_path):
    # Nothing is written into the caller's real home (tests never touch the host's real
    # directories): what is already there must be invisible, and a secret in another host
    # directory (tmp_path, outside the sandbox) must not be found by a search.
    home = Path.home()
    names = sorted(p.name for p in home.iterdir()) if home.is_dir() else []
    marker = f"FAKE-KEY-{time.time_ns()}"
    key = tmp_path / "id_lowlevel_aio"
    key.write_text(marker + "\n")
    assert marker in key.read_text()  # control: readable on the host
    assert all(os.path.lexists(home / n) for n in names)  # control: the host sees its home
    probe = "".join(f'[ -e "{home}/{n}" ] || [ -L "{home}/{n}" ] && echo "SEEN:{n}"; ' for n in names if "'" not in n)
    sync, asy = both(["sh", "-c", f"cat {key}; {probe}grep -rs {marker} /home /root /etc /tmp; echo done"])
    assert _comparable(asy) == _comparable(sync)
    assert marker.encode() not in asy.stdout
    assert b"SEEN:" not in asy.stdout, asy.stdout
    assert asy.stdout.strip().endswith(b"done")


def test_cleared_env_same_as_run(monkeypatch):
    secret = f"ghp_FAKE{time.time_ns()}"
    monkeypatch.setenv("LOWLEVEL_FAKE_TOKEN", secret)
    sync, asy = both(["sh", "-c", "env | sort; tr '\\0' '\\n' < /proc/1/environ"], env={"GREETING": "hi"})
    assert _comparable(asy) == _comparable(sync)
    assert secret.encode() not in asy.stdout and b"LOWLEVEL_FAKE_TOKEN" not in asy.stdout
    assert b"GREETING=hi" in asy.stdout


@pytest.mark.parametrize("script", ["exit 0", "exit 3", "kill -9 $$", "cat; echo err >&2"])
def test_exit_status_and_stdio_same_as_run(script):
    sync, asy = both(["sh", "-c", script], stdin=b"from stdin\n")
    assert _comparable(asy) == _comparable(sync)


def test_timeout_same_as_run():
    sync, asy = both(["sh", "-c", "setsid sleep 100 & sleep 100"], timeout=0.5)
    assert _comparable(asy) == _comparable(sync)
    assert asy.timed_out and asy.killed_by == "timeout" and asy.exit_code == 137
    assert asy.wall_time_s < 5


def test_setup_failure_same_exception_as_run():
    with pytest.raises(lowlevel.ExecError) as sync:
        lowlevel.run(["/nonexistent-program"])
    with pytest.raises(lowlevel.ExecError) as asy:
        asyncio.run(arun(["/nonexistent-program"]))
    assert asy.value.errno == sync.value.errno
    with pytest.raises(lowlevel.PolicyError):
        asyncio.run(arun("not a list"))  # type: ignore[arg-type]


# -- cancellation ------------------------------------------------------------------------------

def test_cancellation_kills_and_reaps():
    marker = f"{random.randint(1000, 9999)}.{os.getpid() % 10000:04d}"  # a unique `sleep` duration
    needle = b"sleep\0" + marker.encode() + b"\0"
    fds_before = fd_numbers()

    async def main() -> None:
        task = asyncio.create_task(arun(["sh", "-c", f"setsid sleep {marker} & sleep {marker} & wait"]))
        for _ in range(500):  # the sandbox's two sleeps are up (bounded wait, not a timing assertion)
            if len(pids_with(needle)) >= 2:
                break
            await asyncio.sleep(0.01)
        assert len(pids_with(needle)) >= 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Already gone when the CancelledError arrives: killed, namespace empty, bwrap reaped.
        assert pids_with(needle) == []
        assert children() == []

    asyncio.run(main())
    assert fd_numbers() == fds_before


@pytest.mark.parametrize("step", ["prepare", "spawn"])
def test_cancel_during_executor_step_kills_and_reaps(monkeypatch, step):
    """A cancel while a pool thread runs prepare (or spawn) waits for the step, then kills and reaps."""
    from lowlevel.sandbox.launcher import Run

    marker = f"{random.randint(1000, 9999)}.{(os.getpid() + 2) % 10000:04d}"
    needle = b"sleep\0" + marker.encode() + b"\0"
    original = getattr(Run, step)
    in_step = threading.Event()

    def slow(self: Run) -> None:
        original(self)
        in_step.set()
        time.sleep(0.3)  # the task is cancelled meanwhile

    monkeypatch.setattr(Run, step, slow)
    fds_before = fd_numbers()

    async def main() -> None:
        task = asyncio.create_task(arun(["sh", "-c", f"sleep {marker}"]))
        while not in_step.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pids_with(needle) == []
        assert children() == []

    asyncio.run(main())
    assert fd_numbers() == fds_before


def test_cancel_before_spawn_discards_the_fresh_workspace(monkeypatch):
    from lowlevel.sandbox.launcher import Run

    original = Run.prepare
    seen: list[str] = []
    in_step = threading.Event()

    def slow(self: Run) -> None:
        original(self)
        seen.append(self.workspace)
        in_step.set()
        time.sleep(0.2)

    monkeypatch.setattr(Run, "prepare", slow)
    fds_before = fd_numbers()

    async def main() -> None:
        task = asyncio.create_task(arun(["/usr/bin/true"]))
        while not in_step.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen and not os.path.exists(seen[0])
    assert children() == []
    assert fd_numbers() == fds_before


def test_runner_aclose_cancels_in_flight():
    marker = f"{random.randint(1000, 9999)}.{(os.getpid() + 1) % 10000:04d}"
    needle = b"sleep\0" + marker.encode() + b"\0"

    async def main() -> None:
        runner = Runner(max_concurrency=2)
        # `sh -c "sleep M"`: only the sleep's own cmdline is "sleep\0M\0" (bwrap's has "sleep M").
        tasks = [asyncio.create_task(runner.run(["sh", "-c", f"sleep {marker}; :"])) for _ in range(4)]
        for _ in range(500):
            if len(pids_with(needle)) >= 2:
                break
            await asyncio.sleep(0.01)
        assert runner.in_flight == 2
        await runner.aclose()
        assert all(t.cancelled() for t in tasks)
        assert pids_with(needle) == []
        assert children() == []
        with pytest.raises(RuntimeError):
            await runner.run(["true"])

    asyncio.run(main())


# -- many at once ------------------------------------------------------------------------------

def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lowlevel-aio")]


def test_500_concurrent_no_fd_or_thread_growth():
    cap = 32
    # The shared executor's threads (at most EXECUTOR_THREADS, for the process's lifetime)
    # exist after the first call: start from there.
    r0 = asyncio.run(arun(["/usr/bin/true"]))
    shutil.rmtree(r0.workspace, ignore_errors=True)
    fds_before = fd_numbers()
    threads_before = threading.active_count()
    pool_before = len(_pool_threads())
    peak = {"fds": 0, "in_flight": 0}

    async def main() -> list[lowlevel.Result]:
        limiter = asyncio.Semaphore(cap)
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                peak["fds"] = max(peak["fds"], len(os.listdir("/proc/self/fd")))
                peak["in_flight"] = max(peak["in_flight"], cap - limiter._value)
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        try:
            return await asyncio.gather(*(arun(["/usr/bin/true"], limiter=limiter) for _ in range(500)))
        finally:
            done.set()
            await sampler

    results = asyncio.run(main())
    for r in results:
        shutil.rmtree(r.workspace, ignore_errors=True)
    assert [r.exit_code for r in results] == [0] * 500
    assert fd_numbers() == fds_before
    # No thread per child: only the shared executor's few, created once.
    assert len(_pool_threads()) <= lowlevel.sandbox.aio.EXECUTOR_THREADS
    assert threading.active_count() - len(_pool_threads()) <= threads_before - pool_before
    assert peak["in_flight"] <= cap
    # The documented bound: at most 10 fds per run in flight, plus the transient fds of the
    # runs being prepared (one per executor thread).
    assert peak["fds"] <= len(fds_before) + 10 * cap + 25 * lowlevel.sandbox.aio.EXECUTOR_THREADS, peak


def test_runner_caps_concurrency_and_validates():
    with pytest.raises(ValueError):
        Runner(max_concurrency=0)

    async def main() -> None:
        async with Runner(max_concurrency=3, timeout=30) as runner:
            seen = []

            async def one() -> lowlevel.Result:
                seen.append(runner.in_flight)
                r = await runner.run(["sh", "-c", "echo $X"], env={"X": "y"})
                seen.append(runner.in_flight)
                return r

            results = await asyncio.gather(*(one() for _ in range(10)))
        assert {r.stdout for r in results} == {b"y\n"}
        assert max(seen) <= 3
        for r in results:
            shutil.rmtree(r.workspace, ignore_errors=True)
        with pytest.raises(TypeError):
            await arun(["true"], limiter=3)  # type: ignore[arg-type]

    asyncio.run(main())


def test_public_names():
    assert lowlevel.arun is arun and lowlevel.Runner is Runner
    assert "arun" in lowlevel.__all__ and lowlevel.__all__ == sorted(lowlevel.__all__)


# -- the bench ---------------------------------------------------------------------------------

RESULT_KEYS = {"name", "command", "concurrency", "n", "p50_ms", "p90_ms", "p99_ms", "calls_per_s"}


@pytest.mark.slow
def test_bench_quick_json_schema(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "startup.py"), "--quick", "--rounds", "1",
                           "--per-round", "2", "--concurrency", "1,2", "--soak", "0", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == 1
    assert {"results", "ratios", "host", "one_time"} <= set(doc)
    names = {r["name"] for r in doc["results"]}
    assert {"floor", "subprocess", "raw_bwrap", "run", "arun", "run_egress", "image", "image_session"} <= names
    assert {r["command"] for r in doc["results"]} == {"/usr/bin/true", "/usr/bin/python3 -c pass"}
    for r in doc["results"]:
        assert RESULT_KEYS <= set(r), r
        if r["skipped"] and r["name"].startswith("image"):
            assert "needs" in r["reason"]  # skopeo/umoci missing: the image cases say so
            continue
        assert r["skipped"] is False and r["n"] >= 1
        for k in ("p50_ms", "p90_ms", "p99_ms", "calls_per_s"):
            assert isinstance(r[k], float) and r[k] > 0, (k, r)
        assert r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert len(r["samples_ms"]) == r["n"]
    assert {(r["name"], r["concurrency"]) for r in doc["results"] if r["name"] == "arun"} == {("arun", 1), ("arun", 2)}
    for k in ("run_vs_raw_bwrap", "raw_bwrap_vs_floor", "run_landlock_vs_run"):
        assert isinstance(doc["ratios"][k], float) and doc["ratios"][k] > 0
    assert {"run_bare", "run_no_landlock", "guard_floor", "session_no_landlock"} <= names
    assert isinstance(doc["ratios"]["guard_minus_floor_ms"], float)
    assert doc["one_time"]["seccomp_compiles_during_bench"] == 0
    dl = doc["egress_download"]
    assert dl["host_n"] >= 1 and dl["egress_n"] >= 1 and isinstance(dl["added_p50_ms"], float)
    for k in ("kernel", "bwrap", "python", "cpus"):
        assert doc["host"][k]
    assert len(doc["host"]["loadavg_before"]) == 3 and len(doc["host"]["loadavg_after"]) == 3
    cli = doc["cli"]  # whole processes: lowlevel run --rm, python -c pass, python -c 'import lowlevel.cli'
    assert cli["errors"] == 0 and cli["n"] >= 1
    for k in ("cli", "python_startup", "cli_import"):
        assert len(cli[f"{k}_samples_ms"]) == cli["n"] and cli[f"{k}_p50_ms"] > 0
    assert doc["ratios"]["cli_vs_python_startup"] == cli["cli_vs_python_startup"] > 1
    try:
        import matplotlib  # noqa: F401  (the bench extra; CI installs only the test extra)
    except ImportError:
        return
    svg = tmp_path / "bench.svg"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), str(out), "-o", str(svg)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()


def test_arun_kill_after_sends_sigterm_first() -> None:
    """issue 25 item 5: ``arun(timeout=, kill_after=)`` as ``timeout -k``: the program's TERM
    handler runs at the deadline (exit 7, still a timeout); control: kill_after=0 SIGKILLs."""
    prog = ["sh", "-c", "trap 'echo term; exit 7' TERM; sleep 30 & wait"]
    r = asyncio.run(lowlevel.arun(prog, timeout=1, kill_after=10, keep_workspace=False))
    assert r.timed_out and r.killed_by == "timeout" and r.exit_code == 7 and r.stdout == b"term\n", r
    r = asyncio.run(lowlevel.arun(prog, timeout=1, keep_workspace=False))
    assert r.timed_out and r.exit_code != 7 and b"term" not in r.stdout, r
    with pytest.raises(lowlevel.PolicyError, match="kill_after"):
        asyncio.run(lowlevel.arun(["true"], kill_after=-1))


@pytest.mark.parametrize("outside", [GeneratorExit, SystemExit])
def test_a_step_interrupted_from_outside_is_waited_for(outside: type[BaseException]) -> None:
    """A blocking step (the run's prepare/spawn in the shared executor) interrupted from outside
    the step: the coroutine closed (a pending task destroyed) or a SystemExit thrown in (a
    SIGTERM handler). The step used to be left running and ``fut.result()`` raised
    InvalidStateError over the interrupt, so the Run was never closed (its cgroup and record
    left to ``lowlevel cleanup``: bench/kill_campaign.py). Now the step is waited for, then the
    interrupt itself goes on. Control: the step's own error still comes out as itself."""
    from lowlevel.sandbox import aio

    done = threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        done.set()

    async def main() -> None:
        coro = aio._step(slow)
        coro.send(None)  # the step runs in a pool thread; the coroutine waits at its await
        await asyncio.sleep(0.05)
        assert not done.is_set()
        if outside is GeneratorExit:
            coro.close()  # as for a pending task's coroutine destroyed: no other exception
        else:
            with pytest.raises(SystemExit):
                coro.throw(SystemExit(143))
        assert done.is_set()  # the step ended before the interrupt went on

        def fails() -> None:
            raise OSError(5, "the step's own error")

        with pytest.raises(OSError, match="the step's own error"):
            await aio._step(fails)

    asyncio.run(main())


SIGTERM_IN_SUBMIT = r"""
import asyncio, os, signal, sys, threading
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
import lowlevel
real = threading.Thread.start
where = sys.argv[2]

def start(self):
    real(self)
    if self.name.startswith("lowlevel-aio"):
        threading.Thread.start = real
        # The SIGTERM lands right after the executor's new thread started, inside submit():
        # before concurrent.futures registered the thread for its exit hook.
        os.kill(os.getpid(), signal.SIGTERM)

if where == "thread-start":
    threading.Thread.start = start
elif where == "lost-callback":
    # The SystemExit raised inside the loop callback that copies a step's outcome to its loop
    # future (wrap_future's _set_state), as a SIGTERM handler's would at its first bytecode.
    loop_cls = asyncio.get_event_loop_policy().new_event_loop().__class__
    real_cst = loop_cls.call_soon_threadsafe

    def call_soon_threadsafe(self, callback, *args, **kw):
        if getattr(callback, "__name__", "") == "_set_state" and not getattr(loop_cls, "hit", False):
            loop_cls.hit = True

            def callback(*_args):
                raise SystemExit(143)
        return real_cst(self, callback, *args, **kw)

    loop_cls.call_soon_threadsafe = call_soon_threadsafe
r = asyncio.run(lowlevel.arun(["sh", "-c", "echo new > f"], workspace=sys.argv[1]))
print("returned", r.exit_code)
"""


@pytest.mark.parametrize("where", ["thread-start", "lost-callback", "none"])
def test_a_sigterm_inside_the_executors_thread_start_ends_the_caller(tmp_path: Path, where: str) -> None:
    """Two hangs of a caller whose SIGTERM handler raises SystemExit during arun (each 1 in
    several hundred of bench/kill_campaign_repro.py arun-sigterm; the caller never exited until
    a second SIGTERM), each made deterministic here:

    - ``thread-start``: inside ThreadPoolExecutor.submit(), right after it started the
      executor's first thread and before it registered that thread for its exit hook: the
      interpreter's exit joined the idle thread forever. Now the signal is held back until the
      step's future is the coroutine's, then raised there (the step waited for, its Run closed).
    - ``lost-callback``: inside the loop callback that copies a step's outcome to its loop
      future: that future never completed, and asyncio.run's cancellation waited for it
      forever. Now the step's own future decides.

    Either way the caller exits 143 and leaves no process or run record. Control: without
    the signal, the call returns and commits."""
    ws = tmp_path / "ws"
    ws.mkdir()
    records = tmp_path / "records"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOWLEVEL_RECORD_DIR": str(records)}
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_IN_SUBMIT, str(ws), where], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the caller hung after the SIGTERM ({where})")
    if where == "none":
        assert (proc.returncode, out) == (0, b"returned 0\n"), err
        assert (ws / "f").read_text() == "new\n"
        return
    assert proc.returncode == 143, err
    assert b"Traceback" not in err, err
    assert not (ws / "f").exists() or (ws / "f").read_text() == "new\n"  # old or new (a close commits)
    assert [n for n in os.listdir(ws) if n.startswith(".lowlevel-commit-")] == []
    time.sleep(0.5)
    assert pids_with(str(ws)) == []
    assert not records.exists() or os.listdir(records) == []


def test_a_wait_for_a_pidfd_survives_the_runs_own_reader_removal() -> None:
    """``_Supervision.readable(fd)`` on an fd the Run already watched (the anchor's pidfd,
    ``on_bwrap_exit``): the Run's own later ``remove_reader(fd)`` (``on_exit_report``, when the
    anchor's EXIT arrives during the wait) removed the wait's reader too, and the wait sat out
    its whole timeout (a cancelled ``arun`` took 12 s to end after SIGTERM). Now the wait owns
    the fd: it returns as soon as the fd is readable. Real fds (a pipe), the real loop."""
    from lowlevel.sandbox import aio

    async def main() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        r_fd, w_fd = os.pipe()
        try:
            sup = aio._Supervision(loop, None)  # type: ignore[arg-type]  # readable() uses no Run
            sup.add_reader(r_fd, lambda: None)  # as _drive's on_bwrap_exit on the pidfd
            t0 = time.monotonic()
            waiting = asyncio.ensure_future(sup.readable(r_fd, 5.0))
            await asyncio.sleep(0.05)
            sup.remove_reader(r_fd)  # as on_exit_report does when the anchor's EXIT comes
            os.write(w_fd, b"x")     # the "process" exits
            ok = await waiting
            return ok, time.monotonic() - t0
        finally:
            os.close(r_fd)
            os.close(w_fd)

    ok, took = asyncio.run(main())
    assert ok and took < 2.0, (ok, took)


def test_an_async_session_used_from_another_event_loop_says_so_and_goes_on():
    """An AsyncSession opened in one ``asyncio.run()`` and used in a second one got a bare
    "RuntimeError: Event loop is closed" from deep inside (its readers live on the first loop: a
    fresh-user trial). Now one SessionError(reason="other_loop") before anything changes; the
    session goes on, and close() from the second loop ends it with nothing left. Control: the
    same call on its own loop runs."""
    async def opened() -> lowlevel.AsyncSession:
        sess = await lowlevel.AsyncSession.create()
        assert (await sess.run(["echo", "first"])).stdout == b"first\n"  # control, on its own loop
        return sess

    before = set(children())
    sess = asyncio.run(opened())

    async def second() -> None:
        for call in (lambda: sess.run(["true"]), lambda: sess.start(["true"]), sess.commit, sess.reset):
            with pytest.raises(lowlevel.SessionError, match="opened on another event loop") as info:
                await call()
            assert info.value.reason == "other_loop"
        assert sess.alive
        await sess.close()

    asyncio.run(second())
    assert not sess.alive
    deadline = time.monotonic() + 10
    while set(children()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(children()) - before
