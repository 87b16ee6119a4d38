"""The ``lowlevel`` sandbox provider for Inspect (``inspect-ai``): one lowlevel session per sample.

Use it in a task as ``sandbox="lowlevel"`` or ``sandbox=("lowlevel", "lowlevel.toml")``; a
``lowlevel.toml`` next to the task is found on its own (:meth:`config_files`). Installing
``lowlevel[inspect]`` registers the provider through Inspect's ``inspect_ai`` entry point, so
the name resolves without importing anything by hand. The config file is the shared format of
:mod:`lowlevel.integrations._config` (a :class:`lowlevel.Policy`: limits, binds, network mode,
environment; plus ``workspace_base`` and ``default_timeout_s``); a
:class:`LowlevelSandboxConfig` object works too.

Contract, as Inspect's ``SandboxEnvironment`` documents it (``inspect_ai/util/_sandbox/
environment.py``) and its conformance suite (``inspect_ai.util._sandbox.self_check``) checks it:

- ``sample_init`` starts one :class:`lowlevel.AsyncSession` (one bwrap sandbox with the Policy's
  mounts, seccomp filter and limits) on a fresh workspace; ``sample_cleanup`` kills everything
  in it and removes the workspace. Every ``exec`` of the sample is a command of that session:
  the workspace, ``/tmp`` and background processes persist across calls, each call has its own
  process group, stdio, env, cwd and timeout.
- ``exec``: ``cmd[0]`` is resolved through the sandbox's ``PATH`` (with ``env`` applied); cwd
  defaults to ``/workspace``, relative ones resolve against it. ``timeout`` SIGKILLs the
  command's whole process tree and raises ``TimeoutError`` (its partial output in
  ``truncated_output``); a command killed by a signal (an OOM kill, its own ``kill``) returns
  ``128 + N``. A missing executable returns exit 127 with the shell's message; a file that is
  not executable raises ``PermissionError``; a dead sandbox raises ``SandboxUnavailableError``;
  an output stream over ``SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE`` (or over the Policy's
  ``stdout_limit_bytes``) raises ``OutputLimitExceededError`` with the tail of the stream.
  ``user`` may only name the sandbox's own user (name or uid): anything else raises
  ``SandboxUserUnsupportedError`` (the sandbox has one unprivileged uid and no way to switch).
  ``timeout_retry`` is ignored (there is no daemon whose hang a retry could cure);
  ``concurrency=True`` takes a slot of Inspect's ``subprocesses`` limiter (``max_subprocesses``),
  as the local and docker providers do.
- ``write_file``/``read_file`` act inside the sandbox (so ``/tmp/x`` works and the sandbox's uid
  owns what is written), text or bytes, parents created on write; errors are
  ``FileNotFoundError``, ``IsADirectoryError``, ``PermissionError`` (a read-only location
  included), and ``OutputLimitExceededError`` above ``MAX_READ_FILE_SIZE``.
- ``max_sandboxes`` bounds the live sessions (Inspect enforces it around ``sample_init``);
  :meth:`default_concurrency` is ``2 * CPUs``, as for docker.
- ``connection`` raises ``NotImplementedError``: nothing can join a live bwrap sandbox without
  bypassing its seccomp filter and uid drop; the workspace path is in the message.
- Workspaces: each sample's session works on a fresh directory through lowlevel's
  copy-on-write overlay with ``commit=False``: its writes stay in the bounded upper layer
  (``Limits.workspace_bytes``) and are dropped with it. ``--no-sandbox-cleanup``: the sessions
  are still ended at ``task_cleanup`` (no process outlives the eval) but their changes are
  committed first and the directories kept and logged.

- Inspect's injected sandbox tools (``bash_session()``, ``text_editor()``, ``exec_remote``,
  sandbox MCP servers): on the host system (no ``image``/``rootfs``) each sandbox gets a
  read-only ``/var`` holding only ``tmp -> /tmp`` and the host's ``/etc/os-release``
  (:func:`_with_tool_support`), so Inspect extracts its tools tree into the sandbox's own
  ``/tmp`` and runs it as the sandbox's unprivileged user, under the same seccomp filter,
  Landlock rules, limits and network as every command; its server (``start-server``) runs as
  a background command of the session (a command's leftovers die with it). With an image or
  rootfs, or a bind under ``/var``, the injection fails with a one-line message naming the
  tools (:func:`_tools_refusal`).

Not supported: ``web_browser`` (it needs a browser in the sandbox and network); docker
images and compose files. asyncio backend only (the session is driven by the asyncio event
loop).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shlex
import shutil
import stat
import tempfile
import threading
from collections.abc import Sequence
from typing import Any, Literal, TYPE_CHECKING, overload

try:
    import anyio
    from inspect_ai.util import (ExecResult, OutputLimitExceededError, SandboxConnection, SandboxEnvironment,
                                 SandboxEnvironmentConfigType, SandboxEnvironmentLimits, sandboxenv)
    from inspect_ai.util import concurrency as _inspect_concurrency
    from inspect_ai.util._sandbox.environment import SandboxUnavailableError, SandboxUserUnsupportedError
    from pydantic import BaseModel, ConfigDict
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError("lowlevel.integrations.inspect_sandbox needs Inspect: "
                      "pip install '.[inspect]' in the lowlevel checkout") from _err

import lowlevel
import lowlevel.workspace
from lowlevel import ExecError, LaunchError, LowlevelError, Policy, PolicyError, Result, SessionError

if TYPE_CHECKING:  # the lazy names of lowlevel/__init__.py, spelled for the type checker
    from lowlevel.session import AsyncSession
else:
    from lowlevel import AsyncSession

from . import _files
from ._config import SandboxConfig

log = logging.getLogger("lowlevel.inspect")

#: The config file looked for next to a task when ``sandbox="lowlevel"`` has none.
CONFIG_FILE = "lowlevel.toml"
#: Smallest stdout/stderr cap the provider accepts (read_file moves files in chunks of the cap).
_MIN_OUTPUT_CAP = 64 * 1024


class LowlevelSandboxConfig(BaseModel):
    """The provider's config as an object: ``SandboxEnvironmentSpec("lowlevel", LowlevelSandboxConfig(...))``.

    Fields are those of the TOML file (see :mod:`lowlevel.integrations._config`), as plain
    JSON-able values so Inspect can log and reload them: ``limits`` and ``env`` are tables,
    ``binds`` a list of tables, sizes ints or ``"512M"`` strings.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    network: bool = False
    egress: dict[str, Any] | None = None
    landlock: bool | Literal["require"] = True
    image: str | None = None
    rootfs: str | None = None
    rootfs_writable: bool = False
    workdir: str | None = None
    deterministic: bool = False
    hostname: str = "sandbox"
    env: dict[str, str] = {}
    limits: dict[str, Any] = {}
    binds: list[dict[str, Any]] = []
    stdout_limit_bytes: int | str | None = None
    stderr_limit_bytes: int | str | None = None
    workspace_base: str | None = None
    default_timeout_s: float | None = None

    def __hash__(self) -> int:  # Inspect hashes its (frozen) SandboxEnvironmentSpec, config included
        return hash(self.model_dump_json())

    def sandbox_config(self) -> SandboxConfig:
        """The validated :class:`SandboxConfig` (raises PolicyError on a bad value)."""
        defaults = {"landlock": True, "rootfs_writable": False}
        data = {k: v for k, v in self.model_dump().items()
                if v is not None and v != {} and v != [] and defaults.get(k, ...) != v}
        return SandboxConfig.from_mapping(data, where="LowlevelSandboxConfig")


