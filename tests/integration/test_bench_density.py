"""bench/density.py runs end to end with tiny N, as root and as the test user, and leaves nothing.

Not a measurement (benchmarks never assert figures): the bench's JSON has every field the
README's table reads, every limit probe ends in a lowlevel error (never a hang or a bare
OSError), and after each child no process, fd or live session is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.procs import pids_with

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_density_bench_json_and_nothing_left(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if os.geteuid() != 0:
        pytest.skip("bench/density.py runs as root (it runs the unprivileged half through runuser)")
    request.getfixturevalue("test_user")  # the bench's "user" caller
    out = tmp_path / "density.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "density.py"), "--sizes", "3", "--seconds", "0.3",
                           "--settle", "0", "--step", "3", "--limits", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [(r["who"], r["started"]) for r in doc["runs"]] == [("root", 3), ("user", 3)], doc["runs"]
    for r in doc["runs"]:
        assert "hang" not in r and "start_error" not in r, r
        assert r["left_after_close"] == {"processes": 0, "fds_over_baseline": 0}, r
        assert r["commands"]["errors"] == 0 and r["commands"]["latency_ms"]["n"] > 0, r
        # anchor, bwrap, bwrap as PID 1, the init, the init's pre-forked shepherd (the spare)
        assert r["idle"]["processes_per_session"] == 5 and r["idle"]["pss_mib_per_session"] > 0, r
        assert r["caller"]["threads_added"] == 0 and r["caller"]["fds_per_session"] > 0, r
    assert sorted((p["who"], p["probe"]) for p in doc["limits"]) == [
        ("root", "memory"), ("root", "nofile"), ("root", "uids"), ("user", "nofile"), ("user", "nproc")], doc["limits"]
    memory = next(p for p in doc["limits"] if p["probe"] == "memory")
    if "skipped" not in memory:  # the OOM killer took sessions, not the bench's child (a crash)
        assert "crashed" not in memory and memory["sessions_ended"]["n"] + ("error" in memory) > 0, memory
    for p in (p for p in doc["limits"] if "skipped" not in p):
        assert p["error"]["lowlevel_error"] and p["started"] >= 1, p
        assert p["left_after_close"]["processes"] == 0, p
        # +1 at most: the init executable's fd, opened once per process (the probe's baseline is before it)
        assert p["left_after_close"]["fds_over_baseline"] <= 1, p
    # The children's command lines name their workspace base (--child-base /tmp/lowlevel-density-...).
    assert not pids_with("lowlevel-density-"), "a child of the bench outlived it"
