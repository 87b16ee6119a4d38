"""Issue 10 item 1: option injection into bwrap's argv through a NUL byte.

bwrap reads its options NUL-separated from the ``--args`` memfd, so a NUL inside any value
that lands there (cwd, env, bind paths, hostname...) splits it into extra options:
``cwd="/workspace\\0--bind\\0/\\0/tmp/host\\0--share-net"`` bound the host's root into the
sandbox and shared the host network. Each test tries the escape against a temp dir it made and
shows the run refused with PolicyError before anything starts; the control shows the sandbox
can write into that dir when it is bound on purpose.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import lowlevel
from lowlevel.sandbox import argv as _argv
from lowlevel.errors import LaunchError, PolicyError

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(120)]


@pytest.fixture
def target() -> Iterator[Path]:
    """A host dir any uid may write into: what the injected --bind would expose."""
    path = Path(tempfile.mkdtemp(prefix="lowlevel-nul-target-"))
    os.chmod(path, 0o777)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def _escape(target: Path) -> str:
    return f"/workspace\0--bind\0{target}\0/tmp/host\0--share-net"


def test_cwd_nul_injection_refused(sandbox, target: Path) -> None:
    out = sandbox.run(["sh", "-c", "touch /tmp/host/ESCAPED; echo ran"], cwd=_escape(target))
    assert out.error == "PolicyError", (out.exit_code, out.out, out.err)
    assert "NUL" in out.message
    assert not (target / "ESCAPED").exists(), "the injected --bind reached the host"


def test_cwd_control_bind_writes(sandbox, target: Path) -> None:
    """Control: the same command with the directory bound on purpose does write there."""
    out = sandbox.run(["sh", "-c", "touch /tmp/host/ESCAPED"], binds=[(str(target), "/tmp/host", True)])
    assert out.exit_code == 0, out.err
    assert (target / "ESCAPED").exists()


@pytest.mark.parametrize("field", ["env_value", "env_key", "command", "workspace_base"])
def test_other_fields_nul_refused(field: str, target: Path, tmp_path: Path) -> None:
    inj = f"x\0--bind\0{target}\0/tmp/host"
    kwargs: dict = {}
    command = ["sh", "-c", "touch /tmp/host/ESCAPED"]
    if field == "env_value":
        kwargs["env"] = {"A": inj}
    elif field == "env_key":
        kwargs["env"] = {inj: "1"}
    elif field == "command":
        command = [*command, inj]
    elif field == "workspace_base":
        kwargs["workspace_base"] = str(tmp_path) + "/" + inj
    with pytest.raises(PolicyError, match="NUL"):
        lowlevel.run(command, **kwargs)
    assert not (target / "ESCAPED").exists()


def test_cwd_nul_refused_in_session(target: Path) -> None:
    with lowlevel.Session() as s:
        with pytest.raises(PolicyError):
            s.run(["sh", "-c", "touch /tmp/host/ESCAPED"], cwd=_escape(target))
        with pytest.raises(PolicyError):
            s.run(["true"], env={"A": "1\0B=2"})
        assert s.run(["true"]).exit_code == 0  # still usable
    shutil.rmtree(s.workspace)
    assert not (target / "ESCAPED").exists()


def test_argv_builder_refuses_nul_last_line() -> None:
    """The last line: whatever slipped past validation, no NUL reaches the --args memfd."""
    with pytest.raises(LaunchError, match="NUL"):
        _argv.encode_args(["--unshare-all", "--chdir", "/workspace\0--share-net"])
    assert _argv.encode_args(["--chdir", "/workspace"]) == b"--chdir\0/workspace\0"


def test_arun_and_pool_refuse_nul(target: Path) -> None:
    import asyncio
    with pytest.raises(PolicyError, match="NUL"):
        asyncio.run(lowlevel.arun(["sh", "-c", "touch /tmp/host/ESCAPED"], cwd=_escape(target)))
    with lowlevel.Pool(size=1) as pool:
        with pytest.raises(PolicyError, match="NUL"):
            pool.run(["sh", "-c", "touch /tmp/host/ESCAPED"], cwd=_escape(target))
        with pytest.raises(PolicyError, match="NUL"):
            pool.run(["true"], inputs=[f"{target}\0x"])
        assert pool.run(["true"]).exit_code == 0
    assert not (target / "ESCAPED").exists()
