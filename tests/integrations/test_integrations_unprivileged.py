"""Every adapter also works, and still blocks the attacks, when an unprivileged user runs it.

bwrap behaves differently for a non-root caller (it maps the caller's own uid; no cgroup is
writable, so limits fall back to rlimits). ``tests/helpers/integrations_as_user.py`` drives
each adapter once as the ``lowlevel-test`` user; the secret belongs to that user and the
control shows the user can read it on the host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

for _module in ("inspect_ai", "autogen_core", "smolagents", "langchain_core"):
    pytest.importorskip(_module, reason="needs every framework extra (pip install '.[integrations]' in the lowlevel checkout)")

pytestmark = [pytest.mark.bwrap, pytest.mark.root, pytest.mark.timeout(300)]
HELPER = Path(__file__).resolve().parents[1] / "helpers" / "integrations_as_user.py"
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"


def test_adapters_as_unprivileged_user(test_user: Any, server: Any) -> None:
    base = Path(tempfile.mkdtemp(prefix="ll-integ-user-", dir="/tmp"))
    try:
        base.chmod(0o755)
        secret = "SECRET-" + secrets.token_hex(8)
        key = base / "id_ed25519"
        key.write_text(secret)
        os.chown(key, test_user.pw_uid, test_user.pw_gid)
        key.chmod(0o600)
        env = {"PATH": "/usr/bin:/bin", "HOME": test_user.pw_dir, "LANG": "C.UTF-8"}
        control = subprocess.run([RUNUSER, "-u", test_user.pw_name, "--", "cat", str(key)], capture_output=True,
                                 text=True, env=env, cwd="/")
        assert control.stdout == secret  # the user can read it on the host
        before = server.accepted
        proc = subprocess.run([RUNUSER, "-u", test_user.pw_name, "--", sys.executable, str(HELPER)],
                              input=json.dumps({"secret_path": str(key), "port": server.port}), capture_output=True,
                              text=True, timeout=240, env=env, cwd="/")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert set(out) == {"inspect", "autogen", "smolagents", "langchain"}
        for name, (benign, attack, *rest) in out.items():
            assert f"uid {test_user.pw_uid} /workspace" in benign, (name, benign)
            assert "blocked-read" in attack and "blocked-net" in attack, (name, attack)
            assert secret not in attack and "connected" not in attack, (name, attack)
            assert all(rest), (name, rest)
        assert server.accepted == before
    finally:
        shutil.rmtree(base)
