"""Run one program through lowlevel.run, a Session and a Pool; print each verdict as JSON.

Used by tests/integration/test_call_limits.py as root (in-process) and as the unprivileged
test user (through setpriv). argv[1] is a JSON spec: ``command``, ``limits`` (Limits kwargs of
the Policy), ``call_limits`` (Limits kwargs passed per call, or null).
"""

import json
import os
import shutil
import sys
import tempfile

import lowlevel
from lowlevel import Limits, Policy


def outcome(fn):  # type: ignore[no-untyped-def]
    try:
        r = fn()
    except lowlevel.LowlevelError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"exit_code": r.exit_code, "killed_by": r.killed_by, "oom_kills": r.oom_kills,
            "stdout": r.stdout.decode("utf-8", "replace"), "stderr": r.stderr.decode("utf-8", "replace")[-500:],
            "limits_enforced": list(r.limits_enforced), "notes": list(r.notes)}


def main() -> int:
    spec = json.loads(sys.argv[1])
    policy = Policy(limits=Limits(**spec.get("limits", {})))
    call = Limits(**spec["call_limits"]) if spec.get("call_limits") is not None else None
    base = tempfile.mkdtemp(prefix="lowlevel-verdicts-")
    os.chmod(base, 0o755)
    cmd = spec["command"]
    out = {}
    run_policy = policy if call is None else Policy(limits=call)
    try:
        out["run"] = outcome(lambda: lowlevel.run(cmd, policy=run_policy, workspace_base=base, timeout=60))
        with lowlevel.Session(policy, workspace_base=base) as s:
            out["session"] = outcome(lambda: s.run(cmd, limits=call, timeout=60))
        with lowlevel.Pool(policy, size=1, workspace_base=base) as p:
            out["pool"] = outcome(lambda: p.run(cmd, limits=call, timeout=60))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
