"""``lowlevel mcp``: a Model Context Protocol tool server over stdio.

Tools an agent client can call (each result a JSON object):

``run``
    Run a command in a fresh sandbox (or in a named workspace the client filled with
    ``write_file``). Arguments carry ``timeout_s`` and limits (``memory_bytes``, ``cpu_s``,
    ``pids``), each clamped to the operator's ceiling; ``network`` (the host network) and
    ``binds`` are requests that are refused unless the operator allowed them; ``allow_hosts``
    narrows the operator's egress allowlist (``[egress]``; every pattern must lie within it,
    ``[]`` means no network). Result: ``exit_code``, ``term_signal``,
    ``killed_by``, ``timed_out``, ``stdout``/``stderr`` (UTF-8, truncated to the operator's
    ``max_output_bytes`` with ``stdout_truncated``/``stderr_truncated``; ``stdout_b64``/
    ``stderr_b64`` hold the exact bytes when they are not valid UTF-8), ``wall_time_s``,
    ``workspace`` (its name, for ``read_file``), ``clamped`` (what the client asked for and
    the operator's config cut), ``notes`` when a limit or the network policy explains the
    verdict (the memory limit and the tmpfs bounds, a refused fork, a refused connect; absent
    otherwise), and in egress mode ``network`` (each connection attempt: host,
    port, address, allowed, reason, bytes up and down). ``cwd`` is the working directory
    (absolute, or relative to ``/workspace``). A run without ``workspace`` gets a fresh one named
    ``run-<hex>``, kept ``run_workspace_ttl_s`` seconds after the call for ``read_file`` (each use
    restarts the clock), then removed; all of them go when the server exits; with a TTL of 0 it
    is removed right after the call and the result's ``workspace`` is null. Names starting
    ``run-`` are the server's: a client cannot create one.
``write_file``, ``read_file``, ``list_files``
    Workspace files, through :mod:`lowlevel.workspace`'s untrusted-output rules (no symlink
    followed, no ``..``, special and hard-linked files refused) and the operator's
    ``max_file_bytes``.

``run_in_session``, ``close_session``
    Run a command in a named, long-lived sandbox (:class:`lowlevel.session.Session`), created
    on first use with the operator's policy narrowed by that first request (``network``,
    ``binds``, ``memory_bytes``, ``pids`` are fixed for the session's life; ``timeout_s`` and
    ``cpu_s`` apply per command). Its workspace is the workspace of the same name, so
    ``write_file``/``read_file`` reach it. At most ``max_sessions`` live at once; a session
    with no command for ``session_idle_ttl_s`` seconds is closed (its slot freed, its
    workspace kept).

A tool call with an argument the tool does not take is an error (``isError``), never
silently ignored; the published input schemas say ``additionalProperties: false``.

Configuration comes from the operator only (TOML file and CLI flags), never from a request:
a client can narrow the policy (shorter timeout, smaller limits) but never widen it. Its keys:
:mod:`lowlevel.mcp_server.config`.

The transport is :mod:`lowlevel.mcp_server.stdio`: the SDK's stdio loop with each input line
checked first (a malformed one gets its JSON-RPC error, a line has a length bound).

Source: Model Context Protocol specification (tools/list, tools/call, ``isError`` results);
the ``mcp`` Python SDK (``MCPServer``, formerly ``FastMCP``).
"""

from __future__ import annotations

import base64
import dataclasses
import inspect
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from lowlevel.spec import validate as _validate
from lowlevel import workspace as _ws
from lowlevel.workspace.files import _split_rel
from lowlevel.spec.egress import Egress
from lowlevel.errors import LaunchError, LowlevelError, PolicyError
from lowlevel.spec.limits import VERDICT_NOTE_PREFIXES
from lowlevel.workspace.overlay import COMMIT_SKIPPED_NOTE
from lowlevel.spec.policy import Bind, Policy
from lowlevel.mcp_server.calls import (CURRENT_CALL, PROGRESS_INTERVAL_S, SHUTDOWN_KILL_S, tool_call,
                                       tool_call_with_progress)
from lowlevel.spec.report import bytes_fields, json_safe
from lowlevel.mcp_server.config import ServerConfig, check_base
from lowlevel.mcp_server.inputs import (argument_errors, check_encoding, decode_content, sandbox_cwd, utf8_arg,
                                       whole_utf8)
from lowlevel.sandbox.result import Result
from lowlevel.units import duration_seconds, size_bytes

log = logging.getLogger("lowlevel")
_F = TypeVar("_F", bound=Callable[..., Any])

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: Prefix of the server's own workspaces (runs without a workspace name):
#: ``run-<server pid>-<its start time>-<random hex>``, so another server on the same base can
#: tell a live server's workspace from a dead one's (:meth:`Tools._sweep_stale_runs`).
RUN_PREFIX = "run-"
_OWNED_RUN = re.compile(r"^run-(\d+)-(\d+)-[0-9a-f]+$")


