"""Every RunRequest field x every entry point is honoured inside the sandbox or refused (issue 26).

The table and its probes are tests/helpers/request_fields.py (one script, run as root and as the
unprivileged test user): ``run``, ``arun``, ``Runner.run``, ``record_run``, ``execute_recorded``,
``Session.run``, ``Pool.run``, the MCP ``run`` tool and the CLI ``lowlevel run``, each with
command, env, cwd, stdin, timeout, kill_after, inputs (paths and (src, dest) pairs), workspace,
workspace_base, allow_sensitive_workspace, capture, stdio_fds, keep_workspace, commit and record.
Honoured means seen: the variable printed from inside, the cwd printed by ``pwd``, the timeout's
kill, the SIGTERM trap of ``kill_after``, stdin echoed by ``cat``, ``commit=False`` and
``commit='on_success'`` (on a failing run) leaving the workspace bit-identical (sha256 and mode
of every entry). Refused means PolicyError (a documented refusal: ``arun(record=)``,
``record_run(commit=False)``...) or TypeError where the entry point has no such parameter;
never a field accepted and ignored. ``run(record=..., commit=False)``, ``record_run(commit=False)``
and ``lowlevel run --record --discard`` are refused with the workspace bit-identical and no
record written (the library used to commit). ``lowlevel.ray`` needs a cluster: not in the table.
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
from helpers.identities import identity_prefix

pytestmark = [pytest.mark.bwrap]

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "request_fields.py"


@pytest.mark.parametrize("identity", ["root", "user"])
def test_every_field_of_every_entry_point_is_honoured_or_refused(identity: str,
                                                                  request: pytest.FixtureRequest) -> None:
    d = tempfile.mkdtemp(prefix="rt-fields-", dir="/tmp")
    try:
        os.chmod(d, 0o755)
        prefix = identity_prefix(identity, request, d)
        proc = subprocess.run([*prefix, sys.executable, str(SCRIPT), d], capture_output=True, cwd="/", timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:].decode(errors="replace")
        table = json.loads(proc.stdout.splitlines()[-1])
        failed = {cell: verdict for cell, verdict in table.items() if verdict != "ok" and not
                  verdict.startswith("n/a")}
        assert not failed, "\n".join(f"{cell}: {verdict}" for cell, verdict in failed.items())
        # The table is whole: every entry point x every field has a verdict.
        entries = {cell.split("/")[0] for cell in table if "/" in cell}
        fields = {cell.split("/")[1] for cell in table if "/" in cell}
        assert entries == {"run", "arun", "Runner", "record_run", "execute_recorded", "Session.run", "Pool.run",
                           "mcp.run", "cli"}
        assert len(fields) == 15 and len(table) == len(entries) * len(fields) + 1
    finally:
        shutil.rmtree(d, ignore_errors=True)
