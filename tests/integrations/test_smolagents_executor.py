"""The smolagents executor under a real CodeAgent driven by a fake model emitting fixed code steps.

No model: ``ScriptedModel`` returns prewritten steps. Checked: state carried between steps,
final-answer detection, a tool defined and called inside the sandbox, authorized imports,
errors with their logs, a step timeout that restarts the interpreter, a step that kills the
interpreter's supervisor or the session's init (the executor recovers), restart(), and the
ssh-key and loopback attacks blocked (with their host controls).
"""

from __future__ import annotations

import re

import os
from typing import Any

import pytest

pytest.importorskip("smolagents", reason="the smolagents extra is not installed (pip install '.[smolagents]' in the lowlevel checkout)")

from attack_probes import PlantedSecret, blocked_lines as _blocked, loopback_attack, run_on_host  # noqa: E402
from smolagents import CodeAgent, Tool  # noqa: E402
from smolagents.local_python_executor import InterpreterError  # noqa: E402
from smolagents.models import ChatMessage, MessageRole, Model  # noqa: E402
from smolagents.monitoring import AgentLogger, LogLevel  # noqa: E402

from lowlevel.integrations.smolagents_executor import LowlevelPythonExecutor  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]


class ScriptedModel(Model):  # type: ignore[misc]
    """A model that answers each call with the next prewritten code step."""

    def __init__(self, steps: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.steps = list(steps)
        self.seen: list[str] = []

    def generate(self, messages: list[Any], stop_sequences: Any = None, response_format: Any = None,
                 tools_to_call_from: Any = None, **kwargs: Any) -> ChatMessage:
        last = messages[-1]
        content = last.content if isinstance(last.content, str) else str(last.content)
        self.seen.append(content)
        step = self.steps.pop(0)
        return ChatMessage(role=MessageRole.ASSISTANT, content=f"Thought: next.\n<code>\n{step}\n</code>")


class Multiply(Tool):  # type: ignore[misc]
    name = "multiply"
    description = "Multiply two integers."
    inputs = {"a": {"type": "integer", "description": "first"}, "b": {"type": "integer", "description": "second"}}
    output_type = "integer"

    def forward(self, a: int, b: int) -> int:
        import os
        return a * b if os.path.isdir("/workspace") else -1  # -1 would mean: not run in the sandbox


def _executor(**kw: Any) -> LowlevelPythonExecutor:
    return LowlevelPythonExecutor(kw.pop("imports", []), AgentLogger(level=LogLevel.OFF), **kw)


def test_code_agent_state_tools_and_final_answer() -> None:
    steps = [
        "import math\nx = multiply(6, 7)\nprint('x is', x)\nhost = open('/etc/hostname').read() if False else None",
        "y = x + int(math.sqrt(16))\nprint('y is', y)\ny",
        "import os\nfinal_answer({'y': y, 'cwd': os.getcwd(), 'uid': os.getuid()})",
    ]
    model = ScriptedModel(steps)
    executor = _executor(imports=["os"])
    assert executor.session is not None
    workspace = executor.session.directory
    with CodeAgent(tools=[Multiply()], model=model, executor=executor, max_steps=5) as agent:
        answer = agent.run("compute")
        assert answer["y"] == 46 and answer["cwd"] == "/workspace"
        # The second step saw the first one's variable, and its logs reached the model.
        assert any("x is 42" in s for s in model.seen) and any("y is 46" in s for s in model.seen)
    assert executor.session is None  # the agent's cleanup ended the session ...
    assert not os.path.exists(workspace)  # ... and removed its workspace


def test_executor_contract_direct() -> None:
    ex = _executor(timeout_seconds=3)
    try:
        out = ex("a = [1, 2, 3]\nprint('hello')\na")
        assert (out.output, out.logs, out.is_final_answer) == ([1, 2, 3], "hello\n", False)
        assert ex("b = len(a) * 2").output == 6  # state persists; an assignment's value is the output
        assert ex("class P:\n    pass\nP()").output.startswith("<__main__.P object")  # repr for non-JSON
        with pytest.raises(InterpreterError, match=r"Import of os is not allowed"):
            ex("import os")
        with pytest.raises(InterpreterError, match=r"Import from subprocess is not allowed"):
            ex("from subprocess import run")
        with pytest.raises(InterpreterError, match=r"at line 'raise ValueError\('bad'\)' due to: ValueError: bad"):
            ex("print('before')\nraise ValueError('bad')")
        assert ex.state["_print_outputs"] == "before\n"  # where CodeAgent looks for the logs of a failed step
        with pytest.raises(InterpreterError, match="Code parsing failed"):
            ex("def broken(:")
        with pytest.raises(InterpreterError, match="maximum execution time of 3 seconds"):
            ex("while True:\n    pass")
        assert ex("1 + 1").output == 2  # a fresh interpreter answers after the timeout
        with pytest.raises(InterpreterError, match="is not defined"):
            ex("a")  # ... and its earlier state is gone, as documented
    finally:
        ex.cleanup()


def test_missing_authorized_module_fails_at_construction() -> None:
    with pytest.raises(InterpreterError, match="Non-installed authorized modules: no_such_module_xyz"):
        _executor(imports=["no_such_module_xyz"])


def test_attacks_blocked(planted_secret: PlantedSecret, server: Any) -> None:
    assert planted_secret.secret in run_on_host(planted_secret.ssh_attack())
    assert "got pong" in run_on_host(loopback_attack(server.port))
    before = server.accepted
    ex = _executor(imports=["os", "socket"])
    try:
        out = ex(planted_secret.ssh_attack())
        assert planted_secret.secret not in out.logs and _blocked(out.logs) == 2, out.logs
        out = ex(loopback_attack(server.port))
        assert out.logs.startswith("blocked"), out.logs
        # The authorized-imports list is no boundary (documented): the sandbox is.
        out = ex("import os\nprint(os.listdir(os.path.expanduser('~')))")
        assert ".ssh" not in out.logs
    finally:
        ex.cleanup()
    assert server.accepted == before


def test_memory_hog_restarts_the_interpreter() -> None:
    ex = _executor(policy={"limits": {"memory_bytes": "128M"}}, timeout_seconds=30)
    try:
        ex("keep = 1")
        with pytest.raises(InterpreterError) as info:
            ex("x = bytearray(1024 * 1024 * 1024)")
        # With a memory cgroup the kernel is OOM-killed; with RLIMIT_DATA the allocation fails.
        assert "MemoryError" in str(info.value) or "died" in str(info.value)
        assert ex("2 * 21").output == 42
    finally:
        ex.cleanup()


#: A step's code that prints the PID of the session's init: its kernel's supervisor's parent.
_INIT_PID = "int(open(f'/proc/{os.getppid()}/stat').read().rsplit(')', 1)[1].split()[1])"


def test_a_step_killing_the_supervisor_is_an_interpreter_error_and_the_agent_goes_on() -> None:
    """One line of agent code (``os.kill(os.getppid(), 9)``: the kernel's supervisor) wedged the
    executor: every later step raised the same raw SessionError ("the supervisor of 'python3' was
    killed ... (the session goes on)"), because the kernel's poll() raised before the kernel was
    restarted. Now the step raises InterpreterError and the kernel is restarted (the tool too)."""
    steps = ["import os\nos.kill(os.getppid(), 9)", "print('still here', multiply(6, 7))", "final_answer('done')"]
    model = ScriptedModel(steps)
    with CodeAgent(tools=[Multiply()], model=model, executor=_executor(imports=["os"], timeout_seconds=10),
                   max_steps=4, verbosity_level=LogLevel.OFF) as agent:
        assert agent.run("go") == "done"
        errors = [str(getattr(step, "error", None) or "") for step in agent.memory.steps[1:]]
    assert "the sandboxed interpreter died" in errors[0] and "supervisor" in errors[0], errors
    assert errors[1:] == ["", ""], errors
    assert any("still here 42" in s for s in model.seen), model.seen


def test_a_step_ending_the_session_gets_a_fresh_sandbox_and_restart() -> None:
    """A step that kills the session's init ended the sandbox for good (every later step: "the
    lowlevel sandbox ended"), and there was no restart(). Now the step raises InterpreterError and
    the executor starts a fresh session (the tools and variables sent again); restart() does so on
    demand."""
    ex = _executor(imports=["os"], timeout_seconds=10)
    try:
        ex.send_variables({"sent": 5})
        ex("kept = 1\nopen('/tmp/scratch', 'w').write('x')")
        first = ex.session
        try:
            ex(f"import os\nos.kill({_INIT_PID}, 9)")
        except InterpreterError as err:
            assert re.search("sandbox ended.*restarted", str(err)), err
        else:  # the step's answer came before the init died: the next step finds the session ended
            with pytest.raises(InterpreterError, match="sandbox ended.*restarted"):
                ex("1")
        assert ex.session is not first and ex.session is not None and ex.session.alive
        assert ex("import os\nsent * 2").output == 10  # the variables sent were sent again
        assert ex("os.path.exists('/tmp/scratch')").output is False  # a fresh sandbox
        with pytest.raises(InterpreterError, match="is not defined"):
            ex("kept")
        ex("kept = 2")
        second = ex.session
        ex.restart()
        assert ex.session is not second and not second.alive
        assert ex("sent").output == 5
        with pytest.raises(InterpreterError, match="is not defined"):
            ex("kept")
    finally:
        ex.cleanup()
