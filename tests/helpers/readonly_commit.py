"""Session.commit() into a directory on a read-only mount: run as root and as the test user.

tests/integration/test_commit_readonly.py calls :func:`scenario` in-process (root) or runs this
file through ``runuser`` as the unprivileged user (``python readonly_commit.py WORKSPACE BASE``:
prints the returned dict as JSON). ``workspace`` holds ``a.txt``; ``base`` is the caller's
directory for conflict copies (``workspace_base``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from lowlevel.errors import WorkspaceError
from lowlevel.session import Session


def scenario(ws: str, base: str) -> dict[str, Any]:
    """Write ``b.txt`` in a session over ``ws``, then commit; report what was raised and seen."""
    out: dict[str, Any] = {"cow": True}
    with Session(workspace=ws, commit=False, workspace_base=base) as s:
        out["cow"] = s._core.run.cow if s._core is not None else False
        r = s.run(["/bin/sh", "-c", "echo new > /workspace/b.txt"])
        out["exit_code"] = r.exit_code
        try:
            out["committed"] = list(s.commit().added)
            out["raised"] = None
        except Exception as err:  # noqa: BLE001 - the type is what the test checks
            out["raised"] = type(err).__name__
            out["is_workspace_error"] = isinstance(err, WorkspaceError)
            out["errno"] = getattr(err, "errno", None)
            out["message"] = str(err)
            out["saved_upper"] = getattr(err, "saved_upper", None)
        out["diff_after"] = list(s.diff().added)
    out["listing"] = sorted(os.listdir(ws))
    with open(os.path.join(ws, "a.txt"), "rb") as f:
        out["a"] = f.read().decode()
    return out


if __name__ == "__main__":
    print(json.dumps(scenario(*sys.argv[1:3])))
