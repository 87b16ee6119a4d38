"""lowlevel.workspace.overlay: the change report read from real overlayfs upper dirs, save_upper, leftovers.

The upper dirs are made by really mounting overlayfs (tests/helpers/overlay_lab.py) in a private
mount namespace: as root with trusted.overlay.* xattrs (``root``), and in the ``userxattr`` form
inside a user namespace, made by root (``userns``) and by the unprivileged test user through
runuser (``user``; the overlay calls then run as that user too). Hostile uppers that overlayfs
would never write are made by hand.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowlevel import WorkspaceError
from lowlevel.workspace import overlay
from lowlevel.workspace import MAX_DEPTH

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


def _fds(*paths: Path) -> list[int]:
    return [os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in paths]


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


# --- hand-made hostile uppers (no mount needed: an upper dir is just a directory) ------------


def _prefix() -> str:
    return "trusted.overlay." if IS_ROOT else "user.overlay."


def test_xattr_whiteout_and_opaque_x(tmp_path: Path):
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    (lower / "d").mkdir(parents=True)
    (lower / "d" / "gone").write_text("g")
    (lower / "d" / "stays").write_text("s")
    (upper / "d").mkdir(parents=True)
    (upper / "d" / "gone").write_bytes(b"")
    p = _prefix()
    os.setxattr(upper / "d" / "gone", p + "whiteout", b"")
    os.setxattr(upper / "d", p + "opaque", b"x")  # "x": holds xattr whiteouts, NOT opaque
    u, lo = _fds(upper, lower)
    try:
        ch = overlay.read_changes(u, lo, xattr_prefix=p)
    finally:
        os.close(u)
        os.close(lo)
    assert ch.deleted == ("d/gone",) and ch.added == () and ch.modified == ()


def test_redirect_and_metacopy_uppers_are_refused(tmp_path: Path):
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    lower.mkdir()
    (upper / "moved").mkdir(parents=True)
    p = _prefix()
    os.setxattr(upper / "moved", p + "redirect", b"/orig")
    u, lo = _fds(upper, lower)
    try:
        with pytest.raises(WorkspaceError, match="redirect_dir") as ei:
            overlay.read_changes(u, lo, xattr_prefix=p)
        assert ei.value.errno == errno.EOPNOTSUPP
        os.removexattr(upper / "moved", p + "redirect")
        with open(upper / "meta", "wb") as f:
            f.truncate(4096)  # size, no blocks: what a metacopy upper file looks like
        os.setxattr(upper / "meta", p + "metacopy", b"")
        with pytest.raises(WorkspaceError, match="metacopy"):
            overlay.read_changes(u, lo, xattr_prefix=p)
        with pytest.raises(WorkspaceError, match="metacopy"):
            overlay.commit(u, lo, xattr_prefix=p, since_ns=time.time_ns(), new_owner=None)
        assert os.listdir(lower) == []
    finally:
        os.close(u)
        os.close(lo)


def test_bad_prefix_is_a_clear_error(tmp_path: Path):
    (tmp_path / "u").mkdir()
    u, lo = _fds(tmp_path / "u", tmp_path)
    try:
        with pytest.raises(ValueError, match="xattr_prefix"):
            overlay.read_changes(u, lo, xattr_prefix="overlay.")
    finally:
        os.close(u)
        os.close(lo)


def test_symlinks_in_the_way_are_never_followed(tmp_path: Path):
    """Upper symlink where the lower has a directory; upper directory where the lower has a
    symlink to a directory outside: reported as kind changes; a commit replaces the link and
    writes nothing outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("p")
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    (lower / "realdir").mkdir(parents=True)
    (lower / "realdir" / "f").write_text("f")
    os.symlink(outside, lower / "esc")
    upper.mkdir()
    os.symlink("/etc", upper / "realdir")
    (upper / "esc").mkdir()
    (upper / "esc" / "precious").write_text("overwritten?")
    (upper / "esc" / "new").write_text("n")
    before_outside = tree_state(outside, ctime=True)
    u, lo = _fds(upper, lower)
    try:
        ch = overlay.read_changes(u, lo, xattr_prefix=_prefix())
        assert ch.modified == ("esc", "realdir")
        assert ch.added == ("esc/new", "esc/precious")
        rep = overlay.commit(u, lo, xattr_prefix=_prefix(), since_ns=time.time_ns(), new_owner=None)
    finally:
        os.close(u)
        os.close(lo)
    assert rep.changes.modified == ("esc", "realdir")
    assert tree_state(outside, ctime=True) == before_outside
    assert os.readlink(lower / "realdir") == "/etc"
    assert (lower / "esc").is_dir() and not (lower / "esc").is_symlink()
    assert (lower / "esc" / "precious").read_text() == "overwritten?"