def load_config(config: SandboxEnvironmentConfigType | None) -> SandboxConfig:
    """The :class:`SandboxConfig` for Inspect's ``config`` (None, a TOML path, or a model).

    Raises:
        PolicyError: a bad file, key or value (the message names it).
    """
    if config is None:
        return SandboxConfig()
    if isinstance(config, str):
        cfg = SandboxConfig.from_toml(config)
    elif isinstance(config, LowlevelSandboxConfig):
        cfg = config.sandbox_config()
    else:
        raise PolicyError(f"the lowlevel sandbox takes a TOML file path or a LowlevelSandboxConfig, got "
                          f"{type(config).__name__} (a Dockerfile/compose config is docker's, not lowlevel's)")
    for name in ("stdout_limit_bytes", "stderr_limit_bytes"):
        if getattr(cfg.policy, name) < _MIN_OUTPUT_CAP:
            raise PolicyError(f"{name} must be at least {_MIN_OUTPUT_CAP} bytes for the Inspect provider (files are "
                              f"read through stdout in chunks of that size), got {getattr(cfg.policy, name)}")
    return cfg


def _max_subprocesses() -> int:
    try:  # the same limiter Inspect's local and docker providers take a slot of
        from inspect_ai.util._subprocess import max_subprocesses_context_var

        return max(1, int(max_subprocesses_context_var.get()))
    except (ImportError, AttributeError, LookupError):  # pragma: no cover - older/newer Inspect
        return len(os.sched_getaffinity(0))


