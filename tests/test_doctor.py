"""`lowlevel doctor --json`: what it finds here, and a verdict that matches what `run` does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)


def _doctor(env_path: str | None) -> tuple[int, dict[str, Any]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if env_path is not None:
        env["PATH"] = env_path
    proc = subprocess.run([sys.executable, "-m", "lowlevel", "doctor", "--json"], env=env,
                          capture_output=True, text=True, timeout=100)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.bwrap
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap on PATH: apt-get install bubblewrap")
def test_doctor_json_lists_what_it_found() -> None:
    rc, report = _doctor(None)
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("bwrap", "bwrap setuid", "--disable-userns", "pidfd", "unprivileged userns", "native extension",
                 "seccomp", "cgroups", "sandbox runs"):
        assert name in checks, name
    for c in report["checks"]:
        assert set(c) == {"name", "ok", "required", "detail", "fix"}
        assert c["ok"] or c["fix"] or not c["required"], c
    assert checks["bwrap"]["ok"] and "0." in checks["bwrap"]["detail"]
    assert report["ok"] is (rc == 0)
    assert report["ok"] == all(c["ok"] for c in report["checks"] if c["required"])


def test_doctor_agrees_with_run_when_bwrap_is_hidden_from_path(tmp_path: Any) -> None:
    """Issue 10 item 4: doctor said NO while `run` worked through the /usr/bin/bwrap fallback.
    Its verdict must be what `run` does with the same PATH; the PATH problem is a warning."""
    import tempfile
    rc, report = _doctor(str(tmp_path))
    base = tempfile.mkdtemp(prefix="lowlevel-doctor-")  # world-traversable: the sandbox's uid reaches it
    os.chmod(base, 0o711)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PATH": str(tmp_path),
           "LOWLEVEL_WORKSPACE_BASE": base}
    try:
        run = subprocess.run([sys.executable, "-m", "lowlevel", "run", "--rm", "--", "/usr/bin/true"], env=env,
                             capture_output=True, text=True, timeout=100)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert report["ok"] is (run.returncode == 0), (report, run.stderr)
    assert (rc == 0) is report["ok"]
    checks = {c["name"]: c for c in report["checks"]}
    if os.access("/usr/bin/bwrap", os.X_OK):
        assert checks["bwrap"]["ok"] is True and "fallback" in checks["bwrap"]["detail"]
        assert checks["bwrap on PATH"]["ok"] is False and checks["bwrap on PATH"]["required"] is False
        assert checks["sandbox runs"]["ok"] is True
    else:
        assert checks["bwrap"]["ok"] is False and "bubblewrap" in checks["bwrap"]["fix"]
