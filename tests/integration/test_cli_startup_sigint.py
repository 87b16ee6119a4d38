"""SIGINT at random instants from the CLI's process start: a one-line notice, never a traceback.

Issue 23 item 5: a ^C in the CLI's first ~170 ms (importing the package) printed a
``KeyboardInterrupt`` traceback (21 of 300 root runs, 15 of 120 unprivileged). ``lowlevel run
--rm -- true`` is started ~100 times per identity and sent SIGINT after a random delay of 0-300
ms: before Python's handler exists (killed by the signal, silent), while the package imports
(:mod:`lowlevel._startup`: one line, exit 130), while the run is set up or runs (the CLI's own
notice, exit 130), or after it ended (exit 0). stderr and stdout never hold a traceback.

The command is lowlevel's console script as pip writes it (its ``import re`` after the package's,
where a plain install's site module has imported re already), run with ``python -S`` and the
installed packages on ``sys.path``: the site module (in this editable checkout setuptools'
editable finder, ~15 ms that imports pathlib and re) runs before any code of lowlevel and is out
of its reach. So is the interpreter's own start-up (``init_sys_streams``); a traceback counts
when it passes through the package's code (its files appear in it), which is what the start-up
handler covers. Control: the same script with the handler not armed (``sys.argv[0]`` not
``lowlevel`` while the package imports) prints such tracebacks.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import cffi

pytestmark = [pytest.mark.bwrap, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITE = os.path.dirname(os.path.dirname(cffi.__file__))  # the environment's site-packages

SCRIPT = """#!{python} -S
import sys
sys.path[:0] = [{repo!r}, {site!r}]
{extra}
from lowlevel.cli import main
import re
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""


