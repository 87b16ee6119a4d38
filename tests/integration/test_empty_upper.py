"""A run that writes nothing commits nothing; a run that only deletes still commits the deletion.

A copy-on-write run's commit is skipped when its upper layer has no entry at all
(:func:`lowlevel.workspace.overlay.upper_is_empty`, issue 27: 0.22 ms of the caller's CPU per
run). These runs check both sides of that decision, as root and as the unprivileged user:

- a run that only reads leaves the workspace byte-identical (names, content, inode, mode,
  owner, mtime and ctime of every entry), and a dead commit's leftover planted in it stays (the
  commit, which would have swept it, did not run); the control run, which writes a file, sweeps it;
- a run that only deletes (its upper holds whiteouts and nothing else) commits the deletions.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bwrap]


def _dead_leftover() -> str:
    """A commit temporary's name of a pid no process can have (above ``pid_max``)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return f".lowlevel-commit-{pid_max + 1}-1"


def _plant(sandbox, ws: Path) -> None:
    (ws / "f").write_text("one\n")
    (ws / "d").mkdir()
    (ws / "d" / "g").write_text("two\n")
    (ws / _dead_leftover()).write_text("left by a killed commit\n")
    if sandbox.user is not None:
        for p in (ws / "f", ws / "d", ws / "d" / "g", ws / _dead_leftover()):
            os.chown(p, sandbox.user.pw_uid, sandbox.user.pw_gid)


def _tree(ws: Path) -> dict[str, tuple[object, ...]]:
    """Every entry below ``ws`` (and ``ws`` itself) with all that a commit could change."""
    out: dict[str, tuple[object, ...]] = {}
    for top, dirs, files in os.walk(ws):
        for name in [".", *dirs, *files]:
            p = Path(top, name)
            st = p.lstat()
            body = p.read_bytes() if p.is_file() else None
            out[str(p.relative_to(ws))] = (st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_size,
                                           st.st_mtime_ns, st.st_ctime_ns, body)
    return out


@pytest.fixture
def ws(sandbox) -> Iterator[Path]:
    """A workspace of the sandbox's identity holding ``f``, ``d/g`` and a dead commit's leftover."""
    path = sandbox.workspace()
    try:
        _plant(sandbox, path)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_run_that_writes_nothing_leaves_the_workspace_byte_identical(sandbox, ws: Path) -> None:
    before = _tree(ws)
    out = sandbox.run(["sh", "-c", "cat f d/g >/dev/null && ls -la . d >/dev/null"], workspace=str(ws))
    assert out.exit_code == 0, (out.err, out.message)
    assert out.changes["added"] == [] and out.changes["modified"] == [] and out.changes["deleted"] == []
    assert _tree(ws) == before
    assert (ws / _dead_leftover()).exists()  # no commit ran: its sweep of leftovers did not either


def test_control_a_run_that_writes_commits_and_sweeps(sandbox, ws: Path) -> None:
    out = sandbox.run(["sh", "-c", "echo new > h"], workspace=str(ws))
    assert out.exit_code == 0, (out.err, out.message)
    assert out.changes["added"] == ["h"]
    assert (ws / "h").read_text() == "new\n"
    assert not (ws / _dead_leftover()).exists()  # the commit ran and swept the dead commit's leftover


def test_a_run_that_only_deletes_commits_the_deletions(sandbox, ws: Path) -> None:
    out = sandbox.run(["sh", "-c", "rm f && rm -r d"], workspace=str(ws))
    assert out.exit_code == 0, (out.err, out.message)
    assert sorted(out.changes["deleted"]) == ["d", "f"] and out.changes["added"] == []
    assert os.listdir(ws) == []  # the commit ran: the deletions applied, the leftover swept


def test_control_an_uncommitted_deletion_is_not_applied(sandbox, ws: Path) -> None:
    out = sandbox.run(["sh", "-c", "rm f"], workspace=str(ws), commit=False)
    assert out.exit_code == 0, (out.err, out.message)
    assert (ws / "f").read_text() == "one\n"
