"""lowlevel.workspace.overlay: the change report read from real overlayfs upper dirs and save_upper.

The upper dirs are made by really mounting overlayfs (tests/helpers/overlay_lab.py) in a private
mount namespace: as root with trusted.overlay.* xattrs (``root``), and in the ``userxattr`` form
inside a user namespace, made by root (``userns``) and by the unprivileged test user through
runuser (``user``; the overlay calls then run as that user too). The lab starts processes
(unshare, runuser), so these tests are here and not in tests/unit (moved from
tests/unit/test_overlay.py, whose hand-made hostile uppers need no mount and stay there).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lowlevel.workspace import overlay

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
from overlay_lab import (SCENARIO_CHANGES, SCENARIO_OPS, SCENARIO_PY, Lab, LabError,  # noqa: E402
                         make_scenario_lower, tree_state)

IS_ROOT = os.geteuid() == 0
MODES = ["root", "userns", "user"] if IS_ROOT else ["userns"]


@pytest.fixture(params=MODES)
def lab(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "user":
        request.getfixturevalue("test_user")
    lab = Lab(request.param, parent=tmp_path)
    yield lab
    lab.remove()



def test_read_changes_classifies_every_kind_of_change(lab: Lab):
    """Create, modify, append, chmod, setuid, delete file/dir, rm -rf, mv file, mv dir (EXDEV
    fallback: whiteout + copy), opaque dir with recreated children, kind changes both ways,
    symlinks, hard links, fifo, user xattrs: exactly the expected added/modified/deleted."""
    make_scenario_lower(lab.lower)
    lab.chown_all()
    lab.run(sh=SCENARIO_OPS + "head -c 1048576 /dev/zero > big.bin\n", py=SCENARIO_PY)
    ch = lab.call("changes")
    assert ch["added"] == sorted(SCENARIO_CHANGES["added"] + ["big.bin"])
    assert ch["modified"] == SCENARIO_CHANGES["modified"]
    assert ch["deleted"] == SCENARIO_CHANGES["deleted"]
    assert ch["complete"] is True
    # bytes_written: what the upper allocates, at least the 1 MiB file, each hard link once
    assert 1 << 20 <= ch["bytes_written"] < (1 << 20) + 200 * 4096


def test_read_changes_and_discard_leave_lower_bit_identical(lab: Lab):
    """Not committing: the lower tree is bit-identical afterwards (content, mode, owner, xattrs,
    inode, ctime, mtime, nlink, size of every entry), and read_changes changes neither side."""
    make_scenario_lower(lab.lower)
    os.setxattr(lab.lower / "x.txt", "user.orig", b"1")
    lab.chown_all()
    before = tree_state(lab.lower, ctime=True)
    lab.run(sh=SCENARIO_OPS, py=SCENARIO_PY)
    upper_before = tree_state(lab.upper, ctime=True)
    lab.call("changes")
    assert tree_state(lab.lower, ctime=True) == before
    assert tree_state(lab.upper, ctime=True) == upper_before


def test_renames_are_delete_plus_add_and_nothing_else_changes(lab: Lab):
    (lab.lower / "src").mkdir()
    (lab.lower / "src" / "m.py").write_text("m")
    (lab.lower / "other.txt").write_text("o")
    lab.chown_all()
    lab.run(sh="mv src dst; mv other.txt other2.txt")
    ch = lab.call("changes")
    assert ch["deleted"] == ["other.txt", "src"]
    assert ch["added"] == ["dst", "dst/m.py", "other2.txt"]
    assert ch["modified"] == []


def test_dir_in_both_is_modified_only_when_its_mode_changed(lab: Lab):
    for d in ("same", "chmodded"):
        (lab.lower / d).mkdir()
        (lab.lower / d / "f").write_text("f")
    lab.chown_all()
    lab.run(sh="echo n > same/new; chmod 0750 chmodded")
    ch = lab.call("changes")
    assert ch["added"] == ["same/new"]
    assert ch["modified"] == ["chmodded"]


def test_non_utf8_names_are_kept_as_surrogate_strings(lab: Lab):
    (lab.lower / os.fsdecode(b"old\xff")).write_text("o")
    lab.chown_all()
    lab.run(py="open(b'new\\xfe\\n', 'w').write('n')\nimport os\nos.unlink(b'old\\xff')\n"
               "os.mkdir(b'dir\\x80')\nopen(b'dir\\x80/in\\xc3', 'w').close()\n")
    ch = lab.call("changes")
    assert ch["added"] == sorted([os.fsdecode(b"dir\x80"), os.fsdecode(b"dir\x80/in\xc3"), os.fsdecode(b"new\xfe\n")])
    assert ch["deleted"] == [os.fsdecode(b"old\xff")]
    assert os.fsencode(ch["deleted"][0]) == b"old\xff"


def test_save_upper_keeps_changes_aside_sanitised(lab: Lab, tmp_path: Path):
    make_scenario_lower(lab.lower)
    lab.chown_all()
    lab.run(sh=SCENARIO_OPS + "chmod 4755 new.txt\n", py=SCENARIO_PY)
    dest = Path(lab.base / "saved")
    dest.mkdir()
    lab.chown_all(dest)
    saved = Path(lab.call("save", dest=str(dest))["path"])
    assert saved.parent == dest and oct(saved.stat().st_mode & 0o777) == "0o700"
    wh = sorted(overlay.iter_saved_list(str(saved / overlay.SAVED_WHITEOUTS)))
    assert wh == ["b.txt", "c.txt", "dir1/x", "mvdir", "tree"]
    assert sorted(overlay.iter_saved_list(str(saved / overlay.SAVED_OPAQUE))) == ["f2d", "opq"]
    skipped = (saved / overlay.SAVED_SKIPPED).read_bytes().split(b"\0")
    assert skipped[0] == b"fifo" and b"fifo" in skipped[1]
    tree = saved / "tree"
    assert (tree / "a.txt").read_text() == "a\nmore\n"
    assert os.readlink(tree / "newlink") == "/etc/passwd"
    assert not (tree / "fifo").exists()
    assert (tree / "new.txt").stat().st_mode & 0o7777 == 0o755  # setuid and o+w gone
    assert (tree / "setuid.bin").stat().st_mode & 0o7000 == 0
    assert (tree / "h1").stat().st_ino == (tree / "h2").stat().st_ino
    assert os.getxattr(tree / "x.txt", "user.k") == b"v"
    assert not any(a.startswith("user.overlay.") for p in tree.rglob("*") if not p.is_symlink()
                   for a in os.listxattr(p))
    assert (tree / "mvdir2" / "q" / "r").read_text() == "r"



def test_lab_error_is_reported(lab: Lab):
    with pytest.raises(LabError) as ei:
        lab.call("changes", prefix="bogus.")
    assert ei.value.kind == "ValueError"
