"""``lowlevel mcp`` lifetimes and small contract gaps (issue 12, items 9 and 10):

- an unnamed ``run``'s workspace is kept ``run_workspace_ttl_s`` after its last use, then
  removed (with 0: right after the call); all go when the server closes; a client cannot
  create a ``run-*`` name; stale ones of a dead server are swept at start;
- a session idle past ``session_idle_ttl_s`` is closed and frees its ``max_sessions`` slot;
- ``cwd`` in ``run`` and ``run_in_session``;
- ``clamped`` lists only what the client asked for and was cut;
- an unknown tool argument is an error (through the SDK's own client).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lowlevel.errors import PolicyError
from lowlevel.mcp_server import ServerConfig, Tools
from helpers.identities import tmpdir_fixture

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]


def workspaces(base: Path) -> list[str]:
    """The workspaces under ``base`` (lowlevel's own dot-entries there, such as the overlay
    mount directory ``.mnt``, are not workspaces)."""
    return sorted(n for n in os.listdir(base) if not n.startswith("."))


base = tmpdir_fixture("lowlevel-mcp-life-")


def tools(base: Path, **config: Any) -> Tools:
    return Tools(ServerConfig.from_mapping({"workspace_base": str(base / "ws"), **config}))


def test_unnamed_run_workspace_expires_after_its_ttl(base: Path) -> None:
    t = tools(base, run_workspace_ttl_s=60.0)
    try:
        out = t.run(["sh", "-c", "echo hi > out.txt"])
        name = out["workspace"]
        assert name.startswith("run-") and t.read_file(name, "out.txt")["content"] == "hi\n"
        t.sweep()
        assert (base / "ws" / name).is_dir()                  # within its TTL
        t.sweep(now=time.monotonic() + 61)
        assert not (base / "ws" / name).exists()              # past it
        with pytest.raises(PolicyError):
            t.read_file(name, "out.txt")
        # A named workspace is the client's: never swept.
        t.write_file("mine", "a.txt", "x")
        t.run(["true"], workspace="mine")
        t.sweep(now=time.monotonic() + 10**6)
        assert (base / "ws" / "mine" / "a.txt").exists()
        # The server's names cannot be made by a client.
        with pytest.raises(PolicyError, match="run-"):
            t.write_file("run-0123456789ab", "a.txt", "x")
        kept = t.run(["true"])["workspace"]
    finally:
        t.close()
    assert not (base / "ws" / kept).exists()                  # gone with the server
    assert sorted(workspaces(base / "ws")) == ["mine"]


def test_ttl_zero_removes_right_after_the_call(base: Path) -> None:
    t = tools(base, run_workspace_ttl_s=0)
    try:
        out = t.run(["sh", "-c", "echo hi; echo x > f"])
        assert out["workspace"] is None and out["stdout"] == "hi\n"
        assert workspaces(base / "ws") == []
    finally:
        t.close()


def test_stale_run_workspaces_of_a_dead_server_are_swept_at_start(base: Path) -> None:
    stale = base / "ws" / "run-deadbeef0001"
    stale.mkdir(parents=True)
    (stale / "f").write_text("x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    fresh = base / "ws" / "run-deadbeef0002"
    fresh.mkdir()
    t = tools(base, run_workspace_ttl_s=3600)
    t.close()
    assert not stale.exists() and fresh.exists()


def test_a_second_server_on_the_base_keeps_a_live_servers_run_workspaces(base: Path) -> None:
    """Server B started with ``run_workspace_ttl_s = 0`` swept server A's live ``run-*`` workspace:
    A's result named a workspace ``read_file`` no longer found (a fresh-user trial). Now each name
    carries its server's pid and start time, and a live server's are never swept. Control: a
    dead server's, past the TTL, is."""
    a = tools(base, run_workspace_ttl_s=3600)
    try:
        name = a.run(["sh", "-c", "echo mine > f"])["workspace"]
        dead = base / "ws" / "run-999999999-1-00aa"
        dead.mkdir()
        b = tools(base, run_workspace_ttl_s=0)
        b.close()
        assert a.read_file(name, "f")["content"] == "mine\n"
        assert not dead.exists()
    finally:
        a.close()


def test_a_run_result_says_what_its_commit_did_not_apply(base: Path) -> None:
    """A fifo the run made is not committed: the MCP result said exit 0 and listed it as added,
    without a word (a fresh-user trial; the Result's note existed, the server dropped it). Now
    the note reaches the client, workspace-relative. Control: a plain file is applied."""
    t = tools(base)
    try:
        t.write_file("w", "seed", "")
        out = t.run(["sh", "-c", "mkfifo pipe; echo x > plain"], workspace="w")
        assert out["exit_code"] == 0
        notes = [n for n in out.get("notes", []) if n.startswith("commit: not applied:")]
        assert len(notes) == 1 and "'pipe'" in notes[0] and str(base) not in notes[0], out
        assert t.read_file("w", "plain")["content"] == "x\n"
    finally:
        t.close()


