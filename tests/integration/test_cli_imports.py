"""What a ``lowlevel run`` process imports (issue 27, item 3): only what the command needs.

A ``lowlevel run --rm -- /usr/bin/true`` process, and ``lowlevel.run`` in a fresh interpreter,
load none of the features the call does not use (images, records, MCP, the egress proxy, Ray,
the integrations, ``doctor``); an egress policy does load :mod:`lowlevel.net` (the control:
the check would see it). And the other way round, what laziness must never take away: the
modules the run's failure, cleanup and commit paths use (``shutil``, ``tempfile``, ``ctypes``,
``logging``) are loaded before the sandbox starts, since an import inside a cleanup failed
with a raw ``EMFILE`` at the fd limit and one inside a commit was cut by ^C (bench/README.md,
"Where the CLI's time goes").

Each case is a fresh interpreter (``-c`` calling :func:`lowlevel.cli.main`), so nothing this
test process imported counts.
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

#: Features a plain run must not load (each a package or module of lowlevel).
NOT_FOR_A_PLAIN_RUN = ("lowlevel.image", "lowlevel.record", "lowlevel.mcp_server", "lowlevel.net", "lowlevel.ray",
                       "lowlevel.integrations", "lowlevel.doctor", "lowlevel.rootfs", "lowlevel.cli.image_cli",
                       "lowlevel.cli.commands")
#: Standard modules the run's failure, cleanup and commit paths use: loaded before the sandbox.
EAGER = ("shutil", "tempfile", "ctypes", "logging")
#: Standard modules a plain run does without (issue 27, "The CLI, round 2"): ``typing`` only for the
#: type checker, ``inspect`` (with ast, dis, tokenize) only for a dataclass without a docstring.
STDLIB_NOT_FOR_A_RUN = ("typing", "inspect", "ast", "dis")

#: Runs the CLI in-process, then prints the loaded lowlevel features and the eager modules that
#: were already there when the sandbox was spawned (a wrapper around the anchor's spawn).
WRAPPER = """
import json, os, sys
import lowlevel.cli
seen = {}
spawn = os.posix_spawn
def spy(*a, **k):
    seen.setdefault("at_spawn", sorted(m for m in %(eager)r if m in sys.modules))
    return spawn(*a, **k)
os.posix_spawn = spy
code = lowlevel.cli.main(sys.argv[1:])
mods = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in %(features)r))
stdlib = sorted(m for m in %(stdlib)r if m in sys.modules)
print(json.dumps({"code": code, "features": mods, "at_spawn": seen.get("at_spawn"), "stdlib": stdlib}))
"""


def _cli(tmp_path: Path, *args: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOWLEVEL_WORKSPACE_BASE": str(tmp_path)}
    code = WRAPPER % {"eager": EAGER, "features": NOT_FOR_A_PLAIN_RUN, "stdlib": STDLIB_NOT_FOR_A_RUN}
    proc = subprocess.run([sys.executable, "-c", code, "run", *args], capture_output=True, text=True, env=env,
                          cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return doc


def test_cli_run_loads_no_feature_it_does_not_use(tmp_path: Path) -> None:
    doc = _cli(tmp_path, "--rm", "--", "/usr/bin/true")
    assert doc["code"] == 0
    assert doc["features"] == []
    assert doc["at_spawn"] == sorted(EAGER)
    assert doc["stdlib"] == []


def test_a_dataclass_without_a_docstring_still_loads_inspect_and_gets_its_doc(tmp_path: Path) -> None:
    # The control of the check above: the same interpreter start does import inspect when a
    # dataclass needs inspect.signature, and the class's __doc__ is the standard one.
    code = ("import sys\nfrom lowlevel._dataclass import dataclass\nassert 'inspect' not in sys.modules\n"
            "@dataclass\nclass NoDoc:\n    a: int\n"
            "print(repr(NoDoc.__doc__), 'inspect' in sys.modules, type(sys.modules['inspect']).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(REPO), "LOWLEVEL_CACHE_DIR": str(tmp_path)})
    assert proc.stdout.split() == ["'NoDoc(a:", "int)'", "True", "module"], proc.stderr


def test_python_m_lowlevel_cli_is_the_command(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOWLEVEL_WORKSPACE_BASE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "lowlevel.cli", "run", "--rm", "--", "/bin/echo", "hi"],
                          capture_output=True, text=True, env=env, cwd="/", timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "hi\n"), proc.stderr


def test_cli_run_with_json_loads_no_feature_it_does_not_use(tmp_path: Path) -> None:
    doc = _cli(tmp_path, "--rm", "--json", "--", "/usr/bin/true")
    assert doc["code"] == 0 and doc["features"] == [] and doc["at_spawn"] == sorted(EAGER) and doc["stdlib"] == []


def test_cli_run_with_an_allowlist_loads_the_egress_proxy(tmp_path: Path) -> None:
    # The control: the same check sees lowlevel.net once the policy has an Egress.
    doc = _cli(tmp_path, "--rm", "--allow-host", "example.invalid", "--", "/usr/bin/true")
    assert doc["code"] == 0
    assert "lowlevel.net" in doc["features"]  # type: ignore[operator]
    assert doc["at_spawn"] == sorted(EAGER)


def test_library_run_in_a_fresh_interpreter_loads_no_feature_it_does_not_use(tmp_path: Path) -> None:
    code = ("import json, os, sys, lowlevel\n"
            "seen = []\nspawn = os.posix_spawn\n"
            f"def spy(*a, **k):\n    seen.append(sorted(m for m in {EAGER!r} if m in sys.modules))\n"
            "    return spawn(*a, **k)\n"
            "os.posix_spawn = spy\n"
            "r = lowlevel.run(['/usr/bin/true'], keep_workspace=False)\n"
            f"features = {NOT_FOR_A_PLAIN_RUN!r}\n"
            "print(json.dumps([r.exit_code, sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') "
            "for f in features)), seen[:1]]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOWLEVEL_WORKSPACE_BASE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [0, [], [sorted(EAGER)]]


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["run", "--help"], ["image", "--help"], ["bogus"]])
def test_help_version_and_usage_errors_load_no_command_machinery(argv: list[str]) -> None:
    code = ("import json, sys\nfrom lowlevel.cli import main\n"
            "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print(json.dumps([code, sorted(m for m in sys.modules if m.startswith(('lowlevel.api', "
            "'lowlevel.sandbox', 'lowlevel.image', 'lowlevel.rootfs', 'lowlevel.session', 'lowlevel.workspace')))]))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd="/", timeout=60)
    code_, loaded = json.loads(proc.stdout.splitlines()[-1])
    assert code_ == (125 if argv == ["bogus"] else 0), proc.stderr
    assert loaded == []
    if argv == ["bogus"]:  # the usage error is still its one line
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("lowlevel: "), proc.stderr
