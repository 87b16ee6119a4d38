"""native/lowlevel_exec.c (``lowlevel/_lowlevel_exec``, the anchor): rlimits, uid/gid/groups
drop, exec; fails closed.

Every failure must exit 125 without exec'ing the target: the target here writes a marker
file, so "it did not run" is checked by the file's absence, not by the exit code alone.
The anchor refuses to run without ``--parent=PID`` naming its real parent; a shell that forks
it (``sh -c 'HELPER --parent=$$ ...'``) is that parent here. Supervision (the caller's death
at any instant) is tested in test_supervision.py.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import lowlevel
from lowlevel.sandbox import facts as launcher_facts

pytestmark = [pytest.mark.timeout(60)]
HELPER = launcher_facts.EXEC_HELPER_PATH
ROOT = os.geteuid() == 0
needs_helper = pytest.mark.skipif(not os.access(HELPER, os.X_OK),
                                  reason="lowlevel/_lowlevel_exec not built (pip install -e .)")

#: The target: records its ids, groups, capabilities and limits, proving it ran.
PROBE = """
import os, resource, sys
r, e, s = os.getresuid(); rg, eg, sg = os.getresgid()
caps = {l.split(':')[0]: l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')}
open(sys.argv[1], 'w').write(repr({'uid': (r, e, s), 'gid': (rg, eg, sg), 'groups': os.getgroups(),
    'caps': caps, 'nofile': resource.getrlimit(resource.RLIMIT_NOFILE),
    'cpu': resource.getrlimit(resource.RLIMIT_CPU), 'core': resource.getrlimit(resource.RLIMIT_CORE)}))
"""


@pytest.fixture
def marker() -> Iterator[Path]:
    """A path the target writes when it runs, in a directory any uid can write (not tmp_path:
    its parents are root-only, and a target that wrongly ran as 65534 must still leave it)."""
    d = tempfile.mkdtemp(prefix="lowlevel-exec-test-", dir="/tmp")
    os.chmod(d, 0o777)
    try:
        yield Path(d) / "ran"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _helper(args: list[str], marker: Path, *, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    # sh forks the anchor (no exec), so $$ is its parent.
    script = " ".join([HELPER, "--parent=$$", *(f"'{a}'" for a in args), "--", "/usr/bin/python3", "-c",
                       '"$0"', '"$1"']) + "; exit $?"
    return subprocess.run([*prefix, "/bin/sh", "-c", script, PROBE, str(marker)],
                          capture_output=True, text=True, timeout=30)


@needs_helper
@pytest.mark.root
def test_ids_dropped_groups_cleared_limits_set(marker: Path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = min(512, hard)
    proc = _helper([f"--rlimit=RLIMIT_NOFILE={nofile - 1}:{nofile}", "--rlimit=RLIMIT_CPU=7:8",
                    "--rlimit=RLIMIT_CORE=0:0", "--uid=65534", "--gid=65534"], marker)
    assert proc.returncode == 0, proc.stderr
    seen = eval(marker.read_text())  # noqa: S307 - our own repr()
    assert seen["uid"] == (65534, 65534, 65534)
    assert seen["gid"] == (65534, 65534, 65534)
    assert seen["groups"] == []
    assert seen["caps"]["CapEff"] == seen["caps"]["CapPrm"] == seen["caps"]["CapAmb"] == "0000000000000000"
    assert seen["nofile"] == (nofile - 1, nofile) and seen["cpu"] == (7, 8) and seen["core"] == (0, 0)
    # Control: the caller is root with supplementary groups to clear.
    assert os.getresuid() == (0, 0, 0)


@needs_helper
@pytest.mark.root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv(1) to drop CAP_SETUID")
def test_refuses_to_exec_when_setresuid_fails(marker: Path):
    """Without CAP_SETUID (setgroups and setresgid still work), setresuid fails: exit 125, no exec."""
    # Control: with the same prefix and no drop, the target runs (as root).
    ok = _helper([], marker, prefix=("setpriv", "--bounding-set=-setuid", "--"))
    assert ok.returncode == 0 and marker.exists(), ok.stderr
    marker.unlink()
    proc = _helper(["--uid=65534", "--gid=65534"], marker, prefix=("setpriv", "--bounding-set=-setuid", "--"))
    assert proc.returncode == 125
    assert "setresuid (65534, 65534, 65534): Operation not permitted" in proc.stderr
    assert not marker.exists()


@needs_helper
@pytest.mark.skipif(ROOT and launcher_facts.host_facts().cap_sys_resource,
                    reason="with CAP_SYS_RESOURCE raising a hard limit succeeds")
def test_refuses_to_exec_when_setrlimit_fails(marker: Path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("RLIMIT_NOFILE hard limit is unlimited here")
    proc = _helper([f"--rlimit=RLIMIT_NOFILE={hard + 1}:{hard + 1}"], marker)
    assert proc.returncode == 125, proc.stderr
    assert f"setrlimit RLIMIT_NOFILE={hard + 1}:{hard + 1}: Operation not permitted" in proc.stderr
    assert not marker.exists()


@needs_helper
def test_refuses_to_exec_when_setgroups_fails_unprivileged(marker: Path, request: pytest.FixtureRequest):
    """An unprivileged caller asking for uid 0: setgroups fails first; exit 125, no exec."""
    prefix: tuple[str, ...] = ()
    if ROOT:
        user = request.getfixturevalue("test_user")  # conftest: the unprivileged account
        prefix = (shutil.which("runuser") or "/usr/sbin/runuser", "-u", user.pw_name, "--")
    proc = _helper(["--uid=0", "--gid=0"], marker, prefix=prefix)
    # Without privilege the PID namespace cannot be made either: that fails first.
    assert proc.returncode == 125 and ("setgroups" in proc.stderr or "CLONE_NEWPID" in proc.stderr), proc.stderr
    assert not marker.exists()


@needs_helper
@pytest.mark.parametrize("args", [
    ["--uid=65534"],                                  # uid without gid
    ["--gid=65534"],
    ["--uid=-1", "--gid=65534"],                      # -1 means "unchanged" to setresuid
    ["--uid=4294967295", "--gid=65534"],
    ["--uid=65534x", "--gid=65534"],
    ["--uid=", "--gid=65534"],
    ["--rlimit=RLIMIT_CPU=-1:5"],
    ["--rlimit=RLIMIT_CPU=6:5"],                      # soft above hard
    ["--rlimit=RLIMIT_BOGUS=1:1"],
    ["--rlimit=RLIMIT_CPU=1"],
    ["--rlimit=RLIMIT_CPU=1:18446744073709551616"],   # overflows
    ["--setuid=0"],                                   # unknown option
    ["--uid=65534", "--gid=65534", "--userns"],       # exclusive
    ["--pass-fds=3,x"],
    ["--idmap=0:0"],                                  # needs --uid/--gid and --mnt
    ["--mnt=relative", "--lower-fd=0"],
    ["--cgroup-dir-fd=2"],                            # fds 0-2 are never ours
    ["--root-lower-fd=0"],                            # needs --mnt and ids (or --userns + path)
    ["--root-lower-path=relative"],
    ["--deadline-ns=0"], ["--deadline-ns=abc"], ["--deadline-ns=-5"],
    ["--deadline-ns=1", "--deadline-ns=2"],          # given twice
])
def test_bad_arguments_exit_125_without_exec(marker: Path, args: list[str]):
    proc = _helper(args, marker)
    assert proc.returncode == 125, (args, proc.stderr)
    assert proc.stderr.startswith("lowlevel_exec: ")
    assert not marker.exists()


@needs_helper
def test_relative_target_and_missing_target():
    def anchor(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["/bin/sh", "-c", f"{HELPER} --parent=$$ --userns {' '.join(args)}; exit $?"]
                              if not ROOT else ["/bin/sh", "-c", f"{HELPER} --parent=$$ {' '.join(args)}; exit $?"],
                              capture_output=True, text=True)
    proc = anchor("--", "python3", "-c", "pass")
    assert proc.returncode == 125 and "usage" in proc.stderr
    proc = anchor("--", "/nonexistent/bwrap")
    assert proc.returncode == 127 and "execv /nonexistent/bwrap: No such file or directory" in proc.stderr


@needs_helper
def test_deadline_kills_the_sandbox_without_the_caller():
    """--deadline-ns (CLOCK_MONOTONIC): the anchor SIGKILLs its PID 1 at that time on its own (its
    caller, the shell, only waits). Control: a deadline far away lets the program exit by itself."""
    def anchor(deadline_s: float, program: str) -> subprocess.CompletedProcess[str]:
        ns = time.monotonic_ns() + int(deadline_s * 1e9)
        ids = "--userns" if not ROOT else "--uid=65534 --gid=65534"
        return subprocess.run(["/bin/sh", "-c", f"{HELPER} --parent=$$ {ids} --deadline-ns={ns} -- {program}; exit $?"],
                              capture_output=True, text=True, timeout=120)
    proc = anchor(0.3, "/bin/sleep 30")
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    proc = anchor(60, "/bin/sleep 0.1")
    assert proc.returncode == 0, proc.stderr


@needs_helper
def test_refuses_to_start_when_the_parent_is_not_the_caller(marker: Path):
    """--parent names the caller; a different parent (the caller already died) means: do nothing."""
    proc = subprocess.run([HELPER, "--parent=1", "--", "/usr/bin/python3", "-c", PROBE, str(marker)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 125 and "the caller exited" in proc.stderr
    assert not marker.exists()


# -- the launcher ---------------------------------------------------------------------------

SCRIPT = "id -u; id -g; id -G; ulimit -n; ulimit -c; grep CapEff /proc/self/status"


@pytest.mark.bwrap
def test_launcher_always_goes_through_the_anchor(monkeypatch: pytest.MonkeyPatch):
    r = lowlevel.run(["sh", "-c", SCRIPT])
    shutil.rmtree(r.workspace, ignore_errors=True)
    assert r.argv[0] == HELPER and r.exit_code == 0, r.stderr
    assert b"CapEff:\t0000000000000000" in r.stdout
    out = r.stdout.decode().split()
    assert out[0] != "0" and out[-3] == "0"  # not root inside; no core dumps (ulimit -c)

    def missing() -> str:
        raise lowlevel.UnsupportedError("exec-helper", "missing", "reinstall lowlevel")
    monkeypatch.setattr(launcher_facts, "_exec_helper", missing)
    with pytest.raises(lowlevel.UnsupportedError):
        lowlevel.run(["true"])


@pytest.mark.bwrap
@pytest.mark.root
def test_launcher_reports_a_failing_helper_as_setup_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A helper that exits 125 before bwrap runs is a LaunchError carrying its message."""
    fake = tmp_path / "fake_exec"
    fake.write_text("#!/bin/sh\necho 'lowlevel_exec: setresuid (65534, 65534, 65534): Operation not permitted' >&2\n"
                    "exit 125\n")
    fake.chmod(0o755)
    monkeypatch.setattr(launcher_facts, "_exec_helper", lambda: str(fake))
    with pytest.raises(lowlevel.LaunchError) as info:
        lowlevel.run(["true"])
    assert "setresuid" in str(info.value)


# -- joining the run's cgroups ------------------------------------------------------------------

#: Records the target's own /proc/self/cgroup and its parent's (the anchor's).
CGROUP_PROBE = """
import sys
ppid = open('/proc/self/stat').read().rsplit(')', 1)[1].split()[1]  # host /proc: the anchor's host PID
open(sys.argv[1], 'w').write(repr({'self': open('/proc/self/cgroup').read(),
                                   'anchor': open(f'/proc/{ppid}/cgroup').read()}))
"""


def _seccomp_enosys(nr: int) -> None:
    """preexec_fn: a seccomp filter making syscall ``nr`` fail with ENOSYS (an older kernel)."""
    import ctypes
    import struct
    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    allow, enosys = 0x7FFF0000, 0x00050000 | 38
    prog = [(ld, 0, 0, 4), (jeq, 0, 3, 0xC000003E), (ld, 0, 0, 0), (jeq, 0, 1, nr), (ret, 0, 0, enosys),
            (ret, 0, 0, allow)]
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    fp = ctypes.create_string_buffer(fprog)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, fp, 0, 0) != 0:  # NO_NEW_PRIVS, SET_SECCOMP
        raise OSError(ctypes.get_errno(), "seccomp")


