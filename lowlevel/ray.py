"""Run sandboxed calls across a Ray cluster: :class:`SandboxActorPool` (``pip install '.[ray]'`` in the checkout).

In Ray's terms (``ray.util.ActorPool``): a pool of actors, one per node (or one per
``cpus_per_actor`` CPUs), each holding a :class:`lowlevel.Runner` with bounded concurrency, and
a router actor on the driver's node that spreads calls over them and re-runs the calls of an
actor that died. The core package never imports Ray; only this module does.

::

    import ray, lowlevel
    from lowlevel.ray import SandboxActorPool

    ray.init(address="auto")
    with SandboxActorPool(lowlevel.Policy()) as pool:
        ref = pool.submit(["python3", "main.py"], inputs={"main.py": b"print(6 * 7)"}, timeout=10)
        result = ray.get(ref)                      # a RemoteResult (a lowlevel.Result)
        result.stdout, result.node_id, result.files, result.attempts
        for r in pool.map([["python3", "-c", f"print({i})"] for i in range(1000)]):
            ...
        with pool.open_session() as s:             # one sandbox, pinned to one node
            s.run(["git", "init"]); s.run(["git", "status"])

Data flow: a call's inputs travel as bytes (a tar archive, GNU format, at most
``max_input_bytes``) through Ray's object store, never as host paths: the node may not have
them. On the node the actor unpacks them into a fresh workspace (fd-relative, no symlink
followed, no ``..``, only regular files, directories and symlinks, no setuid bits), runs the
command with :meth:`lowlevel.Runner.run`, reads back the files the run added or modified
(regular files only, at most ``max_output_bytes`` in all: :attr:`RemoteResult.files`, with
``files_truncated`` / ``files_dropped_bytes`` / ``files_omitted`` like stdout's truncation
report), and removes the workspace. The Result also names the node (``node_id``).

Faults (Ray's own fault-tolerance vocabulary):
    - A sandbox actor that dies (its node lost, its raylet killed, the worker crashed) fails
      its in-flight calls with ``RayActorError``; the router marks the actor dead, never
      uses it again, and re-runs each of those calls on another live actor, up to
      ``max_retries`` times. A fresh-sandbox call is idempotent (fresh workspace, inputs
      shipped with the call), so a re-run is safe; the Result says so: ``attempts`` > 1,
      ``lost_nodes`` lists the nodes that died under it. Past ``max_retries``:
      :class:`ClusterError` ``reason="node_lost"``.
    - A call whose sandbox timed out is a Result with ``timed_out=True``: it is returned
      as is, never re-run. Only the death of the actor holding it re-runs a call.
    - A session lives in one sandbox on one node: when that node's actor dies, every call
      on it raises :class:`lowlevel.SessionError` with ``reason="node_lost"`` (never re-run
      elsewhere: the session's state is gone).
    - A node whose host cannot run the pool's Policy (``lowlevel doctor`` fails a required
      check, or a trial run with the Policy fails) is reported by :meth:`SandboxActorPool.nodes`
      and gets no calls.

Policies are values: each distinct :class:`lowlevel.Policy` is pickled (unchanged) to each
actor once per pool, through the router, and calls name it by a short key (the default
Policy pickles to ~19 KB and takes ~1 ms to unpickle: not a per-call cost); the actor compiles
its seccomp filter once (the per-process cache of :func:`lowlevel.spec.seccomp.compile_bpf`), at
start for the pool's Policy.

Sources: Ray docs "Actors", "AsyncIO / Concurrency for Actors", "Fault Tolerance: Actors"
(``RayActorError``, ``max_restarts``/``max_task_retries``), "Scheduling"
(``NodeAffinitySchedulingStrategy``), ``ray.util.ActorPool``; tar(5) (GNU format).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import io
import logging
import os
import stat
import tarfile
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import ray
    import ray.exceptions
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError("lowlevel.ray needs Ray: pip install '.[ray]' in the lowlevel checkout") from _err

from lowlevel import workspace as _ws
from lowlevel.workspace.files import open_dir_at
from lowlevel.errors import LowlevelError, PolicyError, SessionError, WorkspaceError
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Policy
from lowlevel.sandbox.result import Result

log = logging.getLogger("lowlevel.ray")

#: Default cap on one call's packed inputs (bytes of the tar archive).
DEFAULT_MAX_INPUT_BYTES = 64 * 1024 * 1024
#: Default cap on the changed files' contents carried back by one call (bytes, all files).
DEFAULT_MAX_OUTPUT_BYTES = 16 * 1024 * 1024
#: Inputs up to this size travel inside the call itself; larger ones go through ``ray.put``.
INLINE_INPUT_BYTES = 64 * 1024
#: Most entries one input archive may hold.
MAX_INPUT_ENTRIES = 100_000
#: How long :class:`SandboxActorPool` waits for its actors' start checks, seconds.
DEFAULT_START_TIMEOUT_S = 300.0
#: Command run with the pool's Policy at actor start (the node must be able to run it).
PROBE_COMMAND = ("true",)

_UNSET: Any = object()


class ClusterError(LowlevelError):
    """A call could not be served by the pool; the command (if any) has no Result.

    Attributes:
        reason: ``"node_lost"`` (the call's actor died more than ``max_retries`` times),
            ``"no_nodes"`` (no healthy sandbox actor is left), ``"closed"`` (the pool was
            shut down), ``"start"`` (no node passed its start checks), ``"protocol"`` (a bug).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.reason))


@dataclass
class RemoteResult(Result):
    """A :class:`lowlevel.Result` from a node of the cluster, plus where and how it ran.

    ``workspace`` is ``""``: the node's workspace is removed after the run; its changed
    files travel in ``files``.

    Attributes:
        node_id: Ray node id (hex) of the node that ran the call.
        attempts: 1, or more when the call was re-run after an actor died under it.
        lost_nodes: node ids whose actor died while holding this call (``len == attempts - 1``).
        files: content of each regular file the run added or modified, by workspace-relative
            path (``str``; a non-UTF-8 name is decoded with ``surrogateescape``, so
            ``os.fsencode(name)`` gives its bytes back). Directories, symlinks, special and
            hard-linked files are not carried (listed in ``files_omitted``).
        files_truncated: some changed files were left out (the ``max_output_bytes`` budget,
            or their kind).
        files_dropped_bytes: bytes of regular files left out by the budget.
        files_omitted: paths of changed entries not in ``files``, sorted.
    """

    node_id: str = ""
    attempts: int = 1
    lost_nodes: tuple[str, ...] = ()
    files: dict[str, bytes] = field(default_factory=dict)
    files_truncated: bool = False
    files_dropped_bytes: int = 0
    files_omitted: tuple[str, ...] = ()

    @property
    def retried(self) -> bool:
        """True when the call ran more than once (an actor died under it)."""
        return self.attempts > 1

    def file(self, name: str | bytes) -> bytes:
        """The content of changed file ``name`` (``str`` or raw ``bytes`` path); KeyError if absent."""
        return self.files[os.fsdecode(name) if isinstance(name, bytes) else name]

    def to_json(self) -> dict[str, Any]:
        """As :meth:`lowlevel.Result.to_json`; ``files`` maps each path to its size in bytes."""
        d = super().to_json()
        d["files"] = {k: len(v) for k, v in self.files.items()}
        d["lost_nodes"] = list(self.lost_nodes)
        d["files_omitted"] = list(self.files_omitted)
        d["retried"] = self.retried
        return d


