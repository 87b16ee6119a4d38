"""Per-call limits in Session and Pool are enforced or refused, never ignored, and the same
program gets the same verdict from ``run``, ``Session`` and ``Pool`` (issue 12, item 6).

Root callers get cgroups here: a Pool rewrites its sandbox's cgroup for the call; a Session,
whose cgroup all commands share, refuses a per-call memory limit with PolicyError. An
unprivileged caller has no cgroup: the per-call limit is the ``RLIMIT_DATA`` fallback, per
command, in all three. Each API runs in a child process (``tests/helpers/api_outcomes.py``), as
root and as the unprivileged test user.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.identities import setpriv

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tests" / "helpers" / "api_outcomes.py"
IS_ROOT = os.geteuid() == 0
MiB = 1 << 20

#: A child of the program is OOM-killed (or fails to allocate); the program itself exits 0.
CHILD_OOM = ["sh", "-c", "python3 -c 'b = bytearray(300 << 20); print(len(b))'; echo child=$?"]
#: The program itself allocates and touches 300 MiB.
SELF_300M = ["python3", "-c", "b = bytearray(300 << 20); print('used', len(b) >> 20)"]


def verdicts(who: pwd.struct_passwd | None, spec: dict[str, Any]) -> dict[str, Any]:
    """The helper's outcomes of ``run``, ``Session`` and ``Pool`` (60 s per command; the run commits)."""
    spec = {"apis": ["run", "session", "pool"], "timeout": 60, "commit": True, **spec}
    cmd = setpriv(who, [sys.executable, str(HELPER), json.dumps(spec)])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    if who is not None:
        env["HOME"] = who.pw_dir
    proc = subprocess.run(cmd, capture_output=True, env=env, cwd="/", timeout=200)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_child_oom_gets_the_same_verdict_everywhere(who: pwd.struct_passwd | None) -> None:
    out = verdicts(who, {"command": CHILD_OOM, "limits": {"memory_bytes": 64 * MiB}})
    for api in ("run", "session", "pool"):
        assert "error" not in out[api], out[api]
        assert out[api]["exit_code"] == 0, out
        assert "child=0" not in out[api]["stdout"], out  # the allocation never succeeded
    verdict = {api: (out[api]["killed_by"], bool(out[api]["oom_kills"])) for api in ("run", "session", "pool")}
    if who is None and IS_ROOT:
        assert verdict == {api: ("memory", True) for api in verdict}, out
    else:
        assert verdict == {api: (None, False) for api in verdict}, out
        assert all(any("RLIMIT_DATA" in n for n in out[api]["notes"]) for api in verdict), out


def test_per_call_memory_limit_is_enforced_or_refused(who: pwd.struct_passwd | None) -> None:
    out = verdicts(who, {"command": SELF_300M, "limits": {}, "call_limits": {"memory_bytes": 64 * MiB}})
    for api in ("run", "pool"):  # enforced: the program never gets its 300 MiB
        assert "error" not in out[api], out[api]
        assert "used 300" not in out[api]["stdout"] and out[api]["exit_code"] != 0, out[api]
        if who is None and IS_ROOT:
            assert out[api]["killed_by"] == "memory" and "cgroup:memory" in out[api]["limits_enforced"], out[api]
        else:
            assert "MemoryError" in out[api]["stderr"] and "RLIMIT_DATA" in out[api]["limits_enforced"], out[api]
    if who is None and IS_ROOT:  # the session's cgroup is shared: refused, not ignored
        assert out["session"]["error"] == "PolicyError" and "memory_bytes" in out["session"]["message"], out
    else:  # no cgroup: RLIMIT_DATA per command
        assert "MemoryError" in out["session"]["stderr"], out["session"]


def test_control_without_per_call_limit_the_program_gets_its_memory(who: pwd.struct_passwd | None) -> None:
    out = verdicts(who, {"command": SELF_300M, "limits": {}})
    for api in ("run", "session", "pool"):
        assert out[api]["exit_code"] == 0 and "used 300" in out[api]["stdout"], out[api]


def test_session_refuses_per_call_mount_limits() -> None:
    import lowlevel
    with lowlevel.Session() as s:
        with pytest.raises(lowlevel.PolicyError, match="tmp_size_bytes"):
            s.run(["true"], limits=lowlevel.Limits(tmp_size_bytes=1 * MiB))
        assert s.run(["true"], limits=lowlevel.Limits(nofile=64)).exit_code == 0