def _require_asyncio() -> None:
    try:
        import sniffio

        library = sniffio.current_async_library()
    except Exception:  # noqa: BLE001 - no async library detectable: let asyncio report it
        return
    if library != "asyncio":
        raise RuntimeError(f"the lowlevel sandbox needs Inspect's asyncio backend, not {library} "
                           "(unset INSPECT_ASYNC_BACKEND)")


@sandboxenv(name="lowlevel")
class LowlevelSandboxEnvironment(SandboxEnvironment):
    """One sample's sandbox: a :class:`lowlevel.AsyncSession` (see the module docstring)."""

    #: Live environments per config, ended at task_cleanup whatever happened before (Inspect
    #: calls task_init/task_cleanup once per sandbox type and config, with task name
    #: "startup"/"shutdown", so the config is the key shared with sample_init).
    _live: dict[Any, set["LowlevelSandboxEnvironment"]] = {}
    #: Most environments alive at once since the process started (tests read it).
    peak_live = 0

    def __init__(self, session: AsyncSession, config: SandboxConfig, key: Any) -> None:
        super().__init__()
        self.session = session
        self.config = config
        self._key = key
        self._identity: tuple[str, str] | None = None
        self._tools_server: Any = None  # the AsyncProcess of Inspect's tools server, once started

    # -- lifecycle ------------------------------------------------------------------------
    @classmethod
    def config_files(cls) -> list[str]:
        return [CONFIG_FILE]

    @classmethod
    def default_concurrency(cls) -> int | None:
        return 2 * len(os.sched_getaffinity(0))

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return LowlevelSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        _require_asyncio()
        load_config(config)  # fail before the first sample on a bad file

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        _require_asyncio()
        cfg = load_config(config)
        policy = await anyio.to_thread.run_sync(_with_tool_support, cfg)
        # commit=False: a sample's workspace is scratch; its changes stay in the copy-on-write
        # upper layer and go with it (task_cleanup commits them under --no-sandbox-cleanup).
        session = await AsyncSession.create(policy, workspace_base=cfg.workspace_base, commit=False)
        env = cls(session, cfg, config)
        live = cls._live.setdefault(config, set())
        live.add(env)
        LowlevelSandboxEnvironment.peak_live = max(cls.peak_live, sum(len(s) for s in cls._live.values()))
        return {"default": env}

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        for environment in environments.values():
            if isinstance(environment, LowlevelSandboxEnvironment):
                await environment._end(remove=True)

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                           cleanup: bool) -> None:
        for env in list(cls._live.get(config, ())):
            if not cleanup and env.session.alive:
                try:
                    await env.session.commit(running="leave")  # keep the sample's files (the tools server runs on)
                except LowlevelError as err:  # no overlay here: the files are in the directory already
                    log.debug("commit before keeping %s: %s", env.session.directory, err)
            await env._end(remove=cleanup)
            if not cleanup:
                log.info("lowlevel sandbox workspace kept (--no-sandbox-cleanup): %s", env.session.directory)
        cls._live.pop(config, None)

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        return None  # sessions die with the eval's process (bwrap --die-with-parent)

    async def _end(self, *, remove: bool) -> None:
        self._live.get(self._key, set()).discard(self)
        with anyio.CancelScope(shield=True):
            await self.session.close()
            if remove:
                try:
                    await anyio.to_thread.run_sync(lowlevel.workspace.remove_workspace, self.session.directory)
                except LowlevelError as err:
                    log.warning("could not remove lowlevel workspace %s: %s", self.session.directory, err)

    # -- exec -----------------------------------------------------------------------------
    async def exec(self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        if user is not None:
            await self._check_user(user)
        if _is_tools_command(cmd):
            why = _tools_refusal(self.session_policy)
            if why is not None:
                raise RuntimeError(why)
        if timeout is None:
            timeout = self.config.default_timeout_s  # type: ignore[assignment]
        slot: contextlib.AbstractAsyncContextManager[object] = (
            _inspect_concurrency("subprocesses", _max_subprocesses(), resizable=True) if concurrency
            else contextlib.nullcontext())
        if _is_start_server(cmd):
            await self._start_tools_server(cmd[0], env)
        async with slot:
            result = await self._run(cmd, input, cwd, env, timeout)
        if isinstance(result, ExecResult):
            return result
        return _exec_result(result, timeout, self.session_policy)

    async def _start_tools_server(self, launcher: str, env: dict[str, str] | None) -> None:
        """Run Inspect's tools server as a background command of the session.

        ``start-server`` daemonizes the server; a session kills whatever a command leaves
        behind when the command ends (no process outlives its call), so the daemon would die
        with it and the next tool call would find no ``bash_session`` state. The server is
        started here in the foreground (``server``) as a :meth:`lowlevel.AsyncSession.start`
        command, which lives until the session ends; ``start-server`` then finds it running.
        """
        if self._tools_server is not None and self._tools_server.poll() is None:
            return
        self._tools_server = await self.session.start([launcher, "server"], env=env or None, cwd="/")
        sock = os.path.join(os.path.dirname(launcher), ".server", "sandbox-tools.sock")
        wait = f"i=0; while [ ! -S {shlex.quote(sock)} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done"
        await self._run(["/bin/sh", "-c", wait], None, "/", None, 30)

    @property
    def session_policy(self) -> Policy:
        return self.config.policy

    async def _run(self, cmd: Sequence[str], input: str | bytes | None, cwd: str | None,
                   env: dict[str, str] | None, timeout: float | None) -> Result | ExecResult[str]:
        if not cmd:
            raise ValueError("exec: cmd must name a program")
        stdin = input.encode("utf-8") if isinstance(input, str) else (bytes(input) if input is not None else None)
        where = _files.resolve(cwd) if cwd is not None else _files.WORKSPACE
        try:
            return await self.session.run(list(cmd), stdin=stdin, timeout=timeout, env=env or None, cwd=where)
        except ExecError as err:
            if err.errno == errno.ENOENT:
                return ExecResult(False, 127, "", f"{cmd[0]}: No such file or directory\n")
            raise PermissionError(err.errno or errno.EACCES, f"Permission denied executing {cmd[0]!r}",
                                  cmd[0]) from err
        except LaunchError as err:  # chdir (or an rlimit) failed: the command never ran
            reason = os.strerror(err.errno) if err.errno else str(err)
            return ExecResult(False, 126, "", f"lowlevel: cannot change directory to {where}: {reason}\n")
        except SessionError as err:
            raise SandboxUnavailableError(f"The lowlevel sandbox is not running and cannot execute: {err}") from err

    async def _check_user(self, user: str) -> None:
        if self._identity is None:
            probe = await self._run(["/bin/sh", "-c", "id -u; id -un"], None, "/", None, 30)
            if isinstance(probe, Result) and probe.exit_code == 0:
                uid, _, name = probe.stdout.decode("utf-8", "replace").strip().partition("\n")
                self._identity = (uid.strip(), name.strip())
            else:
                self._identity = ("", "")
        if user not in self._identity:
            raise SandboxUserUnsupportedError(
                f"the lowlevel sandbox runs every command as its one unprivileged user "
                f"({self._identity[1] or '?'}, uid {self._identity[0] or '?'}); it cannot run as {user!r}")

    # -- files ----------------------------------------------------------------------------
    async def write_file(self, file: str, contents: str | bytes) -> None:
        path = _files.resolve(file)
        if _files.is_directory_alias(path):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        data = contents.encode("utf-8") if isinstance(contents, str) else bytes(contents)
        result = await self._file_op(_files.write_argv(path), data)
        try:
            _files.check_write(result, path)
        except OSError as err:
            raise type(err)(err.errno, err.strerror, file) from None

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        path = _files.resolve(file)
        if _files.is_directory_alias(path):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE

        async def run(argv: Sequence[str]) -> Result:
            return await self._file_op(argv, None)

        try:
            data = await _files.read_file(run, path, limit, self.session_policy.stdout_limit_bytes)
        except _files.FileTooLargeError:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None) from None
        except OSError as err:
            raise type(err)(err.errno, err.strerror, file) from None
        return data.decode("utf-8") if text else data

    async def _file_op(self, argv: Sequence[str], stdin: bytes | None) -> Result:
        try:
            return await self.session.run(list(argv), stdin=stdin, timeout=600, env=_files.SCRIPT_ENV, cwd="/")
        except SessionError as err:
            raise SandboxUnavailableError(f"The lowlevel sandbox is not running: {err}") from err

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        if not self.session.alive:
            raise ConnectionError("the lowlevel sandbox of this sample is not running")
        raise NotImplementedError(
            "the lowlevel sandbox offers no interactive connection: nothing can join a live bwrap sandbox "
            "without bypassing its seccomp filter and uid drop. Its live workspace view is "
            f"{shlex.quote(self.session.workspace)} on the host (read it as untrusted content)")


