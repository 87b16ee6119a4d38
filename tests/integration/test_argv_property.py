"""Issue 10 item 1, property-based: arbitrary strings in every field never change bwrap's argv.

Hypothesis feeds strings with NUL bytes, option-looking tokens (``--bind``, ``--share-net``),
``=``, newlines, raw bytes spelled with ``surrogateescape`` and lone surrogates into every field
of ``run``, ``Session.run``, the CLI, the MCP tools and a record for ``replay``. Each call either
refuses with PolicyError (RecordError for a record; exit 125 and one line for the CLI) or
runs with exactly the intended argv:

- pure level (many examples): :func:`lowlevel.sandbox.argv.build_argv` of the validated request, written
  the way the launcher writes the ``--args`` memfd (:func:`lowlevel.sandbox.argv.encode_args`) and split
  the way bwrap splits it, gives back the same list, with ``--chdir /`` (the cwd goes to the
  guard as ``--cwd=DIR``, never to bwrap: issue 22 item 1), each
  variable as ``--setenv NAME VALUE``, each bind as ``--(ro-)bind SRC DEST``, and no option the
  default Policy does not have;
- real level (fewer examples, the real sandbox): the program inside reports the argv, the
  environment and the cwd it got, byte for byte, and ``Result.argv`` (``"argv"`` in ``--json``,
  ``bwrap_argv`` in a record) ends with ``--`` and exactly the command.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowlevel
from lowlevel import cli
from lowlevel.spec import validate
from lowlevel.sandbox.argv import build_argv, encode_args
from lowlevel.errors import PolicyError
from lowlevel.sandbox.facts import host_facts
from lowlevel.sandbox.launcher import Run
from lowlevel.sandbox.plan import CHILD_FDS
from lowlevel.sandbox.request import RunRequest
from lowlevel.spec.policy import WORKSPACE_DEST, Bind, Policy
from lowlevel.record import RecordError, replay
from lowlevel.spec.report import name_from_json

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(600)]

# Strings meant to break an argv: NUL, option tokens, '=', newlines, raw bytes, lone surrogates.
_NASTY_CHARS = st.sampled_from(["\0", "-", "=", "/", "\n", " ", "\udcff", "\udc80", "\ud800", "é", "\t", "'"])
_TOKENS = st.sampled_from(["--bind", "--share-net", "--ro-bind", "/", "/tmp/host", "--setenv", "--", "--args", "3"])
NASTY = st.one_of(
    st.text(alphabet=st.one_of(st.characters(), _NASTY_CHARS), max_size=12),
    st.lists(st.one_of(_TOKENS, st.text(max_size=4)), min_size=1, max_size=5).map("\0".join),
)
# Names that change how the probe program itself starts (PYTHON*, LD_*) are left out.
ENV_NAMES = st.one_of(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), NASTY).filter(
    lambda k: not k.upper().startswith(("PYTHON", "LD_")))

# Prints what the program got, as hex of the exact bytes.
PROG = ("import json, os, sys; print(json.dumps({'argv': [os.fsencode(a).hex() for a in sys.argv[1:]], "
        "'env': {os.fsencode(k).hex(): os.fsencode(v).hex() for k, v in os.environ.items()}, "
        "'cwd': os.fsencode(os.getcwd()).hex()}))")
PY = "/usr/bin/python3"
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                      HealthCheck.filter_too_much])


def _bwrap_reads(argv: list[str]) -> list[str]:
    """What bwrap reads from the --args memfd the launcher writes: split on NUL."""
    return [os.fsdecode(t) for t in encode_args(argv).split(b"\0")[:-1]]


def _options(argv: list[str]) -> list[tuple[str, ...]]:
    arity = {"--bind": 2, "--ro-bind": 2, "--ro-bind-data": 2, "--file": 2, "--perms": 1, "--symlink": 2,
             "--setenv": 2, "--chdir": 1,
             "--hostname": 1, "--uid": 1, "--gid": 1, "--tmpfs": 1, "--size": 1, "--proc": 1, "--dev": 1,
             "--remount-ro": 1, "--json-status-fd": 1, "--block-fd": 1, "--seccomp": 1, "--cap-drop": 1}
    out, i = [], 0
    while i < len(argv):
        n = arity.get(argv[i], 0)
        out.append(tuple(argv[i:i + 1 + n]))
        i += 1 + n
    return out


@pytest.fixture(scope="module")
def shared() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lowlevel-argv-property-"))
    os.chmod(path, 0o711)
    (path / "bindsrc").mkdir(mode=0o755)
    (path / "ws").mkdir(mode=0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- pure level: the argv of every validated request -----------------------------------------------

@settings(max_examples=200, **SETTINGS)
@given(cwd=st.one_of(st.just(WORKSPACE_DEST), NASTY.map(lambda s: "/" + s)),
       env=st.dictionaries(ENV_NAMES, NASTY, max_size=3), args=st.lists(NASTY, max_size=3),
       dest=st.one_of(st.just(""), NASTY.map(lambda s: "/opt/" + s)), hostname=NASTY, policy_env=st.dictionaries(
           ENV_NAMES, NASTY, max_size=2))
def test_argv_is_exactly_the_intended_one(shared: Path, cwd: str, env: dict[str, str], args: list[str], dest: str,
                                          hostname: str, policy_env: dict[str, str]) -> None:
    src = str(shared / "bindsrc")
    try:
        policy = Policy(env=policy_env, binds=(Bind(src, dest),), hostname=hostname or "h")
        r = Run(RunRequest(["true", *args], cwd=cwd, env=env, workspace=str(shared)), policy=policy)
    except PolicyError:
        return
    argv = build_argv(policy, host_facts(), workspace=str(shared), fds=CHILD_FDS, extra_env=env or None)
    assert _bwrap_reads(argv) == argv  # every element arrives as exactly one argument
    opts = _options(argv)
    assert [o for o in opts if o[0] == "--chdir"] == [("--chdir", "/")]
    assert r.cwd == validate.sandbox_cwd(cwd)
    for k, v in {**policy_env, **env}.items():
        assert ("--setenv", k, v) in opts
    bind = policy.binds[0]
    assert bind.dest == os.path.normpath(dest or src)
    assert ("--ro-bind", src, bind.dest) in opts
    assert ("--hostname", hostname or "h") in opts
    ref = _options(build_argv(Policy(binds=(Bind(src, dest),), hostname=hostname or "h"), host_facts(),
                              workspace=str(shared), fds=CHILD_FDS))
    extra = [o for o in opts if o[0] not in ("--chdir", "--setenv", "--clearenv") and o not in ref]
    assert extra == [], extra
    assert r.command == ["true", *args]


# --- real level ------------------------------------------------------------------------------------
# Values that are valid (no NUL, encodable, names that are names), so that every example runs: the
# point is what the program gets. NASTY values are refused before anything starts (above, and in
# tests/integration/test_nul_injection.py).

_VALID_CHARS = st.one_of(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
                         st.sampled_from(["-", "=", "/", "\n", " ", "\udcff", "\udc80", "é", "'", "$", "*"]))
VALIDISH = st.one_of(st.text(alphabet=_VALID_CHARS, max_size=12),
                     st.lists(_TOKENS, min_size=1, max_size=4).map(" ".join), _TOKENS)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
    lambda k: not k.upper().startswith(("PYTHON", "LD_")))
SUBDIR = VALIDISH.filter(lambda n: "/" not in n and n not in ("", ".", "..") and len(os.fsencode(n)) <= 255)
NO_SURROGATES = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)


def _expect(view: dict[str, Any], args: list[str], env: dict[str, str], cwd: str) -> None:
    assert view["argv"] == [os.fsencode(a).hex() for a in args]
    for k, v in env.items():
        assert view["env"].get(os.fsencode(k).hex()) == os.fsencode(v).hex(), k
    assert bytes.fromhex(view["cwd"]) == os.fsencode(cwd)


def _ends_with_command(argv: list[str], command: list[str]) -> None:
    """bwrap's real argv ends with ``--`` and the command, unchanged."""
    assert argv[-len(command):] == command and argv[-len(command) - 1] == "--", argv[-len(command) - 2:]


