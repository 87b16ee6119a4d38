"""Run records: record then replay a deterministic Python run; schema; no host secrets."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

jsonschema = pytest.importorskip("jsonschema")

import lowlevel  # noqa: E402
from lowlevel.record import canonical_policy, load_record, policy_from_canonical, policy_sha256, replay  # noqa: E402

from helpers.identities import tmpdir_fixture  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap: apt-get install bubblewrap")]

SCHEMA = pathlib.Path(__file__).resolve().parents[2] / "docs" / "record-schema.json"
SECRET = "lowlevel-test-secret-4f9a1c"

PROGRAM = r"""
import os, sys, time
data = open("in/data.txt").read()
counts = {w: data.split().count(w) for w in set(data.split())}
with open("out.txt", "w") as f:
    for w in counts:                     # set order: fixed only by PYTHONHASHSEED=0
        f.write(f"{w} {counts[w]}\n")
    f.write(time.strftime("%Z", time.localtime()) + " " + os.environ["SOURCE_DATE_EPOCH"] + "\n")
    f.write(f"{os.getuid()} {os.getgid()} {os.uname().nodename}\n")
print(sorted(os.environ))
print(hash("lowlevel"))
"""


base = tmpdir_fixture("lowlevel-record-test-")


def test_record_then_replay_matches(base: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWLEVEL_TEST_HOST_SECRET", SECRET)  # in the caller's env only
    inputs = base / "in"
    inputs.mkdir(mode=0o755)
    (inputs / "data.txt").write_text("b a c a b a d e f g h\n")
    (inputs / "prog.py").write_text(PROGRAM)
    rec = base / "run.json"
    policy = lowlevel.Policy(deterministic=True)
    result = lowlevel.run(["python3", "in/prog.py"], policy=policy, inputs=[inputs], record=str(rec),
                          workspace_base=str(base / "ws"), env={"RUN_LABEL": "x"})
    assert result.exit_code == 0, result.stderr

    doc = json.loads(rec.read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    assert SECRET not in rec.read_text() and "LOWLEVEL_TEST_HOST_SECRET" not in rec.read_text()
    assert doc["environment"]["PYTHONHASHSEED"] == "0" and doc["environment"]["TZ"] == "UTC"
    assert doc["environment"]["RUN_LABEL"] == "x"
    assert doc["policy_sha256"] == policy_sha256(policy)
    assert policy_from_canonical(doc["policy"]) == policy
    assert doc["host"]["landlock_abi"] == result.landlock_abi
    assert doc["bwrap_argv"][doc["bwrap_argv"].index("--uid") + 1] == "1000"
    assert {e["path"] for e in doc["workspace"]["before"]} == {"in", "in/data.txt", "in/prog.py"}
    assert "out.txt" in {e["path"] for e in doc["workspace"]["after"]}
    assert doc["seccomp"]["bpf_sha256"] and doc["versions"]["bwrap"] and doc["versions"]["libseccomp"]
    assert doc["inputs"]["complete"] is True

    # The inputs live in the store: replay works after the originals are gone.
    shutil.rmtree(inputs)
    report = replay(rec, workspace_base=str(base / "ws"))
    assert report.matched, report.differences
    assert report.record["output"]["stdout"]["sha256"] == doc["output"]["stdout"]["sha256"]

    # The CLI says the same, with exit 0.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "LOWLEVEL_WORKSPACE_BASE": str(base / "ws")}
    proc = subprocess.run([sys.executable, "-m", "lowlevel", "replay", str(rec)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_replay_reports_a_mismatch(base: pathlib.Path) -> None:
    rec = base / "r.json"
    lowlevel.run(["python3", "-c", "import os; open('n', 'w').write(os.urandom(8).hex())"],
                 policy=lowlevel.Policy(deterministic=True), record=str(rec), workspace_base=str(base / "ws"))
    report = replay(rec, workspace_base=str(base / "ws"))
    assert not report.matched
    assert any(d.startswith("workspace: n differs") for d in report.differences)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "LOWLEVEL_WORKSPACE_BASE": str(base / "ws")}
    proc = subprocess.run([sys.executable, "-m", "lowlevel", "replay", str(rec)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1


def test_policy_hash_is_canonical() -> None:
    a = lowlevel.Policy(env={"B": "1", "A": "2"})
    b = lowlevel.Policy(env=(("A", "2"), ("B", "1")))
    assert policy_sha256(a) == policy_sha256(b)
    assert policy_sha256(a) != policy_sha256(lowlevel.Policy(env={"A": "2"}))
    assert canonical_policy(a)["seccomp"]["name"] == "default"
    with pytest.raises(Exception):
        load_record(__file__)


@pytest.mark.parametrize("commit", [False, "on_success"])
def test_record_with_a_commit_other_than_true_is_refused_and_changes_nothing(tmp_path: pathlib.Path,
                                                                              commit: object) -> None:
    """Issue 26: ``run(cmd, record=PATH, commit=False)`` committed the changes (the argument was
    dropped on the way to the recorded run). It is refused before anything runs; the workspace
    stays bit-identical and no record is written. Control: commit=True (the default) records."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "keep").write_text("old\n")
    rec = tmp_path / "run.json"
    with pytest.raises(lowlevel.PolicyError, match="does not go with record"):
        lowlevel.run(["sh", "-c", "rm keep; echo new > new"], workspace=str(ws), record=str(rec),
                     commit=commit)  # type: ignore[arg-type]
    assert sorted(p.name for p in ws.iterdir()) == ["keep"] and (ws / "keep").read_text() == "old\n"
    assert not rec.exists()
    r = lowlevel.run(["sh", "-c", "echo new > new"], workspace=str(ws), record=str(rec))
    assert r.exit_code == 0 and (ws / "new").exists() and rec.exists()
