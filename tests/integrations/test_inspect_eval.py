"""A real Inspect eval on sandbox="lowlevel", driven by Inspect's mockllm model (no model behind it).

Each sample: the model first calls Inspect's ``python()`` tool (which runs in the sample's
sandbox through ``sandbox().exec``), then answers with code; the scorer writes the answer into
the sandbox and runs its tests there, as coding benchmarks do. The attack samples answer with
code that would pass only if it could read the planted key or reach the host's loopback
server: they must score I, and the same code run on the host (the control) does reach both.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("inspect_ai", reason="the Inspect extra is not installed (pip install '.[inspect]' in the lowlevel checkout)")

from attack_probes import PlantedSecret, loopback_attack, run_on_host  # noqa: E402
from inspect_ai import Task  # noqa: E402
from inspect_ai import eval as inspect_eval  # noqa: E402
from inspect_ai.dataset import Sample  # noqa: E402
from inspect_ai.model import ChatMessage, ModelOutput, ModelUsage, get_model  # noqa: E402
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer  # noqa: E402
from inspect_ai.solver import TaskState, generate, use_tools  # noqa: E402
from inspect_ai.tool import python  # noqa: E402
from inspect_ai.util import SandboxEnvironmentSpec, sandbox  # noqa: E402

import lowlevel.workspace  # noqa: E402
from lowlevel import PolicyError# noqa: E402
from lowlevel.integrations.inspect_sandbox import LowlevelSandboxConfig, LowlevelSandboxEnvironment  # noqa: E402

pytestmark = [
    pytest.mark.bwrap, pytest.mark.timeout(240),
    # Inspect itself leaves anyio memory streams unclosed (the same with its own "local" sandbox).
    pytest.mark.filterwarnings("ignore:Exception ignored in. <function MemoryObject(Receive|Send)Stream.__del__"
                               ":pytest.PytestUnraisableExceptionWarning"),
]

PROBE = "import os, socket; print('probe', os.getuid(), socket.gethostname(), os.getcwd())"


def _answer(code: str) -> str:
    return f"Here is my solution:\n```python\n{textwrap.dedent(code).strip()}\n```"


def _mock(answers: dict[str, str]) -> Any:
    """mockllm outputs: a python() probe first, then the answer for the sample's prompt."""

    def outputs(messages: list[ChatMessage], tools: Any, tool_choice: Any, config: Any) -> ModelOutput:
        prompt = next(m.text for m in messages if m.role == "user")
        if messages[-1].role != "tool":
            output = ModelOutput.for_tool_call("mockllm/model", "python", {"code": PROBE})
        else:
            output = ModelOutput.from_content("mockllm/model", _answer(answers[prompt]))
        # Given usage, mockllm skips counting tokens with tiktoken (which downloads its tables).
        output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
        return output

    return outputs


@scorer(metrics=[accuracy()])
def run_tests() -> Any:
    """Write the submitted code and the sample's tests into the sandbox; C when the tests pass."""

    async def score(state: TaskState, target: Target) -> Score:
        m = re.search(r"```python\n(.*?)```", state.output.completion, re.S)
        code = m.group(1) if m else state.output.completion
        box = sandbox()
        await box.write_file("solution.py", code)
        await box.write_file("test_solution.py", state.metadata["tests"])
        try:
            result = await box.exec(["python3", "test_solution.py"], timeout=20)
        except TimeoutError:
            return Score(value=INCORRECT, explanation="timeout")
        return Score(value=CORRECT if result.success else INCORRECT, explanation=result.stdout + result.stderr)

    return score


def _task(samples: list[Sample], config: str | LowlevelSandboxConfig | None) -> Task:
    sandbox: Any = "lowlevel"
    if isinstance(config, str):
        sandbox = ("lowlevel", config)
    elif config is not None:
        sandbox = SandboxEnvironmentSpec("lowlevel", config)
    return Task(dataset=samples, solver=[use_tools(python(timeout=30)), generate()], scorer=run_tests(),
                sandbox=sandbox)


