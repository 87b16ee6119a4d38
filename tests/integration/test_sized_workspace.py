"""(The fallback workspace model: LOWLEVEL_NO_OVERLAY, see the handover_model fixture.) Limits(workspace_bytes=N): the run's total disk use is bounded, results copied back safely."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import lowlevel

pytestmark = [pytest.mark.bwrap, pytest.mark.usefixtures("handover_model")]


def _mounts() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(".sized-" in line for line in f)


@pytest.mark.root
def test_total_disk_use_is_bounded_and_results_come_back(tmp_path):
    src = tmp_path / "data.txt"
    src.write_text("input\n")
    # Control: without a total, 40 files of 1 MiB each fit (RLIMIT_FSIZE is per file).
    fill = "for i in $(seq 40); do head -c 1048576 /dev/zero > f$i || exit 9; done; echo filled"
    free = lowlevel.run(["sh", "-c", fill], policy=lowlevel.Policy(limits=lowlevel.Limits(fsize_bytes=2 << 20)))
    assert free.stdout == b"filled\n"
    policy = lowlevel.Policy(limits=lowlevel.Limits(fsize_bytes=2 << 20, workspace_bytes=4 << 20))
    r = lowlevel.run(["sh", "-c", f"cat data.txt; echo out > result.txt; {fill}"], policy=policy,
                     inputs=[str(src)])
    assert r.exit_code == 9, r.stderr
    assert b"No space left on device" in r.stderr and r.stdout == b"input\n"
    ws = Path(r.workspace)
    total = sum(p.stat().st_size for p in ws.iterdir() if p.is_file())
    assert total <= 4 << 20
    assert (ws / "result.txt").read_text() == "out\n"
    assert "result.txt" in r.changes.added and "data.txt" not in r.changes.modified
    assert _mounts() == 0, "the tmpfs was left mounted"
    assert not [d for d in os.listdir(ws.parent) if d.startswith((".sized-", ".copyback-"))]


@pytest.mark.root
def test_copy_back_is_untrusted():
    policy = lowlevel.Policy(limits=lowlevel.Limits(workspace_bytes=1 << 20))
    r = lowlevel.run(["sh", "-c", "mkfifo pipe; ln -s /etc/shadow link; mkdir d; echo x > d/f; chmod 700 d"],
                     policy=policy)
    ws = Path(r.workspace)
    assert not (ws / "pipe").exists(), "a fifo was copied back"
    assert (ws / "link").is_symlink() and os.readlink(ws / "link") == "/etc/shadow"
    assert (ws / "d" / "f").read_text() == "x\n"
    assert all(os.lstat(p).st_uid == 0 for p in (ws / "link", ws / "d", ws / "d" / "f"))


def test_unprivileged_caller_gets_unsupported_error(sandbox):
    if not sandbox.user and os.geteuid() == 0:
        pytest.skip("root can mount: covered above")
    r = sandbox.run(["true"], limits={"workspace_bytes": 1 << 20})
    assert r.error == "UnsupportedError" and "root" in r.message


def test_cli_flag(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    p = subprocess.run([sys.executable, "-m", "lowlevel", "run", "--workspace-size", "1M", "--rm", "--",
                        "sh", "-c", "head -c 2000000 /dev/zero > big"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "No space left" in p.stderr


@pytest.fixture
def wsparent():
    """A 0755 directory under /tmp (the sandbox's uid must traverse to the workspace)."""
    path = Path(tempfile.mkdtemp(prefix="lowlevel-sized-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _du(path: Path) -> int:
    """Bytes allocated on the host below path, each inode once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


@pytest.mark.root
def test_copy_back_keeps_hard_links_and_holes_within_the_budget(wsparent):
    """Red team: 200 hard links and a 300M sparse file in a 2 MiB tmpfs became 504 MB on the host."""
    attack = ("head -c 1048576 /dev/urandom > big && for i in $(seq 200); do ln big l$i; done && "
              "truncate -s 300M sparse && printf x | dd of=sparse bs=1 seek=1000 conv=notrunc 2>/dev/null && "
              "head -c 900000 /dev/urandom > fits && stat -c %h big && du -k sparse | cut -f1")
    ws = wsparent / "ws"
    ws.mkdir()
    r = lowlevel.run(["sh", "-c", attack], workspace=str(ws),
                     policy=lowlevel.Policy(limits=lowlevel.Limits(workspace_bytes=2 << 20)))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split()[0] == b"201"  # control: the links and the hole exist inside
    assert int(r.stdout.split()[1]) < 100
    assert os.lstat(ws / "big").st_nlink == 201 and os.path.samefile(ws / "big", ws / "l200")
    with open(ws / "sparse", "rb") as f:
        f.seek(1000)
        assert f.read(1) == b"x"
    assert os.lstat(ws / "sparse").st_size == 300 << 20
    assert _du(ws) < 3 << 20, _du(ws)
    assert (ws / "fits").stat().st_size == 900000


@pytest.mark.root
def test_copy_back_budget_skips_what_does_not_fit(tmp_path):
    """Unit check of the byte budget: whatever the tmpfs held, the host gets at most N data bytes."""
    from lowlevel.sizedws import _Copier
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "a").write_bytes(b"a" * 600)
    (src / "b").write_bytes(b"b" * 600)
    c = _Copier(owners={}, new_owner=(0, 0), budget=1000)
    c.copy(str(src), str(dst))
    assert sorted(os.listdir(dst)) == ["a"]
    assert c.skipped == ["b"] and "b" in c.notes()[0]


@pytest.mark.root
def test_tmpfs_inodes_are_bounded():
    policy = lowlevel.Policy(limits=lowlevel.Limits(workspace_bytes=1 << 20))
    r = lowlevel.run(["sh", "-c", "i=0; while [ $i -lt 3000 ]; do touch e$i || exit 7; i=$((i+1)); done"],
                     policy=policy)
    try:
        assert r.exit_code == 7 and b"No space left" in r.stderr, r.stderr
        assert len(os.listdir(r.workspace)) < 1100
    finally:
        shutil.rmtree(r.workspace, ignore_errors=True)


@pytest.mark.root
def test_deep_nesting_copy_back_is_cut_with_a_note(wsparent):
    """Red team: ~990 nested dirs made the recursive copy back raise RecursionError."""
    ws = wsparent / "ws"
    ws.mkdir()
    r = lowlevel.run(["python3", "-c", "import os\nfor i in range(1100): os.mkdir('d'); os.chdir('d')\n"
                      "open('leaf', 'w').write('x')\nprint(len(os.getcwd()))"], workspace=str(ws),
                     policy=lowlevel.Policy(limits=lowlevel.Limits(workspace_bytes=16 << 20)))
    assert r.exit_code == 0, r.stderr
    assert int(r.stdout) > 1100 * 2  # control: the nesting exists inside
    assert any("more than 256 directories deep" in n for n in r.notes), r.notes
    depth, p = 0, ws
    while (p / "d").is_dir():
        p, depth = p / "d", depth + 1
    assert depth == 256
    assert not [d for d in os.listdir(wsparent) if d.startswith((".sized-", ".copyback-"))]


@pytest.mark.root
def test_copy_back_ownership_follows_give_back(wsparent, test_user):
    """Red team: root running on alice's workspace made everything root:root, kept o+w."""
    uid, gid = test_user.pw_uid, test_user.pw_gid
    ws = wsparent / "ws"
    ws.mkdir()
    (ws / "mine.txt").write_text("a")
    (ws / "shared").mkdir()
    os.chmod(ws / "shared", 0o777)
    for p in (ws, ws / "mine.txt", ws / "shared"):
        os.chown(p, uid, gid)
    os.chmod(ws, 0o755)
    (ws / "rootfile").write_text("r")
    r = lowlevel.run(["sh", "-c", "mkdir -m777 new && echo x > new/f && chmod 666 new/f mine.txt && "
                      "stat -c %a new new/f"], workspace=str(ws),
                     policy=lowlevel.Policy(limits=lowlevel.Limits(workspace_bytes=1 << 20)))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == [b"777", b"666"]  # control
    ids = {rel: (os.lstat(ws / rel).st_uid, os.lstat(ws / rel).st_gid, os.lstat(ws / rel).st_mode & 0o7777)
           for rel in ("mine.txt", "shared", "rootfile", "new", "new/f")}
    assert ids["mine.txt"] == (uid, gid, 0o664)
    assert ids["shared"] == (uid, gid, 0o777)  # had o+w before the run: kept
    assert ids["rootfile"][:2] == (0, 0)
    assert ids["new"] == (uid, gid, 0o775) and ids["new/f"] == (uid, gid, 0o664)
    assert (os.lstat(ws).st_uid, os.lstat(ws).st_mode & 0o7777) == (uid, 0o755)
