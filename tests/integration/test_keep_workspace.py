"""``keep_workspace=False`` for ``run``, ``arun`` and ``Runner`` (issue 12, item 9): the fresh
workspace is removed once the Result is built (on failure and cancellation too); 200 ``arun``
calls leave no directory. The last test runs as root and as the unprivileged test user."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lowlevel
from helpers.identities import tmpdir_fixture
from helpers.procs import sleep_running

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(240)]


def workspaces(base: Path) -> list[str]:
    """The workspaces under ``base`` (lowlevel's own dot-entries there, such as the overlay
    mount directory ``.mnt``, are not workspaces)."""
    return sorted(n for n in os.listdir(base) if not n.startswith("."))


base = tmpdir_fixture("lowlevel-keep-", mode=0o755)


def test_run_removes_the_fresh_workspace_after_the_result(base: Path) -> None:
    r = lowlevel.run(["sh", "-c", "mkdir d && echo x > d/f && chmod 0500 d"], workspace_base=str(base),
                     keep_workspace=False)
    assert r.exit_code == 0 and "d/f" in r.changes.added
    assert not os.path.exists(r.workspace) and workspaces(base) == []
    assert any("keep_workspace=False" in n for n in r.notes)
    # control: the default keeps it
    r = lowlevel.run(["true"], workspace_base=str(base))
    assert os.path.isdir(r.workspace)


def test_removed_on_failure_timeout_and_exec_error(base: Path) -> None:
    assert lowlevel.run(["sh", "-c", "exit 3"], workspace_base=str(base), keep_workspace=False).exit_code == 3
    r = lowlevel.run(["sleep", "10"], workspace_base=str(base), timeout=0.3, keep_workspace=False)
    assert r.timed_out
    with pytest.raises(lowlevel.ExecError):
        lowlevel.run(["no-such-program"], workspace_base=str(base), keep_workspace=False)
    assert workspaces(base) == []


def test_refused_with_a_given_workspace(tmp_path: Path) -> None:
    (tmp_path / "mine").write_text("keep")
    with pytest.raises(lowlevel.PolicyError, match="never deletes"):
        lowlevel.run(["true"], workspace=str(tmp_path), keep_workspace=False)
    with pytest.raises(lowlevel.PolicyError, match="never deletes"):
        asyncio.run(lowlevel.arun(["true"], workspace=str(tmp_path), keep_workspace=False))
    assert (tmp_path / "mine").read_text() == "keep"


def test_record_run_removes_it_too(base: Path, tmp_path: Path) -> None:
    r = lowlevel.run(["sh", "-c", "echo x > f"], workspace_base=str(base), keep_workspace=False,
                     record=str(tmp_path / "r.json"))
    assert r.exit_code == 0 and workspaces(base) == [] and (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_200_arun_calls_leave_no_directory(base: Path) -> None:
    async def main() -> list[lowlevel.Result]:
        async with lowlevel.Runner(max_concurrency=8, workspace_base=str(base), keep_workspace=False) as runner:
            return await asyncio.gather(*(runner.run(["sh", "-c", "echo $$ > pid"]) for _ in range(200)))

    results = asyncio.run(main())
    assert all(r.exit_code == 0 and r.changes.added == ("pid",) for r in results)
    assert workspaces(base) == []


def test_arun_cancelled_removes_it(base: Path) -> None:
    marker = f"30.{secrets.randbelow(10**6):06d}"

    async def main() -> None:
        task = asyncio.ensure_future(lowlevel.arun(["sh", "-c", f"echo x > f; exec sleep {marker}"],
                                                   workspace_base=str(base), keep_workspace=False))
        while not sleep_running(marker):
            assert not task.done()
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert workspaces(base) == []


def test_as_each_identity(sandbox, base: Path) -> None:  # type: ignore[no-untyped-def]
    """A tree the program made unwritable (chmod 0500) goes too, as root and as the user."""
    repo = Path(__file__).resolve().parents[2]
    if sandbox.user is not None:
        os.chown(base, sandbox.user.pw_uid, sandbox.user.pw_gid)
    code = ("import lowlevel, sys; r = lowlevel.run(['sh', '-c', 'mkdir d; echo x > d/f; chmod 0500 d'], "
            "workspace_base=sys.argv[1], keep_workspace=False); print(r.exit_code, sorted(r.changes.added))")
    cmd = [sys.executable, "-c", code, str(base)]
    if sandbox.user is not None:
        cmd = [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={sandbox.user.pw_uid}",
               f"--regid={sandbox.user.pw_gid}", "--init-groups", "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
                         cwd="/", timeout=60)
    assert out.stdout == b"0 ['d', 'd/f']\n", out
    assert workspaces(base) == []
