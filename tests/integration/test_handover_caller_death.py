"""The hand-over fallback (no overlay): a root caller SIGKILLed mid-run leaves the workspace
owned by the sandbox's per-run uid; ``lowlevel cleanup``, or the next run, gives it back.

Without the copy-on-write overlay (``LOWLEVEL_NO_OVERLAY=1``, or a kernel or filesystem without
idmapped/user-namespace overlays), a root caller's workspace entries are chowned to the
sandbox's host uid for the run (:func:`lowlevel.workspace.hand_over`) and given back after it.
A caller that dies without its cleanup (SIGKILL) used to leave every entry owned by a uid of
the per-run range, which a later, unrelated sandbox is leased again. The owners are now
journaled on disk before each chown (:mod:`lowlevel.workspace.handover_journal`).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bwrap, pytest.mark.root]

CALLER = """
import sys, lowlevel
lowlevel.run(["sh", "-c", "echo new > new.txt; chmod 4755 new.txt; exec sleep 60"], workspace=sys.argv[1],
             timeout=120)
"""
NEXT_RUN = """
import sys, lowlevel
assert lowlevel.run(["true"], workspace=sys.argv[1]).exit_code == 0
"""


def _owners(root: str) -> dict[str, tuple[int, int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [""] + dirnames + filenames:
            p = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_uid, st.st_gid, st.st_mode & 0o7777)
    return out


def _killed_mid_run(ws: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start CALLER on ``ws``, SIGKILL it once its program has written new.txt; return it (reaped)."""
    caller = subprocess.Popen([sys.executable, "-c", CALLER, ws], env=env)
    deadline = time.monotonic() + 30
    while not os.path.exists(f"{ws}/new.txt") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    return caller


def _fill(ws: str, subdir: bool = False) -> None:
    """A file ``f`` (and a directory ``d``) in ``ws``, all owned by 4242:4242, ``ws`` 0755."""
    Path(ws, "f").write_text("hi\n")
    if subdir:
        os.mkdir(os.path.join(ws, "d"))
    for p in (ws, f"{ws}/f", *([f"{ws}/d"] if subdir else [])):
        os.chown(p, 4242, 4242)
    os.chmod(ws, 0o755)


@pytest.mark.parametrize("repair", ["cleanup", "next run"])
def test_killed_root_caller_in_handover_mode_leaves_owners_restorable(repair: str) -> None:
    ws = tempfile.mkdtemp(prefix="rt-handover-", dir="/tmp")
    env = {**os.environ, "LOWLEVEL_NO_OVERLAY": "1"}
    try:
        _fill(ws, subdir=True)
        before = _owners(ws)
        caller = _killed_mid_run(ws, env)
        assert _owners(ws)["f"][:2] != (4242, 4242)  # it was handed over when the caller died
        assert caller.returncode == -signal.SIGKILL
        listed = subprocess.run([sys.executable, "-m", "lowlevel", "doctor", "--json"], env=env,
                                capture_output=True, text=True)
        assert "handover" in listed.stdout  # the leftovers check says what is left
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            # What a user would do next: lowlevel cleanup, or simply the next run. Both wait for
            # the sandbox's processes to be gone (they die with the anchor, within ms).
            script = ["-m", "lowlevel", "cleanup", "--workspace", ws] if repair == "cleanup" else ["-c", NEXT_RUN, ws]
            subprocess.run([sys.executable, *script], env=env, capture_output=True, check=False)
            if _owners(ws)["f"][:2] == (4242, 4242):
                break
            time.sleep(0.2)
        after = _owners(ws)
        assert {k: v for k, v in after.items() if k != "new.txt"} == before
        # What the run made goes to the workspace root's owner, without its setuid bit.
        assert after["new.txt"][:2] == (4242, 4242) and not after["new.txt"][2] & 0o6000
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def _dead_callers_journal(serial: int, content: Callable[[int], bytes]) -> str:
    """Write ``content(pid)`` as the hand-over journal of a caller (``pid``) that has exited;
    return its path."""
    from lowlevel.workspace import handover_journal as journal
    from lowlevel.workspace.cow import ensure_root_state_dir
    ensure_root_state_dir()
    os.makedirs(journal.JOURNAL_DIR, mode=0o700, exist_ok=True)
    p = subprocess.Popen(["true"])
    p.wait()
    path = os.path.join(journal.JOURNAL_DIR, f"{p.pid}-{serial}")
    Path(path).write_bytes(content(p.pid))
    return path


def test_a_malformed_journal_is_reported_not_fatal() -> None:
    from lowlevel.workspace.handover import recover
    path = _dead_callers_journal(999, lambda _pid: b"H 1 garbage\n\xff")
    try:
        done, problems = recover()
        assert path not in done and any(path in x and "unreadable" in x for x in problems), problems
        out = subprocess.run([sys.executable, "-m", "lowlevel", "cleanup"], capture_output=True, text=True)
        assert "Traceback" not in out.stderr and path in out.stdout + out.stderr
    finally:
        os.unlink(path)


