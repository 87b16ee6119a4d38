"""Inspect's own conformance suite for sandbox providers, run against the lowlevel provider.

``inspect_ai.util._sandbox.self_check`` is the portable suite Inspect ships for any
``SandboxEnvironment`` (its docstring says how to consume it: import the checks, provide a
function-scoped ``sandbox_env`` fixture, xfail what the provider cannot do). Each check gets a
fresh lowlevel session, as a sample would.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("inspect_ai", reason="the Inspect extra is not installed (pip install '.[inspect]' in the lowlevel checkout)")

from inspect_ai.util._sandbox.self_check import *  # noqa: F403,E402  (the checks are the tests)

from lowlevel.integrations.inspect_sandbox import LowlevelSandboxEnvironment  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.anyio, pytest.mark.timeout(120)]

#: Checks this provider cannot pass, with the reason (kept as strict xfails: if one starts
#: passing, the list is wrong).
EXPECTED_FAILURES = {
    # Adds a user with adduser as root, then runs commands as it: the sandbox has one
    # unprivileged uid, a read-only /etc and no setuid; user="root" raises
    # SandboxUserUnsupportedError, as the contract allows.
    "test_exec_as_user": "one unprivileged uid per sandbox: no adduser, no user switch",
}
#: Checks that sleep for seconds by design (Inspect's fixed waits for a leaked process).
SLOW = {"test_exec_timeout", "test_exec_timeout_kills_process", "test_exec_timeout_kills_child_processes"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def sandbox_env(request: pytest.FixtureRequest) -> AsyncIterator[LowlevelSandboxEnvironment]:
    reason = EXPECTED_FAILURES.get(request.node.originalname)
    if reason:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    if request.node.originalname in SLOW:
        request.node.add_marker(pytest.mark.slow)
    envs = await LowlevelSandboxEnvironment.sample_init("conformance", None, {})
    env = envs["default"]
    assert isinstance(env, LowlevelSandboxEnvironment)
    try:
        yield env
    finally:
        await LowlevelSandboxEnvironment.sample_cleanup("conformance", None, envs, False)
    assert not env.session.alive and not os.path.exists(env.session.directory)  # nothing left behind
