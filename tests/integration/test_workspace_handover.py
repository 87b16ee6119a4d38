"""(The fallback workspace model: LOWLEVEL_NO_OVERLAY, see the handover_model fixture.) Red-team findings on the host side of workspaces: setuid leftovers and lossy ownership.

Each attack runs with ``seccomp=None`` so the syscall filter (which denies setuid chmods since
77929fd) does not hide the host side: these tests show that the hand-over and give-back in
:mod:`lowlevel.workspace` hold on their own. The controls print what the program managed to do
inside, so a test cannot pass because the attack never happened.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import lowlevel
import lowlevel.workspace
from lowlevel import WorkspaceError
from lowlevel.workspace import give_back, hand_over

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120), pytest.mark.usefixtures("handover_model")]

REPO = Path(__file__).resolve().parents[2]
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
#: The host side alone: no seccomp rule stops the chmods.
UNSAFE = lowlevel.Policy(seccomp=None, unsafe_no_seccomp=True)
#: A setuid copy of python, a setgid+world-writable dir, a setgid file inside it, a hard link.
ATTACK = ("cp /usr/bin/python3 py3 && chmod 4755 py3 && mkdir d && chmod 2777 d && cp py3 d/py3g "
          "&& chmod 2755 d/py3g && ln py3 py3link && stat -c %a py3 d d/py3g")


def _setid_entries(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def _sandbox_uid() -> int:
    """The per-run uid the handover_model fixture gives root's sandboxes (a range of one)."""
    return int(os.environ["LOWLEVEL_UID_RANGE"].split("-")[0])


