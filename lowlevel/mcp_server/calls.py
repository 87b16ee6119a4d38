"""A tool call of ``lowlevel mcp`` on the server's event loop: run in a worker thread, its errors
made the SDK's tool errors, progress notifications while it runs, and its cancellation.

One concept: the life of one call. :func:`tool_call` runs a tool of :class:`lowlevel.mcp_server.Tools`
in a worker thread (of a ``CapacityLimiter``'s when given: ``max_concurrent_runs`` for the
run tools); :func:`tool_call_with_progress` adds ``notifications/progress``. A cancelled call
(``notifications/cancelled``, the server stopping) returns at once and :class:`CallRuns` kills the
one-shot runs it started (the tools add them through :data:`CURRENT_CALL`).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lowlevel.errors import LaunchError, LowlevelError
from lowlevel.spec.report import display, json_safe

log = logging.getLogger("lowlevel")

#: How long a cancelled call's runs (and :meth:`Tools.shutdown`'s) are killed again, at most, seconds.
SHUTDOWN_KILL_S = 10.0
#: Seconds between two ``notifications/progress`` of a running ``run``/``run_in_session`` call.
PROGRESS_INTERVAL_S = 5.0


class CallRuns:
    """The one-shot runs (:class:`lowlevel.sandbox.launcher.Run`) and session commands
    (:class:`lowlevel.session.Process`) a tool call started (the tools add them through
    :data:`CURRENT_CALL`), so that cancelling the call (``notifications/cancelled``) kills them."""

    def __init__(self) -> None:
        self.started = False  # its worker thread runs the tool
        self.runs: list[Callable[[], None]] = []  # what kills each
        self.cancelled = False
        self.done = threading.Event()
        self.lock = threading.Lock()

    def add(self, kill: Callable[[], None]) -> None:
        """Keep ``kill`` (kills one run or command of the call); LaunchError once cancelled."""
        with self.lock:
            if self.cancelled:
                raise LaunchError("the call was cancelled by the client")
            self.runs.append(kill)

    def cancel(self) -> None:
        """Kill the call's runs, again every 20 ms until its worker thread is done (a run not
        spawned yet cannot be killed yet), at most :data:`SHUTDOWN_KILL_S`; returns at once."""
        with self.lock:
            self.cancelled = True
        threading.Thread(target=self._kill_until_done, name="lowlevel-mcp-cancel", daemon=True).start()

    def _kill_until_done(self) -> None:
        deadline = time.monotonic() + SHUTDOWN_KILL_S
        while not self.done.is_set() and time.monotonic() < deadline:
            with self.lock:
                runs = list(self.runs)
            for run in runs:
                try:
                    run()
                except Exception as err:  # noqa: BLE001 - the others still go
                    log.debug("lowlevel: mcp: killing a cancelled call's run: %s", err)
            self.done.wait(0.02)


#: The calls whose worker threads have not returned (a cancelled call's thread runs on, killed).
_ACTIVE: set[CallRuns] = set()
_ACTIVE_LOCK = threading.Lock()


def wait_idle(bound_s: float) -> bool:
    """Wait until every tool call's worker thread has returned, at most ``bound_s`` seconds: a
    server stopping waits for what its calls still do (a ``close_session`` committing a large
    workspace), which ran on in threads the loop had let go of, and a signal then killed the
    process mid-commit (a fresh-user trial). Returns True when none is left."""
    deadline = time.monotonic() + bound_s
    while True:
        with _ACTIVE_LOCK:
            pending = [c for c in _ACTIVE if c.started]
        if not pending:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        pending[0].done.wait(min(left, 0.5))


#: The tool call a worker thread runs for (set by :func:`tool_call`, copied into the thread's context).
CURRENT_CALL: contextvars.ContextVar[CallRuns | None] = contextvars.ContextVar("lowlevel_mcp_call", default=None)


async def tool_call(tool_error: type[Exception], fn: Any, *args: Any, limiter: Any = None,
                    **kwargs: Any) -> dict[str, Any]:
    """Run the tool ``fn`` in a worker thread (of ``limiter``'s, an ``anyio.CapacityLimiter``, when
    given); lowlevel's errors become the SDK's ``ToolError`` (an ``isError`` result with one line),
    the result JSON-safe (:func:`lowlevel.spec.report.json_safe`). Cancelled (the client's
    ``notifications/cancelled``, or the server stopping), it returns at once and the call's
    one-shot runs are killed (:class:`CallRuns`): they used to run on to their timeouts."""
    import anyio
    import anyio.to_thread

    call = CallRuns()
    context = contextvars.copy_context()
    context.run(CURRENT_CALL.set, call)

    def work() -> dict[str, Any]:
        call.started = True
        try:
            out: dict[str, Any] = context.run(fn, *args, **kwargs)
            return out
        finally:
            call.done.set()
            with _ACTIVE_LOCK:
                _ACTIVE.discard(call)

    with _ACTIVE_LOCK:
        _ACTIVE.add(call)
    try:
        result = await anyio.to_thread.run_sync(work, abandon_on_cancel=True, limiter=limiter)
    except anyio.get_cancelled_exc_class():
        call.cancel()
        if not call.started:  # cancelled while it waited for a thread: it never runs
            with _ACTIVE_LOCK:
                _ACTIVE.discard(call)
        raise
    except (LowlevelError, OSError) as err:
        raise tool_error(display(str(err))) from err
    safe: dict[str, Any] = json_safe(result)
    return safe


async def tool_call_with_progress(tool_error: type[Exception], ctx: Any, fn: Any, *args: Any, limiter: Any = None,
                              **kwargs: Any) -> dict[str, Any]:
    """:func:`tool_call`, sending ``notifications/progress`` while the command runs: one at the
    start, one every :data:`PROGRESS_INTERVAL_S` (elapsed seconds), one at the end. Sent
    only when the client's request carried a ``progressToken`` (the SDK drops them otherwise)."""
    import anyio

    t0 = time.monotonic()
    done = anyio.Event()
    out: dict[str, Any] = {}

    async def work() -> None:
        try:
            out["result"] = await tool_call(tool_error, fn, *args, limiter=limiter, **kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised below, outside the task group (not as an ExceptionGroup)
            out["error"] = err
        finally:
            done.set()

    async def report(message: str) -> None:
        try:
            await ctx.report_progress(round(time.monotonic() - t0, 3), None, message)
        except Exception as err:  # noqa: BLE001 - a client gone away must not fail the run
            log.debug("lowlevel: mcp progress notification not sent: %s", err)

    async with anyio.create_task_group() as tg:
        await report("started")
        tg.start_soon(work)
        while not done.is_set():
            with anyio.move_on_after(PROGRESS_INTERVAL_S):
                await done.wait()
            if not done.is_set():
                await report(f"running for {time.monotonic() - t0:.0f} s")
    await report("finished")
    if "error" in out:
        raise out["error"]
    result: dict[str, Any] = out["result"]
    return result


__all__ = ["CURRENT_CALL", "PROGRESS_INTERVAL_S", "SHUTDOWN_KILL_S", "CallRuns", "tool_call", "tool_call_with_progress",
           "wait_idle"]
