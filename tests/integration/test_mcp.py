"""`lowlevel mcp` driven end to end by the SDK's own stdio client."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import pytest

pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")

from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402
from helpers.identities import tmpdir_fixture  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("bwrap") is None and not os.path.exists("/usr/bin/bwrap"),
                                 reason="needs bubblewrap: apt-get install bubblewrap")]


base = tmpdir_fixture("lowlevel-mcp-test-")


def _payload(result: Any) -> dict[str, Any]:
    """The tool result as a dict: structured content if the SDK gives it, else the JSON text."""
    structured = getattr(result, "structured_content", None) or getattr(result, "structuredContent", None)
    if structured:
        return dict(structured.get("result", structured)) if "result" in structured and len(structured) == 1 \
            else dict(structured)
    return dict(json.loads(result.content[0].text))


def _text(result: Any) -> str:
    return " ".join(getattr(c, "text", "") for c in result.content)


async def _session(tmp_path: Any, *extra: str) -> Any:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "lowlevel", "mcp", "--workspace-base", str(tmp_path / "ws"), "--no-network",
              "--max-timeout", "20", *extra],
        env={"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return stdio_client(params)


def test_mcp_client_lists_tools_runs_and_is_refused_widening(base: Any) -> None:
    tmp_path = base
    allowed = tmp_path / "allowed"
    allowed.mkdir(mode=0o755)
    (allowed / "data.txt").write_text("from the operator\n")
    other = tmp_path / "other"
    other.mkdir()

    async def main() -> None:
        async with await _session(tmp_path, "--allow-bind", str(allowed)) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = await session.list_tools()
                names = {t.name for t in tools.tools}
                assert {"run", "run_in_session", "close_session", "write_file", "read_file", "list_files"} <= names
                run_tool = next(t for t in tools.tools if t.name == "run")
                schema = getattr(run_tool, "input_schema", None) or run_tool.inputSchema
                assert {"timeout_s", "memory_bytes", "network", "binds"} <= set(schema["properties"])

                # A command in a fresh sandbox: the Result comes back.
                res = await session.call_tool("run", {"command": ["sh", "-c", "echo hi; echo err >&2; exit 3"]})
                assert not res.is_error if hasattr(res, "is_error") else not res.isError
                out = _payload(res)
                assert out["exit_code"] == 3 and out["stdout"] == "hi\n" and out["stderr"] == "err\n"
                assert out["killed_by"] is None and out["stdout_truncated"] is False

                # Files through a named workspace; a timeout asked above the ceiling is clamped.
                res = await session.call_tool("write_file", {"workspace": "w1", "path": "a/in.txt",
                                                             "content": "abc"})
                assert _payload(res)["bytes"] == 3
                res = await session.call_tool("run", {"command": ["sh", "-c", "tr a-z A-Z < a/in.txt > out.txt"],
                                                      "workspace": "w1", "timeout_s": 999})
                out = _payload(res)
                assert out["exit_code"] == 0 and any("timeout_s" in c for c in out["clamped"])
                assert out["changes"] == {"added": ["out.txt"], "modified": [], "deleted": [], "truncated": False}
                res = await session.call_tool("read_file", {"workspace": "w1", "path": "out.txt"})
                assert _payload(res)["content"] == "ABC"
                res = await session.call_tool("list_files", {"workspace": "w1"})
                assert {"a", "a/in.txt", "out.txt"} <= {e["path"] for e in _payload(res)["entries"]}

                # Timeout: killed_by comes back.
                res = await session.call_tool("run", {"command": ["sleep", "30"], "timeout_s": 0.5})
                assert _payload(res)["killed_by"] == "timeout"
                # Sizes and durations in the CLI's syntax, as in the config file (a pydantic
                # int_parsing error before); a bad one is one line naming the argument.
                res = await session.call_tool("run", {"command": ["sleep", "30"], "timeout_s": "500ms",
                                                      "memory_bytes": "100M", "cpu_s": "1m"})
                assert _payload(res)["killed_by"] == "timeout"
                res = await session.call_tool("run", {"command": ["true"], "memory_bytes": "lots"})
                assert (res.is_error if hasattr(res, "is_error") else res.isError)
                assert "memory_bytes: invalid size 'lots'" in _text(res) and "pydantic" not in _text(res)

                # Widening refused: network, and a bind the operator did not allow.
                res = await session.call_tool("run", {"command": ["true"], "network": True})
                assert (res.is_error if hasattr(res, "is_error") else res.isError)
                assert "network" in _text(res)
                res = await session.call_tool("run", {"command": ["true"], "binds": [str(other)]})
                assert (res.is_error if hasattr(res, "is_error") else res.isError)
                assert "not allowed" in _text(res)
                # ...while the operator's allowed bind works.
                res = await session.call_tool("run", {"command": ["cat", str(allowed / "data.txt")],
                                                      "binds": [str(allowed)]})
                assert _payload(res)["stdout"] == "from the operator\n"

                # A named session: state persists between commands; its workspace is reachable.
                res = await session.call_tool("run_in_session", {"session": "s1", "command": [
                    "sh", "-c", "echo kept > state.txt; echo started"]})
                assert _payload(res)["stdout"] == "started\n"
                res = await session.call_tool("run_in_session", {"session": "s1", "command": ["cat", "state.txt"],
                                                                 "timeout_s": 999})
                out = _payload(res)
                assert out["stdout"] == "kept\n" and out["clamped"]
                res = await session.call_tool("read_file", {"workspace": "s1", "path": "state.txt"})
                assert _payload(res)["content"] == "kept\n"
                res = await session.call_tool("run_in_session", {"session": "s2", "command": ["true"],
                                                                 "network": True})
                assert (res.is_error if hasattr(res, "is_error") else res.isError)
                res = await session.call_tool("close_session", {"session": "s1"})
                assert _payload(res)["closed"] is True

                # Untrusted-output rules: a symlink planted by the sandbox is not followed.
                await session.call_tool("run", {"command": ["ln", "-s", "/etc/hostname", "link"],
                                                "workspace": "w1"})
                res = await session.call_tool("read_file", {"workspace": "w1", "path": "link"})
                assert (res.is_error if hasattr(res, "is_error") else res.isError)
                res = await session.call_tool("read_file", {"workspace": "../x", "path": "y"})
                assert (res.is_error if hasattr(res, "is_error") else res.isError)

    anyio.run(main)