def _workspace_with(shared: Path, subdir: str) -> Path:
    ws = Path(tempfile.mkdtemp(dir=shared / "ws"))
    os.chmod(ws, 0o755)
    (ws / subdir).mkdir(mode=0o755)
    return ws


@settings(max_examples=12, **SETTINGS)
@given(args=st.lists(VALIDISH, max_size=3), env=st.dictionaries(NAMES, VALIDISH, max_size=2), subdir=SUBDIR)
def test_run_gives_the_program_exactly_its_argv_env_cwd(shared: Path, args: list[str], env: dict[str, str],
                                                         subdir: str) -> None:
    ws = _workspace_with(shared, subdir)
    cwd = f"{WORKSPACE_DEST}/{subdir}"
    try:
        r = lowlevel.run([PY, "-c", PROG, *args], env=env, cwd=cwd, workspace=str(ws), timeout=30)
        assert r.exit_code == 0, r.stderr
        _expect(json.loads(r.stdout), args, env, cwd)
        _ends_with_command(list(r.argv), [PY, "-c", PROG, *args])
        argv = list(r.argv)
        guard = next(i for i in range(len(argv) - 2) if argv[i] == "--" and argv[i + 1].startswith("/proc/self/fd/")
                     and argv[i + 2].startswith("--fd="))  # bwrap's "--", then the guard's argv
        opts = _options(argv[:guard])
        assert ("--chdir", "/") in opts and f"--cwd={cwd}" in r.argv
        assert all(("--setenv", k, v) in opts for k, v in env.items())
    finally:
        shutil.rmtree(ws, ignore_errors=True)


