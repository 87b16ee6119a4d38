"""tests/unit/conftest.py's guard: a unit test that starts a process fails at the call."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

REFUSED = "tests/unit starts no process"


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"]),
    lambda: subprocess.check_output(["true"]),
    lambda: asyncio.run(asyncio.create_subprocess_exec("true")),
    lambda: os.posix_spawn("/bin/true", ["true"], {}),
    lambda: os.posix_spawnp("true", ["true"], {}),
    lambda: os.fork(),  # looked up at the call: the guard replaces os.fork
    lambda: os.spawnv(os.P_WAIT, "/bin/true", ["true"]),
    lambda: os.system("true"),
], ids=["run", "check_output", "asyncio", "posix_spawn", "posix_spawnp", "fork", "spawnv", "system"])
def test_starting_a_process_fails_loudly(start) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AssertionError, match=REFUSED):
        start()
