"""Shared fixtures: the ``sandbox`` fixture runs every sandbox test twice on a root host.

``sandbox.run(command, **kw)`` has the signature of a small ``lowlevel.run``. It is
parametrized over the identities the suite can take here:

- ``root``: in-process ``lowlevel.run`` as root (the sandbox drops to uid 65534).
- ``user``: the same call executed by ``tests/helpers/run_as.py`` as an unprivileged user
  (``lowlevel-test``, created here with useradd), through ``runuser``; bwrap then maps the
  caller's own uid and no cgroup is writable (rlimits only).

Run as a non-root user, the suite has only the ``user`` identity (in-process).
"""

from __future__ import annotations

import base64
import json
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
IS_ROOT = os.geteuid() == 0


def _reach() -> tuple[list[str], str | None]:
    """As root, make this checkout and its venv reachable by the unprivileged half (a mount
    namespace of this process's own, tests/helpers/reach.py; no mode changed on disk). Returns
    the directories covered and, when that user still cannot import lowlevel, the one-line
    reason every test of that half is skipped with. First, while pytest is single-threaded."""
    if not IS_ROOT:
        return [], None
    import importlib.util

    from helpers.reach import reach_for_other_users
    paths = [str(HERE.parent), sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    spec = importlib.util.find_spec("lowlevel")  # found, not imported: the process is single-threaded still
    return reach_for_other_users(paths, spec.origin if spec else None, [str(HERE / "helpers" / "run_as.py")])


REACH_COVERED, USER_HALF_SKIP = _reach()

import lowlevel  # noqa: E402
from helpers.servers import AnsweringServer, tcp_loopback  # noqa: E402

# The suite's host-facts cache (lowlevel.host.hostcache) is its own, not the machine's: the tests
# compile many odd seccomp profiles and fake probes. Subprocesses inherit it; an unprivileged
# test user finds it not theirs and runs without a cache.
if "LOWLEVEL_CACHE_DIR" not in os.environ:
    import atexit
    import tempfile

    _cache = tempfile.mkdtemp(prefix="lowlevel-test-cache-")
    os.environ["LOWLEVEL_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)

# The run records (lowlevel.host.run_records: where each run made its cgroups) go to the suite's own
# directory, not root's /run/lowlevel/cgroups; tests of cleanup's records set their own.
if "LOWLEVEL_RECORD_DIR" not in os.environ:
    import atexit
    import tempfile

    _records = tempfile.mkdtemp(prefix="lowlevel-test-records-")  # 0700
    os.environ["LOWLEVEL_RECORD_DIR"] = _records
    atexit.register(shutil.rmtree, _records, True)

# ``lowlevel cleanup`` (and doctor's leftovers) walk no cgroup hierarchy of the host's in the suite: the
# walk for record-less run cgroups of dead callers would find (and remove) other processes' leftovers
# all over the machine. Tests of the walk name their own private roots.
os.environ.setdefault("LOWLEVEL_CGROUP_ROOTS", "")

RUN_AS = HERE / "helpers" / "run_as.py"
TEST_USER = "lowlevel-test"
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
USERADD = shutil.which("useradd") or "/usr/sbin/useradd"


def _bwrap_ok() -> str | None:
    if not shutil.which("bwrap"):
        return "bwrap is not installed (apt-get install bubblewrap)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _bwrap_ok()
    for item in items:
        if reason and "bwrap" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
        if "root" in item.keywords and not IS_ROOT:
            item.add_marker(pytest.mark.skip(reason="needs root (run the suite as root to cover it)"))


#: The reasons the unprivileged half was skipped with (at most one per run).
_USER_SKIPS: set[str] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Report every skip of the unprivileged half at the test_user fixture, not at each test, so
    that ``-ra`` prints its reason once (``SKIPPED [N] tests/conftest.py:LINE: reason``)."""
    outcome = yield
    rep = outcome.get_result()
    if _USER_SKIPS and rep.skipped and isinstance(rep.longrepr, tuple) and len(rep.longrepr) == 3 \
            and any(str(rep.longrepr[2]).endswith(r) for r in _USER_SKIPS):
        line = getattr(getattr(test_user, "__wrapped__", None), "__code__", None)
        rep.longrepr = (str(Path(__file__)), line.co_firstlineno if line else 0, rep.longrepr[2])


@pytest.fixture(scope="session")
def test_user() -> pwd.struct_passwd:
    """An unprivileged account for the non-root runs (created once, kept for later runs).

    Skipped, with the one reason :data:`USER_HALF_SKIP`, where that user cannot import this
    checkout's lowlevel even in the mount namespace of :func:`_reach`."""
    if not IS_ROOT:
        pytest.skip("creating the test user needs root")
    if USER_HALF_SKIP:
        _USER_SKIPS.add(USER_HALF_SKIP)
        pytest.skip(USER_HALF_SKIP)
    try:
        user = pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run([USERADD, "--create-home", "--shell", "/bin/sh", TEST_USER], check=True)
        user = pwd.getpwnam(TEST_USER)
    probe = subprocess.run([RUNUSER, "-u", user.pw_name, "--", sys.executable, "-c", "import lowlevel"],
                           capture_output=True, cwd="/")
    if probe.returncode != 0:
        last = (probe.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        reason = (f"user {user.pw_name} cannot import lowlevel from {sys.executable} ({last}), though uid 65534 "
                  "could (tests/helpers/reach.py): check the groups and ACLs of the checkout")
        _USER_SKIPS.add(reason)
        pytest.skip(reason)
    return user


@dataclass
class Outcome:
    """The fields of a Result the tests look at, the same for both identities."""

    exit_code: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    killed_by: str | None = None
    term_signal: int | None = None
    workspace: str = ""
    changes: dict[str, Any] = field(default_factory=dict)
    limits_enforced: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_time_s: float = 0.0
    error: str | None = None
    message: str = ""
    errno: int | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")


class Sandbox:
    """Runs lowlevel as one identity; see the module docstring."""

    def __init__(self, identity: str, user: pwd.struct_passwd | None, tmp: Path) -> None:
        self.identity = identity
        self.user = user
        self.tmp = tmp

    @property
    def home(self) -> str:
        """The caller's home directory (where the planted secrets go)."""
        return self.user.pw_dir if self.user else os.path.expanduser("~")

    @property
    def uid(self) -> int:
        return self.user.pw_uid if self.user else os.getuid()

    def workspace(self) -> Path:
        """A fresh empty workspace dir owned by this identity."""
        ws = Path(self._mkdtemp())
        return ws

    def _mkdtemp(self) -> str:
        import tempfile
        path = tempfile.mkdtemp(prefix=f"ws-{self.identity}-", dir="/tmp")
        os.chmod(path, 0o755)
        if self.user:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)
        return path

    def run(self, command: list[str], *, timeout: float = 30, stdin: bytes | None = None,
            env: dict[str, str] | None = None, network: bool = False,
            binds: list[tuple[Any, ...]] | None = None, limits: dict[str, Any] | None = None,
            files: dict[str, bytes] | None = None, workspace: str | None = None,
            cwd: str = "/workspace", commit: bool | str = True, egress: dict[str, Any] | None = None,
            resolver: dict[str, Any] | None = None, policy_kw: dict[str, Any] | None = None,
            extra_dirs: dict[int, str] | None = None) -> Outcome:
        """``egress``: Egress kwargs (network by allowlist); ``resolver``: the egress tests'
        TEST-ONLY resolver override ({"answers": ..., "pretend_public": [...]},
        tests/helpers/scripted_resolver.py); its lookups land in ``raw["resolver_calls"]``;
        ``policy_kw``: more Policy keyword arguments (JSON values: ``compat_32bit``, ``landlock``...);
        ``extra_dirs``: host dirs passed in as open fds ``{fd number inside (>= 9): path}``
        (helpers/run_as.py ``run_with_dir_fds``: a harness smuggling a handle in)."""
        ws = workspace or self._mkdtemp()
        if self.user is None:
            for name, data in (files or {}).items():
                Path(ws, name).write_bytes(data)
            policy = lowlevel.Policy(network=lowlevel.Egress(**egress) if egress is not None else network,
                                     env=env or {},
                                     binds=tuple(lowlevel.Bind(s, d, writable=w, allow_sockets=bool(more and more[0]))
                                                 for s, d, w, *more in binds or ()),
                                     limits=lowlevel.Limits(**(limits or {})), **(policy_kw or {}))
            import contextlib
            scripted = None
            override: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if resolver is not None:
                sys.path.insert(0, str(HERE / "helpers"))
                from scripted_resolver import ScriptedResolver, override_resolver
                scripted = ScriptedResolver(resolver["answers"])
                override = override_resolver(scripted, pretend_public=resolver.get("pretend_public", ()))
            try:
                with override:
                    if extra_dirs:
                        from helpers.run_as import run_with_dir_fds
                        r = run_with_dir_fds(command, policy=policy, workspace=ws, timeout=timeout, stdin=stdin,
                                             dirs=extra_dirs, commit=commit, cwd=cwd)
                    else:
                        r = lowlevel.run(command, policy=policy, workspace=ws, timeout=timeout, stdin=stdin, cwd=cwd,
                                         commit=commit)
            except lowlevel.LowlevelError as err:
                return Outcome(None, error=type(err).__name__, message=str(err),
                               errno=getattr(err, "errno", None), workspace=ws)
            d = r.to_json()
            if scripted is not None:
                d["resolver_calls"] = scripted.calls
            return Outcome(r.exit_code, r.stdout, r.stderr, r.timed_out, r.killed_by, r.term_signal, ws,
                           d["changes"], list(r.limits_enforced), list(r.notes), r.wall_time_s, raw=d)
        spec = {"command": command, "timeout": timeout, "env": env or {}, "network": network,
                "binds": binds or [], "limits": limits or {}, "workspace": ws, "cwd": cwd, "commit": commit,
                "egress": egress, "resolver": resolver, "policy": policy_kw or {},
                "extra_dirs": {str(k): v for k, v in (extra_dirs or {}).items()},
                "files": {k: base64.b64encode(v).decode() for k, v in (files or {}).items()},
                "stdin_b64": base64.b64encode(stdin).decode() if stdin is not None else None}
        proc = subprocess.run(
            [RUNUSER, "-u", self.user.pw_name, "--", sys.executable, str(RUN_AS)],
            input=json.dumps(spec).encode(), capture_output=True, timeout=timeout + 60,
            env={"PATH": "/usr/bin:/bin", "HOME": self.user.pw_dir, "LANG": "C.UTF-8",
                 # fake secrets planted by tests travel to the caller, as a real caller's would
                 **{k: v for k, v in os.environ.items()
                    if k.startswith("LOWLEVEL_FAKE_") or k == "LOWLEVEL_NO_OVERLAY"}}, cwd="/")
        if proc.returncode != 0:
            raise AssertionError(f"run_as.py failed as {self.user.pw_name}: {proc.stderr.decode()[-2000:]}")
        d = json.loads(proc.stdout)
        if "error" in d:
            return Outcome(None, error=d["error"], message=d["message"], errno=d.get("errno"), workspace=ws)
        return Outcome(d["exit_code"], base64.b64decode(d["stdout_b64"]), base64.b64decode(d["stderr_b64"]),
                       d["timed_out"], d["killed_by"], d["term_signal"], ws, d["changes"],
                       d["limits_enforced"], d["notes"], d["wall_time_s"], raw=d)


@pytest.fixture(params=["root", "user"] if IS_ROOT else ["self"])
def who(request: pytest.FixtureRequest) -> pwd.struct_passwd | None:
    """The CLI-level tests' caller: None for the suite's own uid, else the unprivileged test
    user's passwd entry (run the CLI through runuser/setpriv as that user). A module may
    define its own ``who`` (test_image_run.py does)."""
    if request.param == "user":
        return request.getfixturevalue("test_user")  # type: ignore[no-any-return]
    return None


def _identities() -> list[str]:
    return ["root", "user"] if IS_ROOT else ["self"]


@pytest.fixture(params=_identities())
def sandbox(request: pytest.FixtureRequest, tmp_path: Path) -> Sandbox:
    """A :class:`Sandbox` for each identity this host can test (root and unprivileged)."""
    if _bwrap_ok():
        pytest.skip(_bwrap_ok() or "")
    if request.param == "user":
        return Sandbox("user", request.getfixturevalue("test_user"), tmp_path)
    return Sandbox(request.param, None, tmp_path)


@pytest.fixture
def handover_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run with the fallback workspace model (hand-over, no copy-on-write overlay), in-process and
    for the unprivileged identity's subprocess alike; root's sandboxes as one uid (a range of
    one, :data:`HANDOVER_UID`), which these tests check by number. (It was 65534, nobody's: an
    account's uid is never leased.)"""
    monkeypatch.setenv("LOWLEVEL_NO_OVERLAY", "1")
    monkeypatch.setenv("LOWLEVEL_UID_RANGE", f"{HANDOVER_UID}-{HANDOVER_UID}")


def _free_id() -> int:
    from lowlevel.workspace.uids import DEFAULT_UID_RANGE, account_uids
    first, count = DEFAULT_UID_RANGE
    taken = account_uids(first, count)
    return next(u for u in range(first + count - 1, first, -1) if u not in taken)


#: The per-run uid (and gid) of the handover_model fixture's sandboxes: no account's or group's.
HANDOVER_UID = _free_id()


@pytest.fixture
def server() -> Iterator[AnsweringServer]:
    """A TCP server on host loopback answering b'pong' to anyone who connects (tests/helpers/servers.py)."""
    s = tcp_loopback()
    yield s
    s.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line on how the unprivileged half reached this checkout (why it was skipped is the
    one ``SKIPPED [N] tests/conftest.py`` line of ``-ra``)."""
    if REACH_COVERED and not USER_HALF_SKIP:
        terminalreporter.write_line(
            f"lowlevel: other users cannot search {', '.join(REACH_COVERED)}: the unprivileged half ran in this "
            "process's own mount namespace, where those directories are passable (tests/helpers/reach.py); "
            "no mode changed on disk")
