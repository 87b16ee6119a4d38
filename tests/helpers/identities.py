"""The caller identities the tests take, and the boilerplate of running something as one, in
one place (issue 26: the same fixtures were written in many modules).

The ``who`` fixture (tests/conftest.py) is None for the suite's own uid (root in CI, or the
user running it) and the unprivileged test user's passwd entry otherwise. Here:

- :func:`owned_tmpdir` and :func:`tmpdir_fixture`: the per-test directories (a workspace base,
  a scratch dir) a module's ``base``/``scratch`` fixture hands its tests;
- :func:`runuser` and :func:`setpriv`: a command line run as another user (runuser(1) forks
  and waits; setpriv(1) execs, so no process sits in between to take a signal);
- :func:`user_env`, :func:`planted_key` and :func:`last_json_line`: the unprivileged runs of
  the framework adapters' tests (tests/integrations): the environment, the caller's secret
  the sandbox must not read, the JSON line a driver script prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"


def owned_tmpdir(who: pwd.struct_passwd | None, prefix: str, mode: int = 0o755) -> Path:
    """A fresh directory under the temp dir with ``mode``, owned by ``who`` (None: by the caller)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, mode)
    if who is not None:
        os.chown(path, who.pw_uid, who.pw_gid)
    return path


def tmpdir_fixture(prefix: str, *, mode: int = 0o711, owned: bool = False, name: str = "base") -> Any:
    """A function-scoped fixture ``name`` yielding :func:`owned_tmpdir` (removed afterwards).

    ``mode``: 0o711 lets a root caller's sandbox (another uid) pass through to its workspaces,
    0o755 lets it list them too; ``owned``: the directory belongs to the test's ``who`` (lowlevel
    refuses a workspace base of another uid), and the fixture then depends on ``who``. Use as
    ``base = tmpdir_fixture("lowlevel-x-")`` at a test module's top level."""
    if owned:
        def owned_dir(who: pwd.struct_passwd | None) -> Iterator[Path]:
            path = owned_tmpdir(who, prefix, mode)
            yield path
            shutil.rmtree(path, ignore_errors=True)
        return pytest.fixture(name=name)(owned_dir)

    def own_dir() -> Iterator[Path]:
        path = owned_tmpdir(None, prefix, mode)
        yield path
        shutil.rmtree(path, ignore_errors=True)
    return pytest.fixture(name=name)(own_dir)


def runuser(user: pwd.struct_passwd | None, argv: list[str]) -> list[str]:
    """``argv`` run as ``user`` through runuser(1) (None: as it is)."""
    return argv if user is None else [RUNUSER, "-u", user.pw_name, "--", *argv]


def identity_prefix(identity: str, request: pytest.FixtureRequest, own: str) -> list[str]:
    """The runuser(1) prefix of a test parametrized over ``identity`` (``"root"`` or
    ``"user"``), with ``own`` (a directory) given to the unprivileged test user for ``"user"``;
    skips where the identity cannot be taken (not root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch users" if identity == "user" else "needs root")
    if identity == "root":
        return []
    user = request.getfixturevalue("test_user")
    os.chown(own, user.pw_uid, user.pw_gid)
    return [RUNUSER, "-u", user.pw_name, "--"]


def setpriv(who: pwd.struct_passwd | None, argv: list[str]) -> list[str]:
    """``argv`` run as ``who`` through setpriv(1), which execs (None: as it is)."""
    if who is None:
        return argv
    return [SETPRIV, f"--reuid={who.pw_uid}", f"--regid={who.pw_gid}", "--init-groups", "--", *argv]


def user_env(user: pwd.struct_passwd, **more: str) -> dict[str, str]:
    """The whole environment of a command run as ``user``: PATH, HOME, LANG, then ``more``."""
    return {"PATH": "/usr/bin:/bin", "HOME": user.pw_dir, "LANG": "C.UTF-8", **more}


@contextlib.contextmanager
def planted_key(owner: pwd.struct_passwd | None, prefix: str) -> Iterator[tuple[Path, str]]:
    """``(key, secret)``: ``/tmp/PREFIX*/id_ed25519`` (its directory 0755) holding a fresh
    ``SECRET-...``, mode 0600, owned by ``owner`` (None: the caller); the directory is removed
    afterwards. What a caller can read on the host and its sandbox must not."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        base.chmod(0o755)
        secret = "SECRET-" + secrets.token_hex(8)
        key = base / "id_ed25519"
        key.write_text(secret)
        if owner is not None:
            os.chown(key, owner.pw_uid, owner.pw_gid)
        key.chmod(0o600)
        yield key, secret
    finally:
        shutil.rmtree(base, ignore_errors=True)


def last_json_line(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON object a driver script printed last (after whatever its libraries logged)."""
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def scenario_as(user: pwd.struct_passwd, script: Path, *args: str, timeout: float = 240) -> dict[str, Any]:
    """What scenario ``script`` (a tests/helpers module run as a program: ``script NAME ARGS...``,
    printing one JSON object) observed when run as ``user`` through runuser(1), with this
    checkout on PYTHONPATH and ``LOWLEVEL_NO_OVERLAY`` passed through; asserts it exited 0."""
    repo = str(Path(__file__).resolve().parent.parent.parent)
    keep = {k: v for k, v in os.environ.items() if k == "LOWLEVEL_NO_OVERLAY"}
    proc = subprocess.run(runuser(user, [sys.executable, str(script), *args]), capture_output=True,
                          timeout=timeout, cwd="/", env=user_env(user, PYTHONPATH=repo, **keep))
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return dict(json.loads(proc.stdout))
