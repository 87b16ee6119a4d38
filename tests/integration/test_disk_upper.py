"""Limits.upper="disk" (issue 27, item 6): the copy-on-write upper on a per-run loop device.

- the bound is hard: writing past ``workspace_bytes`` is ENOSPC inside (control: the same write
  under a larger bound succeeds), and afterwards no loop device is bound to a file of the upper
  directory, no file is there and nothing of it is mounted on the host;
- a large output does not need RAM: 64 MiB under ``memory_bytes`` = 32 MiB succeeds and commits
  (whiteouts and an opaque directory included); the control, the same run on the tmpfs upper, is
  killed by the memory cgroup; a Session's cgroup holds the tmpfs's 64 MiB as shmem, the disk
  upper's not;
- an unprivileged caller gets UnsupportedError naming why, and nothing runs; so does the
  hand-over fallback (no overlay);
- Session, Pool and arun honour it;
- a caller SIGKILLed at random instants of disk-upper runs leaves nothing: no process, no bound
  loop device, no file, no mount.

``LOWLEVEL_UPPER_DIR`` points at a per-test directory (the host's /var/tmp is never used).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lowlevel
from helpers.hygiene import settle
from helpers.procs import describe, survivors
from lowlevel.workspace.disk_upper import backing_files

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]

MiB = 1 << 20
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="a disk upper needs a root caller")


@pytest.fixture
def upper_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "uppers"
    d.mkdir()
    monkeypatch.setenv("LOWLEVEL_UPPER_DIR", str(d))
    return d


def _ours(upper_dir: Path) -> dict[str, str]:
    """Loop devices bound to a file of ``upper_dir`` (``/sys/block/loop*/loop/backing_file``)."""
    return {k: v for k, v in backing_files().items() if v.startswith(str(upper_dir) + "/")}


def _losetup() -> str:
    return subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout


def assert_nothing_left(upper_dir: Path, timeout: float = 30.0) -> None:
    """No bound loop device of ours, no file in the directory, no ext4 of ours on the host. The
    kernel clears an autoclear loop device after its last close, from a work queue: under CI's
    load once just past 10 s (``losetup -a`` already empty when the message was built)."""
    deadline = time.monotonic() + timeout
    # Both views: sysfs's backing_file goes before the device leaves ``losetup -a`` (its rundown;
    # CI once saw the first empty and the second not, with the whole bound already waited).
    while (_ours(upper_dir) or str(upper_dir) in _losetup()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _ours(upper_dir), f"loop devices left: {_ours(upper_dir)}; losetup -a: {_losetup()}"
    assert str(upper_dir) not in _losetup()
    assert os.listdir(upper_dir) == []
    with open("/proc/self/mountinfo") as f:
        mounts = f.read()
    assert " ext4 /dev/loop" not in mounts or all(
        "/run/lowlevel" not in line and str(upper_dir) not in line
        for line in mounts.splitlines() if " ext4 /dev/loop" in line), mounts


WRITE_32M = ["sh", "-c", "head -c 32M /dev/zero > big; echo rc=$?; df -k /workspace | tail -1"]


def test_disk_upper_is_enospc_at_its_bound(sandbox, upper_dir: Path) -> None:
    out = sandbox.run(WRITE_32M, limits={"upper": "disk", "workspace_bytes": 16 * MiB}, commit=False)
    if sandbox.user is not None:
        assert out.error == "UnsupportedError", out
        assert "needs a root caller" in out.message and "CAP_SYS_ADMIN" in out.message
        assert "fix: leave upper='tmpfs'" in out.message
        assert os.listdir(out.workspace) == []  # nothing ran
        return
    assert out.exit_code == 0, out
    assert "No space left on device" in out.stderr.decode() and b"rc=1" in out.stdout, out
    size_kib = int(out.stdout.decode().split()[-5])  # df: the overlay's size is the ext4's
    assert size_kib <= 16 * 1024
    assert any("upper layer on disk" in n for n in out.notes), out.notes
    assert_nothing_left(upper_dir)
    # Control: the same write under a bound that holds it succeeds (the ENOSPC is the bound's).
    out = sandbox.run(WRITE_32M, limits={"upper": "disk", "workspace_bytes": 64 * MiB}, commit=False)
    assert out.exit_code == 0 and b"rc=0" in out.stdout and not out.stderr, out
    assert_nothing_left(upper_dir)


WRITE_64M_AND_EDIT = ["sh", "-c", "rm del; rm -r gone; rm -r opq; mkdir opq; echo new > opq/new; "
                      "head -c 64M /dev/zero > big && echo wrote"]


def _tree(ws: str) -> None:
    for d in ("gone", "opq", "keep"):
        os.mkdir(os.path.join(ws, d))
    Path(ws, "del").write_text("a\n")
    Path(ws, "opq", "old").write_text("b\n")
    Path(ws, "gone", "g").write_text("c\n")
    Path(ws, "keep", "k").write_text("k\n")


@needs_root
@pytest.mark.parametrize("upper", ["disk", "tmpfs"])
def test_large_output_commits_without_ram(upper: str, upper_dir: Path, tmp_path: Path) -> None:
    ws = str(tmp_path / "ws")
    os.mkdir(ws)
    _tree(ws)
    policy = lowlevel.Policy(limits=lowlevel.Limits(upper=upper, workspace_bytes=128 * MiB, memory_bytes=32 * MiB))
    r = lowlevel.run(WRITE_64M_AND_EDIT, policy=policy, workspace=ws, commit=True, timeout=120)
    if "cgroup:memory" not in r.limits_enforced:
        pytest.skip("no memory cgroup here: the tmpfs control cannot show the difference")
    if upper == "tmpfs":
        # Control: the tmpfs's pages are the run's memory; 64 MiB cannot fit in 32.
        assert r.killed_by == "memory", (r, r.notes)
        return
    assert r.exit_code == 0 and r.stdout == b"wrote\n", (r, r.stderr)
    assert sorted(os.listdir(ws)) == ["big", "keep", "opq"]
    assert os.path.getsize(os.path.join(ws, "big")) == 64 * MiB
    assert os.listdir(os.path.join(ws, "opq")) == ["new"]  # the opaque dir hid opq/old
    assert Path(ws, "keep", "k").read_text() == "k\n"
    assert r.changes.deleted == ("del", "gone", "opq/old") and r.changes.complete
    assert_nothing_left(upper_dir)


def _shmem_bytes(session: lowlevel.Session) -> int | None:
    """The session cgroup's shmem (tmpfs pages) from memory.stat (v1 ``shmem``, v2 ``shmem``)."""
    cg = session._core.run.cgroup
    for node in cg.nodes if cg is not None else ():
        try:
            text = Path(node.path, "memory.stat").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "shmem":
                return int(value)
    return None


