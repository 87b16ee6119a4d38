"""Per-run uids are reused least recently used first, not at once (issue 22, item 6).

A root caller's sandboxes each run as a uid leased from a range (lowlevel.workspace.uids.UidLease). The
lease used to hand the lowest free uid to every run, so sequential runs all ran as the same
uid, and a private (0600) file one run left in a writable bind was the next run's to read,
though the next run may be another task's or tenant's. Now each lease starts after the last one
handed out (a cursor in the lease file, shared by every process under flock), so a uid comes
back only after the rest of the range.

Unprivileged callers are not concerned: bwrap maps their own uid, the same for every run, and
what they bind is theirs (README, "A sandbox's host uid is reused after it").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lowlevel
from lowlevel.workspace import uids

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="per-run uid leases are for root callers")

def _free_id() -> int:
    first, count = uids.DEFAULT_UID_RANGE
    taken = uids.account_uids(first, count)
    return next(u for u in range(first + count - 11, first, -1) if u not in taken)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory under /tmp (pytest's tmp dirs are 0700: no per-run uid reaches them) that
    any per-run uid may write, as a scratch bind shared between runs would be."""
    d = Path(tempfile.mkdtemp(prefix="uid-reuse-", dir="/tmp"))
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


_RUN = textwrap.dedent("""
    import json, sys
    import lowlevel
    shared, command, host_uid = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    policy = lowlevel.Policy(binds=(lowlevel.Bind(shared, "/data", writable=True),), host_uid=host_uid)
    r = lowlevel.run(["sh", "-c", command], policy=policy, timeout=60)
    print(json.dumps({"exit": r.exit_code, "out": r.stdout.decode(), "err": r.stderr.decode()}))
""")


def _run_in_new_process(shared: Path, command: str, host_uid: int | None = None) -> dict[str, Any]:
    """One run by a caller of its own (a CLI call, another task's worker): nothing in-process
    is shared with the previous run."""
    proc = subprocess.run([sys.executable, "-c", _RUN, str(shared), command, json.dumps(host_uid)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


_WRITE = "umask 077; echo private > /data/secret-$(id -u); id -u"


@ROOT_ONLY
def test_sequential_runs_do_not_share_a_uid_nor_private_files(shared: Path) -> None:
    first = _run_in_new_process(shared, _WRITE)
    assert first["exit"] == 0, first
    uid1 = int(first["out"])
    assert (shared / f"secret-{uid1}").stat().st_mode & 0o777 == 0o600
    # The attack: the next run (another task's, another caller process) reads what the first
    # left in the bind.
    second = _run_in_new_process(shared, f"id -u; cat /data/secret-{uid1}")
    uid2 = int(second["out"].split()[0])
    assert uid2 != uid1
    assert second["exit"] != 0 and "Permission denied" in second["err"], second
    assert "private" not in second["out"]


@ROOT_ONLY
def test_control_a_pinned_uid_reads_what_it_left(shared: Path) -> None:
    """Control: the same two runs pinned to one uid (``Policy(host_uid=N)``) share the file:
    the read above failed because the uids differed, nothing else."""
    n = _free_id()
    first = _run_in_new_process(shared, _WRITE, host_uid=n)
    assert first["exit"] == 0 and int(first["out"]) == n, first
    second = _run_in_new_process(shared, f"cat /data/secret-{n}", host_uid=n)
    assert second["exit"] == 0 and second["out"] == "private\n", second


_LEASE = textwrap.dedent("""
    import sys
    from lowlevel.workspace import uids
    uids.UID_LOCK_PATH = sys.argv[1]
    lease = uids.UidLease.acquire()
    print(lease.uid)
    lease.release()
""")


def _lease_in_new_process(lock: Path, first: int, last: int) -> int:
    env = dict(os.environ, LOWLEVEL_UID_RANGE=f"{first}-{last}")
    proc = subprocess.run([sys.executable, "-c", _LEASE, str(lock)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


@ROOT_ONLY
def test_rotation_is_shared_across_processes(tmp_path: Path) -> None:
    """Each lease, in a process of its own, gets the uid after the last one handed out,
    wrapping around the range: least recently used first, whoever leased before."""
    first = _free_id() - 2
    assert not uids.account_uids(first, 3)
    lock = tmp_path / "uids.lock"
    got = [_lease_in_new_process(lock, first, first + 2) for _ in range(4)]
    assert got == [first, first + 1, first + 2, first]


@ROOT_ONLY
def test_a_live_uid_is_skipped_and_the_rotation_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _free_id() - 2
    monkeypatch.setenv("LOWLEVEL_UID_RANGE", f"{first}-{first + 2}")
    monkeypatch.setattr(uids, "UID_LOCK_PATH", str(tmp_path / "uids.lock"))
    held = uids.UidLease.acquire()  # a live sandbox's
    assert held.uid == first
    try:
        others = [uids.UidLease.acquire() for _ in range(2)]
        assert [lease.uid for lease in others] == [first + 1, first + 2]
        with pytest.raises(lowlevel.UnsupportedError):
            uids.UidLease.acquire()  # all three live
        for lease in others:
            lease.release()
        # first is still live: the rotation wraps past it to the least recently used free uid.
        nxt = uids.UidLease.acquire()
        assert nxt.uid == first + 1
        nxt.release()
    finally:
        held.release()
    # Control: released, first comes back in its turn (after first + 1, the last handed out).
    assert [_lease_in_new_process(tmp_path / "uids.lock", first, first + 2) for _ in range(2)] == [first + 2, first]


def test_an_unprivileged_callers_runs_are_all_its_own(sandbox: Any, tmp_path: Path) -> None:
    """Not concerned (unprivileged callers): bwrap maps the caller's own uid, the same for every
    run, so what a run leaves in a writable bind is the caller's, owned by it on the host, not
    another principal's; separate tenants are separate caller uids. (As root this is the
    per-run uid, which differs per run: the tests above.)"""
    if sandbox.user is None:
        pytest.skip("the unprivileged half")
    d = Path(tempfile.mkdtemp(prefix="uid-own-", dir="/tmp"))
    try:
        os.chown(d, sandbox.uid, -1)
        uids = []
        for _ in range(2):
            r = sandbox.run(["sh", "-c", "umask 077; id -u > /data/last; cat /data/last"],
                            binds=[(str(d), "/data", True)], timeout=60)
            assert r.exit_code == 0, (r.err, r.message)
            uids.append(int(r.out))
        assert uids == [sandbox.uid, sandbox.uid]
        assert (d / "last").stat().st_uid == sandbox.uid
    finally:
        shutil.rmtree(d, ignore_errors=True)
