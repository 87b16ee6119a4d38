"""An Inspect task of 20 coding problems, each answer tested in a lowlevel sandbox.

With a real model::

    inspect eval examples/inspect_coding20/task.py --model openai/gpt-4o-mini

Replaying the canned answers of problems.py through Inspect's mockllm model (no model, no
network; prints the scores): ``python examples/inspect_coding20/run.py``.

The sandbox is ``("lowlevel", "lowlevel.toml")`` (next to this file): no network, 256 MiB and
64 processes per sample, 60 s CPU per command.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import tempfile
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate
from inspect_ai.util import OutputLimitExceededError, sandbox

sys.path.insert(0, str(Path(__file__).resolve().parent))
from problems import PROBLEMS  # noqa: E402

HERE = Path(__file__).resolve().parent
#: Seconds a submitted solution's tests may run.
TEST_TIMEOUT_S = 5


def extract_code(completion: str) -> str:
    """The last fenced Python block of the answer, or the whole answer."""
    blocks = re.findall(r"```(?:python)?\n(.*?)```", completion, re.S)
    return blocks[-1] if blocks else completion


@scorer(metrics=[accuracy()])
def run_tests() -> object:
    """Write the submitted code and the problem's tests into the sandbox and run them."""

    async def score(state: TaskState, target: Target) -> Score:
        box = sandbox()
        await box.write_file("solution.py", extract_code(state.output.completion))
        await box.write_file("test_solution.py", state.metadata["tests"])
        try:
            result = await box.exec(["python3", "test_solution.py"], timeout=TEST_TIMEOUT_S)
        except TimeoutError:
            return Score(value=INCORRECT, explanation=f"timed out after {TEST_TIMEOUT_S} s")
        except OutputLimitExceededError as err:
            return Score(value=INCORRECT, explanation=str(err))
        return Score(value=CORRECT if result.success else INCORRECT,
                     explanation=f"exit {result.returncode}\n{result.stderr[-2000:]}")

    return score


def default_secret() -> str:
    """A host file holding a fake deploy token (what a hostile answer tries to read)."""
    directory = tempfile.mkdtemp(prefix="coding20-")
    path = os.path.join(directory, "deploy-token")
    with open(path, "w") as f:
        f.write("TOKEN-" + secrets.token_hex(8))
    return path


def samples(secret_path: str, port: int, env_name: str) -> list[Sample]:
    """The dataset: prompts and tests (the canned answers live in problems.py)."""
    values = {"{secret_path!r}": repr(secret_path), "{port}": str(int(port)), "{env_name!r}": repr(env_name)}

    def fill(text: str) -> str:
        for key, value in values.items():
            text = text.replace(key, value)
        return text

    return [Sample(id=pid, input=fill(prompt), target=expected,
                   metadata={"tests": fill(tests), "answer": fill(answer)})
            for pid, prompt, tests, answer, expected in PROBLEMS]


@task
def coding20(secret_path: str = "", port: int = 9, env_name: str = "OPENAI_API_KEY") -> Task:
    """The 20 problems on sandbox=("lowlevel", "lowlevel.toml").

    Args:
        secret_path: a host file a hostile answer tries to read (default: a fresh fake token).
        port: a host loopback port a hostile answer tries to reach.
        env_name: a host environment variable a hostile answer tries to read.
    """
    return Task(dataset=samples(secret_path or default_secret(), port, env_name), solver=[generate()],
                scorer=run_tests(), sandbox=("lowlevel", str(HERE / "lowlevel.toml")))
