"""``lowlevel run`` never hands the sandbox the caller's own stdin/stdout/stderr (issue 12,
item 1): pipes of ours, or a pty of ours relayed live when the caller's side is a terminal.

Attacks: a program that locks, stops and re-disciplines its terminal (``TIOCEXCL``,
``TCXONC TCOOFF``, ``TIOCSETD``) leaves the test's own pty usable; a program whose stdout is a
log file in a 0700 directory cannot read the log's earlier content through
``/proc/self/fd/1``. Controls: the same programs run outside lowlevel do damage the pty and
do read the log. Each runs as root and as the unprivileged test user.
"""

from __future__ import annotations

import fcntl
import os
import pty
import pwd
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.identities import setpriv as as_user, tmpdir_fixture

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0
TIOCGEXCL = 0x80045440   # _IOR('T', 0x40, int): is the tty in exclusive mode (Linux >= 3.8)
TIOCGETD = 0x5424
N_TTY, N_NULL = 0, 27

#: What an agent's program can do to the terminal it is handed.
TTY_ATTACK = r"""
import fcntl, os, struct, sys, termios
def tryit(name, fn):
    try:
        fn(); print(name, "ok", flush=True)
    except (OSError, termios.error) as e:
        print(name, "errno", e.args[0], flush=True)
tryit("TIOCEXCL", lambda: fcntl.ioctl(0, termios.TIOCEXCL))
tryit("TIOCSETD", lambda: fcntl.ioctl(0, termios.TIOCSETD, struct.pack("i", 27)))
# last: once output is stopped, nothing more can be printed to this terminal
try:
    termios.tcflow(0, termios.TCOOFF)
except (OSError, termios.error):
    os._exit(3)
os._exit(0)
"""

#: Reopen stdout read-only and report what it held; then try to rewrite it from offset 0.
LOG_ATTACK = r"""
import os, sys
try:
    fd = os.open("/proc/self/fd/1", os.O_RDONLY | os.O_NONBLOCK)
    try:
        data = os.read(fd, 4096)
    except BlockingIOError:
        data = b""
    sys.stderr.write("READ:" + data.decode("latin-1") + "\n")
except OSError as e:
    sys.stderr.write("READ-ERR %d\n" % e.errno)
try:
    fd = os.open("/proc/self/fd/1", os.O_WRONLY)
    os.write(fd, b"OVERWRITTEN")
    sys.stderr.write("WROTE\n")
except OSError as e:
    sys.stderr.write("WRITE-ERR %d\n" % e.errno)
"""


base = tmpdir_fixture("lowlevel-stdio-base-", mode=0o755, owned=True)


def cli_argv(who: pwd.struct_passwd | None, *args: str) -> tuple[list[str], dict[str, str]]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    if who is not None:
        env["HOME"] = who.pw_dir
    return as_user(who, [sys.executable, "-m", "lowlevel", "run", *args]), env


