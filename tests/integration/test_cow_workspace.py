"""Copy-on-write workspaces (issue 11), end to end in real sandboxes, root and unprivileged.

The workspace is the read-only lower layer of an overlay the anchor mounts; the run writes into
a bounded upper layer; after the run the changes are committed or discarded. The user's files
never change owner or mode during the run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import pytest

import lowlevel
from lowlevel import Session

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]

PROGRAM = ("echo new > added.txt; echo more >> kept.txt; rm gone.txt; rm -r olddir; mkdir -p nd/deeper; "
           "echo x > nd/deeper/f; chmod 600 kept.txt; mv moved.txt moved2.txt")


def _state(root: str) -> dict[str, tuple[int, int, int, int, int, str]]:
    """Every entry: (mode, uid, gid, size, mtime_ns, sha256 of content or link target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, "."] if dirpath == root else [*dirnames, *filenames]:
            p = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            else:
                digest = ""
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, digest)
    return out


def _fill(ws: Path, owner: tuple[int, int] | None) -> None:
    (ws / "kept.txt").write_text("kept\n")
    (ws / "gone.txt").write_text("gone\n")
    (ws / "moved.txt").write_text("moved\n")
    (ws / "olddir" / "sub").mkdir(parents=True)
    (ws / "olddir" / "sub" / "f").write_text("f\n")
    os.symlink("kept.txt", ws / "link")
    if owner is not None:
        for p in [ws, *ws.rglob("*")]:
            os.lchown(p, *owner)


@pytest.fixture
def ws(sandbox) -> Path:
    path = sandbox.workspace()
    _fill(path, (sandbox.uid, sandbox.user.pw_gid) if sandbox.user else None)
    return path


def test_discard_leaves_the_directory_bit_identical(sandbox, ws: Path):
    before = _state(str(ws))
    r = sandbox.run(["sh", "-c", PROGRAM], workspace=str(ws), commit=False)
    assert r.exit_code == 0, (r.err, r.message)
    assert set(r.changes["added"]) >= {"added.txt", "nd", "nd/deeper/f", "moved2.txt"}
    assert set(r.changes["deleted"]) >= {"gone.txt", "olddir", "moved.txt"}
    assert "kept.txt" in r.changes["modified"]
    assert _state(str(ws)) == before
    assert any("discarded" in n for n in r.notes)


def test_commit_applies_every_kind_of_change(sandbox, ws: Path):
    owner = os.lstat(ws)
    r = sandbox.run(["sh", "-c", PROGRAM], workspace=str(ws))
    assert r.exit_code == 0, (r.err, r.message)
    assert (ws / "added.txt").read_text() == "new\n"
    assert (ws / "kept.txt").read_text() == "kept\nmore\n"
    assert stat.S_IMODE(os.lstat(ws / "kept.txt").st_mode) == 0o600
    assert not (ws / "gone.txt").exists() and not (ws / "olddir").exists() and not (ws / "moved.txt").exists()
    assert (ws / "moved2.txt").read_text() == "moved\n" and (ws / "nd/deeper/f").read_text() == "x\n"
    assert os.readlink(ws / "link") == "kept.txt"
    # Every entry belongs to the workspace's owner: nothing was handed to the sandbox's uid.
    for p in [ws, *ws.rglob("*")]:
        st = os.lstat(p)
        assert (st.st_uid, st.st_gid) == (owner.st_uid, owner.st_gid), p


def test_commit_after_timeout_keeps_what_was_written_unless_on_success(sandbox, ws: Path):
    r = sandbox.run(["sh", "-c", "echo partial > out.txt; sleep 30"], workspace=str(ws), timeout=1)
    assert r.timed_out and (ws / "out.txt").read_text() == "partial\n"
    before = _state(str(ws))
    r = sandbox.run(["sh", "-c", "echo again > out2.txt; sleep 30"], workspace=str(ws), timeout=1,
                    commit="on_success")
    assert r.timed_out and "out2.txt" in r.changes["added"] and _state(str(ws)) == before
    r = sandbox.run(["sh", "-c", "echo ok > out3.txt"], workspace=str(ws), commit="on_success")
    assert r.exit_code == 0 and (ws / "out3.txt").read_text() == "ok\n"


