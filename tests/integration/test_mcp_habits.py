"""`lowlevel mcp` and what MCP clients expect (issue 25 item 5):

- one size syntax everywhere: the MCP config takes ``"128M"`` as the CLI and the Inspect config
  do (and ``"30s"``/``"2m"`` for its seconds), refusing a bad one with a line naming the key;
- ``notifications/progress`` while ``run``/``run_in_session`` work, for a client that asked
  for them with a progress token (start, every few seconds, end), over the SDK's stdio
  client, the server running as root and as the unprivileged test user; no ``ctx``
  parameter leaks into the published schema or the accepted arguments.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")

from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

from lowlevel.cli.args import parse_size  # noqa: E402
from lowlevel.errors import PolicyError  # noqa: E402
from lowlevel.mcp_server import PROGRESS_INTERVAL_S, ServerConfig  # noqa: E402
from helpers.identities import tmpdir_fixture  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"


# --- one size syntax -----------------------------------------------------------------------------

def test_mcp_config_takes_the_cli_and_inspect_size_syntax(tmp_path: Path) -> None:
    config = ServerConfig.from_mapping({
        "workspace_base": str(tmp_path / "ws"), "max_output_bytes": "64K", "max_file_bytes": "1.5M",
        "default_timeout_s": "30s", "max_timeout_s": "2m",
        "limits": {"memory_bytes": "128M", "tmp_size_bytes": "64MiB", "fsize_bytes": 1 << 20, "cpu_s": "1m",
                   "pids": 64}})
    assert config.max_output_bytes == 64 * 1024 == parse_size("64K")
    assert config.max_file_bytes == 1536 * 1024
    assert config.limits.memory_bytes == 128 * 1024 * 1024 == parse_size("128M")
    assert config.limits.tmp_size_bytes == 64 * 1024 * 1024 and config.limits.fsize_bytes == 1 << 20
    assert config.limits.cpu_s == 60.0 and config.default_timeout_s == 30.0 and config.max_timeout_s == 120.0
    from lowlevel.integrations._config import SandboxConfig

    for text in ("128M", "64K", "2G", "1.5M", "512", "64MiB", "8 kb"):
        mcp = ServerConfig.from_mapping({"workspace_base": str(tmp_path / "ws"), "max_file_bytes": text})
        inspect = SandboxConfig.from_mapping({"limits": {"net_bytes": text}}).policy.limits.net_bytes
        assert inspect == parse_size(text) == mcp.max_file_bytes, text


@pytest.mark.parametrize(("mapping", "named"), [
    ({"limits": {"memory_bytes": "128Q"}}, "[limits] memory_bytes"),
    ({"limits": {"memory_bytes": "1.5"}}, "[limits] memory_bytes"),
    ({"max_output_bytes": "lots"}, "max_output_bytes"),
    ({"max_timeout_s": "2 minutes"}, "max_timeout_s"),
    ({"limits": {"cpu_s": "10x"}}, "[limits] cpu_s")])
def test_mcp_config_bad_size_names_the_key(tmp_path: Path, mapping: dict[str, Any], named: str) -> None:
    with pytest.raises(PolicyError, match=named.replace("[", r"\[").replace("]", r"\]")):
        ServerConfig.from_mapping({"workspace_base": str(tmp_path / "ws"), **mapping})


def test_mcp_cli_bad_config_size_is_one_line(tmp_path: Path) -> None:
    toml = tmp_path / "mcp.toml"
    toml.write_text('[limits]\nmemory_bytes = "128Q"\n')
    proc = subprocess.run([sys.executable, "-m", "lowlevel", "mcp", "--config", str(toml)], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 125
    assert proc.stderr.count("\n") == 1 and "[limits] memory_bytes" in proc.stderr and "256M" in proc.stderr


# --- progress notifications ----------------------------------------------------------------------

base = tmpdir_fixture("lowlevel-mcp-habits-", owned=True)


def _server(who: pwd.struct_passwd | None, base: Path) -> Any:
    args = ["-m", "lowlevel", "mcp", "--workspace-base", str(base / "ws"), "--no-network", "--max-timeout", "30s"]
    command = sys.executable
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), "PATH": "/usr/bin:/bin"}
    if who is not None:
        args = [f"--reuid={who.pw_uid}", f"--regid={who.pw_gid}", "--init-groups", "--", sys.executable, *args]
        command = SETPRIV
        env["HOME"] = who.pw_dir
    return stdio_client(StdioServerParameters(command=command, args=args, env=env))


@pytest.mark.slow
def test_mcp_progress_notifications_for_long_runs(who: pwd.struct_passwd | None, base: Path) -> None:
    seen: dict[str, list[tuple[float, float | None, str | None]]] = {"run": [], "session": [], "none": []}

    async def main() -> None:
        async with _server(who, base) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()

                async def on_run(progress: float, total: float | None, message: str | None) -> None:
                    seen["run"].append((progress, total, message))

                async def on_session(progress: float, total: float | None, message: str | None) -> None:
                    seen["session"].append((progress, total, message))

                # Longer than one interval: at least one "running" notification between the two ends.
                res = await session.call_tool("run", {"command": ["sleep", str(PROGRESS_INTERVAL_S + 1)]},
                                              progress_callback=on_run)
                assert not res.is_error, res.content
                res = await session.call_tool("run_in_session", {"session": "s1", "command": ["echo", "hi"]},
                                              progress_callback=on_session)
                assert not res.is_error, res.content
                # Without a progress token: no notifications, same result.
                res = await session.call_tool("run", {"command": ["echo", "hi"]})
                assert not res.is_error
                # The injected context is no tool argument: refused like any unknown one, and unpublished.
                res = await session.call_tool("run", {"command": ["true"], "ctx": 1})
                assert res.is_error and "takes no argument 'ctx'" in " ".join(getattr(c, "text", "")
                                                                               for c in res.content)
                tools = await session.list_tools()
                for tool in tools.tools:
                    assert "ctx" not in tool.input_schema.get("properties", {}), tool.name

    anyio.run(main)
    run = seen["run"]
    assert run[0][2] == "started" and run[-1][2] == "finished", run
    assert any(m is not None and m.startswith("running for ") for _p, _t, m in run[1:-1]), run
    assert [p for p, _t, _m in run] == sorted(p for p, _t, _m in run)
    assert run[-1][0] >= PROGRESS_INTERVAL_S  # elapsed seconds: the run slept longer than that
    assert [m for _p, _t, m in seen["session"]][0] == "started"
    assert [m for _p, _t, m in seen["session"]][-1] == "finished"
