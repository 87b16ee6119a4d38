"""A session's life when its caller goes away midway: cancelled ``AsyncSession`` calls, an
``AsyncSession`` nobody closed, a ^C inside ``Session.close()`` or at the end of ``commit()``.

tests/integration/test_session_cancel.py calls each function in-process (root) or runs this
file through ``runuser`` as the unprivileged user (``python session_cancel_scenarios.py NAME
WORKSPACE BASE``: prints the returned dict as JSON), as tests/helpers/session_gate_scenarios.py.
``workspace`` is an empty directory of the caller's, ``base`` one for fresh workspaces. Each
returns what it observed (``cow``: the session had the copy-on-write workspace); the test asserts.

The waits are made deterministic where the bug needs a race: a default executor of one thread
that the application's own job holds (so a commit's job waits in its queue), a hook on the
session's start (so the cancel lands while it runs), a signal sent to this process from inside
the step it must interrupt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lowlevel.sandbox import launcher
from lowlevel.session import AsyncSession, Session
from lowlevel.session import core as session_core
from session_gate_scenarios import _children, _read

#: How long a call that should return is given before the scenario calls it hung, seconds.
HUNG_S = 10.0


def _fds() -> set[str]:
    """What this process's fds point at (numbers are reused: compared by target)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def _warm(base: str) -> None:
    """One session started and closed first: the fds a process opens once (the init's and the
    anchor's executables, the host-facts cache) are not counted as a scenario's leak."""
    with Session(workspace_base=base, keep_workspace=False) as s:
        s.run(["true"])


@contextmanager
def _patched(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    real = getattr(owner, name)
    setattr(owner, name, make(real))
    try:
        yield
    finally:
        setattr(owner, name, real)


def _sigint_once(real: Any) -> Any:
    """``real`` with a SIGINT sent to this process at its first call, before it runs (the Python
    handler's KeyboardInterrupt is raised at the next bytecode boundary: inside this step)."""
    sent: list[int] = []

    def step(*args: Any, **kwargs: Any) -> Any:
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)
    return step


async def _queued_behind(pool: concurrent.futures.ThreadPoolExecutor, start: Callable[[], Any]) -> Any:
    """Start ``start()`` (a task) while ``pool``'s only thread runs the application's own job,
    cancel it once its worker-thread job waits in the pool's queue, release the thread.
    Returns ``(outcome, queued)``: "cancelled" or what the task returned; whether the job was
    seen waiting in the queue."""
    loop = asyncio.get_running_loop()
    release, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(60.0)

    blocker = loop.run_in_executor(pool, hold)
    while not holding.is_set():  # the thread has taken the job: the queue is empty
        await asyncio.sleep(0.005)
    task = asyncio.ensure_future(start())
    deadline = time.monotonic() + HUNG_S
    while not pool._work_queue.qsize() and time.monotonic() < deadline:  # the job waits for the thread
        await asyncio.sleep(0.005)
    queued = pool._work_queue.qsize() > 0
    task.cancel()
    try:
        outcome = await task
    except asyncio.CancelledError:
        outcome = "cancelled"
    release.set()
    await blocker
    return outcome, queued


def commit_cancelled_in_the_queue(workspace: str, base: str) -> dict[str, Any]:
    """``AsyncSession.commit()`` and ``reset()`` cancelled while their job waits for a thread of
    the busy default executor, then cancelled while the commit runs in its thread: what the
    session does next (run, commit) and what reached the directory."""
    async def main() -> dict[str, Any]:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        asyncio.get_running_loop().set_default_executor(pool)
        out: dict[str, Any] = {}
        s = await AsyncSession.create(workspace=workspace, workspace_base=base)
        out["cow"] = s._core is not None and s._core.run.cow
        if not out["cow"]:
            await s.close()
            return out
        assert s._core is not None
        for what in ("commit", "reset"):
            if what == "reset" and out["commit"]["run"] == "hung":
                break  # the session is stuck: nothing more to learn from it
            await s.run(["sh", "-c", f"echo {what} > {what}"])
            outcome, queued = await _queued_behind(pool, getattr(s, what))
            got: dict[str, Any] = {"outcome": outcome, "queued": queued, "held": s._core.exclusive}
            try:
                r = await asyncio.wait_for(s.run(["cat", what]), HUNG_S)
                got["run"] = [r.exit_code, r.stdout.decode()]
            except TimeoutError:
                got["run"] = "hung"
            got["directory"] = sorted(os.listdir(workspace))
            out[what] = got
        if "reset" in out:
            out["running"] = await _cancelled_while_running(s, workspace)
            await s.run(["sh", "-c", "echo after > after"])
            try:
                out["commit_after"] = sorted((await asyncio.wait_for(s.commit(), HUNG_S)).added)
            except TimeoutError:
                out["commit_after"] = "hung"
        await asyncio.wait_for(s.close(), 60)
        out["children"] = _children()
        return out

    return asyncio.run(main())


