"""Interrupts inside a commit's ``Applier.finish()`` (where it removes its temporaries and its
journal): a SIGTERM handler's SystemExit there left ``.lowlevel-commit-<pid>.journal`` in the
workspace (plain ``lowlevel cleanup`` does not look there once the run's record is gone), and a
^C there was retried and swallowed: the caller carried on as if no ^C came. Now both are
retried until the clean-up is done, and the interrupt is raised after it (found by
bench/kill_campaign.py; the reproducer is bench/kill_campaign_repro.py commit-finish).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import lowlevel
from lowlevel.workspace.overlay import apply

from helpers.interrupt_scripts import POOL_CLOSE

pytestmark = pytest.mark.bwrap


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_finish_is_finished_then_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        interrupt: type[BaseException]) -> None:
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f").write_text("old\n")
    real, hit = apply.Applier.abort_cleanup, []

    def abort_cleanup(self: apply.Applier) -> None:  # the signal handler's exception lands here, once
        if not hit:
            hit.append(1)
            raise interrupt()
        real(self)

    monkeypatch.setattr(apply.Applier, "abort_cleanup", abort_cleanup)
    with pytest.raises(interrupt):
        lowlevel.run(["sh", "-c", "echo new > d/f; echo more > d/g"], workspace=str(ws))
    assert hit == [1]
    assert [n for n in os.listdir(ws) if n.startswith(".lowlevel-commit-")] == []  # journal and temporaries gone
    # Every entry old or new: the apply pass had ended when the interrupt came.
    assert (ws / "d" / "f").read_text() == "new\n" and (ws / "d" / "g").read_text() == "more\n"


def test_control_without_an_interrupt_commits_and_returns(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    r = lowlevel.run(["sh", "-c", "echo new > f"], workspace=str(ws))
    assert r.exit_code == 0 and (ws / "f").read_text() == "new\n"
    assert [n for n in os.listdir(ws) if n.startswith(".lowlevel-commit-")] == []


@pytest.mark.root
def test_an_interrupt_in_pool_close_closes_every_sandbox_first(tmp_path: Path) -> None:
    """A ^C inside ``Pool.close()`` abandoned the sandboxes not yet closed (their run cgroups and
    records stayed for ``lowlevel cleanup``; bench/kill_campaign.py). Now it is raised once every
    sandbox is gone: after each of these interrupts at 1-40 ms into the close, no run record is
    left (each sandbox's cgroup has one while it lives: the control is the first delay's
    interrupt landing before the close, in the pool's own run, where the with block closes it)."""
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("run records name cgroups: root here")
    seen = set()
    for i in range(12):
        d = tmp_path / f"t{i}"
        (d / "records").mkdir(parents=True, mode=0o700)
        env = {**os.environ, "LOWLEVEL_RECORD_DIR": str(d / "records"), "LOWLEVEL_WORKSPACE_BASE": str(d / "base")}
        out = subprocess.run([sys.executable, "-c", POOL_CLOSE, str(0.001 + 0.0035 * i)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert "Traceback" not in out.stderr, out.stderr
        seen.add(out.stdout.strip())
        assert os.listdir(d / "records") == [], (i, out.stdout, os.listdir(d / "records"))
    assert "interrupted" in seen, seen
