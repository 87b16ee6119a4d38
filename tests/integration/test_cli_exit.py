"""The ``lowlevel`` command ends its process without the interpreter's teardown, and loses nothing by it.

:func:`lowlevel._startup.exit_now` (issue 27, "The CLI, round 2") replaces Python's exit in the
command's own process: it waits for the non-daemon threads, runs the atexit handlers, flushes
stdout and stderr, then ``os._exit``. Each test runs the real command (``python -m lowlevel``,
so the start-up guard is armed as for the console script) and checks what Python's exit would
have given: the threads' and atexit handlers' work done, every byte of output delivered, the
status, the workspace removed. The control shows the same checks fail for a process that
``os._exit``\\s straight away.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]

#: A sitecustomize (imported by every interpreter start) leaving marks: one from a non-daemon
#: thread that finishes after the main program, one from an atexit handler, one from the
#: interpreter's teardown (an object freed with the module: the proof that exit_now was taken).
SITECUSTOMIZE = """
import atexit, os, threading, time
_d = os.environ["MARKS"]
def _late():
    time.sleep(0.3)
    open(os.path.join(_d, "thread"), "w").close()
threading.Thread(target=_late).start()
atexit.register(lambda: open(os.path.join(_d, "atexit"), "w").close())
class _AtTeardown:  # freed with this module by the interpreter's teardown, which exit_now skips
    _path = os.path.join(_d, "teardown")
    _open = open
    def __del__(self):
        self._open(self._path, "w").close()
_at_teardown = _AtTeardown()
"""


def _command(tmp_path: Path, *argv: str, marks: bool = False) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOWLEVEL_WORKSPACE_BASE": str(tmp_path / "ws")}
    if marks:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (tmp_path / "marks").mkdir()
        env.update(PYTHONPATH=f"{site}:{REPO}", MARKS=str(tmp_path / "marks"))
    (tmp_path / "ws").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, *argv], capture_output=True, env=env, cwd="/", timeout=60)


def test_threads_and_atexit_handlers_finish_before_the_command_exits(tmp_path: Path) -> None:
    proc = _command(tmp_path, "-m", "lowlevel", "run", "--rm", "--", "/bin/echo", "hi", marks=True)
    assert (proc.returncode, proc.stdout) == (0, b"hi\n"), proc.stderr
    assert sorted(os.listdir(tmp_path / "marks")) == ["atexit", "thread"]  # no "teardown": exit_now ended it
    assert os.listdir(tmp_path / "ws") == []  # --rm: the sandbox's teardown (an atexit drain) ran to the end


def test_controls_python_exit_leaves_all_three_marks_an_immediate_os_exit_none(tmp_path: Path) -> None:
    proc = _command(tmp_path, "-c", "pass", marks=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path / "marks")) == ["atexit", "teardown", "thread"]
    for name in os.listdir(tmp_path / "marks"):
        os.unlink(tmp_path / "marks" / name)
    proc = subprocess.run([sys.executable, "-c", "import os; os._exit(0)"], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "site"), "MARKS": str(tmp_path / "marks")})
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path / "marks") == []


def test_a_program_calling_main_keeps_pythons_exit(tmp_path: Path) -> None:
    proc = _command(tmp_path, "-c", "import sys; from lowlevel.cli import main; sys.exit(main(sys.argv[1:]))",
                    "run", "--rm", "--", "/bin/true", marks=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path / "marks")) == ["atexit", "teardown", "thread"]


def test_all_output_and_the_status_arrive(tmp_path: Path) -> None:
    proc = _command(tmp_path, "-m", "lowlevel", "run", "--rm", "--", "/bin/sh", "-c",
                    "head -c 1000000 /dev/zero; echo err >&2; exit 3")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == b"\0" * 1000000 and proc.stderr == b"err\n"
    proc = _command(tmp_path, "-m", "lowlevel", "run", "--rm", "--json", "--", "/bin/sh", "-c",
                    "head -c 200000 /dev/zero | tr '\\0' a")
    doc = json.loads(proc.stdout)
    assert (proc.returncode, doc["exit_code"], len(doc["stdout"])) == (0, 0, 200000)


def test_a_usage_error_is_still_one_line_and_125(tmp_path: Path) -> None:
    proc = _command(tmp_path, "-m", "lowlevel", "run", "--timeout", "soon", "--", "/bin/true")
    assert proc.returncode == 125
    assert proc.stderr.count(b"\n") == 1 and proc.stderr.startswith(b"lowlevel: "), proc.stderr


CONSOLE_SCRIPT = "import sys\nfrom lowlevel.cli import main\nsys.exit(main())\n"  # what pip writes


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_the_console_script_by_a_relative_path_is_the_command_too(tmp_path: Path, how: str) -> None:
    """``.venv/bin/lowlevel run ...`` (the README's own form): Python makes ``__main__.__file__``
    absolute while ``argv[0]`` stays relative, so the command did not know itself and took
    Python's whole teardown (the teardown mark written; its start-up ^C notice and its cache of
    modules were off too). Run by a relative and by an absolute path, it ends as the command."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "lowlevel").write_text(CONSOLE_SCRIPT)
    script = "bin/lowlevel" if how == "relative" else str(tmp_path / "bin" / "lowlevel")
    env = {**os.environ, "LOWLEVEL_WORKSPACE_BASE": str(tmp_path / "ws")}
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp_path / "marks").mkdir()
    (tmp_path / "ws").mkdir()
    env.update(PYTHONPATH=f"{site}:{REPO}", MARKS=str(tmp_path / "marks"))
    proc = subprocess.run([sys.executable, script, "run", "--rm", "--", "/bin/echo", "hi"], capture_output=True,
                          env=env, cwd=tmp_path, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, b"hi\n"), proc.stderr
    assert sorted(os.listdir(tmp_path / "marks")) == ["atexit", "thread"]  # no teardown: exit_now was taken
