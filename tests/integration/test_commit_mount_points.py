"""The commit never writes or deletes through a mount point inside the workspace.

The copy-on-write lower layer is the workspace's own mount (``open_tree`` without
``AT_RECURSIVE`` for root callers, an overlay lower layer for the others): a directory of the
workspace that is a mount point (a bind mount, a volume, a FUSE mount) shows the sandbox the
empty directory *below* it, never what is mounted there. The commit, though, works on the
host's view of the workspace, where the mount is live. Without a check, ``rm -rf d`` inside
(``d`` holding a mount point) made the commit rename ``d`` aside and remove it recursively,
crossing into the mounted tree and deleting all of it, as root for a root caller (who may
not even let the sandbox's uid read it); and ``echo x > m/f`` wrote into the mounted tree.

Attack: the workspace holds two bind mounts of a host directory (``d/m`` and ``m2``); the
program deletes ``d`` and writes into ``m2``. Blocked: the mounted directory is untouched (its
files, their content, nothing planted), the entries are reported as skipped. Control: the same
program run directly on the host (no sandbox) destroys the mounted tree, so the setup is real.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import lowlevel

pytestmark = [pytest.mark.bwrap, pytest.mark.root]

PROGRAM = "rm -rf d; echo evil > m2/precious; echo new > m2/planted; rmdir m3 && echo replaced > m3; true"


def _target(parent: str, owner: tuple[int, int]) -> str:
    target = os.path.join(parent, "target")
    os.makedirs(os.path.join(target, "keep"))
    Path(target, "precious").write_text("precious\n")
    Path(target, "keep", "x").write_text("x\n")
    for p in (target, f"{target}/keep", f"{target}/precious", f"{target}/keep/x"):
        os.chown(p, *owner)
    os.chmod(target, 0o700)
    return target


def _state(root: str) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = Path(p).read_bytes() if os.path.isfile(p) else None
    return out


class _Mounts:
    def __init__(self) -> None:
        self.points: list[str] = []

    def bind(self, source: str, point: str) -> None:
        os.makedirs(point, exist_ok=True)
        subprocess.run(["mount", "--bind", source, point], check=True)
        self.points.append(point)

    def undo(self) -> None:
        # Also whatever a failed commit moved aside (a leftover holding a mount point).
        with open("/proc/self/mountinfo") as f:
            live = [line.split()[4] for line in f]
        for point in reversed([p for p in live if any(p.startswith(os.path.dirname(q)) for q in self.points)]):
            subprocess.run(["umount", "-l", point], check=False)


@pytest.fixture
def mounts():
    m = _Mounts()
    yield m
    m.undo()


def test_control_the_program_on_the_host_destroys_the_mounted_tree(mounts: _Mounts) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as base:
        target = _target(base, (0, 0))
        ws = os.path.join(base, "ws")
        for point in ("d/m", "m2", "m3"):
            mounts.bind(target, os.path.join(ws, point))
        subprocess.run(["sh", "-c", PROGRAM], cwd=ws, check=True)
        assert "keep/x" not in _state(target)  # rm -rf went through the mount point
        mounts.undo()


def test_commit_does_not_cross_mount_points(mounts: _Mounts) -> None:
    """Root caller (the sandbox runs as a per-run uid; the commit as root). An unprivileged
    caller's userxattr overlay refuses a lower holding mount points (EINVAL), so it gets the
    hand-over fallback, where the sandbox sees the mounts as that user would."""
    base = tempfile.mkdtemp(prefix="rt-mnt-", dir="/tmp")
    try:
        target = _target(base, (0, 0))
        ws = os.path.join(base, "ws")
        for point in ("d/m", "m2", "m3"):
            os.makedirs(os.path.join(ws, point))
        os.chmod(ws, 0o755)
        before = _state(target)
        for point in ("d/m", "m2", "m3"):
            mounts.bind(target, os.path.join(ws, point))
        r = lowlevel.run(["sh", "-c", PROGRAM], workspace=ws, timeout=30)
        assert r.exit_code == 0, r.stderr
        assert any("copy-on-write overlay" in n for n in r.notes), r.notes
        assert _state(target) == before, "the commit wrote or deleted through a mount point"
        skipped = [n for n in r.notes if "not applied" in n]
        assert skipped and "mount point" in skipped[0], r.notes
        for name in ("'d'", "'m2'", "'m3'"):
            assert name in skipped[0], r.notes
    finally:
        mounts.undo()
        shutil.rmtree(base, ignore_errors=True)


CACHE_PROBE = """
import json, sys, lowlevel
out = []
for ws in sys.argv[1:]:
    try:
        r = lowlevel.run(["true"], workspace=ws)
        out.append("cow" if any("copy-on-write overlay" in n for n in r.notes) else "handover")
    except lowlevel.LowlevelError as err:
        out.append(f"{type(err).__name__}: {err}")
print(json.dumps(out))
"""


def test_unprivileged_workspace_with_a_mount_point_does_not_decide_for_the_filesystem(test_user, mounts) -> None:
    """An unprivileged caller's overlay refuses a lower holding mount points (they are locked in
    its user namespace), and the answer was cached per filesystem: run first on such a
    workspace, every later workspace of that filesystem lost the overlay (and its write bound)
    for the process's life; run first on a plain one, the workspace with a mount point failed
    with "sandbox setup failed: lowlevel_exec: mount overlay ... Invalid argument"."""
    import json
    import sys
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    base = tempfile.mkdtemp(prefix="rt-mnt-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        plain, holder, target = (os.path.join(base, n) for n in ("plain", "holder", "target"))
        for d in (plain, holder, f"{holder}/m", target):
            os.makedirs(d)
            os.chown(d, test_user.pw_uid, test_user.pw_gid)
        mounts.bind(target, f"{holder}/m")
        for order, want in (((holder, plain), ["handover", "cow"]), ((plain, holder), ["cow", "handover"])):
            proc = subprocess.run([runuser, "-u", test_user.pw_name, "--", sys.executable, "-c", CACHE_PROBE, *order],
                                  capture_output=True, text=True, cwd="/", timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert json.loads(proc.stdout) == want, proc.stdout
    finally:
        mounts.undo()
        shutil.rmtree(base, ignore_errors=True)
