"""Integration tests of lowlevel.spec.limits and lowlevel.host.cgroups alone, on the real kernel: rlimits
via prlimit and per-run cgroups with plain child processes (and one bwrap --block-fd handshake).

Every child is gated: it blocks on a byte from stdin until its limits are in place, as bwrap's
child blocks on --block-fd. Every child is bounded in time (sleeps <= 60 s, killed at teardown)
and memory (limits of 64 MiB, allocation loops capped at 1 GiB).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from collections.abc import Iterator

import pytest
from helpers.cgroup_attach import apply_rlimits, attach
from helpers.hygiene import open_fds

from lowlevel.host import cgroup_detect as D
from lowlevel.host import cgroups as C
from lowlevel.errors import LaunchError
from lowlevel.spec.limits import MiB, Limits

ROOT = os.geteuid() == 0
SUPPORT = D.detect_cgroups()
needs_cgroup = pytest.mark.skipif(not SUPPORT.usable, reason="no writable cgroup hierarchy "
                                  "(run as root, or in a delegated cgroup v2 subtree)")


PRELUDE = """\
import os, sys, time, signal, resource
def quiet():  # for children that outlive the gated process: let go of its pipes
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
sys.stdin.buffer.read(1)
"""


class Gated:
    """A ``python -c`` child that runs ``body`` only after :meth:`go`."""

    def __init__(self, body: str) -> None:
        code = PRELUDE + textwrap.dedent(body)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.pid = self.proc.pid

    def go(self, timeout: float = 30) -> tuple[int, str, str]:
        out, err = self.proc.communicate(b"g", timeout=timeout)
        return self.proc.returncode, out.decode(), err.decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def gated() -> Iterator:
    made: list[Gated] = []

    def make(body: str) -> Gated:
        g = Gated(body)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


@pytest.fixture
def run_cgroup() -> Iterator:
    made: list[C.RunCgroup] = []

    def make(limits: Limits, support: D.CgroupSupport | None = None) -> C.RunCgroup:
        cg = C.RunCgroup.create(limits, support=support)
        assert cg is not None
        made.append(cg)
        return cg

    yield make
    for cg in made:
        cg.kill_all()
        cg.remove()


def _gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (absent or a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.01)
    return alive


# ---------------------------------------------------------------------------------------------
# rlimits (no cgroup needed)
# ---------------------------------------------------------------------------------------------

PRINT_LIMITS = """
import json
names = ["RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"]
print(json.dumps({n: resource.getrlimit(getattr(resource, n)) for n in names}))
"""


def test_apply_rlimits_reach_the_child(gated) -> None:
    lim = Limits(cpu_s=5, memory_bytes=512 * MiB, pids=100, fsize_bytes=8 * MiB, nofile=64,
                 address_space_bytes=4096 * MiB)
    g = gated(PRINT_LIMITS)
    applied = apply_rlimits(g.pid, lim)
    assert applied == ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NPROC", "RLIMIT_FSIZE",
                       "RLIMIT_NOFILE", "RLIMIT_CORE")
    rc, out, err = g.go()
    assert rc == 0, err
    got = {k: tuple(v) for k, v in json.loads(out).items()}
    assert got == {"RLIMIT_CPU": (5, 6), "RLIMIT_AS": (4096 * MiB,) * 2, "RLIMIT_DATA": (512 * MiB,) * 2,
                   "RLIMIT_NPROC": (100, 100), "RLIMIT_FSIZE": (8 * MiB,) * 2, "RLIMIT_NOFILE": (64, 64),
                   "RLIMIT_CORE": (0, 0)}


def test_apply_rlimits_never_raises_above_an_existing_hard_limit(gated) -> None:
    g = gated(PRINT_LIMITS)
    resource.prlimit(g.pid, resource.RLIMIT_NOFILE, (100, 200))
    apply_rlimits(g.pid, Limits(nofile=1024))
    rc, out, _ = g.go()
    assert tuple(json.loads(out)["RLIMIT_NOFILE"]) == (200, 200)


def test_apply_rlimits_to_a_dead_pid_raises_launch_error(gated) -> None:
    g = gated("")
    g.go()
    with pytest.raises(LaunchError) as info:
        apply_rlimits(g.pid, Limits())
    assert info.value.errno == 3  # ESRCH
    assert f"prlimit({g.pid}, RLIMIT_CPU, (60, 61))" in str(info.value)


def test_fsize_stops_the_write_and_caps_the_file(gated, tmp_path) -> None:
    # Python ignores SIGXFSZ from startup (pylifecycle.c) and the disposition survives exec: a
    # launcher that spawns with os.posix_spawn must pass setsigdef=(SIGPIPE, SIGXFSZ).
    target = tmp_path / "big"
    g = gated(f"""
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        with open({str(target)!r}, "wb") as f:
            for _ in range(4):
                f.write(b"x" * {1 * MiB})
                f.flush()
    """)
    apply_rlimits(g.pid, Limits(fsize_bytes=1 * MiB))
    rc, _, _ = g.go()
    assert rc == -signal.SIGXFSZ
    assert target.stat().st_size == 1 * MiB


def test_fsize_with_sigxfsz_ignored_gives_efbig(gated, tmp_path) -> None:
    target = tmp_path / "big"
    g = gated(f"""
        fd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)
        os.write(fd, b"x" * {1 * MiB})
        try:
            os.write(fd, b"x")
        except OSError as e:
            print(e.errno)
    """)
    apply_rlimits(g.pid, Limits(fsize_bytes=1 * MiB))
    rc, out, _ = g.go()
    assert (rc, out.strip()) == (0, "27")  # EFBIG


def test_rlimit_cpu_sends_sigxcpu(gated) -> None:
    g = gated("while True: pass")
    apply_rlimits(g.pid, Limits(cpu_s=1))
    rc, _, _ = g.go(timeout=10)
    assert rc == -signal.SIGXCPU


def test_rlimit_data_fallback_fails_allocation_without_memory_cgroup(gated) -> None:
    g = gated("""
        try:
            b = bytearray(256 * 1024 * 1024)
        except MemoryError:
            sys.exit(3)
    """)
    applied = apply_rlimits(g.pid, Limits(memory_bytes=64 * MiB), cgroup=None)
    assert "RLIMIT_DATA" in applied
    rc, _, _ = g.go()
    assert rc == 3


# ---------------------------------------------------------------------------------------------
# cgroups (root here; v1 memory/pids/cpu/cpuacct/freezer + v2 core on this host)
# ---------------------------------------------------------------------------------------------


@needs_cgroup
def test_enforced_and_rlimit_fallbacks_dropped(run_cgroup, gated) -> None:
    cg = run_cgroup(Limits())
    plan = C.enforcement_plan(Limits())
    assert set(cg.enforced) == {c for c, _ in plan.cgroups}
    g = gated(PRINT_LIMITS)
    attach(cg, g.pid)
    applied = apply_rlimits(g.pid, Limits(), cg)
    if "memory" in cg.enforced:
        assert "RLIMIT_DATA" not in applied
    if "pids" in cg.enforced:
        assert "RLIMIT_NPROC" not in applied
    assert cg.pids() == [g.pid]
    assert g.go()[0] == 0


def _cpu_sources() -> list:
    """cpu.stat (v2) where writable, and the v1 cpuacct fallback forced by leaving v2 out."""
    out = [pytest.param(None, id="default")]
    no_v2 = D.CgroupSupport(tuple(h for h in SUPPORT.hierarchies if h.version == 1))
    if SUPPORT.v2 is not None and SUPPORT.v2.base and no_v2.hierarchy_for("cpuacct") is not None:
        out.append(pytest.param(no_v2, id="v1-cpuacct"))
    return out


@needs_cgroup
@pytest.mark.parametrize("support", _cpu_sources())
def test_cpu_time_is_read_from_the_cgroup(run_cgroup, gated, support) -> None:
    cg = run_cgroup(Limits(), support)
    g = gated("""
        t = time.process_time()
        while time.process_time() - t < 0.3: pass
        pid = os.fork()   # a child's CPU time counts too, unlike os.wait4 of a grandchild
        t = time.process_time()
        while time.process_time() - t < 0.2: pass
        if pid == 0: os._exit(0)
        os.waitpid(pid, 0)
    """)
    attach(cg, g.pid)
    assert g.go()[0] == 0
    stats = cg.stats()
    assert stats.cpu_user_s is not None and stats.cpu_system_s is not None
    assert 0.6 <= stats.cpu_user_s + stats.cpu_system_s < 5


@needs_cgroup
@pytest.mark.skipif(SUPPORT.hierarchy_for("pids") is None, reason="no writable pids cgroup")
def test_fork_bomb_stops_at_pids_max(run_cgroup, gated) -> None:
    cg = run_cgroup(Limits(pids=16))
    g = gated("""
        n = 0
        while n < 1000:
            try:
                pid = os.fork()
            except OSError as e:
                print(n, e.errno, flush=True)
                break
            if pid == 0:
                quiet()
                time.sleep(60)
                os._exit(0)
            n += 1
    """)
    attach(cg, g.pid)
    rc, out, _ = g.go()
    forked, err = map(int, out.split())
    assert (forked, err) == (15, 11)  # 16 including the parent; EAGAIN
    stats = cg.stats()
    assert stats.pids_limit_hit is True
    survivors = cg.pids()
    assert len(survivors) == 15
    cg.kill_all()
    cg.remove()
    assert _wait_gone(survivors) == []


@needs_cgroup
@pytest.mark.skipif(SUPPORT.hierarchy_for("memory") is None, reason="no writable memory cgroup")
def test_memory_bomb_is_oom_killed(run_cgroup, gated) -> None:
    cg = run_cgroup(Limits(memory_bytes=64 * MiB))
    assert "memory" in cg.enforced
    g = gated("""
        chunks = []
        for _ in range(64):                      # at most 1 GiB
            chunks.append(bytearray(16 * 1024 * 1024))   # zeroed: every page touched
        sys.exit(5)
    """)
    attach(cg, g.pid)
    apply_rlimits(g.pid, Limits(memory_bytes=64 * MiB), cg)
    rc, _, _ = g.go()
    assert rc == -signal.SIGKILL
    stats = cg.stats()
    assert stats.oom_kills is not None and stats.oom_kills >= 1
    assert stats.peak_memory_bytes is not None and 32 * MiB < stats.peak_memory_bytes <= 64 * MiB


@needs_cgroup
@pytest.mark.skipif(SUPPORT.hierarchy_for("cpu") is None, reason="no writable cpu cgroup")
def test_cpu_quota_throttles(run_cgroup, gated) -> None:
    cg = run_cgroup(Limits(cpu_quota=0.1))
    assert "cpu" in cg.enforced
    g = gated("""
        t = time.monotonic()
        while time.monotonic() - t < 1.0: pass
    """)
    attach(cg, g.pid)
    g.go()
    stats = cg.stats()
    used = (stats.cpu_user_s or 0) + (stats.cpu_system_s or 0)
    assert 0.02 < used < 0.4  # ~0.1 s of 1 s wall at 0.1 cores


def _supports() -> list:
    """The host's support, then forced fallbacks: v1 freezer kill, then the plain SIGKILL loop."""
    out = [pytest.param(None, id="default")]
    no_v2 = D.CgroupSupport(tuple(h for h in SUPPORT.hierarchies if h.version == 1))
    if SUPPORT.v2 is not None and no_v2.hierarchy_for("freezer") is not None:
        out.append(pytest.param(no_v2, id="v1-freezer"))
    bare = D.CgroupSupport(tuple(h for h in no_v2.hierarchies if "freezer" not in h.controllers))
    if bare.usable:
        out.append(pytest.param(bare, id="kill-loop"))
    return out


