"""``lowlevel cleanup`` and doctor's leftovers check: what interrupted runs leave, found and removed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lowlevel import limits as _limits
from lowlevel.cleanup import clean, find_leftovers

pytestmark = pytest.mark.bwrap


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_leftovers_of_a_dead_caller_are_found_and_removed(tmp_path: Path):
    dead = _dead_pid()
    # A stale egress socket directory (its proxy is gone: the socket accepts nothing).
    d = Path(tempfile.mkdtemp(prefix="lowlevel-egress-", dir="/dev/shm"))
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "proxy.sock"))
    s.close()
    # A commit killed mid-way left a temporary in a workspace.
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / f".lowlevel-commit-{dead}-1").write_text("half")
    (ws / "mine.txt").write_text("user data")
    # A run cgroup of the dead caller (empty), where a hierarchy is writable.
    support = _limits.detect_cgroups()
    cg = None
    for h in support.hierarchies:
        if h.base:
            cg = Path(h.base) / f"run-{dead}-deadbeef"
            cg.mkdir()
            (cg / "child" / "grandchild").mkdir(parents=True)  # nested cgroups go deepest first
            break
    found = {(x.kind, x.path) for x in find_leftovers((str(ws),))}
    assert ("egress", str(d)) in found
    assert ("commit", str(ws / f".lowlevel-commit-{dead}-1")) in found
    if cg is not None:
        assert ("cgroup", str(cg)) in found
    # doctor says so
    doctor = subprocess.run([sys.executable, "-m", "lowlevel", "doctor", "--json"], capture_output=True, text=True)
    check = next(c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "leftovers")
    assert not check["ok"] and "egress" in check["detail"]
    removed, problems = clean((str(ws),))
    # Only what this test made: a machine shared with other callers may hold their leftovers.
    mine = [p for p in problems if str(d) in p or str(ws) in p or (cg is not None and str(cg) in p)]
    assert not mine, problems
    assert not d.exists() and not (ws / f".lowlevel-commit-{dead}-1").exists()
    assert (ws / "mine.txt").read_text() == "user data"  # never the user's files
    if cg is not None:
        assert not cg.exists()
    p = subprocess.run([sys.executable, "-m", "lowlevel", "cleanup", "--workspace", str(ws)], capture_output=True,
                       text=True)
    out = p.stdout + p.stderr
    assert str(d) not in out and str(ws) not in out and (cg is None or str(cg) not in out), out


def test_a_live_egress_socket_is_not_a_leftover():
    d = Path(tempfile.mkdtemp(prefix="lowlevel-egress-", dir="/dev/shm"))
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(d / "proxy.sock"))
        s.listen(1)
        assert not any(x.path == str(d) for x in find_leftovers())
    finally:
        s.close()
        os.unlink(d / "proxy.sock")
        os.rmdir(d)
