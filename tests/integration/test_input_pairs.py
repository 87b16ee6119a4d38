"""``inputs`` take paths or ``(path, dest)`` pairs (README, "Python API"): ``run``, ``arun``,
``Pool.run`` and ``Session`` copy a pair's file to ``dest`` relative to the workspace.

A pair used to be refused by the argument check (``PolicyError: inputs[0] must be a str, got
tuple``) although ``copy_inputs`` and the CLI's ``--input PATH:DEST`` handle it. A malformed
pair is still a ``PolicyError`` naming it. As root and as the unprivileged test user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = [pytest.mark.bwrap]

SCRIPT = """
import asyncio, json, os, sys
import lowlevel
d = sys.argv[1]
src = os.path.join(d, "a.py")
out = {}
cat = ["cat", "pkg/b.py"]
r = lowlevel.run(cat, inputs=[(src, "pkg/b.py"), src], workspace_base=d, keep_workspace=False)
out["run"] = [r.exit_code, r.stdout.decode()]
r = asyncio.run(lowlevel.arun(cat, inputs=[(src, "pkg/b.py")], workspace_base=d, keep_workspace=False))
out["arun"] = [r.exit_code, r.stdout.decode()]
with lowlevel.Pool(size=1, workspace_base=d) as p:
    r = p.run(cat, inputs=[(src, "pkg/b.py")])
    out["pool"] = [r.exit_code, r.stdout.decode()]
with lowlevel.Session(inputs=[(src, "pkg/b.py")], workspace_base=d) as s:
    r = s.run(cat)
    out["session"] = [r.exit_code, r.stdout.decode()]
for bad in [(src,), (src, "x", "y"), (src, 3)]:
    try:
        lowlevel.run(["true"], inputs=[bad], workspace_base=d)
        out.setdefault("bad", []).append("accepted")
    except lowlevel.PolicyError as err:
        out.setdefault("bad", []).append(str(err)[:40])
print(json.dumps(out))
"""


@pytest.mark.parametrize("identity", ["root", "user"])
def test_input_pairs_go_to_their_dest(identity: str, request: pytest.FixtureRequest) -> None:
    prefix: list[str] = []
    if os.geteuid() != 0:
        pytest.skip("needs root (to run both identities)")
    d = tempfile.mkdtemp(prefix="input-pairs-", dir="/tmp")
    try:
        with open(os.path.join(d, "a.py"), "w") as f:
            f.write("print(1)\n")
        os.chmod(d, 0o755)
        os.chmod(os.path.join(d, "a.py"), 0o644)
        if identity == "user":
            user = request.getfixturevalue("test_user")
            os.chown(d, user.pw_uid, user.pw_gid)
            prefix = [shutil.which("runuser") or "/usr/sbin/runuser", "-u", user.pw_name, "--"]
        proc = subprocess.run([*prefix, sys.executable, "-c", SCRIPT, d], capture_output=True, text=True,
                              cwd="/", timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.splitlines()[-1])
        for how in ("run", "arun", "pool", "session"):
            assert out[how] == [0, "print(1)\n"], (how, out)
        assert out["bad"] == ["inputs[0] must be a path or a (path, des"] * 2 + ["inputs[0][1] must be a str, got int: 3"]
    finally:
        shutil.rmtree(d, ignore_errors=True)
