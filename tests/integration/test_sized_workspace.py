"""Limits(workspace_bytes=N): the run's total disk use is bounded, results copied back safely."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lowlevel

pytestmark = pytest.mark.bwrap


def _mounts() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(".sized-" in line for line in f)


@pytest.mark.root
def test_total_disk_use_is_bounded_and_results_come_back(tmp_path):
    src = tmp_path / "data.txt"
    src.write_text("input\n")
    # Control: without a total, 40 files of 1 MiB each fit (RLIMIT_FSIZE is per file).
    fill = "for i in $(seq 40); do head -c 1048576 /dev/zero > f$i || exit 9; done; echo filled"
    free = lowlevel.run(["sh", "-c", fill], policy=lowlevel.Policy(limits=lowlevel.Limits(fsize_bytes=2 << 20)))
    assert free.stdout == b"filled\n"
    policy = lowlevel.Policy(limits=lowlevel.Limits(fsize_bytes=2 << 20, workspace_bytes=4 << 20))
    r = lowlevel.run(["sh", "-c", f"cat data.txt; echo out > result.txt; {fill}"], policy=policy,
                     inputs=[str(src)])
    assert r.exit_code == 9, r.stderr
    assert b"No space left on device" in r.stderr and r.stdout == b"input\n"
    ws = Path(r.workspace)
    total = sum(p.stat().st_size for p in ws.iterdir() if p.is_file())
    assert total <= 4 << 20
    assert (ws / "result.txt").read_text() == "out\n"
    assert "result.txt" in r.changes.added and "data.txt" not in r.changes.modified
    assert _mounts() == 0, "the tmpfs was left mounted"
    assert not [d for d in os.listdir(ws.parent) if d.startswith((".sized-", ".copyback-"))]


@pytest.mark.root
def test_copy_back_is_untrusted():
    policy = lowlevel.Policy(limits=lowlevel.Limits(workspace_bytes=1 << 20))
    r = lowlevel.run(["sh", "-c", "mkfifo pipe; ln -s /etc/shadow link; mkdir d; echo x > d/f; chmod 700 d"],
                     policy=policy)
    ws = Path(r.workspace)
    assert not (ws / "pipe").exists(), "a fifo was copied back"
    assert (ws / "link").is_symlink() and os.readlink(ws / "link") == "/etc/shadow"
    assert (ws / "d" / "f").read_text() == "x\n"
    assert all(os.lstat(p).st_uid == 0 for p in (ws / "link", ws / "d", ws / "d" / "f"))


def test_unprivileged_caller_gets_unsupported_error(sandbox):
    if not sandbox.user and os.geteuid() == 0:
        pytest.skip("root can mount: covered above")
    r = sandbox.run(["true"], limits={"workspace_bytes": 1 << 20})
    assert r.error == "UnsupportedError" and "root" in r.message


def test_cli_flag(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    p = subprocess.run([sys.executable, "-m", "lowlevel", "run", "--workspace-size", "1M", "--rm", "--",
                        "sh", "-c", "head -c 2000000 /dev/zero > big"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "No space left" in p.stderr