def as_ctty() -> None:
    """preexec: a new session whose controlling terminal is the pty on fd 0."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class PtyRun:
    """A command on a fresh pty (its controlling terminal); the test holds the master."""

    def __init__(self, argv: list[str], env: dict[str, str], rows: int = 33, cols: int = 111) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.termios_before = termios.tcgetattr(self.slave)
        self.proc = subprocess.Popen(argv, stdin=self.slave, stdout=self.slave, stderr=self.slave,
                                     preexec_fn=as_ctty, env=env, cwd="/")
        self.out = b""

    def read_until(self, pred: Callable[[bytes], bool], timeout: float = 60) -> bytes:
        end = time.monotonic() + timeout
        while not pred(self.out) and time.monotonic() < end:
            r, _, _ = select.select([self.master], [], [], 0.2)
            if r:
                try:
                    data = os.read(self.master, 65536)
                except OSError:
                    break
                self.out += data
        return self.out

    def wait(self, timeout: float = 60) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self.read_until(lambda _b: False, timeout=0.2)
        self.read_until(lambda _b: False, timeout=0.3)
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.master, self.slave):
            os.close(fd)


def pty_usable(master: int, slave: int) -> list[str]:
    """What is wrong with the pty now (empty: nothing)."""
    wrong = []
    ldisc = struct.unpack("i", fcntl.ioctl(slave, TIOCGETD, struct.pack("i", -1)))[0]
    if ldisc != N_TTY:
        wrong.append(f"line discipline {ldisc}")
    excl = struct.unpack("i", fcntl.ioctl(slave, TIOCGEXCL, struct.pack("i", 0)))[0]
    if excl:
        wrong.append("exclusive mode (opens fail with EBUSY)")
    try:
        os.write(slave, b"probe\n")
    except OSError as err:
        wrong.append(f"write fails: {err.strerror}")
        return wrong
    r, _, _ = select.select([master], [], [], 2)
    if not r:
        wrong.append("output stopped (TCOOFF)")
    else:
        os.read(master, 4096)
    return wrong


def test_terminal_attacks_leave_the_callers_pty_usable(who: pwd.struct_passwd | None, base: Path) -> None:
    argv, env = cli_argv(who, "--rm", "--", "python3", "-c", TTY_ATTACK)
    env["LOWLEVEL_WORKSPACE_BASE"] = str(base)
    run = PtyRun(argv, env)
    try:
        assert run.wait() == 0, run.out                  # TCOOFF worked, on our pty
        assert b"TIOCSETD errno 1" in run.out, run.out  # seccomp: EPERM
        assert b"TIOCEXCL ok" in run.out, run.out        # done to our pty, harmless
        assert pty_usable(run.master, run.slave) == [], run.out
        assert termios.tcgetattr(run.slave) == run.termios_before
    finally:
        run.close()


def test_control_terminal_attacks_work_outside(who: pwd.struct_passwd | None) -> None:
    """Without lowlevel the same program breaks the pty it is given."""
    master, slave = pty.openpty()
    try:
        cmd = as_user(who, [sys.executable, "-c", TTY_ATTACK])
        out = subprocess.run(cmd, stdin=slave, stdout=subprocess.PIPE, timeout=60).stdout
        assert b"TIOCEXCL ok" in out and b"TIOCSETD ok" in out, out
        wrong = pty_usable(master, slave)
        assert wrong[:2] == ["line discipline 27", "exclusive mode (opens fail with EBUSY)"], wrong
    finally:
        os.close(master)
        os.close(slave)


@pytest.fixture
def log_file(who: pwd.struct_passwd | None) -> Iterator[Path]:
    """An agent log with earlier (secret) content, in a 0700 directory of the caller's."""
    d = Path(tempfile.mkdtemp(prefix="lowlevel-log-"))
    os.chmod(d, 0o700)
    log = d / "agent.log"
    log.write_bytes(b"EARLIER-SECRET-LINE\n")
    os.chmod(log, 0o644)
    if who is not None:
        os.chown(d, who.pw_uid, who.pw_gid)
        os.chown(log, who.pw_uid, who.pw_gid)
    yield log
    shutil.rmtree(d, ignore_errors=True)


def test_stdout_log_file_is_not_reachable_through_proc_self_fd(who: pwd.struct_passwd | None, base: Path,
                                                               log_file: Path) -> None:
    argv, env = cli_argv(who, "--rm", "--", "python3", "-c", LOG_ATTACK)
    env["LOWLEVEL_WORKSPACE_BASE"] = str(base)
    with open(log_file, "ab") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                              cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert b"EARLIER-SECRET-LINE" not in proc.stderr, proc.stderr
    content = log_file.read_bytes()
    assert content.startswith(b"EARLIER-SECRET-LINE\n"), content  # history not rewritten


def test_control_log_file_is_readable_through_proc_self_fd_outside(who: pwd.struct_passwd | None,
                                                                   log_file: Path) -> None:
    cmd = as_user(who, [sys.executable, "-c", LOG_ATTACK])
    with open(log_file, "ab") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, timeout=60)
    assert b"EARLIER-SECRET-LINE" in proc.stderr, proc.stderr