@needs_root
def test_session_disk_upper_holds_no_shmem_and_commits(upper_dir: Path, tmp_path: Path) -> None:
    shmem: dict[str, int | None] = {}
    for upper in ("tmpfs", "disk"):
        ws = str(tmp_path / f"ws-{upper}")
        os.mkdir(ws)
        _tree(ws)
        policy = lowlevel.Policy(limits=lowlevel.Limits(upper=upper, workspace_bytes=128 * MiB))
        with lowlevel.Session(policy=policy, workspace=ws) as s:
            r = s.run(WRITE_64M_AND_EDIT)
            assert r.exit_code == 0 and r.stdout == b"wrote\n", r
            shmem[upper] = _shmem_bytes(s)
            if upper == "disk":
                assert _ours(upper_dir), "no loop device while the session lives"
                with pytest.raises(lowlevel.PolicyError, match="limits.upper='tmpfs' cannot apply"):
                    s.run(["true"], limits=lowlevel.Limits(upper="tmpfs", workspace_bytes=128 * MiB))
                s.commit()
                assert os.path.getsize(os.path.join(ws, "big")) == 64 * MiB
                assert os.listdir(os.path.join(ws, "opq")) == ["new"] and not os.path.exists(f"{ws}/del")
                s.reset()
                assert s.run(["ls", "/workspace/opq"]).stdout == b"new\n"
        assert_nothing_left(upper_dir)
    if shmem["tmpfs"] is None:
        pytest.skip("no memory.stat shmem here")
    assert shmem["tmpfs"] >= 64 * MiB, shmem  # control: the tmpfs holds the output in RAM
    assert shmem["disk"] is not None and shmem["disk"] < 8 * MiB, shmem


