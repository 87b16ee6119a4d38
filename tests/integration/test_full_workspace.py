"""A full workspace or /tmp is ENOSPC, and a memory kill is a Result, never a setup failure
(issue 25, items 1 and 2).

The copy-on-write upper, /tmp and /dev/shm are tmpfs pages charged to the run's memory cgroup.
With the default limits (memory_bytes 2.5 GiB = 1 GiB for the program + the 1.5 GiB of tmpfs
bounds; fsize_bytes 2 GiB, above the 1 GiB workspace) a write past a bound is the program's
ENOSPC, through the CLI, run, Session, Pool and MCP, as root (memory cgroup) and as the
unprivileged user (rlimits only: the tmpfs sizes alone bound the files). Below the bounds (root:
``--memory 256M`` and a 400 MiB write) the memory limit fires first: the program is the OOM
killer's victim (oom_score_adj 1000) and the outcome is a Result with killed_by="memory"; when
the victim is bwrap, the guard or a Session's init instead (a program that lowers its own
oom_score_adj, or the LOWLEVEL_NO_OOM_SCORE_ADJ=1 test knob that restores the old victim choice)
it is still a Result with killed_by="memory" and a note naming the process, and a Session whose
init died ends with a SessionError naming memory. Before the fix each of these was exit 125
"sandbox setup failed" / LaunchError / SessionError("init_died").

Item 2: a program that exits on its own after a fork refused at pids.max is its exit code with
killed_by None and a note; a connect() refused by the network policy gets a note naming it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.identities import owned_tmpdir, setpriv

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tests" / "helpers" / "api_outcomes.py"
IS_ROOT = os.geteuid() == 0
MiB = 1 << 20
ENOSPC_TEXT = "No space left on device"

#: The issue's command, in the workspace; the file is removed so a Pool's or MCP's commit of the
#: call's changes does not copy 1 GiB to the host.
FILL_WORKSPACE = ["sh", "-c", "head -c 1500M /dev/zero > big.bin; rc=$?; rm -f big.bin; exit $rc"]
#: 400 MiB into the workspace: under --memory 256M, past the memory limit first.
WRITE_400M = ["sh", "-c", "head -c 400M /dev/zero > big.bin; echo rc=$?"]
#: The issue's Python writer loop: 3 GiB in 1 MiB writes into one file.
PY_WRITER = ("import errno, sys\n"
             "n = 0\n"
             "with open(sys.argv[1], 'wb') as f:\n"
             "    try:\n"
             "        for n in range(3072):\n"
             "            f.write(b'x' * (1 << 20)); f.flush()\n"
             "    except OSError as e:\n"
             "        print('errno', e.errno, 'after MiB', n); sys.exit(3)\n"
             "print('wrote 3 GiB')\n")


def _env(who: pwd.struct_passwd | None, base: str) -> dict[str, str]:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8",
           "TMPDIR": "/tmp", "LOWLEVEL_WORKSPACE_BASE": base}
    if who is not None:
        env["HOME"] = who.pw_dir
    return env


def _base(who: pwd.struct_passwd | None, prefix: str) -> str:
    """A workspace base owned by the identity (lowlevel refuses another uid's)."""
    return str(owned_tmpdir(who, prefix))


def apis(who: pwd.struct_passwd | None, spec: dict[str, Any]) -> dict[str, Any]:
    base = _base(who, "lowlevel-full-ws-")
    try:
        proc = subprocess.run(setpriv(who, [sys.executable, str(HELPER), json.dumps(spec)]), capture_output=True,
                              env=_env(who, base), cwd="/", timeout=380)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def cli(who: pwd.struct_passwd | None, args: list[str]) -> subprocess.CompletedProcess[bytes]:
    base = _base(who, "lowlevel-full-ws-cli-")
    try:
        return subprocess.run(setpriv(who, [sys.executable, "-m", "lowlevel", *args]), capture_output=True,
                              env=_env(who, base), cwd="/", timeout=300)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _has_memory_cgroup(out: dict[str, Any]) -> bool:
    return "cgroup:memory" in out.get("limits_enforced", [])


# -- item 1: ENOSPC with the default limits ---------------------------------------------------


def test_cli_the_issues_workspace_write_is_enospc(who: pwd.struct_passwd | None) -> None:
    # The issue's command (--discard: nothing of the 1 GiB is copied back): was exit 125
    # "lowlevel: sandbox setup failed: Killed" as root.
    proc = cli(who, ["run", "--discard", "--", "sh", "-c", "head -c 1500M /dev/zero > big.bin"])
    err = proc.stderr.decode()
    assert proc.returncode == 1, err          # head's own exit status
    assert ENOSPC_TEXT in err and "setup failed" not in err, err


def test_cli_json_the_issues_write_is_a_result_with_enospc(who: pwd.struct_passwd | None) -> None:
    proc = cli(who, ["run", "--json", "--discard", "--", "sh", "-c", "head -c 1500M /dev/zero > big.bin"])
    doc = json.loads(proc.stdout)
    assert doc.get("error") is None, doc
    assert doc["exit_code"] == 1 and doc["killed_by"] is None and ENOSPC_TEXT in doc["stderr"], doc


def test_cli_memory_below_the_bounds_is_killed_by_memory_not_setup(who: pwd.struct_passwd | None) -> None:
    # The issue's second command: was exit 125 "bwrap exited during setup".
    proc = cli(who, ["run", "--discard", "--memory", "256M", "--", "sh", "-c", "head -c 400M /dev/zero > big.bin"])
    err = proc.stderr.decode()
    assert "setup failed" not in err and proc.returncode != 125, err
    if who is None and IS_ROOT:
        assert proc.returncode == 137 and "lowlevel: killed by memory" in err, err
        assert f"lowlevel: the memory cgroup's OOM killer killed a process of the run (memory_bytes={256 * MiB}" in err
    else:
        assert proc.returncode == 0, err   # no memory cgroup: the 400 MiB fit in the 1 GiB workspace


def test_python_writer_loop_of_3_gib_meets_enospc_at_the_workspace_bound(sandbox) -> None:  # type: ignore[no-untyped-def]
    out = sandbox.run(["python3", "-c", PY_WRITER, "big.bin"], timeout=180, commit=False)
    assert out.error is None, out.message
    assert out.exit_code == 3 and out.killed_by is None, out   # was exit 137, killed_by memory
    words = out.out.split()
    assert words[:2] == ["errno", "28"], out.out                # ENOSPC, seen by the program
    assert 1000 <= int(words[-1]) <= 1024, out.out              # at the 1 GiB bound


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
def test_tmp_and_shm_past_their_bound_are_enospc(sandbox, where: str) -> None:  # type: ignore[no-untyped-def]
    out = sandbox.run(["python3", "-c", PY_WRITER, f"{where}/big.bin"], timeout=120, commit=False)
    assert out.error is None, out.message
    assert out.exit_code == 3 and out.killed_by is None, out
    words = out.out.split()
    assert words[:2] == ["errno", "28"] and 200 <= int(words[-1]) <= 256, out.out


@pytest.mark.slow
def test_every_api_sees_enospc_with_the_default_limits(who: pwd.struct_passwd | None) -> None:
    out = apis(who, {"command": FILL_WORKSPACE, "then": ["echo", "alive"]})
    for api in ("run", "session", "pool", "mcp_run", "mcp_session"):
        assert out[api].get("error") is None, (api, out[api])
        assert out[api]["exit_code"] == 1 and out[api]["killed_by"] is None, (api, out[api])
        assert ENOSPC_TEXT in out[api]["stderr"], (api, out[api])
    for api in ("session_then", "mcp_session_then"):   # the session lives on
        assert out[api]["exit_code"] == 0 and out[api]["stdout"] == "alive\n", (api, out[api])


# -- item 1: below the bounds, the memory limit is a Result ------------------------------------


@pytest.mark.slow
def test_memory_limit_below_the_bounds_is_a_memory_result_everywhere(who: pwd.struct_passwd | None) -> None:
    # Was exit 125 "bwrap exited during setup" (run), SessionError (Session), "setup failed" (MCP).
    out = apis(who, {"command": WRITE_400M, "limits": {"memory_bytes": 256 * MiB},
                     "then": ["sh", "-c", "rm -f big.bin; echo alive"]})
    for api in ("run", "session", "pool", "mcp_run", "mcp_session"):
        assert out[api].get("error") is None, (api, out[api])
    if not _has_memory_cgroup(out["run"]):
        # Unprivileged, no memory cgroup: RLIMIT_DATA bounds the heap, the tmpfs its files.
        assert who is not None or not IS_ROOT
        for api in ("run", "session", "pool", "mcp_run", "mcp_session"):
            assert out[api]["stdout"] == "rc=0\n" and out[api]["killed_by"] is None, (api, out[api])
        return
    for api in ("run", "session", "pool", "mcp_run", "mcp_session"):
        o = out[api]
        assert o["killed_by"] == "memory", (api, o)
        # The OOM killer took head, the program (sh saw it die: 137), and sometimes sh after it:
        # the file's pages still hold the memory when sh goes on.
        assert o["stdout"] in ("rc=137\n", ""), (api, o)
        note = next(n for n in o["notes"] if "OOM killer" in n)
        assert f"memory_bytes={256 * MiB}" in note and str((1 << 30) + 512 * MiB) in note, note
    for api in ("session", "mcp_session"):
        assert "Session.reset()" in next(n for n in out[api]["notes"] if "OOM killer" in n), out[api]
    for api in ("session_then", "mcp_session_then"):
        # The session lives on (a Result, not a SessionError); the ~250 MiB already written still
        # holds its memory, so this command may meet the limit too: a memory verdict again.
        o = out[api]
        assert o.get("error") is None, (api, o)
        assert o["stdout"] == "alive\n" or o["killed_by"] == "memory", (api, o)


def test_session_reset_frees_the_memory_its_files_held(sandbox) -> None:  # type: ignore[no-untyped-def]
    if sandbox.identity == "user":
        pytest.skip("needs the memory cgroup (root here); the unprivileged half is the ENOSPC tests")
    import lowlevel
    policy = lowlevel.Policy(limits=lowlevel.Limits(memory_bytes=256 * MiB))
    with lowlevel.Session(policy, workspace_base=str(sandbox.workspace())) as s:
        first = s.run(WRITE_400M, timeout=60)
        assert first.killed_by == "memory", first
        s.reset()   # drops the upper layer's files from the host: their tmpfs pages are freed
        after = s.run(["sh", "-c", "echo alive; head -c 100M /dev/zero > small.bin; echo rc=$?"], timeout=60)
        assert after.killed_by is None and after.stdout == b"alive\nrc=0\n", after


def test_a_memory_limit_too_small_for_setup_says_so(sandbox) -> None:  # type: ignore[no-untyped-def]
    # 1 MiB: the OOM killer fires before the session's init says hello (was "the session init
    # exited before saying hello" / "sandbox setup failed"): the error names the limit and the fix.
    if sandbox.identity == "user":
        pytest.skip("needs the memory cgroup (root here)")
    import lowlevel
    with pytest.raises(lowlevel.LaunchError, match=r"the memory limit \(memory_bytes=1048576\) is too small for the "
                       r"sandbox's own setup.*raise memory_bytes"):
        with lowlevel.Session(lowlevel.Policy(limits=lowlevel.Limits(memory_bytes=1 << 20)),
                              workspace_base=str(sandbox.workspace())) as s:
            s.run(["true"])


def test_the_program_is_the_oom_victim_not_the_sandbox(sandbox) -> None:  # type: ignore[no-untyped-def]
    out = sandbox.run(["sh", "-c", "cat /proc/self/oom_score_adj /proc/1/oom_score_adj"])
    assert out.exit_code == 0, out
    assert out.out.split() == ["1000", "1000"], out.out   # the program, and the guard (PID 1)


def test_an_oom_kill_of_bwrap_is_a_memory_result(sandbox) -> None:  # type: ignore[no-untyped-def]
    # LOWLEVEL_NO_OOM_SCORE_ADJ=1: the old victim choice, bwrap (more RSS than head; the tmpfs
    # pages are nobody's). Before the fix: LaunchError "sandbox setup failed".
    out = sandbox.run(WRITE_400M, timeout=60, commit=False, limits={"memory_bytes": 256 * MiB},
                      env={"LOWLEVEL_NO_OOM_SCORE_ADJ": "1"})
    assert out.error is None, out.message
    if "cgroup:memory" not in out.limits_enforced:
        assert sandbox.identity == "user" and out.out == "rc=0\n", out
        return
    assert out.killed_by == "memory", out
    note = next(n for n in out.notes if "OOM killer" in n)
    assert "not the program" in note or "a process of the run" in note, note


def test_a_program_that_lowers_its_oom_score_still_gets_a_memory_result(sandbox) -> None:  # type: ignore[no-untyped-def]
    # The program makes itself a poor victim (lowering to 0 needs no privilege): the guard, at
    # 1000, or bwrap is killed instead. Still a Result, killed_by="memory".
    out = sandbox.run(["sh", "-c", "echo 0 > /proc/self/oom_score_adj && head -c 400M /dev/zero > big.bin; "
                       "echo rc=$?"], timeout=60, commit=False, limits={"memory_bytes": 256 * MiB})
    assert out.error is None, out.message
    if "cgroup:memory" not in out.limits_enforced:
        assert sandbox.identity == "user" and out.out == "rc=0\n", out
        return
    assert out.killed_by == "memory", out
    assert any("OOM killer" in n for n in out.notes), out.notes


#: A command that makes itself a poor OOM victim: its shepherd (at 1000) or the init is taken.
LOWERED_400M = ["sh", "-c", "echo 0 > /proc/self/oom_score_adj && head -c 400M /dev/zero > big.bin; echo rc=$?"]


@pytest.mark.parametrize("how", ["knob", "lowered"])
def test_session_init_killed_by_memory_names_memory(who: pwd.struct_passwd | None, how: str) -> None:
    # knob: LOWLEVEL_NO_OOM_SCORE_ADJ=1, the old victim choice (the init or bwrap); lowered: the
    # command lowers its own score, so its shepherd is killed first (a Result), then maybe the init.
    spec: dict[str, Any] = {"command": WRITE_400M if how == "knob" else LOWERED_400M, "apis": ["session"],
                            "limits": {"memory_bytes": 256 * MiB}, "then": ["echo", "alive"]}
    if how == "knob":
        spec["env"] = {"LOWLEVEL_NO_OOM_SCORE_ADJ": "1"}
    out = apis(who, spec)
    first, then = out["session"], out["session_then"]
    if not _has_memory_cgroup(first) and first.get("error") is None:
        assert who is not None or not IS_ROOT
        assert first["stdout"] == "rc=0\n" and then["stdout"] == "alive\n", out
        return
    # The command that was running: a Result; if the init (or bwrap) died, the session ends
    # with a SessionError that names memory, else it lives on.
    assert first.get("error") is None and first["killed_by"] == "memory", out
    assert any("OOM killer" in n for n in first["notes"]), first
    if then.get("error") is not None:
        assert then["error"] == "SessionError" and "OOM killer" in then["message"], then
        assert "memory_bytes" in then["message"], then
    else:
        # The session lives on; the file already written may still fill its memory.
        assert then["stdout"] == "alive\n" or then["killed_by"] == "memory", then


# -- item 2: verdicts that name their cause ---------------------------------------------------

FORK_THEN_EXIT = ("import os, sys, time\n"
                  "try:\n"
                  "    for i in range(64):\n"
                  "        if os.fork() == 0:\n"
                  "            time.sleep(3); os._exit(0)\n"
                  "except OSError as e:\n"
                  "    print('fork failed', e.errno, file=sys.stderr); sys.exit(2)\n")


def test_a_program_exiting_after_a_refused_fork_is_not_killed_by_pids(sandbox) -> None:  # type: ignore[no-untyped-def]
    out = sandbox.run(["python3", "-c", FORK_THEN_EXIT], timeout=30, limits={"pids": 8})
    assert out.error is None, out.message
    assert "fork failed 11" in out.err, out        # EAGAIN: the limit did stop fork
    assert out.exit_code == 2 and out.killed_by is None, out   # was killed_by="pids"
    if "cgroup:pids" in out.limits_enforced:
        assert any("pids limit was hit" in n and "pids.max=8" in n for n in out.notes), out.notes


def test_a_signal_death_after_a_refused_fork_is_pids(sandbox) -> None:  # type: ignore[no-untyped-def]
    code = FORK_THEN_EXIT.replace("sys.exit(2)", "os.abort()")
    out = sandbox.run(["python3", "-c", code], timeout=30, limits={"pids": 8})
    assert out.error is None, out.message
    assert out.term_signal == 6, out
    assert out.killed_by == ("pids" if "cgroup:pids" in out.limits_enforced else "signal"), out


def test_session_pids_verdict_follows_the_same_rule(who: pwd.struct_passwd | None) -> None:
    out = apis(who, {"command": ["python3", "-c", FORK_THEN_EXIT], "limits": {"pids": 8}, "apis": ["session"]})
    o = out["session"]
    assert o.get("error") is None and o["exit_code"] == 2 and o["killed_by"] is None, o


CONNECT = ("import socket\n"
           "socket.create_connection(('127.0.0.1', 1), timeout=5)\n")


def test_a_refused_connect_names_the_network_policy(sandbox) -> None:  # type: ignore[no-untyped-def]
    out = sandbox.run(["python3", "-c", CONNECT], timeout=30)
    assert out.error is None, out.message
    if "landlock" not in out.limits_enforced:
        pytest.skip("no Landlock here: connect fails in the empty network namespace, not with EACCES")
    assert "PermissionError: [Errno 13] Permission denied" in out.err, out.err
    assert any(n.startswith("connect() refused by the sandbox's network policy (network=False") for n in out.notes), \
        out.notes


def test_control_a_connect_refused_by_the_peer_gets_no_policy_note(sandbox) -> None:  # type: ignore[no-untyped-def]
    # With the host's network the same connect meets a closed port: ECONNREFUSED, the program's
    # own error, and no note blaming the sandbox.
    out = sandbox.run(["python3", "-c", CONNECT], timeout=30, network=True)
    assert out.error is None, out.message
    assert "ConnectionRefusedError" in out.err, out.err
    assert not any("connect() refused by the sandbox" in n for n in out.notes), out.notes
