"""Issue 10 item 5 and issue 12 item 4: the MCP server's workspace tools against hostile inputs.

- ``lowlevel mcp --workspace-base /etc`` was accepted and ``read_file``/``list_files`` then
  reached ``/etc`` subdirectories: the base now follows the rules for workspaces.
- ``write_file`` wrote through hard links planted by ``run_in_session``; now it refuses a file
  with several links, a symlink anywhere on the path, and a path deeper than 256 levels (which
  made the workspace unusable).
- ``read_file`` accepted ``encoding="bogus"``.
- A file name that is not UTF-8 made ``list_files`` fail for the whole workspace.
Tools are driven directly (plain calls), and the SDK's stdio client checks what goes on the wire.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lowlevel.errors import LowlevelError, PolicyError, WorkspaceError
from lowlevel.mcp_server import ServerConfig, Tools
from helpers.identities import tmpdir_fixture

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]


base = tmpdir_fixture("lowlevel-mcp-hardening-")


@pytest.fixture
def tools(base: Path) -> Iterator[Tools]:
    t = Tools(ServerConfig(workspace_base=str(base / "ws"), max_timeout_s=30))
    yield t
    t.close()


def _mcp_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"),
                                                                               str(REPO)) if p)}
    return subprocess.run([sys.executable, "-m", "lowlevel", "mcp", *args], env=env, cwd="/", input="",
                          capture_output=True, text=True, timeout=60)


def test_workspace_base_follows_the_workspace_rules(base: Path) -> None:
    etc_mode = os.stat("/etc").st_mode
    for bad in ("/etc", "/usr/share", "/", os.path.expanduser("~")):
        with pytest.raises(LowlevelError, match="refusing"):
            Tools(ServerConfig(workspace_base=bad))
        p = _mcp_cli("--workspace-base", bad)
        assert p.returncode == 125, p.stderr
        assert "Traceback" not in p.stderr and p.stderr.startswith("lowlevel: mcp: refusing"), p.stderr
    assert os.stat("/etc").st_mode == etc_mode
    # A shared sticky directory (like /tmp) is refused, and its mode is left alone (0711 before).
    sticky = base / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    with pytest.raises(LowlevelError, match="sticky"):
        Tools(ServerConfig(workspace_base=str(sticky)))
    assert stat.S_IMODE(os.stat(sticky).st_mode) == 0o1777


def test_a_refused_base_is_not_made_first(base: Path) -> None:
    """A base below a world-writable (not sticky) directory was created, then refused, and
    stayed (a fresh-user trial). Now the ancestors are checked before the mkdir. Control: the
    same base below a trusted directory is made."""
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(LowlevelError, match="could be renamed or replaced by another user") as err:
        Tools(ServerConfig(workspace_base=str(shared / "a" / "b")))
    assert str(err.value).startswith(f"refusing workspace base {shared / 'a' / 'b'}: {shared} "), err.value
    assert os.listdir(shared) == []
    t = Tools(ServerConfig(workspace_base=str(base / "fine" / "b")))
    t.close()
    assert (base / "fine" / "b").is_dir()


def test_read_and_list_never_leave_the_workspace(tools: Tools, base: Path) -> None:
    (base / "ws" / "evil").symlink_to("/etc")
    for call in (lambda: tools.list_files("evil"), lambda: tools.read_file("evil", "passwd"),
                 lambda: tools.read_file("ok", "../../../etc/passwd")):
        with pytest.raises(LowlevelError):
            call()
    tools.write_file("ok", "a/b.txt", "hi")
    (base / "ws" / "ok" / "a" / "up").symlink_to("/etc")
    with pytest.raises(WorkspaceError, match="symlink"):
        tools.read_file("ok", "a/up/passwd")
    paths = [e["path"] for e in tools.list_files("ok")["entries"]]
    assert paths == ["a", "a/b.txt", "a/up"]


def test_write_file_never_writes_through_links_the_sandbox_planted(tools: Tools, base: Path) -> None:
    victim_dir = base / "victim"
    victim_dir.mkdir(mode=0o755)
    victim = victim_dir / "secret.txt"
    victim.write_text("original\n")
    tools.write_file("s", "data.txt", "mine\n")
    r = tools.run_in_session("s", ["sh", "-c", f"ln data.txt hard.txt && ln -s {victim} soft.txt && "
                                   f"ln -s {victim_dir} dir"])
    assert r["exit_code"] == 0, r
    with pytest.raises(WorkspaceError, match="hard links"):
        tools.write_file("s", "hard.txt", "overwritten\n")
    with pytest.raises(WorkspaceError, match="symlink"):
        tools.write_file("s", "soft.txt", "overwritten\n")
    with pytest.raises(WorkspaceError, match="symlink"):
        tools.write_file("s", "dir/secret.txt", "overwritten\n")
    ws = base / "ws" / "s"
    assert (ws / "data.txt").read_text() == "mine\n"
    assert victim.read_text() == "original\n"
    tools.close_session("s")


def test_write_file_deeper_than_256_levels_refused_and_workspace_still_usable(tools: Tools) -> None:
    deep = "/".join(["d"] * 300) + "/f.txt"
    with pytest.raises(WorkspaceError, match="components"):
        tools.write_file("deep", deep, "x")
    tools.write_file("deep", "ok.txt", "fine")
    r = tools.run(["cat", "ok.txt"], workspace="deep")
    assert r["exit_code"] == 0 and r["stdout"] == "fine", r
    r = tools.run_in_session("deep", ["cat", "ok.txt"])
    assert r["exit_code"] == 0 and r["stdout"] == "fine", r
    tools.close_session("deep")


def test_read_file_encoding_validated(tools: Tools) -> None:
    tools.write_file("enc", "f.txt", "hi")
    with pytest.raises(PolicyError, match="encoding"):
        tools.read_file("enc", "f.txt", encoding="bogus")
    with pytest.raises(PolicyError, match="encoding"):
        tools.write_file("enc", "g.txt", "hi", encoding="bogus")
    assert tools.read_file("enc", "f.txt", "base64")["content"] == "aGk="


def test_bad_argument_types_are_policy_errors(tools: Tools) -> None:
    for kwargs in ({"command": "ls"}, {"command": ["ls", "a\0b"]}, {"command": ["ls"], "binds": ["/tmp\0x"]},
                   {"command": ["ls"], "stdin": "\ud800"}, {"command": ["ls"], "env": {"A": "1\0B"}},
                   {"command": ["ls"], "timeout_s": "five"}, {"command": ["ls"], "memory_bytes": [1]},
                   {"command": ["ls"], "workspace": "a\n"}):
        with pytest.raises(PolicyError):
            tools.run(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(PolicyError):
        tools.write_file("w", "f.txt", "\udcff")


def test_list_files_with_names_that_are_not_utf8(tools: Tools) -> None:
    r = tools.run(["python3", "-c", "import os; open(b'\\xff.txt', 'wb').write(b'x'); "
                   "os.symlink(b'\\xfe-target', b'link')"], workspace=None)
    assert r["exit_code"] == 0, r
    listing = tools.list_files(r["workspace"])
    json.dumps(listing, ensure_ascii=False).encode("utf-8")  # strict UTF-8: no lone surrogates
    names = [e["path"] for e in listing["entries"]]
    assert {"b64": "/y50eHQ=", "text": "\ufffd.txt"} in names and "link" in names


@pytest.mark.parametrize("stdout, b64", [(b"caf\xc3\xa9\n", None), (b"\xff\xfe\n", "//4K")])
def test_run_output_bytes_are_lossless(tools: Tools, stdout: bytes, b64: str | None) -> None:
    r = tools.run(["printf", "".join(f"\\{c:03o}" for c in stdout)])
    assert r["stdout_b64"] == b64
    if b64 is None:
        assert r["stdout"].encode() == stdout


def test_sdk_client_lists_a_workspace_with_an_odd_name(base: Path) -> None:
    pytest.importorskip("mcp")
    anyio = pytest.importorskip("anyio")
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-m", "lowlevel", "mcp", "--workspace-base",
                                                                 str(base / "ws")],
                                   env={"PYTHONPATH": os.pathsep.join(sys.path)}, cwd="/")

    async def go() -> Any:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            r = await session.call_tool("run", {"command": ["python3", "-c",
                                                            "open(b'\\xff', 'w').write('x')"], "workspace": None})
            name = _payload(r)["workspace"]
            return await session.call_tool("list_files", {"workspace": name})

    result = anyio.run(go)
    assert not (getattr(result, "is_error", None) or getattr(result, "isError", None)), result
    entries = _payload(result)["entries"]
    assert entries == [{"path": {"b64": "/w==", "text": "\ufffd"}, "kind": "file", "size": 1}]


def _payload(result: Any) -> dict[str, Any]:
    structured = getattr(result, "structured_content", None) or getattr(result, "structuredContent", None)
    if structured:
        return dict(structured.get("result", structured)) if "result" in structured and len(structured) == 1 \
            else dict(structured)
    return dict(json.loads(result.content[0].text))


def test_list_files_is_bounded_by_max_output_bytes(base: Path) -> None:
    """20,000 files made a 2.7 MB list_files reply, past max_output_bytes. Now the first entries
    up to about the cap, with truncated/total; a small workspace (the control) is listed whole."""
    t = Tools(ServerConfig(workspace_base=str(base / "ws"), max_output_bytes=4096))
    t.write_file("big", "keep.txt", "x")
    d = base / "ws" / "big"
    for i in range(500):
        (d / f"f{i:04d}.txt").write_text("")
    out = t.list_files("big")
    assert out["truncated"] is True and out["total"] == 501 and 0 < len(out["entries"]) < 501, out["total"]
    assert len(json.dumps(out)) < 2 * 4096
    t.write_file("small", "a.txt", "x")
    small = t.list_files("small")
    try:
        assert small["truncated"] is False and small["total"] == 1 and small["entries"][0]["path"] == "a.txt"
    finally:
        t.close()


BAD_ARGUMENTS = [
    ("run", {"command": "ls"}, "'command' must be a list of strings, not a string"),
    ("run", {"command": ["true"], "timeout_s": [1]}, "'timeout_s' must be a number, a string or null, not a list"),
    ("run", {"command": ["true"], "pids": "x"}, "'pids' must be an integer or null, not a string"),
    ("run", {"command": ["true"], "env": {"A": 1}}, "'env'['A'] must be a string, not an integer"),
    ("run", {"command": ["a", 3]}, "'command'[1] must be a string, not an integer"),
    ("close_session", {}, "'session' is required (a string)"),
    ("write_file", {"workspace": "w", "path": "p", "content": None}, "'content' must be a string, not null"),
]


def test_argument_type_errors_are_one_line_in_the_schema_s_terms(base: Path) -> None:
    """A wrong argument type reached an MCP client as the SDK's pydantic text: several lines per
    argument, pydantic's union member tags (``timeout_s.float``), the client's value and a URL
    per error (a fresh-user trial's "left" item). Now one line in the terms of the published
    input schema, with the value's JSON type and never the value; a valid call still runs (the
    control)."""
    lines: list[dict[str, Any]] = [
        {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "pipe", "version": "0"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        *({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call", "params": {"name": name, "arguments": args}}
          for i, (name, args, _want) in enumerate(BAD_ARGUMENTS)),
        {"jsonrpc": "2.0", "id": 99, "method": "tools/call", "params": {
            "name": "run", "arguments": {"command": ["echo", "ok"], "timeout_s": "10s"}}},
    ]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), "LOWLEVEL_CGROUP_ROOTS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "lowlevel", "mcp", "--workspace-base", str(base / "ws")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=base)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        proc.stdin.flush()
        answers: dict[int, Any] = {}
        while len(answers) < len(BAD_ARGUMENTS) + 2:  # stdin stays open: the valid run is not refused
            message = json.loads(proc.stdout.readline())
            answers[message["id"]] = message["result"]
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    for i, (name, _args, want) in enumerate(BAD_ARGUMENTS):
        result = answers[i + 1]
        text = result["content"][0]["text"]
        assert result["isError"] and text == f"Error executing tool {name}: bad arguments: {want}", text
        assert "\n" not in text and "pydantic" not in text and "'ls'" not in text
    assert not answers[99]["isError"] and "ok" in json.dumps(answers[99]), answers[99]