async def _cancelled_while_running(s: AsyncSession, workspace: str) -> dict[str, Any]:
    """A commit cancelled once it runs in its thread (held there 0.3 s): it runs to its end,
    then the session takes commands again."""
    core = s._core
    assert core is not None
    await s.run(["sh", "-c", "echo late > late"])
    started = threading.Event()
    real = core.exclusive_op

    def slow_op(what: str, left: Any) -> Any:
        started.set()
        time.sleep(0.3)
        return real(what, left)

    core.exclusive_op = slow_op  # type: ignore[method-assign]
    try:
        task = asyncio.ensure_future(s.commit())
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        try:
            outcome = await task
        except asyncio.CancelledError:
            outcome = "cancelled"
        r = await asyncio.wait_for(s.run(["true"]), HUNG_S)
    finally:
        core.exclusive_op = real  # type: ignore[method-assign]
    return {"outcome": outcome, "run_after": r.exit_code, "applied": "late" in os.listdir(workspace)}


def create_cancelled(workspace: str, base: str) -> dict[str, Any]:
    """``AsyncSession.create()`` cancelled while its sandbox starts in the worker thread, and
    while its job still waits for a thread: what is left once the loop's executor is done."""
    _warm(base)
    out: dict[str, Any] = {}
    before, dirs = _fds(), set(os.listdir(base))
    started = threading.Event()

    def hooked(real: Any) -> Any:
        def start_init(*args: Any, **kwargs: Any) -> Any:
            started.set()
            time.sleep(0.2)  # the cancel lands here, while the start is under way
            return real(*args, **kwargs)
        return start_init

    async def during_start() -> str:
        # keep_workspace as default (True): the workspace nobody learnt of goes too
        task = asyncio.ensure_future(AsyncSession.create(workspace_base=base))
        while not started.is_set() and not task.done():
            await asyncio.sleep(0.005)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "returned"

    with _patched(session_core, "start_init", hooked):
        out["during_start"] = asyncio.run(during_start())  # its end waits for the executor's threads
    out["started"] = started.is_set()

    async def queued() -> Any:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        asyncio.get_running_loop().set_default_executor(pool)
        return await _queued_behind(pool, lambda: AsyncSession.create(workspace_base=base, keep_workspace=False))

    out["queued"] = asyncio.run(queued())[0]
    gc.collect()
    out["children"] = _children()
    out["fds_leaked"] = sorted(_fds() - before)
    out["new_dirs"] = sorted(set(os.listdir(base)) - dirs)
    return out


def collected_unclosed(workspace: str, base: str) -> dict[str, Any]:
    """An ``AsyncSession`` (and, the control, a ``Session``) dropped without close() and
    garbage-collected: is it closed as close() would (sandbox gone, changes committed)?"""
    _warm(base)
    out: dict[str, Any] = {}
    before = _fds()

    async def main() -> bool:
        s = await AsyncSession.create(workspace=workspace, workspace_base=base)
        await s.run(["sh", "-c", "echo async > async.txt"])
        return s._core is not None and s._core.run.cow

    out["cow"] = asyncio.run(main())  # the loop is closed: nothing refers to the session any more
    gc.collect()
    out["async"] = {"children": _children(), "fds_leaked": sorted(_fds() - before),
                    "committed": _read(os.path.join(workspace, "async.txt")) if os.path.exists(
                        os.path.join(workspace, "async.txt")) else None}

    def sync() -> None:
        s = Session(workspace=workspace, workspace_base=base)
        s.run(["sh", "-c", "echo sync > sync.txt"])

    sync()
    gc.collect()
    out["sync"] = {"children": _children(), "fds_leaked": sorted(_fds() - before),
                   "committed": os.path.exists(os.path.join(workspace, "sync.txt"))}
    return out


