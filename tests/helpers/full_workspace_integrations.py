"""The framework adapters with a full workspace, a memory kill and bad input; print JSON.

Used by tests/integrations/test_full_workspace_integrations.py (issue 25 items 1 and 2), as
root and as the unprivileged test user (through setpriv). argv[1]: a directory for the TOML file.
"""

import errno
import json
import os
import sys

import anyio

import lowlevel
from lowlevel.integrations.inspect_sandbox import LowlevelSandboxConfig, LowlevelSandboxEnvironment
from lowlevel.integrations.langchain_tool import LowlevelRunCommand

MiB = 1 << 20


def langchain() -> dict:
    out = {"run_missing": LowlevelRunCommand().invoke({"command": ["nosuchprog", "x"]})}
    with lowlevel.Session() as s:
        tool = LowlevelRunCommand(session=s)
        out["session_missing"] = tool.invoke({"command": ["nosuchprog", "x"]})
        out["session_fill"] = tool.invoke({"command": "head -c 1500M /dev/zero > big.bin; rc=$?; rm -f big.bin; "
                                                      "exit $rc"})
    return out


async def inspect_case(config: object, size_mib: int) -> dict:
    out: dict = {}
    envs = await LowlevelSandboxEnvironment.sample_init("full-ws", config, {})  # type: ignore[arg-type]
    env = envs["default"]
    try:
        try:
            await env.write_file("big.bin", b"\0" * (size_mib * MiB))
            out["write_file"] = {"ok": True}
        except OSError as err:
            out["write_file"] = {"errno": err.errno, "message": str(err)}
            # The killed write left a partial big.bin in RAM (tmpfs), next to the memory limit:
            # remove it first, or the dd below starts with no room, and which process the OOM
            # killer then takes (dd, or the sh that would remove the files) is a race; a sh
            # taken left the tmpfs full, and the next command's OOM took the session's init
            # (one loaded .ci/run). What this case checks is the verdicts, not that race.
            await env.exec(["rm", "-f", "big.bin"])
        r = await env.exec(["sh", "-c", f"dd if=/dev/zero of=big2.bin bs=1M count={size_mib} status=none; "
                                        "echo rc=$?; rm -f big.bin big2.bin"])
        out["dd"] = {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr[-500:]}
        r = await env.exec(["echo", "alive"])
        out["after"] = {"returncode": r.returncode, "stdout": r.stdout}
    finally:
        await LowlevelSandboxEnvironment.sample_cleanup("full-ws", config, envs, False)
    return out


async def inspect_bad_toml(path: str) -> dict:
    try:
        await LowlevelSandboxEnvironment.sample_init("full-ws", path, {})
    except lowlevel.LowlevelError as err:
        return {"error": type(err).__name__, "message": str(err), "chained": err.__cause__ is not None}
    return {"error": None}


def main() -> int:
    tmp = sys.argv[1]
    out = {"langchain": langchain()}
    out["inspect_default"] = anyio.run(inspect_case, None, 1200)
    out["inspect_small"] = anyio.run(inspect_case, LowlevelSandboxConfig(limits={"memory_bytes": "256M"}), 400)
    toml = os.path.join(tmp, "lowlevel-sandbox.toml")
    with open(toml, "w") as f:
        f.write('[limits]\ncpu_s = 30\n\n[[binds]]\nsource = "/nonexistent/data/dir"\n')
    out["inspect_bad_toml"] = anyio.run(inspect_bad_toml, toml)
    out["toml"] = toml
    out["ENOSPC"], out["ENOMEM"] = errno.ENOSPC, errno.ENOMEM
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
