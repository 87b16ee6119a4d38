"""Supervision and hygiene: floods, the caller's death, and 1,000 runs that leave nothing behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers.hygiene import children, open_fds, settle
from helpers.procs import pids_with

import lowlevel
from lowlevel.host import cgroup_detect as _cgroup_detect

pytestmark = pytest.mark.bwrap


def _ws() -> str:
    path = tempfile.mkdtemp(prefix="ws-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


def test_one_gib_stdout_flood_is_capped_and_caller_rss_bounded():
    code = (
        "import resource, lowlevel, tempfile, os\n"
        "ws = tempfile.mkdtemp(dir='/tmp'); os.chmod(ws, 0o755)\n"
        "p = lowlevel.Policy(stdout_limit_bytes=1 << 20)\n"
        "r = lowlevel.run(['head', '-c', str(1 << 30), '/dev/zero'], policy=p, workspace=ws, timeout=120)\n"
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve, so it would report the
        # forking parent's (pytest's) peak, not ours.
        "hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "print(r.exit_code, len(r.stdout), r.stdout_truncated, r.stdout_dropped_bytes, hwm)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    exit_code, kept, truncated, dropped, maxrss_kib = p.stdout.split()
    assert exit_code == "0" and int(kept) == 1 << 20 and truncated == "True"
    assert int(dropped) == (1 << 30) - (1 << 20)
    assert int(maxrss_kib) < 150 * 1024, f"caller RSS grew to {int(maxrss_kib) // 1024} MiB"


def test_head_and_tail_kept_when_truncated():
    data = b"HEAD" + b"." * 100_000 + b"TAIL"
    r = lowlevel.run(["cat"], stdin=data, workspace=_ws(), policy=lowlevel.Policy(stdout_limit_bytes=1000))
    assert r.stdout.startswith(b"HEAD") and r.stdout.endswith(b"TAIL") and len(r.stdout) == 1000
    assert r.stdout_truncated and r.stdout_dropped_bytes == len(data) - 1000


def test_sigkill_of_the_caller_kills_the_sandbox_within_a_second():
    marker = f"lowlevel-orphan-probe-{os.getpid()}-{time.time_ns()}"
    ws = _ws()
    out = _ws()  # the heartbeat goes to a writable bind: the workspace's writes stay in its upper layer
    os.chmod(out, 0o777)
    code = (
        "import lowlevel, sys\n"
        f"p = lowlevel.Policy(binds=(lowlevel.Bind('{out}', '/out', writable=True),))\n"
        f"lowlevel.run(['sh', '-c', 'while :; do echo x >> /out/beat; sleep 0.05; done', '{marker}'],\n"
        f"             workspace='{ws}', timeout=600, policy=p)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    beat = Path(out, "beat")
    deadline = time.monotonic() + 30
    while not (beat.exists() and beat.stat().st_size > 10):
        assert time.monotonic() < deadline, "the sandbox never started"
        time.sleep(0.05)
    assert pids_with(marker), "control: the sandboxed loop is visible on the host while it runs"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    while pids_with(marker) and time.monotonic() - t0 < 1.0:
        time.sleep(0.02)
    assert not pids_with(marker), "sandbox processes survived their caller's SIGKILL for over 1 s"
    size = beat.stat().st_size
    time.sleep(0.3)
    assert beat.stat().st_size == size


def _children() -> list[int]:
    """This process's children (zombies included), less lowlevel's kept ones (tests/helpers/hygiene.py)."""
    return children()


def _our_cgroups() -> list[str]:
    settle()  # the finished runs' cgroups are removed off the result path (lowlevel.sandbox.teardown)
    support = _cgroup_detect.detect_cgroups()
    found = []
    for h in support.hierarchies:
        if h.base and os.path.isdir(h.base):
            found += [d for d in os.listdir(h.base) if str(os.getpid()) in d]
    return found


def _ours_in_tmp() -> set[str]:
    """Entries of /tmp lowlevel could make: its own prefix and tempfile's default one (other
    jobs on a shared machine, pip's unpack dirs..., are not ours to count)."""
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(("lowlevel", "tmp"))}


