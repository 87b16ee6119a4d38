"""Red-team finding 3: a system or home directory as the workspace is refused before anything
touches it (``lowlevel run --workspace /root`` as root chowned 256k entries to 65534 and back)."""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import lowlevel
from lowlevel import WorkspaceError
from lowlevel import cli as _cli
from lowlevel.cli import run_cmd
from lowlevel.workspace import check_workspace_path, workspace_refusal

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]

REFUSED = ["/", "/root", "/etc", "/etc/ssh", "/usr", "/usr/lib", "/bin", "/var", "/var/lib", "/tmp", "/home", "/opt",
           "/proc", "/sys", "/dev", "/run", "/boot", "/srv"]


def _tree_state(path: str) -> tuple[tuple[int, int, int, int], ...]:
    """(uid, gid, mode, ctime_ns) of path and its direct entries: a chown or chmod changes ctime."""
    out = []
    for p in [path] + sorted(os.path.join(path, n) for n in os.listdir(path))[:50]:
        st = os.lstat(p)
        out.append((st.st_uid, st.st_gid, st.st_mode, st.st_ctime_ns))
    return tuple(out)


@pytest.mark.parametrize("path", REFUSED)
def test_system_dirs_refused(path: str) -> None:
    if not os.path.isdir(path):
        pytest.skip(f"{path} does not exist here")
    assert workspace_refusal(os.path.realpath(path)) is not None
    with pytest.raises(WorkspaceError) as info:
        check_workspace_path(os.path.realpath(path))
    assert info.value.errno == errno.EPERM and "allow_sensitive_workspace=True" in str(info.value)
    check_workspace_path(os.path.realpath(path), allow_sensitive=True)  # the explicit override


@pytest.mark.root
def test_run_with_root_home_refused_before_touching_it() -> None:
    """The attack: ``lowlevel.run(workspace="/root")`` as root; now nothing under /root changes."""
    before = _tree_state("/root")
    with pytest.raises(WorkspaceError) as info:
        lowlevel.run(["true"], workspace="/root", inputs=[__file__])
    assert info.value.errno == errno.EPERM and "home directory /root" in str(info.value)
    assert _tree_state("/root") == before
    assert not os.path.exists(os.path.join("/root", os.path.basename(__file__)))  # no input copied in


@pytest.mark.root
def test_symlink_to_system_dir_refused(tmp_path: Path) -> None:
    link = tmp_path / "ws"
    link.symlink_to("/etc")
    with pytest.raises(WorkspaceError) as info:
        lowlevel.run(["true"], workspace=str(link))
    assert info.value.errno in (errno.EPERM, errno.ENOTDIR)


@pytest.mark.root
def test_home_dir_refused_and_project_dir_inside_accepted(test_user: pwd.struct_passwd) -> None:
    home = os.path.realpath(test_user.pw_dir)
    with pytest.raises(WorkspaceError, match="home directory"):
        lowlevel.run(["true"], workspace=home)
    # Control: a project directory inside a home is a fine workspace (when reachable).
    project = tempfile.mkdtemp(prefix="lowlevel-project-", dir="/tmp")
    try:
        os.chmod(project, 0o755)
        assert workspace_refusal(project) is None
        r = lowlevel.run(["sh", "-c", "echo ok > out"], workspace=project)
        assert r.exit_code == 0 and Path(project, "out").read_text() == "ok\n"
    finally:
        shutil.rmtree(project)


def test_cli_refuses_and_names_the_override() -> None:
    proc = subprocess.run([sys.executable, "-m", "lowlevel", "run", "--workspace", "/etc", "--", "true"],
                          capture_output=True, cwd=str(REPO), timeout=60)
    assert proc.returncode == 125
    assert b"refusing workspace /etc" in proc.stderr and b"--allow-sensitive" in proc.stderr


def test_cli_allow_sensitive_reaches_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """--allow-sensitive is passed on as allow_sensitive_workspace=True (not run here: it would
    hand /etc over)."""
    seen: dict[str, object] = {}

    def fake_run(command: list[str], **kwargs: object) -> lowlevel.Result:
        seen.update(kwargs)
        raise lowlevel.LowlevelError("stop")

    monkeypatch.setattr(run_cmd, "run", fake_run)
    assert _cli.main(["run", "--workspace", "/etc", "--allow-sensitive", "--", "true"]) == 125
    assert seen["allow_sensitive_workspace"] is True
    assert _cli.main(["run", "--workspace", "/etc", "--", "true"]) == 125
    assert seen["allow_sensitive_workspace"] is False


@pytest.mark.root
def test_record_run_refuses_before_copying_inputs(tmp_path: Path) -> None:
    before = _tree_state("/root")
    with pytest.raises(WorkspaceError):
        lowlevel.run(["true"], workspace="/root", inputs=[__file__], record=str(tmp_path / "r.json"))
    assert _tree_state("/root") == before
