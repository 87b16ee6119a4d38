"""Session commit()/reset() beside running commands: scenarios run as root and as the test user.

tests/integration/test_session_commit_gate.py calls each function in-process (root) or runs
this file through ``runuser`` as the unprivileged user (``python session_gate_scenarios.py NAME
WORKSPACE BASE``: prints the returned dict as JSON). Each returns what it observed; the test
asserts on it. ``workspace`` is an existing directory of the caller's; ``base`` a directory of
the caller's for the session's conflict copies (``workspace_base``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import threading
import time
from typing import Any

from lowlevel.errors import CommitConflictError, SessionError, WorkspaceError
from lowlevel.session import AsyncSession, Session
from lowlevel.session.protocol import init_fd, init_path

WRITER_THREADS = 4
WRITES_PER_THREAD = 75
#: The committer thread commits at least this many times while the writers run (the writers
#: keep going, past their quota, until it has): commits and commands interleave by construction.
MIN_COMMITS = 20


def _children() -> list[int]:
    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2:].split()[1]) == me:
                out.append(int(name))
    return out


def _fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _wait_for(path: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def concurrent_commits(workspace: str, base: str) -> dict[str, Any]:
    """WRITER_THREADS threads each run short writers (``echo NAME > NAME``) while another thread
    commits in a loop; the session then closes (the final commit). Every command that exited 0
    must have its file in the directory."""
    ok: list[str] = []
    failed: list[str] = []
    commits = 0
    commit_errors: list[str] = []
    done = threading.Event()
    lock = threading.Lock()
    with Session(workspace=workspace, workspace_base=base) as s:
        cow = s._core.run.cow

        def writer(t: int) -> None:
            i = 0
            while i < WRITES_PER_THREAD or (commits < MIN_COMMITS and not commit_errors and i < 5000):
                name = f"w{t}-{i}"
                try:
                    r = s.run(["sh", "-c", f"echo {name} > {name}"], timeout=30)
                except Exception as err:  # noqa: BLE001 - recorded, asserted on
                    with lock:
                        failed.append(f"{name}: {type(err).__name__}: {err}")
                else:
                    with lock:
                        (ok if r.exit_code == 0 else failed).append(
                            name if r.exit_code == 0 else f"{name}: exit {r.exit_code}: {r.stderr[-200:]!r}")
                i += 1

        def committer() -> None:
            nonlocal commits
            while not done.is_set():
                try:
                    s.commit()
                except Exception as err:  # noqa: BLE001 - recorded, asserted on
                    commit_errors.append(f"{type(err).__name__}: {err}")
                    return
                commits += 1

        writers = [threading.Thread(target=writer, args=(t,)) for t in range(WRITER_THREADS)]
        c = threading.Thread(target=committer)
        c.start()
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        done.set()
        c.join()
    present = set(os.listdir(workspace))
    wrong = [n for n in ok if n in present and _read(os.path.join(workspace, n)) != n + "\n"]
    return {"cow": cow, "ok": len(ok), "failed": failed[:20], "n_failed": len(failed), "commits": commits,
            "commit_errors": commit_errors, "lost": sorted(n for n in ok if n not in present)[:50],
            "wrong": wrong[:20], "children": _children()}


def async_concurrent_commits(workspace: str, base: str) -> dict[str, Any]:
    """The AsyncSession form of :func:`concurrent_commits`: writer tasks and a committing task."""
    async def main() -> dict[str, Any]:
        ok: list[str] = []
        failed: list[str] = []
        commits = 0
        done = asyncio.Event()
        async with AsyncSession(workspace=workspace, workspace_base=base) as s:
            cow = s._core.run.cow if s._core is not None else False

            async def writer(t: int) -> None:
                i = 0
                while i < WRITES_PER_THREAD or (commits < MIN_COMMITS and i < 5000):
                    name = f"a{t}-{i}"
                    try:
                        r = await s.run(["sh", "-c", f"echo {name} > {name}"], timeout=30)
                    except Exception as err:  # noqa: BLE001
                        failed.append(f"{name}: {type(err).__name__}: {err}")
                    else:
                        (ok if r.exit_code == 0 else failed).append(
                            name if r.exit_code == 0 else f"{name}: exit {r.exit_code}: {r.stderr[-200:]!r}")
                    i += 1

            async def committer() -> None:
                nonlocal commits
                while not done.is_set():
                    await s.commit()
                    commits += 1
                    await asyncio.sleep(0)

            c = asyncio.ensure_future(committer())
            await asyncio.gather(*(writer(t) for t in range(WRITER_THREADS)))
            done.set()
            await c
        present = set(os.listdir(workspace))
        return {"cow": cow, "ok": len(ok), "failed": failed[:20], "n_failed": len(failed), "commits": commits,
                "lost": sorted(n for n in ok if n not in present)[:50], "children": _children()}

    return asyncio.run(main())


BG_WRITER = ("i=0; while [ ! -e /workspace/stop ]; do echo $i > /workspace/bg-$i || exit 3; i=$((i+1)); "
             "sleep 0.01; done; ls /workspace > /workspace/bg-done")


def background_across_commit(workspace: str, base: str) -> dict[str, Any]:
    """A background writer (Session.start) while commit()/reset() are asked for: refused by
    default (naming it), the writer keeps working and exits 0 with every file in the final
    directory; running='wait' waits for a background command; running='leave' commits around
    one that does not use /workspace and notes it in its Result."""
    out: dict[str, Any] = {}
    with Session(workspace=workspace, workspace_base=base) as s:
        out["cow"] = s._core.run.cow
        if not out["cow"]:
            return out
        p = s.start(["sh", "-c", BG_WRITER], timeout=120)
        out["started"] = _wait_for(os.path.join(s.workspace, "bg-3"))
        for what in ("commit", "reset"):
            try:
                getattr(s, what)()
            except SessionError as err:
                out[f"{what}_refused"] = [err.reason, str(err)]
            else:
                out[f"{what}_refused"] = None
        out["directory_after_refusals"] = sorted(os.listdir(workspace))
        s.run(["touch", "stop"])
        r = p.wait(60)
        out["writer_exit"], out["writer_stderr"] = r.exit_code, r.stderr.decode(errors="replace")
        listed = set(s.run(["cat", "bg-done"]).stdout.decode().split())
        changes = s.commit()
        present = set(os.listdir(workspace))
        out["bg_files_listed"] = len([n for n in listed if n.startswith("bg-")])
        out["bg_missing"] = sorted(n for n in listed if n not in present)
        out["committed_bg_done"] = "bg-done" in changes.added and "bg-done" in present
        # running="wait": the commit waits for the background command (pumping its output).
        late = s.start(["sh", "-c", "sleep 0.3; head -c 200000 /dev/zero; echo late > late"], timeout=60)
        s.commit(running="wait")
        out["late_committed"] = os.path.exists(os.path.join(workspace, "late"))
        lr = late.poll()
        out["late_result"] = None if lr is None else [lr.exit_code, len(lr.stdout)]
        # running="leave": a command that does not use /workspace keeps running across it.
        server = s.start(["sh", "-c", "cd /tmp && while :; do sleep 0.05; done"])
        s.run(["sh", "-c", "echo x > left-x"])
        s.commit(running="leave")
        out["leave_committed"] = os.path.exists(os.path.join(workspace, "left-x"))
        out["leave_still_running"] = server.poll() is None
        server.kill()
        sr = server.wait(30)
        out["leave_notes"] = list(sr.notes)
        out["leave_killed_by"] = sr.killed_by
        try:
            s.commit(running="later")
        except Exception as err:  # noqa: BLE001
            out["bad_running"] = [type(err).__name__, str(err)]
    out["children"] = _children()
    return out


def reset_waits_for_run_in_flight(workspace: str, base: str) -> dict[str, Any]:
    """commit() while another thread's run() is in flight waits for it (its file is in the
    commit); a reset() asked while one runs waits too, and the command exits 0 (no EACCES)."""
    out: dict[str, Any] = {}
    with Session(workspace=workspace, workspace_base=base) as s:
        out["cow"] = s._core.run.cow
        if not out["cow"]:
            return out
        results: list[Any] = []
        t = threading.Thread(target=lambda: results.append(
            s.run(["sh", "-c", "touch started; sleep 0.5; echo late > late; ls /workspace"], timeout=60)))
        t.start()
        out["started"] = _wait_for(os.path.join(s.workspace, "started"))
        changes = s.commit()
        t.join()
        out["commit_added"] = sorted(changes.added)
        out["in_directory"] = sorted(os.listdir(workspace))
        out["run_exit"] = results[0].exit_code
        results.clear()
        t = threading.Thread(target=lambda: results.append(
            s.run(["sh", "-c", "touch started2; sleep 0.5; echo y > after; cat after"], timeout=60)))
        t.start()
        out["started2"] = _wait_for(os.path.join(s.workspace, "started2"))
        s.reset()
        t.join()
        out["reset_run"] = [results[0].exit_code, results[0].stdout.decode(), results[0].stderr.decode()]
        out["view_after_reset"] = sorted(os.listdir(s.workspace))
    return out


def close_conflict(workspace: str, base: str) -> dict[str, Any]:
    """close() whose final commit meets a host change raises CommitConflictError with the
    saved path, after the sandbox is gone; under ``with`` while the block raises, the block's
    exception propagates with a note."""
    out: dict[str, Any] = {}
    with open(os.path.join(workspace, "f"), "w") as f:
        f.write("orig\n")
    init_fd(init_path())  # opened once per process (cached): not a leak of this session
    fds0 = _fds()
    s = Session(workspace=workspace, workspace_base=base)
    out["cow"] = s._core.run.cow
    if not out["cow"]:
        s.close()
        return out
    s.run(["sh", "-c", "echo sandbox > f; echo new > g"])
    time.sleep(0.05)  # past the filesystem's coarse ctime tick (lowlevel.workspace.overlay.commit, Conflicts)
    with open(os.path.join(workspace, "f"), "w") as f:
        f.write("host\n")
    try:
        s.close()
    except CommitConflictError as err:
        out["error"] = [type(err).__name__, str(err), list(err.conflicts)]
        out["saved"] = err.saved_upper
        if err.saved_upper:
            tree = os.path.join(err.saved_upper, "tree")
            out["saved_files"] = {n: _read(os.path.join(tree, n)) for n in sorted(os.listdir(tree))}
    else:
        out["error"] = None
    out["alive"] = s.alive
    out["children"] = _children()
    out["fds_leaked"] = sorted(set(_fds()) - set(fds0))
    out["directory"] = {n: _read(os.path.join(workspace, n)) for n in sorted(os.listdir(workspace))}
    s.close()  # idempotent: nothing more to raise
    # Under `with`, while the block raises: the block's error propagates, the close's is noted.
    with open(os.path.join(workspace, "f"), "w") as f:
        f.write("orig2\n")
    try:
        with Session(workspace=workspace, workspace_base=base) as s2:
            s2.run(["sh", "-c", "echo sandbox2 > f"])
            time.sleep(0.05)
            with open(os.path.join(workspace, "f"), "w") as f:
                f.write("host2\n")
            raise KeyError("the block's own error")
    except KeyError as err:
        out["with_error"] = [type(err).__name__, list(getattr(err, "__notes__", []))]
    out["children_after_with"] = _children()
    # The async form raises the same.
    with open(os.path.join(workspace, "f"), "w") as f:
        f.write("orig3\n")

    async def amain() -> Any:
        a = await AsyncSession.create(workspace=workspace, workspace_base=base)
        await a.run(["sh", "-c", "echo sandbox3 > f"])
        await asyncio.sleep(0.05)
        with open(os.path.join(workspace, "f"), "w") as f:
            f.write("host3\n")
        try:
            await a.close()
        except WorkspaceError as err:
            return [type(err).__name__, err.saved_upper is not None and os.path.isdir(err.saved_upper)]
        return None

    out["async_error"] = asyncio.run(amain())
    with open(os.path.join(workspace, "f"), "w") as f:
        f.write("orig4\n")

    async def awith() -> Any:
        try:
            async with AsyncSession(workspace=workspace, workspace_base=base) as a:
                await a.run(["sh", "-c", "echo sandbox4 > f"])
                await asyncio.sleep(0.05)
                with open(os.path.join(workspace, "f"), "w") as f:
                    f.write("host4\n")
                raise KeyError("the block's own error")
        except KeyError as err:
            return [type(err).__name__, list(getattr(err, "__notes__", []))]
        return None

    out["async_with_error"] = asyncio.run(awith())
    out["children_after_async"] = _children()
    return out


def interrupted_commit(workspace: str, base: str) -> dict[str, Any]:
    """An interrupt inside ``Session.commit()``'s apply pass (KeyboardInterrupt, or a SIGTERM
    handler's SystemExit, right after its 40th rename: entries placed, the rest not), then the
    ``with`` block's ``close()`` (the final commit) completes it; the same with ``commit()``
    called again by the caller that caught the interrupt. Nothing is saved aside as a conflict."""
    from overlay_lab import interrupt_after
    out: dict[str, Any] = {}
    script = "for i in $(seq 100); do echo $i > f$i; done; echo new > keep; rm gone; mkdir -p d/e; echo x > d/e/x"
    for what, exc in (("close", KeyboardInterrupt), ("close_sigterm", SystemExit), ("again", KeyboardInterrupt)):
        for name in os.listdir(workspace):
            path = os.path.join(workspace, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        for name, text in (("keep", "old\n"), ("gone", "old\n")):
            with open(os.path.join(workspace, name), "w") as f:
                f.write(text)
        got: dict[str, Any] = {}
        try:
            with Session(workspace=workspace, workspace_base=base) as s:
                out["cow"] = s._core.run.cow
                if not out["cow"]:
                    return out
                s.run(["sh", "-c", script])
                try:
                    with interrupt_after(40, exc):
                        s.commit()
                except (KeyboardInterrupt, SystemExit) as err:
                    got["interrupted"] = type(err).__name__
                    got["applied_first"] = len(os.listdir(workspace))
                    if what != "again":
                        raise
                got["again"] = sorted(s.commit().modified)[:3]
        except (KeyboardInterrupt, SystemExit) as err:
            got["raised"] = [type(err).__name__, list(getattr(err, "__notes__", []))]
        names = sorted(os.listdir(workspace))
        got["files"] = len([n for n in names if n.startswith("f")])
        got["keep"] = _read(os.path.join(workspace, "keep"))
        got["gone"] = "gone" in names
        got["deep"] = _read(os.path.join(workspace, "d", "e", "x")) if os.path.exists(
            os.path.join(workspace, "d", "e", "x")) else None
        got["temporaries"] = [n for n in names if n.startswith(".lowlevel-commit-")]
        got["conflicts"] = [n for n in os.listdir(base) if n.startswith("conflict-")]
        got["children"] = _children()
        out[what] = got
    return out


def interrupted_commit_changed_again(workspace: str, base: str) -> dict[str, Any]:
    """An interrupted ``Session.commit()`` (KeyboardInterrupt right after its ``n``-th rename),
    then a command that changes again what the first pass had applied (every file, a file in a
    new directory, a file in an existing directory whose new mode, 0555, is set last: the
    interrupt falls inside it), then ``close()``: the final commit applies the new versions;
    nothing is a conflict, nothing saved aside. Control (``host``): the host also edits two
    applied files between the two commits, f1 and the entry whose rename the interrupt followed
    (same size, its mtime put back: only its ctime tells): both are conflicts and keep the
    host's bytes."""
    from overlay_lab import interrupt_after
    out: dict[str, Any] = {}
    first = ("mkdir -p d/e && echo x > d/e/x && for i in $(seq 60); do echo $i > f$i; done && "
             "for i in $(seq 30); do echo $i > ro/g$i; done && chmod 0555 ro")
    second = ("echo x2 > d/e/x && for i in $(seq 60); do echo again$i > f$i; done && chmod u+w ro && "
              "for i in $(seq 30); do echo again$i > ro/g$i; done && chmod 0555 ro")
    # Renames in name order: d (1), f1..f60 (60), then ro's g1..g30: the 75th is ro's 14th.
    for what in ("changed", "host"):
        for name in os.listdir(workspace):
            path = os.path.join(workspace, name)
            if os.path.isdir(path):
                os.chmod(path, 0o755)
                shutil.rmtree(path)
            else:
                os.unlink(path)
        os.mkdir(os.path.join(workspace, "ro"), 0o755)
        got: dict[str, Any] = {}
        try:
            with Session(workspace=workspace, workspace_base=base) as s:
                out["cow"] = s._core.run.cow
                if not out["cow"]:
                    return out
                s.run(["sh", "-c", first])
                try:
                    with interrupt_after(75):
                        s.commit()
                except KeyboardInterrupt:
                    got["interrupted"] = True
                got["applied_first"] = [len([n for n in os.listdir(workspace) if n.startswith("f")]),
                                        len(os.listdir(os.path.join(workspace, "ro"))),
                                        oct(os.stat(os.path.join(workspace, "ro")).st_mode & 0o7777)]
                last = "ro/" + sorted(os.listdir(os.path.join(workspace, "ro")))[-1]  # the 75th rename
                got["second"] = s.run(["sh", "-c", second]).exit_code
                if what == "host":
                    time.sleep(0.1)  # past a coarse ctime tick and the loose stamp's 50 ms
                    with open(os.path.join(workspace, "f1"), "w") as f:
                        f.write("host\n")
                    path = os.path.join(workspace, last)
                    st = os.stat(path)
                    with open(path, "r+") as f:
                        f.write("h" * (st.st_size - 1))
                    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
                    got["last"] = last
        except CommitConflictError as err:
            got["conflict"] = sorted(err.conflicts)
        files = {n: _read(os.path.join(workspace, n)) for n in os.listdir(workspace) if n.startswith("f")}
        got["files_again"] = sorted(n for n, t in files.items() if t == f"again{n[1:]}\n")
        got["f1"] = files.get("f1")
        got["x"] = _read(os.path.join(workspace, "d", "e", "x"))
        if "last" in got:
            got["last_text"] = _read(os.path.join(workspace, got["last"]))
        ro = os.path.join(workspace, "ro")
        got["ro_mode"] = oct(os.stat(ro).st_mode & 0o7777)
        got["ro_again"] = len([n for n in os.listdir(ro) if _read(os.path.join(ro, n)) == f"again{n[1:]}\n"])
        got["temporaries"] = [n for n in os.listdir(workspace) if n.startswith(".lowlevel-commit-")]
        got["conflict_dirs"] = len([n for n in os.listdir(base) if n.startswith("conflict-")])
        got["children"] = _children()
        os.chmod(ro, 0o755)
        out[what] = got
    return out


