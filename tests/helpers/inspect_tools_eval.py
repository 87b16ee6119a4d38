"""A real ``inspect eval`` of one sample whose (mockllm) model calls Inspect's ``text_editor()``
and ``bash_session()`` in a ``sandbox="lowlevel"`` sample; run as root and as an unprivileged
user by tests/integrations/test_inspect_tools.py.

Reads a JSON spec on stdin: {"log_dir": str, "secret_path": str, "config": str | null}.
Prints one JSON object: the eval's status and error, and each tool result in order.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from inspect_ai import Task
from inspect_ai import eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessage, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import includes
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import bash_session, text_editor

spec = json.loads(sys.stdin.read())
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("text_editor", {"command": "create", "path": "/workspace/hello.txt", "file_text": "hi from editor\n"}),
    ("text_editor", {"command": "view", "path": "/workspace/hello.txt"}),
    ("bash_session", {"action": "type_submit", "input": "cd /tmp && export MARK=kept; cat /workspace/hello.txt"}),
    ("bash_session", {"action": "type_submit", "input": "echo state $MARK $PWD uid $(id -u)"}),
    ("bash_session", {"action": "type_submit",
                      "input": f"cat {spec['secret_path']} 2>/dev/null || echo blocked-read"}),
]


def outputs(messages: list[ChatMessage], tools: Any, tool_choice: Any, config: Any) -> ModelOutput:
    done = sum(1 for m in messages if m.role == "tool")
    if done < len(CALLS):
        output = ModelOutput.for_tool_call("mockllm/model", CALLS[done][0], CALLS[done][1])
    else:
        output = ModelOutput.from_content("mockllm/model", "done")
    output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    return output


sandbox: Any = ("lowlevel", spec["config"]) if spec.get("config") else "lowlevel"
task = Task(dataset=[Sample(input="go", target="done")], solver=[use_tools(bash_session(), text_editor()), generate()],
            scorer=includes(), sandbox=sandbox, message_limit=30)
log = inspect_eval(task, model=get_model("mockllm/model", custom_outputs=outputs), log_dir=spec["log_dir"],
                   display="none")[0]
samples = log.samples or []
results = [m.text for s in samples for m in s.messages if m.role == "tool"]
errors = [m.error.message for s in samples for m in s.messages if m.role == "tool" and m.error]
print(json.dumps({"status": log.status, "error": log.error.message if log.error else None,
                  "results": results, "tool_errors": errors}))
