"""Replay the canned answers of problems.py through Inspect's mockllm model and print the scores.

    python examples/inspect_coding20/run.py [--log-dir DIR]

No model and no network: mockllm answers each prompt with its problem's canned answer, and
every answer is tested in its own lowlevel sandbox. Exits 1 unless every score is the expected one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from inspect_ai import eval as inspect_eval
from inspect_ai.model import ModelOutput, ModelUsage, get_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from task import coding20  # noqa: E402


def replay_model(task: Any) -> Any:
    """mockllm answering each sample's prompt with its canned answer."""
    answers = {s.input: s.metadata["answer"] for s in task.dataset}

    def outputs(messages: list[Any], tools: Any, tool_choice: Any, config: Any) -> ModelOutput:
        prompt = next(m.text for m in messages if m.role == "user")
        output = ModelOutput.from_content("mockllm/model", f"```python\n{answers[prompt]}```")
        output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)  # no tiktoken download
        return output

    return get_model("mockllm/model", custom_outputs=outputs)


def run(log_dir: str, **task_args: Any) -> dict[str, tuple[str, str]]:
    """Run the eval; returns ``{problem id: (score, expected)}``."""
    task = coding20(**task_args)
    [log] = inspect_eval(task, model=replay_model(task), log_dir=log_dir, display="none", max_sandboxes=4)
    if log.status != "success" or not log.samples:
        raise RuntimeError(f"eval failed: {log.error}")
    return {str(s.id): (str(s.scores["run_tests"].value) if s.scores else "?", str(s.target)) for s in log.samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="logs")
    args = parser.parse_args()
    scores = run(args.log_dir)
    for pid, (got, want) in scores.items():
        print(f"{pid:20} {got}  (expected {want}){'' if got == want else '  <-- MISMATCH'}")
    right = sum(got == "C" for got, _ in scores.values())
    print(f"accuracy {right}/{len(scores)}")
    return 0 if all(got == want for got, want in scores.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