def _ids(path: str | Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


@pytest.fixture
def tmpdir_0755() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lowlevel-handover-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.root
def test_setuid_leftovers_are_stripped_and_given_to_the_owner() -> None:
    r = lowlevel.run(["sh", "-c", ATTACK], policy=UNSAFE)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split() == ["4755", "2777", "2755"]  # control: it worked inside
    ws = r.workspace
    try:
        assert _setid_entries(ws) == []
        for rel in ("py3", "py3link", "d", "d/py3g"):
            assert os.lstat(Path(ws, rel)).st_uid == 0 and os.lstat(Path(ws, rel)).st_gid == 0, rel
        assert _ids(Path(ws, "d")) == (0, 0, 0o775)  # no setgid, no world write
        assert _ids(Path(ws, "py3")) == (0, 0, 0o755)
        assert _ids(ws) == (0, 0, 0o700)  # the fresh root as mkdtemp made it
        # The change report sees the state as given back.
        assert "py3" in r.changes.added
    finally:
        shutil.rmtree(ws, ignore_errors=True)


@pytest.mark.root
def test_setuid_copy_unreachable_while_live_and_stripped_after_timeout(test_user: pwd.struct_passwd) -> None:
    """A local user who learns the path cannot run the setuid copy during the run."""
    ws = tempfile.mkdtemp(prefix="lowlevel-live-")
    os.chmod(ws, 0o755)
    out: list[lowlevel.Result] = []
    cmd = ATTACK + "; chmod 755 /workspace 2>/dev/null && echo CHMOD-ROOT-OK; touch ready; sleep 30"
    t = threading.Thread(target=lambda: out.append(lowlevel.run(["sh", "-c", cmd], policy=UNSAFE, workspace=ws,
                                                                timeout=4)))
    t.start()
    try:
        for _ in range(300):
            if os.path.exists(Path(ws, "ready")):
                break
            time.sleep(0.01)
        assert os.path.exists(Path(ws, "ready"))
        # Control: the setuid copy exists right now, owned by the sandbox's uid.
        st = os.lstat(Path(ws, "py3"))
        assert st.st_mode & stat.S_ISUID and st.st_uid == _sandbox_uid()
        # The root is never the sandbox's: ours, the sandbox's group, 0770.
        assert _ids(ws) == (0, _sandbox_uid(), 0o770)
        probe = subprocess.run([RUNUSER, "-u", test_user.pw_name, "--", os.path.join(ws, "py3"), "-c",
                                "import os; print(os.geteuid())"], capture_output=True, cwd="/")
        assert probe.returncode != 0 and b"Permission denied" in probe.stderr, probe
    finally:
        t.join()
    r = out[0]
    try:
        assert r.timed_out
        assert "CHMOD-ROOT-OK" not in r.stdout.decode()
        assert _setid_entries(ws) == []
        assert _ids(ws) == (0, 0, 0o755)
        assert os.lstat(Path(ws, "py3")).st_uid == 0
    finally:
        shutil.rmtree(ws, ignore_errors=True)


@pytest.mark.root
def test_given_workspace_restored_exactly(tmpdir_0755: Path, test_user: pwd.struct_passwd) -> None:
    uid, gid = test_user.pw_uid, test_user.pw_gid
    ws = tmpdir_0755 / "ws"
    ws.mkdir()
    outside = tmpdir_0755 / "outside-link"

    def put(rel: str, mode: int, owner: tuple[int, int] = (uid, gid), src: str | None = None) -> None:
        p = ws / rel
        if src:
            shutil.copyfile(src, p)
        elif not p.exists():
            p.write_text(rel)
        os.chown(p, *owner)
        os.chmod(p, mode)

    (ws / "sgid_dir").mkdir()
    put("sgid_dir", 0o2775)
    put("sgid_dir/f", 0o644)
    put("keep_suid", 0o4755, src="/usr/bin/true")     # the user's own setuid file, left alone
    put("replaced_suid", 0o4755, src="/usr/bin/true")  # one the program deletes and remakes
    put("hard1", 0o644)
    os.link(ws / "hard1", ws / "hard2")
    os.link(ws / "hard1", outside)                      # a name outside the workspace
    put("rootfile", 0o600, owner=(0, 0))
    put("plain.txt", 0o640)
    os.chown(ws, uid, gid)
    os.chmod(ws, 0o755)
    before = {rel: _ids(ws / rel) for rel in ("sgid_dir", "sgid_dir/f", "keep_suid", "hard1", "rootfile")}

    cmd = ("echo more >> plain.txt && chmod 0777 plain.txt && echo new > sgid_dir/new && "
           "(chmod 777 keep_suid 2>/dev/null || echo CANNOT-CHMOD-KEEP) && "
           "rm replaced_suid && cp /usr/bin/python3 replaced_suid && chmod 4755 replaced_suid && "
           "mkdir w && chmod 2777 w && stat -c %a replaced_suid w")
    r = lowlevel.run(["sh", "-c", cmd], policy=UNSAFE, workspace=ws)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split() == ["CANNOT-CHMOD-KEEP", "4755", "2777"]  # control

    assert _ids(ws) == (uid, gid, 0o755)
    for rel, ids in before.items():
        assert _ids(ws / rel) == ids, rel              # setgid dir, setuid file, hard links, root's file
    assert _ids(ws / "hard2") == before["hard1"] and _ids(outside) == before["hard1"]
    assert _ids(ws / "plain.txt") == (uid, gid, 0o775)  # the program's chmod kept, minus o+w
    assert _ids(ws / "replaced_suid") == (uid, gid, 0o755)  # a new inode: the root's owner, no setuid
    assert _ids(ws / "sgid_dir/new")[:2] == (uid, gid)
    assert _ids(ws / "w") == (uid, gid, 0o775)
    assert sorted(_setid_entries(str(ws))) == ["keep_suid", "sgid_dir"]


USER_SCRIPT = r"""
import json, os, stat, sys, tempfile, shutil
import lowlevel
import lowlevel.workspace
ws = tempfile.mkdtemp(prefix="lowlevel-user-handover-")
shutil.copyfile("/usr/bin/true", os.path.join(ws, "mine_suid")); os.chmod(os.path.join(ws, "mine_suid"), 0o4755)
shutil.copyfile("/usr/bin/true", os.path.join(ws, "mine2_suid")); os.chmod(os.path.join(ws, "mine2_suid"), 0o4755)
cmd = (sys.argv[1] + " && rm mine2_suid && cp /usr/bin/python3 mine2_suid && chmod 4755 mine2_suid"
       " && mkdir hid && cp py3 hid/py && chmod 4755 hid/py && chmod 0311 hid && stat -c %a mine2_suid hid/py")
r = lowlevel.run(["sh", "-c", cmd], policy=lowlevel.Policy(seccomp=None, unsafe_no_seccomp=True), workspace=ws)
modes = {}
for dirpath, dirnames, filenames in os.walk(ws):
    for name in dirnames + filenames:
        p = os.path.join(dirpath, name)
        modes[os.path.relpath(p, ws)] = stat.S_IMODE(os.lstat(p).st_mode)
print(json.dumps({"exit": r.exit_code, "stdout": r.stdout.decode(), "stderr": r.stderr.decode(), "modes": modes,
                  "root": stat.S_IMODE(os.stat(ws).st_mode)}))
shutil.rmtree(ws)
"""


@pytest.mark.root
def test_unprivileged_caller_setuid_leftovers_stripped(test_user: pwd.struct_passwd) -> None:
    """Sandbox uid == caller uid: nothing changes hands; stripping after the run is the defense."""
    proc = subprocess.run([RUNUSER, "-u", test_user.pw_name, "--", sys.executable, "-c", USER_SCRIPT, ATTACK],
                          capture_output=True, cwd="/", timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": test_user.pw_dir, "PYTHONPATH": str(REPO),
                               "LOWLEVEL_NO_OVERLAY": "1"})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    d = json.loads(proc.stdout)
    assert d["exit"] == 0, d["stderr"]
    assert d["stdout"].split() == ["4755", "2777", "2755", "4755", "4755"]  # control: it worked inside
    modes = d["modes"]
    assert modes["mine_suid"] == 0o4755                   # the caller's own setuid file: kept exactly
    assert modes["mine2_suid"] == 0o755                   # replaced by the program: stripped
    for rel in ("py3", "py3link", "d/py3g", "hid/py"):
        assert not modes[rel] & (stat.S_ISUID | stat.S_ISGID), rel
    assert modes["d"] == 0o775
    assert modes["hid"] & 0o500 == 0o500                  # made listable again to be checked
    assert d["root"] == 0o700


