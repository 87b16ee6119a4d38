"""Session.commit() into a directory on a read-only file system raises WorkspaceError.

A session may run over a read-only directory (``commit=False``: its changes stay in the
overlay's upper layer). Committing them there cannot work: the commit must raise lowlevel's
WorkspaceError (EROFS, one line saying so), never a bare OSError, leave the directory as it
was (no temporaries), and keep the changes in the session (``diff()`` still lists them), as
every commit that fails before applying anything. The same when the directory's file system
turns read-only during the session (a tmpfs remounted ``ro``: the commit's apply pass stops on
EROFS), where the changes are also saved aside. The same steps over a writable directory
(the control) commit the file. The directory is made read-only by a read-only bind mount of
a fresh tmp dir onto itself, or is a fresh tmpfs (root mounts and remounts; the user half runs
through runuser).
Both commit paths (a run's and a session's) go through
:func:`lowlevel.workspace.overlay.commits.commit_upper`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

HELPERS = Path(__file__).resolve().parent.parent / "helpers"
sys.path.insert(0, str(HELPERS))

import readonly_commit  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount of a tmp dir needs root")]

RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"


@pytest.fixture(params=["root", "user"])
def run_scenario(request: pytest.FixtureRequest) -> Any:
    """``run_scenario(readonly)``: the scenario over a fresh directory holding ``a.txt``, read-only
    (a ro bind mount onto itself) or not, as root in-process or as the test user."""
    made: list[str] = []
    mounted: list[str] = []
    user = request.getfixturevalue("test_user") if request.param == "user" else None

    def mkdir(prefix: str) -> str:
        path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        made.append(path)
        os.chmod(path, 0o755)
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)
        return path

    def run(readonly: str = "") -> dict[str, Any]:
        """``readonly``: "" (writable), "bind" (ro bind mount before the session), "remount" (a
        tmpfs remounted ro between the session's write and its commit)."""
        ws, base = mkdir("ws-ro-commit-"), mkdir("base-ro-commit-")
        if readonly == "remount":
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", ws], check=True)
            mounted.append(ws)
            if user is not None:
                os.chown(ws, user.pw_uid, user.pw_gid)
        Path(ws, "a.txt").write_text("a\n")
        if user is not None:
            os.chown(os.path.join(ws, "a.txt"), user.pw_uid, user.pw_gid)
        if readonly == "bind":
            subprocess.run(["mount", "--bind", ws, ws], check=True)
            mounted.append(ws)
            subprocess.run(["mount", "-o", "remount,ro,bind", ws], check=True)
            assert os.statvfs(ws).f_flag & os.ST_RDONLY

        def remount() -> None:
            subprocess.run(["mount", "-o", "remount,ro", ws], check=True)
            assert os.statvfs(ws).f_flag & os.ST_RDONLY

        wait = readonly == "remount"
        if user is None:
            out = readonly_commit.scenario(ws, base, remount if wait else None)
        else:
            proc = subprocess.Popen(
                [RUNUSER, "-u", user.pw_name, "--", sys.executable, str(HELPERS / "readonly_commit.py"), ws, base,
                 *(["wait"] if wait else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                env={"PATH": "/usr/bin:/bin", "HOME": user.pw_dir, "LANG": "C.UTF-8",
                     "PYTHONPATH": str(HELPERS.parent.parent),
                     **{k: v for k, v in os.environ.items() if k == "LOWLEVEL_NO_OVERLAY"}})
            assert proc.stdin is not None and proc.stdout is not None
            try:
                if wait:
                    first = proc.stdout.readline()
                    assert first == b"ready\n", (first, proc.stderr.read() if proc.stderr else b"")
                    remount()
                    proc.stdin.write(b"\n")
                    proc.stdin.flush()
                stdout, stderr = proc.communicate(timeout=240)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            assert proc.returncode == 0, stderr.decode()[-3000:]
            out = json.loads(stdout)
        if not out.get("cow"):
            pytest.skip("no copy-on-write overlay on this host: Session.commit() is unsupported")
        return out

    yield run
    for path in mounted:
        subprocess.run(["umount", path], check=False)
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def test_session_commit_into_a_read_only_directory_raises_workspace_error(run_scenario: Any) -> None:
    out = run_scenario(readonly="bind")
    assert out["exit_code"] == 0, out
    assert out["raised"] is not None and out["is_workspace_error"], out  # lowlevel's error, not a bare OSError
    assert out["errno"] == errno.EROFS, out
    assert "read-only" in out["message"].lower() and "\n" not in out["message"], out
    assert out["listing"] == ["a.txt"] and out["a"] == "a\n", out  # unchanged, no temporaries left
    assert out["diff_after"] == ["b.txt"], out  # the change stays in the session


def test_session_commit_into_a_writable_directory_lands_control(run_scenario: Any) -> None:
    out = run_scenario()
    assert out["raised"] is None and out["committed"] == ["b.txt"], out
    assert out["listing"] == ["a.txt", "b.txt"] and out["diff_after"] == [], out


def test_session_commit_after_the_file_system_turned_read_only_raises_workspace_error(run_scenario: Any) -> None:
    out = run_scenario(readonly="remount")
    assert out["exit_code"] == 0, out
    assert out["raised"] is not None and out["is_workspace_error"], out
    assert out["raised"] == "WorkspaceError", out  # nothing applied: not a CommitIncompleteError
    assert out["errno"] == errno.EROFS, out
    assert "read-only" in out["message"].lower() and "\n" not in out["message"], out
    assert out["saved_is_dir"], out  # the apply pass stopped: the changes were saved aside too
    assert out["listing"] == ["a.txt"] and out["a"] == "a\n", out
    assert out["diff_after"] == ["b.txt"], out
