"""Every RunRequest field x every entry point: honoured (seen inside the sandbox) or refused.

Run as a script (``python request_fields.py DIR``: DIR is a scratch directory this caller owns);
prints one JSON object ``{"entry/field": "ok" | "FAIL: ..." | "n/a: ..."}`` on its last line.
tests/integration/test_request_fields.py runs it as root and as the unprivileged test user, so
the same table is checked for both identities. A field an entry point has no parameter for is
checked to be refused loudly (TypeError or PolicyError), never silently ignored; the CLI's and
the MCP tool's own option sets are checked through their own names (``--discard``, ``timeout_s``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import lowlevel
from lowlevel.errors import PolicyError

D = ""  # the scratch directory (set in main)
Call = Callable[..., Any]


def tree_digest(root: str) -> list[tuple[str, int, str]]:
    """(relative path, st_mode, sha256 of the content or the link target) of every entry under root."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = "link:" + os.readlink(path)
            else:
                digest = ""
            out.append((os.path.relpath(path, root), st.st_mode, digest))
    st = os.lstat(root)
    out.append((".", st.st_mode, ""))
    return out


def fresh_dir(name: str, files: dict[str, bytes] | None = None) -> str:
    path = tempfile.mkdtemp(prefix=name + "-", dir=D)
    os.chmod(path, 0o755)
    for rel, data in (files or {}).items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
        os.chmod(os.path.join(path, rel), 0o644)
    return path


# --- entry points: each (command, **fields) -> an object with stdout, exit_code, timed_out, killed_by, workspace
def ep_run(cmd: list[str], **f: Any) -> Any:
    return lowlevel.run(cmd, **f)


def ep_arun(cmd: list[str], **f: Any) -> Any:
    return asyncio.run(lowlevel.arun(cmd, **f))


def ep_runner(cmd: list[str], **f: Any) -> Any:
    async def main() -> Any:
        async with lowlevel.Runner(max_concurrency=2) as runner:
            return await runner.run(cmd, **f)
    return asyncio.run(main())


def ep_record_run(cmd: list[str], **f: Any) -> Any:
    from lowlevel.record import record_run
    f.setdefault("record", os.path.join(fresh_dir("rec"), "run.json"))
    return record_run(cmd, **f)


def ep_execute_recorded(cmd: list[str], **f: Any) -> Any:
    from lowlevel.record import execute_recorded
    return execute_recorded(cmd, **f)[0]


def ep_session(cmd: list[str], **f: Any) -> Any:
    with lowlevel.Session(workspace_base=fresh_dir("sbase")) as s:
        return s.run(cmd, **f)


def ep_pool(cmd: list[str], **f: Any) -> Any:
    with lowlevel.Pool(size=1, workspace_base=fresh_dir("pbase")) as p:
        return p.run(cmd, **f)


def ep_mcp(cmd: list[str], **f: Any) -> Any:
    from lowlevel.mcp_server import ServerConfig, Tools
    names = {"timeout": "timeout_s", "env": "env", "cwd": "cwd", "stdin": "stdin"}
    kw = {}
    for k, v in f.items():
        if k not in names:
            raise TypeError(f"the MCP run tool has no {k}")
        kw[names[k]] = v.decode() if k == "stdin" else v
    out = Tools(ServerConfig(workspace_base=fresh_dir("mcp"))).run(cmd, **kw)
    return SimpleNamespace(stdout=out["stdout"].encode(), exit_code=out["exit_code"], timed_out=out["timed_out"],
                           killed_by=out["killed_by"], workspace=None)