#: Where Inspect injects its sandbox-tools tree (``inspect_ai.util._sandbox._cli.SANDBOX_TOOLS_DIR``,
#: ``/var/tmp/.<hash>``): the tools of ``bash_session()``, ``text_editor()``, ``exec_remote``,
#: sandbox MCP servers and the agent bridge.
TOOLS_PARENT = "/var/tmp"
OS_RELEASE = "/etc/os-release"
#: Name of the host directory (in the workspace base) bound read-only at ``/var``: it holds only
#: the symlink ``tmp -> /tmp``.
_VAR_DIR = ".inspect-var"
_VAR_LOCK = threading.Lock()


def _is_tools_command(cmd: Sequence[str]) -> bool:
    """Is ``cmd`` Inspect's tool-support injection or launcher (it names the tools directory)?"""
    try:
        from inspect_ai.util._sandbox._cli import SANDBOX_TOOLS_DIR
    except ImportError:  # pragma: no cover - another Inspect layout: nothing to recognize
        return False
    leaf = os.path.basename(SANDBOX_TOOLS_DIR)
    # The last OS probe before the injection (inspect_ai/util/_sandbox/recon.py) fails on a tree
    # without /etc/os-release or /etc/kali_version: refuse there too, with the reason.
    return any(arg in (SANDBOX_TOOLS_DIR, leaf) or arg.startswith(SANDBOX_TOOLS_DIR + "/")
               or "[ -f /etc/kali_version ]" in arg for arg in cmd)


