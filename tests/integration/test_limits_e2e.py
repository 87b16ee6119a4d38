"""End-to-end limit tests through ``lowlevel.run`` (issue 4), for each identity of the
``sandbox`` fixture: root (cgroups here) and an unprivileged user (rlimits only).

Bounded: every run has a wall-clock timeout of at most 10 s, memory is capped at 256 MiB by the
cgroup or by RLIMIT_DATA, process counts by pids.max or RLIMIT_NPROC.
"""

from __future__ import annotations

import os
import secrets
import signal
import time

import pytest

from helpers.hygiene import settle
from helpers.procs import pids_with

from lowlevel.host import cgroup_detect
from lowlevel.spec.limits import MiB

pytestmark = pytest.mark.bwrap


def _cgroup(outcome, controller: str) -> bool:
    return f"cgroup:{controller}" in outcome.limits_enforced


def _nothing_survives(marker: str, timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := pids_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _run_cgroups_of(pid: int) -> list[str]:
    if pid == os.getpid():
        settle()  # the finished runs' cgroups are removed off the result path (lowlevel.sandbox.teardown)
    """Run cgroups left by process ``pid`` under any of our bases."""
    left = []
    for h in cgroup_detect.detect_cgroups().hierarchies:
        if h.base is not None and os.path.isdir(h.base):
            left += [os.path.join(h.base, e) for e in os.listdir(h.base)
                     if e.startswith((f"{pid}-", f"run-{pid}-"))]
    return left


def test_fork_bomb_stops_at_the_pids_limit_and_nothing_survives(sandbox) -> None:
    marker = f"bomb-{secrets.token_hex(4)}"
    # Every process forks forever and retries when fork fails: only the timeout ends it.
    code = ("import os, sys, time\n"
            "top = os.getpid()\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError as e:\n"
            "        if os.getpid() == top or os.getppid() == 1: print(e.errno, file=sys.stderr)\n"
            "        time.sleep(0.05)\n")
    t0 = time.monotonic()
    out = sandbox.run(["python3", "-c", code, marker], timeout=3, limits={"pids": 32})
    assert out.error is None, out.message
    assert time.monotonic() - t0 < 30
    assert out.killed_by == "timeout", out
    assert "11\n" in out.err  # EAGAIN: the limit stopped fork
    if sandbox.identity == "root":
        assert _cgroup(out, "pids")
    else:
        assert "RLIMIT_NPROC" in out.limits_enforced
    assert _nothing_survives(marker) == []
    assert _run_cgroups_of(os.getpid()) == []


def test_memory_bomb_2gib_under_256mib(sandbox) -> None:
    # Touches every byte: 32 chunks of 64 MiB, 2 GiB in all.
    code = "chunks = [bytearray(b'x') * (64 << 20) for _ in range(32)]"
    out = sandbox.run(["python3", "-c", code], timeout=10, limits={"memory_bytes": 256 * MiB})
    assert out.error is None, out.message
    assert out.exit_code != 0
    if _cgroup(out, "memory"):
        assert out.killed_by == "memory", out
        assert out.term_signal == signal.SIGKILL
        assert out.raw["oom_kills"] >= 1
        assert out.raw["peak_memory_bytes"] <= 256 * MiB
    else:
        # rlimits only: RLIMIT_DATA makes the allocation fail instead.
        assert sandbox.identity == "user"
        assert "RLIMIT_DATA" in out.limits_enforced
        assert "MemoryError" in out.err
        assert out.killed_by is None


def test_cpu_spin_is_killed_by_cpu(sandbox) -> None:
    out = sandbox.run(["python3", "-c", "while True: pass"], timeout=10, limits={"cpu_s": 1})
    assert out.error is None, out.message
    assert out.killed_by == "cpu", out
    assert out.term_signal in (signal.SIGXCPU, signal.SIGKILL)
    assert "RLIMIT_CPU" in out.limits_enforced
    if out.raw.get("cpu_user_s") is not None:
        # RLIMIT_CPU counts tick samples: under load it fires before 1 s of exact runtime.
        assert 0.3 <= out.raw["cpu_user_s"] + out.raw["cpu_system_s"] < 3


def test_write_past_fsize_fails_inside_and_the_host_file_is_capped(sandbox) -> None:
    # exec: head itself is the program, so its own death is what the Result reports (a shell
    # around it would exit 153 normally after printing "File size limit exceeded").
    out = sandbox.run(["sh", "-c", "exec head -c 4194304 /dev/zero > big"], timeout=10,
                      limits={"fsize_bytes": 1 * MiB})
    assert out.error is None, out.message
    # SIGXFSZ (exit 128+25) where its default disposition reaches the program, EFBIG otherwise.
    assert out.exit_code != 0
    assert out.term_signal == signal.SIGXFSZ or "File too large" in out.err, out
    assert os.path.getsize(os.path.join(out.workspace, "big")) == 1 * MiB


def test_setsid_daemon_is_gone_after_the_timeout(sandbox) -> None:
    marker = f"daemon-{secrets.token_hex(4)}"
    script = f"setsid sh -c 'exec sleep 1000' {marker} </dev/null >/dev/null 2>&1 & exec sleep 1000"
    out = sandbox.run(["sh", "-c", script], timeout=1)
    assert out.error is None, out.message
    assert out.killed_by == "timeout" and out.timed_out
    assert _nothing_survives(marker) == []
    assert _run_cgroups_of(os.getpid()) == []


def test_limits_enforced_says_what_applied(sandbox) -> None:
    out = sandbox.run(["true"], limits={"memory_bytes": 256 * MiB, "pids": 64})
    assert out.exit_code == 0, out
    assert {"RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"} <= set(out.limits_enforced)
    if sandbox.identity == "root" and cgroup_detect.detect_cgroups().hierarchy_for("memory") is not None:
        assert _cgroup(out, "memory") and _cgroup(out, "pids")
        assert "RLIMIT_DATA" not in out.limits_enforced  # the cgroup bounds memory instead
    if sandbox.identity == "user":
        assert not any(e.startswith("cgroup:") for e in out.limits_enforced)
        assert {"RLIMIT_DATA", "RLIMIT_NPROC"} <= set(out.limits_enforced)


def test_an_open_file_limit_too_small_for_bwrap_names_limits_nofile(sandbox) -> None:
    """Limits.nofile of 3-11 starts bwrap with fewer fds than it opens itself (ld.so's
    libselinux, its pipes): an EMFILE before the program, once "sandbox setup failed: ...
    libselinux.so.1 ... Error 24". Now a LaunchError that names the limit and what to set."""
    out = sandbox.run(["true"], limits={"nofile": 8})
    assert out.error == "LaunchError" and out.errno == 24, out
    assert "Limits.nofile" in out.message and "at least 16" in out.message, out.message
    ok = sandbox.run(["true"], limits={"nofile": 16})  # the control: the limit it names works
    assert ok.error is None and ok.exit_code == 0, ok


def test_an_open_file_limit_above_what_the_caller_can_set_is_lowered_with_a_warning(sandbox) -> None:
    """Limits.nofile above the caller's hard limit (or, with CAP_SYS_RESOURCE, fs.nr_open) cannot
    be applied: it was lowered silently. Now the sandbox runs with the bound and a "warning:"
    note (the CLI prints it) says which limit, the asked value and the bound."""
    out = sandbox.run(["sh", "-c", "ulimit -Hn"], limits={"nofile": 1 << 30})
    assert out.exit_code == 0, out
    got = int(out.stdout.strip())
    assert got < 1 << 30, out
    lowered = [n for n in out.notes if n.startswith("warning: RLIMIT_NOFILE 1073741824 is above")]
    assert lowered and lowered[0].endswith(f"the sandbox runs with {got}"), out.notes
    ok = sandbox.run(["sh", "-c", "ulimit -Hn"], limits={"nofile": 1000})  # the control: within bounds, no note
    assert ok.stdout.strip() == b"1000" and not any("RLIMIT_NOFILE" in n for n in ok.notes), ok


def test_a_session_commands_limit_above_the_sessions_hard_limit_says_so() -> None:
    """Per command (Session.run(limits=...)), the init lowers an rlimit above the session's hard
    limit to it: silently, before. Now the command's Result says so, as run() does; a value
    below it (the control) is applied exactly, without a note."""
    import lowlevel
    with lowlevel.Session() as s:
        r = s.run(["sh", "-c", "ulimit -Hn"], limits=lowlevel.Limits(nofile=10**7))
        assert r.exit_code == 0 and r.stdout == b"1024\n", r
        assert any(n.startswith("warning: RLIMIT_NOFILE 10000000 is above the session's hard limit (1024)")
                   for n in r.notes), r.notes
        ok = s.run(["sh", "-c", "ulimit -Hn"], limits=lowlevel.Limits(nofile=100))
        assert ok.stdout == b"100\n" and not any("RLIMIT_NOFILE" in n for n in ok.notes), ok.notes