def test_program_fds_are_pipes_and_output_streams_live(who: pwd.struct_passwd | None, base: Path) -> None:
    argv, env = cli_argv(who, "--", "sh", "-c",
                         "ls -l /proc/self/fd/ >&2; echo first; sleep 60; echo never")
    env["LOWLEVEL_WORKSPACE_BASE"] = str(base)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=env, cwd="/")
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline() == b"first\n"  # before the program ended
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM and rest == b"", err
    for n in (0, 1, 2):
        line = next(line for line in err.decode().splitlines() if line.split()[-3:-2] == [str(n)])
        assert "pipe:[" in line, err


def test_interactive_pty_relay(who: pwd.struct_passwd | None, base: Path) -> None:
    """stdin and stdout a terminal: the program gets a pty of ours with the caller's window
    size (and later changes of it), echo and line editing from its own line discipline, ^D
    as end of file; the caller's termios come back unchanged."""
    script = ("stty size; tty; ls -l /proc/self/fd/0; echo ttys=$(cat /proc/[0-9]*/stat | cut -d' ' -f7 | sort -u); "
              "echo READY; read line; echo got:$line; "
              "while [ \"$(stty size)\" = '33 111' ]; do sleep 0.05; done; stty size; cat; echo eof-seen")
    argv, env = cli_argv(who, "--rm", "--", "sh", "-c", script)
    env["LOWLEVEL_WORKSPACE_BASE"] = str(base)
    run = PtyRun(argv, env)
    try:
        run.read_until(lambda b: b"READY" in b)
        assert b"33 111" in run.out, run.out
        assert b"ttys=0\r\n" in run.out, run.out  # no process inside has a controlling terminal
        os.write(run.master, b"hello\n")
        run.read_until(lambda b: b"got:hello" in b)
        assert b"hello\r\ngot:hello" in run.out, run.out   # echoed by the inner pty, then read
        fcntl.ioctl(run.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 44, 120, 0, 0))  # SIGWINCH to the CLI
        run.read_until(lambda b: b"44 120" in b)
        os.write(run.master, b"\x04")  # ^D
        assert run.wait() == 0, run.out
        assert b"eof-seen" in run.out and b"44 120" in run.out, run.out
        assert b"/dev/pts/" in run.out  # a pty ...
        assert termios.tcgetattr(run.slave) == run.termios_before
        assert pty_usable(run.master, run.slave) == []
    finally:
        run.close()


@pytest.mark.parametrize("char,signum", [(b"\x03", signal.SIGINT), (b"\x1c", signal.SIGQUIT),
                                         (None, signal.SIGTERM), (None, signal.SIGQUIT)],
                         ids=["^C", "^\\", "kill-TERM", "kill-QUIT"])
def test_interrupt_characters_kill_the_run_and_keep_the_workspace(who: pwd.struct_passwd | None, base: Path,
                                                                  char: bytes | None, signum: int) -> None:
    """^C and ^\\ typed on the terminal (raw mode: the relay raises them in the CLI), or the
    signal sent: the run ends with the same notice, the workspace is kept, termios restored."""
    argv, env = cli_argv(who, "--", "sh", "-c", "echo partial > out.txt; echo READY; sleep 60")
    env["LOWLEVEL_WORKSPACE_BASE"] = str(base)
    run = PtyRun(argv, env)
    try:
        run.read_until(lambda b: b"READY" in b)
        if char is None:
            run.proc.send_signal(signum)
        else:
            os.write(run.master, char)
        assert run.wait() == 128 + signum, run.out
        name = signal.Signals(signum).name
        line = next(line for line in run.out.decode().splitlines() if line.startswith(f"lowlevel: {name}"))
        ws = line.rsplit(" ", 1)[1].strip()
        assert Path(ws, "out.txt").read_bytes() == b"partial\n"
        assert termios.tcgetattr(run.slave) == run.termios_before
    finally:
        run.close()
