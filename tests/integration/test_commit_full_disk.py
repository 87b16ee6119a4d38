"""Issue 23 item 2: a commit onto a host filesystem that cannot take the run's changes fails
(CommitIncompleteError, a WorkspaceError; the CLI exits 125 with one line), keeps the tree
consistent (what was applied stays, whole; no temporaries), saves the run's changes aside at the
path it names with the list of what was not applied, and ``Result.changes`` claims only what is
on disk. Before, the entries that did not fit were skipped and saved nowhere, and the CLI exited 0.

Small filesystems, mounted by the test (root) in a temp dir and unmounted at teardown: a tmpfs out
of bytes (``size=``), a tmpfs out of inodes (``nr_inodes=``), and an ext4 loop image when
``mkfs.ext4`` is present; for the unprivileged test user, the tmpfs is chowned to it. The saved
copy goes to ``LOWLEVEL_WORKSPACE_BASE``, on the main disk.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bwrap, pytest.mark.root, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
MKFS_EXT4 = shutil.which("mkfs.ext4") or ("/sbin/mkfs.ext4" if os.path.exists("/sbin/mkfs.ext4") else None)
#: 40 files of 16 KiB, written by the program: 640 KiB, more than the small filesystems hold.
PROGRAM = ["sh", "-c", "for i in $(seq 1 40); do head -c 16384 /dev/zero | tr '\\0' \"$i\" > f$i; done; "
           "rm gone; echo ran"]
NAMES = {f"f{i}" for i in range(1, 41)}


@pytest.fixture
def place() -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="lowlevel-full-disk-"))
    os.chmod(top, 0o711)
    (top / "mnt").mkdir()
    yield top
    subprocess.run(["umount", "-l", str(top / "mnt")], capture_output=True)
    shutil.rmtree(top, ignore_errors=True)


def _mount(place: Path, kind: str) -> None:
    mnt = place / "mnt"
    if kind == "tmpfs-bytes":
        opts = "size=256k,mode=0755"
    elif kind == "tmpfs-inodes":
        opts = "size=4m,nr_inodes=24,mode=0755"
    else:
        if MKFS_EXT4 is None:
            pytest.skip("mkfs.ext4 is not installed")
        img = place / "ext4.img"
        with open(img, "wb") as f:
            f.truncate(2 << 20)
        subprocess.run([MKFS_EXT4, "-q", "-F", "-b", "1024", "-m", "0", "-N", "64", "-O", "^has_journal",
                        str(img)], check=True, capture_output=True)
        p = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a loop image here: {p.stderr.decode().strip()}")
        # Fill all but ~300 KiB, so the 640 KiB of the run do not fit.
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        if free > 300 << 10:
            with open(mnt / "ballast", "wb") as f:
                f.write(b"\1" * (free - (300 << 10)))
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], check=True)


def _workspace(place: Path, user: pwd.struct_passwd | None) -> tuple[Path, Path]:
    ws = place / "mnt" / "W"
    ws.mkdir()
    (ws / "gone").write_text("to be deleted\n")
    (ws / "kept").write_text("untouched\n")
    base = place / "base"
    base.mkdir()
    for p in (ws, ws / "gone", ws / "kept", base):
        if user is not None:
            os.chown(p, user.pw_uid, user.pw_gid)
    os.chmod(ws, 0o755)
    return ws, base


_API = r"""
import json, sys
import lowlevel
ws = sys.argv[1]
try:
    r = lowlevel.run(json.loads(sys.argv[2]), workspace=ws)
    print(json.dumps({"ok": True, "exit": r.exit_code, "added": list(r.changes.added)}))
except lowlevel.CommitIncompleteError as err:
    r = err.result
    print(json.dumps({"ok": False, "type": type(err).__name__, "errno": err.errno, "message": str(err),
                      "saved": err.saved_upper, "not_applied": list(err.not_applied),
                      "applied": list(err.applied.added), "deleted": list(err.applied.deleted),
                      "result_added": list(r.changes.added), "result_deleted": list(r.changes.deleted),
                      "exit": r.exit_code, "stdout": r.stdout.decode(), "notes": list(r.notes)}))