#: Paths listed per kind (added, modified, deleted) in a result's ``changes``; past it
#: ``changes.truncated`` is true (``list_files`` lists the workspace, bounded by max_output_bytes).
MAX_CHANGES_LISTED = 200


def _clamp(name: str, asked: float | None, ceiling: float | None, clamped: list[str]) -> Any:
    if asked is None:
        return ceiling
    if isinstance(asked, bool) or not isinstance(asked, (int, float)) or asked != asked:
        raise PolicyError(f"{name} must be a number, got {asked!r:.40}")
    if asked <= 0:
        raise PolicyError(f"{name} must be > 0, got {asked!r}")
    if ceiling is not None and asked > ceiling:
        clamped.append(f"{name}: asked {asked}, operator ceiling {ceiling}")
        return ceiling
    return asked


class Tools:
    """The tool implementations, independent of the MCP SDK (plain calls, easy to test).

    Every method raises :class:`lowlevel.errors.LowlevelError` (PolicyError for a refused or
    invalid request); the server turns it into an MCP tool error.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.base = check_base(config.workspace_base)
        self.sessions: dict[str, Any] = {}
        self.session_policies: dict[str, Policy] = {}
        self.sessions_lock = threading.Lock()
        # Lifetimes (monotonic seconds): unnamed run workspaces expire, idle sessions close.
        self.run_expiry: dict[str, float] = {}
        self.session_last_used: dict[str, float] = {}
        self.busy: dict[str, int] = {}     # workspace/session name -> calls in flight
        self.life_lock = threading.Lock()
        self.inflight: set[Any] = set()    # the Runs of one-shot calls in flight (shutdown kills them)
        self._run_limiter: Any = None
        from lowlevel.host.run_records import own_start_time
        self._run_owner = f"{os.getpid()}-{own_start_time() or 0}"  # in each run-* name (the sweep's test)
        self._sweep_stale_runs()
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="lowlevel-mcp-sweeper", daemon=True)
        self._sweeper.start()

    # -- lifetimes ---------------------------------------------------------------------------
    def _sweep_stale_runs(self) -> None:
        """Remove ``run-*`` workspaces an earlier server left (last changed over a TTL ago), never
        one of a server still running on the same base (its pid and start time in the name: a
        second server's sweep with a TTL of 0 removed the first one's workspace mid-call, a
        fresh-user trial)."""
        from lowlevel.host.procs import process_start_time
        cutoff = time.time() - self.config.run_workspace_ttl_s
        try:
            names = os.listdir(self.base)
        except OSError:
            return
        for name in names:
            path = os.path.join(self.base, name)
            owner = _OWNED_RUN.match(name)
            if owner and process_start_time(int(owner.group(1))) == int(owner.group(2)):
                continue  # a live server's
            try:
                if name.startswith(RUN_PREFIX) and not os.path.islink(path) and os.lstat(path).st_mtime < cutoff:
                    _ws.remove_workspace(path)
            except (OSError, LowlevelError) as err:
                log.warning("lowlevel: mcp: cannot remove stale workspace %s: %s", path, err)

    def _sweep_loop(self) -> None:
        interval = max(0.2, min(60.0, self.config.session_idle_ttl_s / 4, self.config.run_workspace_ttl_s / 4 or 60.0))
        while not self._stop.wait(interval):
            try:
                self.sweep()
            except Exception as err:  # noqa: BLE001 - the sweeper must not die
                log.warning("lowlevel: mcp: sweep failed: %s", err)

    def _enter(self, name: str) -> None:
        with self.life_lock:
            self.busy[name] = self.busy.get(name, 0) + 1

    def _leave(self, name: str) -> None:
        now = time.monotonic()
        with self.life_lock:
            self.busy[name] -= 1
            if not self.busy[name]:
                del self.busy[name]
            if name in self.run_expiry:
                self.run_expiry[name] = now + self.config.run_workspace_ttl_s
            if name in self.session_last_used:
                self.session_last_used[name] = now

    def sweep(self, now: float | None = None) -> None:
        """Remove expired unnamed run workspaces and close sessions idle past their TTL (or
        already ended), freeing their ``max_sessions`` slots. Called by a background thread
        and before a new session is counted against ``max_sessions``."""
        now = time.monotonic() if now is None else now
        with self.life_lock:
            expired = [n for n, t in self.run_expiry.items() if t <= now and n not in self.busy]
            for n in expired:
                del self.run_expiry[n]
            idle = [n for n, t in self.session_last_used.items()
                    if n not in self.busy and t + self.config.session_idle_ttl_s <= now]
        for name in expired:
            try:
                _ws.remove_workspace(os.path.join(self.base, name))
            except (OSError, LowlevelError) as err:
                log.warning("lowlevel: mcp: cannot remove workspace %s: %s", name, err)
        with self.sessions_lock:
            for name, sess in list(self.sessions.items()):
                if name in idle or not sess.alive:
                    with self.life_lock:
                        if name in self.busy:
                            continue
                        self.session_last_used.pop(name, None)
                    del self.sessions[name]
                    self.session_policies.pop(name, None)
                    try:
                        sess.close()
                    except Exception as err:  # noqa: BLE001
                        log.warning("lowlevel: mcp: closing idle session %s: %s", name, err)

    def _workspace(self, name: str, create: bool) -> str:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise PolicyError(f"workspace name {name!r:.80}: use 1-64 letters, digits, '_', '.', '-'")
        path = os.path.join(self.base, name)
        if create and name.startswith(RUN_PREFIX) and name not in self.run_expiry:
            if not os.path.isdir(path):
                raise PolicyError(f"workspace name {name!r}: names starting {RUN_PREFIX!r} are the server's "
                                  "(runs without a workspace); choose another name")
            create = False
        if create:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
        if os.path.islink(path) or not os.path.isdir(path):
            raise PolicyError(f"no workspace named {name!r}: write a file to it first, or omit it")
        return path

    def policy_for(self, *, network: bool, binds: list[str], memory_bytes: int | None, cpu_s: float | None,
                   pids: int | None, clamped: list[str], allow_hosts: list[str] | None = None) -> Policy:
        """The Policy of one request: the operator's, narrowed by the request.

        Args:
            allow_hosts: None keeps the operator's egress allowlist (if any); a list narrows it
                to those patterns (each within the operator's); ``[]`` means no network.
        Raises:
            PolicyError: the request asks for the host network, a host outside the operator's
                allowlist, or a bind the operator did not allow.
        """
        cfg = self.config
        if network and not cfg.network:
            raise PolicyError("refused: the host network is disabled by the operator of this server"
                              + (f"; egress is allowed to {list(cfg.egress.allow)} (ask with allow_hosts)"
                                 if cfg.egress is not None else ""))
        net: bool | Egress = bool(network)
        if not network and cfg.egress is not None:
            net = cfg.egress if allow_hosts is None else (
                cfg.egress.narrow(allow=allow_hosts) if allow_hosts else False)
        elif allow_hosts and not network:
            raise PolicyError("refused: the operator of this server allows no network egress")
        extra: list[Bind] = []
        if not isinstance(binds, (list, tuple)):
            raise PolicyError("binds must be a list of host paths")
        for path in binds:
            real = os.path.realpath(_validate.host_path(path, "binds[]"))
            if real not in cfg.allowed_binds:
                raise PolicyError(f"refused: binding {path!r} is not allowed by the operator of this server")
            extra.append(Bind(real))
        lim = cfg.limits
        new_limits = dataclasses.replace(
            lim,
            memory_bytes=_clamp("memory_bytes", memory_bytes, lim.memory_bytes, clamped),
            cpu_s=_clamp("cpu_s", cpu_s, lim.cpu_s, clamped),
            pids=_clamp("pids", pids, lim.pids, clamped),
        )
        return Policy(network=net, binds=cfg.binds + tuple(extra), limits=new_limits,
                      deterministic=cfg.deterministic)

    def _policy_and_timeout(self, network: bool, binds: list[str] | None, memory_bytes: int | str | None,
                            cpu_s: float | str | None, pids: int | None, timeout_s: float | str | None,
                            clamped: list[str], allow_hosts: list[str] | None = None) -> tuple[Policy, float]:
        """The request's Policy and timeout, both bounded by the operator's config (what was
        cut is appended to ``clamped``). ``memory_bytes`` may be a size string (``"128M"``) and
        ``cpu_s``/``timeout_s`` duration strings (``"30s"``, ``"2m"``): the CLI's syntax, as in
        the config file (:mod:`lowlevel.units`; a bad one is one PolicyError line)."""
        if isinstance(memory_bytes, str):
            memory_bytes = size_bytes(memory_bytes, "memory_bytes")
        if isinstance(cpu_s, str):
            cpu_s = duration_seconds(cpu_s, "cpu_s")
        if isinstance(timeout_s, str):
            timeout_s = duration_seconds(timeout_s, "timeout_s")
        policy = self.policy_for(network=network, binds=list(binds or ()), memory_bytes=memory_bytes,
                                 cpu_s=cpu_s, pids=pids, clamped=clamped, allow_hosts=allow_hosts)
        if timeout_s is None:
            # Only what the client asked for and was cut goes to ``clamped``.
            timeout = min(self.config.default_timeout_s, self.config.max_timeout_s)
        else:
            timeout = _clamp("timeout_s", timeout_s, self.config.max_timeout_s, clamped)
        return policy, timeout

    def run(self, command: list[str], *, workspace: str | None = None, timeout_s: float | str | None = None,
            memory_bytes: int | str | None = None, cpu_s: float | str | None = None, pids: int | None = None,
            network: bool = False, binds: list[str] | None = None, stdin: str | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None,
            allow_hosts: list[str] | None = None) -> dict[str, Any]:
        """Run ``command`` in a fresh sandbox; see the module docstring for the result."""
        from lowlevel.sandbox.drive import run_request
        from lowlevel.sandbox.request import RunRequest

        clamped: list[str] = []
        command = _validate.command(command)
        stdin_bytes = utf8_arg(stdin, "stdin")
        policy, timeout = self._policy_and_timeout(network, binds, memory_bytes, cpu_s, pids, timeout_s, clamped,
                                                   allow_hosts)
        inside = sandbox_cwd(cwd)
        name = workspace if workspace is not None else f"{RUN_PREFIX}{self._run_owner}-{secrets.token_hex(6)}"
        if workspace is None:
            with self.life_lock:
                self.run_expiry[name] = float("inf")  # not swept while the call runs
        self._enter(name)
        box: list[Any] = []
        try:
            path = self._workspace(name, create=workspace is None)
            request = RunRequest(command, workspace=path, timeout=timeout, stdin=stdin_bytes, env=env, cwd=inside)
            result = run_request(request, policy, started=lambda r: self._track(box, r))
        except BaseException:
            if workspace is None:
                self._drop_run_workspace(name)
            raise
        finally:
            self._untrack(box)
            self._leave(name)
        if workspace is None and self.config.run_workspace_ttl_s == 0:
            self._drop_run_workspace(name)
            return self._result(result, None, clamped)
        return self._result(result, name, clamped)

    def _track(self, box: list[Any], run: Any) -> None:
        with self.life_lock:
            if self._stop.is_set():
                raise LaunchError("the server is shutting down: no new run")
            box.append(run)
            self.inflight.add(run)
        call = CURRENT_CALL.get()
        if call is not None:
            call.add(lambda: run.kill("cancelled"))

    def _untrack(self, box: list[Any]) -> None:
        with self.life_lock:
            for run in box:
                self.inflight.discard(run)

    def run_limiter(self) -> Any:
        """The ``anyio.CapacityLimiter`` of ``max_concurrent_runs`` the run tools' worker threads
        take (made on first use, inside the server's event loop)."""
        if self._run_limiter is None:
            import anyio
            self._run_limiter = anyio.CapacityLimiter(self.config.max_concurrent_runs)
        return self._run_limiter

    def shutdown(self, bound_s: float = SHUTDOWN_KILL_S) -> None:
        """A signal ended the server (SIGTERM, SIGHUP, SIGINT): refuse new runs, kill the one-shot
        runs in flight (again every 20 ms until their calls return, at most ``bound_s`` seconds:
        a run not yet spawned cannot be killed yet), then :meth:`close` (every session closed,
        its work committed as on ``close_session``; unnamed run workspaces removed). Thread-safe;
        called from the server's loop while tool calls still run in worker threads."""
        with self.life_lock:
            self._stop.set()  # under the lock: no run is tracked after this (_track refuses it)
        deadline = time.monotonic() + bound_s
        while True:
            with self.life_lock:
                runs = list(self.inflight)
            if not runs or time.monotonic() > deadline:
                break
            for run in runs:
                try:
                    run.kill("cancelled")
                except Exception as err:  # noqa: BLE001 - the others still go
                    log.debug("lowlevel: mcp: killing a run at shutdown: %s", err)
            time.sleep(0.02)
        self.close()

    def _drop_run_workspace(self, name: str) -> None:
        with self.life_lock:
            self.run_expiry.pop(name, None)
        path = os.path.join(self.base, name)
        if os.path.lexists(path):
            try:
                _ws.remove_workspace(path)
            except (OSError, LowlevelError) as err:
                log.warning("lowlevel: mcp: cannot remove workspace %s: %s", name, err)

    def run_in_session(self, session: str, command: list[str], *, timeout_s: float | str | None = None,
                       memory_bytes: int | str | None = None, cpu_s: float | str | None = None,
                       pids: int | None = None,
                       network: bool = False, binds: list[str] | None = None, stdin: str | None = None,
                       env: dict[str, str] | None = None, cwd: str | None = None,
                       allow_hosts: list[str] | None = None) -> dict[str, Any]:
        """Run ``command`` in the named session, starting it on first use."""
        from lowlevel.session import Session

        clamped: list[str] = []
        command = _validate.command(command)
        stdin_bytes = utf8_arg(stdin, "stdin")
        if not isinstance(session, str) or not _NAME.fullmatch(session):
            raise PolicyError(f"session name {session!r:.80}: use 1-64 letters, digits, '_', '.', '-'")
        policy, timeout = self._policy_and_timeout(network, binds, memory_bytes, cpu_s, pids, timeout_s, clamped,
                                                   allow_hosts)
        inside = sandbox_cwd(cwd)
        self._enter(session)
        try:
            with self.sessions_lock:
                sess = self.sessions.get(session)
                if sess is not None and not sess.alive:
                    sess.close()
                    del self.sessions[session]
                    sess = None
            if sess is None and len(self.sessions) >= self.config.max_sessions:
                self.sweep()  # idle or ended sessions free their slots first
            with self.sessions_lock:
                sess = self.sessions.get(session)
                if sess is None:
                    if self._stop.is_set():  # shutdown() closes the sessions under this lock, after setting it
                        raise LaunchError("the server is shutting down: no new session")
                    if len(self.sessions) >= self.config.max_sessions:
                        raise PolicyError(f"refused: {len(self.sessions)} sessions are open, the operator's "
                                          f"max_sessions; close one with close_session (idle sessions close "
                                          f"after {self.config.session_idle_ttl_s:g} s)")
                    sess = Session(policy, workspace=self._workspace(session, create=True),
                                   idle_timeout=self.config.session_idle_ttl_s)
                    self.sessions[session] = sess
                    self.session_policies[session] = policy
                    with self.life_lock:
                        self.session_last_used[session] = time.monotonic()
                elif policy != self.session_policies[session] and (network or binds or allow_hosts is not None):
                    raise PolicyError(f"session {session!r} already runs with its own network/binds; "
                                      "close it to start it with others")
                fixed = self.session_policies[session].limits
            for name, asked in (("memory_bytes", memory_bytes), ("pids", pids)):
                if asked is not None and getattr(policy.limits, name) != getattr(fixed, name):
                    raise PolicyError(f"session {session!r} runs with {name}={getattr(fixed, name)}, fixed when "
                                      "it started; close it to start it with another value")
            # memory_bytes and pids are the session's; cpu_s applies per command.
            limits = dataclasses.replace(fixed, cpu_s=policy.limits.cpu_s)
            # start + wait, not run: the handle is what a cancelled call kills (CallRuns).
            proc = sess.start(command, timeout=timeout, stdin=stdin_bytes, env=env, cwd=inside, limits=limits,
                              track_changes=None)
            call = CURRENT_CALL.get()
            if call is not None:
                call.add(proc.kill)
            result = proc.wait()
        finally:
            self._leave(session)
        return self._result(result, session, clamped)

    def close_session(self, session: str) -> dict[str, Any]:
        """Close a named session (its workspace stays)."""
        with self.sessions_lock:
            sess = self.sessions.pop(session, None)
            self.session_policies.pop(session, None)
        with self.life_lock:
            self.session_last_used.pop(session, None)
        if sess is None:
            raise PolicyError(f"no open session named {session!r}")
        sess.close()
        return {"session": session, "closed": True}

    def close(self) -> None:
        """Close every session and remove every unnamed run workspace (nobody can read them now)."""
        self._stop.set()
        with self.sessions_lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for sess in sessions:
            try:
                sess.close()  # raises when its final commit failed (a conflict): close the others too
            except Exception as err:  # noqa: BLE001
                log.warning("lowlevel: mcp: closing a session: %s", err)
        with self.life_lock:
            names = list(self.run_expiry)
        for name in names:
            self._drop_run_workspace(name)

    def _result(self, result: Result, name: str | None, clamped: list[str]) -> dict[str, Any]:
        cap = self.config.max_output_bytes
        out: dict[str, Any] = {
            "exit_code": result.exit_code, "term_signal": result.term_signal, "signal": result.signal_name(),
            "killed_by": result.killed_by, "timed_out": result.timed_out, "wall_time_s": result.wall_time_s,
            "workspace": name, "clamped": clamped, "limits_enforced": list(result.limits_enforced),
        }
        for stream, data, truncated in (("stdout", result.stdout, result.stdout_truncated),
                                        ("stderr", result.stderr, result.stderr_truncated)):
            cut = data[:cap]
            if len(data) > cap:
                cut = whole_utf8(cut)
            out[stream], out[f"{stream}_b64"] = bytes_fields(cut)
            out[f"{stream}_truncated"] = truncated or len(data) > cap
        # Why a limit or the network policy ended the program (issue 25): the verdict notes only,
        # which name limits and policy, never host paths; and what of the run's writes did not
        # reach the workspace (a fifo, an entry too deep: workspace-relative paths; a fresh-user
        # trial found those dropped without a word).
        why = [n for n in result.notes if n.startswith((*VERDICT_NOTE_PREFIXES, COMMIT_SKIPPED_NOTE))]
        if why:
            out["notes"] = why
        if result.network is not None:
            out["network"] = [dataclasses.asdict(a) for a in result.network]
        changes = result.changes
        if changes is not None and (changes.added or changes.modified or changes.deleted):
            # What the command wrote, so a client need not list_files to find it; bounded like
            # the output (MAX_CHANGES_LISTED paths per kind; workspace-relative paths only).
            kinds = {kind: getattr(changes, kind) for kind in ("added", "modified", "deleted")}
            listed: dict[str, Any] = {kind: list(paths[:MAX_CHANGES_LISTED]) for kind, paths in kinds.items()}
            listed["truncated"] = not changes.complete or any(len(p) > MAX_CHANGES_LISTED for p in kinds.values())
            out["changes"] = listed
        safe: dict[str, Any] = json_safe(out)
        return safe

    def write_file(self, workspace: str, path: str, content: str, encoding: str = "utf-8") -> dict[str, Any]:
        """Write a file into a named workspace (created if missing). ``encoding``: utf-8 or base64.

        Never writes through a symlink or a hard link the sandbox planted, and refuses a path
        more than :data:`lowlevel.workspace.MAX_DEPTH` levels deep (see
        :func:`lowlevel.workspace.write_file`).
        """
        check_encoding(encoding)
        _split_rel(path)  # the path's own errors before the workspace is created
        data = decode_content(content, encoding)
        if len(data) > self.config.max_file_bytes:
            raise PolicyError(f"refused: {len(data)} bytes > the operator's max_file_bytes "
                              f"{self.config.max_file_bytes}")
        sess = self._live_session(workspace)
        if sess is not None:
            # Into the session's live view (its copy-on-write workspace), owned as its sandbox.
            uid, gid = sess.host_ids if os.geteuid() == 0 else (None, None)
            _ws.write_file(sess.workspace, path, data, uid=uid, gid=gid)
        else:
            _ws.write_file(self._workspace(workspace, create=True), path, data)
        return {"workspace": workspace, "path": path, "bytes": len(data)}

    def _live_session(self, name: str) -> Any:
        """The live session of that name, whose workspace is its live view, or None."""
        sess = self.sessions.get(name)
        return sess if sess is not None and sess.alive else None

    def _view(self, name: str) -> str:
        sess = self._live_session(name)
        return sess.workspace if sess is not None else self._workspace(name, create=False)

    def read_file(self, workspace: str, path: str, encoding: str = "utf-8") -> dict[str, Any]:
        """Read a workspace file (untrusted: no symlinks, size-capped). ``encoding``: utf-8 or base64."""
        check_encoding(encoding)
        data = _ws.read_file(self._view(workspace), path, self.config.max_file_bytes)
        content = base64.b64encode(data).decode() if encoding == "base64" else data.decode("utf-8", "replace")
        return {"workspace": workspace, "path": path, "bytes": len(data), "encoding": encoding, "content": content,
                "exact": encoding == "base64" or bytes_fields(data)[1] is None}

    def list_files(self, workspace: str) -> dict[str, Any]:
        """List a workspace's entries (no symlink followed). A name that is not valid UTF-8 is a
        ``{"b64", "text"}`` object (:mod:`lowlevel.spec.report`), so one odd name never breaks the list.
        At most about ``max_output_bytes`` of entries (path order); ``truncated``/``total`` say so."""
        entries = _ws.list_files(self._view(workspace))
        # Bounded like a run's output (max_output_bytes): 20,000 files made a 2.7 MB reply. The
        # first entries in path order up to the cap; "truncated" and "total" say what was left out.
        cap, used, shown = self.config.max_output_bytes, 0, []
        for e in entries:
            used += len(e.path.encode("utf-8", "surrogateescape")) + 48  # the entry's JSON, about
            if used > cap:
                break
            shown.append({"path": e.path, "kind": e.kind, "size": e.size})
        listing: dict[str, Any] = json_safe({"workspace": workspace, "entries": shown,
                                             "truncated": len(shown) < len(entries), "total": len(entries)})
        return listing


def _tool(server: Any) -> Callable[[_F], _F]:
    """``server.tool()``, typed: the SDK's decorator registers the function and returns it."""
    decorator: Callable[[_F], _F] = server.tool()
    return decorator


def _run_tools(server: Any, tools: Tools, context: Any, tool_error: type[Exception]) -> dict[str, Any]:
    """Register the ``run`` and ``run_in_session`` tools (with progress notifications) on ``server``."""

    def with_context(fn: Any) -> Any:
        # The SDK finds the Context parameter by its resolved type hint; under `from __future__
        # import annotations` the string "Context" would resolve in this module's globals, where
        # the lazily imported class is not: give the hint as the class itself.
        fn.__annotations__["ctx"] = context
        return fn

    @_tool(server)
    @with_context
    async def run(command: list[str], workspace: str | None = None, timeout_s: float | str | None = None,
                  memory_bytes: int | str | None = None, cpu_s: float | str | None = None, pids: int | None = None,
                  network: bool = False, binds: list[str] | None = None, stdin: str | None = None,
                  env: dict[str, str] | None = None, cwd: str | None = None,
                  allow_hosts: list[str] | None = None, ctx: Any = None) -> dict[str, Any]:
        """Run a command (argv list, e.g. ["python3", "main.py"]) in a fresh sandbox.

        workspace: name of a workspace filled with write_file (default: a fresh empty one; its
        name is returned, and it is removed a while after the call). cwd: working directory
        (absolute, or relative to /workspace). timeout_s, memory_bytes, cpu_s, pids: limits
        (sizes and durations as numbers or as "128M", "30s"), clamped to the operator's
        ceilings (what was cut is listed in "clamped"). network (the host network), binds:
        requests the operator may refuse. allow_hosts: narrow the operator's egress allowlist
        to these host patterns ([] for no network); programs reach allowed hosts through
        HTTP_PROXY/HTTPS_PROXY. Returns exit_code, term_signal, killed_by, timed_out, stdout,
        stderr (truncated, with stdout_truncated/stderr_truncated), wall_time_s, workspace,
        and with egress "network" (each connection attempt and why it was allowed or refused);
        "changes": the paths the command added, modified, deleted (at most 200 each, truncated).
        """
        return await tool_call_with_progress(tool_error, ctx, tools.run, command, limiter=tools.run_limiter(),
                                         workspace=workspace, timeout_s=timeout_s, memory_bytes=memory_bytes,
                                         cpu_s=cpu_s, pids=pids, network=network, binds=binds, stdin=stdin,
                                         env=env, cwd=cwd, allow_hosts=allow_hosts)

    @_tool(server)
    @with_context
    async def run_in_session(session: str, command: list[str], timeout_s: float | str | None = None,
                             memory_bytes: int | str | None = None, cpu_s: float | str | None = None,
                             pids: int | None = None,
                             network: bool = False, binds: list[str] | None = None, stdin: str | None = None,
                             env: dict[str, str] | None = None, cwd: str | None = None,
                             allow_hosts: list[str] | None = None, ctx: Any = None) -> dict[str, Any]:
        """Run a command in the named long-lived sandbox, starting it on first use.

        The session's workspace is the workspace of the same name (write_file/read_file reach
        it); files and processes persist between commands. network, allow_hosts, binds,
        memory_bytes and pids are fixed when the session starts; timeout_s and cpu_s apply per
        command, clamped to the operator's ceilings; cwd as for run. A session idle for the
        operator's session_idle_ttl_s is closed. Returns the same fields as run.
        """
        return await tool_call_with_progress(tool_error, ctx, tools.run_in_session, session, command,
                                         limiter=tools.run_limiter(), timeout_s=timeout_s, memory_bytes=memory_bytes,
                                         cpu_s=cpu_s, pids=pids, network=network, binds=binds, stdin=stdin,
                                         env=env, cwd=cwd, allow_hosts=allow_hosts)

    return {"run": run, "run_in_session": run_in_session}


def _file_tools(server: Any, tools: Tools, tool_error: type[Exception]) -> dict[str, Any]:
    """Register ``close_session`` and the workspace file tools on ``server``."""

    @_tool(server)
    async def close_session(session: str) -> dict[str, Any]:
        """Close a named session; its workspace stays."""
        return await tool_call(tool_error, tools.close_session, session)

    @_tool(server)
    async def write_file(workspace: str, path: str, content: str, encoding: str = "utf-8") -> dict[str, Any]:
        """Write a file (relative path) into a named workspace, creating it. encoding: utf-8 or base64."""
        return await tool_call(tool_error, tools.write_file, workspace, path, content, encoding)

    @_tool(server)
    async def read_file(workspace: str, path: str, encoding: str = "utf-8") -> dict[str, Any]:
        """Read a file (relative path) from a workspace; symlinks and oversized files are refused."""
        return await tool_call(tool_error, tools.read_file, workspace, path, encoding)

    @_tool(server)
    async def list_files(workspace: str) -> dict[str, Any]:
        """List the entries of a workspace (path, kind, size)."""
        return await tool_call(tool_error, tools.list_files, workspace)

    return {"close_session": close_session, "write_file": write_file, "read_file": read_file,
            "list_files": list_files}


def build_server(config: ServerConfig, tools: Tools | None = None) -> Any:
    """The MCP server object (``mcp.server.mcpserver.MCPServer``, or ``FastMCP`` on mcp 1.x).

    Raises:
        ImportError: the ``mcp`` package is missing (``pip install '.[mcp]'`` in the lowlevel checkout).
    """
    try:
        from mcp.server.mcpserver import Context, MCPServer as _Server
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import Context  # type: ignore[no-redef,attr-defined,unused-ignore]
        from mcp.server.fastmcp import FastMCP as _Server  # type: ignore[no-redef,attr-defined,unused-ignore]
        from mcp.server.fastmcp.exceptions import ToolError  # type: ignore[no-redef,unused-ignore]

    tools = tools or Tools(config)
    # log_level WARNING: the SDK's default INFO logged every failed call, several lines each, on
    # stderr; a client that never drains stderr stopped the server after ~64 KiB (a fresh-user trial).
    server = _Server("lowlevel", log_level="WARNING", instructions=(
        "Run commands in a bubblewrap sandbox (no network unless the operator allows it; with an "
        "operator allowlist, HTTP(S) to allowed hosts goes through a proxy: see each result's 'network'). "
        "Use write_file to put files in a named workspace, run with workspace=NAME, then read_file."))

    fns = {**_run_tools(server, tools, Context, ToolError), **_file_tools(server, tools, ToolError)}
    _strict_arguments(server, ToolError, fns)
    return server


def _strict_arguments(server: Any, tool_error: type[Exception], fns: Mapping[str, Any]) -> None:
    """Make an unknown tool argument an error: the SDK's argument models ignore extra keys,
    which would run a request the client believes limited (``timeout`` for ``timeout_s``)
    without its limit. Checked in front of the tool manager (``call_tool``, the same in
    mcp 1.x and 2.x), and said in each published schema (``additionalProperties: false``)."""
    known = {name: set(inspect.signature(fn).parameters) - {"ctx"} for name, fn in fns.items()}
    manager = getattr(server, "_tool_manager", None)
    target = manager if manager is not None and hasattr(manager, "call_tool") else server
    inner = target.call_tool

    async def call_tool(name: str, arguments: dict[str, Any] | None, *args: Any, **kwargs: Any) -> Any:
        unknown = sorted(set(arguments or {}) - known.get(name, set(arguments or {})))
        if unknown:
            raise tool_error(f"tool {name!r} takes no argument {', '.join(map(repr, unknown))}; its arguments: "
                             f"{', '.join(sorted(known[name]))}")
        try:
            return await inner(name, arguments, *args, **kwargs)
        except tool_error as err:
            cause = err.__cause__
            if cause is None or type(cause).__name__ != "ValidationError" or name not in schemas:
                raise
            raise tool_error(f"Error executing tool {name}: bad arguments: "
                             f"{argument_errors(cause, arguments, schemas[name])}") from None

    target.call_tool = call_tool
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in (manager.list_tools() if manager is not None and hasattr(manager, "list_tools") else ()):
        params = getattr(tool, "parameters", None)
        if isinstance(params, dict) and tool.name in known:
            params["additionalProperties"] = False
            schemas[tool.name] = params


def serve(config: ServerConfig, pending: Callable[[], int | None] | None = None) -> int | None:
    """Serve MCP over stdio until the client closes stdin, through :mod:`lowlevel.mcp_server.stdio`
    (a malformed input line gets its JSON-RPC error; lines up to
    ``stdio.line_limit(config.max_file_bytes)`` bytes, 16 MiB by default), or until SIGTERM,
    SIGHUP or SIGINT (called from the main thread): then :meth:`Tools.shutdown` kills the runs in
    flight and closes every session (its work committed) before the server stops. Either way it
    then waits, up to :data:`DRAIN_S`, for the calls' worker threads to return (a
    ``close_session`` still committing). ``pending``: the first signal a handler of the caller's
    recorded (the CLI's :class:`lowlevel.cli.signals.SignalRecorder`, which also keeps the
    process alive through that wait), or None.

    Returns:
        The signal number that stopped the server, or None (the client closed stdin).
    """
    from lowlevel.mcp_server import stdio as _stdio
    from lowlevel.mcp_server.calls import wait_idle

    tools = Tools(config)
    signum: int | None = None
    try:
        if pending is None or pending() is None:
            server = build_server(config, tools)
            log.debug("lowlevel: mcp server on stdio, workspace base %s, host network %s, egress %s",
                      config.workspace_base, "allowed" if config.network else "off",
                      config.egress.describe() if config.egress is not None else "off")
            signum = _stdio.run(server, _stdio.line_limit(config.max_file_bytes),
                                on_signal=lambda _signum: tools.shutdown(), on_gone=lambda: _drain(tools),
                                pending=pending)
        tools.shutdown()
        if not wait_idle(DRAIN_S):
            log.warning("lowlevel: mcp: a call still runs after %g s; stopping anyway", DRAIN_S)
    finally:
        tools.close()
    if signum is None and pending is not None:
        signum = pending()
    return signum


#: How long a stopping server waits for its calls' worker threads (a session's final commit), seconds.
DRAIN_S = 600.0


def _drain(tools: Tools) -> None:
    """The client is gone (stdin's end, EPIPE): kill what runs, close the sessions, and wait for
    the calls' worker threads, so the answers of those that finish can still be written."""
    from lowlevel.mcp_server.calls import wait_idle
    tools.shutdown()
    wait_idle(DRAIN_S)


__all__ = ["PROGRESS_INTERVAL_S", "ServerConfig", "Tools", "build_server", "serve"]