@needs_cgroup
@pytest.mark.parametrize("support", _supports())
def test_kill_all_gets_a_setsid_double_forked_daemon(run_cgroup, gated, support) -> None:
    cg = run_cgroup(Limits(pids=64), support)
    g = gated("""
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                quiet()
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                time.sleep(60)
                os._exit(0)
            os._exit(0)
        os.wait()
        time.sleep(0.1)
    """)
    attach(cg, g.pid)
    assert g.go()[0] == 0
    daemons = cg.pids()
    assert len(daemons) == 1 and not _gone(daemons[0])
    cg.kill_all()
    assert cg.pids() == []
    cg.remove()
    assert _wait_gone(daemons) == []
    assert all(not os.path.exists(n.path) for n in cg.nodes)


@needs_cgroup
def test_context_manager_kills_and_removes(gated) -> None:
    g = gated("time.sleep(60)")
    with C.RunCgroup.create(Limits()) as cg:
        attach(cg, g.pid)
        g.proc.stdin.write(b"g")
        g.proc.stdin.flush()
    assert g.proc.wait(timeout=5) == -signal.SIGKILL
    assert all(not os.path.exists(n.path) for n in cg.nodes)


@needs_cgroup
def test_remove_after_a_failed_attach_leaves_nothing(gated) -> None:
    g = gated("")
    g.go()
    cg = C.RunCgroup.create(Limits())
    assert cg is not None
    with pytest.raises(LaunchError) as info:
        attach(cg, g.pid)
    assert info.value.errno == 3  # ESRCH: the process is gone
    cg.remove()
    assert all(not os.path.exists(n.path) for n in cg.nodes)


