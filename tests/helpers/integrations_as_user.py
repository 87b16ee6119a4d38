"""Drive each framework adapter once, as whoever runs this (the tests run it as an unprivileged user).

Reads a JSON spec on stdin: {"secret_path": str, "secret": str, "port": int}. Prints one JSON
object: for each adapter, what its sandbox printed for a benign step and for the attacks
(reading the secret by host path, connecting to the host loopback port), and any more
checks as booleans (all must be True).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

spec = json.loads(sys.stdin.read())
ATTACK = ("import socket\n"
          f"try:\n    print(open({spec['secret_path']!r}).read())\nexcept OSError as e:\n    print('blocked-read', type(e).__name__)\n"
          f"try:\n    socket.create_connection(('127.0.0.1', {spec['port']}), timeout=3); print('connected')\n"
          "except OSError as e:\n    print('blocked-net', type(e).__name__)\n")
BENIGN = "import os\nprint('uid', os.getuid(), os.getcwd())\n"
out: dict[str, Any] = {}


async def inspect_part() -> None:
    from lowlevel.integrations.inspect_sandbox import LowlevelSandboxEnvironment

    envs = await LowlevelSandboxEnvironment.sample_init("as-user", None, {})
    env = envs["default"]
    try:
        await env.write_file("attack.py", ATTACK)
        r1 = await env.exec(["python3", "-c", BENIGN])
        r2 = await env.exec(["python3", "attack.py"])
        out["inspect"] = [r1.stdout, r2.stdout, await env.read_file("attack.py") == ATTACK]
    finally:
        await LowlevelSandboxEnvironment.sample_cleanup("as-user", None, envs, False)


async def autogen_part() -> None:
    from autogen_core import CancellationToken
    from autogen_core.code_executor import CodeBlock

    from lowlevel.integrations.autogen_executor import LowlevelCodeExecutor

    async with LowlevelCodeExecutor(timeout=30) as ex:
        r1 = await ex.execute_code_blocks([CodeBlock(BENIGN, "python")], CancellationToken())
        r2 = await ex.execute_code_blocks([CodeBlock(ATTACK, "python")], CancellationToken())
        out["autogen"] = [r1.output, r2.output]


def smolagents_part() -> None:
    from smolagents.monitoring import AgentLogger, LogLevel

    from lowlevel.integrations.smolagents_executor import LowlevelPythonExecutor

    from smolagents.local_python_executor import InterpreterError

    ex = LowlevelPythonExecutor(["os", "socket"], AgentLogger(level=LogLevel.OFF))
    try:
        out["smolagents"] = [ex(BENIGN).logs, ex(ATTACK).logs]
        # A step killing its interpreter's supervisor, then one killing the session's init: each
        # an InterpreterError, and the next step answers (a fresh kernel, a fresh session).
        # (Killing the init, the step's answer may come back before the init is gone: then the
        # next step is the one that finds the session ended and says so.)
        recovered = []
        for victim in ("os.getppid()", "int(open(f'/proc/{os.getppid()}/stat').read().rsplit(')', 1)[1].split()[1])"):
            errors, last = [], None
            for code in (f"import os\nos.kill({victim}, 9)", "6 * 7", "6 * 7"):
                try:
                    last = ex(code).output
                except InterpreterError as err:
                    errors.append(str(err))
                    last = None
            recovered.append(last == 42 and 1 <= len(errors) <= 2 and all("restarted" in e for e in errors))
        out["smolagents"].append(all(recovered) and len(recovered) == 2)
    finally:
        ex.cleanup()


def langchain_part() -> None:
    from lowlevel.integrations.langchain_tool import LowlevelRunCode

    tool = LowlevelRunCode()
    out["langchain"] = [tool.invoke({"code": BENIGN}), tool.invoke({"code": ATTACK})]


asyncio.run(inspect_part())
asyncio.run(autogen_part())
smolagents_part()
langchain_part()
print(json.dumps(out))