@pytest.fixture(scope="module")
def session(shared: Path) -> Iterator[Any]:
    s = lowlevel.Session(workspace_base=str(shared / "ws"))
    yield s
    s.close()


@settings(max_examples=20, **SETTINGS)
@given(args=st.lists(VALIDISH, max_size=3), env=st.dictionaries(NAMES, VALIDISH, max_size=2), subdir=SUBDIR)
def test_session_run_gives_the_program_exactly_its_argv_env_cwd(session: Any, args: list[str], env: dict[str, str],
                                                                 subdir: str) -> None:
    host = Path(session.workspace) / subdir
    host.mkdir(exist_ok=True)
    os.chmod(host, 0o777)
    cwd = f"{WORKSPACE_DEST}/{subdir}"
    r = session.run([PY, "-c", PROG, *args], env=env, cwd=cwd, timeout=30)
    assert r.exit_code == 0, r.stderr
    _expect(json.loads(r.stdout), args, env, cwd)
    assert session.alive


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as exit_:  # argparse's usage error
            rc = int(exit_.code or 0)
    return rc, out.getvalue(), err.getvalue()


@settings(max_examples=12, **SETTINGS)
@given(args=st.lists(st.one_of(VALIDISH, NASTY), max_size=3),
       env=st.dictionaries(st.one_of(NAMES, NAMES, NASTY), st.one_of(VALIDISH, VALIDISH, NASTY), max_size=2))
def test_cli_json_argv_is_exactly_the_command(shared: Path, args: list[str], env: dict[str, str]) -> None:
    os.environ["LOWLEVEL_WORKSPACE_BASE"] = str(shared / "ws")
    try:
        cmd = ["run", "--json", "--rm", *[x for k, v in env.items() for x in ("--env", f"{k}={v}")], "--", PY,
               "-c", PROG, *args]
        rc, out, err = _main(cmd)
    finally:
        del os.environ["LOWLEVEL_WORKSPACE_BASE"]
    assert "Traceback" not in err
    bad = any("\0" in x for x in [*args, *env, *env.values()]) or not all(_encodable(x) for x in [*args, *env.values()])
    if rc != 0:
        # 125: refused (one line); 2: argparse took an --env value starting with '-' for an option
        assert rc in (2, 125) and err.startswith(("lowlevel:", "usage:")), (rc, err)
        assert bad or rc == 2 or any(k not in NAME_OK for k in env), (rc, err)
        return
    assert not bad
    doc = json.loads(out)
    argv = [name_from_json(a) for a in doc["argv"]]
    _ends_with_command(argv, [PY, "-c", PROG, *args])
    _expect(json.loads(doc["stdout"]), args, env, WORKSPACE_DEST)


