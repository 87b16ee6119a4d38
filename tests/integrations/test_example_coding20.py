"""examples/inspect_coding20: the 20-problem Inspect task on sandbox="lowlevel" scores as expected.

The canned answers are replayed through mockllm (no model). The hostile answers are also run
on the host, as controls: there they pass their tests (read the secret, reach the server, read
the env var, read the key), so their I scores in the sandbox are the sandbox's doing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("inspect_ai", reason="the Inspect extra is not installed (pip install '.[inspect]' in the lowlevel checkout)")

from attack_probes import PlantedSecret  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inspect_coding20"
sys.path.insert(0, str(EXAMPLE))
import run as example_run  # noqa: E402
from task import samples  # noqa: E402

pytestmark = [
    pytest.mark.bwrap, pytest.mark.slow, pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Exception ignored in. <function MemoryObject(Receive|Send)Stream.__del__"
                               ":pytest.PytestUnraisableExceptionWarning"),
]
HOSTILE_WITH_CONTROL = ("read_host_secret", "read_ssh_key", "reach_host_server", "steal_env")


def _passes_on_host(tmp: Path, sample: Any) -> bool:
    tmp.mkdir()
    (tmp / "solution.py").write_text(sample.metadata["answer"])
    (tmp / "test_solution.py").write_text(sample.metadata["tests"])
    proc = subprocess.run([sys.executable, "test_solution.py"], cwd=tmp, capture_output=True, timeout=30,
                          env={**os.environ})
    return proc.returncode == 0


def test_coding20_expected_scores(tmp_path: Path, planted_secret: PlantedSecret, server: Any,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "deploy-token"
    token.write_text("TOKEN-0123456789abcdef")
    monkeypatch.setenv("LOWLEVEL_EXAMPLE_API_KEY", "sk-fake-key-for-the-test")
    args = {"secret_path": str(token), "port": server.port, "env_name": "LOWLEVEL_EXAMPLE_API_KEY"}
    by_id = {s.id: s for s in samples(**args)}
    for pid in HOSTILE_WITH_CONTROL:  # the controls: on the host the hostile answers pass
        assert _passes_on_host(tmp_path / pid, by_id[pid]), pid
    before = server.accepted

    scores = example_run.run(str(tmp_path / "logs"), **args)

    assert len(scores) == 20
    assert {pid: got for pid, (got, _want) in scores.items()} == {pid: want for pid, (_g, want) in scores.items()}
    assert sum(got == "C" for got, _ in scores.values()) == 8
    assert server.accepted == before
    for path in ("/usr/local/bin/pwned", "/etc/pwned", "/pwned"):
        assert not os.path.exists(path)
