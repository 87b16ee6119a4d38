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
