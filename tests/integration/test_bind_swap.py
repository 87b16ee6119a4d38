"""A bind source swapped for a symlink between two runs of one Policy (red-team pass, issue 22).

Attack: a Policy binds ``w`` writable at ``/opt/w`` and ``w/sub`` read-only at ``/opt/sub``; run 1
replaces ``/opt/w/sub`` (that is, the host's ``w/sub``) with a symlink to a directory the Policy
would never bind (the caller's ``~/.ssh``-like secret directory); run 2 of the same Policy must
not read it: :meth:`lowlevel.Bind.check_unchanged` refuses the swapped source before bwrap runs.
Control: raw bwrap mounts what the symlink names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.bwrap
HELPER = Path(__file__).resolve().parent.parent / "helpers" / "bind_swap.py"


def _dirs(owner: tuple[int, int] | None) -> tuple[str, str]:
    scratch = tempfile.mkdtemp(prefix="bindswap-", dir="/tmp")
    secret = tempfile.mkdtemp(prefix="bindswap-secret-", dir="/tmp")
    Path(secret, "secret").write_text("FAKE-PRIVATE-KEY\n")
    for d in (scratch, secret):
        os.chmod(d, 0o755)
    os.chmod(Path(secret, "secret"), 0o644)
    if owner:
        for p in (scratch, secret, os.path.join(secret, "secret")):
            os.chown(p, *owner)
    return scratch, secret


@pytest.mark.parametrize("identity", ["root", "user"])
def test_a_swapped_bind_source_is_refused(identity: str, request: pytest.FixtureRequest) -> None:
    if identity == "root" and os.geteuid() != 0:
        pytest.skip("needs root")
    prefix: list[str] = []
    owner = None
    if identity == "user":
        if os.geteuid() != 0:
            pytest.skip("the unprivileged half runs from root")
        user = request.getfixturevalue("test_user")
        prefix, owner = ["runuser", "-u", user.pw_name, "--"], (user.pw_uid, user.pw_gid)
    scratch, secret = _dirs(owner)
    try:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LOWLEVEL_CACHE_DIR", "LOWLEVEL_RECORD_DIR")}
        if identity == "user":
            env.pop("LOWLEVEL_CACHE_DIR", None)
            env.pop("LOWLEVEL_RECORD_DIR", None)
        proc = subprocess.run([*prefix, sys.executable, str(HELPER), scratch, secret], capture_output=True,
                              timeout=120, env=env, cwd="/")
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        out = json.loads(proc.stdout)
        assert out["swap_exit"] == 0, out  # the sandbox did replace the source with a symlink
        assert Path(scratch, "w", "sub").is_symlink()
        assert "FAKE-PRIVATE-KEY" not in out.get("read", ""), out
        assert out.get("error") == "LaunchError" and "was replaced by a symlink" in out["message"], out
        # Control: bwrap itself mounts what the swapped source names now.
        ctl = subprocess.run(["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink",
                              "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--ro-bind",
                              os.path.join(scratch, "w", "sub"), "/opt/sub", "--", "/usr/bin/cat", "/opt/sub/secret"],
                             capture_output=True, timeout=30)
        assert ctl.stdout == b"FAKE-PRIVATE-KEY\n", ctl
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(secret, ignore_errors=True)