@pytest.fixture
def tmp_bin():
    """A directory under /tmp the test user can read (pytest's tmp_path is root's 0700)."""
    d = tempfile.mkdtemp(prefix="lowlevel-sigint-", dir="/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _script(tmp: Path, extra: str = "", name: str | None = None) -> str:
    d = tmp / (name or ("bin-control" if extra else "bin"))
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    path = d / "lowlevel"
    path.write_text(SCRIPT.format(python=sys.executable, repo=REPO, site=SITE, extra=extra))
    path.chmod(0o755)
    return str(path)


#: A traceback through the package's own code (Python's start-up has none: see the docstring).
OURS = os.path.join(REPO, "lowlevel") + os.sep


def _trials(argv_prefix: list[str], script: str, n: int, seed: int) -> tuple[int, dict[int, int], str]:
    rng = random.Random(seed)
    bad, codes, sample = 0, {}, ""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    for name in ("LOWLEVEL_CACHE_DIR", "LOWLEVEL_RECORD_DIR"):  # the suite's (an unprivileged user: not theirs)
        if name in os.environ:
            env[name] = os.environ[name]
    for _ in range(n):
        p = subprocess.Popen([*argv_prefix, script, "run", "--rm", "--", "true"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd="/", env=env)
        time.sleep(rng.uniform(0, 0.3))
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        codes[p.returncode] = codes.get(p.returncode, 0) + 1
        if (b"Traceback" in err or b"Traceback" in out) and OURS.encode() in err + out:
            bad += 1
            sample = sample or err.decode(errors="replace")[-800:]
    return bad, codes, sample


@pytest.mark.parametrize("identity", ["root", "user"])
def test_sigint_at_random_instants_never_a_traceback(identity: str, tmp_bin: Path,
                                                     request: pytest.FixtureRequest) -> None:
    prefix: list[str] = []
    if identity == "root" and os.geteuid() != 0:
        pytest.skip("needs root")
    if identity == "user" and os.geteuid() == 0:
        user = request.getfixturevalue("test_user")
        prefix = ["/usr/sbin/runuser", "-u", user.pw_name, "--"]
    script = _script(tmp_bin)
    if prefix:  # setpriv execs the script (the signal reaches its python), runuser would fork
        user = request.getfixturevalue("test_user")
        prefix = ["/usr/bin/setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    bad, codes, sample = _trials(prefix, script, 100, 23)
    assert bad == 0, f"{bad} of 100 printed a traceback ({codes}):\n{sample}"
    # Not vacuous: many runs were interrupted by lowlevel's handlers (130), some finished (0).
    assert codes.get(128 + signal.SIGINT, 0) >= 10, codes  # 17 of 100 on a loaded 2-core machine


def test_control_without_the_startup_guard_tracebacks(tmp_bin: Path) -> None:
    """Control: with the guard disarmed (the import-time window open), ^C gives tracebacks."""
    script = _script(tmp_bin, extra="sys.argv[0] = 'not-the-cli'")
    bad, codes, _sample = _trials([], script, 60, 7)
    assert bad > 0, codes


TRACER = """
import sys
INIT = {init!r}
LINE = {line}
SEEN = []
def _local(frame, event, arg):
    if event == "line" and LINE == 0:
        SEEN.append((frame.f_code.co_name, frame.f_lineno))
    if event == "line" and frame.f_lineno == LINE:
        sys.settrace(None)
        raise KeyboardInterrupt
    return _local
def _global(frame, event, arg):
    if frame.f_code.co_filename == INIT and frame.f_code.co_name in ("<module>", "_is_the_command"):
        return _local
    if LINE == 0 and SEEN and frame.f_code.co_filename != INIT:  # the guard is behind: report what ran
        sys.settrace(None)
        print(repr(SEEN), file=sys.stderr)
        import os; os._exit(0)
    return None
sys.settrace(_global)
"""


def _traced(tmp: Path, line: int) -> subprocess.CompletedProcess[bytes]:
    script = _script(tmp, TRACER.format(init=os.path.join(OURS, "__init__.py"), line=line), name=f"l{line}")
    return subprocess.run([script, "run", "--rm", "--", "true"], capture_output=True, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, timeout=60)


def _guard_lines(tmp: Path) -> list[int]:
    """The lines the start-up guard runs before its handler is armed (its try block's and
    ``_is_the_command``'s), as a trace of the command's start records them.

    Less its ``def`` and ``try:`` lines: a trace function can raise there, a signal cannot (a
    pending signal is acted on at calls, backward jumps and function entries; those lines are
    a MAKE_FUNCTION and a NOP, and CPython 3.11 leaves the inner ``try:``'s NOP out of the outer
    handler's range).
    """
    import ast
    lines = Path(OURS, "__init__.py").read_text().splitlines()
    first, last = lines.index("try:") + 1, lines.index("except KeyboardInterrupt:") + 1
    seen = ast.literal_eval(_traced(tmp, 0).stderr.decode().strip().splitlines()[-1])
    return sorted({ln for _, ln in seen if first < ln < last
                   and not lines[ln - 1].lstrip().startswith(("def ", "try:"))})


def test_a_sigint_on_any_line_before_the_handler_is_armed_gives_the_notice(tmp_bin: Path) -> None:
    """The guard's own window: a KeyboardInterrupt on each of its lines is the notice and 130.

    CI once caught the SIGINT landing inside the guard before its handler was armed (1 of 100
    random instants): the default handler's KeyboardInterrupt, raised in the package's first
    lines, printed a traceback. A trace function raises it on each line in turn, deterministically.
    """
    lines = _guard_lines(tmp_bin)
    assert len(lines) >= 4, lines
    for line in lines:
        p = _traced(tmp_bin, line)
        assert (p.returncode, p.stdout, p.stderr) == (
            130, b"", b"lowlevel: SIGINT: interrupted while starting; nothing was run\n"), (line, p.stderr[-900:])


def test_control_a_library_caller_interrupted_there_gets_its_keyboardinterrupt(tmp_bin: Path) -> None:
    """Control: a program that imports the library keeps Python's behaviour (a traceback)."""
    line = next(n for n, text in enumerate(Path(OURS, "__init__.py").read_text().splitlines(), 1)
                if "_signal.getsignal(_signal.SIGINT)" in text)  # where a library caller's check runs
    prog = tmp_bin / "prog.py"
    prog.write_text(f"import sys\nsys.path[:0] = [{REPO!r}, {SITE!r}]\n"
                    + TRACER.format(init=os.path.join(OURS, "__init__.py"), line=line) + "import lowlevel\n")
    p = subprocess.run([sys.executable, "-S", str(prog)], capture_output=True, cwd="/", timeout=60)
    assert p.returncode == -signal.SIGINT and b"KeyboardInterrupt" in p.stderr, (p.returncode, p.stderr[-400:])


SET_NAME_TRACER = """
import sys
def _local(frame, event, arg):
    if event == "line" and "lowlevel.cli.run_cmd" in sys.modules:
        sys.settrace(None)
        raise KeyboardInterrupt
    return _local
def _global(frame, event, arg):
    if frame.f_code.co_name == "__set_name__" and frame.f_code.co_filename.endswith("dataclasses.py"):
        return _local
    return None
sys.settrace(_global)
"""


def test_a_sigint_in_a_dataclass_field_while_run_imports_is_the_notice(tmp_bin: Path) -> None:
    """CI caught a ^C landing in ``dataclasses.Field.__set_name__`` while ``run``'s machinery
    imported (1 of 100 random instants): CPython 3.11 wraps it in ``RuntimeError("Error calling
    __set_name__ on 'Field' instance 'changes' in 'Result'")``, which the CLI's
    ``except KeyboardInterrupt`` missed: a traceback, exit 1. A trace function raises it there."""
    script = _script(tmp_bin, SET_NAME_TRACER, name="setname")
    p = subprocess.run([script, "run", "--rm", "--", "true"], capture_output=True, cwd="/",
                       env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LOWLEVEL_NO_CACHE": "1"}, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (
        130, b"", b"lowlevel: SIGINT: interrupted while starting; nothing was run\n"), p.stderr[-900:]