@needs_root
def test_pool_and_arun_honour_the_disk_upper(upper_dir: Path) -> None:
    policy = lowlevel.Policy(limits=lowlevel.Limits(upper="disk", workspace_bytes=16 * MiB))
    with lowlevel.Pool(policy=policy, size=2) as pool:
        r = pool.run(WRITE_32M)
        assert b"rc=1" in r.stdout and b"No space left" in r.stderr, r
    assert_nothing_left(upper_dir)
    r = asyncio.run(lowlevel.arun(WRITE_32M, policy=policy))
    assert b"rc=1" in r.stdout and any("upper layer on disk" in n for n in r.notes), r
    assert_nothing_left(upper_dir)


@needs_root
def test_handover_fallback_refuses_the_disk_upper(handover_model: None, upper_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(lowlevel.UnsupportedError, match="overlay is unavailable here") as info:
        lowlevel.run(["true"], policy=lowlevel.Policy(limits=lowlevel.Limits(upper="disk")), workspace=str(tmp_path))
    assert info.value.feature == "disk-upper"
    assert_nothing_left(upper_dir)


def test_cli_upper_disk(who, upper_dir: Path, tmp_path: Path) -> None:
    from helpers.identities import setpriv
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "LANG": "C.UTF-8",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "LOWLEVEL_UPPER_DIR": str(upper_dir)}
    if who is not None:
        env["HOME"] = who.pw_dir
    cmd = [sys.executable, "-m", "lowlevel", "run", "--rm", "--upper", "disk", "--workspace-size", "16M", "--",
           "sh", "-c", "head -c 32M /dev/zero > big; echo rc=$?"]
    proc = subprocess.run(setpriv(who, cmd), capture_output=True, env=env, cwd="/", timeout=120)
    if who is not None:
        assert proc.returncode == 125 and b"needs a root caller" in proc.stderr, proc
        return
    assert proc.returncode == 0 and proc.stdout == b"rc=1\n" and b"No space left" in proc.stderr, proc
    assert_nothing_left(upper_dir)


SERVER = r"""
import os, signal, sys
import lowlevel
marker = sys.argv[1]
base = lowlevel.Limits(upper="disk", workspace_bytes=32 << 20)
lowlevel.run(["true"], policy=lowlevel.Policy(limits=base))  # warm: probes, the 32 MiB template
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
for line in sys.stdin:
    trial = int(line)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # Every third trial a new size: the kill may land in the template's mke2fs too.
        size = (32 << 20) + (trial << 20) * (trial % 3 == 0)
        policy = lowlevel.Policy(limits=lowlevel.Limits(upper="disk", workspace_bytes=size))
        cmd = ["sh", "-c", "while :; do head -c 4M /dev/zero > f; rm f; done", f"{marker}-{trial}"]
        try:
            lowlevel.run(cmd, policy=policy, timeout=600)
        finally:
            os._exit(0)
    print(pid, flush=True)
"""