@dataclass(frozen=True)
class NodeStatus:
    """What the pool knows about one node.

    Attributes:
        node_id: Ray node id (hex).
        address: the node's IP address as Ray reports it.
        ok: the node passed its start checks and still has a live actor.
        actors: live sandbox actors on the node.
        reason: why the node is not used (``""`` when ``ok``): failed doctor checks, the
            trial run's error, or ``"lost: ..."`` once its actors died.
        doctor: the node's ``lowlevel doctor`` report (``{"ok", "checks"}``), or None.
    """

    node_id: str
    address: str
    ok: bool
    actors: int
    reason: str = ""
    doctor: dict[str, Any] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Call:
    """One call of :meth:`SandboxActorPool.map`: a command and its own arguments.

    Fields left as None take the ``map`` call's defaults.
    """

    command: Sequence[str]
    inputs: Any = None
    stdin: bytes | None = None
    timeout: float | None = _UNSET
    env: Mapping[str, str] | None = None
    policy: Policy | None = None
    limits: Limits | None = None


# ---------------------------------------------------------------------------------------------
# Inputs: packed on the driver, unpacked on the node
# ---------------------------------------------------------------------------------------------


def _norm_name(name: str | bytes) -> str:
    text = os.fsdecode(name) if isinstance(name, bytes) else name
    if not isinstance(text, str) or not text or "\0" in text:
        raise PolicyError(f"input name {name!r} is invalid: use a non-empty relative path")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if text.startswith("/") or not parts or ".." in parts:
        raise PolicyError(f"input name {name!r} must be a relative path without '..'")
    return "/".join(parts)


def pack_inputs(inputs: Any, *, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> bytes:
    """Pack a call's inputs into one tar archive (bytes) for the object store.

    Args:
        inputs: one of
            - a mapping ``{relative path (str or bytes): content (bytes)}``; parent
              directories are implied; a ``str`` content is encoded as UTF-8;
            - a sequence of host paths on *this* machine (files or directories), each packed
              under its base name as ``lowlevel.run(inputs=...)`` copies them (symlinks kept
              as symlinks);
            - ``bytes``: an already packed tar archive (checked on the node).
        max_bytes: refuse archives larger than this (bytes).
    Returns:
        The archive (GNU tar; names are the raw bytes of the paths).
    Raises:
        PolicyError: a bad name, a content that is not bytes, or over ``max_bytes``.
        WorkspaceError: a host path is missing or unreadable.
    """
    if isinstance(inputs, (bytes, bytearray, memoryview)):
        data = bytes(inputs)
    else:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding="utf-8",
                          errors="surrogateescape") as tar:
            if isinstance(inputs, Mapping):
                total = 0
                for raw_name, content in inputs.items():
                    name = _norm_name(raw_name)
                    if isinstance(content, str):
                        content = content.encode()
                    if not isinstance(content, (bytes, bytearray, memoryview)):
                        raise PolicyError(f"input {name!r}: content must be bytes, got {type(content).__name__}")
                    content = bytes(content)
                    total += len(content)
                    if total > max_bytes:
                        raise PolicyError(f"inputs exceed max_input_bytes={max_bytes} (at {name!r}): ship "
                                          "less, or raise max_input_bytes")
                    info = tarfile.TarInfo(name)
                    info.size = len(content)
                    info.mode = 0o644
                    info.mtime = int(time.time())
                    tar.addfile(info, io.BytesIO(content))
            elif isinstance(inputs, (str, os.PathLike)):
                raise PolicyError("inputs must be a mapping, a sequence of paths or tar bytes; wrap a single "
                                  f"path in a list: [{os.fspath(inputs)!r}]")
            else:
                seen: set[str] = set()
                for item in inputs:
                    src = os.fspath(item)
                    name = os.path.basename(os.path.normpath(src))
                    if not os.path.lexists(src):
                        raise WorkspaceError(errno.ENOENT, f"input {src!r} does not exist")
                    if not name or name in (".", ".."):
                        raise WorkspaceError(errno.EINVAL, f"input {src!r} has no usable base name")
                    if name in seen:
                        raise WorkspaceError(errno.EEXIST, f"input {src!r}: two inputs are named {name!r}")
                    seen.add(name)

                    def scrub(info: tarfile.TarInfo) -> tarfile.TarInfo:
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        info.mode &= 0o777
                        return info

                    try:
                        tar.add(src, arcname=name, recursive=True, filter=scrub)
                    except OSError as err:
                        raise WorkspaceError(err.errno or errno.EIO, f"cannot pack input {src!r}: {err}") from err
                    if buf.tell() > max_bytes:
                        raise PolicyError(f"inputs exceed max_input_bytes={max_bytes} (at {src!r}): ship less, "
                                          "or raise max_input_bytes")
        data = buf.getvalue()
    if len(data) > max_bytes:
        raise PolicyError(f"inputs archive is {len(data)} bytes > max_input_bytes={max_bytes}: ship less, "
                          "or raise max_input_bytes")
    return data


