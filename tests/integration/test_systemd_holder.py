"""The systemd-delegated cgroup scope's holder process (lowlevel.host.cgroup_detect._systemd_delegate),
with ``systemd-run`` stood in by a script: the holder is a real child process (moved from
tests/unit/test_limits.py: tests/unit starts no process)."""

from __future__ import annotations

import os
import shutil

import pytest

from lowlevel.host import cgroup_detect as L


def test_systemd_delegate_reads_the_scope_and_stops_the_holder(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``systemd-run`` stood in by a script: prints the scope as the holder would, then waits on stdin."""
    mount = tmp_path / "cg"
    scope = mount / "user.slice" / "lowlevel-1.scope"
    scope.mkdir(parents=True)
    (scope / "cgroup.procs").write_text("")
    fake = tmp_path / "systemd-run"
    args_file = tmp_path / "args"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args_file}\nprintf '0::/user.slice/lowlevel-1.scope\\n.\\n'\n"
                    "exec cat >/dev/null\n")
    fake.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(fake) if name == "systemd-run" else None)
    monkeypatch.setattr(L, "_SYSTEMD_BOOTED", str(tmp_path))
    monkeypatch.setattr(L, "_holder", None)
    got = L._systemd_delegate(str(mount), True)
    assert got is not None
    path, holder_pid = got
    assert path == str(scope)
    holder = L._holder
    assert holder is not None and holder.pid == holder_pid and holder.poll() is None
    args = args_file.read_text().split()
    assert args[:6] == ["--user", "--scope", "--quiet", "--collect", "-p", "Delegate=yes"]
    assert args[6].startswith(f"--unit=lowlevel-{os.getpid()}-")
    L._stop_holder(holder)  # what atexit does: close its stdin, it exits
    assert holder.returncode == 0
