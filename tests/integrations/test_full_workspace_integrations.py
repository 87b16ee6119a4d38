"""The adapters with a full workspace, a memory kill and bad input (issue 25 items 1 and 2).

``tests/helpers/full_workspace_integrations.py`` drives LangChain's tool and Inspect's sandbox
once as root and once as the unprivileged user (setpriv): with the default limits a write past
the workspace bound is ENOSPC (write_file raises the OSError, dd says so) and the sample lives
on; under ``memory_bytes="256M"`` (root: memory cgroup) write_file is an ENOMEM naming the
memory limit and the tmpfs bounds, and later execs are results, never SandboxUnavailableError
(was: the init died and every later exec raised it); a missing program reads "nosuchprog: command
not found in the sandbox (PATH=...)" once; a bind in the Inspect TOML that does not exist is
one PolicyError line naming the file and the entry.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from helpers.identities import setpriv

for _module in ("inspect_ai", "langchain_core"):
    pytest.importorskip(_module, reason="needs the inspect and langchain extras (pip install '.[integrations]')")

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tests" / "helpers" / "full_workspace_integrations.py"
IS_ROOT = os.geteuid() == 0
MISSING = "nosuchprog: command not found in the sandbox (PATH="


@pytest.fixture(params=["root", "user"] if IS_ROOT else ["self"], scope="module")
def outcome(request: pytest.FixtureRequest) -> dict[str, Any]:
    who: pwd.struct_passwd | None = None
    if request.param == "user":
        try:
            who = pwd.getpwnam("lowlevel-test")
        except KeyError:
            pytest.skip("no lowlevel-test user")
    tmp = tempfile.mkdtemp(prefix="ll-full-ws-integ-")
    os.chmod(tmp, 0o755)
    cmd = [sys.executable, str(HELPER), tmp]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8",
           "TMPDIR": "/tmp"}
    if who is not None:
        os.chown(tmp, who.pw_uid, who.pw_gid)
        env["HOME"] = who.pw_dir
        cmd = setpriv(who, cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, env=env, cwd="/", timeout=280)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    out["identity"] = request.param
    return out


def test_langchain_missing_program_is_one_line_with_path(outcome: dict[str, Any]) -> None:
    for key in ("run_missing", "session_missing"):
        text = outcome["langchain"][key]
        assert text.startswith("exit code: 127\n"), text
        assert text.count("nosuchprog") == 1 and MISSING in text, text   # was "nosuchprog: nosuchprog: ..."


def test_langchain_full_workspace_is_enospc(outcome: dict[str, Any]) -> None:
    text = outcome["langchain"]["session_fill"]
    assert text.startswith("exit code: 1\n") and "No space left on device" in text, text


def test_inspect_full_workspace_is_enospc_and_the_sample_lives_on(outcome: dict[str, Any]) -> None:
    d = outcome["inspect_default"]
    assert d["write_file"]["errno"] == outcome["ENOSPC"], d
    assert d["dd"]["returncode"] == 0 and d["dd"]["stdout"] == "rc=1\n", d
    assert "No space left on device" in d["dd"]["stderr"], d
    assert d["after"] == {"returncode": 0, "stdout": "alive\n"}, d


def test_inspect_memory_limit_below_the_bounds_is_a_verdict_not_a_dead_sandbox(outcome: dict[str, Any]) -> None:
    d = outcome["inspect_small"]
    # Every exec gave a result (a SandboxUnavailableError would have failed the helper).
    assert isinstance(d["dd"]["returncode"], int) and isinstance(d["after"]["returncode"], int), d
    if outcome["identity"] == "user":
        # No memory cgroup: 400 MiB fit in the 1 GiB workspace; RLIMIT_DATA bounds the heap only.
        assert d["write_file"] == {"ok": True} and d["dd"]["stdout"] == "rc=0\n", d
        return
    w = d["write_file"]
    assert w["errno"] == outcome["ENOMEM"], d   # was ENOLCK: exit 137 read as 100 + errno
    assert "killed by the memory limit" in w["message"] and f"memory_bytes={256 << 20}" in w["message"], w


def test_inspect_toml_bind_that_does_not_exist_names_the_file(outcome: dict[str, Any]) -> None:
    d = outcome["inspect_bad_toml"]
    assert d["error"] == "PolicyError", d
    msg = d["message"]
    assert "\n" not in msg and msg.startswith(f"{outcome['toml']}: binds[0]: "), msg
    assert "/nonexistent/data/dir" in msg and "does not exist" in msg, msg
    assert not d["chained"], d   # one error, not a chain of tracebacks