def unpack_inputs(data: bytes, root: str) -> list[str]:
    """Unpack a :func:`pack_inputs` archive into the (empty, caller-owned) directory ``root``.

    Only regular files, directories and symlinks; permission bits kept without
    setuid/setgid/sticky; mtimes kept; every path opened component by component with
    ``O_NOFOLLOW`` below ``root`` (a symlink in the archive never redirects a later entry);
    a duplicate name is an error (``O_EXCL``).

    Returns:
        The relative paths created, in archive order.
    Raises:
        WorkspaceError: a corrupt archive, an absolute or ``..`` name, a hard link, device,
            fifo or sparse member, a duplicate, more than :data:`MAX_INPUT_ENTRIES` entries,
            or a symlink in the way (EINVAL / ELOOP / EEXIST with the member named).
    """
    created: list[str] = []
    dir_times: list[tuple[list[str], int]] = []
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:", encoding="utf-8", errors="surrogateescape")
        except tarfile.TarError as err:
            raise WorkspaceError(errno.EINVAL, f"inputs are not a tar archive: {err}") from err
        with tar:
            for count, member in enumerate(_members(tar)):
                if count >= MAX_INPUT_ENTRIES:
                    raise WorkspaceError(errno.E2BIG, f"inputs hold more than {MAX_INPUT_ENTRIES} entries")
                try:
                    rel = _norm_name(member.name)
                except PolicyError as err:
                    raise WorkspaceError(errno.EINVAL, f"refusing input member {member.name!r}: {err}") from None
                parts = rel.split("/")
                mode = member.mode & 0o777
                try:
                    if member.isdir():
                        dfd = open_dir_at(rootfd, parts, create=True)
                        try:
                            os.chmod(dfd, mode | 0o700)
                        finally:
                            os.close(dfd)
                        dir_times.append((parts, int(member.mtime)))
                    elif member.isreg():
                        if member.issparse():
                            raise WorkspaceError(errno.EINVAL, f"refusing input member {rel!r}: sparse file")
                        src = tar.extractfile(member)
                        assert src is not None
                        dfd = open_dir_at(rootfd, parts[:-1], create=True)
                        try:
                            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                         | os.O_CLOEXEC, mode, dir_fd=dfd)
                        finally:
                            os.close(dfd)
                        try:
                            with os.fdopen(fd, "wb", closefd=False) as out:
                                while chunk := src.read(1 << 20):
                                    out.write(chunk)
                            os.fchmod(fd, mode)
                            os.utime(fd, (member.mtime, member.mtime))
                        finally:
                            os.close(fd)
                    elif member.issym():
                        if not member.linkname or "\0" in member.linkname:
                            raise WorkspaceError(errno.EINVAL, f"refusing input member {rel!r}: empty symlink")
                        dfd = open_dir_at(rootfd, parts[:-1], create=True)
                        try:
                            os.symlink(member.linkname, parts[-1], dir_fd=dfd)
                        finally:
                            os.close(dfd)
                    else:
                        kind = "hard link" if member.islnk() else "device or fifo"
                        raise WorkspaceError(errno.EINVAL, f"refusing input member {rel!r}: a {kind} "
                                             "(only files, directories and symlinks travel)")
                except WorkspaceError:
                    raise
                except OSError as err:
                    why = "a symlink is in the way" if err.errno in (errno.ELOOP, errno.ENOTDIR) else err.strerror
                    raise WorkspaceError(err.errno or errno.EIO, f"cannot unpack input {rel!r}: {why}") from err
                created.append(rel)
        for parts, mtime in reversed(dir_times):
            dfd = open_dir_at(rootfd, parts, create=False)
            try:
                os.utime(dfd, (mtime, mtime))
            finally:
                os.close(dfd)
    finally:
        os.close(rootfd)
    return created


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    try:
        while True:
            member = tar.next()
            if member is None:
                return
            yield member
    except tarfile.TarError as err:
        raise WorkspaceError(errno.EINVAL, f"inputs are not a valid tar archive: {err}") from err


def collect_outputs(root: str, paths: Iterable[str], max_bytes: int) -> tuple[dict[str, bytes], int, list[str]]:
    """Read the regular files among ``paths`` (workspace-relative) with a total budget.

    The workspace is untrusted: every component is opened with ``O_NOFOLLOW``; only
    regular files with one link are read; a file is kept whole or not at all.

    Returns:
        ``(files, dropped_bytes, omitted)``: contents by path; bytes of regular files left
        out by the budget; every path not carried (budget, kind, vanished), sorted.
    """
    files: dict[str, bytes] = {}
    omitted: list[str] = []
    dropped = 0
    budget = max_bytes
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel in sorted(set(paths)):
            parts = rel.split("/")
            try:
                dfd = open_dir_at(rootfd, parts[:-1], create=False)
            except OSError:
                omitted.append(rel)
                continue
            try:
                try:
                    st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    omitted.append(rel)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    continue  # a directory is implied by the files under it
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    omitted.append(rel)
                    continue
                if st.st_size > budget:
                    omitted.append(rel)
                    dropped += st.st_size
                    continue
                try:
                    fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                except OSError:
                    omitted.append(rel)
                    continue
                with os.fdopen(fd, "rb") as f:
                    fst = os.fstat(f.fileno())
                    if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(fst.st_mode):
                        omitted.append(rel)
                        continue
                    content = f.read(budget + 1)
                if len(content) > budget:
                    omitted.append(rel)
                    dropped += len(content)
                    continue
                files[rel] = content
                budget -= len(content)
            finally:
                os.close(dfd)
    finally:
        os.close(rootfd)
    return files, dropped, sorted(omitted)


# ---------------------------------------------------------------------------------------------
# The actor (one per node, or per N CPUs)
# ---------------------------------------------------------------------------------------------


_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(Result))


