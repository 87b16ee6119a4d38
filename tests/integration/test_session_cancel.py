"""A session whose caller goes away midway: cancelled AsyncSession calls, an AsyncSession nobody
closed, a ^C inside ``Session.close()`` or at the end of ``commit()`` (found by a fresh-user trial).

Before: a commit() or reset() cancelled while its job waited for a thread of the loop's (busy)
default executor never ran and never reopened the workspace gate: every later run(), start()
and commit() of the session waited forever. A create() cancelled while its sandbox started
dropped the started session (a zombie anchor, ~10 fds, its cgroups, run record and workspace).
An AsyncSession garbage-collected unclosed left its sandbox running (a Session is closed). A ^C
in close()'s kill skipped the anchor's reap (a zombie for the process's life; a second close()
did nothing), and one at the end of commit()'s RESET left the old upper layer's fd open and the
commit baseline (since_ns, own_stamps) of the dropped layer.

Each scenario (tests/helpers/session_cancel_scenarios.py) runs as root in-process and as the
unprivileged test user through runuser, with the same assertions.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HELPERS = Path(__file__).resolve().parent.parent / "helpers"
sys.path.insert(0, str(HELPERS))

import session_cancel_scenarios as scenarios  # noqa: E402
from identities import scenario_as  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]


@pytest.fixture(params=["root", "user"] if os.geteuid() == 0 else ["self"])
def scenario(request: pytest.FixtureRequest) -> Iterator[Callable[[str], dict[str, Any]]]:
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
        ws, base = mkdir("ws-cancel-"), mkdir("base-cancel-")
        if user is None:
            return scenarios.SCENARIOS[name](ws, base)
        return scenario_as(user, HELPERS / "session_cancel_scenarios.py", name, ws, base)

    yield run
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def _need_cow(out: dict[str, Any]) -> None:
    if not out.get("cow"):
        pytest.skip("no copy-on-write overlay on this host: commit()/reset() are unsupported")


def test_a_commit_cancelled_while_queued_for_a_thread_releases_the_session(scenario: Any) -> None:
    out = scenario("commit_cancelled_in_the_queue")
    _need_cow(out)
    for what in ("commit", "reset"):
        got = out[what]
        assert got["queued"] and got["outcome"] == "cancelled", got  # cancelled while its job waited
        assert got["held"] is None, got  # was "commit" (or "reset") forever
        assert got["run"] == [0, f"{what}\n"], got  # was "hung"; the change is still the session's
        assert what not in got["directory"], got  # nothing was applied
    # Cancelled once it ran in its thread: it ran to its end (applied), then commands ran again.
    assert out["running"] == {"outcome": "cancelled", "run_after": 0, "applied": True}
    assert out["commit_after"] == ["after"]
    assert out["children"] == []


def test_a_close_cancelled_while_queued_for_a_thread_still_closes(scenario: Any) -> None:
    """A close() cancelled while its job waited for a thread of the busy default executor never
    ran: the session stayed open (its sandbox, and its work uncommitted) until a later close()
    or garbage collection. Now the close runs anyway, in a thread of its own."""
    out = scenario("close_cancelled_in_the_queue")
    assert out["queued"] and out["outcome"] == "cancelled", out
    assert out["closed"] and out["children"] == [], out
    if out["cow"]:
        assert "closed" in out["directory"], out  # commit=True: close() committed the work


def test_a_cancelled_create_leaves_nothing(scenario: Any) -> None:
    out = scenario("create_cancelled")
    assert out["started"] and out["during_start"] == "cancelled"
    assert out["queued"] == "cancelled"
    # The session started under the cancelled create() was closed in its thread (keep_workspace=False:
    # its workspace removed); before, its anchor, fds and workspace stayed.
    assert out["children"] == [] and out["fds_leaked"] == [], out
    assert out["new_dirs"] == [], out


def test_an_async_session_collected_unclosed_is_closed(scenario: Any) -> None:
    out = scenario("collected_unclosed")
    for kind in ("async", "sync"):  # sync: the control (it was closed before too)
        got = out[kind]
        assert got["children"] == [] and got["fds_leaked"] == [], (kind, got)
    if out["cow"]:  # commit=True: its changes reached the directory as close() commits them
        assert out["async"]["committed"] == "async\n" and out["sync"]["committed"]


def test_a_sigint_inside_close_still_reaps_the_sandbox(scenario: Any) -> None:
    out = scenario("interrupted_close")
    assert out["close"] == "KeyboardInterrupt"  # raised, once the teardown was done
    assert out["children"] == [] and not out["anchor_left"], out  # was the anchor, a zombie
    assert out["children_after_retry"] == [] and out["fds_leaked"] == [], out
    assert out["committed"]


def test_a_sigint_at_the_end_of_commit_leaves_no_old_upper(scenario: Any) -> None:
    out = scenario("interrupted_commit_reset")
    _need_cow(out)
    assert out["commit"] == "KeyboardInterrupt" and out["host"] == "v1\n"  # applied, then the ^C
    assert not out["old_upper_open"], out  # the dropped layer's fd was kept for the session's life
    assert out["since_moved"] and out["own_stamps"] == 0, out
    assert out["later_commit"] == ["f.txt"] and out["host_after"] == "v2\n"
    assert out["children"] == []