def test_a_reused_caller_pid_does_not_keep_the_workspace_handed_over() -> None:
    """The dead caller's pid now belongs to another process (pid reuse, simulated by moving the
    journal to a live process's pid): cleanup tells it from the caller by its start time and
    gives the workspace back (it was skipped for as long as that process lived, and the next
    run recorded the sandbox's owners as the originals)."""
    from lowlevel.workspace import handover_journal as journal
    ws = tempfile.mkdtemp(prefix="rt-handover-reuse-", dir="/tmp")
    env = {**os.environ, "LOWLEVEL_NO_OVERLAY": "1"}
    other = None
    try:
        _fill(ws)
        before = _owners(ws)
        caller = _killed_mid_run(ws, env)
        mine = [n for n in os.listdir(journal.JOURNAL_DIR) if n.startswith(f"{caller.pid}-")]
        assert len(mine) == 1, mine
        time.sleep(0.05)  # the other process starts at a later clock tick than the caller
        other = subprocess.Popen(["sleep", "60"])
        old = os.path.join(journal.JOURNAL_DIR, mine[0])
        text = Path(old).read_text()
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            rec = line.split(" ")
            if rec[0] == "H" or (rec[0] == "P" and rec[1] == "caller"):
                rec[2] = str(other.pid)  # both records give the pid third
                lines[i] = " ".join(rec)
        new = os.path.join(journal.JOURNAL_DIR, f"{other.pid}-{mine[0].split('-', 1)[1]}")
        Path(new).write_text("".join(lines))
        os.chmod(new, 0o600)
        os.unlink(old)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            subprocess.run([sys.executable, "-m", "lowlevel", "cleanup", "--workspace", ws], env=env,
                           capture_output=True, check=False)
            if _owners(ws)["f"][:2] == (4242, 4242):
                break
            time.sleep(0.2)
        after = _owners(ws)
        assert {k: v for k, v in after.items() if k != "new.txt"} == before
        assert other.poll() is None  # control: the pid is live, and still was not taken for the caller
    finally:
        if other is not None:
            other.kill()
            other.wait()
        shutil.rmtree(ws, ignore_errors=True)


def test_a_journal_never_chowns_a_directory_swapped_in_at_the_workspace_path() -> None:
    """After the caller's death the workspace's parent is moved away and replaced by a symlink
    to another tree with a directory of the workspace's name: cleanup leaves that directory (and
    what is in it) as it is (it gave it the journaled owner and mode, through the symlink)."""
    top = tempfile.mkdtemp(prefix="rt-handover-swap-", dir="/tmp")
    parent, ws = os.path.join(top, "p"), os.path.join(top, "p", "ws")
    victim = os.path.join(top, "victim", "ws")
    env = {**os.environ, "LOWLEVEL_NO_OVERLAY": "1"}
    try:
        os.chmod(top, 0o755)
        os.makedirs(ws)
        os.makedirs(victim)
        _fill(ws)
        Path(victim, "secret").write_text("x")
        for p in (victim, f"{victim}/secret"):
            os.chown(p, 5555, 5555)
        os.chmod(victim, 0o700)
        victim_before = _owners(victim)
        _killed_mid_run(ws, env)
        assert _owners(ws)["f"][:2] != (4242, 4242)  # it was handed over when the caller died
        os.rename(parent, parent + ".moved")
        os.symlink(os.path.dirname(victim), parent)
        for _ in range(3):
            out = subprocess.run([sys.executable, "-m", "lowlevel", "cleanup"], env=env, capture_output=True,
                                 text=True, check=False)
            assert "Traceback" not in out.stderr, out.stderr
            time.sleep(0.2)
        assert _owners(victim) == victim_before
        # Control: the same cleanup gives a workspace back where it was handed over (the first test).
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_two_live_runs_never_hand_over_one_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run on a workspace while the first has it handed over is refused (EBUSY): it
    recorded the first sandbox's owners as the originals and gave them back after, leaving the
    workspace owned by a per-run uid for good. Control: one after the other, both run."""
    import threading

    import lowlevel
    monkeypatch.setenv("LOWLEVEL_NO_OVERLAY", "1")
    ws = tempfile.mkdtemp(prefix="rt-handover-two-", dir="/tmp")
    try:
        _fill(ws, subdir=True)
        before = _owners(ws)
        first: list[object] = []
        t = threading.Thread(target=lambda: first.append(lowlevel.run(
            ["sh", "-c", "touch started; sleep 2"], workspace=ws, timeout=60)))
        t.start()
        deadline = time.monotonic() + 30
        while not os.path.exists(f"{ws}/started") and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(lowlevel.WorkspaceError, match="handed to another live run") as info:
            lowlevel.run(["true"], workspace=ws)
        assert info.value.errno == errno.EBUSY
        t.join()
        os.unlink(f"{ws}/started")
        assert _owners(ws) == before
        assert lowlevel.run(["true"], workspace=ws).exit_code == 0  # control: in turn, it runs
        assert _owners(ws) == before
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def test_a_journaled_uid_is_not_leased_until_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller killed between READY and recording bwrap leaves its workspace owned by its uid;
    leasing that uid to the next sandbox (the lowest free one) made that sandbox own the dead
    run's files and kept the recovery waiting for as long as uids were busy (found by killing
    callers at random instants). Journaled uids are skipped; the control lease takes them."""
    from lowlevel.workspace.uids import UidLease
    first = 1879048192 + 60000  # two ids of the default range no other test leases
    monkeypatch.setenv("LOWLEVEL_UID_RANGE", f"{first}-{first + 1}")
    path = _dead_callers_journal(
        998, lambda pid: f"H 1 {pid} {os.fsencode('/nonexistent-ws').hex()} 0 0 493 {first} 0 0\n".encode())
    try:
        for _ in range(3):
            lease = UidLease.acquire()
            assert lease.uid == first + 1
            lease.release()
    finally:
        os.unlink(path)
    leases = [UidLease.acquire() for _ in range(2)]  # control: without the journal, both ids go
    assert sorted(lease.uid for lease in leases) == [first, first + 1]
    for lease in leases:
        lease.release()