@needs_cgroup
def test_many_runs_leave_no_cgroups_and_no_fds() -> None:
    fds = set(open_fds())
    for _ in range(50):
        cg = C.RunCgroup.create(Limits(cpu_quota=1.0))
        assert cg is not None
        proc = subprocess.Popen(["true"])
        attach(cg, proc.pid)
        proc.wait()
        cg.stats()
        cg.remove()
    for h in SUPPORT.hierarchies:
        if h.base is not None:
            mine = [e for e in os.listdir(h.base) if e.startswith(f"{os.getpid()}-")]
            assert mine == [], h.base
    assert set(open_fds()) == fds


# ---------------------------------------------------------------------------------------------
# bwrap --block-fd handshake: limits in place before the program's first instruction
# ---------------------------------------------------------------------------------------------


@needs_cgroup
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed (apt install bubblewrap)")
def test_bwrap_handshake_limits_apply_before_exec(run_cgroup) -> None:
    lim = Limits(nofile=77, pids=32, memory_bytes=128 * MiB)
    cg = run_cgroup(lim)
    r_info, w_info = os.pipe()
    r_block, w_block = os.pipe()
    script = "grep 'open files' /proc/self/limits; cat /proc/self/cgroup"
    argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
            "--die-with-parent", "--info-fd", str(w_info), "--block-fd", str(r_block), "sh", "-c", script]
    proc = subprocess.Popen(argv, pass_fds=(w_info, r_block), stdout=subprocess.PIPE)
    os.close(w_info)
    os.close(r_block)
    try:
        data = b""
        while True:  # bwrap writes the JSON and keeps the fd open
            data += os.read(r_info, 4096)
            try:
                info = json.loads(data)
                break
            except ValueError:
                continue
        child = info["child-pid"]
        attach(cg, child)
        applied = apply_rlimits(child, lim, cg)
        assert "RLIMIT_NOFILE" in applied
        os.write(w_block, b"x")
    finally:
        os.close(w_block)
        os.close(r_info)
    out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0
    assert out.split("\n")[0].split()[3:5] == ["77", "77"]
    mem = cg.node("memory")
    if mem is not None:
        rel = os.path.relpath(mem.path, D.detect_cgroups().hierarchy_for("memory").mount)  # type: ignore[union-attr]
        assert f":memory:/{rel}\n" in out