def ep_cli(cmd: list[str], **f: Any) -> Any:
    argv = [sys.executable, "-m", "lowlevel", "run"]
    env = {k: v for k, v in os.environ.items()}
    stdin = f.pop("stdin", None)
    argv.append("--json")  # the CLI's capture switch: how this adapter sees the Result
    flags: dict[str, Callable[[Any], list[str]]] = {
        "workspace": lambda v: ["--workspace", v], "timeout": lambda v: ["--timeout", str(v)],
        "kill_after": lambda v: ["-k", str(v)], "cwd": lambda v: ["-w", v],
        "env": lambda v: [x for k, val in v.items() for x in ("-e", f"{k}={val}")],
        "inputs": lambda v: [x for i in v for x in ("--input", i if isinstance(i, str) else f"{i[0]}:{i[1]}")],
        "keep_workspace": lambda v: [] if v else ["--rm"],
        "commit": lambda v: [] if v is True else ["--discard"] if v is False else ["--commit-on-success"],
        "record": lambda v: ["--record", v], "allow_sensitive_workspace": lambda v: ["--allow-sensitive"] if v else [],
    }
    for k, v in f.items():
        if k == "workspace_base":
            env["LOWLEVEL_WORKSPACE_BASE"] = v
            continue
        if k not in flags:
            raise TypeError(f"lowlevel run has no option for {k}")
        argv += flags[k](v)
    proc = subprocess.run([*argv, "--", *cmd], input=stdin or b"", capture_output=True, env=env, timeout=120)
    try:
        d = json.loads(proc.stdout)
    except ValueError:
        if proc.returncode == 2:  # a usage error: the CLI's refusal
            raise PolicyError(proc.stderr.decode(errors="replace").strip()[-300:]) from None
        raise AssertionError(f"lowlevel run exited {proc.returncode}: {proc.stderr[-500:]!r}") from None
    if d.get("error"):
        refused = d["error"] in ("PolicyError", "UsageError")
        raise (PolicyError if refused else RuntimeError)(f"{d['error']}: {d.get('message')}")
    return SimpleNamespace(stdout=d["stdout"].encode(), exit_code=d["exit_code"], timed_out=d["timed_out"],
                           killed_by=d["killed_by"], workspace=d["workspace"])


ENTRIES: dict[str, Call] = {"run": ep_run, "arun": ep_arun, "Runner": ep_runner, "record_run": ep_record_run,
                            "execute_recorded": ep_execute_recorded, "Session.run": ep_session, "Pool.run": ep_pool,
                            "mcp.run": ep_mcp, "cli": ep_cli}
try:
    import ray  # noqa: F401
    RAY = True
except ImportError:
    RAY = False


# --- probes: each honours one field through `call` (raises AssertionError when not honoured) ----
def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def p_command(call: Call) -> None:
    r = call(sh("echo hi"))
    assert r.stdout == b"hi\n" and r.exit_code == 0, (r.stdout, r.exit_code)


def p_env(call: Call) -> None:
    r = call(sh('printf %s "$PROBE"'), env={"PROBE": "seen"})
    assert r.stdout == b"seen", r.stdout


def p_cwd(call: Call) -> None:
    r = call(["pwd"], cwd="/tmp")
    assert r.stdout == b"/tmp\n", r.stdout


def p_stdin(call: Call) -> None:
    r = call(["cat"], stdin=b"fed")
    assert r.stdout == b"fed", r.stdout


def p_timeout(call: Call) -> None:
    r = call(["sleep", "30"], timeout=0.5)
    assert r.timed_out and r.killed_by == "timeout", (r.timed_out, r.killed_by)


def p_kill_after(call: Call) -> None:
    r = call(sh('trap "echo term; exit 7" TERM; sleep 30 & wait'), timeout=0.5, kill_after=20)
    assert r.exit_code == 7 and r.stdout == b"term\n", (r.exit_code, r.stdout)


def p_inputs(call: Call) -> None:
    src = fresh_dir("in", {"a.txt": b"A", "b.src": b"B"})
    r = call(["cat", "a.txt", "sub/b.txt"], inputs=[os.path.join(src, "a.txt"), (os.path.join(src, "b.src"),
                                                                                  "sub/b.txt")])
    assert r.stdout == b"AB", r.stdout


def p_workspace(call: Call) -> None:
    ws = fresh_dir("ws", {"f.txt": b"W"})
    r = call(sh("cat f.txt; echo new > new.txt"), workspace=ws)
    assert r.stdout == b"W", r.stdout
    with open(os.path.join(ws, "new.txt"), "rb") as f:
        assert f.read() == b"new\n"