def _is_start_server(cmd: Sequence[str]) -> bool:
    """Is ``cmd`` Inspect's ``<tools dir>/inspect-sandbox-tools start-server``?"""
    try:
        from inspect_ai.util._sandbox._cli import SANDBOX_TOOLS_DIR
    except ImportError:  # pragma: no cover - another Inspect layout
        return False
    return (len(cmd) == 2 and cmd[1] == "start-server" and os.path.dirname(cmd[0]) == SANDBOX_TOOLS_DIR)


def _tools_refusal(policy: Policy) -> str | None:
    """Why Inspect's sandbox tools cannot be injected under ``policy`` (None: they can)."""
    if policy.rootfs is not None or policy.image is not None:
        return (f"the lowlevel sandbox cannot host Inspect's sandbox tools (bash_session(), text_editor(), "
                f"exec_remote, sandbox MCP servers) with a rootfs or image ({policy.rootfs or policy.image}): "
                "Inspect needs a "
                f"{TOOLS_PARENT} owned by the sandbox's user, and the tree's is read-only and owned by "
                "another uid; use bash() and python(), or the host system (no image/rootfs)")
    for bind in policy.binds:
        if bind.dest == "/var" or bind.dest.startswith("/var/"):
            return (f"the lowlevel sandbox cannot host Inspect's sandbox tools (bash_session(), text_editor()) "
                    f"while a bind owns {bind.dest}: the tools need {TOOLS_PARENT} (the sandbox's /tmp); "
                    "bind it elsewhere, e.g. under /opt")
    return None


