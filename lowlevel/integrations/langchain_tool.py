"""LangChain tools (``langchain-core`` ``BaseTool``) that run a model's code or command in lowlevel.

    from lowlevel.integrations.langchain_tool import LowlevelRunCode, LowlevelRunCommand
    tools = [LowlevelRunCode(policy=lowlevel.Policy(), timeout_s=30), LowlevelRunCommand()]

The operator fixes everything that matters when building the tool: the :class:`lowlevel.Policy`
(network, binds, limits, environment), the maximum timeout, the output cap, the interpreter,
and whether calls share a workspace (``session=``, a :class:`lowlevel.Session` the operator
owns) or each gets a fresh one (the default: a new sandbox and workspace per call, removed
after it). The model's arguments are exactly the tool's schema (``extra="forbid"``: an unknown
argument such as ``network`` is a validation error, never a setting); its ``timeout_s`` can only
shorten the operator's.

- ``run_code(code, language="python"|"bash"|"sh", timeout_s=None)``: the code is saved as
  ``main.py`` / ``main.sh`` in the workspace and run there.
- ``run_command(command, stdin=None, timeout_s=None)``: ``command`` is a shell command line
  (run with ``/bin/sh -c``) or an argv list.

The tool's text answer has the exit code, stdout and stderr (each capped to ``max_output_chars``,
head and tail kept), and says when the run timed out or was killed by a limit. With
``response_format="content_and_artifact"`` the artifact is a dict of the Result's fields
(``exit_code``, ``timed_out``, ``killed_by``, ``stdout``, ``stderr``, ``wall_time_s``).
A failure of the sandbox itself (bad bind, bwrap missing) raises ``ToolException``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import tempfile
from typing import Annotated, Any, Literal, TYPE_CHECKING

try:
    from langchain_core.callbacks import AsyncCallbackManagerForToolRun, CallbackManagerForToolRun
    from langchain_core.tools import BaseTool, ToolException
    from pydantic import BaseModel, ConfigDict, Field, SkipValidation
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError("lowlevel.integrations.langchain_tool needs langchain-core: "
                      "pip install '.[langchain]' in the lowlevel checkout") from _err

import lowlevel
import lowlevel.workspace
from lowlevel import ExecError, LowlevelError, Policy, Result

if TYPE_CHECKING:  # the lazy names of lowlevel/__init__.py, spelled for the type checker
    from lowlevel.session import Session
else:
    from lowlevel import Session

from . import _files

_SUFFIX = {"python": "py", "bash": "sh", "sh": "sh"}


class RunCodeInput(BaseModel):
    """What the model may send to ``run_code``: nothing else."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="The complete program to run.")
    language: Literal["python", "bash", "sh"] = Field("python", description="python, bash or sh.")
    timeout_s: float | None = Field(None, gt=0, description="Seconds before the run is killed (capped).")


class RunCommandInput(BaseModel):
    """What the model may send to ``run_command``: nothing else."""

    model_config = ConfigDict(extra="forbid")

    command: str | list[str] = Field(description="A shell command line, or a program and its arguments.")
    stdin: str | None = Field(None, description="Text fed to the command's standard input.")
    timeout_s: float | None = Field(None, gt=0, description="Seconds before the command is killed (capped).")


