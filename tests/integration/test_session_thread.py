"""Issue 10 item 5: a Session created in a thread that then exits.

bwrap's ``--die-with-parent`` is PR_SET_PDEATHSIG, which fires when the *thread* that spawned
bwrap exits. A Session made in a worker thread died with it while ``alive`` still said True, and
the first ``run`` blamed "a command". The Session now starts bwrap from a thread that lives as
long as the process, so it keeps working; checked as root and as the unprivileged test user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"

SCRIPT = r"""
import json, shutil, threading, time
import lowlevel
box = {}
def make():
    box["s"] = lowlevel.Session()
t = threading.Thread(target=make)
t.start()
t.join()
time.sleep(0.5)  # PDEATHSIG had time to fire, had it been armed on the dead thread
s = box["s"]
out = {"alive_before": s.alive}
try:
    r = s.run(["sh", "-c", "echo hi"], timeout=20)
    out.update(exit_code=r.exit_code, stdout=r.stdout.decode())
except lowlevel.LowlevelError as err:
    out.update(error=type(err).__name__, message=str(err))
out["alive_after"] = s.alive
ws = s.workspace
s.close()
shutil.rmtree(ws, ignore_errors=True)
print(json.dumps(out))
"""


@pytest.mark.parametrize("identity", ["root", "user"] if os.geteuid() == 0 else ["self"])
def test_session_outlives_the_thread_that_created_it(identity: str, request: pytest.FixtureRequest) -> None:
    pythonpath = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
    cmd = [sys.executable, "-c", SCRIPT]
    if identity == "user":
        user = request.getfixturevalue("test_user")
        cmd = [RUNUSER, "-u", user.pw_name, "--", "env", f"PYTHONPATH={pythonpath}", "PATH=/usr/bin:/bin", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd="/",
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath})
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out == {"alive_before": True, "exit_code": 0, "stdout": "hi\n", "alive_after": True}, out