@pytest.mark.slow
def test_thousand_runs_leave_nothing_behind(monkeypatch: pytest.MonkeyPatch):
    # A temp directory of this test's own: other callers on a shared machine (benchmarks, other
    # test runs) make lowlevel-* entries in /tmp too.
    private_tmp = tempfile.mkdtemp(prefix="thousand-", dir="/tmp")
    os.chmod(private_tmp, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", private_tmp)
    ws = _ws()
    base = tempfile.mkdtemp(prefix="wsbase-", dir="/tmp")
    os.chmod(base, 0o755)
    lowlevel.run(["true"], workspace=ws)  # warm-up: probes, seccomp compile, cgroup base dirs
    fds_before = sorted(open_fds())
    tmp_before = _ours_in_tmp()
    for i in range(1000):
        if i % 250 == 0:
            # a few error paths too: they must not leak either
            with pytest.raises(lowlevel.ExecError):
                lowlevel.run(["no-such-command-anywhere"], workspace=ws)
            r = lowlevel.run(["sleep", "5"], workspace=ws, timeout=0.2)
            assert r.timed_out
        r = lowlevel.run(["true"], workspace=ws)
        assert r.exit_code == 0
    assert sorted(open_fds()) == fds_before, "fds leaked (pidfds, pipes or memfds)"
    assert _children() == [], "zombie or live children left"
    assert _our_cgroups() == [], "stray per-run cgroups left"
    assert _ours_in_tmp() == tmp_before, "temp files or dirs left"
    assert not any("memfd:" in os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))
    # No mount of lowlevel's in the host's mount namespace (the overlay and its tmpfs live in each
    # run's own). No per-run uid is still leased either: a lease is an OFD lock held by an
    # anchor's fd, and no child (anchor) is left. The lease file itself cannot say whose a lock
    # is (F_OFD_GETLK reports pid -1), and other callers on a shared machine hold theirs.
    with open("/proc/self/mountinfo") as f:
        assert "lowlevel-upper" not in f.read()
    shutil.rmtree(private_tmp, ignore_errors=True)


def test_inherited_fd_above_the_soft_nofile_limit_is_closed_not_fatal(tmp_path):
    """A caller may hold an inheritable fd numbered above its soft RLIMIT_NOFILE (inherited from
    a parent with a higher limit): posix_spawn cannot close it, the anchor does (close_range)."""
    code = (
        "import os, resource, lowlevel\n"
        "fd = os.open('/etc/hostname', os.O_RDONLY)\n"
        "os.dup2(fd, 2000, inheritable=True)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "r = lowlevel.run(['sh', '-c', 'ls /proc/self/fd'])\n"
        "print(r.exit_code, sorted(int(x) for x in r.stdout.split()))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    exit_code, fds = p.stdout.split(" ", 1)
    assert exit_code == "0"
    assert max(eval(fds)) < 10, fds  # noqa: S307 - our own repr: only stdio and ls's own directory fd


def test_fd_pressure_gives_typed_errors_and_leaks_nothing():
    """100 concurrent arun under `ulimit -n 64`: each run succeeds or raises LaunchError; no raw
    OSError escapes, and every fd is closed afterwards."""
    code = (
        "import asyncio, os, resource, sys, lowlevel\n"
        "from lowlevel.sandbox.aio import arun\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'helpers')!r})\n"
        "from hygiene import open_fds\n"  # less the fds lowlevel keeps by design
        "lowlevel.run(['true'])\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "before = len(open_fds())\n"
        "async def one():\n"
        "    try:\n"
        "        return (await arun(['true'])).exit_code\n"
        "    except (lowlevel.LaunchError, lowlevel.WorkspaceError) as err:\n"
        "        return type(err).__name__\n"
        "async def main():\n"
        "    return await asyncio.gather(*(one() for _ in range(100)), return_exceptions=True)\n"
        "out = asyncio.run(main())\n"
        "kinds = sorted({type(x).__name__ if isinstance(x, BaseException) else str(x) for x in out})\n"
        "print(kinds, len(open_fds()) - before)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    kinds, leaked = p.stdout.rsplit(" ", 1)
    assert set(eval(kinds)) <= {"0", "LaunchError", "WorkspaceError"}, kinds  # noqa: S307 - our own repr
    assert int(leaked) <= 0, p.stdout