def async_background_across_commit(workspace: str, base: str) -> dict[str, Any]:
    """AsyncSession: a running background writer refuses commit()/reset() as in the sync form;
    running='wait' awaits it and commits its files."""
    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with AsyncSession(workspace=workspace, workspace_base=base) as a:
            assert a._core is not None
            out["cow"] = a._core.run.cow
            if not out["cow"]:
                return out
            p = await a.start(["sh", "-c", BG_WRITER], timeout=120)
            while not os.path.exists(os.path.join(a.workspace, "bg-3")):
                await asyncio.sleep(0.01)
            for what in ("commit", "reset"):
                try:
                    await getattr(a, what)()
                except SessionError as err:
                    out[f"{what}_refused"] = [err.reason, str(err)]
                else:
                    out[f"{what}_refused"] = None
            stopper = asyncio.ensure_future(a.run(["sh", "-c", "sleep 0.2; touch stop"]))
            while len(a._core.cmds) < 2:  # the stopper's command is in flight before the commit
                await asyncio.sleep(0.01)
            await a.commit(running="wait")  # waits for the stopper's run() and for the writer
            r = await p.wait(10)
            out["writer_exit"] = r.exit_code
            out["stopper_exit"] = (await stopper).exit_code
            listed = set((await a.run(["cat", "bg-done"])).stdout.decode().split())
            present = set(os.listdir(workspace))
            out["bg_files_listed"] = len([n for n in listed if n.startswith("bg-")])
            out["bg_missing"] = sorted(n for n in listed if n not in present)
        out["children"] = _children()
        return out

    return asyncio.run(main())


SCENARIOS = {f.__name__: f for f in (concurrent_commits, async_concurrent_commits, background_across_commit,
                                     async_background_across_commit, reset_waits_for_run_in_flight,
                                     close_conflict, interrupted_commit, interrupted_commit_changed_again)}

if __name__ == "__main__":
    name, ws, base = sys.argv[1:4]
    print(json.dumps(SCENARIOS[name](ws, base)))
