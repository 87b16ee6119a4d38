"""Red-team finding 1: ``lowlevel replay`` of a crafted record.

A record's workspace listing made ``_restore_inputs`` chmod a host directory 0777 and plant a
symlink to /etc/shadow outside the workspace, as root, before any sandbox; and its policy was
trusted as is. Each test crafts the record an attacker would hand over and shows the replay
now refuses it with nothing changed outside; the controls replay honest records.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import lowlevel
from lowlevel.record import RecordError, canonical_policy, policy_loosening, policy_sha256, replay
from helpers.identities import tmpdir_fixture

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]


base = tmpdir_fixture("lowlevel-record-hardening-")


def _record(base: Path, policy: lowlevel.Policy | None = None) -> tuple[Path, dict[str, Any]]:
    inputs = base / "in"
    inputs.mkdir(mode=0o755)
    (inputs / "data.txt").write_text("hello\n")
    rec = base / "run.json"
    r = lowlevel.run(["sh", "-c", "cat in/data.txt > out.txt"], policy=policy, inputs=[inputs], record=str(rec),
                     workspace_base=str(base / "ws"))
    assert r.exit_code == 0, r.stderr
    shutil.rmtree(r.workspace)
    return rec, json.loads(rec.read_text())


def _write(rec: Path, doc: dict[str, Any]) -> None:
    rec.write_text(json.dumps(doc))


def _victim(base: Path) -> Path:
    victim = base / "victim"
    victim.mkdir(mode=0o700)
    os.chmod(victim, 0o700)
    return victim


def test_absolute_and_dotdot_paths_refused(base: Path) -> None:
    rec, doc = _record(base)
    victim = _victim(base)
    escape = os.path.relpath(base / "planted-link", base / "ws" / "run-x")  # ../../planted-link
    attacks = [
        {"path": str(victim), "kind": "dir", "mode": 0o777, "size": 0, "sha256": None, "link": None,
         "stored": False, "skipped": None},
        {"path": escape, "kind": "symlink", "mode": 0o777, "size": 11, "sha256": None, "link": "/etc/shadow",
         "stored": False, "skipped": None},
        {"path": "in/../../../victim", "kind": "dir", "mode": 0o777, "size": 0, "sha256": None, "link": None,
         "stored": False, "skipped": None},
    ]
    for attack in attacks:
        crafted = json.loads(json.dumps(doc))
        crafted["workspace"]["before"].append(attack)
        _write(rec, crafted)
        with pytest.raises(RecordError, match="must be relative"):
            replay(rec, workspace_base=str(base / "ws"))
        assert stat.S_IMODE(os.stat(victim).st_mode) == 0o700
        assert not os.path.lexists(base / "planted-link")
    # No workspace is left behind by the refused replays.
    assert sorted(os.listdir(base / "ws")) == []


def test_symlink_then_write_through_it_refused(base: Path) -> None:
    """A listed symlink to a host dir, then a file and a dir "inside" it: never followed."""
    rec, doc = _record(base)
    victim = _victim(base)
    crafted = json.loads(json.dumps(doc))
    data_entry = next(e for e in crafted["workspace"]["before"] if e["path"] == "in/data.txt")
    crafted["workspace"]["before"] += [
        {"path": "lnk", "kind": "symlink", "mode": 0o777, "size": 1, "sha256": None, "link": str(victim),
         "stored": False, "skipped": None},
        dict(data_entry, path="lnk/pwned"),
    ]
    _write(rec, crafted)
    with pytest.raises(RecordError):
        replay(rec, workspace_base=str(base / "ws"))
    assert os.listdir(victim) == [] and stat.S_IMODE(os.stat(victim).st_mode) == 0o700
    crafted["workspace"]["before"][-1] = {"path": "lnk/sub", "kind": "dir", "mode": 0o777, "size": 0,
                                          "sha256": None, "link": None, "stored": False, "skipped": None}
    _write(rec, crafted)
    with pytest.raises(RecordError):
        replay(rec, workspace_base=str(base / "ws"))
    assert os.listdir(victim) == [] and stat.S_IMODE(os.stat(victim).st_mode) == 0o700


def test_store_and_digest_cannot_point_elsewhere(base: Path) -> None:
    rec, doc = _record(base)
    for mutate in (lambda d: d["inputs"].__setitem__("store", "../.."),
                   lambda d: d["workspace"]["before"][1].__setitem__("sha256", "../../../../etc/shadow"),
                   lambda d: d.__setitem__("stdin", {"sha256": "/dev/zero", "bytes": 1, "stored": True})):
        crafted = json.loads(json.dumps(doc))
        mutate(crafted)
        _write(rec, crafted)
        with pytest.raises(RecordError, match="refusing the record"):
            replay(rec, workspace_base=str(base / "ws"))


def test_setuid_bits_never_recreated(base: Path) -> None:
    rec, doc = _record(base)
    crafted = json.loads(json.dumps(doc))
    for e in crafted["workspace"]["before"]:
        if e["path"] == "in/data.txt":
            e["mode"] = 0o4755
    _write(rec, crafted)
    report = replay(rec, workspace_base=str(base / "ws"), keep_workspace=True)
    assert report.result is not None
    ws = report.result.workspace
    try:
        assert stat.S_IMODE(os.lstat(Path(ws, "in", "data.txt")).st_mode) == 0o755
    finally:
        shutil.rmtree(ws)


def _with_policy(doc: dict[str, Any], policy: lowlevel.Policy) -> dict[str, Any]:
    crafted = json.loads(json.dumps(doc))
    crafted["policy"] = canonical_policy(policy)
    crafted["policy_sha256"] = policy_sha256(policy)
    return crafted


def test_looser_policy_refused_with_the_differences(base: Path) -> None:
    rec, doc = _record(base)
    evil = lowlevel.Policy(binds=(lowlevel.Bind("/", "/host", writable=True, allow_sensitive=True),),
                           network=True, seccomp=None, unsafe_no_seccomp=True,
                           limits=lowlevel.Limits(memory_bytes=None, pids=None))
    _write(rec, _with_policy(doc, evil))
    with pytest.raises(RecordError) as info:
        replay(rec, workspace_base=str(base / "ws"))
    msg = str(info.value)
    for needle in ("bind / -> /host (writable, allow_sensitive)", "network=True", "seccomp=None",
                   "limits.memory_bytes=None", "limits.pids=None", "--trust-record-policy"):
        assert needle in msg, (needle, msg)
    assert sorted(os.listdir(base / "ws")) == []  # refused before a workspace was made
    proc = subprocess.run([sys.executable, "-m", "lowlevel", "replay", str(rec)], capture_output=True,
                          cwd=str(REPO), timeout=60)
    assert proc.returncode == 125 and b"bind / -> /host" in proc.stderr and b"network=True" in proc.stderr


def test_log_mode_and_read_only_bind_are_looser_too() -> None:
    assert policy_loosening(lowlevel.Policy()) == []
    assert policy_loosening(lowlevel.Policy(deterministic=True, hostname="x", env={"A": "1"}), 10) == []
    loose = policy_loosening(lowlevel.Policy(seccomp=lowlevel.DEFAULT_PROFILE.with_log(),
                                             binds=(lowlevel.Bind("/usr/share", "/opt/share"),)), None)
    assert any("log mode" in line for line in loose)
    assert any("bind /usr/share -> /opt/share (read-only)" in line for line in loose)
    assert any("timeout_s=None" in line for line in loose)


def test_trusted_looser_record_replays(base: Path) -> None:
    """Control: the same mechanism with trust: a record with network=True replays when trusted."""
    rec, doc = _record(base, lowlevel.Policy(network=True))
    with pytest.raises(RecordError, match="network=True"):
        replay(rec, workspace_base=str(base / "ws"))
    report = replay(rec, workspace_base=str(base / "ws"), trust_policy=True)
    assert report.matched, report.differences
    proc = subprocess.run([sys.executable, "-m", "lowlevel", "replay", "--trust-record-policy", str(rec)],
                          capture_output=True, cwd=str(REPO), timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_honest_record_replays(base: Path) -> None:
    rec, _doc = _record(base)
    report = replay(rec, workspace_base=str(base / "ws"))
    assert report.matched, report.differences
