"""``keep_workspace=False`` for a Session and a Pool, as for :func:`lowlevel.run`: a fresh
workspace per sandbox piled up in the workspace base (a new user's loop of 260 Pool calls left
260 directories, and ``Pool.run(keep_workspace=False)`` was a TypeError). Now the session's
workspace goes at close, a pool call's when its sandbox is torn down, each named ``rm-...``
meanwhile; the default keeps them (the control). Root and unprivileged.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from helpers.identities import identity_prefix

pytestmark = [pytest.mark.bwrap]

SCRIPT = """
import json, os, sys
from lowlevel.session import Pool, Session
from lowlevel.errors import PolicyError
base, keep = sys.argv[1], sys.argv[2] == "keep"
out = {}
with Session(workspace_base=base, keep_workspace=keep) as s:
    s.run(["sh", "-c", "echo s > made.txt"])
    out["session_name"] = os.path.basename(s.directory)[:3]
    session_dir = s.directory
out["session_left"] = os.path.isdir(session_dir)
with Pool(size=1, workspace_base=base, keep_workspace=keep) as p:
    r = p.run(["sh", "-c", "echo p > made.txt"])
    out["pool_changes"] = list(r.changes.added)
    out["pool_note"] = any("keep_workspace=False" in n for n in r.notes)
    out["pool_name"] = os.path.basename(r.workspace)[:3]
    pool_dir = r.workspace
out["pool_left"] = os.path.isdir(pool_dir)
out["pool_file"] = os.path.exists(os.path.join(pool_dir, "made.txt"))
out["base_left"] = sorted(n[:3] for n in os.listdir(base) if not n.startswith("."))  # .mnt: the overlay mount dir
try:
    Session(workspace=base, keep_workspace=False)
except PolicyError as err:
    out["refused"] = "never deletes" in str(err) or "does not go with" in str(err)
print(json.dumps(out))
"""


@pytest.mark.parametrize("keep", ["keep", "drop"])
@pytest.mark.parametrize("identity", ["root", "user"])
def test_session_and_pool_keep_workspace(identity: str, keep: str, request: pytest.FixtureRequest) -> None:
    d = tempfile.mkdtemp(prefix="rt-keepws-", dir="/tmp")
    try:
        os.chmod(d, 0o755)
        prefix = identity_prefix(identity, request, d)
        proc = subprocess.run([*prefix, sys.executable, "-c", SCRIPT, d, keep], capture_output=True, text=True,
                              cwd="/", timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.splitlines()[-1])
        assert out["pool_changes"] == ["made.txt"] and out["refused"] is True, out
        if keep == "keep":  # the control: both kept, the pool call's change committed
            assert out["session_name"] == out["pool_name"] == "run", out
            assert out["session_left"] and out["pool_left"] and out["pool_file"] and not out["pool_note"], out
            assert out["base_left"] == ["run", "run"], out
        else:
            assert out["session_name"] == out["pool_name"] == "rm-", out
            assert not out["session_left"] and not out["pool_left"] and out["pool_note"], out
            assert out["base_left"] == [], out
    finally:
        shutil.rmtree(d, ignore_errors=True)
