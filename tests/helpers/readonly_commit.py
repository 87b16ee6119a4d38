"""Session.commit() into a directory on a read-only mount: run as root and as the test user.

tests/integration/test_commit_readonly.py calls :func:`scenario` in-process (root) or runs this
file through ``runuser`` as the unprivileged user (``python readonly_commit.py WORKSPACE BASE
[wait]``: prints the returned dict as JSON; with ``wait``, first a ``ready`` line once the
session's change is made, then it waits for a line on stdin before committing).
``workspace`` holds ``a.txt``; ``base`` is the caller's directory for conflict copies
(``workspace_base``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from lowlevel.errors import WorkspaceError
from lowlevel.session import Session


def scenario(ws: str, base: str, before_commit: Callable[[], None] | None = None) -> dict[str, Any]:
    """Write ``b.txt`` in a session over ``ws``, call ``before_commit``, then commit; report
    what was raised and seen."""
    out: dict[str, Any] = {"cow": True}
    with Session(workspace=ws, commit=False, workspace_base=base) as s:
        out["cow"] = s._core.run.cow if s._core is not None else False
        r = s.run(["/bin/sh", "-c", "echo new > /workspace/b.txt"])
        out["exit_code"] = r.exit_code
        if before_commit is not None:
            before_commit()
        try:
            out["committed"] = list(s.commit().added)
            out["raised"] = None
        except Exception as err:  # noqa: BLE001 - the type is what the test checks
            out["raised"] = type(err).__name__
            out["is_workspace_error"] = isinstance(err, WorkspaceError)
            out["errno"] = getattr(err, "errno", None)
            out["message"] = str(err)
            out["saved_upper"] = getattr(err, "saved_upper", None)
            out["saved_is_dir"] = bool(out["saved_upper"]) and os.path.isdir(out["saved_upper"])
        out["diff_after"] = list(s.diff().added)
    out["listing"] = sorted(os.listdir(ws))
    with open(os.path.join(ws, "a.txt"), "rb") as f:
        out["a"] = f.read().decode()
    return out


def _wait() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    wait = sys.argv[3:] == ["wait"]
    print(json.dumps(scenario(sys.argv[1], sys.argv[2], _wait if wait else None)))