@pytest.mark.root
def test_huge_tree_refused_before_anything_changes(tmpdir_0755: Path) -> None:
    for i in range(20):
        (tmpdir_0755 / f"f{i}").write_text("x")
    before = {p.name: _ids(p) for p in tmpdir_0755.iterdir()}
    root_before = _ids(tmpdir_0755)
    with pytest.raises(WorkspaceError) as info:
        hand_over(str(tmpdir_0755), sandbox_ids=(65534, 65534), limit=10)
    assert info.value.errno == 7  # E2BIG
    assert {p.name: _ids(p) for p in tmpdir_0755.iterdir()} == before
    assert _ids(tmpdir_0755) == root_before
    # Control: under the cap it hands over, and gives back exactly.
    h = hand_over(str(tmpdir_0755), sandbox_ids=(65534, 65534), limit=100)
    assert _ids(tmpdir_0755 / "f0")[0] == 65534 and _ids(tmpdir_0755) == (0, 65534, 0o770)
    give_back(h)
    assert {p.name: _ids(p) for p in tmpdir_0755.iterdir()} == before
    assert _ids(tmpdir_0755) == root_before


@pytest.mark.root
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_cli_signal_mid_run_restores_ownership(tmpdir_0755: Path, test_user: pwd.struct_passwd,
                                               signame: str) -> None:
    import signal
    uid, gid = test_user.pw_uid, test_user.pw_gid
    (tmpdir_0755 / "a.txt").write_text("a")
    (tmpdir_0755 / "sub").mkdir()
    for p in (tmpdir_0755, tmpdir_0755 / "a.txt", tmpdir_0755 / "sub"):
        os.chown(p, uid, gid)
    before = {p: _ids(p) for p in (tmpdir_0755, tmpdir_0755 / "a.txt", tmpdir_0755 / "sub")}
    proc = subprocess.Popen([sys.executable, "-m", "lowlevel", "run", "--workspace", str(tmpdir_0755), "--",
                             "sleep", "30"], cwd=str(REPO), stderr=subprocess.PIPE)
    try:
        for _ in range(500):
            if _ids(tmpdir_0755 / "a.txt")[0] == _sandbox_uid():
                break
            time.sleep(0.01)
        assert _ids(tmpdir_0755 / "a.txt")[0] == _sandbox_uid()  # control: handed over, run live
        time.sleep(0.2)
        proc.send_signal(getattr(signal, signame))
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + getattr(signal, signame), err
    assert signame.encode() in err
    assert {p: _ids(p) for p in before} == before


SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"


def _as_nobody(cmd: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([SETPRIV, "--reuid", "65534", "--regid", "65534", "--clear-groups", "sh", "-c", cmd],
                          capture_output=True, cwd="/")


@pytest.mark.root
def test_deep_nesting_give_back_is_iterative_and_seals_the_rest(tmpdir_0755: Path) -> None:
    """Red team: 1,100 nested dirs made give_back raise RecursionError, leaving o+w nobody entries."""
    ws = tmpdir_0755 / "ws"
    ws.mkdir()
    prog = ("import os\nfor i in range(1100):\n    os.mkdir('d', 0o777); os.chmod('d', 0o777); os.chdir('d')\n"
            "open('leaf', 'w').write('x'); os.chmod('leaf', 0o666)\nprint(len(os.getcwd()))")
    r = lowlevel.run(["python3", "-c", prog], workspace=str(ws), policy=UNSAFE)
    assert r.exit_code == 0, r.stderr
    assert int(r.stdout) > 2200  # control: the nesting exists
    assert any("more than 256 levels deep" in n for n in r.notes), r.notes
    assert not r.changes.complete
    p = ws
    for level in range(1, 258):
        p = p / "d"
        st = os.lstat(p)
        if level <= 256:
            assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o775), level  # given back, no o+w
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o700)  # level 257: sealed
    assert _ids(ws) == (0, 0, 0o755)
    probe = _as_nobody(f"ls {p}")
    assert probe.returncode != 0  # nobody cannot reach the unchecked part
    # The library's other walks cope too.
    assert len(lowlevel.workspace.list_files(str(ws))) == 257
    lowlevel.workspace.remove_workspace(str(ws))
    assert not ws.exists()


