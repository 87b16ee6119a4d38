"""What a commit does not apply is said in ``Result.notes``, never dropped silently.

``Result.changes`` comes from the upper layer (what the run did); the commit then skips what it
never applies (fifos, sockets, devices, reserved ``.lowlevel-commit-`` names, entries changed on
the host during the commit, mount points). Before, a run that made a fifo got
``changes.added == ("p",)``, no ``p`` in the workspace and not a word about it.
"""

from __future__ import annotations

import os
import shutil

import pytest

pytestmark = [pytest.mark.bwrap]


def test_skipped_entries_are_noted(sandbox) -> None:
    ws = sandbox.workspace()
    try:
        out = sandbox.run(["sh", "-c", "mkfifo p && echo x > .lowlevel-commit-1-1 && echo ok > f"], workspace=str(ws))
        assert out.exit_code == 0, (out.err, out.message)
        assert set(out.changes["added"]) >= {"p", "f"}
        assert sorted(os.listdir(ws)) == ["f"]
        notes = [n for n in out.notes if "not applied" in n]
        assert len(notes) == 1, out.notes
        assert "2 entries" in notes[0] and "'p': fifo" in notes[0] and "'.lowlevel-commit-1-1'" in notes[0], notes
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def test_control_nothing_skipped_no_note(sandbox) -> None:
    ws = sandbox.workspace()
    try:
        out = sandbox.run(["sh", "-c", "echo ok > f"], workspace=str(ws))
        assert out.exit_code == 0
        assert not [n for n in out.notes if "not applied" in n], out.notes
    finally:
        shutil.rmtree(ws, ignore_errors=True)
