"""A program must not plant lowlevel's cache: the caller's code objects and seccomp filters.

lowlevel loads ``dataclass-code.marshal`` (code objects, :mod:`lowlevel._dataclass`) and cached
seccomp filters (:mod:`lowlevel.host.hostcache`) from its cache directory, trusting any file of the
caller's uid in a 0700 directory of theirs. A commit writes the program's files into the workspace
as exactly that. Found by the red team (issue 27): with ``LOWLEVEL_CACHE_DIR`` inside the
workspace, a program wrote ``.cache/dataclass-code.marshal``, the commit made it the caller's, and
the caller's next ``import lowlevel`` ran its code outside the sandbox.

- attack: the same run is now refused (WorkspaceError naming the cache directory) and the next
  import runs no planted code; a writable Bind of a directory holding the cache is a PolicyError;
- control: the planted file put in the cache directory by the caller itself (what the commit did)
  is loaded and its code runs: the loader trusts it, so the refusal is what protects;
- a read-only run (``commit=False``) and a cache directory outside the workspace still run.

As root and as the unprivileged test user (each in a process of its own, the cache per test).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.identities import RUNUSER

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]

# Makes a cache whose code objects, for every method text lowlevel's dataclasses generate, first
# write the marker file (argv[2]); argv[1]: a scratch cache directory to learn the texts from.
_MAKE_EVIL = """
import marshal, os, sys
os.environ["LOWLEVEL_CACHE_DIR"] = sys.argv[1]
from lowlevel import _dataclass
import lowlevel
lowlevel.Policy, lowlevel.Limits, lowlevel.Session, lowlevel.Result
payload = f"open({sys.argv[2]!r}, 'w').write('planted code ran')\\n"
evil = {k: compile(payload + k, "<string>", "exec", dont_inherit=True) for k in _dataclass._load()}
sys.stdout.buffer.write(marshal.dumps((_dataclass._header(), evil)))
"""

# The attack run: the program writes the evil cache into the workspace's .cache (stdin), then a
# fresh process imports lowlevel with the same environment.
_ATTACK = """
import json, os, subprocess, sys
import lowlevel
ws = sys.argv[1]
prog = ["sh", "-c", "mkdir -m 700 -p .cache && cat > .cache/dataclass-code.marshal && chmod 600 .cache/*"]
out = {}
try:
    r = lowlevel.run(prog, workspace=ws, stdin=open(sys.argv[2], "rb").read(), commit=sys.argv[3] == "commit")
    out["ran"] = r.exit_code
except lowlevel.LowlevelError as err:
    out["error"] = [type(err).__name__, str(err)]
try:
    lowlevel.Bind(ws, "/opt/ws", writable=True)
    out["bind"] = "made"
except lowlevel.PolicyError as err:
    out["bind"] = str(err)
try:  # the program's bytes there (the caller's own save of its cache may have made the file)
    out["planted"] = open(os.path.join(ws, ".cache", "dataclass-code.marshal"), "rb").read() == \
        open(sys.argv[2], "rb").read()
except OSError:
    out["planted"] = False
print(json.dumps(out))
"""

_IMPORT = "import lowlevel; lowlevel.Policy, lowlevel.Limits, lowlevel.Session, lowlevel.Result"


def _as(who: pwd.struct_passwd | None, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT), **env}
    if who is None:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**base, "HOME": "/root"})
    return subprocess.run([RUNUSER, "-u", who.pw_name, "--", *argv], capture_output=True, text=True, timeout=120,
                          env={**base, "HOME": who.pw_dir}, cwd="/")


@pytest.fixture(params=["root", "user"] if os.geteuid() == 0 else ["self"])
def who(request: pytest.FixtureRequest) -> pwd.struct_passwd | None:
    if request.param == "user":
        return request.getfixturevalue("test_user")  # type: ignore[no-any-return]
    return None


def _evil_bytes(who: pwd.struct_passwd | None, scratch: Path, marker: Path) -> bytes:
    base = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", _MAKE_EVIL, str(scratch), str(marker)]
    if who is not None:
        argv = [RUNUSER, "-u", who.pw_name, "--", *argv]
    made = subprocess.run(argv, capture_output=True, timeout=120, env=base, cwd="/")
    assert made.returncode == 0, made.stderr[-2000:]
    return made.stdout


@pytest.fixture
def area() -> Iterator[Path]:
    """A scratch directory both identities can reach (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="lowlevel-cache-plant-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _prepare(who: pwd.struct_passwd | None, area: Path) -> tuple[Path, Path, Path, dict[str, str]]:
    top = area / "top"
    ws, scratch = top / "ws", top / "scratch-cache"
    for p in (top, ws, scratch):
        p.mkdir(mode=0o700 if p == scratch else 0o755)
        if who is not None:
            os.chown(p, who.pw_uid, who.pw_gid)
    marker, evil = top / "MARKER", top / "evil.marshal"
    evil.write_bytes(_evil_bytes(who, scratch, marker))
    os.chmod(evil, 0o644)
    return ws, evil, marker, {"LOWLEVEL_CACHE_DIR": str(ws / ".cache")}


def test_a_program_cannot_plant_the_callers_code_cache(who: pwd.struct_passwd | None, area: Path) -> None:
    ws, evil, marker, env = _prepare(who, area)
    out = _as(who, [sys.executable, "-c", _ATTACK, str(ws), str(evil), "commit"], env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"][0] == "WorkspaceError" and "cache directory" in got["error"][1], got
    assert "LOWLEVEL_CACHE_DIR" in got["error"][1]
    assert "contains lowlevel's cache directory" in got["bind"], got
    assert not got["planted"]
    after = _as(who, [sys.executable, "-c", _IMPORT], env)
    assert after.returncode == 0, after.stderr[-2000:]
    assert not marker.exists(), "the program's code ran in the caller"


def test_control_a_planted_cache_file_is_loaded_and_runs(who: pwd.struct_passwd | None, area: Path) -> None:
    """What the commit did before the refusal: the file in the cache directory, the caller's."""
    ws, evil, marker, env = _prepare(who, area)
    cache = ws / ".cache"
    cache.mkdir(mode=0o700)
    planted = cache / "dataclass-code.marshal"
    planted.write_bytes(evil.read_bytes())
    os.chmod(planted, 0o600)
    if who is not None:
        os.chown(cache, who.pw_uid, who.pw_gid)
        os.chown(planted, who.pw_uid, who.pw_gid)
    _as(who, [sys.executable, "-c", _IMPORT], env)
    assert marker.exists(), "the control's planted code did not run: the attack test proves nothing"


def test_read_only_runs_and_a_cache_elsewhere_still_run(who: pwd.struct_passwd | None, area: Path) -> None:
    ws, evil, marker, env = _prepare(who, area)
    out = _as(who, [sys.executable, "-c", _ATTACK, str(ws), str(evil), "discard"], env)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got.get("ran") == 0 and not got["planted"], (got, out.stderr[-2000:])
    elsewhere = {"LOWLEVEL_CACHE_DIR": str(ws.parent / "cache-elsewhere")}
    out = _as(who, [sys.executable, "-c", _ATTACK, str(ws), str(evil), "commit"], elsewhere)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got.get("ran") == 0 and got["bind"] == "made" and got["planted"], (got, out.stderr[-2000:])
    after = _as(who, [sys.executable, "-c", _IMPORT], elsewhere)  # the file in ws/.cache is not the cache
    assert after.returncode == 0 and not marker.exists()
