"""Issue 23 item 0: a copy-on-write probe that fails for a reason of the caller's (EMFILE under a
tight ``RLIMIT_NOFILE``) is never cached as a fact of the host, and a run asked to discard its
changes never writes the caller's directory, whatever workspace model it gets.

Each test uses a cache directory of its own (``LOWLEVEL_CACHE_DIR``) and a workspace on a tmpfs
the test mounts (its own ``st_dev``, so its overlay verdict is its own cache entry), as root and
as the unprivileged test user.
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

pytestmark = [pytest.mark.bwrap, pytest.mark.root, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"


@pytest.fixture
def place() -> Iterator[Path]:
    """A 0711 temp dir with ``mnt/``: a 4 MiB tmpfs (unmounted at teardown)."""
    top = Path(tempfile.mkdtemp(prefix="lowlevel-probe-faults-"))
    os.chmod(top, 0o711)
    (top / "mnt").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(top / "mnt")], check=True)
    yield top
    subprocess.run(["umount", "-l", str(top / "mnt")], capture_output=True)
    shutil.rmtree(top, ignore_errors=True)


def _user(identity: str, request: pytest.FixtureRequest) -> pwd.struct_passwd | None:
    return request.getfixturevalue("test_user") if identity == "user" else None


def _owned(path: Path, user: pwd.struct_passwd | None, mode: int = 0o755) -> Path:
    path.mkdir()
    os.chmod(path, mode)
    if user is not None:
        os.chown(path, user.pw_uid, user.pw_gid)
    return path


def _setup(place: Path, user: pwd.struct_passwd | None) -> tuple[Path, Path, Path]:
    """(workspace on the tmpfs holding ``keep``, cache dir 0700, workspace base), owned by the identity."""
    ws = _owned(place / "mnt" / "W", user)
    (ws / "keep").write_text("k\n")
    if user is not None:
        os.chown(ws / "keep", user.pw_uid, user.pw_gid)
    return ws, _owned(place / "cache", user, 0o700), _owned(place / "base", user)


def _env(cache: Path, base: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LOWLEVEL_CACHE_DIR": str(cache),
            "LOWLEVEL_WORKSPACE_BASE": str(base),
            "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)}


def _as(user: pwd.struct_passwd | None, env: dict[str, str], argv: list[str]) -> list[str]:
    if user is None:
        return argv
    return [RUNUSER, "-u", user.pw_name, "--", "env", *(f"{k}={v}" for k, v in env.items()), *argv]


def _cached_cow(cache: Path) -> list[dict[str, object]]:
    """The ``cow:`` verdicts in the cache file (empty when there is none)."""
    path = cache / "host.json"
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    return [v["value"] for k, v in doc["entries"].items() if k.startswith("cow:")]


# The probe itself, in a process of the identity's, with every fd but one taken: the workspace
# opens, the probe's pipes do not (EMFILE). Then the cache, and a probe at the normal limit.
_PROBE = r"""
import errno, json, os, resource, sys
from lowlevel.workspace import cow
from lowlevel.host import hostcache
from lowlevel.sandbox import facts as sandbox_facts
ws = sys.argv[1]
facts = sandbox_facts.host_facts()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError as err:
    assert err.errno == errno.EMFILE, err
os.close(held.pop())  # one fd left: the probe opens the workspace, then cannot make its pipes
starved = cow.cow_support(ws, lambda: sandbox_facts._probe_cow(facts, ws, None))
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
hostcache.clear_memory()
after = [v for k, v in hostcache.entries("host") if k.startswith("cow:")]
again = cow.cow_support(ws, lambda: sandbox_facts._probe_cow(facts, ws, None))
print(json.dumps({"starved": [starved.ok, starved.reason, starved.transient], "cached_after": after,
                  "again": [again.ok, again.reason, again.transient]}))
