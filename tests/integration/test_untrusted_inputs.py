"""Issue 10 item 4: hostile or odd inputs get one clear error, never a traceback, a hang or a
lost exit status. Each test drives the CLI (as root and as the unprivileged test user, where
both apply) or the API with the odd input, and checks the one line, the exit status and that
nothing is left behind. Everything happens under temp dirs the tests make (and tiny tmpfs
mounts of their own, as root).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import lowlevel
from lowlevel.errors import BwrapNotFoundError, LaunchError, WorkspaceError

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"


def _identities() -> list[str]:
    return ["root", "user"] if IS_ROOT else ["self"]


@pytest.fixture
def tmpdir_shared() -> Iterator[Path]:
    """A temp dir every uid may traverse (0711); the test user's files go in subdirs it owns."""
    path = Path(tempfile.mkdtemp(prefix="lowlevel-odd-inputs-"))
    os.chmod(path, 0o711)
    yield path
    subprocess.run(["umount", "-R", "-l", str(path / "mnt")], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def _owned_dir(parent: Path, name: str, identity: str, test_user: pwd.struct_passwd | None) -> Path:
    d = parent / name
    d.mkdir()
    os.chmod(d, 0o755)
    if identity == "user" and test_user is not None:
        os.chown(d, test_user.pw_uid, test_user.pw_gid)
    return d


def cli(args: list[str], identity: str, test_user: pwd.struct_passwd | None = None, *, base: Path | None = None,
        timeout: float = 60, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[bytes]:
    """`python -m lowlevel ARGS` as root or as the test user, from /."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)}
    if base is not None:
        env["LOWLEVEL_WORKSPACE_BASE"] = str(base)
    cmd = [sys.executable, "-m", "lowlevel", *args]
    if identity == "user":
        assert test_user is not None
        cmd = [RUNUSER, "-u", test_user.pw_name, "--", "env", *(f"{k}={v}" for k, v in env.items()), *cmd]
    return subprocess.run(cmd, env=env, cwd="/", stdout=stdout, stderr=subprocess.PIPE, timeout=timeout)


def _one_line(stderr: bytes) -> str:
    text = stderr.decode("utf-8", "replace")
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if ln.startswith("lowlevel:")]
    assert len(lines) == 1, text
    return lines[0]


def _user(identity: str, request: pytest.FixtureRequest) -> pwd.struct_passwd | None:
    return request.getfixturevalue("test_user") if identity == "user" else None


# --- --input of a device, a FIFO, a directory holding one -----------------------------------------

@pytest.mark.parametrize("identity", _identities())
def test_input_that_is_not_a_file_or_dir_is_refused(identity: str, request: pytest.FixtureRequest,
                                                     tmpdir_shared: Path) -> None:
    user = _user(identity, request)
    d = _owned_dir(tmpdir_shared, "in", identity, user)
    fifo = d / "fifo"
    os.mkfifo(fifo)
    tree = d / "tree"
    tree.mkdir()
    os.mkfifo(tree / "pipe")
    (tree / "ok.txt").write_text("fine\n")
    if user is not None:
        for p in (fifo, tree, tree / "pipe", tree / "ok.txt"):
            os.chown(p, user.pw_uid, user.pw_gid)
    base = _owned_dir(tmpdir_shared, "ws", identity, user)
    for src, kind in (("/dev/zero", "character device"), (str(fifo), "FIFO"), (str(tree), "FIFO")):
        p = cli(["run", "--input", src, "--", "true"], identity, user, base=base, timeout=60)
        assert p.returncode == 125, p.stderr
        assert kind in _one_line(p.stderr)
    assert list(base.iterdir()) == [], "a half-made workspace was left"
    p = cli(["run", "--rm", "--input", str(tree / "ok.txt"), "--", "cat", "ok.txt"], identity, user, base=base)
    assert p.returncode == 0 and p.stdout == b"fine\n", p.stderr  # control: a regular file is copied


def test_api_input_device_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(WorkspaceError, match="character device"):
        lowlevel.run(["true"], inputs=["/dev/zero"], workspace_base=str(tmp_path / "ws"))
    assert not any((tmp_path / "ws").iterdir())


# --- --record to a place that cannot hold it ------------------------------------------------------

@pytest.mark.parametrize("identity", _identities())
def test_record_path_checked_before_running(identity: str, request: pytest.FixtureRequest,
                                            tmpdir_shared: Path) -> None:
    user = _user(identity, request)
    ws = _owned_dir(tmpdir_shared, "ws", identity, user)
    out = _owned_dir(tmpdir_shared, "out", identity, user)
    locked = tmpdir_shared / "locked"  # root-owned 0755: the test user cannot write it
    locked.mkdir(mode=0o755)
    cases = [(str(out / "missing" / "r.json"), "does not exist"), (str(out), "is a directory"),
             ("", "must not be empty")]
    if identity == "user":
        cases.append((str(locked / "r.json"), "Permission denied"))
    for path, why in cases:
        p = cli(["run", "--workspace", str(ws), "--record", path, "--", "touch", "ran"], identity, user)
        assert p.returncode == 125, (path, p.stderr)
        assert why in _one_line(p.stderr), (path, p.stderr)
        assert not (ws / "ran").exists(), f"the program ran before the record path {path!r} was refused"
    assert sorted(os.listdir(out)) == [] and sorted(os.listdir(locked)) == []


@pytest.mark.root
def test_record_on_full_disk_keeps_output_and_status_and_leaves_no_temp_file(tmpdir_shared: Path) -> None:
    mnt = tmpdir_shared / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(mnt)], check=True)
    try:
        filler = mnt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while True:
                os.write(fd, b"x" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        ws = tmpdir_shared / "ws"
        ws.mkdir(mode=0o755)
        # The record itself does not fit: the run happened, so output and status are delivered.
        p = cli(["run", "--workspace", str(ws), "--record", str(mnt / "r.json"), "--", "sh", "-c",
                 "echo out; echo err >&2; exit 7"], "root")
        assert p.returncode == 7, p.stderr
        assert p.stdout == b"out\n"
        line = _one_line(p.stderr)
        assert "record not written" in line and "No space left" in line
        assert sorted(os.listdir(mnt)) == ["filler"], "a temp file of the record was left"
        # API: the same, as a note
        r = lowlevel.run(["sh", "-c", "exit 3"], workspace=str(ws), record=str(mnt / "r2.json"))
        assert r.exit_code == 3 and any(n.startswith("record not written") for n in r.notes)
        assert sorted(os.listdir(mnt)) == ["filler"]
        # Inputs that do not fit in the input store: refused before the run, nothing left.
        os.unlink(filler)
        big = tmpdir_shared / "big.bin"
        big.write_bytes(os.urandom(512 * 1024))
        p = cli(["run", "--input", str(big), "--record", str(mnt / "r3.json"), "--", "touch", "/workspace/ran"],
                "root", base=tmpdir_shared / "fresh")
        assert p.returncode == 125, p.stderr
        assert "No space left" in _one_line(p.stderr)
        leftovers = [str(q.relative_to(mnt)) for q in mnt.rglob("*") if ".tmp" in q.name or q.suffix == ".json"]
        assert leftovers == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# --- stdout's reader goes away -----------------------------------------------------------------------

@pytest.mark.parametrize("identity", _identities())
def test_closed_stdout_gives_no_traceback_and_keeps_status(identity: str, request: pytest.FixtureRequest,
                                                           tmpdir_shared: Path) -> None:
    user = _user(identity, request)
    base = _owned_dir(tmpdir_shared, "ws", identity, user)
    rec = _owned_dir(tmpdir_shared, "rec", identity, user)
    for args in (["run", "--rm", "--json", "--", "sh", "-c", "exit 3"],
                 ["run", "--rm", "--json", "--", "sh", "-c", "head -c 300000 /dev/zero | tr '\\0' a; exit 3"],
                 ["run", "--rm", "--record", str(rec / "r.json"), "--", "sh", "-c",
                  "head -c 300000 /dev/zero; exit 3"]):
        r, w = os.pipe()
        os.close(r)  # the reader is gone before we write: `| head -1` that already exited
        try:
            p = cli(args, identity, user, base=base, stdout=w)
        finally:
            os.close(w)
        assert p.returncode == 3, p.stderr
        assert b"Traceback" not in p.stderr and b"BrokenPipe" not in p.stderr, p.stderr


# --- a read-only workspace ----------------------------------------------------------------------------

def _ro_tmpfs(mnt: Path, owner: pwd.struct_passwd | None) -> Path:
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)], check=True)
    ws = mnt / "ws"
    ws.mkdir(mode=0o755)
    (ws / "data.txt").write_text("x\n")
    if owner is not None:
        for p in (ws, ws / "data.txt"):
            os.chown(p, owner.pw_uid, owner.pw_gid)
    return ws


@pytest.mark.root
@pytest.mark.parametrize("identity", ["root", "user"])
def test_read_only_workspace_is_one_clear_error(identity: str, request: pytest.FixtureRequest,
                                                tmpdir_shared: Path) -> None:
    user = _user(identity, request)
    ws = _ro_tmpfs(tmpdir_shared / "mnt", user)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpdir_shared / "mnt")], check=True)
    for extra in ([], ["--json"]):
        p = cli(["run", *extra, "--workspace", str(ws), "--", "touch", "ran"], identity, user)
        assert p.returncode == 125, p.stderr
        assert "read-only file system" in _one_line(p.stderr)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.parametrize("identity", ["root", "user"])
def test_workspace_turning_read_only_during_the_run_keeps_the_exit_status(
        identity: str, request: pytest.FixtureRequest, tmpdir_shared: Path) -> None:
    """The file system goes read-only while the program runs: writing its changes back into the
    workspace (the copy-on-write commit, or the hand-over's chown back) fails after the run. The
    exit status and output are still delivered, with one warning line; never a traceback."""
    user = _user(identity, request)
    mnt = tmpdir_shared / "mnt"
    ws = _ro_tmpfs(mnt, user)
    pythonpath = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
    base = _owned_dir(tmpdir_shared, "base", identity, user)  # where saved changes go (cleaned up)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "LOWLEVEL_WORKSPACE_BASE": str(base)}
    cmd = [sys.executable, "-m", "lowlevel", "run", "--workspace", str(ws), "--", "sh", "-c",
           "echo hi > new.txt; echo started; sleep 3; echo out; exit 5"]
    if user is not None:
        cmd = [RUNUSER, "-u", user.pw_name, "--", "env", *(f"{k}={v}" for k, v in env.items()), *cmd]
    proc = subprocess.Popen(cmd, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the program is running once it said so
        assert first == b"started\n", (first, proc.stderr.read() if proc.stderr else b"")
        remount = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if remount.returncode != 0:
        pytest.skip(f"cannot remount read-only while the sandbox runs: {remount.stderr!r}")
    assert proc.returncode == 5, err
    assert rest == b"out\n"
    assert b"Traceback" not in err, err
    line = _one_line(err)
    assert "warning:" in line and ("saved to" in line or "given back" in line), line


# --- misleading messages --------------------------------------------------------------------------

@pytest.mark.root
def test_process_limit_is_not_reported_as_a_userns_restriction(request: pytest.FixtureRequest,
                                                               tmpdir_shared: Path) -> None:
    """clone(2) EAGAIN at the caller's RLIMIT_NPROC made bwrap say "Creating new namespace failed",
    which lowlevel reported as "the host restricts unprivileged user namespaces"."""
    user = request.getfixturevalue("test_user")
    base = _owned_dir(tmpdir_shared, "ws", "user", user)
    failures = []
    for nproc in range(1, 7):
        pythonpath = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
        env = ["env", "PATH=/usr/bin:/bin", f"PYTHONPATH={pythonpath}", f"LOWLEVEL_WORKSPACE_BASE={base}"]
        p = subprocess.run([RUNUSER, "-u", user.pw_name, "--", "prlimit", f"--nproc={nproc}", *env, sys.executable,
                            "-m", "lowlevel", "run", "--rm", "--json", "--", "true"], capture_output=True,
                           cwd="/", timeout=60)
        if p.returncode != 0:
            text = p.stderr.decode()
            assert "user namespace" not in text, text
            if "Traceback" not in text and "lowlevel:" in text:
                failures.append(text)
                if "process limit" in text:
                    break
    # Since the anchor runs bwrap in a user namespace of its own, the caller's low RLIMIT_NPROC may
    # not stop a run at all (the process count starts in that namespace); when one fails, the
    # message must name the process limit, not user namespaces.
    assert not failures or any("process limit" in f for f in failures), failures


@pytest.mark.root
def test_unexecutable_bwrap_named_as_such_by_session_and_run(tmpdir_shared: Path) -> None:
    """A bwrap the sandbox's uid cannot execute: a new Session said "init exited before saying hello"."""
    priv = tmpdir_shared / "priv"
    priv.mkdir(mode=0o700)
    bwrap = priv / "bwrap"
    shutil.copy2(shutil.which("bwrap") or "/usr/bin/bwrap", bwrap)
    with pytest.raises(BwrapNotFoundError, match="cannot execute bwrap") as info:
        lowlevel.Session(bwrap=str(bwrap), workspace_base=str(tmpdir_shared / "ws"))
    assert "hello" not in str(info.value)
    from lowlevel.sandbox.drive import _drive_sync
    from lowlevel.sandbox.launcher import Run
    from lowlevel.sandbox.request import RunRequest
    r = Run(RunRequest(["true"], workspace_base=str(tmpdir_shared / "ws")), policy=lowlevel.Policy(), bwrap=str(bwrap))
    try:
        with pytest.raises(LaunchError, match="cannot execute bwrap"):
            _drive_sync(r)
    finally:
        r.close()
        r.discard_workspace_if_unused()
    assert list((tmpdir_shared / "ws").iterdir()) == [], "a workspace was left by the failed start"