@needs_helper
@pytest.mark.root
@pytest.mark.parametrize("clone3", ["clone_into_cgroup", "enosys"])
def test_cgroup_join_v1_tasks_and_v2_born_inside(marker: Path, clone3: str):
    """v1: the anchor writes "0" to each tasks fd (it moves itself); v2: bwrap's stand-in is
    born in the run's v2 directory (clone3 CLONE_INTO_CGROUP), the anchor stays out of it.
    Where clone3 fails with ENOSYS (an old kernel), the child joins the v2 directory itself."""
    from lowlevel.host import cgroup_detect as _cgroup_detect
    support = _cgroup_detect.detect_cgroups()
    v1 = support.hierarchy_for("pids") or support.hierarchy_for("memory")
    v2 = support.v2
    if v1 is None or v1.version != 1 or v2 is None or v2.base is None:
        pytest.skip("needs a writable cgroup v1 hierarchy and a writable v2 one (a hybrid host)")
    name = f"{os.getpid()}-exec-test-{clone3}"
    dirs = [os.path.join(v1.base or "", name), os.path.join(v2.base, name)]
    for d in dirs:
        os.mkdir(d)
    tasks = os.open(os.path.join(dirs[0], "tasks"), os.O_WRONLY | os.O_CLOEXEC)
    v2_dir = os.open(dirs[1], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        script = (f"{HELPER} --parent=$$ --cgroup-fd={tasks} --cgroup-dir-fd={v2_dir} --uid=65534 --gid=65534 "
                  f"-- /usr/bin/python3 -c \"$0\" \"$1\"; exit $?")
        proc = subprocess.run(["/bin/sh", "-c", script, CGROUP_PROBE, str(marker)], capture_output=True, text=True,
                              timeout=30, pass_fds=(tasks, v2_dir),
                              preexec_fn=(lambda: _seccomp_enosys(435)) if clone3 == "enosys" else None)
        assert proc.returncode == 0, proc.stderr
        seen = {k: _cgroup_detect.parse_proc_cgroup(v) for k, v in eval(marker.read_text()).items()}  # noqa: S307
        v1_key = next(k for k in seen["self"] if k and set(k.split(",")) & v1.controllers)
        rel = [d[len(h.mount):] for d, h in zip(dirs, (v1, v2))]
        assert seen["self"][v1_key] == rel[0] and seen["anchor"][v1_key] == rel[0]
        assert seen["self"][""] == rel[1]
        assert seen["anchor"][""] != rel[1]  # never moved on v2: the child was born there
    finally:
        os.close(tasks)
        os.close(v2_dir)
        for d in dirs:
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except OSError:
                    import time
                    time.sleep(0.01)


@needs_helper
@pytest.mark.parametrize(("make", "words"), [
    (lambda p: (os.symlink(p.name + "-b", p), os.symlink(p.name, str(p) + "-b")), "Too many levels of symbolic links"),
    (lambda p: None, "No such file or directory"),
])
def test_the_anchor_words_errors_as_glibc_does(tmp_path: Path, make, words: str):
    """The launcher reads the anchor's messages by glibc's strerror words (facts._TRANSIENT_TEXT,
    failures.py), and the anchor may be linked against musl, which says "Symbolic link loop" for
    ELOOP (native/lowlevel_errtext.h): an execv of a symlink loop is worded as glibc words it.
    Control: ENOENT, worded alike by both libcs."""
    target = tmp_path / "prog"
    make(target)
    proc = subprocess.run(["/bin/sh", "-c", f"{HELPER} --parent=$$ -- {target}; exit $?"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 127, proc.stderr
    assert proc.stderr == f"lowlevel_exec: execv {target}: {words}\n", proc.stderr
