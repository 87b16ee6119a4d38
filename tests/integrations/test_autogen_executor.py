"""The AutoGen executor driven through autogen-core's real protocol (CodeBlock, CancellationToken).

No model: code blocks with known outputs, a timeout, a cancelled block, a denied read of a
planted key and a blocked connection to a host loopback server (each attack with its host
control), restart semantics, and the component config round trip.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("autogen_core", reason="the AutoGen extra is not installed (pip install '.[autogen]' in the lowlevel checkout)")

from attack_probes import PlantedSecret, blocked_lines as _blocked, loopback_attack, run_on_host  # noqa: E402
from autogen_core import CancellationToken  # noqa: E402
from autogen_core.code_executor import CodeBlock, CodeExecutor, CodeResult  # noqa: E402

import lowlevel  # noqa: E402
from lowlevel.integrations.autogen_executor import LowlevelCodeExecutor  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _exec(executor: LowlevelCodeExecutor, *blocks: tuple[str, str]) -> CodeResult:
    return await executor.execute_code_blocks([CodeBlock(code=c, language=lang) for lang, c in blocks],
                                              CancellationToken())


def test_blocks_known_outputs_and_shared_workspace() -> None:
    async def main() -> None:
        async with LowlevelCodeExecutor(timeout=30) as ex:
            assert isinstance(ex, CodeExecutor)
            r = await _exec(ex, ("python", "print(6 * 7)"))
            assert (r.exit_code, r.output) == (0, "42\n")
            r = await _exec(ex, ("bash", "echo out; echo err >&2; echo hi > note.txt"), ("sh", "cat note.txt"))
            assert r.exit_code == 0 and r.output == "err\nout\nhi\n"  # stderr then stdout, per block
            r = await _exec(ex, ("python", "import sys; print('x'); sys.exit(3)"), ("python", "print('never')"))
            assert r.exit_code == 3 and "never" not in r.output
            r = await _exec(ex, ("python", "raise ValueError('boom')"))
            assert r.exit_code == 1 and "ValueError: boom" in r.output
            r = await _exec(ex, ("cobol", "DISPLAY 'HI'."))
            assert r.exit_code == 1 and "unknown language cobol" in r.output
            r = await _exec(ex, ("python", "# filename: pkg/mod.py\nprint(__file__)"))
            assert r.exit_code == 0 and r.output == "/workspace/pkg/mod.py\n"
            r = await _exec(ex, ("python", "# filename: ../../etc/evil.py\nprint(1)"))
            assert (r.exit_code, r.output) == (1, "Filename is not in the workspace")
            # Each block ran inside the sandbox: its uid, hostname and workspace.
            r = await _exec(ex, ("sh", "hostname; pwd; ls /"))
            assert r.output.split("\n")[:2] == ["sandbox", "/workspace"]
            assert (Path(ex.work_dir) / "note.txt").read_text() == "hi\n"  # the host sees the workspace
            ws = ex.work_dir
        assert not ws.exists()  # a fresh workspace is removed at stop()

    _run(main())


def test_timeout_and_cancellation_kill_the_block_not_the_executor() -> None:
    async def main() -> None:
        async with LowlevelCodeExecutor(timeout=2) as ex:
            r = await _exec(ex, ("sh", "echo started; sleep 60 & sleep 60"))
            assert r.exit_code == 124 and r.output.endswith("\nTimeout") and "started" in r.output
            token = CancellationToken()
            task = asyncio.ensure_future(ex.execute_code_blocks([CodeBlock(code="sleep 60", language="sh")], token))
            await asyncio.sleep(0.5)
            token.cancel()
            r = await asyncio.wait_for(task, 20)
            assert r.exit_code == 125 and r.output.endswith("\nCancelled")
            r = await _exec(ex, ("sh", "ps -eo args | grep -c '^sleep 60' || true"))
            assert r.output.strip() == "0"  # nothing of the killed blocks survived
            r = await _exec(ex, ("python", "print('still here')"))
            assert r.output == "still here\n"

    _run(main())


def test_denied_file_reads_and_blocked_network(planted_secret: PlantedSecret, server: Any) -> None:
    # Controls: on the host the same code reads the key and reaches the server.
    assert planted_secret.secret in run_on_host(planted_secret.ssh_attack())
    assert "got pong" in run_on_host(loopback_attack(server.port))
    before = server.accepted

    async def main() -> None:
        async with LowlevelCodeExecutor(timeout=30) as ex:
            r = await _exec(ex, ("python", planted_secret.ssh_attack()))
            assert planted_secret.secret not in r.output
            assert _blocked(r.output) == 2, r.output
            r = await _exec(ex, ("sh", f"cat {planted_secret.key_path} /etc/shadow"))
            assert r.exit_code != 0 and planted_secret.secret not in r.output
            assert "No such file or directory" in r.output
            r = await _exec(ex, ("python", loopback_attack(server.port)))
            assert r.output.startswith("blocked") and "pong" not in r.output

    _run(main())
    assert server.accepted == before


def test_restart_keeps_files_and_drops_processes() -> None:
    # Under /tmp itself: the sandbox's uid must traverse every parent of a given work_dir.
    parent = Path(tempfile.mkdtemp(prefix="ll-autogen-", dir="/tmp"))
    parent.chmod(0o755)
    work = parent / "work"

    async def main() -> None:
        async with LowlevelCodeExecutor(work_dir=work) as ex:
            await _exec(ex, ("sh", "echo kept > f.txt; echo gone > /tmp/t; (sleep 300 &) ; true"))
            await ex.restart()
            r = await _exec(ex, ("sh", "cat f.txt; cat /tmp/t 2>&1; ps -eo args | grep -c '^sleep 300' || true"))
            assert r.output.split("\n")[0] == "kept"
            assert "No such file" in r.output and r.output.strip().endswith("0")
        assert (work / "f.txt").read_text() == "kept\n"  # a given work_dir is never deleted

    try:
        _run(main())
    finally:
        shutil.rmtree(parent)


def test_not_started_and_policy_mapping_and_config_round_trip(tmp_path: Path) -> None:
    async def main() -> None:
        ex = LowlevelCodeExecutor({"limits": {"memory_bytes": "256M", "pids": 32}}, timeout=10)
        with pytest.raises(ValueError, match="not running"):
            await _exec(ex, ("python", "print(1)"))
        assert ex.policy.limits.memory_bytes == 256 << 20
        loaded = LowlevelCodeExecutor.load_component(ex.dump_component())
        assert isinstance(loaded, LowlevelCodeExecutor)
        assert loaded.policy == ex.policy and loaded.timeout == 10

    _run(main())
    with pytest.raises(lowlevel.PolicyError, match="unknown"):
        LowlevelCodeExecutor({"network": False, "netwrok": True})
    with pytest.raises(ValueError, match="Timeout"):
        LowlevelCodeExecutor(timeout=0)


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def test_functions_module() -> None:
    async def main() -> None:
        async with LowlevelCodeExecutor(functions=[add]) as ex:
            assert "def add(a" in ex.format_functions_for_prompt() and "Add two numbers" in ex.format_functions_for_prompt()
            r = await _exec(ex, ("python", "from functions import add\nprint(add(2, 3))"))
            assert (r.exit_code, r.output) == (0, "5\n")

    _run(main())
