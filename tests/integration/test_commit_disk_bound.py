"""A run cannot make its commit write more to the host's disk than its workspace bound allows.

``Limits.workspace_bytes`` bounds the copy-on-write upper layer (a sized tmpfs): past it the
program gets ENOSPC "and the host's disk is untouched". Two ways around that bound, through the
commit that copies the upper into the user's directory:

- **sparse files**: ``truncate -s 200M f`` allocates nothing in the upper (tmpfs keeps holes),
  but a dense copy (``sendfile`` to EOF) writes 200 MB of zeros into the workspace. Thousands
  of such files fit in the upper's inode budget.
- **hard links**: one file linked over many existing names costs one inode's data in the
  upper; the commit replaces each name with a copy (it cannot link a new file to a replaced
  one), so the data is multiplied by the number of names.

Each attack is shown working outside a sandbox (control: the program really makes what it says),
then blocked: after the run, the workspace's allocated bytes stay within the bound (sparse files
are committed sparse; a hard-link multiplication past the budget is refused with a warning and
nothing of the run is applied).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bwrap]

MiB = 1 << 20
BOUND = 8 * MiB


def _allocated(root: str) -> int:
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


SPARSE = "for i in 1 2 3 4; do truncate -s 64M s$i || exit 1; done; printf data | dd of=s1 bs=1 seek=1000 conv=notrunc 2>/dev/null"


def test_control_sparse_files_cost_nothing_until_copied_dense() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        subprocess.run(["sh", "-c", SPARSE], cwd=d, check=True)
        assert os.path.getsize(f"{d}/s1") == 64 * MiB
        assert _allocated(d) < MiB  # the program's own files are sparse
        subprocess.run(["cp", "--sparse=never", f"{d}/s2", f"{d}/dense"], check=True)
        assert os.stat(f"{d}/dense").st_blocks * 512 >= 64 * MiB  # a dense copy is what fills a disk


@pytest.fixture
def ws(sandbox):
    path = sandbox.workspace()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _drop_saved(notes: list[str]) -> None:
    for note in notes:
        for saved in re.findall(r"saved to (/\S+?lowlevel-upper-\d+-\d+)", note):
            shutil.rmtree(os.path.dirname(saved), ignore_errors=True)


def test_sparse_files_are_committed_sparse(sandbox, ws) -> None:
    out = sandbox.run(["sh", "-c", SPARSE], workspace=str(ws), limits={"workspace_bytes": BOUND})
    assert out.exit_code == 0, (out.err, out.message)
    assert sorted(out.changes["added"]) == ["s1", "s2", "s3", "s4"]
    # 256 MiB of apparent size from an 8 MiB bound: the host disk holds no more than the bound.
    assert _allocated(str(ws)) <= BOUND, _allocated(str(ws))
    s1 = Path(ws, "s1")
    assert s1.stat().st_size == 64 * MiB
    with open(s1, "rb") as f:
        assert f.read(1000) == bytes(1000)
        assert f.read(4) == b"data"
        f.seek(64 * MiB - 10)
        assert f.read() == bytes(10)


HARDLINKS = ("head -c 3000000 /dev/urandom > big && for i in $(seq 0 39); do ln -f big f$i || exit 1; done; "
             "rm big")


def test_control_hard_links_cost_one_inode() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        for i in range(40):
            Path(d, f"f{i}").write_text("old\n")
        subprocess.run(["sh", "-c", HARDLINKS], cwd=d, check=True)
        assert os.stat(f"{d}/f0").st_nlink == 40
        assert _allocated(d) < 4 * MiB


def test_hard_link_multiplication_is_bounded(sandbox, ws) -> None:
    for i in range(40):
        Path(ws, f"f{i}").write_text("old\n")
        if sandbox.user:
            os.chown(Path(ws, f"f{i}"), sandbox.user.pw_uid, sandbox.user.pw_gid)
    out = sandbox.run(["sh", "-c", HARDLINKS], workspace=str(ws), limits={"workspace_bytes": BOUND})
    _drop_saved(out.notes)
    assert out.exit_code == 0, (out.err, out.message)
    # 40 names x 3 MB = 120 MB if every name were copied; the commit writes at most twice the
    # bound (hard links it cannot keep are copied), and refuses the rest with a warning.
    assert _allocated(str(ws)) <= 2 * BOUND + MiB, _allocated(str(ws))
    assert any(n.startswith("warning: ") and "budget" in n for n in out.notes), out.notes
    # Refused as a whole: every name is old or new, never missing; here all old.
    for i in range(40):
        assert Path(ws, f"f{i}").read_text() == "old\n"