def _var_dir(base: str) -> str:
    """The host directory bound at ``/var``: ``<base>/.inspect-var`` holding ``tmp -> /tmp``.

    Created once (atomically: a temporary directory renamed into place), then checked on each
    use: a real directory of ours, mode 0755, holding exactly that symlink; anything else is
    replaced (a squatted entry never reaches a sandbox).
    """
    base = lowlevel.workspace.ensure_base(base)
    path = os.path.join(base, _VAR_DIR)

    def good() -> bool:
        try:
            st = os.lstat(path)
            link = os.path.join(path, "tmp")
            return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o755
                    and os.listdir(path) == ["tmp"] and os.path.islink(link) and os.readlink(link) == "/tmp")
        except OSError:
            return False

    with _VAR_LOCK:  # samples start in threads: one creates it, the others find it made
        if good():
            return path
        fresh = tempfile.mkdtemp(prefix=".inspect-var-", dir=base)
        try:
            os.chmod(fresh, 0o755)
            os.symlink("/tmp", os.path.join(fresh, "tmp"))
            if os.path.lexists(path) and not good():  # a squatted or damaged entry: move it aside
                old = tempfile.mkdtemp(prefix=".inspect-var-old-", dir=base)
                os.rename(path, os.path.join(old, "x"))
                shutil.rmtree(old, ignore_errors=True)
            os.rename(fresh, path)  # fails if another process made it meanwhile: then it is good
        except OSError as err:
            shutil.rmtree(fresh, ignore_errors=True)
            if not good():
                raise PolicyError(f"cannot prepare {path} (the /var of Inspect's sandbox tools): "
                                  f"{err.strerror or err}") from None
    return path


def _with_tool_support(cfg: SandboxConfig) -> Policy:
    """``cfg.policy`` plus what Inspect's sandbox tools need, where they can work.

    Inspect's ``bash_session()`` and ``text_editor()`` (and ``exec_remote``, sandbox MCP
    servers, the agent bridge) extract a PyInstaller tree into ``/var/tmp/.<hash>`` and run a
    server from it (``inspect_ai/tool/_sandbox_tools_utils/sandbox.py``); Inspect's
    framework-directory check (``inspect_ai/util/_sandbox/_framework_directory.py``) wants the
    parent owned by the command's uid or root and not writable by others. The host layout has
    no ``/var``: the provider binds a directory holding only ``tmp -> /tmp`` there read-only,
    so ``/var/tmp`` is the sandbox's own ``/tmp`` (a tmpfs owned by the sandbox user, mode
    0755, inside ``Limits.tmp_size_bytes``, writable and executable under Landlock). The tools
    then run as that same unprivileged user, with the same seccomp filter, limits and network
    as every other command (the tools cannot run as root: there is none). With a rootfs or
    image, or a bind under ``/var``, nothing is added and the injection fails with
    :func:`_tools_refusal`'s message.
    """
    policy = cfg.policy
    if policy.rootfs is not None or policy.image is not None:
        return policy
    extra = []
    # Inspect's OS probe (inspect_ai/util/_sandbox/recon.py) reads /etc/os-release, which the
    # host layout leaves out: the host's, read-only (the distribution's name and version). Bound
    # even where the tools are refused, so the refusal (not a failed probe) is what Inspect reports.
    release = os.path.realpath(OS_RELEASE)
    if os.path.isfile(release) and not any(b.dest == OS_RELEASE for b in policy.binds):
        extra.append(lowlevel.Bind(release, OS_RELEASE))
    if _tools_refusal(policy) is None:
        extra.append(lowlevel.Bind(_var_dir(cfg.workspace_base or lowlevel.workspace.default_base()), "/var"))
    return dataclasses.replace(policy, binds=(*policy.binds, *extra)) if extra else policy


def _human(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} bytes"


def _exec_result(result: Result, timeout: float | None, policy: Policy) -> ExecResult[str]:
    """Inspect's view of a finished command (see the module docstring for the mapping)."""
    if result.timed_out:
        error = TimeoutError(f"Command timed out after {timeout} seconds")
        partial = (result.stdout + result.stderr).decode("utf-8", "replace")
        if partial:
            error.truncated_output = partial  # type: ignore[attr-defined]  # docker's convention
        raise error
    limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
    for data, truncated, cap in ((result.stdout, result.stdout_truncated, policy.stdout_limit_bytes),
                                 (result.stderr, result.stderr_truncated, policy.stderr_limit_bytes)):
        if truncated or len(data) > limit:
            shown = min(limit, cap) if truncated else limit
            label = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR if shown == limit else _human(shown)
            tail = data[-max(1, min(limit, cap // 2)):].decode("utf-8", "replace")
            raise OutputLimitExceededError(label, tail)
    return ExecResult(result.exit_code == 0, result.exit_code, result.stdout.decode("utf-8", "replace"),
                      result.stderr.decode("utf-8", "replace"))


__all__ = ["CONFIG_FILE", "LowlevelSandboxConfig", "LowlevelSandboxEnvironment", "load_config"]
