"""Values the red-team pass of the reshaping found getting past the checks of some entry points:
an infinite or huge timeout into a Session (OverflowError deep in the wire format), a Pool given
a non-Policy (AttributeError), a Runner's bad limits (a bare ValueError, or accepted), commit=1.
Each is now one PolicyError naming the value, from every entry point alike, and leaves nothing
running (the session fixture's hygiene checks the rest)."""

from __future__ import annotations

import asyncio
import math

import pytest

import lowlevel

BAD_SECONDS = [math.inf, -math.inf, math.nan, 2.0**31, 1e12, 0, -1, True, "5"]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
def test_session_timeouts_are_checked_as_run_checks_them(value: object) -> None:
    for kw in ("idle_timeout", "total_timeout"):
        with pytest.raises(lowlevel.PolicyError, match=kw):
            lowlevel.Session(**{kw: value})
    with pytest.raises(lowlevel.PolicyError, match="timeout"):
        lowlevel.run(["true"], timeout=value)  # the same rule (RunRequest)


def test_session_command_timeout_inf_is_a_policy_error() -> None:
    with lowlevel.Session() as s:
        for value in (math.inf, math.nan, 1e12):
            with pytest.raises(lowlevel.PolicyError, match="timeout"):
                s.run(["true"], timeout=value)
        assert s.run(["true"], timeout=5).exit_code == 0  # control: the session is fine


def test_pool_and_async_session_timeouts() -> None:
    with lowlevel.Pool(size=1) as pool:
        with pytest.raises(lowlevel.PolicyError, match="timeout"):
            pool.run(["true"], timeout=math.inf)
        assert pool.run(["true"]).exit_code == 0

    async def go() -> None:
        async with lowlevel.AsyncSession() as s:
            with pytest.raises(lowlevel.PolicyError, match="timeout"):
                await s.run(["true"], timeout=math.inf)
            assert (await s.run(["true"])).exit_code == 0

    asyncio.run(go())


@pytest.mark.parametrize("policy", ["x", 0, [], {}], ids=repr)
def test_pool_and_session_refuse_a_non_policy(policy: object) -> None:
    with pytest.raises(lowlevel.PolicyError, match="lowlevel.Policy"):
        lowlevel.Pool(policy)  # type: ignore[arg-type]
    with pytest.raises(lowlevel.PolicyError, match="lowlevel.Policy"):
        lowlevel.Session(policy)  # type: ignore[arg-type]


@pytest.mark.parametrize(("args", "kwargs", "word"), [((0,), {}, "max_concurrency"), (("2",), {}, "max_concurrency"),
                                                       ((1,), {"timeout": math.nan}, "timeout"),
                                                       ((1,), {"timeout": -1}, "timeout")])
def test_runner_arguments_are_policy_errors(args: tuple[object, ...], kwargs: dict[str, object], word: str) -> None:
    with pytest.raises(lowlevel.PolicyError, match=word):
        lowlevel.Runner(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("commit", [1, 0, 1.0, "yes", None], ids=repr)
def test_commit_takes_only_true_false_or_on_success(commit: object, tmp_path) -> None:
    with pytest.raises(lowlevel.PolicyError, match="commit"):
        lowlevel.run(["true"], workspace=str(tmp_path), commit=commit)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "2", 10**6], ids=repr)
def test_pool_size_is_bounded(size: object) -> None:
    """``Pool(size=10**6)`` was accepted and started sandboxes until the uid range or memory ran out."""
    with pytest.raises(lowlevel.PolicyError, match="Pool size must be an int from 1 to"):
        lowlevel.Pool(size=size)  # type: ignore[arg-type]


def test_a_pool_starts_at_most_max_parallel_starts_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Pool(size=40)`` started all 40 at once (80 bwrap processes within 0.5 s). The real starts
    of a Pool of 6 with the bound set to 2, counted as they run: never more than 2 side by side,
    and all 6 become ready (the control that the bound does not starve the refill)."""
    import threading
    import time

    from lowlevel.session import pool as pool_mod
    monkeypatch.setattr(pool_mod, "MAX_PARALLEL_STARTS", 2)
    lock, live, peak = threading.Lock(), [0], [0]
    new = pool_mod.Pool._new

    def counted(self: lowlevel.Pool) -> object:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        try:
            return new(self)
        finally:
            with lock:
                live[0] -= 1
    monkeypatch.setattr(pool_mod.Pool, "_new", counted)
    with lowlevel.Pool(size=6) as pool:
        deadline = time.monotonic() + 120
        while len(pool._ready) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool._ready) == 6 and peak[0] == 2, (len(pool._ready), peak[0])
        assert pool.run(["true"]).exit_code == 0
