"""One-line CLI messages read as sentences once their newlines are folded (``lowlevel: ...``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bwrap]


def test_replay_refusal_of_a_looser_policy_is_one_readable_line() -> None:
    d = Path(tempfile.mkdtemp(prefix="replay-msg-", dir="/tmp"))
    try:
        lowlevel = [sys.executable, "-m", "lowlevel"]
        run = subprocess.run([*lowlevel, "run", "--rm", "--network=host", "--memory", "4G", "--record",
                              str(d / "r.json"), "--", "true"], capture_output=True, text=True, timeout=120, cwd=d)
        assert run.returncode == 0, run.stderr
        proc = subprocess.run([*lowlevel, "replay", str(d / "r.json")], capture_output=True, text=True,
                              timeout=120, cwd=d)
        assert proc.returncode == 125 and proc.stderr.count("\n") == 1, proc.stderr
        # each difference ends with ";", the list with "." before the next sentence
        assert "default: no network; " in proc.stderr or "default: no network. " in proc.stderr, proc.stderr
        assert "memory_bytes" in proc.stderr and ". A record is untrusted input." in proc.stderr, proc.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("identity", ["root", "user"])
def test_replay_keep_workspace_says_where_it_is(identity: str, request: pytest.FixtureRequest) -> None:
    """``lowlevel replay --keep-workspace`` keeps the replay's workspace and prints its path, as
    ``run`` prints a fresh workspace's (it printed nothing: the kept directory could not be found)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (to run both identities)")
    prefix: list[str] = []
    d = Path(tempfile.mkdtemp(prefix="replay-keep-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        if identity == "user":
            user = request.getfixturevalue("test_user")
            os.chown(d, user.pw_uid, user.pw_gid)
            prefix = [shutil.which("runuser") or "/usr/sbin/runuser", "-u", user.pw_name, "--"]
        lowlevel = [*prefix, sys.executable, "-m", "lowlevel"]
        run = subprocess.run([*lowlevel, "run", "--rm", "--record", str(d / "r.json"), "--", "sh", "-c",
                              "echo out > made.txt"], capture_output=True, text=True, timeout=120, cwd=d)
        assert run.returncode == 0, run.stderr
        proc = subprocess.run([*lowlevel, "replay", "--keep-workspace", str(d / "r.json")], capture_output=True,
                              text=True, timeout=120, cwd=d)
        assert proc.returncode == 0 and proc.stdout == "outputs match\n", proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.startswith("lowlevel: workspace ")]
        assert len(lines) == 1, proc.stderr
        kept = Path(lines[0].split(" ", 2)[2])
        assert (kept / "made.txt").read_text() == "out\n"
        shutil.rmtree(kept)
    finally:
        shutil.rmtree(d, ignore_errors=True)