def test_an_empty_workspace_name_is_refused_as_a_name(base: Path) -> None:
    """``workspace: ""`` said "no workspace named 'run-<hex>'", a name the client never gave (a
    fresh-user trial); now the name's own rule."""
    t = tools(base)
    try:
        with pytest.raises(PolicyError, match="workspace name '': use 1-64 letters"):
            t.run(["true"], workspace="")
    finally:
        t.close()


def test_idle_session_is_closed_and_frees_its_slot(base: Path) -> None:
    t = tools(base, max_sessions=1, session_idle_ttl_s=600)
    try:
        assert t.run_in_session("s1", ["sh", "-c", "echo kept > f"])["exit_code"] == 0
        with pytest.raises(PolicyError, match="max_sessions"):
            t.run_in_session("s2", ["true"])
        old = t.sessions["s1"]
        t.sweep(now=time.monotonic() + 601)                   # abandoned: closed, slot freed
        assert "s1" not in t.sessions and not old.alive
        assert t.run_in_session("s2", ["true"])["exit_code"] == 0
        assert t.read_file("s1", "f")["content"] == "kept\n"  # its workspace stays
    finally:
        t.close()


def test_cwd_and_clamped(base: Path) -> None:
    t = tools(base, default_timeout_s=300.0, max_timeout_s=20.0)
    try:
        t.write_file("w", "sub/x.txt", "X")
        out = t.run(["sh", "-c", "pwd; cat x.txt"], workspace="w", cwd="sub")
        assert out["stdout"] == "/workspace/sub\nX" and out["clamped"] == []  # default cut: not asked
        out = t.run(["pwd"], cwd="/tmp", timeout_s=999)
        assert out["stdout"] == "/tmp\n" and [c.split(":")[0] for c in out["clamped"]] == ["timeout_s"]
        t.write_file("s", "sub/y", "y")
        assert t.run_in_session("s", ["pwd"], cwd="sub")["stdout"] == "/workspace/sub\n"
        for bad in ("../x", "a/../../b", ""):
            with pytest.raises(PolicyError):
                t.run(["true"], cwd=bad)
    finally:
        t.close()


def test_unknown_tool_argument_is_an_error(base: Path) -> None:
    pytest.importorskip("mcp")
    anyio = pytest.importorskip("anyio")
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "lowlevel", "mcp", "--workspace-base", str(base / "ws")],
                                   env={"PYTHONPATH": os.pathsep.join(sys.path)})

    def is_error(res: Any) -> bool:
        return bool(res.is_error if hasattr(res, "is_error") else res.isError)

    async def main() -> None:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                listed = await session.list_tools()
                for tool in listed.tools:
                    schema = getattr(tool, "input_schema", None) or tool.inputSchema
                    assert schema.get("additionalProperties") is False, tool.name
                # "timeout" instead of "timeout_s": refused, not run without its limit
                res = await session.call_tool("run", {"command": ["sleep", "5"], "timeout": 0.1})
                assert is_error(res)
                text = " ".join(getattr(c, "text", "") for c in res.content)
                assert "timeout" in text and "timeout_s" in text
                res = await session.call_tool("list_files", {"workspace": "x", "recursive": True})
                assert is_error(res)
                # control: the right name works
                res = await session.call_tool("run", {"command": ["echo", "ok"], "timeout_s": 10})
                assert not is_error(res)
                structured = getattr(res, "structured_content", None) or getattr(res, "structuredContent", None)
                out = structured.get("result", structured) if structured else json.loads(res.content[0].text)
                assert out["stdout"] == "ok\n"

    anyio.run(main)


def test_session_limits_are_fixed_at_start_and_later_calls_need_not_repeat_them(base: Path) -> None:
    t = tools(base)
    try:
        assert t.run_in_session("s", ["true"], memory_bytes=256 << 20)["exit_code"] == 0
        assert t.run_in_session("s", ["true"])["exit_code"] == 0                    # not asked: the session's
        assert t.run_in_session("s", ["true"], memory_bytes=256 << 20, cpu_s=5)["exit_code"] == 0
        with pytest.raises(PolicyError, match="fixed when it started"):
            t.run_in_session("s", ["true"], memory_bytes=128 << 20)
    finally:
        t.close()
