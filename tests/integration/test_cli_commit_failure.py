"""``lowlevel run`` whose commit fails after the program ran (the host changed the same file
during the run) still delivers what the program printed and its exit status, and a record
names the failure: with ``--record`` or ``--json`` the output, the status and the record were
all lost (one ``commit refused`` line, 125, no record: a fresh-user trial). And a record inside
the run's own workspace is refused before anything runs: the program could see its temporary
file and delete it to make the commit fail, suppressing its own record."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers.identities import runuser, tmpdir_fixture
from helpers.procs import running_exactly

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]

base = tmpdir_fixture("lowlevel-cli-commit-failure-", mode=0o755, owned=True)

#: The program: appends to data.txt (its copy in the upper layer), prints, then execs a shell
#: whose command line carries the marker (the host's cue: data.txt is written) and sleeps while
#: the host changes data.txt too. The commit finds it changed on the host after the run began, in
#: a version the run never saw: refused (a host change the run saw first is no conflict).
PROGRAM = "echo run >> data.txt; echo OUT; echo ERR >&2; exec sh -c 'sleep 3; exit 3' \"$0\""


def _conflicting_run(who: pwd.struct_passwd | None, ws: Path, *options: str) -> subprocess.CompletedProcess[bytes]:
    marker = f"marker-{uuid.uuid4().hex}"
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LOWLEVEL_CGROUP_ROOTS": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), "LOWLEVEL_WORKSPACE_BASE": str(ws.parent / "wsbase")}
    argv = runuser(who, ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "lowlevel", "run",
                         "--workspace", str(ws), *options, "--", "sh", "-c", PROGRAM, marker])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ws.parent)
    deadline = time.monotonic() + 60
    while not running_exactly(["sh", "-c", "sleep 3; exit 3", marker]) and time.monotonic() < deadline \
            and proc.poll() is None:  # the program's inner shell (the CLI's own argv holds the marker too)
        time.sleep(0.02)
    with open(ws / "data.txt", "a") as f:  # the host's change, while the program runs
        f.write("host\n")
    out, err = proc.communicate(timeout=90)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _workspace(base: Path, who: pwd.struct_passwd | None) -> Path:
    ws = base / "ws"
    ws.mkdir()
    (ws / "data.txt").write_text("hi\n")
    (base / "wsbase").mkdir()
    for p in (ws, ws / "data.txt", base / "wsbase"):
        if who is not None:
            os.chown(p, who.pw_uid, who.pw_gid)
    return ws


def test_record_run_whose_commit_fails_delivers_output_status_and_record(base: Path,
                                                                         who: pwd.struct_passwd | None) -> None:
    ws = _workspace(base, who)
    record = base / "r.json"
    proc = _conflicting_run(who, ws, "--record", str(record))
    assert proc.returncode == 125, proc.stderr
    assert proc.stdout == b"OUT\n"
    assert b"ERR\n" in proc.stderr and b"commit refused" in proc.stderr and b"(the program exited 3)" in proc.stderr
    assert b"save_upper()" not in proc.stderr  # says where the changes are, not a Python API
    doc = json.loads(record.read_text())
    assert doc["exit"]["exit_code"] == 3 and any(n.startswith("commit: failed: commit refused") for n in doc["notes"]), doc
    assert (ws / "data.txt").read_text() == "hi\nhost\n"  # the commit changed nothing


def test_json_run_whose_commit_fails_prints_one_object_with_the_result(base: Path,
                                                                        who: pwd.struct_passwd | None) -> None:
    ws = _workspace(base, who)
    proc = _conflicting_run(who, ws, "--json")
    assert proc.returncode == 125, proc.stderr
    doc = json.loads(proc.stdout)  # exactly one object
    assert doc["error"] == "CommitConflictError" and doc["exit_status"] == 125, doc
    assert doc["result"]["exit_code"] == 3 and "OUT" in json.dumps(doc["result"]["stdout"]), doc["result"]


def test_a_record_inside_the_workspace_is_refused_before_the_run(base: Path, who: pwd.struct_passwd | None) -> None:
    ws = _workspace(base, who)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LOWLEVEL_CGROUP_ROOTS": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    for record in (ws / "rec.json", ws / "sub" / ".." / "rec.json"):
        proc = subprocess.run(runuser(who, ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m",
                                            "lowlevel", "run", "--workspace", str(ws), "--record", str(record), "--",
                                            "touch", "ran"]), capture_output=True, cwd=base, timeout=60)
        assert proc.returncode == 125 and b"inside the run's workspace" in proc.stderr, proc.stderr
    assert sorted(os.listdir(ws)) == ["data.txt"]  # nothing ran, no temporary, no input store
    control = base / "rec.json"  # outside: recorded
    proc = subprocess.run(runuser(who, ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m",
                                        "lowlevel", "run", "--workspace", str(ws), "--record", str(control), "--",
                                        "touch", "ran"]), capture_output=True, cwd=base, timeout=60)
    assert proc.returncode == 0 and control.is_file() and (ws / "ran").exists(), proc.stderr
