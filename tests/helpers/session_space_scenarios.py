"""Session commit()/reset() cycles under a small ``workspace_bytes``: run as root and as the test user.

tests/integration/test_session_commit_space.py calls :func:`commit_cycles` in-process (root) or
runs this file through ``runuser`` as the unprivileged user (``python session_space_scenarios.py
NAME WORKSPACE UPPER``: prints the returned dict as JSON); :func:`inode_cycles` likewise. Each
returns what it observed; the test asserts on it. ``workspace`` is an existing, empty directory
of the caller's; ``upper`` is ``Limits.upper`` ("tmpfs" or "disk").

Inside the sandbox, ``stat -f /workspace`` is the statfs of the overlay on top, which overlayfs
answers from its upper layer's filesystem (overlayfs.rst): the run's tmpfs (or ext4 disk upper),
so its used blocks are the bytes the session's bound is charged with.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from hygiene import children, fd_numbers

from lowlevel import Limits, Policy
from lowlevel.errors import LowlevelError
from lowlevel.session import Session
from lowlevel.workspace import disk_upper

MiB = 1 << 20
BOUND = 16 * MiB
#: One write: ~70% of the bound (two of them do not fit in it at once).
CHUNK_MIB = 11
#: A write past the bound (the control: still ENOSPC after any number of commits).
OVER_MIB = 20
CYCLES = 5
#: Plain resets at the end of :func:`commit_cycles` (each used to keep 3 of the upper's inodes).
MANY_RESETS = 30

#: The command that writes ``$1`` MiB to ``$2`` and reports: "rc=N USED_BYTES" (the upper's
#: filesystem's used bytes after the write, from statfs).
WRITE = ('head -c "$1"M /dev/zero > "$2"; rc=$?; set -- $(stat -f -c "%b %f %S" /workspace); '
         'echo "rc=$rc $(( ($1 - $2) * $3 ))"')
USED = 'set -- $(stat -f -c "%b %f %S" /workspace); echo $(( ($1 - $2) * $3 ))'


def _new_fds(before: set[int]) -> list[int]:
    return sorted(fd_numbers() - before - set(disk_upper._templates.values()))


def _write(s: Session, mib: int, name: str) -> tuple[int, int, str]:
    """Write ``mib`` MiB to /workspace/``name``: (head's exit status, used bytes after, stderr)."""
    r = s.run(["sh", "-c", WRITE, "sh", str(mib), name])
    rc, used = r.stdout.decode().split()
    return int(rc.removeprefix("rc=")), int(used), r.stderr.decode()


def _used(s: Session) -> int:
    return int(s.run(["sh", "-c", USED]).stdout)


def _mounts(s: Session) -> int:
    return len(s.run(["cat", "/proc/self/mountinfo"]).stdout.splitlines())


def _free_inodes(s: Session) -> int:
    return int(s.run(["stat", "-f", "-c", "%d", "/workspace"]).stdout)


def _listing(s: Session) -> list[str]:
    return sorted(s.run(["ls", "-A", "/workspace"]).stdout.decode().split())


def commit_cycles(ws: str, upper: str) -> dict[str, Any]:
    """Write ~70% of the bound and commit, :data:`CYCLES` times; the over-bound control; then
    write ~70% and reset, three times. Returns every observation (see the test)."""
    out: dict[str, Any] = {"write_rc": [], "write_err": [], "used_after_write": [], "used_after_commit": [],
                           "added": [], "diff_after_commit": [], "mounts": [], "reset_rc": [],
                           "used_after_reset": [], "reset_visible": [], "free_inodes": []}
    fds, kids = fd_numbers(), children()
    policy = Policy(limits=Limits(workspace_bytes=BOUND, upper=upper))
    with Session(policy=policy, workspace=ws) as s:
        out["cow"] = s._core.run.cow
        out["used_at_start"] = _used(s)
        for i in range(CYCLES):
            rc, used, err = _write(s, CHUNK_MIB, f"f{i}")
            out["write_rc"].append(rc)
            out["write_err"].append(err)
            out["used_after_write"].append(used)
            out["added"].append(list(s.commit().added))
            out["used_after_commit"].append(_used(s))
            out["diff_after_commit"].append(list(s.diff().added))  # nothing left in the upper
            out["mounts"].append(_mounts(s))
            out["free_inodes"].append(_free_inodes(s))
        out["listing"] = _listing(s)
        out["sizes"] = {n: os.path.getsize(os.path.join(ws, n)) for n in sorted(os.listdir(ws))}
        # The control: the bound still holds after the commits.
        rc, used, err = _write(s, OVER_MIB, "over")
        out["over_rc"], out["over_err"], out["over_used"] = rc, err, used
        s.reset()
        out["over_visible"] = "over" in _listing(s) or os.path.exists(os.path.join(ws, "over"))
        for i in range(3):
            rc, _used_now, err = _write(s, CHUNK_MIB, f"r{i}")
            out["reset_rc"].append(rc)
            s.reset()
            out["used_after_reset"].append(_used(s))
            out["reset_visible"].append(f"r{i}" in _listing(s) or os.path.exists(os.path.join(ws, f"r{i}")))
            out["free_inodes"].append(_free_inodes(s))
        for _ in range(MANY_RESETS):
            s.reset()
        out["free_inodes"].append(_free_inodes(s))
        out["mounts"].append(_mounts(s))
    out["children_left"] = sorted(set(children()) - set(kids))  # first: it waits for the teardown
    # A disk upper's fd is closed by a worker (disk_upper.close_later); its mke2fs template is
    # kept for the process's later runs by design (disk_upper._template): no leak.
    deadline = time.monotonic() + 10
    while _new_fds(fds) and time.monotonic() < deadline:
        time.sleep(0.02)
    out["fds_leaked"] = _new_fds(fds)
    return out


#: ``Limits.workspace_bytes`` of :func:`inode_cycles`: ~1024 inodes either way
#: (lowlevel.workspace.cow.upper_inodes: 1 KiB a tmpfs inode, at least 1024;
#: disk_upper.inodes_for: 8 KiB a disk inode, at its 8 MiB minimum).
INODE_BOUND = {"tmpfs": 1 * MiB, "disk": 8 * MiB}
#: ``$1`` files in a new directory ``$2``; "rc=N FREE_INODES" after.
MAKE_FILES = ('mkdir "$2" && cd "$2" && seq "$1" | xargs touch; rc=$?; '
              'echo "rc=$rc $(stat -f -c %d /workspace)"')


def inode_cycles(ws: str, upper: str) -> dict[str, Any]:
    """Make files for ~70% of the upper's free inodes and commit, 3 times; then the control, past
    them. Returns every observation."""
    out: dict[str, Any] = {"rc": [], "free_after_commit": [], "added": []}
    with Session(policy=Policy(limits=Limits(workspace_bytes=INODE_BOUND[upper], upper=upper)), workspace=ws) as s:
        out["cow"] = s._core.run.cow
        out["free_at_start"] = free = _free_inodes(s)
        out["n"] = n = free * 7 // 10
        for i in range(3):
            r = s.run(["sh", "-c", MAKE_FILES, "sh", str(n), f"d{i}"])
            out["rc"].append(int(r.stdout.split()[0].removeprefix(b"rc=")))
            out["added"].append(len(s.commit().added))
            out["free_after_commit"].append(_free_inodes(s))
        r = s.run(["sh", "-c", MAKE_FILES, "sh", str(free + 16), "over"])
        out["over_rc"], out["over_err"] = int(r.stdout.split()[0].removeprefix(b"rc=")), r.stderr.decode()[-300:]
        out["files"] = {d: len(os.listdir(os.path.join(ws, d))) for d in sorted(os.listdir(ws))}
    return out


def inode_full(ws: str, upper: str) -> dict[str, Any]:
    """Make files until the upper has no inode left, commit, then make ~70% of them again."""
    out: dict[str, Any] = {}
    with Session(policy=Policy(limits=Limits(workspace_bytes=INODE_BOUND[upper], upper=upper)), workspace=ws) as s:
        out["cow"] = s._core.run.cow
        out["free_at_start"] = free = _free_inodes(s)
        r = s.run(["sh", "-c", MAKE_FILES, "sh", str(free + 16), "full"])
        out["full_rc"], out["free_when_full"] = (int(x) for x in r.stdout.decode().removeprefix("rc=").split())
        try:
            out["added"], out["commit_error"] = len(s.commit().added), None
        except LowlevelError as err:  # the observation: the test asserts there is none
            out["added"], out["commit_error"] = None, f"{type(err).__name__}: {err}"[:500]
        out["free_after_commit"] = _free_inodes(s)
        r = s.run(["sh", "-c", MAKE_FILES, "sh", str(free * 7 // 10), "again"])
        out["again_rc"] = int(r.stdout.split()[0].removeprefix(b"rc="))
        out["diff_again"] = len(s.diff().added)
    out["files"] = {d: len(os.listdir(os.path.join(ws, d))) for d in sorted(os.listdir(ws))}
    return out


SCENARIOS = {"commit_cycles": commit_cycles, "inode_cycles": inode_cycles, "inode_full": inode_full}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](sys.argv[2], sys.argv[3])))
