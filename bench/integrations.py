#!/usr/bin/env python3
"""What do the framework adapters cost per call, against each framework's own local baseline?

Interleaved rounds (every case once per round, rotated order) in one process:

- ``inspect_exec``: ``exec(["true"])`` on a live sample sandbox, lowlevel provider vs
  Inspect's own ``local`` provider (no isolation: a plain subprocess);
- ``inspect_sample``: ``sample_init`` + ``sample_cleanup`` (a sandbox's life), lowlevel vs local;
- ``autogen_block``: one ``print(1)`` python block, ``LowlevelCodeExecutor`` (one session)
  vs a plain ``/usr/bin/python3`` subprocess of the same file (what autogen-ext's local executor does);
- ``smolagents_step``: one ``x = x + 1`` step, ``LowlevelPythonExecutor`` (persistent kernel)
  vs smolagents' in-process ``LocalPythonExecutor``;
- ``langchain_call``: ``run_code`` with ``print(1)`` (a fresh sandbox per call) vs a plain
  ``python3 -c`` subprocess.

Prints median and p90 milliseconds and the ratio to the baseline. Usage:
``python bench/integrations.py [--rounds N] [--json FILE]``. Needs the extras installed.
Never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

#: The interpreter the sandboxes run (the system one, bound read-only), for the baselines.
PY = "/usr/bin/python3"


def _ms(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_ms": round(1000 * statistics.median(s), 3), "p90_ms": round(1000 * s[int(0.9 * (len(s) - 1))], 3)}


async def main_async(rounds: int) -> dict[str, Any]:
    from autogen_core import CancellationToken
    from autogen_core.code_executor import CodeBlock
    from inspect_ai.util._sandbox.local import LocalSandboxEnvironment
    from smolagents.local_python_executor import LocalPythonExecutor
    from smolagents.monitoring import AgentLogger, LogLevel

    from lowlevel.integrations.autogen_executor import LowlevelCodeExecutor
    from lowlevel.integrations.inspect_sandbox import LowlevelSandboxEnvironment
    from lowlevel.integrations.langchain_tool import LowlevelRunCode
    from lowlevel.integrations.smolagents_executor import LowlevelPythonExecutor

    ll_env = (await LowlevelSandboxEnvironment.sample_init("bench", None, {}))["default"]
    local_env = (await LocalSandboxEnvironment.sample_init("bench", None, {}))["default"]
    autogen = LowlevelCodeExecutor(timeout=30)
    await autogen.start()
    smol = LowlevelPythonExecutor([], AgentLogger(level=LogLevel.OFF))
    smol("x = 0")
    smol_local = LocalPythonExecutor([])
    smol_local.send_tools({})
    smol_local("x = 0")
    tool = LowlevelRunCode()
    script = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    script.write("print(1)\n")
    script.close()

    async def sample(cls: Any) -> None:
        envs = await cls.sample_init("bench", None, {})
        await cls.sample_cleanup("bench", None, envs, False)

    def sync(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
        async def run() -> Any:
            return fn()
        return run

    cases: dict[str, Callable[[], Awaitable[Any]]] = {
        "inspect_exec/lowlevel": lambda: ll_env.exec(["true"]),
        "inspect_exec/local": lambda: local_env.exec(["true"]),
        "inspect_sample/lowlevel": lambda: sample(LowlevelSandboxEnvironment),
        "inspect_sample/local": lambda: sample(LocalSandboxEnvironment),
        "autogen_block/lowlevel": lambda: autogen.execute_code_blocks([CodeBlock("print(1)", "python")],
                                                                       CancellationToken()),
        "autogen_block/subprocess": sync(lambda: subprocess.run([PY, script.name], capture_output=True)),
        "smolagents_step/lowlevel": sync(lambda: smol("x = x + 1")),
        "smolagents_step/local": sync(lambda: smol_local("x = x + 1")),
        "langchain_call/lowlevel": sync(lambda: tool.invoke({"code": "print(1)"})),
        "langchain_call/subprocess": sync(lambda: subprocess.run([PY, "-c", "print(1)"], capture_output=True)),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            await cases[name]()
            times[name].append(time.perf_counter() - t0)
    await LowlevelSandboxEnvironment.sample_cleanup("bench", None, {"default": ll_env}, False)
    await LocalSandboxEnvironment.sample_cleanup("bench", None, {"default": local_env}, False)
    await autogen.stop()
    smol.cleanup()
    out: dict[str, Any] = {name: _ms(t) for name, t in times.items()}
    for name in {n.split("/")[0] for n in names}:
        ll = out[f"{name}/lowlevel"]["p50_ms"]
        base = next(v["p50_ms"] for k, v in out.items() if k.startswith(name + "/") and not k.endswith("lowlevel"))
        out[f"{name}/ratio_p50"] = round(ll / base, 2) if base else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = asyncio.run(main_async(args.rounds))
    for key in sorted(result):
        print(f"{key:32} {result[key]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": 1, "rounds": args.rounds, "cases": result}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
