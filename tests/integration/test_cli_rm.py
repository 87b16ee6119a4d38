"""``lowlevel run --rm``: the fresh per-run workspace does not outlive the run (finding 5:
1,700+ workspaces had piled up in /tmp/lowlevel-0)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.identities import tmpdir_fixture

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
#: Leaves a file, and a directory its owner cannot write (rmtree must still empty it).
PROGRAM = "echo x > f && mkdir d && echo y > d/g && chmod 0500 d"


base = tmpdir_fixture("lowlevel-rm-base-", mode=0o755)


def _cli(base: Path, *args: str, user: pwd.struct_passwd | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin", "LOWLEVEL_WORKSPACE_BASE": str(base), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "lowlevel", "run", *args]
    if user is not None:
        env["HOME"] = user.pw_dir
        cmd = [RUNUSER, "-u", user.pw_name, "--", *cmd]
    return subprocess.run(cmd, capture_output=True, env=env, cwd="/", timeout=60)


def test_rm_removes_the_workspace_and_json_still_lists_changes(base: Path) -> None:
    proc = _cli(base, "--rm", "--json", "--", "sh", "-c", PROGRAM)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {"f", "d", "d/g"} <= set(doc["changes"]["added"])
    assert not os.path.exists(doc["workspace"])
    assert os.listdir(base) == []
    assert b"lowlevel: workspace" not in proc.stderr
    # Control: without --rm the workspace stays, and its path is printed.
    proc = _cli(base, "--", "sh", "-c", PROGRAM)
    assert proc.returncode == 0, proc.stderr
    assert len(os.listdir(base)) == 1 and b"lowlevel: workspace" in proc.stderr


def test_rm_on_failure_and_timeout(base: Path) -> None:
    assert _cli(base, "--rm", "--", "sh", "-c", PROGRAM + "; exit 3").returncode == 3
    assert _cli(base, "--rm", "--timeout", "0.5", "--", "sleep", "5").returncode == 124
    assert os.listdir(base) == []


def test_rm_refuses_a_given_workspace(base: Path, tmp_path: Path) -> None:
    (tmp_path / "keep").write_text("mine")
    proc = _cli(base, "--rm", "--workspace", str(tmp_path), "--", "true")
    assert proc.returncode == 125 and b"--rm" in proc.stderr
    assert (tmp_path / "keep").read_text() == "mine"


@pytest.mark.root
def test_rm_as_unprivileged_user(base: Path, test_user: pwd.struct_passwd) -> None:
    os.chown(base, test_user.pw_uid, test_user.pw_gid)
    proc = _cli(base, "--rm", "--json", "--", "sh", "-c", PROGRAM, user=test_user)
    assert proc.returncode == 0, proc.stderr
    assert "f" in json.loads(proc.stdout)["changes"]["added"]
    # .mnt: the (empty) directory an unprivileged caller's runs mount their upper tmpfs on, each in
    # its own mount namespace (lowlevel.workspace.cow.mount_dir); it stays, empty, for the next run.
    assert [n for n in os.listdir(base) if n != ".mnt"] == []
    assert os.listdir(base / ".mnt") == [] if (base / ".mnt").exists() else True
