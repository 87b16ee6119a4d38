"""Every adapter also works, and still blocks the attacks, when an unprivileged user runs it.

bwrap behaves differently for a non-root caller (it maps the caller's own uid; no cgroup is
writable, so limits fall back to rlimits). ``tests/helpers/integrations_as_user.py`` drives
each adapter once as the ``lowlevel-test`` user; the secret belongs to that user and the
control shows the user can read it on the host.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.identities import last_json_line, planted_key, runuser, user_env

for _module in ("inspect_ai", "autogen_core", "smolagents", "langchain_core"):
    pytest.importorskip(_module, reason="needs every framework extra (pip install '.[integrations]' in the lowlevel checkout)")

pytestmark = [pytest.mark.bwrap, pytest.mark.root, pytest.mark.timeout(300)]
HELPER = Path(__file__).resolve().parents[1] / "helpers" / "integrations_as_user.py"


def test_adapters_as_unprivileged_user(test_user: Any, server: Any) -> None:
    with planted_key(test_user, "ll-integ-user-") as (key, secret):
        env = user_env(test_user)
        control = subprocess.run(runuser(test_user, ["cat", str(key)]), capture_output=True, text=True, env=env,
                                 cwd="/")
        assert control.stdout == secret  # the user can read it on the host
        before = server.accepted
        proc = subprocess.run(runuser(test_user, [sys.executable, str(HELPER)]),
                              input=json.dumps({"secret_path": str(key), "port": server.port}), capture_output=True,
                              text=True, timeout=240, env=env, cwd="/")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = last_json_line(proc)
        assert set(out) == {"inspect", "autogen", "smolagents", "langchain"}
        for name, (benign, attack, *rest) in out.items():
            assert f"uid {test_user.pw_uid} /workspace" in benign, (name, benign)
            assert "blocked-read" in attack and "blocked-net" in attack, (name, attack)
            assert secret not in attack and "connected" not in attack, (name, attack)
            assert all(rest), (name, rest)
        assert server.accepted == before
