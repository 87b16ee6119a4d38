"""The core package never imports an optional framework (issue 18: extras stay optional)."""

from __future__ import annotations

import json
import subprocess
import sys

FRAMEWORKS = ("inspect_ai", "autogen_core", "smolagents", "langchain_core", "pydantic", "anyio")


def _imported_after(code: str) -> list[str]:
    probe = (f"{code}\nimport sys, json\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(FRAMEWORKS)!r}))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return list(json.loads(out.stdout))


def test_import_lowlevel_imports_no_framework() -> None:
    assert _imported_after("import lowlevel") == []


def test_public_api_and_cli_import_no_framework() -> None:
    code = ("import lowlevel, lowlevel.cli, lowlevel.workspace, lowlevel.integrations, lowlevel.integrations._config\n"
            "lowlevel.Session, lowlevel.AsyncSession, lowlevel.Pool, lowlevel.arun")
    assert _imported_after(code) == []


def test_config_loader_without_any_framework(tmp_path) -> None:
    from lowlevel.integrations._config import SandboxConfig

    path = tmp_path / "ll.toml"
    path.write_text('network = false\ndefault_timeout_s = 5\n[env]\nA = "1"\n'
                    '[limits]\nmemory_bytes = "256M"\npids = 64\nrequire = ["memory"]\n')
    cfg = SandboxConfig.from_toml(path)
    assert cfg.policy.limits.memory_bytes == 256 << 20 and cfg.policy.limits.require == ("memory",)
    assert dict(cfg.policy.env)["A"] == "1" and cfg.default_timeout_s == 5


def test_config_errors_name_the_key(tmp_path) -> None:
    import pytest

    import lowlevel
    from lowlevel.integrations._config import SandboxConfig

    cases = [
        ({"limits": {"memory_bytes": "lots"}}, "limits.memory_bytes: invalid size 'lots'"),
        ({"limits": {"memory": 5}}, "unknown [limits] keys ['memory']"),
        ({"binds": [{"source": "/usr/share", "ro": True}]}, "unknown [[binds]] keys ['ro']"),
        ({"workspace_base": "relative/dir"}, "workspace_base must be an absolute path"),
        ({"default_timeout_s": 0}, "default_timeout_s must be a number of seconds > 0"),
        ({"netwrok": True}, "unknown keys ['netwrok']"),
        ({"env": ["A=1"]}, "env must be a table"),
    ]
    for data, message in cases:
        with pytest.raises(lowlevel.PolicyError) as info:
            SandboxConfig.from_mapping(data, where="test.toml")
        assert message in str(info.value) and "test.toml" in str(info.value), (data, str(info.value))
    import os
    with pytest.raises(lowlevel.PolicyError, match="home"):  # the Policy's own refusal, kept
        SandboxConfig.from_mapping({"binds": [{"source": os.path.expanduser("~")}]})
    bad = tmp_path / "bad.toml"
    bad.write_text("network = [")
    with pytest.raises(lowlevel.PolicyError, match="not valid TOML"):
        SandboxConfig.from_toml(bad)
    with pytest.raises(lowlevel.PolicyError, match="cannot read"):
        SandboxConfig.from_toml(tmp_path / "missing.toml")
    ok = SandboxConfig.from_mapping({"binds": [{"source": "/usr/share", "dest": "/data"}], "stdout_limit_bytes": "1M"})
    assert ok.policy.binds[0].dest == "/data" and ok.policy.stdout_limit_bytes == 1 << 20
