"""`lowlevel doctor --json`: what it finds here, and a non-zero exit when bwrap is hidden."""

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


def test_doctor_exits_nonzero_when_bwrap_is_hidden_from_path(tmp_path: Any) -> None:
    # An empty PATH dir: the doctor honours PATH strictly (no /usr/bin/bwrap fallback).
    rc, report = _doctor(str(tmp_path))
    assert rc == 1 and report["ok"] is False
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["bwrap"]["ok"] is False and checks["bwrap"]["required"] is True
    assert "bubblewrap" in checks["bwrap"]["fix"]
    assert checks["sandbox runs"]["ok"] is False
