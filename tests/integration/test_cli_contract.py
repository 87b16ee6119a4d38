"""The ``lowlevel run`` contract (issue 12 items 2, 3, 10; issue 10 item 3's CLI bullet):

- every error of lowlevel's own exits 125 with one line on stderr (argparse's 2 included);
  with ``--json`` every outcome prints exactly one JSON object;
- piped stdin reaches the program in every mode; ``--record`` stores it, replay feeds it,
  and more than 64 MiB is one line and exit 125;
- SIGINT, SIGTERM, SIGHUP and SIGQUIT during a run keep a fresh workspace (with the
  program's partial output) and print the same one-line notice with its path;
- ``--input SRC:DEST``, ``--cwd``; an interpreter whose symlink target is outside the sandbox
  is "not found" (127) with a hint naming the target, in every mode.

Each runs as root and as the unprivileged test user (``setpriv``, which execs, so the
signals reach the CLI itself).
"""

from __future__ import annotations

import json
import os
import secrets
import pwd
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.identities import setpriv, tmpdir_fixture
from helpers.procs import sleep_running

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]


def workspaces(base: Path) -> list[str]:
    """The workspaces under ``base`` (lowlevel's own dot-entries there, such as the overlay
    mount directory ``.mnt``, are not workspaces)."""
    return sorted(n for n in os.listdir(base) if not n.startswith("."))

REPO = Path(__file__).resolve().parents[2]


base = tmpdir_fixture("lowlevel-contract-base-", mode=0o755, owned=True)


scratch = tmpdir_fixture("lowlevel-contract-scratch-", mode=0o755, owned=True, name="scratch")


def argv_env(who: pwd.struct_passwd | None, base: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8",
           "LOWLEVEL_WORKSPACE_BASE": str(base)}
    cmd = [sys.executable, "-m", "lowlevel", *args]
    if who is not None:
        env["HOME"] = who.pw_dir
        cmd = setpriv(who, cmd)
    return cmd, env


def cli(who: pwd.struct_passwd | None, base: Path, *args: str, stdin: bytes | None = None,
        cwd: str = "/") -> subprocess.CompletedProcess[bytes]:
    cmd, env = argv_env(who, base, *args)
    return subprocess.run(cmd, input=stdin if stdin is not None else b"", capture_output=True, env=env,
                          cwd=cwd, timeout=120)


