"""An AutoGen ``CodeExecutor`` (autogen-core's protocol) that runs code blocks in a lowlevel session.

Drop-in for ``LocalCommandLineCodeExecutor`` / ``DockerCommandLineCodeExecutor`` (autogen-ext),
with the same block semantics, but every block runs inside one :class:`lowlevel.AsyncSession`
that lives from :meth:`start` to :meth:`stop`::

    async with LowlevelCodeExecutor(policy=lowlevel.Policy(), timeout=30) as executor:
        result = await executor.execute_code_blocks(
            [CodeBlock(language="python", code="print(6 * 7)")], CancellationToken())
        assert result.exit_code == 0 and result.output == "42\\n"

Contract (as autogen-ext's command-line executors define it):

- Languages: ``python`` (and ``py``, ``Python``, ``python3``: run with ``python``, default
  ``python3`` on the sandbox's PATH), ``bash``, ``sh`` and ``shell`` (``sh``). Anything else
  (``pwsh`` included: not in the sandbox) ends the run with exit code 1 and
  ``unknown language X``.
- Each block is saved as a file in the workspace (``/workspace``; ``tmp_code_<sha256>.<ext>``, or
  the name of a first line ``# filename: path``, which must stay inside the workspace, else exit 1
  and ``Filename is not in the workspace``) and run there. Blocks run in order; the first block
  that fails stops the run. ``output`` is each block's stderr then stdout, concatenated, as
  autogen-ext does.
- A block over ``timeout`` seconds is killed with its whole process tree: exit code 124 and
  ``Timeout`` appended. Cancelling the ``CancellationToken`` kills the running block: exit code
  125 and ``Cancelled``. The session stays usable.
- ``restart()`` ends the session (every process of it, ``/tmp``) and starts a fresh one on the
  same workspace, whose files persist (as docker's bind-mounted ``work_dir`` does).
- Files: the session works on ``work_dir`` through lowlevel's copy-on-write overlay; the
  blocks' changes are committed to it when :meth:`execute_code_blocks` returns (so the host
  sees the files then, as with autogen-ext's executors), bounded by ``Limits.workspace_bytes``.
- ``functions`` (``FunctionWithRequirements`` or plain functions) are written to
  ``<functions_module>.py`` in the workspace before the first block, as the local executor does;
  their ``python_packages`` cannot be pip-installed in a sandbox without network, so listing any
  is a ``ValueError`` (put them in a virtualenv bound with ``Policy(binds=...)`` instead).

What is isolated: everything lowlevel isolates (read-only system, no network unless the Policy
says so, no host secrets, seccomp, limits). What is shared: all blocks of one executor share the
workspace, ``/tmp`` and the sandbox's processes (a block's background process survives until it
ends, is killed at restart/stop, or its block's process group is killed when the block ends).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import posixpath
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from string import Template
from typing import Any, ClassVar, TYPE_CHECKING

try:
    from autogen_core import CancellationToken, Component
    from autogen_core.code_executor import (CodeBlock, CodeExecutor, CodeResult, FunctionWithRequirements,
                                            FunctionWithRequirementsStr)
    from autogen_core.code_executor._func_with_reqs import build_python_functions_file, to_stub
    from pydantic import BaseModel
    from typing import Self
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError("lowlevel.integrations.autogen_executor needs autogen-core: "
                      "pip install '.[autogen]' in the lowlevel checkout") from _err

from lowlevel._dataclass import dataclass
import lowlevel.workspace
from lowlevel import ExecError, LowlevelError, Policy, Result, SessionError, UnsupportedError

if TYPE_CHECKING:  # the lazy names of lowlevel/__init__.py, spelled for the type checker
    from lowlevel.session import AsyncSession
else:
    from lowlevel import AsyncSession

from . import _files
from ._config import SandboxConfig

log = logging.getLogger("lowlevel.autogen")

PYTHON_VARIANTS = ("python", "Python", "py", "python3")
_SHELLS = {"bash": "bash", "sh": "sh", "shell": "sh"}


@dataclass
class LowlevelCodeResult(CodeResult):
    """A :class:`CodeResult` with the path (inside the sandbox) of the first block's file,
    as autogen-ext's ``CommandLineCodeResult``."""

    code_file: str | None


