"""Session.reset() and commit() while a command keeps writing into the dropped layer.

A command that started before a reset keeps its cwd (and its open directories) in the old
overlay, and keeps writing into the old upper directory, which the host clears right after the
anchor stacked the fresh overlay. That race made ``reset()`` raise ``WorkspaceError("cannot clear
the directory: Directory not empty")`` although the reset had happened (and ``commit()``, which
resets last, raise after the changes were applied). Now the clearing is best effort: the reset
stands, the call returns, what the old command keeps writing stays out of every later diff and
commit (it is gone with the sandbox). A reset refuses a running background command unless
asked to leave it (``running="leave"``, which this test exercises).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

from lowlevel.session import Session

pytestmark = [pytest.mark.bwrap]

WRITER = """
import os
os.chdir('/workspace')
i = 0
while True:
    try:
        os.makedirs(f'd{i % 50}/x/y', exist_ok=True)
        open(f'd{i % 50}/x/y/f{i}', 'w').write('x')
    except OSError:
        pass
    i += 1
"""


def test_reset_and_commit_race_a_writer_in_the_old_layer() -> None:
    ws = tempfile.mkdtemp(prefix="rt-reset-", dir="/tmp")
    try:
        with Session(workspace=ws) as s:
            if not s._core.run.cow:
                pytest.skip("no copy-on-write overlay here")
            writer = s.start(["python3", "-c", WRITER], timeout=60)
            time.sleep(0.3)
            for _ in range(10):
                # running="leave": reset around the background writer (the default refuses it,
                # test_session_commit_gate.py); raised WorkspaceError (ENOTEMPTY) when the writer
                # won the race
                s.reset(running="leave")
                time.sleep(0.02)
            assert s.alive
            s.run(["sh", "-c", "echo kept > kept"])
            changes = s.commit(running="leave")
            assert "kept" in changes.added
            assert [n for n in os.listdir(ws)] == ["kept"]  # nothing of the old layer's writer
            writer.kill()
            writer.wait(10)
    finally:
        shutil.rmtree(ws, ignore_errors=True)