def _remote_result(result: Result, node_id: str, outputs: tuple[dict[str, bytes], int, list[str]]) -> RemoteResult:
    files, dropped, omitted = outputs
    base = {name: getattr(result, name) for name in _RESULT_FIELDS}
    base["workspace"] = ""
    return RemoteResult(**base, node_id=node_id, files=files, files_truncated=bool(omitted),
                        files_dropped_bytes=dropped, files_omitted=tuple(omitted))


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
        (:func:`lowlevel.spec.seccomp.compile_bpf`), so each actor compiles each profile once.
        """
        if key in self.policies:
            return
        if not isinstance(policy, Policy):
            raise PolicyError(f"expected a lowlevel.Policy, got {type(policy).__name__}")
        from lowlevel.spec import seccomp as _seccomp
        if policy.seccomp is not None:
            await asyncio.to_thread(_seccomp.compile_bpf, policy.seccomp)
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
        if timeout is not _UNSET:
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
        return _remote_result(result, self.node_id, outputs)

    async def run(self, spec: dict[str, Any], inputs: bytes | None) -> RemoteResult:
        """One fresh-sandbox call (see :meth:`SandboxActorPool.submit`)."""
        if not self.started:
            raise ClusterError("this sandbox actor did not pass its start checks", "no_nodes")
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            policy = self._policy(spec["policy_key"])
            return await self._run_fresh(spec["command"], policy, inputs, spec["stdin"],
                                         spec.get("timeout", _UNSET), spec["env"], spec["cwd"])
        finally:
            self.active -= 1

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
        if spec.get("timeout", _UNSET) is not _UNSET:
            kwargs["timeout"] = spec["timeout"]
        result = await session.run(spec["command"], **kwargs)
        changed = result.changes.added + result.changes.modified
        outputs: tuple[dict[str, bytes], int, list[str]] = ({}, 0, [])
        if changed:
            outputs = await asyncio.to_thread(collect_outputs, session.workspace, changed,
                                              int(self.config["max_output_bytes"]))
        self.calls += 1
        return _remote_result(result, self.node_id, outputs)

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

        ``calls`` served; ``in_flight`` calls in the actor now (running or waiting for a
        Runner slot) and ``peak_in_flight`` the most at once; ``running`` sandboxes now;
        ``sessions`` open; ``policies`` distinct Policies received; ``seccomp_cache_entries``
        filters compiled in this process.
        """
        from lowlevel.spec import seccomp as _seccomp
        cache = getattr(_seccomp, "_cache", None)
        return {"node_id": self.node_id, "pid": os.getpid(), "calls": self.calls, "in_flight": self.active,
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


# ---------------------------------------------------------------------------------------------
# The router (one per pool, on the driver's node)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    key: str
    handle: Any
    node_id: str
    capacity: int
    in_flight: int = 0
    dispatched: int = 0
    alive: bool = True


#: Errors that mean "the actor (or its node) is gone": the call may be re-run elsewhere.
_LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


class _Router:
    """Spreads fresh-sandbox calls over the live actors (least loaded first, at most
    ``capacity`` in flight per actor) and re-runs the calls of an actor that died.

    Runs on one event loop (an async actor): slot bookkeeping needs no lock, only the
    waiters for a free slot are parked on futures.
    """

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries
        self.slots: dict[str, _Slot] = {}
        self.policies: dict[str, Policy] = {}
        self.lost: dict[str, str] = {}
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closed = False

    def _wake(self, everyone: bool = False) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                if not everyone:
                    return

    async def add(self, entries: list[tuple[str, Any, str, int]]) -> None:
        """Take new actors into rotation, after giving them every registered Policy."""
        sent: set[str] = set()
        while todo := [k for k in self.policies if k not in sent]:  # add_policy may run meanwhile
            await asyncio.gather(*(handle.add_policy.remote(k, self.policies[k]) for _, handle, _, _ in entries
                                   for k in todo), return_exceptions=True)
            sent.update(todo)
        for key, handle, node_id, capacity in entries:  # no await since the check: none missed
            self.slots[key] = _Slot(key, handle, node_id, capacity)
        self._wake(everyone=True)

    async def add_policy(self, key: str, policy: Policy) -> None:
        """Register a Policy with every live actor (once per Policy value per pool).

        An actor that cannot take it (dead) is left to the next call to find out.
        """
        if key in self.policies:
            return
        self.policies[key] = policy
        live = [s for s in self.slots.values() if s.alive]
        await asyncio.gather(*(s.handle.add_policy.remote(key, policy) for s in live), return_exceptions=True)

    async def status(self) -> dict[str, Any]:
        return {"actors": [(s.key, s.node_id, s.alive, s.in_flight, s.capacity, s.dispatched)
                           for s in self.slots.values()], "lost": dict(self.lost),
                "router_node": ray.get_runtime_context().get_node_id(), "router_pid": os.getpid()}

    async def close(self) -> None:
        self.closed = True
        self._wake(everyone=True)

    async def _acquire(self) -> _Slot:
        while True:
            if self.closed:
                raise ClusterError("the pool is shut down", "closed")
            best: _Slot | None = None
            any_live = False
            for s in self.slots.values():
                if not s.alive:
                    continue
                any_live = True
                if s.in_flight < s.capacity and (best is None or (s.in_flight / s.capacity, s.dispatched)
                                                 < (best.in_flight / best.capacity, best.dispatched)):
                    best = s
            if best is not None:
                best.in_flight += 1
                best.dispatched += 1
                return best
            if not any_live:
                raise ClusterError("no healthy sandbox actor is left in the pool"
                                   + (f" (lost: {self.lost})" if self.lost else ""), "no_nodes")
            fut = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake()  # pass the wake-up on: this waiter no longer wants the slot
                raise

    def _release(self, slot: _Slot) -> None:
        slot.in_flight -= 1
        self._wake()

    def _mark_lost(self, slot: _Slot, err: BaseException) -> None:
        if slot.alive:
            slot.alive = False
            self.lost[slot.node_id] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            log.warning("lowlevel.ray: sandbox actor on node %s lost: %s", slot.node_id, err)
            try:
                ray.kill(slot.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._wake(everyone=True)

    async def ping(self) -> str:
        """The path of a call without the sandbox (driver -> router -> actor and back): for the bench."""
        slot = await self._acquire()
        try:
            node: str = await slot.handle.ping.remote()
            return node
        finally:
            self._release(slot)

    async def submit(self, spec: dict[str, Any], inputs_box: list[Any]) -> RemoteResult:
        lost_nodes: list[str] = []
        while True:
            slot = await self._acquire()
            ref = slot.handle.run.remote(spec, inputs_box[0] if inputs_box else None)
            try:
                result: RemoteResult = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            except _LOST as err:
                self._mark_lost(slot, err)
                lost_nodes.append(slot.node_id)
                if len(lost_nodes) > self.max_retries:
                    raise ClusterError(f"the call's sandbox actor died {len(lost_nodes)} times (nodes "
                                       f"{lost_nodes}); max_retries={self.max_retries}", "node_lost") from None
                continue
            except ray.exceptions.RayTaskError as err:
                cause = getattr(err, "cause", None)
                if isinstance(cause, BaseException):
                    raise cause from None
                raise
            finally:
                self._release(slot)
            result.attempts = len(lost_nodes) + 1
            result.lost_nodes = tuple(lost_nodes)
            return result


# ---------------------------------------------------------------------------------------------
# The driver's view
# ---------------------------------------------------------------------------------------------


def _unwrap(err: BaseException) -> BaseException:
    """The lowlevel exception inside a Ray error (``RayTaskError.cause``), else ``err``."""
    seen = 0
    while isinstance(err, ray.exceptions.RayTaskError) and seen < 5:
        cause = getattr(err, "cause", None)
        if not isinstance(cause, BaseException):
            break
        err = cause
        seen += 1
    return err


def _check_command(command: Sequence[str]) -> list[str]:
    if isinstance(command, (str, bytes)) or not command or \
            not all(isinstance(a, str) and "\0" not in a for a in command):
        raise PolicyError(f"command must be a non-empty list of str without NUL, got {command!r}")
    return list(command)


class SandboxActorPool:
    """A pool of sandbox actors across the nodes of a Ray cluster (needs ``ray.init()`` first).

    One actor per alive node (``cpus_per_actor=None``), or ``max(1, node CPUs //
    cpus_per_actor)`` per node. Each actor checks its node at start (``lowlevel doctor``
    and a trial run of ``policy``): a node that fails is reported by :meth:`nodes` and gets
    no calls. A router actor on the driver's node sends each call to the least loaded live
    actor, at most ``max_in_flight`` per actor (the rest wait in the router, holding only
    a reference to their inputs), and re-runs the calls of an actor that died.

    Args:
        policy: the default :class:`lowlevel.Policy` for calls and sessions; each node must
            be able to run it. Default ``Policy()``.
        cpus_per_actor: None for one actor per node, else one per this many CPUs of a node.
        concurrency: sandboxes one actor runs at once (its :class:`lowlevel.Runner`'s
            ``max_concurrency``); default ``max(2, 2 * CPUs)`` of the actor's share.
        max_in_flight: calls sent to one actor at once (running plus queued in the actor);
            default ``2 * concurrency``.
        max_retries: how many times a call is re-run after the actor holding it died.
        nodes: restrict to these Ray node ids (hex); default every alive node.
        max_input_bytes: cap on one call's packed inputs.
        max_output_bytes: cap on the changed files' contents one call carries back.
        workspace_base: parent of the nodes' workspaces (default ``/tmp/lowlevel-<uid>``
            on each node, or ``$LOWLEVEL_WORKSPACE_BASE`` there).
        actor_options: extra ``.options(...)`` for the sandbox actors (e.g. ``num_cpus=4``
            to reserve CPUs in Ray's accounting; default ``num_cpus=0``: sandboxes are not
            Ray tasks, size ``concurrency`` instead).
        start_timeout: seconds to wait for the actors' start checks.
    Raises:
        PolicyError: a bad argument.
        ClusterError: ``reason="start"`` when no node passed its checks (the message lists
            each node's reason); ``RuntimeError`` when Ray is not initialised.
    """

    def __init__(self, policy: Policy | None = None, *, cpus_per_actor: float | None = None,
                 concurrency: int | None = None, max_in_flight: int | None = None, max_retries: int = 3,
                 nodes: Sequence[str] | None = None, max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
                 max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES, workspace_base: str | None = None,
                 actor_options: Mapping[str, Any] | None = None,
                 start_timeout: float = DEFAULT_START_TIMEOUT_S) -> None:
        if not ray.is_initialized():
            raise RuntimeError("SandboxActorPool needs a Ray connection: call ray.init() (or ray.init(address=...)) "
                               "first")
        if policy is not None and not isinstance(policy, Policy):
            raise PolicyError(f"policy must be a lowlevel.Policy, got {type(policy).__name__}")
        for name, value in (("concurrency", concurrency), ("max_in_flight", max_in_flight)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PolicyError(f"{name} must be an int >= 1 or None, got {value!r}")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise PolicyError(f"max_retries must be an int >= 0, got {max_retries!r}")
        for name, value in (("max_input_bytes", max_input_bytes), ("max_output_bytes", max_output_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PolicyError(f"{name} must be a byte count >= 0, got {value!r}")
        if cpus_per_actor is not None and not (isinstance(cpus_per_actor, (int, float)) and cpus_per_actor > 0):
            raise PolicyError(f"cpus_per_actor must be a number > 0 or None, got {cpus_per_actor!r}")
        self.policy = policy or Policy()
        self.max_input_bytes = max_input_bytes
        self.max_output_bytes = max_output_bytes
        self.max_retries = max_retries
        self._concurrency = concurrency
        self._max_in_flight = max_in_flight
        self._cpus_per_actor = cpus_per_actor
        self._workspace_base = workspace_base
        self._actor_options = dict(actor_options or {})
        self._start_timeout = start_timeout
        self._only_nodes = set(nodes) if nodes is not None else None
        self._policy_keys: dict[Policy, str] = {}
        self._actors: dict[str, tuple[Any, str]] = {}      # key -> (handle, node_id)
        self._node_info: dict[str, NodeStatus] = {}
        self._sessions: set[RemoteSession] = set()
        self._closed = False
        # The router lives and dies with the driver's node (hard affinity: Ray's soft affinity
        # may place it elsewhere, and the driver would then lose every call in flight with a
        # node it does not even use).
        driver_node = ray.get_runtime_context().get_node_id()
        self._router = ray.remote(_Router).options(
            num_cpus=0, max_concurrency=100_000, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=driver_node, soft=False),
        ).remote(max_retries)
        self._actor_cls = ray.remote(SandboxActor)
        try:
            self.refresh()
            if not self._actors:
                why = "; ".join(f"node {s.node_id[:12]}: {s.reason}" for s in self._node_info.values())
                raise ClusterError("no node can run sandboxes for this pool: " + (why or "no alive node"), "start")
        except BaseException:
            self.shutdown()
            raise

    # -- membership --------------------------------------------------------------------------
    def _policy_key(self, policy: Policy) -> str:
        """The key calls carry instead of the Policy (19 KB pickled for the default one).

        A new Policy value is registered once with the router, which hands it to every
        actor before this returns (one blocking round trip per distinct Policy); a call
        then names it by key, so the Policy is never pickled per call.
        """
        key = self._policy_keys.get(policy)
        if key is None:
            key = f"p{len(self._policy_keys)}"
            ray.get(self._router.add_policy.remote(key, policy))
            self._policy_keys[policy] = key
        return key

    def refresh(self) -> list[NodeStatus]:
        """Start actors on alive nodes that have none yet (new nodes of an autoscaling cluster).

        Returns:
            The status of the nodes examined this time (see :meth:`nodes`).
        """
        if self._closed:
            raise ClusterError("the pool is shut down", "closed")
        have = {node for _, node in self._actors.values()} | set(self._node_info)
        pending: list[tuple[str, Any, str, int, Any]] = []
        addresses: dict[str, str] = {}
        key = self._policy_key(self.policy)
        for node in ray.nodes():
            node_id = node["NodeID"]
            if not node.get("Alive") or node_id in have:
                continue
            if self._only_nodes is not None and node_id not in self._only_nodes:
                continue
            addresses[node_id] = node.get("NodeManagerAddress", "")
            cpus = float(node.get("Resources", {}).get("CPU", 1.0))
            count = 1 if self._cpus_per_actor is None else max(1, int(cpus // self._cpus_per_actor))
            share = cpus if self._cpus_per_actor is None else min(cpus, float(self._cpus_per_actor))
            concurrency = self._concurrency or max(2, min(64, int(2 * share)))
            in_flight = self._max_in_flight or 2 * concurrency
            config = {"concurrency": concurrency, "max_output_bytes": self.max_output_bytes,
                      "workspace_base": self._workspace_base}
            options = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 10_000,
                       **self._actor_options,
                       "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}
            for i in range(count):
                handle = self._actor_cls.options(**options).remote(config)
                pending.append((f"{node_id}/{i}", handle, node_id, in_flight, handle.start.remote(key, self.policy)))
        examined: dict[str, NodeStatus] = {}
        ready: list[tuple[str, Any, str, int]] = []
        deadline = time.monotonic() + self._start_timeout
        for akey, handle, node_id, in_flight, start_ref in pending:
            try:
                report = ray.get(start_ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as err:  # noqa: BLE001 - the node is reported, not used
                report = {"ok": False, "reason": f"actor did not start: {type(_unwrap(err)).__name__}: "
                          f"{str(_unwrap(err)).splitlines()[0] if str(_unwrap(err)) else ''}", "doctor": None}
            if report["ok"]:
                ready.append((akey, handle, node_id, in_flight))
                self._actors[akey] = (handle, node_id)
            else:
                log.warning("lowlevel.ray: node %s not used: %s", node_id, report["reason"])
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            prev = examined.get(node_id)
            actors = (prev.actors if prev else 0) + (1 if report["ok"] else 0)
            reason = report["reason"] if not report["ok"] else (prev.reason if prev else "")
            examined[node_id] = NodeStatus(node_id, addresses.get(node_id, ""), actors > 0, actors,
                                           "" if actors else reason, report.get("doctor"))
        if ready:
            ray.get(self._router.add.remote(ready))
        self._node_info.update(examined)
        return list(examined.values())

    def nodes(self) -> list[NodeStatus]:
        """Every node the pool examined: used (``ok``) or not, with the reason.

        A node whose actors died since shows ``ok=False`` and ``reason="lost: ..."``.
        """
        status = ray.get(self._router.status.remote())
        alive: dict[str, int] = {}
        for _, node_id, is_alive, *_ in status["actors"]:
            alive[node_id] = alive.get(node_id, 0) + (1 if is_alive else 0)
        out = []
        for node_id, info in self._node_info.items():
            if info.ok and alive.get(node_id, 0) == 0:
                info = dataclasses.replace(info, ok=False, actors=0,
                                           reason="lost: " + status["lost"].get(node_id, "actor died"))
            elif info.ok:
                info = dataclasses.replace(info, actors=alive[node_id])
            out.append(info)
        return out

    def stats(self) -> list[dict[str, Any]]:
        """Each live actor's counters (:meth:`SandboxActor.stats`)."""
        refs = [handle.stats.remote() for handle, _ in self._actors.values()]
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=30))
            except Exception:  # noqa: BLE001 - a dead actor has no stats
                pass
        return out

    # -- calls -------------------------------------------------------------------------------
    def _spec(self, command: Sequence[str], policy: Policy | None, limits: Limits | None, stdin: bytes | None,
              timeout: Any, env: Mapping[str, str] | None, cwd: str | None) -> dict[str, Any]:
        if self._closed:
            raise ClusterError("the pool is shut down", "closed")
        if policy is not None and not isinstance(policy, Policy):
            raise PolicyError(f"policy must be a lowlevel.Policy, got {type(policy).__name__}")
        policy = policy or self.policy
        if limits is not None:
            if not isinstance(limits, Limits):
                raise PolicyError(f"limits must be a lowlevel.Limits, got {type(limits).__name__}")
            policy = dataclasses.replace(policy, limits=limits)
        if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
            raise PolicyError(f"stdin must be bytes or None, got {type(stdin).__name__}")
        if stdin is not None and len(stdin) > self.max_input_bytes:
            raise PolicyError(f"stdin is {len(stdin)} bytes > max_input_bytes={self.max_input_bytes}")
        if timeout is not _UNSET and timeout is not None and \
                (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
            raise PolicyError(f"timeout must be seconds > 0 or None, got {timeout!r}")
        spec: dict[str, Any] = {"command": _check_command(command), "policy_key": self._policy_key(policy),
                                "stdin": bytes(stdin) if stdin is not None else None,
                                "env": dict(env) if env else None, "cwd": cwd}
        if timeout is not _UNSET:
            spec["timeout"] = timeout
        return spec

    def _inputs(self, inputs: Any) -> Any:
        """``None``, inline tar bytes, or an ObjectRef of tar bytes."""
        if inputs is None:
            return None
        if isinstance(inputs, ray.ObjectRef):
            return inputs
        data = pack_inputs(inputs, max_bytes=self.max_input_bytes)
        return data if len(data) <= INLINE_INPUT_BYTES else ray.put(data)

    def put_inputs(self, inputs: Any) -> Any:
        """Pack ``inputs`` (as :func:`pack_inputs`) and put them in the object store once.

        Pass the returned ObjectRef as ``inputs=`` to many calls (the same repository for a
        thousand tasks): each node fetches it once.
        """
        return ray.put(pack_inputs(inputs, max_bytes=self.max_input_bytes))

    def submit(self, command: Sequence[str], *, policy: Policy | None = None, inputs: Any = None,
               stdin: bytes | None = None, timeout: float | None = _UNSET, limits: Limits | None = None,
               env: Mapping[str, str] | None = None, cwd: str | None = None) -> Any:
        """Run ``command`` in a fresh sandbox on some node; return ``ObjectRef[RemoteResult]`` at once.

        ``ray.get(ref)`` (or ``await ref`` in asyncio) gives the :class:`RemoteResult`, or
        raises a ``RayTaskError`` that is also the lowlevel exception (``ExecError``,
        ``LaunchError``, :class:`ClusterError`...); :meth:`run` and :meth:`arun` raise the
        lowlevel exception itself.

        Args:
            command: program and arguments as seen inside the sandbox.
            policy: this call's Policy (default: the pool's). Sent to each node once.
            inputs: files for the fresh workspace: ``{path: bytes}``, a list of host paths
                on the driver, tar bytes, or an ObjectRef from :meth:`put_inputs`.
            stdin: bytes for the program's stdin (at most ``max_input_bytes``).
            timeout: wall-clock seconds, as :func:`lowlevel.run` (default its default);
                a timed-out call is a Result (``timed_out=True``), never re-run.
            limits: this call's :class:`lowlevel.Limits` (replaces the Policy's).
            env, cwd: as :func:`lowlevel.run` (``cwd`` None: the Policy's working directory).
        Raises (at once, nothing sent):
            PolicyError: a bad argument, inputs over ``max_input_bytes``.
            WorkspaceError: a host path in ``inputs`` is missing.
            ClusterError: the pool is shut down.
        """
        spec = self._spec(command, policy, limits, stdin, timeout, env, cwd)
        box = self._inputs(inputs)
        return self._router.submit.remote(spec, [box] if box is not None else [])

    def run(self, command: Sequence[str], **kwargs: Any) -> RemoteResult:
        """:meth:`submit` and wait; raises the lowlevel exception itself (not Ray's wrapper)."""
        ref = self.submit(command, **kwargs)
        try:
            result: RemoteResult = ray.get(ref)
        except ray.exceptions.RayError as err:
            raise _unwrap(err) from None
        return result

    async def arun(self, command: Sequence[str], **kwargs: Any) -> RemoteResult:
        """:meth:`run` for an asyncio driver (awaits the ObjectRef; the loop is never blocked)."""
        ref = self.submit(command, **kwargs)
        try:
            result: RemoteResult = await ref
        except ray.exceptions.RayError as err:
            raise _unwrap(err) from None
        return result

    @staticmethod
    def _capacity(status: dict[str, Any]) -> int:
        """Calls the live actors accept at once (the backpressure window of map/amap)."""
        return max(1, int(sum(cap for _, _, alive, _, cap, _ in status["actors"] if alive)))

    def _submit_call(self, item: Any, defaults: dict[str, Any]) -> Any:
        if isinstance(item, Call):
            kw = dict(defaults)
            for f in dataclasses.fields(Call):
                value = getattr(item, f.name)
                if f.name != "command" and value is not None and value is not _UNSET:
                    kw[f.name] = value
            if item.timeout is None:
                kw["timeout"] = None
            return self.submit(item.command, **kw)
        return self.submit(item, **defaults)

    def map(self, calls: Iterable[Sequence[str] | Call], *, ordered: bool = True, return_exceptions: bool = False,
            **defaults: Any) -> Iterator[RemoteResult | BaseException]:
        """Run many calls with backpressure; yield their Results (in order, or as they finish).

        At most the pool's total in-flight capacity (``max_in_flight`` x live actors) is
        submitted at a time: inputs are packed and put in the object store only when a
        call's turn comes, so a million-call iterable costs memory for the window only.

        Args:
            calls: commands (lists of str) or :class:`Call` objects.
            ordered: yield in the order of ``calls`` (True) or of completion (False).
            return_exceptions: yield a call's exception instead of raising it (the lowlevel
                exception, unwrapped); otherwise the first failure raises and the calls
                still in flight are cancelled.
            defaults: :meth:`submit` arguments for every call (``policy``, ``inputs``,
                ``timeout``, ``limits``, ``env``, ``stdin``, ``cwd``).
        """
        window = self._capacity(ray.get(self._router.status.remote()))
        it = iter(enumerate(calls))
        pending: dict[Any, int] = {}
        done: dict[int, RemoteResult | BaseException] = {}
        next_out = 0
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) + len(done) < window:
                    try:
                        index, item = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    pending[self._submit_call(item, defaults)] = index
                if not pending and not done:
                    return
                if pending:
                    ready, _ = ray.wait(list(pending), num_returns=1)
                    for ref in ready:
                        index = pending.pop(ref)
                        try:
                            done[index] = ray.get(ref)
                        except ray.exceptions.RayError as err:
                            exc = _unwrap(err)
                            if not return_exceptions:
                                raise exc from None
                            done[index] = exc
                if ordered:
                    while next_out in done:
                        yield done.pop(next_out)
                        next_out += 1
                else:
                    for index in list(done):
                        yield done.pop(index)
        finally:
            for ref in pending:
                ray.cancel(ref)

    async def amap(self, calls: Iterable[Sequence[str] | Call], *, ordered: bool = True,
                   return_exceptions: bool = False, **defaults: Any) -> AsyncIterator[RemoteResult | BaseException]:
        """:meth:`map` for an asyncio driver: ``async for result in pool.amap(...)``."""
        window = self._capacity(await self._router.status.remote())
        it = iter(enumerate(calls))
        pending: dict[asyncio.Future[Any], tuple[int, Any]] = {}
        done: dict[int, RemoteResult | BaseException] = {}
        next_out = 0
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) + len(done) < window:
                    try:
                        index, item = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    ref = self._submit_call(item, defaults)
                    pending[asyncio.wrap_future(ref.future())] = (index, ref)
                if not pending and not done:
                    return
                if pending:
                    finished, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
                    for fut in finished:
                        index, _ = pending.pop(fut)
                        try:
                            done[index] = fut.result()
                        except ray.exceptions.RayError as err:
                            exc = _unwrap(err)
                            if not return_exceptions:
                                raise exc from None
                            done[index] = exc
                if ordered:
                    while next_out in done:
                        yield done.pop(next_out)
                        next_out += 1
                else:
                    for index in list(done):
                        yield done.pop(index)
        finally:
            for fut, (_, ref) in pending.items():
                ray.cancel(ref)
                fut.cancel()

    # -- sessions ----------------------------------------------------------------------------
    def open_session(self, policy: Policy | None = None, *, inputs: Any = None, node_id: str | None = None,
                     idle_timeout: float | None = None, total_timeout: float | None = None,
                     track_changes: bool = True) -> "RemoteSession":
        """Start a :class:`lowlevel.Session` on one node; its calls all go to that node's actor.

        Args:
            policy: the session's Policy (default the pool's).
            inputs: files for the session's workspace (as :meth:`submit`).
            node_id: pin to this node (hex id); default the live actor with fewest sessions.
            idle_timeout, total_timeout: as :class:`lowlevel.Session`.
            track_changes: each Result carries the files the command added or modified.
        Raises:
            ClusterError: no live actor (on ``node_id``).
            SessionError: ``reason="node_lost"`` when the node died during the start.
            PolicyError, WorkspaceError, LaunchError, UnsupportedError: as :class:`lowlevel.Session`.
        """
        if self._closed:
            raise ClusterError("the pool is shut down", "closed")
        policy = policy or self.policy
        status = ray.get(self._router.status.remote())
        alive_keys = {key for key, _, alive, *_ in status["actors"] if alive}
        candidates = [(key, handle, node) for key, (handle, node) in self._actors.items()
                      if key in alive_keys and (node_id is None or node == node_id)]
        if not candidates:
            raise ClusterError("no live sandbox actor" + (f" on node {node_id}" if node_id else ""), "no_nodes")
        load: dict[str, int] = {}
        for s in self._sessions:
            load[s._actor_key] = load.get(s._actor_key, 0) + 1
        key, handle, node = min(candidates, key=lambda c: load.get(c[0], 0))
        pkey = self._policy_key(policy)
        packed = pack_inputs(inputs, max_bytes=self.max_input_bytes) if inputs is not None and \
            not isinstance(inputs, ray.ObjectRef) else inputs
        options = {"idle_timeout": idle_timeout, "total_timeout": total_timeout, "track_changes": track_changes}
        try:
            sid = ray.get(handle.session_open.remote(pkey, packed, options))
        except ray.exceptions.RayActorError as err:
            raise SessionError(f"the session's node {node} was lost while it started: {err}", "node_lost") from None
        except ray.exceptions.RayError as err:
            raise _unwrap(err) from None
        session = RemoteSession(self, key, handle, node, sid)
        self._sessions.add(session)
        return session

    # -- lifecycle ---------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Close every session, cancel calls in flight, kill the actors; idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in list(self._sessions):
            s._closed = True
        self._sessions.clear()
        try:
            ray.get(self._router.close.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - best effort
            pass
        refs = [handle.shutdown.remote() for handle, _ in self._actors.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for handle, _ in self._actors.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        try:
            ray.kill(self._router, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        self._actors.clear()

    close = shutdown

    def __enter__(self) -> "SandboxActorPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> "SandboxActorPool":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.shutdown)


class RemoteSession:
    """A :class:`lowlevel.Session` on one node of the pool (from :meth:`SandboxActorPool.open_session`).

    Every call goes to the same actor, hence the same sandbox and workspace. Nothing is
    re-run elsewhere: when the node's actor dies, each call raises
    :class:`lowlevel.SessionError` with ``reason="node_lost"``.

    Attributes:
        node_id: the node the session lives on.
    """

    def __init__(self, pool: SandboxActorPool, actor_key: str, handle: Any, node_id: str, sid: str) -> None:
        self._pool = pool
        self._actor_key = actor_key
        self._handle = handle
        self.node_id = node_id
        self._sid = sid
        self._closed = False

    def _spec(self, command: Sequence[str], stdin: bytes | None, timeout: Any, env: Mapping[str, str] | None,
              cwd: str | None, limits: Limits | None, track_changes: bool | None) -> dict[str, Any]:
        if self._closed:
            raise SessionError("the session is closed", "closed")
        if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
            raise PolicyError(f"stdin must be bytes or None, got {type(stdin).__name__}")
        if limits is not None and not isinstance(limits, Limits):
            raise PolicyError(f"limits must be a lowlevel.Limits, got {type(limits).__name__}")
        spec: dict[str, Any] = {"command": _check_command(command), "stdin": bytes(stdin) if stdin else stdin,
                                "env": dict(env) if env else None, "cwd": cwd, "limits": limits,
                                "track_changes": track_changes}
        if timeout is not _UNSET:
            spec["timeout"] = timeout
        return spec

    def _lost(self, err: BaseException) -> SessionError:
        self._closed = True
        self._pool._sessions.discard(self)
        return SessionError(f"the session's node {self.node_id} was lost: {type(err).__name__}", "node_lost")

    def submit(self, command: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = _UNSET,
               env: Mapping[str, str] | None = None, cwd: str | None = None, limits: Limits | None = None,
               track_changes: bool | None = None) -> Any:
        """Send one command; return ``ObjectRef[RemoteResult]`` (Ray's errors unconverted: prefer :meth:`run`)."""
        return self._handle.session_run.remote(self._sid, self._spec(command, stdin, timeout, env, cwd, limits,
                                                                     track_changes))

    def run(self, command: Sequence[str], **kwargs: Any) -> RemoteResult:
        """Run one command in the session and wait (arguments as :meth:`lowlevel.Session.run`).

        Raises:
            SessionError: ``"node_lost"`` (the node's actor died), ``"closed"``, or the
                session's own reasons (``"init_died"``...).
            ExecError, LaunchError, PolicyError: as :meth:`lowlevel.Session.run`.
        """
        ref = self.submit(command, **kwargs)
        try:
            result: RemoteResult = ray.get(ref)
        except _LOST as err:
            raise self._lost(err) from None
        except ray.exceptions.RayError as err:
            raise _unwrap(err) from None
        return result

    async def arun(self, command: Sequence[str], **kwargs: Any) -> RemoteResult:
        """:meth:`run` for an asyncio driver."""
        ref = self.submit(command, **kwargs)
        try:
            result: RemoteResult = await ref
        except _LOST as err:
            raise self._lost(err) from None
        except ray.exceptions.RayError as err:
            raise _unwrap(err) from None
        return result

    def read_file(self, relpath: str, max_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> bytes:
        """One regular file of the session's workspace (as :func:`lowlevel.workspace.read_file`)."""
        if self._closed:
            raise SessionError("the session is closed", "closed")
        try:
            data: bytes = ray.get(self._handle.session_read.remote(self._sid, relpath, max_bytes))
        except _LOST as err:
            raise self._lost(err) from None
        except ray.exceptions.RayError as err:
            raise _unwrap(err) from None
        return data

    def close(self) -> None:
        """End the session on its node and remove its workspace; idempotent (a lost node is fine)."""
        if self._closed:
            return
        self._closed = True
        self._pool._sessions.discard(self)
        try:
            ray.get(self._handle.session_close.remote(self._sid), timeout=60)
        except Exception:  # noqa: BLE001 - the node may be gone; nothing left to close then
            pass

    def __enter__(self) -> "RemoteSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DEFAULT_MAX_INPUT_BYTES", "DEFAULT_MAX_OUTPUT_BYTES", "Call", "ClusterError", "NodeStatus",
           "RemoteResult", "RemoteSession", "SandboxActor", "SandboxActorPool", "collect_outputs", "pack_inputs",
           "unpack_inputs"]