def p_workspace_base(call: Call) -> None:
    base = fresh_dir("base")
    r = call(sh("echo x > mark"), workspace_base=base)
    made = [n for n in os.listdir(base) if os.path.exists(os.path.join(base, n, "mark"))]
    assert len(made) == 1, os.listdir(base)
    assert r.workspace is None or os.path.realpath(r.workspace) == os.path.realpath(os.path.join(base, made[0]))


def p_allow_sensitive_workspace(call: Call) -> None:
    # Accepted on an ordinary workspace (the refusals it lifts: tests/integration/test_workspace_refusal.py).
    ws = fresh_dir("sens", {"f.txt": b"S"})
    r = call(["cat", "f.txt"], workspace=ws, allow_sensitive_workspace=True)
    assert r.stdout == b"S", r.stdout


def p_capture(call: Call) -> None:
    """capture=False: the program writes to the caller's own fd 1 (here a file dup2'd over it)."""
    path = os.path.join(fresh_dir("cap"), "out")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    saved = os.dup(1)
    sys.stdout.flush()
    os.dup2(fd, 1)
    try:
        r = call(sh("echo to-fd-1"), capture=False)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == b"to-fd-1\n"
    assert r.stdout == b"", r.stdout


def p_stdio_fds(call: Call) -> None:
    d = fresh_dir("sfd")
    with open(os.path.join(d, "in"), "wb") as f:
        f.write(b"from-fd")
    fd_in = os.open(os.path.join(d, "in"), os.O_RDONLY)
    fd_out = os.open(os.path.join(d, "out"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        r = call(["cat"], stdio_fds=(fd_in, fd_out, None), capture=False)
    finally:
        os.close(fd_in)
        os.close(fd_out)
    with open(os.path.join(d, "out"), "rb") as f:
        assert f.read() == b"from-fd"
    assert r.stdout == b"", r.stdout


def p_keep_workspace(call: Call) -> None:
    base = fresh_dir("keep")
    r = call(sh("echo x > mark"), keep_workspace=False, workspace_base=base)
    assert r.workspace is None or not os.path.exists(r.workspace), r.workspace
    left = [n for n in os.listdir(base) if n != ".mnt"]  # .mnt: the overlays' mount points (lowlevel.workspace.cow)
    assert left == [], left


def _changing(call: Call, **f: Any) -> tuple[Any, bool]:
    ws = fresh_dir("commit", {"keep.txt": b"k", "gone.txt": b"g", "d/x": b"x"})
    before = tree_digest(ws)
    r = call(sh("echo more >> keep.txt; rm gone.txt; chmod 600 d/x; mkdir n; echo y > n/y; exit 1"),
             workspace=ws, **f)
    return r, tree_digest(ws) == before


def p_commit(call: Call) -> None:
    for mode in (False, "on_success"):
        r, same = _changing(call, commit=mode)
        assert r.exit_code == 1 and same, f"commit={mode!r} changed the workspace"
    r, same = _changing(call, commit=True)
    assert not same, "commit=True left the workspace unchanged"


def p_record(call: Call) -> None:
    path = os.path.join(fresh_dir("rec"), "run.json")
    r = call(sh("echo rec"), record=path)
    assert r.stdout == b"rec\n"
    with open(path) as f:
        doc = json.load(f)
    assert doc["command"][-1] == "echo rec", doc["command"]


def p_record_commit_false(call: Call) -> None:
    """run(record=..., commit=False): refused, the workspace bit-identical, no record written."""
    path = os.path.join(fresh_dir("rec"), "run.json")
    ws = fresh_dir("rcw", {"a": b"a"})
    before = tree_digest(ws)
    try:
        call(sh("echo b > a; echo c > c"), workspace=ws, record=path, commit=False)
    except PolicyError:
        pass
    else:
        raise AssertionError("record with commit=False was not refused")
    assert tree_digest(ws) == before and not os.path.exists(path)


PROBES: dict[str, Callable[[Call], None]] = {
    "command": p_command, "env": p_env, "cwd": p_cwd, "stdin": p_stdin, "timeout": p_timeout,
    "kill_after": p_kill_after, "inputs": p_inputs, "workspace": p_workspace, "workspace_base": p_workspace_base,
    "allow_sensitive_workspace": p_allow_sensitive_workspace, "capture": p_capture, "stdio_fds": p_stdio_fds,
    "keep_workspace": p_keep_workspace, "commit": p_commit, "record": p_record,
}
#: A value of each field for the refusal checks.
REFUSE_WITH: dict[str, dict[str, Any]] = {
    "workspace": {"workspace": "/nonexistent-probe"}, "inputs": {"inputs": ["/nonexistent-probe"]},
    "kill_after": {"kill_after": 1.0, "timeout": 5}, "env": {"env": {"A": "b"}}, "cwd": {"cwd": "/tmp"},
    "workspace_base": {"workspace_base": "/nonexistent-probe"}, "allow_sensitive_workspace":
    {"allow_sensitive_workspace": True}, "capture": {"capture": False}, "stdio_fds": {"stdio_fds": (None, 1, 1),
                                                                                    "capture": False},
    "keep_workspace": {"keep_workspace": False}, "commit": {"commit": False}, "record": {"record": "refused.json"},
    "stdin": {"stdin": b"x"}, "timeout": {"timeout": 5},
}
ALL = set(PROBES)
#: What each entry point honours (probe), refuses with PolicyError (a documented refusal), or
#: has no parameter for (TypeError: refused loudly). ``record_run`` always records.
TABLE: dict[str, tuple[set[str], set[str]]] = {
    "run": (ALL, set()),
    "arun": (ALL - {"record"}, {"record"}),
    "Runner": (ALL - {"record"}, {"record"}),
    "record_run": (ALL - {"kill_after", "stdio_fds", "commit"}, {"kill_after", "stdio_fds", "commit"}),
    "execute_recorded": (ALL - {"kill_after", "stdio_fds", "commit", "record"},
                         {"kill_after", "stdio_fds", "commit"}),
    "Session.run": ({"command", "env", "cwd", "stdin", "timeout"}, set()),
    "Pool.run": ({"command", "env", "cwd", "stdin", "timeout", "inputs"}, set()),
    "mcp.run": ({"command", "env", "cwd", "stdin", "timeout"}, set()),
    "cli": (ALL - {"stdio_fds", "capture"}, set()),  # capture: the adapter's --json
}

#: Checks run after a cell's own: ``record`` with ``commit=False`` refused and the workspace left
#: bit-identical (issue 26's defect), wherever a record can be asked for.
EXTRA: dict[tuple[str, str], Callable[[Call], None]] = {
    ("run", "record"): p_record_commit_false, ("record_run", "commit"): p_record_commit_false,
    ("cli", "commit"): p_record_commit_false,
}


def check(entry: str, field: str) -> str:
    call = ENTRIES[entry]
    honoured, refused = TABLE[entry]
    try:
        if field in honoured:
            PROBES[field](call)
            if (entry, field) in EXTRA:
                EXTRA[entry, field](call)
            return "ok"
        kw = dict(REFUSE_WITH[field])
        if "record" in kw:
            kw["record"] = os.path.join(D, kw["record"])  # never written: the call is refused
        try:
            call(["true"], **kw)
        except PolicyError:
            if (entry, field) in EXTRA:
                EXTRA[entry, field](call)
            if field not in refused and entry not in ("cli", "mcp.run"):
                return f"FAIL: refused with PolicyError but the table says it has no such parameter: {kw}"
            return "ok"
        except TypeError as err:
            if field in refused:
                return f"FAIL: TypeError ({err}) where PolicyError was expected"
            return "ok"
        return f"FAIL: {kw} was accepted and not honoured"
    except Exception as err:  # noqa: BLE001 - reported per cell
        return f"FAIL: {type(err).__name__}: {err}\n{traceback.format_exc()[-600:]}"


def main() -> int:
    global D
    D = sys.argv[1]
    out: dict[str, str] = {}
    for entry in ENTRIES:
        for field in PROBES:
            out[f"{entry}/{field}"] = check(entry, field)
    out["ray"] = "n/a: ray is not installed" if not RAY else "n/a: lowlevel.ray needs a cluster"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