def test_writes_are_bounded_by_default_and_the_host_disk_is_untouched(sandbox, ws: Path):
    """Files of 64 MiB, each within RLIMIT_FSIZE, in a loop: ENOSPC at the bound, not the host's disk."""
    r = sandbox.run(["sh", "-c", "i=0; while dd if=/dev/zero of=f$i bs=1M count=64 status=none; do i=$((i+1)); "
                     "[ $i -gt 40 ] && break; done; echo stopped-at $i; df -k /workspace | tail -1"],
                    workspace=str(ws), limits={"workspace_bytes": 256 << 20, "memory_bytes": 1 << 30},
                    commit=False, timeout=120)
    assert r.exit_code == 0, (r.err, r.message)
    assert "No space left on device" in r.err
    stopped = int(r.out.split("stopped-at")[1].split()[0])
    assert stopped <= 4, r.out  # 256 MiB / 64 MiB
    # What the sandbox writes into is the run's 256 MiB upper tmpfs, not the host's disk.
    total_kib = int(r.out.split("stopped-at")[1].split()[2])
    assert total_kib == 256 * 1024, r.out
    assert total_kib * 1024 < shutil.disk_usage(ws).total
    assert not list(ws.glob("f*"))


@pytest.mark.slow
def test_default_bound_is_one_gib(sandbox, ws: Path):
    # Two files, each under RLIMIT_FSIZE (1 GiB by default): the workspace bound stops the second.
    r = sandbox.run(["sh", "-c", "dd if=/dev/zero of=a bs=1M count=600 status=none; "
                     "dd if=/dev/zero of=b bs=1M count=600 status=none; du -sk --apparent-size /workspace"],
                    workspace=str(ws), limits={"memory_bytes": 3 << 30}, commit=False, timeout=120)
    assert "No space left on device" in r.err, r.err
    assert int(r.out.split()[0]) * 1024 <= (1 << 30) + (64 << 10)  # the files, plus directory entries
    assert any("bounded to 1073741824 bytes" in n for n in r.notes)


def test_host_change_during_the_run_is_a_conflict_and_loses_nothing(sandbox, ws: Path):
    done = threading.Event()

    def host_edit() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.3)
            (ws / "kept.txt").write_text("host edit\n")
            if done.wait(0.2):
                return

    t = threading.Thread(target=host_edit)
    t.start()
    try:
        r = sandbox.run(["sh", "-c", "sleep 1; echo sandbox >> kept.txt; echo new > added.txt"], workspace=str(ws))
    finally:
        done.set()
        t.join()
    assert r.error == "CommitConflictError", (r.error, r.message)
    assert "kept.txt" in r.message
    assert (ws / "kept.txt").read_text() == "host edit\n" and not (ws / "added.txt").exists()
    saved = r.message.split("saved to ")[1].split()[0].rstrip(".;")
    assert os.path.isdir(saved)


@pytest.mark.root
def test_overlapping_runs_leave_owners_and_modes_unchanged(tmp_path: Path):
    ws = tmp_path / "ws"
    ws.mkdir(mode=0o750)
    _fill(ws, None)
    before = {k: v[:3] for k, v in _state(str(ws)).items()}
    out: list[lowlevel.Result] = []
    a = threading.Thread(target=lambda: out.append(lowlevel.run(["sleep", "0.5"], workspace=ws)))
    a.start()
    time.sleep(0.2)
    out.append(lowlevel.run(["sleep", "1"], workspace=ws))
    a.join()
    assert [r.exit_code for r in out] == [0, 0]
    assert {k: v[:3] for k, v in _state(str(ws)).items()} == before


