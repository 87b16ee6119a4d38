"""The Ray actor on a node (:class:`SandboxActor`): a :class:`lowlevel.Runner` for fresh sandboxes, plus
the sessions pinned to it, and the node's start check.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import ray
import ray.exceptions

from lowlevel import workspace as _ws
from lowlevel.errors import PolicyError, SessionError
from lowlevel.spec.policy import Policy
from lowlevel.ray.inputs import collect_outputs, unpack_inputs
from lowlevel.ray.results import PROBE_COMMAND, UNSET, ClusterError, RemoteResult, log, remote_result


def _picklable(err: BaseException) -> BaseException:
    """``err`` if it survives a pickle round trip (lowlevel's errors do), else a ClusterError naming it."""
    import pickle
    if isinstance(err, asyncio.CancelledError):
        raise err
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any failure: describe it instead
        return ClusterError(f"the call raised an unpicklable {type(err).__name__}: {err}", "protocol")
    return err


class SandboxActor:
    """The Ray actor on a node: a :class:`lowlevel.Runner` for fresh sandboxes plus sessions.

    Created by :class:`SandboxActorPool` (async actor: every method is a coroutine on the
    actor's event loop; ``concurrency`` sandboxes run at once, more calls wait holding only
    their coroutine and their inputs). Not meant to be used directly.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.node_id = ray.get_runtime_context().get_node_id()
        self.policies: dict[str, Policy] = {}
        self.sessions: dict[str, Any] = {}
        self.session_workspaces: dict[str, str] = {}
        self.runner: Any = None
        self.base: str | None = None
        self.calls = 0
        self.batches = 0
        self.active = 0
        self.peak_active = 0
        self.started = False

    def _base(self) -> str:
        """The node's workspace base (checked once per actor)."""
        if self.base is None:
            self.base = _ws.ensure_base(self.config.get("workspace_base") or _ws.default_base())
        return self.base

    def _new_workspace(self) -> str:
        """A fresh empty workspace (as :func:`lowlevel.workspace.create_workspace`)."""
        import tempfile
        return tempfile.mkdtemp(prefix="run-", dir=self._base())

    async def add_policy(self, key: str, policy: Policy) -> None:
        """Register a Policy under ``key`` (sent once per actor) and compile its seccomp filter.

        Later runs with the same profile hit the process's compile cache
        (:func:`lowlevel.host.seccomp_filter.compile_bpf`), so each actor compiles each profile once.
        """
        if key in self.policies:
            return
        if not isinstance(policy, Policy):
            raise PolicyError(f"expected a lowlevel.Policy, got {type(policy).__name__}")
        from lowlevel.host import seccomp_filter as _seccomp_filter
        if policy.seccomp is not None:
            await asyncio.to_thread(_seccomp_filter.compile_bpf, policy.seccomp)
        self.policies[key] = policy

    def _policy(self, key: str) -> Policy:
        policy = self.policies.get(key)
        if policy is None:
            raise ClusterError(f"policy {key} was never registered with this actor (a bug)", "protocol")
        return policy

    async def start(self, policy_key: str, policy: Policy) -> dict[str, Any]:
        """Check the node (``lowlevel doctor`` + a trial run of the pool's Policy); start the Runner.

        Returns:
            ``{"node_id", "ok", "reason", "doctor", "pid", "uid"}``; ``ok`` False means the
            node must not be used (``reason`` says why).
        """
        from lowlevel import doctor
        from lowlevel.sandbox.aio import Runner

        out: dict[str, Any] = {"node_id": self.node_id, "pid": os.getpid(), "uid": os.getuid(),
                               "ok": False, "reason": "", "doctor": None}
        try:
            report = await asyncio.to_thread(doctor.diagnose)
        except Exception as err:  # noqa: BLE001 - reported, the node is not used
            out["reason"] = f"lowlevel doctor failed: {type(err).__name__}: {err}"
            return out
        out["doctor"] = report
        if not report.get("ok"):
            failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if c["required"] and not c["ok"]]
            out["reason"] = "lowlevel doctor: " + "; ".join(failed)
            return out
        try:
            await self.add_policy(policy_key, policy)
            policy = self._policy(policy_key)
            self.runner = Runner(int(self.config["concurrency"]))
            probe = await self._run_fresh(list(PROBE_COMMAND), policy, None, None, 30.0, None, None)
        except Exception as err:  # noqa: BLE001 - reported, the node is not used
            out["reason"] = f"trial run with the pool's Policy failed: {type(err).__name__}: {err}"
            return out
        if probe.exit_code != 0:
            out["reason"] = (f"trial run {list(PROBE_COMMAND)} with the pool's Policy exited {probe.exit_code}: "
                             f"{probe.stderr[-300:].decode('utf-8', 'replace')}")
            return out
        self.started = True
        out["ok"] = True
        return out

    async def _run_fresh(self, command: list[str], policy: Policy, inputs: bytes | None, stdin: bytes | None,
                         timeout: Any, env: Mapping[str, str] | None, cwd: str | None) -> RemoteResult:

        kwargs: dict[str, Any] = {"policy": policy, "stdin": stdin, "env": env, "cwd": cwd}
        if timeout is not UNSET:
            kwargs["timeout"] = timeout
        ws: str | None = None
        outputs: tuple[dict[str, bytes], int, list[str]] = ({}, 0, [])
        try:
            if inputs:
                ws = self._new_workspace()
                await asyncio.to_thread(unpack_inputs, inputs, ws)
                kwargs["workspace"] = ws
            else:
                # lowlevel makes the fresh workspace itself: known empty, so no walk before the run
                kwargs["workspace_base"] = self._base()
            result = await self.runner.run(command, **kwargs)
            ws = result.workspace
            changed = result.changes.added + result.changes.modified
            if changed:
                outputs = await asyncio.to_thread(collect_outputs, ws, changed, int(self.config["max_output_bytes"]))
        finally:
            if ws is not None:
                if inputs or outputs[0]:
                    await asyncio.to_thread(_ws.remove_workspace, ws)
                else:
                    _ws.remove_workspace(ws)
        self.calls += 1
        return remote_result(result, self.node_id, outputs)

    async def run(self, spec: dict[str, Any], inputs: bytes | None) -> RemoteResult:
        """One fresh-sandbox call (see :meth:`SandboxActorPool.submit`)."""
        if not self.started:
            raise ClusterError("this sandbox actor did not pass its start checks", "no_nodes")
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            policy = self._policy(spec["policy_key"])
            return await self._run_fresh(spec["command"], policy, inputs, spec["stdin"],
                                         spec.get("timeout", UNSET), spec["env"], spec["cwd"])
        finally:
            self.active -= 1

    async def run_batch(self, specs: list[dict[str, Any]], *inputs: bytes | None) -> list[Any]:
        """Several fresh-sandbox calls in one Ray task (the driver's batched ``map``): each as
        :meth:`run`, all at once through the Runner (its ``concurrency`` bounds them).

        Returns:
            One entry per spec, in order: its :class:`RemoteResult`, or the exception the call
            raised (a lowlevel error, pickled back as is; anything unpicklable becomes a
            :class:`ClusterError` ``"protocol"`` naming it). ``inputs[i]`` belongs to ``specs[i]``.
        """
        if len(inputs) != len(specs):
            raise ClusterError(f"run_batch got {len(specs)} specs and {len(inputs)} inputs (a bug)", "protocol")
        self.batches += 1
        outs = await asyncio.gather(*(self.run(spec, box) for spec, box in zip(specs, inputs, strict=True)),
                                    return_exceptions=True)
        return [_picklable(o) if isinstance(o, BaseException) else o for o in outs]

    async def ping(self) -> str:
        """This actor's node id (no sandbox): measures the Ray path alone."""
        return str(self.node_id)

    # -- sessions --------------------------------------------------------------------------
    async def session_open(self, policy_key: str, inputs: bytes | None,
                           options: dict[str, Any]) -> str:
        """Start a session sandbox here; returns its id."""
        from lowlevel.session import AsyncSession

        if not self.started:
            raise ClusterError("this sandbox actor did not pass its start checks", "no_nodes")
        policy = self._policy(policy_key)
        ws = self._new_workspace()
        try:
            if inputs:
                await asyncio.to_thread(unpack_inputs, inputs, ws)
            # commit=False: the changes stay in the session's copy-on-write upper layer (read through
            # its live view) and the directory is removed at close, so applying them is wasted work.
            session = await AsyncSession.create(policy, workspace=ws, commit=False, **options)
        except BaseException:
            await asyncio.to_thread(_ws.remove_workspace, ws)
            raise
        sid = os.urandom(8).hex()
        self.sessions[sid] = session
        self.session_workspaces[sid] = ws
        return sid

    def _session(self, sid: str) -> Any:
        session = self.sessions.get(sid)
        if session is None:
            raise SessionError("the session is closed", "closed")
        return session

    async def session_run(self, sid: str, spec: dict[str, Any]) -> RemoteResult:
        """Run one command in session ``sid``."""
        session = self._session(sid)
        kwargs: dict[str, Any] = {"stdin": spec["stdin"], "env": spec["env"], "cwd": spec["cwd"],
                                  "limits": spec["limits"], "track_changes": spec["track_changes"]}
        if spec.get("timeout", UNSET) is not UNSET:
            kwargs["timeout"] = spec["timeout"]
        result = await session.run(spec["command"], **kwargs)
        changed = result.changes.added + result.changes.modified
        outputs: tuple[dict[str, bytes], int, list[str]] = ({}, 0, [])
        if changed:
            outputs = await asyncio.to_thread(collect_outputs, session.workspace, changed,
                                              int(self.config["max_output_bytes"]))
        self.calls += 1
        return remote_result(result, self.node_id, outputs)

    async def session_read(self, sid: str, relpath: str, max_bytes: int) -> bytes:
        """Read one regular file of session ``sid``'s workspace (untrusted: no symlink followed)."""
        session = self._session(sid)
        return await asyncio.to_thread(_ws.read_file, session.workspace, relpath, max_bytes)

    async def session_close(self, sid: str) -> None:
        """Close session ``sid`` and remove its workspace; idempotent."""
        session = self.sessions.pop(sid, None)
        ws = self.session_workspaces.pop(sid, None)
        if session is not None:
            await session.close()
        if ws is not None:
            await asyncio.to_thread(_ws.remove_workspace, ws)

    # -- lifecycle -------------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
        """Counters for tests and operators.

        ``calls`` served; ``batches`` the :meth:`run_batch` tasks among them; ``in_flight``
        calls in the actor now (running or waiting for a
        Runner slot) and ``peak_in_flight`` the most at once; ``running`` sandboxes now;
        ``sessions`` open; ``policies`` distinct Policies received; ``seccomp_cache_entries``
        filters compiled in this process.
        """
        from lowlevel.host import seccomp_filter as _seccomp_filter
        cache = getattr(_seccomp_filter, "_cache", None)
        return {"node_id": self.node_id, "pid": os.getpid(), "calls": self.calls, "batches": self.batches,
                "in_flight": self.active,
                "peak_in_flight": self.peak_active,
                "running": self.runner.in_flight if self.runner is not None else 0,
                "sessions": len(self.sessions), "policies": len(self.policies),
                "seccomp_cache_entries": len(cache) if isinstance(cache, dict) else None}

    async def shutdown(self) -> None:
        """Close every session (removing its workspace) and cancel the calls in flight."""
        for sid in list(self.sessions):
            try:
                await self.session_close(sid)
            except Exception as err:  # noqa: BLE001 - best effort at shutdown
                log.warning("lowlevel.ray: closing session %s failed: %s", sid, err)
        if self.runner is not None:
            await self.runner.aclose()
