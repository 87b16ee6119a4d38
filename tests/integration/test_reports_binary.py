"""Issue 12 item 4: binary-safe, name-safe reports.

``--json`` turned stdout bytes >= 0x80 into U+FFFD, and a file named ``b"\\xff"`` (or a symlink
whose target is not UTF-8) made ``--record`` raise after the run: a traceback, no record, a
partial temp file, the output lost. Every report now carries text when it is valid UTF-8 and the
exact bytes otherwise (docs/records.md, "Bytes and names in JSON"), the JSON is strict UTF-8
(no lone surrogates), and a replay restores such names exactly.
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lowlevel
from lowlevel.record import replay

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"

# Makes a file named b"\xff", a symlink with a non-UTF-8 target, writes bytes >= 0x80 to stdout.
ODD = ("import os, sys; open(b'\\xffname', 'wb').write(b'data'); os.symlink(b'\\xfe-target', b'link'); "
       "sys.stdout.buffer.write(b'\\xff\\x00ok\\n'); sys.stderr.write('caf\\u00e9\\n')")


@pytest.fixture
def shared() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lowlevel-reports-"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _cli(args: list[str], user: pwd.struct_passwd | None, base: Path) -> subprocess.CompletedProcess[bytes]:
    pythonpath = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": pythonpath, "LOWLEVEL_WORKSPACE_BASE": str(base)}
    cmd = [sys.executable, "-m", "lowlevel", *args]
    if user is not None:
        cmd = [RUNUSER, "-u", user.pw_name, "--", "env", *(f"{k}={v}" for k, v in env.items()), *cmd]
    return subprocess.run(cmd, env=env, cwd="/", capture_output=True, timeout=120)


def _strict(data: bytes) -> Any:
    """Parse JSON that must be strict UTF-8 with no lone surrogate (what serde or Go accept)."""
    text = data.decode("utf-8")
    assert "\\ud" not in text.lower(), "a lone surrogate escape in the JSON"
    return json.loads(text)


@pytest.mark.parametrize("identity", ["root", "user"] if os.geteuid() == 0 else ["self"])
def test_json_and_record_are_lossless(identity: str, request: pytest.FixtureRequest, shared: Path) -> None:
    user = request.getfixturevalue("test_user") if identity == "user" else None
    out = shared / "out"
    out.mkdir(mode=0o755)
    base = shared / "ws"
    base.mkdir(mode=0o755)
    if user is not None:
        os.chown(out, user.pw_uid, user.pw_gid)
        os.chown(base, user.pw_uid, user.pw_gid)
    rec = out / "run.json"
    p = _cli(["run", "--json", "--record", str(rec), "--", "python3", "-c", ODD], user, base)
    assert p.returncode == 0, p.stderr
    assert b"Traceback" not in p.stderr
    doc = _strict(p.stdout)
    assert base64.b64decode(doc["stdout_b64"]) == b"\xff\x00ok\n"
    assert doc["stdout"] == "\ufffd\x00ok\n"
    assert doc["stderr"] == "caf\u00e9\n" and doc["stderr_b64"] is None
    assert {"b64": "/25hbWU=", "text": "\ufffdname"} in doc["changes"]["added"]
    assert "link" in doc["changes"]["added"]
    record = _strict(rec.read_bytes())
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(record, json.loads((REPO / "docs" / "record-schema.json").read_text()))
    entries = {json.dumps(e["path"], sort_keys=True): e for e in record["workspace"]["after"]}
    odd = entries[json.dumps({"b64": "/25hbWU=", "text": "\ufffdname"}, sort_keys=True)]
    assert odd["kind"] == "file" and odd["sha256"] is not None
    assert entries['"link"']["link"] == {"b64": "/i10YXJnZXQ=", "text": "\ufffd-target"}
    assert sorted(os.listdir(out)) == ["run.json"], "a temp file was left, or the record is missing"


def test_replay_restores_names_that_are_not_utf8(shared: Path) -> None:
    inputs = shared / "in"
    inputs.mkdir(mode=0o755)
    (inputs / os.fsdecode(b"\xff-input")).write_bytes(b"payload")
    os.symlink(os.fsdecode(b"\xfe-dangling"), inputs / os.fsdecode(b"\xfd-link"))
    rec = shared / "run.json"
    r = lowlevel.run(["python3", "-c", "import os, sys; d = b'in'; names = sorted(os.listdir(d)); "
                      "sys.stdout.buffer.write(repr([(n, os.readlink(d + b'/' + n) if os.path.islink(d + b'/' + n) "
                      "else open(d + b'/' + n, 'rb').read()) for n in names]).encode())", os.fsdecode(b"\xfc-arg")],
                     inputs=[inputs], record=str(rec), workspace_base=str(shared / "ws"))
    assert r.exit_code == 0, r.stderr
    assert b"\\xff-input" in r.stdout and b"\\xfe-dangling" in r.stdout
    doc = _strict(rec.read_bytes())
    assert doc["command"][-1] == {"b64": base64.b64encode(b"\xfc-arg").decode(), "text": "\ufffd-arg"}
    report = replay(rec, workspace_base=str(shared / "ws"))
    assert report.matched, report.differences
    assert report.result is not None and report.result.stdout == r.stdout
