"""The one-line causes of issue 25 item 2, on given inputs (the sandboxed halves are in
tests/integration/test_full_workspace.py and tests/integrations/test_full_workspace_integrations.py)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from lowlevel import Egress, Policy, PolicyError, Result
from lowlevel.integrations import _files
from lowlevel.integrations._config import SandboxConfig
from lowlevel.sandbox.failures import network_denial_note, pids_note

PY_CONNECT = (b"Traceback (most recent call last):\n  File \"<string>\", line 2, in <module>\n"
              b"    sock.connect(sa)\nPermissionError: [Errno 13] Permission denied\n")


@pytest.mark.parametrize("stderr", [
    PY_CONNECT,
    b"Error: connect EACCES 1.1.1.1:443\n    at TCPConnectWrap.afterConnect\n",       # node
    b"nc: connect to 10.0.0.1 port 80 (tcp) failed: Permission denied\n",           # netcat
])
def test_a_refused_connect_names_the_policy(stderr: bytes) -> None:
    note = network_denial_note(Policy(), 7, 1, stderr)
    assert note is not None and "network=False" in note and "--allow-host" in note
    egress = network_denial_note(Policy(network=Egress(allow=("pypi.org",))), 7, 1, stderr)
    assert egress is not None and "network=Egress" in egress and "HTTPS_PROXY" in egress


@pytest.mark.parametrize(("policy", "abi", "code", "stderr"), [
    (Policy(network=True), 7, 1, PY_CONNECT),                                          # the host's network
    (Policy(), 3, 1, PY_CONNECT),                                                      # no Landlock TCP rules
    (Policy(), None, 1, PY_CONNECT),                                                   # no Landlock
    (Policy(), 7, 0, PY_CONNECT),                                                      # the program succeeded
    (Policy(), 7, 1, b"PermissionError: [Errno 13] Permission denied: '/etc/shadow'\n"),  # a file
    (Policy(), 7, 1, b"cat: /root/x: Permission denied\n"),
])
def test_control_no_network_note_without_a_refused_connect(policy: Policy, abi: int | None, code: int,
                                                           stderr: bytes) -> None:
    assert network_denial_note(policy, abi, code, stderr) is None


def test_pids_note_says_what_the_program_did() -> None:
    own = pids_note(8, 2, None)
    assert "pids.max=8" in own and "exited with status 2 on its own" in own and "killed_by is None" in own
    assert "died by signal 6" in pids_note(8, 134, 6)


def test_a_missing_bind_in_the_toml_names_the_file_and_the_entry(tmp_path: Path) -> None:
    good = tmp_path / "data"
    good.mkdir()
    toml = tmp_path / "sandbox.toml"
    toml.write_text(f'[[binds]]\nsource = "{good}"\ndest = "/opt/data"\n\n'
                    '[[binds]]\nsource = "/nonexistent/lowlevel/x"\ndest = "/opt/x"\n')
    with pytest.raises(PolicyError) as info:
        SandboxConfig.from_toml(toml)
    msg = str(info.value)
    assert msg.startswith(f"{toml}: binds[1]: ") and "/nonexistent/lowlevel/x" in msg and "\n" not in msg, msg
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(PolicyError, match=r"^where: binds\[0\]: .*does not exist"):
        SandboxConfig.from_mapping({"binds": ["/nonexistent/lowlevel/y"]}, where="where")


def test_a_file_operation_killed_by_memory_is_enomem_not_enolck() -> None:
    note = "the memory cgroup's OOM killer killed a process of the session (memory_bytes=268435456, ...)"
    killed = Result(exit_code=137, term_signal=9, killed_by="memory", notes=("other", note))
    err = _files._error(killed, "/workspace/big.bin", "write_file")
    assert err.errno == errno.ENOMEM and "killed by the memory limit" in str(err) and note in str(err)
    # Control: the helper's own 100 + errno codes still map (ENOSPC = 128 - 100).
    assert _files._error(Result(exit_code=100 + errno.ENOSPC), "/workspace/x", "write_file").errno == errno.ENOSPC
