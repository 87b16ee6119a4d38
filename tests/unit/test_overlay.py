"""lowlevel.workspace.overlay on hand-made upper dirs: hostile uppers, the commit's reserved
names, leftovers, clear_dir (pure: no mount, no process; an upper dir is just a directory).

The change report read from real overlayfs uppers (a mount namespace, the unprivileged user
through runuser) is tests/integration/test_overlay_changes.py.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import pytest

from lowlevel import WorkspaceError
from lowlevel.workspace import overlay
from lowlevel.workspace import MAX_DEPTH

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
from overlay_lab import tree_state  # noqa: E402

IS_ROOT = os.geteuid() == 0


def _fds(*paths: Path) -> list[int]:
    return [os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in paths]


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
    """A PID no process has: above the kernel's ``pid_max`` (proc(5): PIDs never exceed it)."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


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