"""


def _env(base: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LOWLEVEL_WORKSPACE_BASE": str(base),
            "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)}


def _as(user: pwd.struct_passwd | None, env: dict[str, str], argv: list[str]) -> list[str]:
    if user is None:
        return argv
    return [RUNUSER, "-u", user.pw_name, "--", "env", *(f"{k}={v}" for k, v in env.items()), *argv]


def _check_tree(ws: Path, applied: set[str]) -> None:
    """Consistent: each applied file is whole (16 KiB of its digit), nothing else of the run's is
    there, no temporaries, the untouched file as it was."""
    names = set(os.listdir(ws)) - {"gone", "kept", "lost+found"}
    assert not [n for n in os.listdir(ws) if n.startswith(".lowlevel-commit-")], os.listdir(ws)
    assert names == applied, (sorted(names), sorted(applied))
    for n in names:  # f7 holds 16384 "7"s; f12 (tr maps NUL to the first character) "1"s
        assert (ws / n).read_bytes() == n[1].encode() * 16384, n
    assert (ws / "kept").read_text() == "untouched\n"


def _check_saved(saved: str, not_applied: list[str]) -> None:
    tree = Path(saved) / "tree"
    assert NAMES <= set(os.listdir(tree)), sorted(os.listdir(tree))  # the run's whole change set
    for n in NAMES:
        assert (tree / n).stat().st_size == 16384
    listed = (Path(saved) / "not-applied").read_bytes().split(b"\0")[:-1]
    assert sorted(os.fsdecode(x) for x in listed) == sorted(not_applied)
    assert (Path(saved) / "whiteouts").read_bytes() == b"gone\0"


@pytest.mark.parametrize("kind", ["tmpfs-bytes", "tmpfs-inodes", "ext4"])
@pytest.mark.parametrize("identity", ["root", "user"])
def test_commit_onto_a_full_filesystem_fails_and_saves_the_rest(identity: str, kind: str, place: Path,
                                                                request: pytest.FixtureRequest) -> None:
    user = request.getfixturevalue("test_user") if identity == "user" else None
    _mount(place, kind)
    ws, base = _workspace(place, user)
    env = _env(base)
    p = subprocess.run(_as(user, env, [sys.executable, "-c", _API, str(ws), json.dumps(PROGRAM)]), env=env,
                       cwd="/", capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    got = json.loads(p.stdout)
    assert got["ok"] is False, got  # never a normal return
    assert got["type"] == "CommitIncompleteError" and got["errno"] in (28, 122, 27), got  # ENOSPC EDQUOT EFBIG
    assert got["exit"] == 0 and got["stdout"] == "ran\n", got  # the program's result is still there
    applied = {a for a in got["applied"]}
    assert got["result_added"] == got["applied"], got  # Result.changes claims only what was applied
    assert applied < NAMES, got
    assert sorted(set(NAMES) - applied) == sorted(set(got["not_applied"]) - {"gone"}), got
    assert got["saved"] and got["saved"] in got["message"] and "not applied" in got["message"], got
    assert "were applied and are kept" in got["message"], got
    _check_tree(ws, applied)
    assert ("gone" in got["deleted"]) == (not (ws / "gone").exists()), got
    _check_saved(got["saved"], got["not_applied"])


@pytest.mark.parametrize("identity", ["root", "user"])
def test_cli_exits_125_with_one_line(identity: str, place: Path, request: pytest.FixtureRequest) -> None:
    user = request.getfixturevalue("test_user") if identity == "user" else None
    _mount(place, "tmpfs-bytes")
    ws, base = _workspace(place, user)
    env = _env(base)
    p = subprocess.run(_as(user, env, [sys.executable, "-m", "lowlevel", "run", "--workspace", str(ws), "--",
                                       *PROGRAM]), env=env, cwd="/", capture_output=True, timeout=120)
    assert p.returncode == 125, p.stderr
    assert p.stdout == b"ran\n"
    lines = p.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowlevel: commit stopped part-way: No space left on device"), lines
    saved = lines[0].split("saved to ")[1].split(" ")[0]
    listed = {os.fsdecode(x) for x in (Path(saved) / "not-applied").read_bytes().split(b"\0")[:-1]}
    present = set(os.listdir(ws)) - {"gone", "kept"}
    assert listed - {"gone"} == NAMES - present and present < NAMES, (sorted(listed), sorted(present))


def test_control_the_same_run_fits_on_a_bigger_filesystem(place: Path) -> None:
    """Control: with room (a 4 MiB tmpfs) the same run commits everything and returns normally."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(place / "mnt")], check=True)
    ws, base = _workspace(place, None)
    env = _env(base)
    p = subprocess.run([sys.executable, "-c", _API, str(ws), json.dumps(PROGRAM)], env=env, cwd="/",
                       capture_output=True, timeout=120)
    got = json.loads(p.stdout)
    assert got["ok"] and sorted(got["added"]) == sorted(NAMES), got
    assert set(os.listdir(ws)) == NAMES | {"kept"}


def test_session_commit_onto_a_full_filesystem_raises(place: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Session.commit() (the shared commit) raises the same error instead of returning, and its
    reset does not throw the unapplied changes away: they are saved at the named path."""
    import lowlevel
    _mount(place, "tmpfs-bytes")
    ws, base = _workspace(place, None)
    monkeypatch.setenv("LOWLEVEL_WORKSPACE_BASE", str(base))
    with lowlevel.Session(workspace=ws) as s:
        assert s.run(PROGRAM).exit_code == 0
        with pytest.raises(lowlevel.CommitIncompleteError) as info:
            s.commit()
        err = info.value
        assert isinstance(err, lowlevel.WorkspaceError) and err.saved_upper
        assert err.saved_upper in str(err)
        _check_saved(err.saved_upper, list(err.not_applied))
        _check_tree(ws, set(err.applied.added))
        # The session goes on over the directory as it now is: nothing left to re-apply, so
        # the final commit of close() has nothing that conflicts with what was applied.
        assert not s.diff().added and s.run(["true"]).exit_code == 0