# ---------------------------------------------------------------------------------------------
# Unprivileged: rlimits only, reported so
# ---------------------------------------------------------------------------------------------

UNPRIV = """
import json, os
from lowlevel.host import cgroup_detect as D
from lowlevel.host import cgroups as C
from lowlevel.spec import limits as L
from lowlevel.errors import UnsupportedError
s = D.detect_cgroups()
out = {"usable": s.usable, "create": C.RunCgroup.create(L.Limits()) is None,
       "plan": [list(x) for x in C.enforcement_plan(L.Limits()).not_enforced]}
try:
    C.RunCgroup.create(L.Limits(require=("memory",)))
except UnsupportedError as e:
    out["feature"] = e.feature
print(json.dumps(out))
"""


@pytest.mark.skipif(not ROOT or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_unprivileged_user_gets_rlimits_only_and_require_fails() -> None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-c", UNPRIV], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": repo}, cwd="/")
    if proc.returncode != 0 and b"Permission denied" in proc.stderr:
        pytest.skip(f"user 65534 cannot read {repo}")
    assert proc.returncode == 0, proc.stderr.decode()
    out = json.loads(proc.stdout)
    assert out["usable"] is False and out["create"] is True
    assert out["feature"] == "cgroup:memory"
    assert [c for c, _ in out["plan"]] == ["memory", "pids"]


def test_default_limits_match_replace() -> None:
    assert replace(Limits(), nofile=10).nofile == 10
