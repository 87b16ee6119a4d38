"""Session mode: the main job's security cases as session commands, per-command lifetime,
the init under attack, concurrency without mixed outputs, and no growth over many commands."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers.hygiene import children, fd_numbers

import lowlevel
from lowlevel.session import AsyncSession, Pool, Session, SessionError

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]


def _ws() -> str:
    """A fresh workspace the sandbox's uid can reach (pytest's tmp_path is under a 0700 dir)."""
    path = tempfile.mkdtemp(prefix="ws-session-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


@pytest.fixture
def session():
    s = Session(workspace=_ws())
    yield s
    s.close()


def _sandbox_procs(s: Session, *, spare: bool = True) -> list[str]:
    """Command lines of every process in the session (via a command; minus that command).

    spare=False leaves out the init's idle spare too: the next command's shepherd, forked a
    moment after a hand-over (native/lowlevel_init.c, spare_due), so whether `ps` sees it is a
    race. It is the one child of the init (the pid whose parent is bwrap's PID 1) that is neither
    the `ps` command's shepherd nor anybody's parent."""
    out = s.run(["ps", "-eo", "pid,ppid,pgid,args"]).stdout.decode().splitlines()[1:]
    rows = [(int(line.split()[0]), int(line.split()[1]), line) for line in out]
    ps_parent = next(ppid for _pid, ppid, line in rows if "ps -eo" in line)
    kept = [(pid, ppid, line) for pid, ppid, line in rows if "ps -eo" not in line and pid != ps_parent]
    if not spare:
        init = next((pid for pid, ppid, _line in rows if ppid == 1), None)
        parents = {ppid for _pid, ppid, _line in rows}
        idle = [pid for pid, ppid, _line in kept if ppid == init and pid not in parents]
        kept = [row for row in kept if row[0] not in idle[:1]]
    return [line for _pid, _ppid, line in kept]


# -- the main job's security cases, as session commands -------------------------------------


def test_basic_exit_output_stdin(session):
    r = session.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr, r.killed_by, r.term_signal) == (3, b"out\n", b"err\n", None, None)
    assert r.cpu_user_s is not None and r.max_rss_bytes and r.max_rss_bytes > 0
    assert "seccomp" in r.limits_enforced and "RLIMIT_CPU" in r.limits_enforced
    data = os.urandom(300_000)
    assert session.run(["cat"], stdin=data).stdout == data


def test_no_network(session):
    r = session.run(["python3", "-c", "import socket\ns = socket.socket()\ns.settimeout(2)\n"
                     "try:\n s.connect(('1.1.1.1', 53)); print('connected')\nexcept OSError as e: print('err', e.errno)\n"
                     "print(open('/proc/net/dev').read())"])
    assert r.exit_code == 0, r.stderr
    assert "connected" not in r.stdout.decode()
    devs = [line.split(":")[0].strip() for line in r.stdout.decode().splitlines() if ":" in line and "|" not in line]
    assert devs == ["lo"]


def test_read_only_system_and_workspace_only_writes(session):
    r = session.run(["sh", "-c", "touch /usr/bin/x; echo usr=$?; touch /etc/x; echo etc=$?; touch /x; echo root=$?; "
                     "echo hello > /workspace/out.txt; echo ws=$?"])
    assert "usr=1" in r.stdout.decode() and "etc=1" in r.stdout.decode() and "root=1" in r.stdout.decode()
    assert "ws=0" in r.stdout.decode()
    assert Path(session.workspace, "out.txt").read_text() == "hello\n"
    assert not Path("/usr/bin/x").exists()


def test_env_cleared_and_per_command_env(session, monkeypatch):
    monkeypatch.setenv("LOWLEVEL_FAKE_SECRET", "hunter2")
    r = session.run(["env"], env={"EXTRA": "1"})
    env = dict(line.split("=", 1) for line in r.stdout.decode().splitlines())
    assert "LOWLEVEL_FAKE_SECRET" not in env and "hunter2" not in r.stdout.decode()
    assert env["EXTRA"] == "1"
    assert set(env) == set(lowlevel.Policy().environment({"EXTRA": "1"}))
    # The extra variable does not leak into the next command.
    assert "EXTRA" not in session.run(["env"]).stdout.decode()


def test_cwd_and_per_command_rlimits(session):
    session.run(["mkdir", "-p", "sub"])
    assert session.run(["pwd"], cwd="/workspace/sub").stdout == b"/workspace/sub\n"
    r = session.run(["sh", "-c", "ulimit -n; ulimit -t"], limits=lowlevel.Limits(nofile=64, cpu_s=5))
    assert r.stdout == b"64\n5\n"
    assert session.run(["sh", "-c", "ulimit -n"]).stdout == b"1024\n"


def test_per_command_rlimit_above_the_sessions_hard_limit_is_lowered_to_it():
    """The vfork child sets each rlimit with one prlimit64 and falls back to get, clamp, set only
    when the kernel refuses (EPERM above the hard limit) or the set raised the hard limit: a
    command can never raise the session's hard limit, and a value within it is set exactly."""
    policy = lowlevel.Policy(limits=lowlevel.Limits(nofile=256))
    with Session(policy, workspace=_ws()) as s:
        probe = ["sh", "-c", "ulimit -Sn; ulimit -Hn"]
        assert s.run(probe).stdout == b"256\n256\n"
        assert s.run(probe, limits=lowlevel.Limits(nofile=100_000)).stdout == b"256\n256\n"
        assert s.run(probe, limits=lowlevel.Limits(nofile=64)).stdout == b"64\n64\n"
        assert s.run(probe).stdout == b"256\n256\n"


def test_exec_errors(session):
    with pytest.raises(lowlevel.ExecError) as e:
        session.run(["no-such-program"])
    assert e.value.errno == 2
    session.run(["sh", "-c", "printf '#!/bin/sh\\n' > noexec; chmod 644 noexec"])
    with pytest.raises(lowlevel.ExecError) as e:
        session.run(["./noexec"])
    assert e.value.errno == 13
    with pytest.raises(lowlevel.LaunchError) as e:
        session.run(["true"], cwd="/nonexistent")
    assert e.value.errno == 2
    assert session.run(["true"]).exit_code == 0


def test_large_argv_goes_through_a_memfd(session):
    big = "x" * 100_000
    assert session.run(["sh", "-c", 'echo ${#1} ${#2}', "sh", big, big]).stdout == b"100000 100000\n"


# -- lifetime: timeouts, leftovers, background commands --------------------------------------


def test_timeout_kills_double_forked_children_and_session_stays_usable(session):
    script = ("setsid sh -c 'sleep 300' & (sh -c 'sleep 301 &') ; "
              "sh -c 'trap \"\" TERM; exec sleep 302' & echo started; sleep 303")
    r = session.run(["sh", "-c", script], timeout=0.5)
    assert r.timed_out and r.killed_by == "timeout" and r.term_signal == signal.SIGKILL
    assert r.stdout == b"started\n"
    assert r.wall_time_s < 3
    procs = _sandbox_procs(session)
    assert not [p for p in procs if "sleep" in p], procs
    assert session.run(["echo", "ok"]).stdout == b"ok\n"


def test_leftovers_die_with_their_command(session):
    r = session.run(["sh", "-c", "setsid sleep 300 & (sleep 301 &); echo bye"])
    assert r.exit_code == 0 and r.stdout == b"bye\n"
    assert not [p for p in _sandbox_procs(session) if "sleep" in p]


def test_background_command_stream_poll_wait_kill(session):
    p = session.start(["sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.1; done; exec sleep 300"])
    seen = b""
    deadline = time.monotonic() + 10
    while b"line3" not in seen and time.monotonic() < deadline:
        out, _err = p.read(timeout=1)
        seen += out
    assert seen == b"line1\nline2\nline3\n"
    assert p.poll() is None
    with pytest.raises(TimeoutError):
        p.wait(timeout=0.1)
    # Short commands run beside it.
    assert session.run(["echo", "beside"]).stdout == b"beside\n"
    p.kill()
    r = p.wait(timeout=10)
    assert r.killed_by == "cancelled" and r.term_signal == signal.SIGKILL
    assert r.stdout == b"line1\nline2\nline3\n"


def test_send_signal_to_group(session):
    p = session.start(["sh", "-c", "trap 'echo got-term; exit 7' TERM; while :; do sleep 0.05; done"])
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    r = p.wait(timeout=10)
    assert r.exit_code == 7 and b"got-term" in r.stdout


# -- the init under attack -------------------------------------------------------------------


def test_catchable_signals_to_the_init_are_ignored(session):
    r = session.run(["sh", "-c", "for s in TERM INT HUP QUIT USR1 USR2 PIPE ALRM; do kill -$s 2; done; "
                     "kill -TERM -1; echo alive"])
    assert r.stdout == b"alive\n" or r.killed_by == "signal"  # kill -1 may hit the command itself
    assert session.run(["echo", "still"]).stdout == b"still\n"


def _sig_masks(status: bytes) -> dict[str, int]:
    return {k.decode(): int(v, 16) for k, v in (line.split(b":\t") for line in status.splitlines()
                                                if line[:3] == b"Sig" and line[:4] != b"SigQ")}


def test_commands_start_with_default_dispositions_and_an_empty_mask(session):
    """The init shrugs signals off with a no-op handler (not SIG_IGN), which execve resets: no
    command inherits a caught, ignored or blocked signal (the control: the init itself catches them)."""
    init = _sig_masks(session.run(["cat", "/proc/2/status"]).stdout)
    assert init["SigCgt"] & (1 << (signal.SIGTERM - 1)) and init["SigCgt"] & (1 << (signal.SIGRTMAX - 1))
    # What a fresh sandbox's program inherits (signals 32 and 33, glibc's own, come ignored from
    # above bwrap; the guard and the init reset them: test_glibc_signals.py): a session command
    # must get no more.
    fresh = _sig_masks(lowlevel.run(["cat", "/proc/self/status"]).stdout)
    for masks in (_sig_masks(session.run(["cat", "/proc/self/status"]).stdout),
                  _sig_masks(session.start(["cat", "/proc/self/status"]).wait(timeout=10).stdout)):
        assert masks == {"SigPnd": 0, "SigBlk": 0, "SigIgn": fresh["SigIgn"], "SigCgt": 0}, masks
        assert not masks["SigIgn"] & init["SigCgt"]


# The shepherds waiting for their command (the init forks each one ahead): their PIDs, from a
# command: the init's children other than the command's own shepherd ($PPID of its sh).
_SPARES = ("for f in /proc/[0-9]*/stat; do set -- $(cat $f 2>/dev/null); "
           "[ \"$4\" = 2 ] && [ \"$1\" != $PPID ] && echo $1; done")


@pytest.mark.parametrize("signo", ["KILL", "STOP"])
def test_a_command_that_kills_or_stops_the_waiting_shepherd_does_not_stall_the_next(session, signo):
    """The next command's shepherd is forked ahead and waits, as the commands' uid: a command can
    SIGKILL or SIGSTOP it. The init forks a fresh one (KILL) or continues it (STOP) before it
    hands a command over, so the next commands run (a stalled one would end in SessionError)."""
    r = session.run(["sh", "-c", f"for i in $(seq 200); do s=$({_SPARES}); [ -n \"$s\" ] && break; sleep 0.01; done; "
                                 f"for p in $s; do kill -{signo} $p && echo hit; done"])
    assert r.exit_code == 0 and b"hit" in r.stdout, (r.stdout, r.stderr)
    for i in range(3):
        assert session.run(["echo", str(i)], timeout=10).stdout == f"{i}\n".encode()
    assert session.alive


def _fault_session(deaths: int) -> Session:
    """A session whose next ``deaths`` spares die (SIGKILL) with their command queued, unread: the
    init's test fault LOWLEVEL_INIT_FAULT_SPARE_DEATHS, as a spare SIGKILLed after the init's
    /proc check did in a loaded CI run (the signal dequeued, PF_EXITING not yet set)."""
    policy = lowlevel.Policy(env={"LOWLEVEL_INIT_FAULT_SPARE_DEATHS": str(deaths)})
    return Session(policy, workspace=_ws())


def test_a_command_whose_spare_dies_before_reading_it_runs_on_a_fresh_one():
    """The init keeps its copy of each spare's end of the control socket, so a command queued to a
    spare that died unread is still there, fds and all: the init hands it to a fresh spare (twice
    here), with the signal requests queued after it. Before: 'the supervisor of 'echo' was killed
    (wait status 9)', a SessionError for a command that never ran."""
    with _fault_session(2) as s:
        r = s.run(["sh", "-c", "echo one; echo two >&2"], timeout=10)
        assert (r.exit_code, r.stdout, r.stderr) == (0, b"one\n", b"two\n")
        assert s.run(["cat"], stdin=b"in", timeout=10).stdout == b"in"
    with _fault_session(1) as s:
        p = s.start(["sleep", "30"])
        p.send_signal(signal.SIGTERM)  # queued behind the SPAWN, or sent to the fresh shepherd
        assert p.wait(timeout=10).term_signal == signal.SIGTERM
        assert s.run(["echo", "next"], timeout=10).stdout == b"next\n"
        assert s.alive


def test_a_command_whose_spares_keep_dying_gets_an_error_not_a_hang():
    """Every spare dies unread: each command is handed over MAX_HANDOVERS (3) times, then reported
    as a SessionError at once (no timeout waited out), and the session's init still answers."""
    with _fault_session(1000) as s:
        for _ in range(2):
            t = time.monotonic()
            with pytest.raises(SessionError, match="supervisor of 'true' was killed"):
                s.run(["true"], timeout=30)
            assert time.monotonic() - t < 5
        assert s.alive


def test_a_command_cannot_lower_the_limits_of_the_init_or_the_next_command(session):
    """The default seccomp profile fails prlimit(2) and ioprio_set(2) on another process with EPERM
    (the same uid is all the kernel asks): a command cannot set RLIMIT_FSIZE 0 or the idle I/O
    class on the init or the waiting spare for the commands after it (``ionice -c3 CMD``, its own,
    still works). Control: on the host, the same prlimit of a child of ours works."""
    before = session.run(["sh", "-c", "ulimit -f; ionice; prlimit --pid 2 --fsize --noheadings --output SOFT,HARD"]).stdout
    r = session.run(["sh", "-c", f"for i in $(seq 200); do s=$({_SPARES}); [ -n \"$s\" ] && break; sleep 0.01; done; "
                                 "for p in 2 $s; do prlimit --pid $p --fsize=0:0 || echo refused; "
                                 "ionice -c 3 -p $p || echo refused; done; ionice -c 3 ionice"])
    assert r.stdout.split() == [b"refused"] * 4 + [b"idle"], (r.stdout, r.stderr)
    assert b"Operation not permitted" in r.stderr
    after = session.run(["sh", "-c", "ulimit -f; ionice; prlimit --pid 2 --fsize --noheadings --output SOFT,HARD"]).stdout
    assert after == before and not before.startswith(b"0\n"), (before, after)
    child = subprocess.Popen(["sleep", "30"])
    try:
        subprocess.run(["prlimit", "--pid", str(child.pid), "--fsize=0:0"], check=True, timeout=10)
        with open(f"/proc/{child.pid}/limits") as f:
            assert any(line.startswith("Max file size") and line.split()[3:5] == ["0", "0"] for line in f), "control"
    finally:
        child.kill()
        child.wait()


def test_a_spare_whose_fd_limit_a_command_lowered_reports_the_next_command_not_a_hang():
    """Without that rule (a policy's own seccomp profile), a command can set RLIMIT_NOFILE 3 on the
    waiting spare: the next SPAWN's fds are dropped as it reads it (MSG_CTRUNC). The spare
    reports EMFILE for that command at once (a LaunchError), and the one after runs on a fresh
    spare. Before: the spare exited 0 without a report and the command hung until its timeout."""
    from lowlevel.spec.seccomp import DEFAULT_PROFILE, SeccompProfile
    profile = SeccompProfile("no-prlimit-rule", tuple(r for r in DEFAULT_PROFILE.rules if r.syscall != "prlimit64"))
    with Session(lowlevel.Policy(seccomp=profile), workspace=_ws()) as s:
        r = s.run(["sh", "-c", f"for i in $(seq 200); do s=$({_SPARES}); [ -n \"$s\" ] && break; sleep 0.01; done; "
                               "for p in $s; do prlimit --pid $p --nofile=3:3 && echo hit; done"])
        assert b"hit" in r.stdout, (r.stdout, r.stderr)
        t = time.monotonic()
        with pytest.raises(lowlevel.LaunchError, match="Too many open files") as e:
            s.run(["echo", "lost"], timeout=30)
        assert e.value.errno == errno.EMFILE and time.monotonic() - t < 5
        assert s.run(["echo", "next"], timeout=10).stdout == b"next\n"


#: A command that parks open fds in flight (SCM_RIGHTS on a socket it never reads) until the kernel
#: refuses more (ETOOMANYREFS: the uid's fds in flight are past the sender's RLIMIT_NOFILE), then
#: says so and waits: the count stays charged to the sandbox's uid while it lives.
_PARK_FDS = """
import array, errno, os, socket, sys, time
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
a.setblocking(False)
fds = array.array("i", [os.open("/dev/null", os.O_RDONLY) for _ in range(200)])
parked = 0
while True:
    try:
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        parked += len(fds)
    except OSError as err:
        print(parked, errno.errorcode[err.errno], flush=True)
        break
time.sleep(60)
"""


def test_a_command_holding_fds_in_flight_does_not_stop_the_next_from_starting(session):
    """The kernel caps the fds a uid has in flight in unix sockets at the sender's RLIMIT_NOFILE
    (unix(7), ETOOMANYREFS), per uid: a command parking ~1,200 of them made every later SPAWN fail
    ("Too many references"), since the init runs as the same uid under the same limit. The init's
    limit is now the commands' plus INIT_NOFILE_HEADROOM: it can still pass the next command its
    pipes. (Root caller: the host's own sendmsg is exempt, CAP_SYS_RESOURCE.)"""
    parker = session.start(["python3", "-c", _PARK_FDS])
    line, _ = parker.read(timeout=30)
    assert line.split()[1:] == [b"ETOOMANYREFS"] and int(line.split()[0]) >= 1024, line
    assert session.run(["echo", "next"], timeout=10).stdout == b"next\n"
    assert session.run(["sh", "-c", "ulimit -n"], timeout=10).stdout == b"1024\n"  # the commands' limit
    parker.kill()
    parker.wait(timeout=10)


def test_a_shepherd_a_command_stopped_is_resumed_and_its_command_reported(session):
    """SIGSTOP of another command's shepherd (same uid): the init, told by SIGCHLD (WUNTRACED),
    continues it. Before, a command without a timeout was never reported: its wait() waited on."""
    sleeper = session.start(["sleep", "1"])
    deadline = time.monotonic() + 10
    while sleeper.pid is None and time.monotonic() < deadline:
        sleeper.poll()  # takes in the init's STARTED (the pid)
        time.sleep(0.01)
    r = session.run(["sh", "-c", f"set -- $(cat /proc/{sleeper.pid}/stat); kill -STOP $4 && echo stopped $4"])
    assert r.stdout.startswith(b"stopped "), (r.stdout, r.stderr)
    assert sleeper.wait(timeout=10).exit_code == 0
    assert session.alive


def test_the_init_holds_one_fd_per_running_command(session):
    """The init's copy of a shepherd's control socket (kept so a SPAWN its spare never read can go
    to another) is closed once the SPAWN is read: 60 background commands cost the init ~60 fds,
    not 120 (its RLIMIT_NOFILE bounds how many commands run at once)."""
    before = len(os.listdir(f"/proc/{session._core.init_host_pid}/fd"))
    procs = [session.start(["sleep", "30"]) for _ in range(60)]
    deadline = time.monotonic() + 10
    while any(p.poll() is None and p.pid is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    session.run(["true"])  # one SPAWN more: the init settles the copies of those read
    during = len(os.listdir(f"/proc/{session._core.init_host_pid}/fd"))
    assert during - before <= 60 + 3, (before, during)
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=10)


def test_starting_commands_that_fail_without_reading_their_reports_keeps_the_session():
    """Session.start() in a loop, nobody reading, every start past the pids limit failing: the
    init's own EXIT for each failure (EXIT_SPAWN_FAILED) used to block it once the socket was
    full, so it stopped reading SPAWNs and the host killed the session after 10 s as
    "unresponsive" (found by a fresh-user trial). The init queues its own reports and sends them
    as the socket takes them: every start returns at once, each failure is a LaunchError naming
    the process limit, and the session lives on."""
    with Session(lowlevel.Policy(limits=lowlevel.Limits(pids=64)), workspace=_ws()) as s:
        t = time.monotonic()
        procs = [s.start(["sleep", "30"]) for _ in range(450)]
        assert time.monotonic() - t < 5
        # The init works through the 450 SPAWNs in order: under load (CI's) some are still queued
        # when the loop ends, and a queued one polls None like a running one. Count until it settles.
        deadline = time.monotonic() + 60
        while True:
            failed = running = 0
            for p in procs:
                try:
                    running += p.poll() is None
                except lowlevel.LaunchError as err:
                    assert "process limit" in str(err), err
                    failed += 1
            if failed > 300 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert failed > 300 and running > 0, (failed, running)
        assert s.alive
        for p in procs:
            p.kill()
        for p in procs:
            with contextlib.suppress(lowlevel.LaunchError):
                p.wait(timeout=10)
        assert s.run(["echo", "ok"], timeout=10).stdout == b"ok\n"


def test_the_init_catches_the_signals_it_shrugs_off_but_leaves_sigcont_at_its_default(session):
    """The init and its shepherds catch TERM, HUP etc. with a no-op handler (a command's
    ``kill -TERM -1`` leaves them running; execve resets it for the command), but not SIGCONT,
    whose default only resumes: the init's SIGCONT to the waiting spare before each hand-over
    then does not wake it to run a handler. A command's ``kill -CONT -1`` and ``kill -TERM -1``
    leave the session running its next commands; the commands themselves get SIGCONT's default."""
    with open(f"/proc/{session._core.init_host_pid}/status") as f:
        status = f.read()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    assert caught >> (signal.SIGTERM - 1) & 1 and caught >> (signal.SIGHUP - 1) & 1
    assert not caught >> (signal.SIGCONT - 1) & 1
    r = session.run(["sh", "-c", "kill -CONT -1; kill -TERM -1; echo survived"])
    assert r.stdout == b"survived\n" or r.term_signal == signal.SIGTERM, (r.stdout, r.stderr)
    for i in range(3):
        assert session.run(["echo", str(i)], timeout=10).stdout == f"{i}\n".encode()
    fields = dict(line.split(":", 1) for line in session.run(["cat", "/proc/self/status"]).stdout.decode().splitlines())
    for name in ("SigCgt", "SigIgn"):
        assert not int(fields[name], 16) >> (signal.SIGCONT - 1) & 1, fields[name]
    assert session.alive


def test_init_not_ptraceable_or_readable(session):
    r = session.run(["sh", "-c", "cat /proc/2/environ; echo rc=$?; ls /proc/2/fd; echo rc=$?; cat /proc/2/mem; "
                     "echo rc=$?"])
    assert b"rc=0" not in r.stdout, r.stdout


def test_killing_the_init_ends_the_session_without_hanging(session):
    pid = session._core.init_host_pid
    bg = session.start(["sleep", "300"])
    t = time.monotonic()
    with pytest.raises(SessionError) as e:
        session.run(["sh", "-c", "kill -KILL 2; sleep 300"])
    assert e.value.reason == "init_died" and "SIGKILL" in str(e.value)
    assert time.monotonic() - t < 5
    with pytest.raises(SessionError):
        bg.wait(timeout=5)
    with pytest.raises(SessionError):
        session.run(["true"])
    assert not session.alive
    session.close()
    assert not os.path.exists(f"/proc/{pid}")


def test_kill_everything_from_a_command(session):
    with pytest.raises(SessionError) as e:
        session.run(["sh", "-c", "kill -KILL -1; sleep 300"])
    assert e.value.reason == "init_died"


def test_stopping_the_init_cannot_hang_the_caller(session):
    t = time.monotonic()
    with pytest.raises(SessionError) as e:
        session.run(["sh", "-c", "kill -STOP 2; sleep 300"], timeout=None)
    assert e.value.reason == "unresponsive"
    assert time.monotonic() - t < 5


def test_stopping_the_shepherd_cannot_hang_the_caller(session):
    """The command's parent is its shepherd; stopping it would stop timeout enforcement (the host
    then killed the session as unresponsive after GRACE_S). The init continues a stopped shepherd
    (WUNTRACED), so the timeout holds and the session lives on."""
    t = time.monotonic()
    r = session.run(["sh", "-c", "kill -STOP $PPID; sleep 300"], timeout=0.5)
    assert r.timed_out, r
    assert time.monotonic() - t < 0.5 + lowlevel.session.GRACE_S
    assert session.run(["echo", "ok"]).stdout == b"ok\n"


def test_commit_returns_what_it_applied_not_the_entries_it_skipped():
    """A fifo and a unix socket in the upper are skipped by the commit (documented), so
    ``Session.commit()``, which returns what was applied, leaves them out (found by a fresh-user
    trial: it returned them as added)."""
    ws = _ws()
    with Session(workspace=ws) as s:
        r = s.run(["python3", "-c", "import os, socket; os.mkfifo('fifo'); open('plain', 'w').write('x'); "
                   "socket.socket(socket.AF_UNIX).bind('sock')"])
        assert r.exit_code == 0, r.stderr
        assert s.diff().added == ("fifo", "plain", "sock")
        assert s.commit().added == ("plain",)
    assert sorted(os.listdir(ws)) == ["plain"]


def test_a_commit_whose_sandbox_is_killed_under_it_applies_and_says_the_session_is_over():
    """bwrap SIGKILLed while commit() applies (found by ``kill_campaign.py --victim sandbox``): the
    host-side apply completes; stacking the fresh layer then finds the anchor gone. That was
    ``LaunchError: resetting the workspace failed: [Errno 32] Broken pipe``; it is now the
    session's SessionError(reason="init_died") saying the changes were applied, and close()
    applies nothing twice."""
    ws = _ws()
    s = Session(workspace=ws)
    try:
        s.run(["sh", "-c", "mkdir d; for i in $(seq 3000); do echo $i > d/f$i; done"])
        bwrap = s._core.run.pid

        def kill_when_the_apply_starts() -> None:
            while not os.path.exists(os.path.join(ws, "d")):
                time.sleep(0.0005)
            os.kill(bwrap, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_the_apply_starts)
        killer.start()
        with pytest.raises(SessionError, match="the changes were applied to .*, but the sandbox is gone") as e:
            s.commit()
        killer.join()
        assert e.value.reason == "init_died"
        assert len(os.listdir(os.path.join(ws, "d"))) == 3000
        with pytest.raises(SessionError):
            s.run(["true"])
    finally:
        s.close()
    assert sorted(os.listdir(ws)) == ["d"] and len(os.listdir(os.path.join(ws, "d"))) == 3000


def test_killing_the_shepherd_kills_its_command(session):
    with pytest.raises(SessionError) as e:
        session.run(["sh", "-c", "(setsid sleep 300 &); kill -KILL $PPID; sleep 300"], timeout=30)
    assert e.value.reason == "unresponsive"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not [p for p in _sandbox_procs(session) if "sleep" in p]:
            break
        time.sleep(0.05)
    assert not [p for p in _sandbox_procs(session) if "sleep" in p]


def test_close_leaves_nothing():
    before = fd_numbers()
    s = Session(workspace=_ws())
    pid = s._core.init_host_pid
    bwrap_pid = s._core.run.pid
    handles = [s.start(["sh", "-c", "setsid sleep 300 & sleep 300"]) for _ in range(3)]
    s.run(["true"])
    s.close()
    assert not os.path.exists(f"/proc/{pid}")
    assert not os.path.exists(f"/proc/{bwrap_pid}")
    assert not children(os.getpid())
    for h in handles:
        with pytest.raises(SessionError) as e:
            h.wait(timeout=1)
        assert e.value.reason == "closed"
    with pytest.raises(SessionError):
        s.run(["true"])
    s.close()
    assert fd_numbers() == before


def test_callers_death_ends_the_session():
    code = ("import os, signal, sys, tempfile\n"
            "from lowlevel.session import Session\n"
            "ws = tempfile.mkdtemp(prefix='ws-session-', dir='/tmp'); os.chmod(ws, 0o755)\n"
            "s = Session(workspace=ws)\n"
            "s.start(['sh', '-c', 'setsid sleep 300 & sleep 300'])\n"
            "s.run(['true'])\n"
            "print(s._core.init_host_pid, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{pid}")


def test_idle_timeout_ends_the_session():
    s = Session(workspace=_ws(), idle_timeout=0.3)
    try:
        assert s.run(["true"]).exit_code == 0
        time.sleep(0.8)
        with pytest.raises(SessionError) as e:
            s.run(["true"])
        assert e.value.reason == "idle_timeout"
    finally:
        s.close()


def test_alive_says_the_idle_timeout_ended_the_session_without_a_command():
    """``alive`` stayed True after the idle timeout until a command found out (a fresh-user
    trial); now it reads what the init reported. Control: alive while the timeout has not run out."""
    s = Session(workspace=_ws(), idle_timeout=0.5)
    try:
        assert s.run(["true"]).exit_code == 0 and s.alive
        deadline = time.monotonic() + 10
        while s.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not s.alive and time.monotonic() < deadline
        with pytest.raises(SessionError) as e:
            s.run(["true"])
        assert e.value.reason == "idle_timeout"
    finally:
        s.close()


def test_total_timeout_ends_the_session():
    s = Session(workspace=_ws(), total_timeout=0.5)
    try:
        with pytest.raises(SessionError) as e:
            s.run(["sleep", "5"])
        assert e.value.reason == "total_timeout"
    finally:
        s.close()


# -- concurrency ----------------------------------------------------------------------------


def test_concurrent_commands_outputs_never_mixed(session):
    def job(tag: str, results: dict) -> None:
        r = session.run(["sh", "-c", f"i=0; while [ $i -lt 3000 ]; do echo {tag}-$i; echo E{tag} >&2; i=$((i+1)); done"])
        results[tag] = r

    results: dict = {}
    threads = [threading.Thread(target=job, args=(f"T{n}", results)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8
    for tag, r in results.items():
        lines = r.stdout.decode().splitlines()
        assert lines == [f"{tag}-{i}" for i in range(3000)]
        assert set(r.stderr.decode().splitlines()) == {f"E{tag}"}


def test_concurrent_stdin_never_mixed(session):
    def job(n: int, results: dict) -> None:
        data = bytes([65 + n]) * 300_000 + os.urandom(1000)
        results[n] = (data, session.run(["cat"], stdin=data))

    results: dict = {}
    threads = [threading.Thread(target=job, args=(n, results)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 6
    for data, r in results.values():
        assert r.stdout == data


def test_concurrent_stdin_rounds_never_hang(session):
    """40 rounds of 6 threads each piping 300 KB through ``cat``: a thread closing a finished
    command's pipe and then dropping its number from the fd table could drop a newer command's
    entry that had just got the same number, leaving that command's stdout unread while it
    blocked writing it: a hang (the test above failed 1 run in 5 at its 60 s join). Each round
    must finish within 20 s."""
    for round_ in range(40):
        results: dict = {}

        def job(n: int, out: dict) -> None:
            data = bytes([65 + n]) * 300_000 + os.urandom(100)
            out[n] = (data, session.run(["cat"], stdin=data))

        threads = [threading.Thread(target=job, args=(n, results), daemon=True) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(results) == 6, (round_, sorted(results))
        assert all(r.stdout == data for data, r in results.values())


def test_async_session_concurrent():
    async def main() -> None:
        async with AsyncSession(workspace=_ws()) as s:
            rs = await asyncio.gather(*(s.run(["sh", "-c", f"echo {i}; sleep 0.2"]) for i in range(8)))
            assert [r.stdout for r in rs] == [f"{i}\n".encode() for i in range(8)]
            p = await s.start(["sh", "-c", "echo hi; sleep 300"])
            out, _ = await p.read(timeout=5)
            assert out == b"hi\n"
            p.kill()
            assert (await p.wait(timeout=5)).killed_by == "cancelled"
            r = await s.run(["sleep", "5"], timeout=0.3)
            assert r.timed_out
            task = asyncio.ensure_future(s.run(["sleep", "300"]))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await s.run(["echo", "ok"])).stdout == b"ok\n"

    asyncio.run(main())


# -- no growth ------------------------------------------------------------------------------


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_many_sequential_commands_no_growth(session):
    n = int(os.environ.get("LOWLEVEL_SESSION_N", "2000"))
    for _ in range(50):
        session.run(["true"])
    fds0 = fd_numbers()
    init_pid = session._core.init_host_pid
    init_rss0 = _rss_kib(init_pid)
    procs0 = _sandbox_procs(session, spare=False)
    for _ in range(n):
        assert session.run(["true"]).exit_code == 0
    assert fd_numbers() == fds0
    assert len(_sandbox_procs(session, spare=False)) == len(procs0), procs0
    assert _rss_kib(init_pid) <= init_rss0 + 64
    assert not session._core.cmds and not session._core.fd_owner


# -- pool -----------------------------------------------------------------------------------


def test_pool_fresh_sandbox_per_call(tmp_path):
    src = tmp_path / "input.txt"
    src.write_text("data\n")
    os.chmod(tmp_path, 0o755)
    with Pool(size=2) as pool:
        r1 = pool.run(["sh", "-c", "cat input.txt; echo x > /tmp/mark; echo y > made.txt; echo $$"], inputs=[src])
        r2 = pool.run(["sh", "-c", "ls /tmp /workspace; cat /tmp/mark"])
        assert r1.stdout.startswith(b"data\n") and r1.exit_code == 0
        assert r1.changes.added == ("made.txt",)
        assert r1.workspace != r2.workspace
        assert r2.exit_code != 0 and b"made.txt" not in r2.stdout and b"input.txt" not in r2.stdout
        deadline = time.monotonic() + 10
        while pool.hits < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        rs = [pool.run(["echo", str(i)]) for i in range(6)]
        assert [r.stdout for r in rs] == [f"{i}\n".encode() for i in range(6)]
    assert not children(os.getpid())


def _as_test_user(code: str) -> str:
    """Run Python ``code`` as the unprivileged test user (runuser) and return its stdout."""
    user = "lowlevel-test"
    try:
        import pwd
        pwd.getpwnam(user)
    except KeyError:
        pytest.skip("no lowlevel-test user (tests/conftest.py creates it)")
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    probe = subprocess.run([runuser, "-u", user, "--", sys.executable, "-c", "import lowlevel.session"],
                           capture_output=True, cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"{user} cannot import lowlevel from {sys.executable} (.ci/run makes the checkout and venv "
                    f"world-readable): {probe.stderr.decode()[-300:]}")
    proc = subprocess.run([runuser, "-u", user, "--", sys.executable, "-c", code], capture_output=True,
                          timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return proc.stdout.decode()


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the session as an unprivileged user via runuser")
def test_session_as_unprivileged_user():
    out = _as_test_user("from lowlevel.session import Session\n"
                        "with Session() as s:\n"
                        "    r = s.run(['sh', '-c', 'id -u; echo hi > /workspace/f; cat /workspace/f'])\n"
                        "    print(r.exit_code, r.stdout)\n")
    assert "0 b'" in out and "hi" in out


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the session as an unprivileged user via runuser")
def test_spare_faults_as_unprivileged_user():
    """As an unprivileged caller: a command queued to spares that die unread runs on a fresh one,
    and a command's prlimit(2) of the init is refused (the root tests above, in brief)."""
    out = _as_test_user("import lowlevel\nfrom lowlevel.session import Session\n"
                        "p = lowlevel.Policy(env={'LOWLEVEL_INIT_FAULT_SPARE_DEATHS': '2'})\n"
                        "with Session(p) as s:\n"
                        "    print(s.run(['echo', 'ran'], timeout=10).stdout)\n"
                        "    r = s.run(['sh', '-c', 'prlimit --pid 2 --nofile=3:3 || echo refused'], timeout=10)\n"
                        "    print(r.stdout, s.run(['true'], timeout=10).exit_code)\n")
    assert out.split() == ["b'ran\\n'", "b'refused\\n'", "0"], out


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the session as an unprivileged user via runuser")
def test_fds_in_flight_as_unprivileged_user_give_a_clear_error():
    """An unprivileged caller's sandbox runs as the caller's own uid, so a command parking fds in
    flight counts against the caller's sendmsg(2) too: past the caller's RLIMIT_NOFILE its SPAWN
    fails with ETOOMANYREFS. That is a LaunchError saying what happened (was a bare OSError), or,
    under a higher caller limit, the command runs; the session lives on either way."""
    out = _as_test_user("import lowlevel\nfrom lowlevel.session import Session\n"
                        f"PARK = {_PARK_FDS!r}\n"
                        "with Session() as s:\n"
                        "    p = s.start(['python3', '-c', PARK])\n"
                        "    print(p.read(timeout=30)[0].split()[1:])\n"
                        "    try:\n"
                        "        print('ran', s.run(['echo', 'next'], timeout=10).stdout)\n"
                        "    except lowlevel.LaunchError as err:\n"
                        "        print('LaunchError', 'ETOOMANYREFS' in str(err), err.errno)\n"
                        "    p.kill(); p.wait(timeout=10)\n"
                        "    print('after', s.run(['echo', 'ok'], timeout=10).stdout)\n")
    lines = out.splitlines()
    assert lines[0] == "[b'ETOOMANYREFS']", out
    assert lines[1] in ("ran b'next\\n'", "LaunchError True 109"), out
    assert lines[2] == "after b'ok\\n'", out


def _reap_at_once(run: "lowlevel.sandbox.launcher.Run", barrier: threading.Barrier, errors: list[str]) -> None:
    barrier.wait()
    try:
        run.reap_bwrap()
    except Exception as err:  # noqa: BLE001 - the test's assertion shows it
        errors.append(repr(err))


def test_two_threads_reaping_a_dead_sessions_bwrap_at_once_do_not_fail():
    """A Session's reader reaping its dead init's bwrap while close() reaps it too: the second
    os.wait4 failed with "[Errno 10] No child processes", which close() raised (an MCP server's
    shutdown logged it; 11 of 20 here before the fix). Now the loser takes the winner's status."""
    errors: list[str] = []
    for _ in range(10):
        s = Session()
        s.run(["true"])
        run = s._core.run
        run.kill(None)
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=_reap_at_once, args=(run, barrier, errors)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert run.wait_status is not None
        s.close()
    assert errors == []


def test_a_forked_child_cannot_use_or_close_its_parents_session():
    """A child forked while a Session was open could run commands in it and its close() ended
    the parent's sandbox (the parent then heard "the session's init exited": a fresh-user
    trial). Now the child's copy is closed there: its calls raise SessionError(reason="forked"),
    its close() does nothing, and the parent's session goes on. Control: the parent's command
    runs before and after."""
    s = Session(workspace=_ws())
    try:
        assert s.run(["echo", "before"]).stdout == b"before\n"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            code = 1
            try:
                os.close(r)
                try:
                    s.run(["true"])
                    verdict = "ran"
                except SessionError as err:
                    verdict = f"{err.reason}:{'forked' in str(err) and not s.alive}"
                s.close()
                os.write(w, verdict.encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            verdict = f.read().decode()
        assert os.waitpid(pid, 0)[1] == 0
        assert verdict == "forked:True", verdict
        assert s.alive and s.run(["echo", "after"]).stdout == b"after\n"
    finally:
        s.close()
