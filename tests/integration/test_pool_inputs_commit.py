"""Pool.run(inputs=...): a program that changes or deletes one of its inputs gets its Result.

The inputs are copied into the pooled sandbox's fresh workspace (the overlay's lower layer)
when the call comes, after the sandbox started; its commit then took them for host changes
made during the run and refused with CommitConflictError: every modified input for an
unprivileged caller (its userxattr overlay records no origin), a deleted one for root.
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
from lowlevel.session import Pool
d = sys.argv[1]
out = []
with Pool(size=1, workspace_base=os.path.join(d, "base")) as p:
    for prog in ("echo more >> in.txt", "rm in.txt", "echo new > in.txt"):
        try:
            r = p.run(["sh", "-c", prog], inputs=[os.path.join(d, "in.txt")])
            path = os.path.join(r.workspace, "in.txt")
            out.append([r.exit_code, open(path).read() if os.path.exists(path) else None])
        except Exception as err:
            out.append([type(err).__name__, str(err)[:200]])
print(json.dumps(out))
"""


@pytest.mark.parametrize("identity", ["root", "user"])
def test_pool_call_may_change_its_inputs(identity: str, request: pytest.FixtureRequest) -> None:
    d = tempfile.mkdtemp(prefix="rt-pool-", dir="/tmp")
    try:
        with open(os.path.join(d, "in.txt"), "w") as f:
            f.write("input\n")
        os.chmod(d, 0o755)
        os.chmod(os.path.join(d, "in.txt"), 0o644)
        prefix = identity_prefix(identity, request, d)
        proc = subprocess.run([*prefix, sys.executable, "-c", SCRIPT, d], capture_output=True, text=True,
                              cwd="/", timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.splitlines()[-1]) == [[0, "input\nmore\n"], [0, None], [0, "new\n"]]
        assert "commit refused" not in proc.stderr, proc.stderr[-2000:]
    finally:
        shutil.rmtree(d, ignore_errors=True)