def test_mockllm_eval_scores_and_attacks(tmp_path: Path, planted_secret: PlantedSecret, server: Any) -> None:
    # The controls: on the host both attacks work.
    assert planted_secret.secret in run_on_host(planted_secret.ssh_attack())
    assert "got pong" in run_on_host(loopback_attack(server.port))
    accepted_before = server.accepted

    leak_ssh = planted_secret.ssh_attack().replace("print(open(p).read())", "return open(p).read()")
    leak_ssh = "def leak():\n" + textwrap.indent(leak_ssh.replace("print('blocked'", "pass  # ('blocked'"), "    ")
    leak_net = ("import socket\n"
                "def leak():\n"
                f"    return socket.create_connection(('127.0.0.1', {server.port}), timeout=3).recv(16).decode()\n")
    samples = {
        "add": ("def add(a, b):\n    return a + b\n",
                "from solution import add\nassert add(2, 3) == 5\nassert add(-1, 1) == 0\nprint('ok')\n", "C"),
        "add-wrong": ("def add(a, b):\n    return a - b\n",
                      "from solution import add\nassert add(2, 3) == 5\n", "I"),
        "leak-ssh": (leak_ssh,
                     f"from solution import leak\nassert {planted_secret.secret!r} in (leak() or '')\n", "I"),
        "leak-loopback": (leak_net, "from solution import leak\nassert leak() == 'pong'\n", "I"),
    }
    answers = {f"Task {name}": code for name, (code, _t, _e) in samples.items()}
    dataset = [Sample(id=name, input=f"Task {name}", metadata={"tests": tests})
               for name, (_c, tests, _e) in samples.items()]
    config = tmp_path / "lowlevel.toml"
    config.write_text('[limits]\nmemory_bytes = "512M"\npids = 64\n')

    logs = inspect_eval(_task(dataset, str(config)), model=get_model("mockllm/model", custom_outputs=_mock(answers)),
                        log_dir=str(tmp_path / "logs"), display="none", max_sandboxes=2)
    [log] = logs
    assert log.status == "success", log.error
    assert log.samples is not None
    scores = {s.id: s.scores["run_tests"].value for s in log.samples if s.scores}
    assert scores == {name: expected for name, (_c, _t, expected) in samples.items()}, \
        {s.id: s.scores["run_tests"].explanation for s in log.samples if s.scores}
    # The python() tool call ran in the sandbox: its own hostname, the workspace as cwd.
    for s in log.samples:
        tool_out = [m.text for m in s.messages if m.role == "tool"]
        assert tool_out and re.search(r"probe \d+ sandbox /workspace", tool_out[0]), tool_out
    assert server.accepted == accepted_before  # no connection from any sandbox reached the server
    assert not any(LowlevelSandboxEnvironment._live.values())  # every session ended


def test_max_sandboxes_bounds_live_sessions(tmp_path: Path) -> None:
    """max_sandboxes=2 with 5 samples that each hold their sandbox for a while: never more than 2 live.

    The config is an object here (LowlevelSandboxConfig); its env reaches the sandbox.
    """
    LowlevelSandboxEnvironment.peak_live = 0
    tests = "import os, time; time.sleep(0.5); assert os.environ['FROM_CONFIG'] == 'yes'\n"
    dataset = [Sample(id=f"s{i}", input=f"Task s{i}", metadata={"tests": tests}) for i in range(5)]
    answers = {f"Task s{i}": "pass\n" for i in range(5)}
    config = LowlevelSandboxConfig(env={"FROM_CONFIG": "yes"}, limits={"pids": 32})
    logs = inspect_eval(_task(dataset, config), model=get_model("mockllm/model", custom_outputs=_mock(answers)),
                        log_dir=str(tmp_path / "logs"), display="none", max_sandboxes=2, max_samples=5)
    assert logs[0].status == "success", logs[0].error
    assert logs[0].samples and all(s.scores and s.scores["run_tests"].value == "C" for s in logs[0].samples)
    assert 1 <= LowlevelSandboxEnvironment.peak_live <= 2


def test_bad_config_fails_before_any_sample(tmp_path: Path) -> None:
    config = tmp_path / "lowlevel.toml"
    config.write_text("[limits]\nmemory = 5\n")  # a typo: memory_bytes
    dataset = [Sample(id="x", input="Task x", metadata={"tests": ""})]
    with pytest.raises(PolicyError, match=r"unknown \[limits\] keys \['memory'\]"):
        inspect_eval(_task(dataset, str(config)), model=get_model("mockllm/model", custom_outputs=_mock({})),
                     log_dir=str(tmp_path / "logs"), display="none")
    assert not any(LowlevelSandboxEnvironment._live.values())


def test_no_sandbox_cleanup_keeps_the_files_and_ends_the_sessions(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """--no-sandbox-cleanup: no session outlives the eval, but each sample's files stay on the host."""
    dataset = [Sample(id="keep", input="Task keep", metadata={"tests": "open('left.txt', 'w').write('kept')\n"})]
    with caplog.at_level("INFO", logger="lowlevel.inspect"):
        logs = inspect_eval(_task(dataset, None), model=get_model("mockllm/model", custom_outputs=_mock({"Task keep": "x = 1\n"})),
                            log_dir=str(tmp_path / "logs"), display="none", sandbox_cleanup=False)
    assert logs[0].status == "success", logs[0].error
    assert not any(LowlevelSandboxEnvironment._live.values())
    [kept] = [r.getMessage().rsplit(": ", 1)[1] for r in caplog.records if "workspace kept" in r.getMessage()]
    try:
        assert Path(kept, "left.txt").read_text() == "kept" and Path(kept, "solution.py").read_text() == "x = 1\n"
    finally:
        lowlevel.workspace.remove_workspace(kept)


def test_config_output_cap_too_small(tmp_path: Path) -> None:
    from lowlevel.integrations.inspect_sandbox import load_config

    path = tmp_path / "lowlevel.toml"
    path.write_text('stdout_limit_bytes = "1K"\n')
    with pytest.raises(PolicyError, match="stdout_limit_bytes must be at least 65536"):
        load_config(str(path))
    with pytest.raises(PolicyError, match="TOML file path or a LowlevelSandboxConfig"):
        load_config(42)  # type: ignore[arg-type]