class _NameOk:
    def __contains__(self, key: object) -> bool:
        import re
        return isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) is not None


NAME_OK = _NameOk()


def _encodable(text: str) -> bool:
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=12, **SETTINGS)
@given(args=st.lists(VALIDISH, max_size=3), env=st.dictionaries(NAMES, VALIDISH, max_size=2), stdin=NO_SURROGATES,
       nasty=NASTY)
def test_mcp_run_gives_the_program_exactly_its_argv_env(shared: Path, args: list[str], env: dict[str, str],
                                                         stdin: str, nasty: str) -> None:
    from lowlevel.mcp_server import ServerConfig, Tools
    tools = Tools(ServerConfig(workspace_base=str(shared / "mcp"), max_output_bytes=1 << 20))
    try:
        if "\0" in nasty or not _encodable(nasty):
            for kwargs in ({"command": [PY, nasty]}, {"command": [PY], "env": {"A": nasty}},
                           {"command": [PY], "env": {nasty: "1"}}):
                with pytest.raises(PolicyError):
                    tools.run(**kwargs)  # type: ignore[arg-type]
        r = tools.run([PY, "-c", PROG, *args], env=env, stdin=stdin)
    finally:
        tools.close()
    assert r["exit_code"] == 0, r
    _expect(json.loads(r["stdout"]), [name_from_json(a) for a in args], env, WORKSPACE_DEST)


@pytest.fixture(scope="module")
def honest_record(shared: Path) -> dict[str, Any]:
    rec = shared / "honest.json"
    inputs = shared / "in"
    inputs.mkdir(mode=0o755)
    (inputs / "x.txt").write_text("x")
    r = lowlevel.run([PY, "-c", PROG], inputs=[inputs], record=str(rec), workspace_base=str(shared / "ws"))
    assert r.exit_code == 0, r.stderr
    return json.loads(rec.read_text())


@settings(max_examples=12, **SETTINGS)
@given(args=st.lists(st.one_of(VALIDISH, VALIDISH, NASTY), max_size=3),
       env=st.dictionaries(NAMES, st.one_of(VALIDISH, VALIDISH, NASTY), max_size=2), subdir=SUBDIR)
def test_replayed_record_runs_exactly_its_fields(shared: Path, honest_record: dict[str, Any], args: list[str],
                                                 env: dict[str, str], subdir: str) -> None:
    from lowlevel.spec.report import json_safe
    doc = copy.deepcopy(honest_record)
    cwd = f"{WORKSPACE_DEST}/{subdir}"
    doc["command"] = json_safe([PY, "-c", PROG, *args])
    doc["env"] = json_safe(env)
    doc["cwd"] = json_safe(cwd)
    doc["workspace"]["before"].append(json_safe({"path": subdir, "kind": "dir", "mode": 0o755, "size": 0,
                                                 "sha256": None, "link": None, "stored": False, "skipped": None}))
    doc["workspace"]["before"].sort(key=lambda e: json.dumps(e["path"]))
    rec = shared / "prop.json"
    rec.write_text(json.dumps(doc))
    bad = any("\0" in x or not _encodable(x) for x in [*args, *env.values()])
    try:
        report = replay(rec, workspace_base=str(shared / "ws"))
    except RecordError as err:
        assert bad, err
        assert "\n" not in str(err), err
        return
    assert not bad
    assert report.result is not None and report.result.exit_code == 0, report.result
    argv = [name_from_json(a) for a in report.record["bwrap_argv"]]
    _ends_with_command(argv, [PY, "-c", PROG, *args])
    _expect(json.loads(report.result.stdout), args, env, cwd)