@pytest.mark.slow
@pytest.mark.root
def test_concurrent_root_sandboxes_have_their_own_host_uid(tmp_path: Path):
    """Per-uid kernel budgets are per run: one sandbox exhausting inotify instances (EMFILE at
    fs.inotify.max_user_instances) does not starve another. Control: with one pinned uid it does."""
    limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    hog = (f"import ctypes, time; libc = ctypes.CDLL(None); fds = [libc.inotify_init1(0) for _ in range({limit + 8})]; "
           "print(sum(f >= 0 for f in fds), flush=True); time.sleep(3)")
    probe = "import ctypes, time; time.sleep(1); print(ctypes.CDLL(None).inotify_init1(0))"

    def pair(policy: lowlevel.Policy) -> tuple[lowlevel.Result, lowlevel.Result]:
        res: dict[str, lowlevel.Result] = {}
        t = threading.Thread(target=lambda: res.update(hog=lowlevel.run(["python3", "-c", hog], policy=policy)))
        t.start()
        time.sleep(0.5)
        res["probe"] = lowlevel.run(["python3", "-c", probe], policy=policy)
        t.join()
        return res["hog"], res["probe"]

    hog_r, probe_r = pair(lowlevel.Policy())
    uids = {next(a for a in r.argv if a.startswith("--uid=")) for r in (hog_r, probe_r)}
    assert len(uids) == 2, uids
    assert int(probe_r.stdout) >= 0, probe_r.stdout
    pinned = lowlevel.Policy(host_uid=65534)
    hog_r, probe_r = pair(pinned)
    assert int(hog_r.stdout) <= limit
    assert int(probe_r.stdout) == -1  # control: the shared uid's budget is gone


def test_session_reset_diff_commit(sandbox, ws: Path):
    if sandbox.user is not None:
        pytest.skip("Session as another user is covered by the unprivileged run tests")
    before = _state(str(ws))
    with Session(workspace=str(ws)) as s:
        assert s.run(["sh", "-c", "echo 1 > a.txt; rm gone.txt"]).exit_code == 0
        d = s.diff()
        assert d.added == ("a.txt",) and d.deleted == ("gone.txt",)
        assert _state(str(ws)) == before  # nothing reached the directory yet
        s.reset()
        assert s.diff().added == () and s.run(["cat", "gone.txt"]).stdout == b"gone\n"
        assert s.run(["test", "-e", "a.txt"]).exit_code == 1
        s.run(["sh", "-c", "echo 2 > b.txt"])
        applied = s.commit()
        assert applied.added == ("b.txt",)
        assert (ws / "b.txt").read_text() == "2\n" and s.diff().added == ()
        assert s.run(["cat", "b.txt"]).stdout == b"2\n"
        s.run(["sh", "-c", "echo 3 > c.txt"])
    assert (ws / "c.txt").read_text() == "3\n"  # close() commits by default
    with Session(workspace=str(ws), commit=False) as s:
        s.run(["sh", "-c", "echo 4 > d.txt; rm b.txt"])
    assert not (ws / "d.txt").exists() and (ws / "b.txt").exists()


def test_session_sees_host_written_files_as_writable(sandbox, ws: Path):
    if sandbox.user is not None:
        pytest.skip("Session as another user is covered by the unprivileged run tests")
    with Session(workspace=str(ws)) as s:
        # Through the live view, as the sandbox's ids (what MCP write_file does) ...
        lowlevel.workspace.write_file(s.workspace, "from-host/view.txt", b"v\n",
                                      uid=s.host_ids[0] if os.geteuid() == 0 else None,
                                      gid=s.host_ids[1] if os.geteuid() == 0 else None)
        # ... and straight into the directory, as its owner: no uid argument at all.
        (ws / "direct.txt").write_text("d\n")
        r = s.run(["sh", "-c", "echo w >> from-host/view.txt && echo w >> direct.txt && echo w > from-host/n"])
        assert r.exit_code == 0, r.stderr
    assert (ws / "from-host/view.txt").read_text() == "v\nw\n"
    assert (ws / "direct.txt").read_text() == "d\nw\n"


