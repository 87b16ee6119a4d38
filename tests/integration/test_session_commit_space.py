"""Session.commit()/reset() give the session its whole ``workspace_bytes`` back.

A RESET stacks a new overlay on the first one (native/lowlevel_exec.c), which stays mounted
below: bwrap's /workspace is a copy of it. Before the fix, that first overlay's cached dentries
held the first generation's upper files after the caller had cleared them, so their blocks
(and inodes) stayed charged to the run's tmpfs or disk upper: in a session bounded to 16 MiB,
11 MiB written and committed left 11264 KiB used (``stat -f /workspace``, measured here) and the
next 11 MiB write got ENOSPC at 5 MiB, for the session's whole life. And every RESET kept the
old layer's three directories (3 inodes: 1017 free -> 956 after 20 resets of a 1 MiB upper),
and a session that had used every inode could not commit: the commit applied, then RESET's
``mkdir upper.N`` failed with ENOSPC and each later commit or close met its own applied entries
as host changes (CommitConflictError).

Now, for root (tmpfs and disk upper) and the unprivileged user (tmpfs): 5 cycles of ~70% of
the bound written and committed each succeed, and the used space after each commit is what it
was at the start; the same for reset(); the bound still holds (a write past it after the commits
is ENOSPC: the control); the committed files are in the directory and nothing of them is left in
the upper (diff() empty); no mount, inode, fd or process is left (the mount count and the free
inodes inside are the same after 1 and after 39 resets); ~70% of the inodes as files, committed
3 times, fits each time and past them is ENOSPC; a session out of inodes commits and goes on.

Each scenario (tests/helpers/session_space_scenarios.py) runs as root in-process and as the
unprivileged test user through runuser, with the same assertions.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

HELPERS = Path(__file__).resolve().parent.parent / "helpers"
sys.path.insert(0, str(HELPERS))

import session_space_scenarios as sc  # noqa: E402
from identities import scenario_as  # noqa: E402

from lowlevel.workspace.disk_upper import backing_files  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]

MiB = 1 << 20
IS_ROOT = os.geteuid() == 0
#: Slack on "used after commit == used at start": directories the RESET makes (upper.N, work.N)
#: and the filesystem's own bookkeeping, far below one chunk (11 MiB).
SLACK = 1 * MiB


def _loops(uppers: Path) -> list[str]:
    """Loop devices bound to a file of ``uppers`` (deleted or not)."""
    return [v for v in backing_files().values() if v.startswith(f"{uppers}/")]


def _cases() -> list[tuple[str, str]]:
    if not IS_ROOT:
        return [("self", "tmpfs")]
    return [("root", "tmpfs"), ("root", "disk"), ("user", "tmpfs")]


def _run(name: str, who: str, upper: str, tmp_path_factory: pytest.TempPathFactory,
         request: pytest.FixtureRequest) -> dict[str, Any]:
    """Scenario ``name`` as ``who`` in a fresh workspace; skips where there is no overlay."""
    uppers = tmp_path_factory.mktemp("uppers")
    ws = tempfile.mkdtemp(prefix="ws-space-", dir="/tmp")
    os.chmod(ws, 0o755)
    mp = pytest.MonkeyPatch()
    mp.setenv("LOWLEVEL_UPPER_DIR", str(uppers))  # the disk upper's file: never /var/tmp
    try:
        if who == "user":
            user = request.getfixturevalue("test_user")
            os.chown(ws, user.pw_uid, user.pw_gid)
            out = scenario_as(user, HELPERS / "session_space_scenarios.py", name, ws, upper)
        else:
            out: dict[str, Any] = sc.SCENARIOS[name](ws, upper)
        if not out.get("cow"):
            pytest.skip("no copy-on-write overlay on this host: commit()/reset() are unsupported")
        if upper == "disk":  # the disk upper's file and loop device go with the session
            assert os.listdir(uppers) == []
            deadline = time.monotonic() + 10  # the loop device's clear is off the caller's path
            while _loops(uppers) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _loops(uppers) == []
        return out
    finally:
        mp.undo()
        shutil.rmtree(ws, ignore_errors=True)


@pytest.fixture(scope="module", params=_cases(), ids=lambda c: f"{c[0]}-{c[1]}")
def observed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """:func:`session_space_scenarios.commit_cycles` for one (identity, Limits.upper), once a module."""
    return _run("commit_cycles", *request.param, tmp_path_factory, request)


def test_commits_give_the_space_back(observed: Any) -> None:
    out = observed
    chunk = sc.CHUNK_MIB * MiB
    # Every cycle's ~70% write fits: the committed generations no longer count.
    assert out["write_rc"] == [0] * sc.CYCLES, (out["write_rc"], out["write_err"], out["used_after_write"])
    assert out["write_err"] == [""] * sc.CYCLES
    for used in out["used_after_write"]:
        assert chunk <= used - out["used_at_start"] <= chunk + SLACK, out["used_after_write"]
    for used in out["used_after_commit"]:
        assert used - out["used_at_start"] <= SLACK, (out["used_at_start"], out["used_after_commit"])
    # Each commit applied its generation, and nothing of it is left in the upper.
    assert out["added"] == [[f"f{i}"] for i in range(sc.CYCLES)]
    assert out["diff_after_commit"] == [[]] * sc.CYCLES
    assert out["listing"] == [f"f{i}" for i in range(sc.CYCLES)]
    assert out["sizes"] == {f"f{i}": chunk for i in range(sc.CYCLES)}


def test_the_bound_still_holds_after_commits(observed: Any) -> None:
    out = observed
    # The control: past the bound is ENOSPC, whatever was committed before.
    assert out["over_rc"] != 0 and "No space left on device" in out["over_err"], out
    assert out["over_used"] <= sc.BOUND + SLACK
    assert out["over_visible"] is False  # the reset dropped it: neither in the view nor the directory


def test_resets_give_the_space_back(observed: Any) -> None:
    out = observed
    assert out["reset_rc"] == [0, 0, 0], out
    for used in out["used_after_reset"]:
        assert used - out["used_at_start"] <= SLACK, (out["used_at_start"], out["used_after_reset"])
    assert out["reset_visible"] == [False, False, False]


def test_no_mount_fd_or_process_left(observed: Any) -> None:
    out = observed
    # One stacked overlay whatever the number of resets: the first reset adds it, later ones
    # replace it (5 commits + the over-bound reset + 3 resets, then 30 more: 39).
    assert len(set(out["mounts"])) == 1, out["mounts"]
    # Nor does a reset keep any of the upper's inodes (the old generation's directories).
    assert len(set(out["free_inodes"])) == 1, out["free_inodes"]
    assert out["fds_leaked"] == [] and out["children_left"] == []


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]}-{c[1]}")
def test_commits_give_the_inodes_back(case: tuple[str, str], tmp_path_factory: pytest.TempPathFactory,
                                      request: pytest.FixtureRequest) -> None:
    out = _run("inode_cycles", *case, tmp_path_factory, request)
    # ~70% of the upper's inodes as empty files, committed, three times: each fits.
    assert out["n"] >= 500, out
    assert out["rc"] == [0, 0, 0], out
    assert out["added"] == [out["n"] + 1] * 3  # the directory and its files
    for free in out["free_after_commit"]:
        assert free >= out["free_at_start"] - 16, out  # RESET's upper.N/work.N directories
    # The control: past the inode bound is ENOSPC, after the commits too.
    assert out["over_rc"] != 0 and "No space left on device" in out["over_err"], out
    assert out["files"] == {"d0": out["n"], "d1": out["n"], "d2": out["n"]}


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]}-{c[1]}")
def test_a_session_out_of_inodes_commits_and_goes_on(case: tuple[str, str], tmp_path_factory: pytest.TempPathFactory,
                                                     request: pytest.FixtureRequest) -> None:
    out = _run("inode_full", *case, tmp_path_factory, request)
    assert out["full_rc"] != 0 and out["free_when_full"] == 0, out  # every inode of the bound used
    # The commit applies them and the RESET after it still finds room for the next layer.
    assert out["commit_error"] is None, out
    assert out["added"] == out["files"]["full"] + 1
    assert out["free_after_commit"] >= out["free_at_start"] - 8, out
    assert out["again_rc"] == 0 and out["diff_again"] == out["free_at_start"] * 7 // 10 + 1, out