class _LowlevelTool(BaseTool):
    """Shared settings of the lowlevel tools (the operator's; see the module docstring)."""

    policy: Annotated[Policy, SkipValidation()] = Field(default_factory=Policy, exclude=True)
    timeout_s: float = 30.0
    max_output_chars: int = 20_000
    python: str = "python3"
    session: Annotated[Session | None, SkipValidation()] = Field(default=None, exclude=True)
    workspace_base: str | None = None

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a lowlevel.Policy, got {type(self.policy).__name__}")
        if self.session is not None and not isinstance(self.session, Session):
            raise TypeError(f"session must be a lowlevel.Session, got {type(self.session).__name__}")
        if not self.timeout_s > 0 or self.max_output_chars < 100:
            raise ValueError("timeout_s must be > 0 and max_output_chars >= 100")

    def _timeout(self, asked: float | None) -> float:
        return self.timeout_s if asked is None else min(float(asked), self.timeout_s)

    def _execute(self, argv: list[str], *, stdin: bytes | None, timeout: float,
                 files: dict[str, bytes]) -> Result:
        """Run in the operator's session, or in a fresh sandbox whose workspace is removed after."""
        try:
            if self.session is not None:
                for name, data in files.items():
                    path = _files.resolve(name)
                    written = self.session.run(_files.write_argv(path), stdin=data, timeout=60,
                                               env=_files.SCRIPT_ENV, cwd="/")
                    _files.check_write(written, path)
                return self.session.run(argv, stdin=stdin, timeout=timeout)
            with tempfile.TemporaryDirectory(prefix="lowlevel-tool-") as tmp:
                inputs = []
                for name, data in files.items():
                    inputs.append(os.path.join(tmp, name))
                    with open(inputs[-1], "wb") as f:
                        f.write(data)
                result = lowlevel.run(argv, policy=self.policy, inputs=inputs, stdin=stdin, timeout=timeout,
                                      workspace_base=self.workspace_base, commit=False)
            lowlevel.workspace.remove_workspace(result.workspace)
            return result
        except ExecError as err:
            return Result(exit_code=127 if err.errno == errno.ENOENT else 126,
                          stderr=(self._exec_message(argv[0], err) + "\n").encode())
        except (LowlevelError, OSError) as err:
            raise ToolException(f"the sandbox could not run this: {err}") from err

    def _exec_message(self, prog: str, err: ExecError) -> str:
        """One line for a program the sandbox could not start: ``prog: command not found in the
        sandbox (PATH=...)`` for a missing one (what a shell would say, with where it looked),
        else lowlevel's own message, which already starts with the program's name."""
        text = str(err)
        if err.errno == errno.ENOENT and "PATH=" not in text and "/" not in prog:
            core = getattr(self.session, "_core", None) if self.session is not None else None
            policy = getattr(core, "policy", None) or self.policy
            return f"{prog}: command not found in the sandbox (PATH={policy.environment().get('PATH', '')})"
        return text if text.startswith(f"{prog}:") else f"{prog}: {text}"

    def _answer(self, result: Result) -> Any:
        text = [f"exit code: {result.exit_code}"]
        if result.timed_out:
            text.append("timed out: the run was killed")
        elif result.killed_by:
            text.append(f"killed: {result.killed_by} limit")
            if result.killed_by == "memory":
                text.extend(n for n in result.notes if "OOM killer" in n)
        for name, data in (("stdout", result.stdout), ("stderr", result.stderr)):
            if data:
                text.append(f"--- {name} ---\n{_cap(data.decode('utf-8', 'replace'), self.max_output_chars)}")
        content = "\n".join(text)
        if self.response_format == "content_and_artifact":
            return content, {"exit_code": result.exit_code, "timed_out": result.timed_out,
                             "killed_by": result.killed_by, "stdout": result.stdout.decode("utf-8", "replace"),
                             "stderr": result.stderr.decode("utf-8", "replace"), "wall_time_s": result.wall_time_s}
        return content


def _cap(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"


class LowlevelRunCode(_LowlevelTool):
    """``run_code``: run a program the model wrote, in a lowlevel sandbox."""

    name: str = "run_code"
    description: str = ("Run a complete Python, bash or sh program in an isolated sandbox (no network, no access "
                        "to the host's files) and get its exit code and output. Print what you need to see.")
    args_schema: type[BaseModel] = RunCodeInput

    def _run(self, code: str, language: str = "python", timeout_s: float | None = None,
             run_manager: CallbackManagerForToolRun | None = None) -> Any:
        name = f"main.{_SUFFIX[language]}"
        argv = [self.python if language == "python" else language, name]
        result = self._execute(argv, stdin=None, timeout=self._timeout(timeout_s), files={name: code.encode("utf-8")})
        return self._answer(result)

    async def _arun(self, code: str, language: str = "python", timeout_s: float | None = None,
                    run_manager: AsyncCallbackManagerForToolRun | None = None) -> Any:
        return await asyncio.to_thread(self._run, code, language, timeout_s)


class LowlevelRunCommand(_LowlevelTool):
    """``run_command``: run a shell command line or an argv in a lowlevel sandbox."""

    name: str = "run_command"
    description: str = ("Run a shell command (or a program with arguments) in an isolated sandbox (no network, "
                        "no access to the host's files) and get its exit code and output.")
    args_schema: type[BaseModel] = RunCommandInput

    def _run(self, command: str | list[str], stdin: str | None = None, timeout_s: float | None = None,
             run_manager: CallbackManagerForToolRun | None = None) -> Any:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise ToolException("command is empty: give a command line or a program and its arguments")
        data = stdin.encode("utf-8") if stdin is not None else None
        return self._answer(self._execute(argv, stdin=data, timeout=self._timeout(timeout_s), files={}))

    async def _arun(self, command: str | list[str], stdin: str | None = None, timeout_s: float | None = None,
                    run_manager: AsyncCallbackManagerForToolRun | None = None) -> Any:
        return await asyncio.to_thread(self._run, command, stdin, timeout_s)


__all__ = ["LowlevelRunCode", "LowlevelRunCommand", "RunCodeInput", "RunCommandInput"]
