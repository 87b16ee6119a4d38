"""smolagents: ``executor_type="lowlevel"`` as well as ``executor=`` (issue 25 item 5).

``LowlevelCodeAgent`` is smolagents' ``CodeAgent`` that knows the name (the stock one refuses
it: the control). Checked as root in-process and as the unprivileged test user in a child:
the agent's code runs inside the sandbox (``/workspace``, a sandbox uid, the host's secret
unreadable there while the same user reads it on the host), ``executor_kwargs`` reach the
executor, and the other types still behave as in ``CodeAgent``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.identities import last_json_line, planted_key, runuser, user_env

pytest.importorskip("smolagents", reason="the smolagents extra is not installed (pip install '.[smolagents]' in the lowlevel checkout)")

from smolagents import CodeAgent  # noqa: E402
from smolagents.local_python_executor import LocalPythonExecutor  # noqa: E402

from lowlevel.integrations.smolagents_executor import EXECUTOR_TYPE, LowlevelCodeAgent  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[2]

#: Builds a LowlevelCodeAgent by name, runs two scripted steps, prints a JSON line. argv[1]: the secret's path.
AGENT_SCRIPT = r'''
import json, sys
from typing import Any
from smolagents.models import ChatMessage, MessageRole, Model
from lowlevel.integrations.smolagents_executor import LowlevelCodeAgent, LowlevelPythonExecutor

class ScriptedModel(Model):
    def __init__(self, steps: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.steps = list(steps)

    def generate(self, messages: Any, stop_sequences: Any = None, response_format: Any = None,
                 tools_to_call_from: Any = None, **kwargs: Any) -> ChatMessage:
        return ChatMessage(role=MessageRole.ASSISTANT, content=f"Thought: next.\n<code>\n{self.steps.pop(0)}\n</code>")

secret = sys.argv[1]
steps = ["import os\nx = 6 * 7",
         "import os\ntry:\n    leaked = open(%r).read()\nexcept OSError as e:\n    leaked = 'blocked: ' + type(e).__name__\n"
         "final_answer({'x': x, 'cwd': os.getcwd(), 'uid': os.getuid(), 'leaked': leaked})" % secret]
agent = LowlevelCodeAgent(tools=[], model=ScriptedModel(steps), executor_type="lowlevel",
                          additional_authorized_imports=["os"], executor_kwargs={"timeout_seconds": 60},
                          max_steps=4)
with agent:
    ex = agent.python_executor
    info = {"executor": type(ex).__name__, "is_lowlevel": isinstance(ex, LowlevelPythonExecutor),
            "timeout_seconds": ex.timeout_seconds, "answer": agent.run("go")}
    info["session_after_run"] = ex.session is not None
print(json.dumps(info))
'''


def _check(info: dict[str, Any], secret_text: str) -> None:
    assert info["executor"] == "LowlevelPythonExecutor" and info["is_lowlevel"] and info["timeout_seconds"] == 60
    answer = info["answer"]
    assert answer["x"] == 42 and answer["cwd"] == "/workspace"  # state kept between steps, run in the sandbox
    assert secret_text not in json.dumps(answer) and answer["leaked"].startswith("blocked: "), answer


def test_stock_code_agent_refuses_the_name() -> None:
    """The control: smolagents' own CodeAgent does not know "lowlevel"; hence the subclass."""
    from smolagents.models import Model
    with pytest.raises(ValueError, match="Unsupported executor type"):
        CodeAgent(tools=[], model=Model(model_id="x"), executor_type=EXECUTOR_TYPE)


def test_other_executor_types_and_executor_arg_unchanged() -> None:
    from smolagents.models import Model
    agent = LowlevelCodeAgent(tools=[], model=Model(model_id="x"), executor_type="local")
    assert isinstance(agent.python_executor, LocalPythonExecutor)
    with pytest.raises(ValueError, match="Unsupported executor type"):
        LowlevelCodeAgent(tools=[], model=Model(model_id="x"), executor_type="nonsense")


def test_executor_type_lowlevel_as_root() -> None:
    with planted_key(None, "ll-smol-type-") as (key, text):
        assert key.read_text() == text  # control: the caller reads it on the host
        proc = subprocess.run([sys.executable, "-c", AGENT_SCRIPT, str(key)], capture_output=True, text=True,
                              timeout=150, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        _check(last_json_line(proc), text)


@pytest.mark.root
def test_executor_type_lowlevel_as_unprivileged_user(test_user: Any) -> None:
    with planted_key(test_user, "ll-smol-type-") as (key, text):
        env = user_env(test_user, PYTHONPATH=str(REPO))
        control = subprocess.run(runuser(test_user, ["cat", str(key)]), capture_output=True, text=True, env=env,
                                 cwd="/", timeout=30)
        assert control.stdout == text  # control: the same user reads it on the host
        proc = subprocess.run(runuser(test_user, [sys.executable, "-c", AGENT_SCRIPT, str(key)]),
                              capture_output=True, text=True, env=env, cwd="/", timeout=150)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _check(last_json_line(proc), text)
