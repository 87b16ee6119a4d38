"""bench/bwrap_parts.py leaves no cgroup behind (a nested leftover failed CI's cleanup test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowlevel.host import cgroup_detect

ROOT = Path(__file__).resolve().parents[2]


def _cpuacct_base() -> str:
    if os.geteuid() != 0:
        pytest.skip("bench/bwrap_parts.py runs the seed recipe as root")
    h = cgroup_detect.detect_cgroups().hierarchy_for("cpuacct")
    if h is None or h.version != 1 or not h.base:
        pytest.skip("no writable cgroup v1 cpuacct hierarchy: the bench uses rusage, no cgroup")
    return h.base


def _start() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(ROOT / "bench" / "bwrap_parts.py"), "--calls", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not os.path.isdir(os.path.join(path, "seed")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the bench made no cgroup in 60 s"
        time.sleep(0.05)


@pytest.mark.slow
def test_bwrap_parts_removes_its_cgroups_when_done():
    base = _cpuacct_base()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bwrap_parts.py"), "--calls", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "raw (uid_drop) vs seed" in proc.stdout
    # The pid is gone: nothing of it may stay, nested step directories included.
    assert not [n for n in os.listdir(base) if n.endswith("-bench-parts")
                and not os.path.exists(f"/proc/{n.split('-')[0]}")]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_bwrap_parts_removes_its_cgroups_when_stopped(sig):
    base = _cpuacct_base()
    proc = _start()
    path = os.path.join(base, f"{proc.pid}-bench-parts")
    try:
        _wait_for(path, proc)
        time.sleep(0.3)  # mid-ladder: the thread is in a step's cgroup, a sandbox may be starting
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not os.path.exists(path), os.listdir(path)