@pytest.mark.root
def test_workspace_under_a_private_root_owned_directory(tmp_path: Path):
    """/root/proj-like: below 0700 parents; the sandbox's uid never walks the host path."""
    private = Path(tempfile.mkdtemp(prefix="lowlevel-private-"))
    try:
        os.chmod(private, 0o700)
        ws = private / "proj"
        ws.mkdir()
        (ws / "in.txt").write_text("in\n")
        r = lowlevel.run(["sh", "-c", "cat in.txt > out.txt"], workspace=ws)
        assert r.exit_code == 0, r.stderr
        assert (ws / "out.txt").read_text() == "in\n" and os.stat(ws / "out.txt").st_uid == 0
    finally:
        shutil.rmtree(private)


def test_pool_with_a_template_gives_each_call_a_fresh_overlay(tmp_path: Path):
    template = tmp_path / "template"
    template.mkdir()
    (template / "data.txt").write_text("base\n")
    os.chmod(tmp_path, 0o755)
    before = _state(str(template))
    with lowlevel.Pool(size=2, template=template) as pool:
        r1 = pool.run(["sh", "-c", "cat data.txt; echo one >> data.txt; echo x > new.txt"])
        r2 = pool.run(["sh", "-c", "cat data.txt; ls"])
    assert r1.stdout == b"base\n" and r1.changes.modified == ("data.txt",) and r1.changes.added == ("new.txt",)
    assert r2.stdout == b"base\ndata.txt\n"  # the second call saw none of the first's changes
    assert _state(str(template)) == before


def test_pool_close_leaves_no_prestarted_workspaces(tmp_path: Path):
    base = tmp_path / "base"
    base.mkdir()
    os.chmod(tmp_path, 0o755)
    with lowlevel.Pool(size=2, workspace_base=str(base)) as pool:
        r = pool.run(["sh", "-c", "echo out > o.txt"])
        assert Path(r.workspace, "o.txt").read_text() == "out\n"
        deadline = time.monotonic() + 20
        while len([p for p in base.iterdir() if p.name.startswith("run-")]) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    left = sorted(p.name for p in base.iterdir() if p.name.startswith("run-"))
    assert left == [Path(r.workspace).name], left  # the used one is kept, the pre-started ones are gone


@pytest.mark.parametrize("given", [False, True], ids=["fresh", "given"])
def test_a_run_that_makes_its_own_output_unreadable_still_returns(sandbox, given: bool):
    """A program that leaves a directory (and a file) unreadable to their owner: the caller's
    run still returns a Result and commits the rest. An unprivileged caller is that owner
    without CAP_DAC_OVERRIDE: those entries are skipped with a note (it raised WorkspaceError,
    "cannot read the upper directory", and left a conflict directory); a root caller copies
    them as they are (the control)."""
    ws = sandbox.workspace() if given else None
    out = sandbox.run(["sh", "-c", "mkdir d && echo x > d/f && chmod 000 d && echo y > g && chmod 000 g "
                                   "&& echo ok > fine"], workspace=None if ws is None else str(ws))
    assert out.exit_code == 0, (out.err, out.message)
    root = Path(out.workspace)
    assert (root / "fine").read_text() == "ok\n"
    assert not [p for p in root.iterdir() if p.name.startswith(("conflict", ".lowlevel-commit"))]
    if sandbox.identity == "root":
        assert stat.S_IMODE(os.lstat(root / "d").st_mode) == 0 and stat.S_IMODE(os.lstat(root / "g").st_mode) == 0
        assert (root / "d" / "f").read_text() == "x\n"  # root reads through mode 000
    else:
        assert not (root / "d").exists() and not (root / "g").exists()
        note = next(n for n in out.notes if n.startswith("commit:"))
        assert "'d': unreadable in the run's upper layer (mode 0000" in note and "'g': unreadable" in note
