"""docs/mcp.md stays ready to paste (issue 25 item 5): its JSON client configs parse and start
``lowlevel mcp`` with options the CLI takes, its operator TOML loads as a ServerConfig, and its
Inspect example imports and builds the MCP tool source."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from lowlevel import cli
from lowlevel.mcp_server import ServerConfig

DOC = (Path(__file__).resolve().parents[2] / "docs" / "mcp.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, re.S)


def test_client_json_configs_parse_and_start_lowlevel_mcp() -> None:
    blocks = _blocks("json")
    assert len(blocks) >= 2  # Claude Desktop, Cursor
    for block in blocks:
        server = json.loads(block)["mcpServers"]["lowlevel"]
        assert server["command"].endswith("/lowlevel") and server["args"][0] == "mcp"
        args = cli.build_parser("mcp").parse_args(server["args"])
        assert args.config == "/etc/lowlevel/mcp.toml"
    claude_code = next(line for line in _blocks("sh")[0].splitlines() if line.startswith("claude mcp add"))
    argv = shlex.split(claude_code)
    cli.build_parser("mcp").parse_args(argv[argv.index("--") + 2:])


def test_operator_toml_loads(tmp_path: Path) -> None:
    toml = tmp_path / "mcp.toml"
    toml.write_text(_blocks("toml")[0].replace("/var/lib/lowlevel-mcp", str(tmp_path / "ws")))
    config = ServerConfig.from_toml(str(toml))
    assert config.max_timeout_s == 300.0 and config.default_timeout_s == 30.0
    assert config.max_output_bytes == 64 * 1024 and config.limits.memory_bytes == 1 << 30
    assert config.limits.cpu_s == 120.0 and config.limits.pids == 128


def test_inspect_example_builds() -> None:
    pytest.importorskip("inspect_ai")
    pytest.importorskip("mcp")
    code = _blocks("python")[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/mcp.md", "exec"), namespace)  # noqa: S102 - our own doc
    assert callable(namespace["sandboxed_python"]) and namespace["lowlevel_mcp"] is not None