def _acl(entries: list[tuple[int, int, int]]) -> bytes:
    import struct
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


@pytest.mark.root
def test_acls_set_by_the_sandbox_are_removed(tmpdir_0755: Path) -> None:
    """Red team: user:65534:rwx ACLs survived give_back; nobody could modify root's outputs."""
    ws = tmpdir_0755 / "ws"
    ws.mkdir()
    (ws / "old.sh").write_text("echo old\n")
    (ws / "kept").write_text("k")
    # A pre-existing ACL (user 12345 may read) is restored as it was.
    kept_acl = _acl([(1, 6, 0xFFFFFFFF), (2, 4, 12345), (4, 4, 0xFFFFFFFF), (0x10, 4, 0xFFFFFFFF),
                     (0x20, 4, 0xFFFFFFFF)])
    os.setxattr(ws / "kept", "system.posix_acl_access", kept_acl)
    prog = r"""
import os, struct
u = os.getuid()
def acl(*e): return struct.pack('<I', 2) + b''.join(struct.pack('<HHI', *x) for x in e)
a = acl((1, 7, 0xffffffff), (2, 7, u), (4, 5, 0xffffffff), (0x10, 7, 0xffffffff), (0x20, 5, 0xffffffff))
open('new.txt', 'w').write('new')
os.mkdir('d')
for p in ('old.sh', 'new.txt', 'd', 'kept'):
    os.setxattr(p, 'system.posix_acl_access', a)
os.setxattr('d', 'system.posix_acl_default', a)
print(sorted(os.listxattr('d')))
"""
    r = lowlevel.run(["python3", "-c", prog], workspace=str(ws), policy=UNSAFE)
    assert r.exit_code == 0, r.stderr
    assert b"system.posix_acl_default" in r.stdout  # control: the ACLs were set inside
    for rel in ("old.sh", "new.txt", "d"):
        assert [a for a in os.listxattr(ws / rel) if a.startswith("system.posix_acl")] == [], rel
        assert os.lstat(ws / rel).st_uid == 0
    import struct
    raw = os.getxattr(ws / "kept", "system.posix_acl_access")
    named = [e for e in struct.iter_unpack("<HHI", raw[4:]) if e[0] in (2, 8)]
    assert named == [(2, 4, 12345)]  # the recorded ACL is back (its mode entries follow the program's chmod)
    (ws / "d" / "later").write_text("created by root after the run")
    probe = _as_nobody(f"echo pwned >> {ws}/old.sh || echo DENIED1; echo pwned >> {ws}/d/later || echo DENIED2")
    assert b"DENIED1" in probe.stdout and b"DENIED2" in probe.stdout, probe
    assert (ws / "old.sh").read_text() == "echo old\n"


MMAP_SCRIPT = r"""
import json, os, shutil, stat, sys, tempfile
import lowlevel
import lowlevel.workspace
ws = tempfile.mkdtemp(prefix="lowlevel-user-mmap-")
for name in ("victim_suid", "control_suid"):
    shutil.copyfile("/usr/bin/true", os.path.join(ws, name)); os.chmod(os.path.join(ws, name), 0o4755)
prog = ("import mmap, os\nfd = os.open('victim_suid', os.O_RDWR)\nm = mmap.mmap(fd, 0)\n"
        "m[:36] = b'#!/bin/sh\\necho PWNED-BY-SANDBOX; id\\n'\nm.flush()\nprint(oct(os.stat('victim_suid').st_mode))")
r = lowlevel.run(["python3", "-c", prog], policy=lowlevel.Policy(seccomp=None, unsafe_no_seccomp=True), workspace=ws)
modes = {n: stat.S_IMODE(os.lstat(os.path.join(ws, n)).st_mode) for n in ("victim_suid", "control_suid")}
print(json.dumps({"exit": r.exit_code, "stdout": r.stdout.decode(), "stderr": r.stderr.decode(), "modes": modes}))
shutil.rmtree(ws)
"""


@pytest.mark.root
def test_setuid_file_written_through_mmap_loses_its_bits(test_user: pwd.struct_passwd) -> None:
    """Red team: MAP_SHARED writes into the caller's own setuid file keep S_ISUID (no write() to clear it)."""
    proc = subprocess.run([RUNUSER, "-u", test_user.pw_name, "--", sys.executable, "-c", MMAP_SCRIPT],
                          capture_output=True, cwd="/", timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": test_user.pw_dir, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    d = json.loads(proc.stdout)
    assert d["exit"] == 0, d["stderr"]
    assert d["stdout"].strip() == oct(0o104755)  # control: the bit survived the write inside
    assert d["modes"] == {"victim_suid": 0o755, "control_suid": 0o4755}
