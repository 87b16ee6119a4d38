"""Session.commit()/reset() beside running commands, and close() that cannot commit.

A commit or reset replaces the overlay's upper layer under ``/workspace``
(``native/lowlevel_exec.c``, RESET). Before the gate, commands running while another thread
committed lost completed writes and failed on ``/workspace`` (measured on this host with
4 threads x 75 writers and a committing thread: 96 of 300 commands exited 0 with their file
missing after the final commit, 191 failed with EACCES), and a background writer lost
``/workspace`` at the first commit. Now commit()/reset() wait for the commands in flight and
hold new ones until they are done; background commands are refused (or waited for, or left,
as ``running=`` says); close() whose final commit fails raises with the saved path.

Each scenario (tests/helpers/session_gate_scenarios.py) runs as root in-process and as the
unprivileged test user through runuser, with the same assertions.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

HELPERS = Path(__file__).resolve().parent.parent / "helpers"
sys.path.insert(0, str(HELPERS))

import session_gate_scenarios as scenarios  # noqa: E402
from identities import scenario_as  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]



def _identities() -> list[str]:
    return ["root", "user"] if os.geteuid() == 0 else ["self"]


@pytest.fixture(params=_identities())
def scenario(request: pytest.FixtureRequest) -> Any:
    """``scenario(name)``: run one scenario as this identity and return what it observed."""
    made: list[str] = []
    user = request.getfixturevalue("test_user") if request.param == "user" else None

    def mkdir(prefix: str) -> str:
        path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        made.append(path)
        os.chmod(path, 0o755)
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)
        return path

    def run(name: str) -> dict[str, Any]:
        ws, base = mkdir("ws-gate-"), mkdir("base-gate-")
        if user is None:
            out = scenarios.SCENARIOS[name](ws, base)
        else:
            out = scenario_as(user, HELPERS / "session_gate_scenarios.py", name, ws, base)
        if not out.get("cow"):
            pytest.skip("no copy-on-write overlay on this host: commit()/reset() are unsupported")
        return out

    yield run
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def test_no_completed_write_lost_while_another_thread_commits(scenario: Any) -> None:
    out = scenario("concurrent_commits")
    assert out["commit_errors"] == []
    assert out["commits"] >= scenarios.MIN_COMMITS  # the commits ran while the writers did
    assert out["n_failed"] == 0, out["failed"]  # no EACCES/ESTALE on /workspace for any command
    assert out["ok"] >= scenarios.WRITER_THREADS * scenarios.WRITES_PER_THREAD
    assert out["lost"] == [] and out["wrong"] == []  # every command that exited 0 has its file
    assert out["children"] == []


def test_async_no_completed_write_lost_while_a_task_commits(scenario: Any) -> None:
    out = scenario("async_concurrent_commits")
    assert out["commits"] >= scenarios.MIN_COMMITS
    assert out["n_failed"] == 0, out["failed"]
    assert out["ok"] >= scenarios.WRITER_THREADS * scenarios.WRITES_PER_THREAD
    assert out["lost"] == []
    assert out["children"] == []


def test_background_writer_refuses_commit_and_reset_and_keeps_working(scenario: Any) -> None:
    out = scenario("background_across_commit")
    assert out["started"]
    for what in ("commit", "reset"):
        reason, message = out[f"{what}_refused"]
        assert reason == "busy"
        assert f"{what}() refused" in message and "sh -c" in message and "(pid " in message
        assert "wait()" in message and "kill()" in message and f"{what}(running='wait')" in message
    assert out["directory_after_refusals"] == []  # a refused commit applied nothing
    # The writer never lost /workspace (it exits 3 at the first failed write) and everything it
    # wrote is in the directory after the commit that followed its end.
    assert (out["writer_exit"], out["writer_stderr"]) == (0, "")
    assert out["bg_files_listed"] >= 4 and out["bg_missing"] == [] and out["committed_bg_done"]
    # running="wait": the commit waited for the background command (whose 200 kB of output it
    # moved meanwhile) and took its file.
    assert out["late_committed"] and out["late_result"] == [0, 200000]
    # running="leave": committed around a command that does not use /workspace, said in its notes.
    assert out["leave_committed"] and out["leave_still_running"]
    assert out["leave_killed_by"] == "cancelled"
    assert any("ran across a Session.commit()" in n for n in out["leave_notes"])
    assert out["bad_running"][0] == "PolicyError" and "'refuse', 'wait', 'leave'" in out["bad_running"][1]
    assert out["children"] == []


def test_async_background_writer_refuses_commit_and_reset(scenario: Any) -> None:
    out = scenario("async_background_across_commit")
    for what in ("commit", "reset"):
        reason, message = out[f"{what}_refused"]
        assert reason == "busy" and f"{what}() refused" in message and "sh -c" in message
    # running="wait": the commit awaited the run() in flight (which stops the writer) and the
    # writer itself; the writer never lost /workspace and all its files were committed.
    assert out["writer_exit"] == 0 and out["stopper_exit"] == 0
    assert out["bg_files_listed"] >= 4 and out["bg_missing"] == []
    assert out["children"] == []


def test_commit_and_reset_wait_for_a_run_in_flight(scenario: Any) -> None:
    out = scenario("reset_waits_for_run_in_flight")
    assert out["started"] and out["started2"]
    # The commit waited for the other thread's command: its late write is in the commit.
    assert out["commit_added"] == ["late", "started"] and out["in_directory"] == ["late", "started"]
    assert out["run_exit"] == 0
    # The reset waited too: the command kept /workspace to its end (wrote and read its file back).
    assert out["reset_run"] == [0, "y\n", ""]
    assert out["view_after_reset"] == ["late", "started"]  # then its changes were dropped


def test_close_that_cannot_commit_raises_with_the_saved_path(scenario: Any) -> None:
    out = scenario("close_conflict")
    kind, message, conflicts = out["error"]
    assert kind == "CommitConflictError" and conflicts == ["f"]
    assert out["saved"] and out["saved"] in message
    assert out["saved_files"] == {"f": "sandbox\n", "g": "new\n"}  # the session's changes, kept aside
    assert out["directory"] == {"f": "host\n"}  # nothing applied over the host's change
    # Raised after the teardown: nothing left running, no fd left open, the session over.
    assert out["alive"] is False and out["children"] == [] and out["fds_leaked"] == []
    # Under `with` while the block raises: the block's exception propagates, the close's noted.
    kind, notes = out["with_error"]
    assert kind == "KeyError"
    assert len(notes) == 1 and "CommitConflictError" in notes[0] and "saved to" in notes[0]
    assert out["children_after_with"] == []
    assert out["async_error"] == ["CommitConflictError", True]
    kind, notes = out["async_with_error"]
    assert kind == "KeyError" and len(notes) == 1 and "CommitConflictError" in notes[0]
    assert out["children_after_async"] == []


def test_close_after_an_interrupted_commit_completes_it(scenario: Any) -> None:
    """^C (or a SIGTERM handler's SystemExit) inside commit()'s apply pass left part of the
    changes applied; the with block's close() (or a second commit()) applies the rest and
    meets the entries already applied as what they are, not as host changes (before: "commit
    refused", everything saved to conflict-*, close() raised; bench/kill_campaign.py)."""
    out = scenario("interrupted_commit")
    for what in ("close", "close_sigterm", "again"):
        got = out[what]
        assert got["interrupted"] == ("SystemExit" if what == "close_sigterm" else "KeyboardInterrupt"), got
        assert 0 < got["applied_first"], got
        assert got.get("raised", [None, []])[1] == [], got  # close() raised nothing over the interrupt
        assert (got["files"], got["keep"], got["gone"], got["deep"]) == (100, "new\n", False, "x\n"), got
        assert got["temporaries"] == [] and got["conflicts"] == [] and got["children"] == [], got
    assert "raised" not in out["again"] and out["again"]["again"]


def test_close_after_an_interrupted_commit_applies_what_the_session_changed_again(scenario: Any) -> None:
    """After an interrupted commit, a command changes again entries the first pass had applied
    (files, a file in a new directory, files in an existing directory whose 0555 mode is set
    last): close() applies the new versions, no conflict (before: every one of them was a
    conflict, all saved to conflict-*). Control: host edits between the two commits are still
    conflicts and keep the host's bytes, among them a same-size rewrite with the mtime put
    back of the entry whose rename the interrupt followed (found by a red-team pass: its
    ctime-less stamp matched any later state of it until the next commit)."""
    out = scenario("interrupted_commit_changed_again")
    if not out.get("cow"):
        pytest.skip("no copy-on-write workspace here")
    got = out["changed"]
    assert got["interrupted"] and got["applied_first"] == [60, 14, "0o755"], got
    assert got["second"] == 0 and "conflict" not in got, got
    assert len(got["files_again"]) == 60 and got["x"] == "x2\n", got
    assert (got["ro_mode"], got["ro_again"]) == ("0o555", 30), got
    assert got["temporaries"] == [] and got["conflict_dirs"] == 0 and got["children"] == [], got
    host = out["host"]
    # (Found before anything is applied: the whole commit is refused, its changes saved aside.)
    assert host["interrupted"] and host["conflict"] == sorted(["f1", host["last"]]), host
    assert host["last_text"] == "hh\n" and host["f1"] == "host\n" and host["files_again"] == [] and host["conflict_dirs"] == 1, host
    assert host["children"] == [], host