"""


@pytest.mark.parametrize("identity", ["root", "user"])
def test_emfile_probe_is_not_cached(identity: str, request: pytest.FixtureRequest, place: Path) -> None:
    user = _user(identity, request)
    ws, cache, base = _setup(place, user)
    env = _env(cache, base)
    p = subprocess.run(_as(user, env, [sys.executable, "-c", _PROBE, str(ws)]), env=env, cwd="/",
                       capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    got = json.loads(p.stdout)
    ok, reason, transient = got["starved"]
    assert not ok and transient, got  # the probe did fail, for the caller's reason
    assert "Too many open files" in reason, got
    assert got["cached_after"] == [], got  # neither on disk ...
    assert got["again"] == [True, "", False], got  # ... nor in the process: the next probe runs, and works


@pytest.mark.parametrize("identity", ["root", "user"])
def test_fd_starved_runs_leave_discard_working(identity: str, request: pytest.FixtureRequest, place: Path) -> None:
    """The issue's reproduction: CLI runs under ``prlimit --nofile=N`` for a range of N (some of
    them fail in the overlay probe), then ``--discard`` at the normal limit: the directory is
    untouched and no "no overlay" verdict is cached."""
    user = _user(identity, request)
    ws, cache, base = _setup(place, user)
    env = _env(cache, base)
    lowlevel = [sys.executable, "-m", "lowlevel"]
    warm = subprocess.run(_as(user, env, [*lowlevel, "run", "--rm", "--", "true"]), env=env, cwd="/",
                          capture_output=True, timeout=60)  # bwrap's facts cached: later runs reach the probe
    assert warm.returncode == 0, warm.stderr
    probe_failures = 0
    for n in range(13, 41):
        p = subprocess.run(_as(user, env, ["prlimit", f"--nofile={n}", *lowlevel, "run", "--workspace", str(ws),
                                           "--", "true"]), env=env, cwd="/", capture_output=True, timeout=60)
        if b"cannot check whether the copy-on-write workspace works here" in p.stderr:
            probe_failures += 1
            assert p.returncode == 125 and b"Too many open files" in p.stderr, p.stderr
        assert [v for v in _cached_cow(cache) if v.get("ok") is False] == [], (n, p.stderr, _cached_cow(cache))
    assert probe_failures, "no limit in 13..40 made the overlay probe fail: the sweep tested nothing"
    p = subprocess.run(_as(user, env, [*lowlevel, "run", "--workspace", str(ws), "--discard", "--", "sh", "-c",
                                       "rm keep; echo y > y"]), env=env, cwd="/", capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert (ws / "keep").read_text() == "k\n" and not (ws / "y").exists(), os.listdir(ws)


@pytest.mark.usefixtures("handover_model")
def test_discard_is_refused_in_the_handover_model(sandbox) -> None:  # type: ignore[no-untyped-def]
    """Where the overlay is unavailable (here: LOWLEVEL_NO_OVERLAY) the program would write the
    caller's directory itself: commit=False and commit='on_success' refuse to run. Control: the
    same program with commit=True does write it (what the refusal keeps from happening)."""
    for commit in (False, "on_success"):
        ws = sandbox.workspace()
        r = sandbox.run(["sh", "-c", "rm keep; echo y > y"], workspace=str(ws), files={"keep": b"k\n"},
                        commit=commit)
        assert r.error == "UnsupportedError", (commit, r)
        assert "needs the copy-on-write workspace" in r.message and "nothing was run" in r.message, r.message
        assert sorted(os.listdir(ws)) == ["keep"] and (ws / "keep").read_bytes() == b"k\n", commit
    ws = sandbox.workspace()
    r = sandbox.run(["sh", "-c", "rm keep; echo y > y"], workspace=str(ws), files={"keep": b"k\n"}, commit=True)
    assert r.exit_code == 0, r
    assert sorted(os.listdir(ws)) == ["y"]
    assert any(n.startswith("workspace handed over") for n in r.notes), r.notes


def test_discard_refusal_is_one_cli_line(place: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws, cache, base = _setup(place, None)
    env = {**_env(cache, base), "LOWLEVEL_NO_OVERLAY": "1"}
    p = subprocess.run([sys.executable, "-m", "lowlevel", "run", "--workspace", str(ws), "--discard", "--", "sh",
                        "-c", "rm keep; echo y > y"], env=env, cwd="/", capture_output=True, timeout=60)
    assert p.returncode == 125, p.stderr
    lines = p.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowlevel: ") and "--discard" in lines[0], lines
    assert sorted(os.listdir(ws)) == ["keep"]


def test_doctor_probes_a_cached_no_again(place: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A "no overlay" verdict in the cache (as an older lowlevel stored after an fd-starved probe)
    for a filesystem where the overlay works: doctor probes it again, says so, and rewrites it;
    the next run there gets copy-on-write (and --discard works)."""
    import lowlevel
    from lowlevel.workspace import cow
    from lowlevel import doctor
    from lowlevel.host import hostcache
    from lowlevel.sandbox import facts as sandbox_facts
    ws, cache, base = _setup(place, None)
    monkeypatch.setenv("LOWLEVEL_CACHE_DIR", str(cache))
    monkeypatch.setenv("LOWLEVEL_WORKSPACE_BASE", str(base))
    hostcache.clear_memory()
    cow.forget_cow_support()
    try:
        dev = os.stat(ws).st_dev
        mnt = cow.mount_dir(None)
        key = [dev, os.geteuid(), mnt, hostcache.file_key(sandbox_facts.EXEC_HELPER_PATH)]
        stale = {"ok": False, "reason": "[Errno 24] Too many open files", "path": str(ws), "base": None}
        hostcache.put("host", f"cow:{dev}:{mnt}", key, stale)
        assert not cow.cow_support(str(ws), lambda: sandbox_facts._probe_cow(sandbox_facts.host_facts(), str(ws), None)).ok
        checks = doctor.cached_cow_checks()
        mine = [c for c in checks if c["name"] == f"workspace on {ws}"]
        assert len(mine) == 1 and mine[0]["ok"] and "corrected" in mine[0]["detail"], checks
        hostcache.clear_memory()
        assert hostcache.get("host", f"cow:{dev}:{mnt}", key)["ok"] is True
        r = lowlevel.run(["sh", "-c", "rm keep; echo y > y"], workspace=str(ws), commit=False)
        assert r.exit_code == 0 and any(n.startswith("workspace: copy-on-write") for n in r.notes), r.notes
        assert sorted(os.listdir(ws)) == ["keep"]
    finally:
        hostcache.clear_memory()
        cow.forget_cow_support()
