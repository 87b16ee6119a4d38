"""Workspace creation and untrusted-output reading (no sandbox needed)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from lowlevel import WorkspaceError
from lowlevel.workspace import (create_workspace, diff, ensure_base, list_files, read_file, snapshot,
                                write_file)


def test_create_copies_inputs_and_is_all_or_nothing(tmp_path):
    (tmp_path / "a.py").write_text("print(1)")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.txt").write_text("x")
    base = tmp_path / "base"
    ws = create_workspace([tmp_path / "a.py", tmp_path / "dir"], base=str(base))
    assert sorted(os.listdir(ws)) == ["a.py", "dir"]
    assert Path(ws, "dir", "x.txt").read_text() == "x"
    before = set(os.listdir(base))
    with pytest.raises(WorkspaceError, match="does not exist"):
        create_workspace([tmp_path / "a.py", tmp_path / "missing"], base=str(base))
    assert set(os.listdir(base)) == before, "a half-made workspace was left behind"
    with pytest.raises(WorkspaceError, match="same name"):
        create_workspace([tmp_path / "a.py", tmp_path / "dir" / ".." / "a.py"], base=str(base))


@pytest.mark.parametrize("secret", ["/proc/self/environ", "/etc/shadow", "/proc/self", "link"])
def test_inputs_a_bind_would_refuse_are_refused_and_leave_no_workspace(tmp_path, secret):
    """A copy hands the sandbox what a read-only bind would: the caller's environment
    (/proc/self/environ), /etc/shadow, or a symlink to it, is refused as a bind source is."""
    if secret == "link":
        (tmp_path / "link").symlink_to("/etc/shadow")
        secret = str(tmp_path / "link")
    if not os.path.lexists(secret):
        pytest.skip(f"{secret} does not exist here")
    (tmp_path / "a.py").write_text("print(1)")
    base = tmp_path / "base"
    base.mkdir()
    with pytest.raises(WorkspaceError, match="is refused: it (overlaps|is inside)") as info:
        create_workspace([tmp_path / "a.py", secret], base=str(base))
    assert info.value.errno == errno.EACCES and "copy what it needs into a file" in str(info.value)
    assert os.listdir(base) == [], "a half-made workspace was left behind"
    # The control: the same call with a file of the caller's own copies it in.
    (tmp_path / "mine.txt").write_text("mine")
    ws = create_workspace([tmp_path / "a.py", tmp_path / "mine.txt"], base=str(base))
    assert sorted(os.listdir(ws)) == ["a.py", "mine.txt"]


def test_base_must_be_ours_and_not_a_symlink(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(WorkspaceError):
        ensure_base(str(link))
    if os.geteuid() == 0:
        squat = tmp_path / "squat"
        squat.mkdir()
        os.chown(squat, 65534, 65534)
        with pytest.raises(WorkspaceError, match="owned by uid 65534"):
            ensure_base(str(squat))


def test_read_file_refuses_symlinks_specials_hardlinks_and_big(tmp_path):
    ws = tmp_path
    (ws / "ok.txt").write_bytes(b"fine")
    (ws / "link").symlink_to("/etc/hostname")
    (ws / "dirlink").symlink_to("/etc")
    os.mkfifo(ws / "fifo")
    (ws / "big").write_bytes(b"x" * 100)
    (ws / "hard1").write_bytes(b"h")
    os.link(ws / "hard1", ws / "hard2")
    assert read_file(str(ws), "ok.txt") == b"fine"
    for rel in ("link", "dirlink/hostname", "fifo", "hard1", "../etc/passwd", "/etc/passwd", ""):
        with pytest.raises(WorkspaceError):
            read_file(str(ws), rel)
    with pytest.raises(WorkspaceError, match="cap"):
        read_file(str(ws), "big", max_bytes=10)


def test_write_file_never_through_symlink(tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("original")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "evil").symlink_to(target)
    (ws / "evildir").symlink_to(tmp_path)
    with pytest.raises(WorkspaceError):
        write_file(str(ws), "evil", b"pwned")
    with pytest.raises(WorkspaceError):
        write_file(str(ws), "evildir/outside.txt", b"pwned")
    assert target.read_text() == "original"
    write_file(str(ws), "sub/dir/new.txt", b"ok")
    assert (ws / "sub" / "dir" / "new.txt").read_bytes() == b"ok"


def test_snapshot_diff_and_listing(tmp_path):
    (tmp_path / "keep").write_text("1")
    (tmp_path / "change").write_text("1")
    (tmp_path / "gone").write_text("1")
    before = snapshot(str(tmp_path))
    (tmp_path / "change").write_text("22")
    (tmp_path / "gone").unlink()
    (tmp_path / "new").write_text("n")
    (tmp_path / "lnk").symlink_to("/")
    changes = diff(before, snapshot(str(tmp_path)))
    assert changes.added == ("lnk", "new") and changes.modified == ("change",) and changes.deleted == ("gone",)
    kinds = {e.path: e.kind for e in list_files(str(tmp_path))}
    assert kinds == {"keep": "file", "change": "file", "new": "file", "lnk": "symlink"}


def test_backslash_is_part_of_a_name(tmp_path):
    """A Linux name may hold a backslash: writing "a\\b" makes that one file, not a/b (issue 12
    item 4: records must restore names exactly)."""
    write_file(str(tmp_path), "a\\b", b"x")
    assert os.listdir(tmp_path) == ["a\\b"]
    assert read_file(str(tmp_path), "a\\b") == b"x"


@pytest.mark.parametrize("rel", [".", "./", "./."])
def test_a_workspace_path_naming_the_workspace_itself_says_so(tmp_path: Path, rel: str) -> None:
    """``--input f:.`` said "workspace path '.' must be relative, without '..'": it is both."""
    src = tmp_path / "f"
    src.write_text("x")
    with pytest.raises(WorkspaceError, match="names the workspace itself"):
        create_workspace([(str(src), rel)], base=str(tmp_path / "base"))


def test_write_file_replaces_the_file_whole(tmp_path):
    """write_file wrote in place (truncate, then write): a writer killed half-way left part of
    the new content and none of the old (16 MB of 40: a fresh-user trial). Now a new file
    replaces the name in one rename: an fd opened on the old file still reads all the old
    content, the name holds all the new, the mode is kept, and no temporary is left."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_bytes(b"old" * 1000)
    os.chmod(ws / "f", 0o600)
    before = os.stat(ws / "f").st_ino
    with open(ws / "f", "rb") as old:
        write_file(str(ws), "f", b"new" * 5000)
        assert old.read() == b"old" * 1000
    assert (ws / "f").read_bytes() == b"new" * 5000
    assert os.stat(ws / "f").st_ino != before and oct(os.stat(ws / "f").st_mode & 0o777) == oct(0o600)
    assert sorted(os.listdir(ws)) == ["f"]
    os.link(ws / "f", ws / "other")
    with pytest.raises(WorkspaceError) as err:
        write_file(str(ws), "f", b"x")
    assert err.value.errno == errno.EMLINK and (ws / "other").read_bytes() == b"new" * 5000
    assert sorted(os.listdir(ws)) == ["f", "other"]
