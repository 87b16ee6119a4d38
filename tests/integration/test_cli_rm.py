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


#: ``lowlevel run --rm`` with a SIGTERM that lands the moment the fresh workspace exists (raised
#: right after ``create_workspace`` made it, before the CLI could note it).
SIGNAL_AT_CREATE = """
import os, signal, sys
import lowlevel.workspace as ws
from lowlevel.cli import main
real = ws.create_workspace
def create_workspace(*args, **kwargs):
    path = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode: here, or deferred
    return path
ws.create_workspace = create_workspace
sys.exit(main(["run", "--rm", "--", "true"]))
"""


def test_rm_removes_a_workspace_made_the_instant_a_signal_came(base: Path) -> None:
    """A SIGTERM right after the fresh workspace was made: the CLI unwinds (143) and --rm removes
    it. Before, the handler's exception came between the mkdir and the CLI's note of the path,
    and the workspace was left to ``lowlevel cleanup`` (bench/kill_campaign.py ``cli_rm``)."""
    env = {"PATH": "/usr/bin:/bin", "LOWLEVEL_WORKSPACE_BASE": str(base), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SIGNAL_AT_CREATE], capture_output=True, env=env, cwd="/",
                          timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert b"SIGTERM" in proc.stderr and b"Traceback" not in proc.stderr, proc.stderr
    assert os.listdir(base) == []
