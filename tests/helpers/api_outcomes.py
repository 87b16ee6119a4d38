"""Run one program through every API (lowlevel.run, a Session, a Pool, the MCP tools); print
each outcome as JSON.

Used, as root and as the unprivileged test user (through setpriv), by
tests/integration/test_full_workspace.py (issue 25 items 1 and 2: fill a tmpfs layer or the
memory limit) and tests/integration/test_call_limits.py (issue 12 item 6: per-call limits get
the same verdict everywhere). argv[1] is a JSON spec: ``command``, ``limits`` (Limits kwargs of
the Policy), ``env`` (Policy env), ``apis`` (which of ``run``, ``session``, ``pool``, ``mcp_run``,
``mcp_session`` to use; default all), ``then`` (a second command run in the same Session / MCP
session after the first: is it still usable?), ``call_limits`` (Limits kwargs passed per call
to Session.run and Pool.run, and the Policy of the ``run``; default none), ``timeout`` (seconds
per command, default 120) and ``commit`` (the ``run``'s, default false).
"""

import json
import os
import shutil
import sys
import tempfile

import lowlevel
from lowlevel import Limits, Policy


def result_doc(r):  # type: ignore[no-untyped-def]
    return {"exit_code": r.exit_code, "killed_by": r.killed_by, "oom_kills": r.oom_kills,
            "stdout": r.stdout.decode("utf-8", "replace"), "stderr": r.stderr.decode("utf-8", "replace")[-800:],
            "limits_enforced": list(r.limits_enforced), "notes": list(r.notes)}


def outcome(fn):  # type: ignore[no-untyped-def]
    try:
        r = fn()
    except lowlevel.LowlevelError as err:
        return {"error": type(err).__name__, "message": str(err)}
    if isinstance(r, dict):  # an MCP tool's answer
        return {"exit_code": r.get("exit_code"), "killed_by": r.get("killed_by"), "stdout": r.get("stdout", ""),
                "stderr": r.get("stderr", "")[-800:], "notes": r.get("notes") or [], "error": r.get("error"),
                "message": r.get("message")}
    return result_doc(r)


def main() -> int:
    spec = json.loads(sys.argv[1])
    limits = spec.get("limits", {})
    policy = Policy(limits=Limits(**limits), env=spec.get("env", {}))
    call = Limits(**spec["call_limits"]) if spec.get("call_limits") is not None else None
    run_policy = policy if call is None else Policy(limits=call)
    timeout, commit = spec.get("timeout", 120), spec.get("commit", False)
    cmd, then = spec["command"], spec.get("then")
    apis = spec.get("apis", ["run", "session", "pool", "mcp_run", "mcp_session"])
    base = tempfile.mkdtemp(prefix="lowlevel-api-outcomes-")
    os.chmod(base, 0o755)
    out: dict = {}
    try:
        if "run" in apis:
            out["run"] = outcome(lambda: lowlevel.run(cmd, policy=run_policy, workspace_base=base, timeout=timeout,
                                                      commit=commit))
        if "session" in apis:
            with lowlevel.Session(policy, workspace_base=base) as s:
                out["session"] = outcome(lambda: s.run(cmd, limits=call, timeout=timeout))
                if then:
                    out["session_then"] = outcome(lambda: s.run(then, timeout=60))
        if "pool" in apis:
            with lowlevel.Pool(policy, size=1, workspace_base=base) as p:
                out["pool"] = outcome(lambda: p.run(cmd, limits=call, timeout=timeout))
        if "mcp_run" in apis or "mcp_session" in apis:
            from lowlevel.mcp_server import ServerConfig, Tools
            mcp_limits = {k: v for k, v in limits.items() if k != "memory_bytes"}
            tools = Tools(ServerConfig.from_mapping({"workspace_base": os.path.join(base, "mcp"),
                                                     **({"limits": mcp_limits} if mcp_limits else {})}))
            mem = {"memory_bytes": limits["memory_bytes"]} if "memory_bytes" in limits else {}
            try:
                if "mcp_run" in apis:
                    out["mcp_run"] = outcome(lambda: tools.run(cmd, timeout_s=120, **mem))
                if "mcp_session" in apis:
                    out["mcp_session"] = outcome(lambda: tools.run_in_session("s", cmd, timeout_s=120, **mem))
                    if then:
                        out["mcp_session_then"] = outcome(lambda: tools.run_in_session("s", then, timeout_s=60))
            finally:
                tools.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