@needs_root
@pytest.mark.slow
def test_caller_killed_during_disk_upper_runs_leaves_nothing(upper_dir: Path) -> None:
    marker = f"lowlevel-disk-death-{os.getpid()}-{time.time_ns()}"
    server = subprocess.Popen([sys.executable, "-c", SERVER, marker], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd="/")
    rng = random.Random(27)
    trials, bound_at_kill = 40, 0
    try:
        for trial in range(trials):
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(f"{trial}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            time.sleep(rng.uniform(0, 0.12))
            bound_at_kill += bool(_ours(upper_dir))
            os.kill(pid, signal.SIGKILL)
            left = survivors(f"{marker}-{trial}")
            assert not left, f"trial {trial}: survivors {describe(left)}"
            assert_nothing_left(upper_dir)
    finally:
        server.kill()
        server.wait()
        for stream in (server.stdin, server.stdout):
            if stream is not None:
                stream.close()
    # Not vacuous: many kills hit a run whose loop device was bound.
    assert bound_at_kill >= trials // 4, bound_at_kill


CONTROL = r"""
import os, signal, sys, time
from lowlevel.workspace import disk_upper
disk_upper._LO_FLAGS_AUTOCLEAR = 0  # the protection removed
upper = disk_upper.open_disk_upper(16 << 20)
print(upper.device, flush=True)
time.sleep(60)
"""


@needs_root
def test_control_a_loop_device_without_autoclear_outlives_its_caller(upper_dir: Path) -> None:
    """The checks above are not vacuous: without LO_FLAGS_AUTOCLEAR the caller's SIGKILL leaves a
    bound device (its unnamed backing file with it), which :func:`assert_nothing_left` sees."""
    import fcntl
    proc = subprocess.Popen([sys.executable, "-c", CONTROL], stdout=subprocess.PIPE, text=True, cwd="/",
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.stdout is not None
    device = proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    proc.stdout.close()
    try:
        time.sleep(0.5)
        assert _ours(upper_dir), "the control left no device: the check would be vacuous"
        with pytest.raises(AssertionError, match="loop devices left"):
            assert_nothing_left(upper_dir, timeout=0.5)
    finally:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, 0x4C01)  # LOOP_CLR_FD: detach it (loop(4))
        finally:
            os.close(fd)
    assert_nothing_left(upper_dir)


@needs_root
def test_doctor_says_whether_the_disk_upper_works(upper_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lowlevel.doctor import workspace_checks
    checks = {c["name"]: c for c in workspace_checks(("workspace: copy-on-write overlay",))}
    assert checks["disk upper"]["ok"] and str(upper_dir) in checks["disk upper"]["detail"], checks
    assert_nothing_left(upper_dir)
    # Control: an upper directory on a tmpfs (RAM) is refused, with what to do.
    monkeypatch.setenv("LOWLEVEL_UPPER_DIR", "/dev/shm")
    bad = {c["name"]: c for c in workspace_checks(("workspace: copy-on-write overlay",))}["disk upper"]
    assert not bad["ok"] and "is on a tmpfs (RAM)" in bad["detail"] and "LOWLEVEL_UPPER_DIR" in bad["detail"], bad


@needs_root
def test_session_commits_and_resets_a_full_disk_upper(upper_dir: Path, tmp_path: Path) -> None:
    """A run that filled the upper still commits and resets: the RESET's new upper.N/work.N take
    no block (ext4 inline_data), as on a tmpfs (before: "mkdir upper.1: No space left on device").
    (The committed bytes keep counting against the bound afterwards, on both uppers alike: the
    first overlay, still mounted below, holds the cleared upper's dentries.)"""
    ws = str(tmp_path / "ws")
    os.mkdir(ws)
    policy = lowlevel.Policy(limits=lowlevel.Limits(upper="disk", workspace_bytes=16 * MiB))
    with lowlevel.Session(policy=policy, workspace=ws) as s:
        assert b"rc=1" in s.run(["sh", "-c", "head -c 32M /dev/zero > big; echo rc=$?"]).stdout
        s.commit()  # applies big (as much as fitted), then RESET on the full filesystem
        assert 8 * MiB < os.path.getsize(os.path.join(ws, "big")) <= 16 * MiB
        assert s.run(["sh", "-c", "mkdir d && echo x > d/f && ls /workspace"]).stdout == b"big\nd\n"
        s.reset()
        assert s.run(["ls", "/workspace"]).stdout == b"big\n"
    assert_nothing_left(upper_dir)


@pytest.fixture
def small_fs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """LOWLEVEL_UPPER_DIR on an 80 MiB ext4 of the test's own (a file of tmp_path, loop-mounted)."""
    img, mnt = tmp_path / "small.img", tmp_path / "small"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(80 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    d = mnt / "uppers"
    d.mkdir()
    monkeypatch.setenv("LOWLEVEL_UPPER_DIR", str(d))
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# The program writes 40 MB (random: lost pages cannot read back as the same bytes) after a pause;
# in the attack the host fills the upper directory's filesystem during that pause.
_WRITE_40M = ["sh", "-c", "sleep 2; head -c 40000000 /dev/urandom > out; echo rc=$?; sha256sum out"]


def _run_filling(small_fs: Path, ws: Path, fill: bool) -> lowlevel.Result:
    import threading

    def filler() -> None:
        time.sleep(0.5)
        with open(small_fs.parent / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"x" * MiB)
            except OSError:
                pass
    t = threading.Thread(target=filler)
    if fill:
        t.start()
    try:
        return lowlevel.run(_WRITE_40M, workspace=ws, policy=lowlevel.Policy(
            limits=lowlevel.Limits(upper="disk", workspace_bytes=48 * MiB, memory_bytes=256 * MiB)))
    finally:
        if fill:
            t.join()
        (small_fs.parent / "filler").unlink(missing_ok=True)


@needs_root
def test_disk_upper_full_host_disk_commits_nothing_corrupt(small_fs: Path, tmp_path: Path) -> None:
    """Attack: the host filesystem of the sparse backing file fills during the run, so the loop
    device's writes fail after the program's write(2) calls succeeded. Found by the red team: the
    run ended 0 and the workspace got a 40 MB file whose hash was not the one the program saw
    (its lost pages read back as other bytes). Now the commit is refused with a warning naming the
    full directory, and the workspace is untouched."""
    ws = tmp_path / "ws"
    ws.mkdir()
    r = _run_filling(small_fs, ws, fill=True)
    assert r.exit_code == 0 and b"rc=0" in r.stdout  # the program saw no error
    assert not (ws / "out").exists(), "a corrupt output was committed"
    assert any("disk upper lost writes" in n and str(small_fs) in n for n in r.notes), r.notes
    assert_nothing_left(small_fs)


@needs_root
def test_disk_upper_control_without_filling_commits_the_exact_bytes(small_fs: Path, tmp_path: Path) -> None:
    """Control: the same run without the filler commits the 40 MB the program hashed."""
    import hashlib
    ws = tmp_path / "ws"
    ws.mkdir()
    r = _run_filling(small_fs, ws, fill=False)
    assert r.exit_code == 0 and b"rc=0" in r.stdout
    want = r.stdout.split(b"rc=0\n", 1)[1].split()[0].decode()
    assert hashlib.sha256((ws / "out").read_bytes()).hexdigest() == want
    assert not any("lost writes" in n for n in r.notes)
    assert_nothing_left(small_fs)


@needs_root
@pytest.mark.parametrize("where", ["/dev", "a file", "read-only"])
def test_disk_upper_dir_in_devtmpfs_or_a_file_is_a_clear_workspace_error(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LOWLEVEL_UPPER_DIR=/dev (a devtmpfs: RAM, as a tmpfs, which is refused) put the "disk" upper
    in RAM; a regular file gave 'cannot prepare the sandbox: Not a directory', a read-only mount
    'cannot prepare the sandbox: Read-only file system'. All are now a WorkspaceError naming
    LOWLEVEL_UPPER_DIR; control: a directory on disk runs."""
    path = "/dev" if where == "/dev" else str(tmp_path / "f")
    if where == "a file":
        Path(path).write_text("x")
    if where == "read-only":
        os.mkdir(path)
        subprocess.run(["mount", "--bind", "-o", "ro", path, path], check=True)
    monkeypatch.setenv("LOWLEVEL_UPPER_DIR", path)
    policy = lowlevel.Policy(limits=lowlevel.Limits(upper="disk", workspace_bytes=16 * MiB))
    try:
        with pytest.raises(lowlevel.WorkspaceError, match="LOWLEVEL_UPPER_DIR"):
            lowlevel.run(["true"], policy=policy)
    finally:
        if where == "read-only":
            subprocess.run(["umount", path], check=False)
    d = tmp_path / "ok"
    d.mkdir()
    monkeypatch.setenv("LOWLEVEL_UPPER_DIR", str(d))
    assert lowlevel.run(["true"], policy=policy).exit_code == 0


@needs_root
@pytest.mark.parametrize("fill", [True, False], ids=["filled", "control"])
def test_disk_upper_session_commit_after_lost_writes_applies_nothing(
        fill: bool, small_fs: Path, tmp_path: Path) -> None:
    """A Session's commit() after the host filesystem filled: WorkspaceError, nothing applied, and
    the layer is discarded (a second commit() must not apply it: syncfs reports an error once per
    fd). Control: no filler, commit() applies the exact bytes."""
    import hashlib
    import threading
    ws = tmp_path / "ws"
    ws.mkdir()
    filler_path = small_fs.parent / "filler"

    def filler() -> None:
        time.sleep(0.5)
        with open(filler_path, "wb") as f:
            try:
                while True:
                    f.write(b"x" * MiB)
            except OSError:
                pass
    policy = lowlevel.Policy(limits=lowlevel.Limits(upper="disk", workspace_bytes=48 * MiB,
                                                    memory_bytes=256 * MiB))
    with lowlevel.Session(policy=policy, workspace=ws) as s:
        t = threading.Thread(target=filler)
        if fill:
            t.start()
        r = s.run(_WRITE_40M)
        if fill:
            t.join()
        assert r.exit_code == 0 and b"rc=0" in r.stdout
        if fill:
            with pytest.raises(lowlevel.WorkspaceError, match="disk upper lost writes"):
                s.commit()
            filler_path.unlink()
            s.commit()  # the discarded layer: nothing
            assert not (ws / "out").exists()
            assert s.run(["ls", "/workspace"]).stdout == b""
        else:
            s.commit()
            want = r.stdout.split(b"rc=0\n", 1)[1].split()[0].decode()
            assert hashlib.sha256((ws / "out").read_bytes()).hexdigest() == want
    filler_path.unlink(missing_ok=True)
    assert_nothing_left(small_fs)


@needs_root
def test_disk_upper_dir_moved_to_another_filesystem_between_runs(small_fs: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """LOWLEVEL_UPPER_DIR is a symlink retargeted to another filesystem between two runs of one
    process: the second run used the template of the first filesystem and failed ('cannot prepare
    the sandbox: Invalid cross-device link': copy_file_range across filesystems). Now both run;
    control: the first run, on the first filesystem."""
    other = tmp_path / "uppers-other"
    other.mkdir()
    link = tmp_path / "link"
    link.symlink_to(other)
    monkeypatch.setenv("LOWLEVEL_UPPER_DIR", str(link))
    policy = lowlevel.Policy(limits=lowlevel.Limits(upper="disk", workspace_bytes=16 * MiB))
    assert lowlevel.run(["true"], policy=policy).exit_code == 0
    link.unlink()
    link.symlink_to(small_fs)
    assert lowlevel.run(["true"], policy=policy).exit_code == 0
    assert_nothing_left(small_fs)


@needs_root
def test_settle_waits_for_the_disk_uppers_close_as_for_the_teardown(upper_dir: Path, tmp_path: Path) -> None:
    """One "close later" queue (lowlevel.host.later): the drain that waits for a one-shot run's
    teardown (hygiene.settle, ``lowlevel.sandbox.teardown.drain``) also waits for the disk upper's
    close, so right after it no loop device of the run is bound (before, the close had its own
    threads that no drain saw: the loop devices were still bound after settle)."""
    policy = lowlevel.Policy(limits=lowlevel.Limits(upper="disk", workspace_bytes=16 * MiB))
    for _ in range(3):
        r = lowlevel.run(["/usr/bin/true"], policy=policy, workspace=str(tmp_path))
        assert r.exit_code == 0, r.stderr
        settle()
        assert _ours(upper_dir) == {}, _losetup()
    with lowlevel.Session(policy=policy, workspace=str(tmp_path)) as s:
        assert s.run(["sh", "-c", "echo x > f"]).exit_code == 0
    settle()
    assert _ours(upper_dir) == {}, _losetup()
    assert_nothing_left(upper_dir, timeout=0)
