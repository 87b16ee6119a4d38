"""Inspect's injected agent tools (``bash_session()``, ``text_editor()``) in a real ``inspect eval``
on ``sandbox="lowlevel"``, as root and as an unprivileged user, and the config switches evals
use (``landlock``, ``[egress]``) with the attack each one is about.

The eval itself is ``tests/helpers/inspect_tools_eval.py`` (a mockllm model that calls the
tools), run in a subprocess so the same script runs as root and through ``runuser`` as the
``lowlevel-test`` user. Probes: a bash_session command reading a secret by its host path is
blocked (the control reads it on the host), and the tools run as the sandbox's unprivileged
uid (never 0). Where the tools cannot work (a bind under ``/var``, a rootfs), the eval fails with
the provider's one-line refusal naming the tools.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from helpers.identities import last_json_line, planted_key, runuser, user_env

pytest.importorskip("inspect_ai", reason="the Inspect extra is not installed (pip install '.[inspect]' in the lowlevel checkout)")

from lowlevel import Egress, PolicyError# noqa: E402
from lowlevel.integrations.inspect_sandbox import (LowlevelSandboxConfig, LowlevelSandboxEnvironment,  # noqa: E402
                                                   load_config)

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]
HELPER = Path(__file__).resolve().parents[1] / "helpers" / "inspect_tools_eval.py"
ROOT = Path(__file__).resolve().parents[2]


def _eval(spec: dict[str, Any], user: Any | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(runuser(user, [sys.executable, str(HELPER)]), input=json.dumps(spec), capture_output=True,
                          text=True, timeout=280, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json_line(proc)


def _check_tools(out: dict[str, Any], secret: str) -> None:
    assert out["status"] == "success", out
    assert out["tool_errors"] == [], out
    created, viewed, first, state, attack = out["results"]
    assert created == "File created successfully at: /workspace/hello.txt"
    assert "hi from editor" in viewed
    assert "hi from editor" in first  # bash_session sees what text_editor wrote
    words = state.split()
    assert words[:3] == ["state", "kept", "/tmp"], state  # one shell across calls: env and cwd kept
    assert words[3] == "uid" and int(words[4]) != 0, state  # the sandbox's unprivileged uid
    assert "blocked-read" in attack and secret not in attack, attack


@pytest.mark.slow
def test_bash_session_and_text_editor_in_a_real_eval_as_root(tmp_path: Path, planted_secret: Any) -> None:
    assert planted_secret.key_path.read_text().count(planted_secret.secret) == 1  # control: readable on the host
    out = _eval({"log_dir": str(tmp_path / "logs"), "secret_path": str(planted_secret.key_path), "config": None})
    _check_tools(out, planted_secret.secret)


@pytest.mark.slow
@pytest.mark.root
def test_bash_session_and_text_editor_in_a_real_eval_as_unprivileged_user(test_user: Any) -> None:
    with planted_key(test_user, "ll-inspect-tools-") as (key, secret):
        logs = key.parent / "logs"
        logs.mkdir()
        os.chown(logs, test_user.pw_uid, test_user.pw_gid)
        env = user_env(test_user, PYTHONPATH=os.environ.get("PYTHONPATH", str(ROOT)))
        control = subprocess.run(runuser(test_user, ["cat", str(key)]), capture_output=True, text=True, env=env,
                                 cwd="/")
        assert control.stdout == secret  # the user can read it on the host
        out = _eval({"log_dir": str(logs), "secret_path": str(key), "config": None}, user=test_user, env=env)
        _check_tools(out, secret)


def test_tools_refused_with_a_one_line_reason_when_var_is_bound(tmp_path: Path) -> None:
    data = Path(tempfile.mkdtemp(prefix="ll-inspect-var-", dir="/tmp"))  # reachable by the per-run uid
    data.chmod(0o755)
    config = tmp_path / "lowlevel.toml"
    config.write_text(f'[[binds]]\nsource = "{data}"\ndest = "/var/lib/data"\n')
    out = _eval({"log_dir": str(tmp_path / "logs"), "secret_path": "/nonexistent", "config": str(config)})
    assert out["status"] == "error", out
    assert "cannot host Inspect's sandbox tools (bash_session(), text_editor())" in out["error"], out
    assert "/var/lib/data" in out["error"], out
    shutil.rmtree(data)


def _exec(config: LowlevelSandboxConfig | None, cmd: list[str]) -> Any:
    async def main() -> Any:
        envs = await LowlevelSandboxEnvironment.sample_init("t", config, {})
        try:
            return await envs["default"].exec(cmd, timeout=60)
        finally:
            await LowlevelSandboxEnvironment.sample_cleanup("t", config, envs, False)

    return asyncio.run(main())


BIND_LOOPBACK = ["python3", "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
                 "print('bound', s.getsockname()[1])"]


def test_landlock_switch_lets_a_test_suite_bind_loopback() -> None:
    refused = _exec(None, BIND_LOOPBACK)  # the default: Landlock refuses every TCP bind
    assert refused.returncode != 0 and "PermissionError" in refused.stderr, refused
    allowed = _exec(LowlevelSandboxConfig(landlock=False), BIND_LOOPBACK)
    assert allowed.success and allowed.stdout.startswith("bound "), allowed


def test_egress_table_is_the_policy_network(tmp_path: Path) -> None:
    config = tmp_path / "lowlevel.toml"
    config.write_text('landlock = "require"\n[egress]\nallow = ["pypi.org"]\nallow_ports = [443]\n')
    cfg = load_config(str(config))
    assert cfg.policy.network == Egress(allow=("pypi.org",), allow_ports=(443,))
    assert cfg.policy.landlock == "require"
    model = LowlevelSandboxConfig(egress={"allow": ["pypi.org"], "allow_ports": [443]})
    assert model.sandbox_config().policy.network == cfg.policy.network
    # Inside: the proxy variables are set, and nothing but the proxy is reachable.
    out = _exec(model, ["sh", "-c", "echo $HTTPS_PROXY"])
    assert out.success and out.stdout.strip(), out


@pytest.mark.parametrize("text, message", [
    ('network = true\n[egress]\nallow = ["pypi.org"]\n', "contradict each other"),
    ('[egress]\nalow = ["pypi.org"]\n', "unknown egress keys ['alow']"),
    ('network = "egress"\n', "for an allowlist use an [egress] table"),
    ('landlock = "maybe"\n', "Policy.landlock must be True, False or 'require'"),
    ('rootfs = "/nonexistent-rootfs"\n', "/nonexistent-rootfs"),
])
def test_bad_config_is_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "lowlevel.toml"
    config.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_config(str(config))
    assert message in str(info.value) and str(config) in str(info.value) and "\n" not in str(info.value)


def test_tools_refused_with_a_one_line_reason_on_a_rootfs(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    import imagekit

    imagekit.need_tools()
    work = imagekit.public_tmpdir("ll-inspect-rootfs-")
    try:
        tree = imagekit.busybox_tree(work / "tree")
        # The rootfs key works: the sample's commands see the tree, not the host's system.
        seen = _exec(LowlevelSandboxConfig(rootfs=str(tree)), ["cat", "/app/hello.txt"])
        assert seen.success and seen.stdout == "hello from the image\n", seen
        assert not Path("/app/hello.txt").exists()  # control: the host has no such file
        config = tmp_path / "lowlevel.toml"
        config.write_text(f'rootfs = "{tree}"\n')
        out = _eval({"log_dir": str(tmp_path / "logs"), "secret_path": "/nonexistent", "config": str(config)})
        assert out["status"] == "error", out
        assert "cannot host Inspect's sandbox tools (bash_session(), text_editor()" in out["error"], out
        assert "kali_version" not in out["error"], out
    finally:
        shutil.rmtree(work)


def test_a_squatted_var_directory_is_replaced_not_bound() -> None:
    base = Path(tempfile.mkdtemp(prefix="ll-inspect-base-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / ".inspect-var").symlink_to("/root")  # planted: would bind /root at /var
        config = LowlevelSandboxConfig(workspace_base=str(base))
        out = _exec(config, ["sh", "-c", "ls -A /var; readlink /var/tmp; ls -ld /var/tmp/"])
        assert out.success, out
        listing, target, tmp = out.stdout.splitlines()
        assert (listing, target) == ("tmp", "/tmp"), out.stdout  # only the symlink, never /root's entries
        assert (base / ".inspect-var").is_dir() and not (base / ".inspect-var").is_symlink()
        assert set(os.listdir("/root")) != {"tmp"}  # control: the planted target would list otherwise
    finally:
        shutil.rmtree(base)


CLI_TASK = '''
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import Generate, TaskState, solver
from inspect_ai.tool import bash_session, text_editor


@solver
def use_agent_tools():
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        editor, shell = text_editor(), bash_session()
        await editor(command="create", path="/workspace/answer.txt", file_text="forty-two\\n")
        out = await shell(action="type_submit", input="cat /workspace/answer.txt; id -u")
        state.output.completion = str(out)
        return state
    return solve


@task
def tools_task():
    return Task(dataset=[Sample(input="go", target="forty-two")], solver=use_agent_tools(), scorer=includes(),
                sandbox="lowlevel")
'''


@pytest.mark.slow
def test_inspect_eval_cli_runs_the_tools(tmp_path: Path) -> None:
    """The ``inspect eval`` command itself (the provider found through the entry point)."""
    from inspect_ai.log import read_eval_log

    (tmp_path / "tools_task.py").write_text(CLI_TASK)
    inspect_cli = Path(sys.executable).with_name("inspect")
    proc = subprocess.run([str(inspect_cli), "eval", "tools_task.py", "--model", "mockllm/model", "--log-dir",
                           str(tmp_path / "logs"), "--display", "none"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (log_file,) = (tmp_path / "logs").glob("*.eval")
    log = read_eval_log(str(log_file))
    assert log.status == "success" and log.samples, log.error
    completion = log.samples[0].output.completion
    assert "forty-two" in completion, completion
    uid = [ln for ln in completion.splitlines() if ln.strip().isdigit()]
    assert uid and int(uid[-1]) != 0, completion  # the tools ran as the sandbox's unprivileged uid
    assert log.results is not None and log.results.scores[0].metrics["accuracy"].value == 1.0
