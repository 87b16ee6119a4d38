"""tests/unit/ starts no process (issue 26: "unit/ starts processes").

A unit test checks a pure function: argv building, parsing, classification, the C sources' text.
What needs a process (a sandbox, a compiler, a child interpreter, a fake bwrap) is an
integration test and lives in tests/integration/. The autouse fixture below makes every way
this interpreter can start one raise :class:`ProcessStartedError` during a unit test, so a new unit
test that starts a process fails loudly at the call instead of slowing the quick loop:

- ``subprocess.Popen`` (and so ``subprocess.run``/``check_output``, asyncio's subprocesses,
  ``multiprocessing``'s fork server): ``Popen._execute_child`` and ``_posixsubprocess.fork_exec``;
- ``os.fork``, ``os.forkpty``, ``os.posix_spawn``, ``os.posix_spawnp`` (lowlevel's launcher
  starts its anchor with ``os.posix_spawn``), ``os.system``, ``os.popen``, ``pty.fork``.

The session-scoped fixtures of tests/conftest.py (the unprivileged test user) are not used here.
"""

from __future__ import annotations

import _posixsubprocess
import os
import pty
import subprocess
from typing import Any

import pytest


class ProcessStartedError(AssertionError):
    """A unit test tried to start a process (see this module's docstring)."""


def _refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ProcessStartedError(f"{what} in a unit test: tests/unit starts no process (a sandbox, compiler or "
                             f"child interpreter makes it an integration test: move it to tests/integration/)")
    return refuse


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process-starting call of this interpreter raises :class:`ProcessStartedError`."""
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess.Popen"))
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse("_posixsubprocess.fork_exec"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
    monkeypatch.setattr(pty, "fork", _refuse("pty.fork"))