def test_deep_upper_is_capped_not_crashing(tmp_path: Path):
    """An upper nested deeper than MAX_DEPTH (300 levels): the report is marked incomplete, the
    commit applies down to the cap and skips the rest with a reason. No RecursionError, no
    fd exhaustion."""
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    lower.mkdir()
    upper.mkdir()
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(300):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w").close()
    os.close(fd)
    u, lo = _fds(upper, lower)
    try:
        ch = overlay.read_changes(u, lo, xattr_prefix=_prefix())
        assert not ch.complete
        assert len(ch.added) == MAX_DEPTH + 1
        rep = overlay.commit(u, lo, xattr_prefix=_prefix(), since_ns=time.time_ns(), new_owner=None)
    finally:
        os.close(u)
        os.close(lo)
    assert len(rep.skipped) == 1 and "levels deep" in rep.skipped[0][1]
    assert rep.skipped[0][0].count("/") == MAX_DEPTH
    assert not [n for n in os.listdir(lower) if n.startswith(overlay.LEFTOVER_PREFIX)]


@pytest.mark.slow
def test_100k_entry_upper_report(tmp_path: Path):
    """A 100,000-entry upper (all new files): read_changes reports them all; time printed."""
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    lower.mkdir()
    upper.mkdir()
    for i in range(100):
        d = upper / f"d{i:03}"
        d.mkdir()
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        for j in range(999):
            os.close(os.open(f"f{j}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        os.close(fd)
    u, lo = _fds(upper, lower)
    try:
        t0 = time.perf_counter()
        ch = overlay.read_changes(u, lo, xattr_prefix=_prefix(), limit=200_000)
        elapsed = time.perf_counter() - t0
    finally:
        os.close(u)
        os.close(lo)
    print(f"read_changes of a 100,000-entry upper: {elapsed * 1000:.0f} ms")
    assert len(ch.added) == 100_000 and ch.complete


# --- leftovers -------------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_cleanup_removes_dead_commits_leftovers_only(tmp_path: Path):
    ws = tmp_path / "ws"
    (ws / "sub" / "deeper").mkdir(parents=True)
    (ws / "user-file").write_text("mine")
    dead, live = _dead_pid(), os.getpid()
    pre = overlay.LEFTOVER_PREFIX
    (ws / f"{pre}{dead}.journal").write_bytes(b"\0sub/deeper\0")
    (ws / f"{pre}{dead}-1").write_text("half-written")
    (ws / "sub" / "deeper" / f"{pre}{dead}-7").mkdir()
    (ws / "sub" / "deeper" / f"{pre}{dead}-7" / "x").write_text("half-built dir")
    (ws / "sub" / "deeper" / f"{pre}{live}-8").write_text("a live commit's")
    (ws / f"{pre}{live}-2").write_text("a live commit's")
    (ws / f"{pre}notapid").write_text("not ours")
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    try:
        removed = overlay.cleanup_commit_leftovers(fd)
    finally:
        os.close(fd)
    assert removed == sorted([f"{pre}{dead}-1", f"{pre}{dead}.journal", f"sub/deeper/{pre}{dead}-7"])
    assert sorted(os.listdir(ws)) == sorted([f"{pre}{live}-2", f"{pre}notapid", "sub", "user-file"])
    assert os.listdir(ws / "sub" / "deeper") == [f"{pre}{live}-8"]


def test_reserved_names_in_the_upper_are_not_committed(tmp_path: Path):
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    lower.mkdir()
    upper.mkdir()
    (upper / f"{overlay.LEFTOVER_PREFIX}1-1").write_text("would be cleaned up as ours")
    (upper / "ok").write_text("ok")
    u, lo = _fds(upper, lower)
    try:
        rep = overlay.commit(u, lo, xattr_prefix=_prefix(), since_ns=time.time_ns(), new_owner=None)
    finally:
        os.close(u)
        os.close(lo)
    assert os.listdir(lower) == ["ok"]
    assert rep.skipped[0][0] == f"{overlay.LEFTOVER_PREFIX}1-1" and "reserved" in rep.skipped[0][1]


def test_clear_dir_empties_a_deep_tree_without_following_links(tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    up = tmp_path / "upper"
    deep = up
    for _ in range(MAX_DEPTH + 20):
        deep = deep / "d"
    os.makedirs(deep)
    (deep / "f").write_text("f")
    os.symlink(outside, up / "link")
    (up / "ro").mkdir()
    (up / "ro" / "x").write_text("x")
    os.chmod(up / "ro", 0o500)
    fd = os.open(up, os.O_RDONLY | os.O_DIRECTORY)
    try:
        overlay.clear_dir(fd)
    finally:
        os.close(fd)
    assert os.listdir(up) == [] and os.listdir(outside) == ["keep"]


def test_lab_error_is_reported(lab: Lab):
    with pytest.raises(LabError) as ei:
        lab.call("changes", prefix="bogus.")
    assert ei.value.kind == "ValueError"
