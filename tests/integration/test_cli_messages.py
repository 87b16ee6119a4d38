"""One-line CLI messages read as sentences once their newlines are folded (``lowlevel: ...``)."""

from __future__ import annotations

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
        run = subprocess.run([*lowlevel, "run", "--rm", "--network=host", "--memory", "2G", "--record",
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