def one_line(stderr: bytes) -> str:
    lines = [line for line in stderr.decode().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lowlevel: "), stderr
    return lines[0]


# --- exit status contract ------------------------------------------------------------------------

USAGE_ERRORS = [
    ["run", "--memory", "abc", "--", "true"],
    ["run", "--timeout", "-1", "--", "true"],
    ["run", "--rm", "--workspace", "/tmp", "--", "true"],
    ["run"],
    ["run", "--"],
    ["run", "--no-such-option", "--", "true"],
    ["run", "--input", ":x", "--", "true"],
    ["run", "--cwd", "../x", "--", "true"],
    ["bogus"],
    [],
    ["replay"],
]


def test_usage_errors_exit_125_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing does not depend on who runs it: in-process, one subprocess below."""
    from lowlevel import cli as _cli
    monkeypatch.setenv("LOWLEVEL_WORKSPACE_BASE", str(tmp_path))
    for args in USAGE_ERRORS:
        assert _cli.main(args) == 125, args
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("lowlevel: "), (args, err)
        if args[:1] == ["run"]:
            assert _cli.main(["run", "--json", *args[1:]]) == 125, args
            out, err = capsys.readouterr()
            doc = json.loads(out)
            assert doc["error"] == "UsageError" and doc["exit_status"] == 125 and "\n" not in doc["message"]
            assert len(err.splitlines()) == 1
    assert os.listdir(tmp_path) == []


def test_usage_error_exit_status_of_the_process(who: pwd.struct_passwd | None, base: Path) -> None:
    proc = cli(who, base, "run", "--memory", "abc", "--", "true")
    assert proc.returncode == 125 and proc.stdout == b"", proc
    assert "--memory" in one_line(proc.stderr)


@pytest.mark.slow
def test_json_prints_one_object_for_every_outcome(who: pwd.struct_passwd | None, base: Path,
                                                  scratch: Path) -> None:
    for args, status, kind in [
        (["--", "no-such-command"], 127, "ExecError"),
        (["--", "/etc/passwd"], 126, "ExecError"),
        (["--workspace", "/etc", "--", "true"], 125, "WorkspaceError"),
        (["--input", str(scratch / "missing"), "--", "true"], 125, "WorkspaceError"),
    ]:
        proc = cli(who, base, "run", "--json", *args)
        assert proc.returncode == status, proc
        doc = json.loads(proc.stdout)  # exactly one object
        assert doc["error"] == kind and doc["exit_status"] == status, doc
        assert one_line(proc.stderr)
    proc = cli(who, base, "run", "--json", "--rm", "--timeout", "0.5", "--", "sleep", "10")
    assert proc.returncode == 124 and json.loads(proc.stdout)["timed_out"] is True
    proc = cli(who, base, "run", "--json", "--rm", "--", "sh", "-c", "exit 2")
    assert proc.returncode == 2 and json.loads(proc.stdout)["exit_code"] == 2
    assert workspaces(base) == []


# --- stdin in every mode -----------------------------------------------------------------------

@pytest.mark.slow
def test_piped_stdin_reaches_the_program_in_every_mode(who: pwd.struct_passwd | None, base: Path,
                                                       scratch: Path) -> None:
    data = b"hello\x00\xff world\n" * 1000
    proc = cli(who, base, "run", "--rm", "--", "sha256sum", stdin=data)
    import hashlib
    digest = hashlib.sha256(data).hexdigest().encode()
    assert proc.returncode == 0 and proc.stdout.startswith(digest), proc
    proc = cli(who, base, "run", "--rm", "--json", "--", "sha256sum", stdin=data)
    assert proc.returncode == 0 and json.loads(proc.stdout)["stdout"].startswith(digest.decode()), proc
    record = scratch / "run.json"
    proc = cli(who, base, "run", "--rm", "--record", str(record), "--", "sh", "-c", "sha256sum; echo done > f",
               stdin=data)
    assert proc.returncode == 0 and proc.stdout.startswith(digest), proc
    doc = json.loads(record.read_text())
    assert doc["stdin"]["sha256"] == hashlib.sha256(data).hexdigest() and doc["stdin"]["bytes"] == len(data)
    proc = cli(who, base, "replay", str(record))
    assert proc.returncode == 0, proc  # replay fed the same stdin: same output


@pytest.mark.slow
def test_record_stdin_over_64_mib_is_one_line(who: pwd.struct_passwd | None, base: Path, scratch: Path) -> None:
    record = scratch / "big.json"
    proc = cli(who, base, "run", "--record", str(record), "--", "true", stdin=b"x" * (64 * 1024 * 1024 + 1))
    assert proc.returncode == 125
    assert "64" in one_line(proc.stderr) or "67108864" in one_line(proc.stderr)
    assert not record.exists() and workspaces(base) == []
    # control: without --record the same stdin streams through (no bound)
    proc = cli(who, base, "run", "--rm", "--", "wc", "-c", stdin=b"x" * (64 * 1024 * 1024 + 1))
    assert proc.returncode == 0 and proc.stdout.split()[0] == b"67108865", proc


# --- interruptions -------------------------------------------------------------------------------

@pytest.mark.parametrize("signum,json_mode", [
    (signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGQUIT, False),
    (signal.SIGINT, True), (signal.SIGTERM, True),
], ids=["SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGINT-json", "SIGTERM-json"])
def test_interrupt_keeps_the_fresh_workspace_and_says_where(who: pwd.struct_passwd | None, base: Path,
                                                            signum: int, json_mode: bool) -> None:
    marker = f"60.{secrets.randbelow(10**6):06d}"  # names the program's sleep among the host's processes
    args = ["run", *(["--json"] if json_mode else []), "--", "sh", "-c",
            f"echo partial > out.txt; echo started >&2; exec sleep {marker}"]
    cmd, env = argv_env(who, base, *args)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd="/")
    try:
        if json_mode:  # output is captured: wait until the program sleeps (out.txt written)
            deadline = time.monotonic() + 60
            while not sleep_running(marker):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        else:
            assert proc.stderr is not None and proc.stderr.readline() == b"started\n"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    line = one_line(err)
    assert line.startswith(f"lowlevel: {name}: the sandbox was killed"), line
    ws = line.rsplit(" ", 1)[1]
    assert Path(ws, "out.txt").read_bytes() == b"partial\n"
    assert os.stat(ws).st_uid == (who.pw_uid if who else os.getuid())  # given back
    if json_mode:
        doc = json.loads(out)
        assert doc["error"] == "Interrupted" and doc["signal"] == name and doc["workspace"] == ws
        assert doc["exit_status"] == 128 + signum


def test_interrupt_with_rm_removes_the_workspace(who: pwd.struct_passwd | None, base: Path) -> None:
    cmd, env = argv_env(who, base, "run", "--rm", "--", "sh", "-c", "echo started >&2; sleep 60")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd="/")
    assert proc.stderr is not None and proc.stderr.readline() == b"started\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "removed (--rm)" in one_line(err)
    assert workspaces(base) == []


# --- small contract gaps -------------------------------------------------------------------------

def test_input_with_destination_and_cwd(who: pwd.struct_passwd | None, base: Path, scratch: Path) -> None:
    (scratch / "a.txt").write_text("A")
    (scratch / "pkg").mkdir()
    (scratch / "pkg" / "m.py").write_text("M")
    if who is not None:
        for p in (scratch / "a.txt", scratch / "pkg", scratch / "pkg" / "m.py"):
            os.chown(p, who.pw_uid, who.pw_gid)
    proc = cli(who, base, "run", "--rm", "--json", "--input", f"{scratch / 'a.txt'}:data/in/a.txt",
               "--input", f"{scratch / 'pkg'}:src/pkg", "--input", str(scratch / "a.txt"),
               "--cwd", "data", "--", "sh", "-c", "pwd; cat in/a.txt ../src/pkg/m.py ../a.txt")
    assert proc.returncode == 0, proc
    assert json.loads(proc.stdout)["stdout"] == "/workspace/data\nAMA"
    proc = cli(who, base, "run", "--rm", "--cwd", "/tmp", "--", "pwd")
    assert proc.stdout == b"/tmp\n"
    for bad in ("../x", "/abs/x", "a/../../x"):
        proc = cli(who, base, "run", "--rm", "--input", f"{scratch / 'a.txt'}:{bad}", "--", "true")
        assert proc.returncode == 125, proc
        one_line(proc.stderr)
    assert workspaces(base) == []


@pytest.fixture
def venv_outside(who: pwd.struct_passwd | None, scratch: Path) -> Path:
    """A venv whose ``bin/python`` links to an interpreter the sandbox will not see (as a
    venv made from a pyenv build under /root), and a ``bin/tool`` script using it."""
    target = scratch / "pyenv" / "bin"
    target.mkdir(parents=True)
    shutil.copy2("/usr/bin/true", target / "python3.11")
    venv = scratch / "venv" / "bin"
    venv.mkdir(parents=True)
    os.symlink(target / "python3.11", venv / "python")
    (venv / "tool").write_text(f"#!{venv / 'python'}\n")
    os.chmod(venv / "tool", 0o755)
    if who is not None:
        for root, dirs, files in os.walk(scratch):
            for n in dirs + files:
                os.lchown(os.path.join(root, n), who.pw_uid, who.pw_gid)
    return scratch / "venv"


@pytest.mark.parametrize("mode", [[], ["--json"], ["--record", "REC"]], ids=["live", "json", "record"])
def test_interpreter_symlink_outside_the_sandbox_is_not_found(who: pwd.struct_passwd | None, base: Path,
                                                              scratch: Path, venv_outside: Path,
                                                              mode: list[str]) -> None:
    mode = [str(scratch / "r.json") if m == "REC" else m for m in mode]
    for prog in ("python", "tool"):
        proc = cli(who, base, "run", *mode, "--ro", str(venv_outside), "--", str(venv_outside / "bin" / prog))
        assert proc.returncode == 127, proc
        line = one_line(proc.stderr)
        assert str(scratch / "pyenv" / "bin" / "python3.11") in line and "--ro" in line, line
        if "--json" in mode:
            assert json.loads(proc.stdout)["exit_status"] == 127
    # control: with the target bound too, it runs
    proc = cli(who, base, "run", "--rm", *mode, "--ro", str(venv_outside), "--ro", str(scratch / "pyenv"), "--",
               str(venv_outside / "bin" / "python"))
    assert proc.returncode == 0, proc
