"""lowlevel.workspace.overlay.upper_is_empty and the commit it skips, on hand-made upper dirs
(pure: no mount, no process; an upper dir is just a directory)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from lowlevel.workspace import Changes, overlay

IS_ROOT = os.geteuid() == 0
PREFIX = "trusted.overlay." if IS_ROOT else "user.overlay."


def _dead_leftover() -> str:
    return f".lowlevel-commit-{int(Path('/proc/sys/kernel/pid_max').read_text()) + 1}-1"


def _dir_fd(p: Path, flags: int = os.O_RDONLY) -> int:
    return os.open(p, flags | os.O_DIRECTORY)


def test_empty_and_not(tmp_path: Path) -> None:
    up = tmp_path / "u"
    up.mkdir()
    fd, path_fd = _dir_fd(up), _dir_fd(up, os.O_PATH)
    try:
        assert overlay.upper_is_empty(fd) and overlay.upper_is_empty(path_fd)
        os.setxattr(up, PREFIX + "opaque", b"y")  # the root's own metadata is never a change
        assert overlay.upper_is_empty(fd)
        (up / "gone").write_bytes(b"")  # any entry (here an xattr-whiteout candidate) counts
        assert not overlay.upper_is_empty(fd) and not overlay.upper_is_empty(path_fd)
        os.unlink(up / "gone")
        (up / "d").mkdir()  # an (opaque) directory is an entry
        assert not overlay.upper_is_empty(fd)
        os.lseek(fd, 0, os.SEEK_SET)
        assert sorted(os.listdir(fd)) == ["d"]  # the caller's fd is not consumed
    finally:
        os.close(fd)
        os.close(path_fd)


@pytest.mark.skipif(not IS_ROOT, reason="a 0/0 character device (overlayfs's whiteout) needs CAP_MKNOD")
def test_a_whiteout_alone_is_not_empty(tmp_path: Path) -> None:
    up = tmp_path / "u"
    up.mkdir()
    os.mknod(up / "f", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    fd = _dir_fd(up)
    try:
        assert not overlay.upper_is_empty(fd)
    finally:
        os.close(fd)


def _commit(up: Path, lo: Path) -> overlay.CommitReport:
    u, low = _dir_fd(up), _dir_fd(lo)
    try:
        return overlay.commit_upper(u, low, xattr_prefix=PREFIX, since_ns=time.time_ns(), new_owner=None,
                                    upper_bytes=1 << 20, save_to=lambda: str(up.parent / "saved"),
                                    keep_upper=False)
    finally:
        os.close(u)
        os.close(low)


def test_commit_of_an_empty_upper_touches_nothing(tmp_path: Path) -> None:
    up, lo = tmp_path / "u", tmp_path / "lo"
    up.mkdir()
    lo.mkdir()
    (lo / _dead_leftover()).write_text("x")
    report = _commit(up, lo)
    assert report.changes == Changes()
    assert not (report.changes.added or report.changes.modified or report.changes.deleted)
    assert os.listdir(lo) == [_dead_leftover()]  # not even swept: no commit ran


def test_control_commit_of_a_written_upper_sweeps_and_applies(tmp_path: Path) -> None:
    up, lo = tmp_path / "u", tmp_path / "lo"
    up.mkdir()
    lo.mkdir()
    (lo / _dead_leftover()).write_text("x")
    (up / "new").write_text("n")
    report = _commit(up, lo)
    assert report.changes.added == ("new",)
    assert os.listdir(lo) == ["new"]


def test_bad_prefix_still_refused_for_an_empty_upper(tmp_path: Path) -> None:
    (tmp_path / "u").mkdir()
    u = _dir_fd(tmp_path / "u")
    try:
        with pytest.raises(ValueError, match="xattr_prefix"):
            overlay.commit_upper(u, u, xattr_prefix="overlay.", since_ns=0, new_owner=None, upper_bytes=1,
                                 save_to=str, keep_upper=False)
    finally:
        os.close(u)
