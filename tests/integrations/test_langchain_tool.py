"""The LangChain tools invoked directly, as an agent's tool call would (no model).

Checked: outputs and exit codes, the operator's timeout as a ceiling, arguments outside the
schema refused (the model cannot turn the network on), a shared session, the async path, and
the ssh-key and loopback attacks blocked with their host controls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("langchain_core", reason="the LangChain extra is not installed (pip install '.[langchain]' in the lowlevel checkout)")

from attack_probes import PlantedSecret, loopback_attack, run_on_host  # noqa: E402
from attack_probes import blocked_lines as _blocked  # noqa: E402
from langchain_core.messages import ToolMessage  # noqa: E402
from langchain_core.tools import BaseTool  # noqa: E402
from pydantic import ValidationError  # noqa: E402

import lowlevel  # noqa: E402
from lowlevel.integrations.langchain_tool import LowlevelRunCode, LowlevelRunCommand  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]


def test_run_code_and_run_command() -> None:
    code = LowlevelRunCode()
    assert isinstance(code, BaseTool) and code.name == "run_code"
    out = code.invoke({"code": "import os, socket\nprint(6 * 7, socket.gethostname(), os.getcwd())"})
    assert out.startswith("exit code: 0") and "42 sandbox /workspace" in out
    out = code.invoke({"code": "echo hi; exit 3", "language": "bash"})
    assert out.startswith("exit code: 3") and "hi" in out
    cmd = LowlevelRunCommand()
    out = cmd.invoke({"command": "cat; echo err >&2", "stdin": "fed\n"})
    assert "--- stdout ---\nfed" in out and "--- stderr ---\nerr" in out
    assert cmd.invoke({"command": ["printf", "%s-%s", "a", "b"]}).endswith("a-b")
    assert cmd.invoke({"command": ["no-such-program"]}).startswith("exit code: 127")
    # As a tool call from a chat model: a ToolMessage comes back.
    msg = cmd.invoke({"name": "run_command", "args": {"command": "echo via-call"}, "id": "1", "type": "tool_call"})
    assert isinstance(msg, ToolMessage) and "via-call" in msg.content


def test_operator_policy_is_never_widened(server: Any) -> None:
    cmd = LowlevelRunCommand(timeout_s=2)
    with pytest.raises(ValidationError):
        cmd.invoke({"command": "true", "network": True})
    with pytest.raises(ValidationError):
        cmd.invoke({"command": "true", "policy": {"network": True}})
    out = cmd.invoke({"command": "sleep 30", "timeout_s": 600})  # asks for more than the operator's 2 s
    assert "timed out" in out
    # Even an operator's tool object cannot be pointed at a network through the call.
    code = LowlevelRunCode(policy=lowlevel.Policy(limits=lowlevel.Limits(memory_bytes=64 << 20)))
    out = code.invoke({"code": "x = bytearray(512 * 1024 * 1024)\nprint('allocated')"})
    assert "allocated" not in out and not out.startswith("exit code: 0")


def test_attacks_blocked(planted_secret: PlantedSecret, server: Any) -> None:
    assert planted_secret.secret in run_on_host(planted_secret.ssh_attack())
    assert "got pong" in run_on_host(loopback_attack(server.port))
    before = server.accepted
    code = LowlevelRunCode()
    out = code.invoke({"code": planted_secret.ssh_attack()})
    assert planted_secret.secret not in out and _blocked(out.split("--- stdout ---\n", 1)[1]) == 2, out
    out = code.invoke({"code": loopback_attack(server.port)})
    assert "blocked" in out and "pong" not in out
    out = LowlevelRunCommand().invoke({"command": f"cat {planted_secret.key_path} ~/.ssh/id_ed25519"})
    assert planted_secret.secret not in out and "No such file" in out
    assert server.accepted == before


def test_shared_session_and_async() -> None:
    with lowlevel.Session() as session:
        run = LowlevelRunCommand(session=session)
        code = LowlevelRunCode(session=session, response_format="content_and_artifact")
        run.invoke({"command": "echo state > kept.txt"})
        msg = code.invoke({"name": "run_code", "args": {"code": "print(open('kept.txt').read().strip())"},
                           "id": "2", "type": "tool_call"})
        assert msg.artifact["exit_code"] == 0 and msg.artifact["stdout"] == "state\n"
        assert "state" in asyncio.run(run.ainvoke({"command": "cat kept.txt"}))
    assert "async" in asyncio.run(LowlevelRunCode().ainvoke({"code": "print('async')"}))
