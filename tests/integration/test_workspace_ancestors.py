"""(The fallback workspace model: LOWLEVEL_NO_OVERLAY, see the handover_model fixture.) A workspace below a directory another user controls is refused before anything is touched.

The attack (red team, round 2): root runs lowlevel on /home/alice/x/proj; during the run alice
renames x and puts a symlink to a root-owned directory in its place; after the run lowlevel
gave "the workspace" back by path, which chowned that directory to alice (and the sized mode
emptied and refilled it). Refusing untrusted ancestors closes it for every post-run step.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest

import lowlevel

pytestmark = [pytest.mark.bwrap, pytest.mark.root, pytest.mark.usefixtures("handover_model")]


@pytest.fixture
def tree():
    top = Path(tempfile.mkdtemp(prefix="anc-", dir="/tmp"))
    os.chmod(top, 0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def test_user_owned_ancestor_refused_and_untouched(tree, test_user: pwd.struct_passwd):
    alice = tree / "home_alice"
    proj = alice / "x" / "proj"
    proj.mkdir(parents=True)
    (proj / "keep.txt").write_text("mine\n")
    for p in (alice, alice / "x"):
        os.chown(p, test_user.pw_uid, test_user.pw_gid)
    before = {p: os.stat(p) for p in (proj, proj / "keep.txt")}
    with pytest.raises(lowlevel.WorkspaceError, match="could be renamed or replaced") as info:
        lowlevel.run(["sh", "-c", "echo pwned > keep.txt"], workspace=str(proj))
    assert str(alice) in str(info.value)
    assert (proj / "keep.txt").read_text() == "mine\n"
    for p, st in before.items():
        now = os.stat(p)
        assert (now.st_uid, now.st_gid, now.st_mode) == (st.st_uid, st.st_gid, st.st_mode)
    with pytest.raises(lowlevel.WorkspaceError):  # allow_sensitive does not lift it
        lowlevel.run(["true"], workspace=str(proj), allow_sensitive_workspace=True)


def test_group_writable_ancestor_refused_sticky_allowed(tree):
    shared = tree / "shared"
    (shared / "proj").mkdir(parents=True)
    os.chmod(shared, 0o775)
    with pytest.raises(lowlevel.WorkspaceError, match="could be renamed"):
        lowlevel.run(["true"], workspace=str(shared / "proj"))
    # Control: a sticky world-writable parent (like /tmp) is safe: others cannot rename our entry.
    os.chmod(shared, 0o1777)
    r = lowlevel.run(["sh", "-c", "echo ok > out"], workspace=str(shared / "proj"))
    assert r.exit_code == 0 and (shared / "proj" / "out").read_text() == "ok\n"