class LowlevelCodeExecutorConfig(BaseModel):
    """Serializable configuration (``dump_component``/``load_component``).

    ``sandbox`` is the Policy as a mapping in the TOML format of
    :mod:`lowlevel.integrations._config`; an executor built from a :class:`lowlevel.Policy`
    object dumps ``sandbox=None`` (and loads back with the default Policy, the strictest).
    """

    timeout: int = 60
    work_dir: str | None = None
    functions_module: str = "functions"
    cleanup_temp_files: bool = True
    python: str = "python3"
    sandbox: dict[str, Any] | None = None


class LowlevelCodeExecutor(CodeExecutor, Component[LowlevelCodeExecutorConfig]):
    """Runs AutoGen code blocks in one lowlevel session (see the module docstring).

    Args:
        policy: the :class:`lowlevel.Policy` of the session (default ``Policy()``: no network,
            default limits), or a mapping in the TOML format of
            :mod:`lowlevel.integrations._config`. Fixed for the executor's life.
        timeout: wall-clock seconds per block (>= 1).
        work_dir: host directory bound as ``/workspace`` (created if missing, never deleted);
            None: a fresh workspace, removed by :meth:`stop`.
        functions: functions offered to the code as ``from <functions_module> import f``.
        functions_module: that module's name (a Python identifier).
        cleanup_temp_files: delete each block's file after the run.
        python: the interpreter inside the sandbox (looked up on its PATH).
    Raises:
        ValueError: timeout < 1, a bad module name, or functions that need pip packages.
        lowlevel.PolicyError: a bad policy mapping.
    """

    component_config_schema = LowlevelCodeExecutorConfig
    component_provider_override = "lowlevel.integrations.autogen_executor.LowlevelCodeExecutor"
    SUPPORTED_LANGUAGES: ClassVar[list[str]] = ["bash", "shell", "sh", "python"]
    FUNCTION_PROMPT_TEMPLATE: ClassVar[str] = (
        "You have access to the following user defined functions. They can be accessed from the module called "
        "`$module_name` by their function names.\n\nFor example, if there was a function called `foo` you could "
        "import it by writing `from $module_name import foo`\n\n$functions")

    def __init__(self, policy: Policy | Mapping[str, Any] | None = None, *, timeout: int = 60,
                 work_dir: str | os.PathLike[str] | None = None,
                 functions: Sequence[FunctionWithRequirements[Any, Any] | Callable[..., Any]
                                     | FunctionWithRequirementsStr] = (),
                 functions_module: str = "functions", cleanup_temp_files: bool = True,
                 python: str = "python3") -> None:
        if timeout < 1:
            raise ValueError("Timeout must be greater than or equal to 1.")
        if not functions_module.isidentifier():
            raise ValueError("Module name must be a valid Python identifier")
        packages = sorted({p for f in functions if isinstance(f, FunctionWithRequirements) for p in f.python_packages})
        if packages:
            raise ValueError(f"functions need pip packages {packages}: a lowlevel sandbox installs nothing; "
                             "bind a virtualenv that has them (Policy(binds=...)) and list none here")
        self._sandbox_mapping: dict[str, Any] | None = None
        if policy is None or isinstance(policy, Policy):
            self._config = SandboxConfig(policy=policy or Policy())
        else:
            self._sandbox_mapping = dict(policy)
            self._config = SandboxConfig.from_mapping(policy, where="LowlevelCodeExecutor policy")
        self._timeout = timeout
        self._work_dir = Path(work_dir) if work_dir is not None else None
        self._functions = list(functions)
        self._functions_module = functions_module
        self._cleanup_temp_files = cleanup_temp_files
        self._python = python
        self._session: AsyncSession | None = None
        self._setup_functions_complete = not self._functions

    # -- properties as autogen-ext's executors ------------------------------------------
    @property
    def timeout(self) -> int:
        """Seconds per block."""
        return self._timeout

    @property
    def work_dir(self) -> Path:
        """Host directory of the workspace (``/workspace`` inside); it holds the blocks' files
        once :meth:`execute_code_blocks` returns. Raises ValueError before start()."""
        if self._session is not None:
            return Path(self._session.directory)
        if self._work_dir is not None:
            return self._work_dir
        raise ValueError("the executor has no workspace before start()")

    @property
    def functions_module(self) -> str:
        return self._functions_module

    @property
    def policy(self) -> Policy:
        """The fixed :class:`lowlevel.Policy`."""
        return self._config.policy

    def format_functions_for_prompt(self, prompt_template: str = FUNCTION_PROMPT_TEMPLATE) -> str:
        """The prompt text listing the functions (as autogen-ext's executors)."""
        return Template(prompt_template).substitute(
            module_name=self._functions_module, functions="\n\n".join(to_stub(f) for f in self._functions))

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the session (idempotent)."""
        if self._session is not None and self._session.alive:
            return
        workspace = None
        if self._work_dir is not None:
            self._work_dir.mkdir(parents=True, exist_ok=True)
            workspace = str(self._work_dir)
        self._session = await AsyncSession.create(self._config.policy, workspace=workspace,
                                                  workspace_base=self._config.workspace_base)

    async def stop(self) -> None:
        """End the session (every process in it); remove the workspace if it was ours."""
        session, self._session = self._session, None
        if session is None:
            return
        await session.close()
        if self._work_dir is None:
            try:
                await asyncio.to_thread(lowlevel.workspace.remove_workspace, session.directory)
            except LowlevelError as err:
                log.warning("could not remove workspace %s: %s", session.directory, err)

    async def restart(self) -> None:
        """A fresh session on the same workspace: processes and ``/tmp`` are gone, files stay."""
        session = self._session
        if session is None:
            return await self.start()
        await session.close()
        self._session = await AsyncSession.create(self._config.policy, workspace=session.directory,
                                                  workspace_base=self._config.workspace_base)
        self._setup_functions_complete = not self._functions

    # -- execution ------------------------------------------------------------------------
    async def execute_code_blocks(self, code_blocks: list[CodeBlock],
                                  cancellation_token: CancellationToken) -> LowlevelCodeResult:
        """Run the blocks in order in the session (see the module docstring).

        Raises:
            ValueError: the executor was not started, or the functions module failed to load.
        """
        session = self._session
        if session is None or not session.alive:
            raise ValueError("The lowlevel executor is not running. Start it with start() or `async with`.")
        if not self._setup_functions_complete:
            await self._setup_functions(session, cancellation_token)
        try:
            return await self._execute(session, code_blocks, cancellation_token)
        finally:
            await self._commit(session)

    async def _commit(self, session: AsyncSession) -> None:
        """Apply the blocks' changes to the host directory (lowlevel's copy-on-write overlay
        holds them until then), so ``work_dir`` shows the files as autogen-ext's executors do."""
        if not session.alive:
            return
        try:
            await session.commit()
        except UnsupportedError:
            pass  # no overlay on this host: the blocks wrote into the directory directly

    async def _setup_functions(self, session: AsyncSession, token: CancellationToken) -> None:
        source = build_python_functions_file(self._functions)
        await self._write(session, f"{self._functions_module}.py", source)
        result = await self._execute(session, [CodeBlock(code=source, language="python")], token)
        if result.exit_code != 0:
            raise ValueError(f"Functions failed to load: {result.output}")
        self._setup_functions_complete = True

    async def _write(self, session: AsyncSession, relpath: str, code: str) -> str:
        path = posixpath.join(_files.WORKSPACE, relpath)
        result = await session.run(_files.write_argv(path), stdin=code.encode("utf-8"), timeout=60,
                                   env=_files.SCRIPT_ENV, cwd="/")
        _files.check_write(result, path)
        return path

    async def _execute(self, session: AsyncSession, code_blocks: Sequence[CodeBlock],
                       token: CancellationToken) -> LowlevelCodeResult:
        output = ""
        exit_code = 0
        files: list[str] = []
        try:
            for block in code_blocks:
                lang, code = block.language.lower(), block.code
                if lang in [v.lower() for v in PYTHON_VARIANTS]:
                    lang = "python"
                if lang not in self.SUPPORTED_LANGUAGES:
                    exit_code = 1
                    output += "\n" + f"unknown language {lang}"
                    break
                filename = _filename_from_content(code)
                if filename is None:
                    ext = "py" if lang == "python" else lang
                    filename = f"tmp_code_{hashlib.sha256(code.encode()).hexdigest()}.{ext}"
                elif filename == "":
                    return LowlevelCodeResult(exit_code=1, output="Filename is not in the workspace", code_file=None)
                path = await self._write(session, filename, code)
                files.append(path)
                argv = [self._python, path] if lang == "python" else [_SHELLS[lang], path]
                task = asyncio.ensure_future(session.run(argv, timeout=self._timeout, cwd=_files.WORKSPACE))
                token.link_future(task)
                try:
                    result: Result = await task
                except asyncio.CancelledError:
                    if not token.is_cancelled():
                        raise  # our own caller was cancelled, not the token
                    output += "\nCancelled"
                    exit_code = 125
                    break
                except ExecError as err:
                    output += f"{argv[0]}: {err}\n"
                    exit_code = 127 if err.errno == 2 else 126
                    break
                output += result.stderr.decode("utf-8", "replace") + result.stdout.decode("utf-8", "replace")
                if result.timed_out:
                    output += "\nTimeout"
                    exit_code = 124
                    break
                exit_code = result.exit_code
                if exit_code != 0:
                    break
        except SessionError as err:
            raise ValueError(f"the lowlevel sandbox ended ({err}); call restart()") from err
        finally:
            if self._cleanup_temp_files and files and session.alive:
                await session.run(["rm", "-f", "--", *files], timeout=30, cwd="/")
        return LowlevelCodeResult(exit_code=exit_code, output=output, code_file=files[0] if files else None)

    # -- component config -------------------------------------------------------------------
    def _to_config(self) -> LowlevelCodeExecutorConfig:
        if self._functions:
            log.info("Functions will not be included in serialized configuration")
        return LowlevelCodeExecutorConfig(
            timeout=self._timeout, work_dir=str(self._work_dir) if self._work_dir is not None else None,
            functions_module=self._functions_module, cleanup_temp_files=self._cleanup_temp_files,
            python=self._python, sandbox=self._sandbox_mapping)

    @classmethod
    def _from_config(cls, config: LowlevelCodeExecutorConfig) -> Self:
        return cls(config.sandbox, timeout=config.timeout, work_dir=config.work_dir,
                   functions_module=config.functions_module, cleanup_temp_files=config.cleanup_temp_files,
                   python=config.python)


def _filename_from_content(code: str) -> str | None:
    """The ``# filename: x`` of the first line, normalised inside the workspace; "" when it
    escapes it; None when there is none (autogen-ext's ``get_file_name_from_content``)."""
    first = code.split("\n")[0]
    if not first.startswith("# filename:"):
        return None
    name = first.split(":", 1)[1].strip()
    path = posixpath.normpath(name if name.startswith("/") else posixpath.join(_files.WORKSPACE, name))
    if not path.startswith(_files.WORKSPACE + "/"):
        return ""
    return posixpath.relpath(path, _files.WORKSPACE)


__all__ = ["LowlevelCodeExecutor", "LowlevelCodeExecutorConfig", "LowlevelCodeResult"]