def interrupted_close(workspace: str, base: str) -> dict[str, Any]:
    """A ^C (SIGINT) inside ``Session.close()``'s kill of the sandbox, then a second close()."""
    _warm(base)
    out: dict[str, Any] = {}
    before = _fds()
    s = Session(workspace=workspace, workspace_base=base)
    s.run(["sh", "-c", "echo kept > kept.txt"])
    anchor = s._core.run.pid
    with _patched(launcher.Run, "kill", _sigint_once):
        try:
            s.close()
            out["close"] = "returned"
        except KeyboardInterrupt:
            out["close"] = "KeyboardInterrupt"
    out["children"] = _children()
    out["anchor_left"] = anchor is not None and os.path.exists(f"/proc/{anchor}")
    s.close()  # the caller retries: nothing to do, nothing raised
    out["children_after_retry"] = _children()
    out["fds_leaked"] = sorted(_fds() - before)
    out["committed"] = os.path.exists(os.path.join(workspace, "kept.txt"))
    return out


def interrupted_commit_reset(workspace: str, base: str) -> dict[str, Any]:
    """A ^C (SIGINT) during the RESET round trip at the end of ``Session.commit()`` (raised at the
    end of the step that holds it back): is the old upper layer's fd closed, the session's
    commit baseline moved; do later commits work?"""
    _warm(base)
    out: dict[str, Any] = {}
    with Session(workspace=workspace, workspace_base=base) as s:
        run = s._core.run
        out["cow"] = run.cow
        if not run.cow:
            return out
        s.run(["sh", "-c", "echo v1 > f.txt"])
        assert run.upper_fd is not None
        st, since = os.fstat(run.upper_fd), run.since_ns
        old = (st.st_dev, st.st_ino)
        with _patched(socket, "recv_fds", _sigint_once):
            try:
                s.commit()
                out["commit"] = "returned"
            except KeyboardInterrupt:
                out["commit"] = "KeyboardInterrupt"
        out["old_upper_open"] = old in _open_inodes()
        out["since_moved"] = run.since_ns > since
        out["own_stamps"] = len(run.own_stamps)
        out["host"] = _read(os.path.join(workspace, "f.txt"))
        s.run(["sh", "-c", "echo v2 > f.txt"])
        out["later_commit"] = sorted(s.commit().modified)
    out["host_after"] = _read(os.path.join(workspace, "f.txt"))
    out["children"] = _children()
    return out


def _open_inodes() -> set[tuple[int, int]]:
    """``(st_dev, st_ino)`` of every fd this process has open."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(fd))
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


def close_cancelled_in_the_queue(workspace: str, base: str) -> dict[str, Any]:
    """``AsyncSession.close()`` cancelled while its job waits for a thread of the busy default
    executor (a task cancelled in ``async with``'s exit): is the session closed (its work
    committed) without another close()?"""
    async def main() -> dict[str, Any]:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        asyncio.get_running_loop().set_default_executor(pool)
        s = await AsyncSession.create(workspace=workspace, workspace_base=base)
        out: dict[str, Any] = {"cow": s._core is not None and s._core.run.cow}
        await s.run(["sh", "-c", "echo closed > closed"])
        outcome, queued = await _queued_behind(pool, s.close)
        out.update(outcome=outcome, queued=queued)
        for t in threading.enumerate():  # the close's own thread: its commit comes after the sandbox is gone
            if t.name == "lowlevel-session-close":
                t.join(HUNG_S)
        deadline = time.monotonic() + HUNG_S
        while _children() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        out["children"] = _children()
        out["closed"] = s._core is not None and s._core.closed
        out["directory"] = sorted(os.listdir(workspace))
        return out

    return asyncio.run(main())


SCENARIOS = {f.__name__: f for f in (commit_cancelled_in_the_queue, create_cancelled, collected_unclosed,
                                     interrupted_close, interrupted_commit_reset, close_cancelled_in_the_queue)}

if __name__ == "__main__":
    name, ws, base = sys.argv[1:4]
    print(json.dumps(SCENARIOS[name](ws, base)))
