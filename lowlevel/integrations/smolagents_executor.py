"""A smolagents ``PythonExecutor`` that runs the agent's code in a lowlevel session.

Use it as ``CodeAgent(tools=..., model=..., executor=LowlevelPythonExecutor(...))``, or name it
as smolagents' own executors are named: ``LowlevelCodeAgent(tools=..., model=...,
executor_type="lowlevel", executor_kwargs={"policy": ...})`` (:class:`LowlevelCodeAgent` is a
``CodeAgent`` that knows the name; the other types, ``"local"``, ``"docker"``..., work as before).
It is a
:class:`smolagents.remote_executors.RemotePythonExecutor` (as the E2B, Docker and Modal
executors are), so tools, variables and ``final_answer`` travel as smolagents defines for
remote executors, while the step semantics follow its ``LocalPythonExecutor``:

- **State between steps**: one persistent CPython interpreter (the *kernel*, a background
  command of one :class:`lowlevel.Session`) executes every step in one namespace: variables,
  functions and imports of a step are there in the next. ``send_variables`` puts the agent's
  state there (smolagents' ``SafeSerializer``: JSON-safe values; pickle only with
  ``allow_pickle=True``); ``send_tools`` defines the tools *inside the sandbox* from their
  source, as every remote executor does (so a tool runs under the same policy as the code).
- **Output**: ``CodeOutput.logs`` is what the step printed (stdout and stderr), truncated
  with smolagents' ``truncate_content`` at ``max_print_outputs_length``; ``CodeOutput.output``
  is the value of the last statement when it is an expression or an assignment to a name (a
  JSON-able value as is, anything else as its ``repr``), else None.
- **Final answer**: ``final_answer(x)`` raises smolagents' ``FinalAnswerException`` in the
  sandbox; its serialized value comes back and ``is_final_answer`` is True.
- **Errors** raise smolagents' ``InterpreterError`` with the local executor's message shape
  (``Code execution failed at line '...' due to: ValueError: ...``); the step's logs are in
  ``executor.state["_print_outputs"]``, where ``CodeAgent`` looks for them.
- **Authorized imports**: honoured for the agent's own ``import`` statements, with the local
  executor's matching rules and message (``Import of os is not allowed. Authorized imports
  are: [...]``); ``"*"`` allows all. Unlike smolagents' AST interpreter this is real CPython:
  the import list is a guard rail, not the boundary (code can reach other modules through
  the ones it may import); the boundary is the sandbox. Authorized modules missing from the
  sandbox's Python raise ``InterpreterError`` at construction, as the local executor does.
  Nothing is pip-installed (no network by default): tool requirements must already be
  importable in the sandbox (bind a virtualenv with ``Policy(binds=...)`` and pass its
  interpreter as ``python``).
- **Timeout**: a step over ``timeout_seconds`` is killed with its process tree, the kernel is
  restarted (its variables are lost, the tools and last variables are sent again) and
  ``InterpreterError("Code execution exceeded the maximum execution time of N seconds ...")``
  is raised. A kernel killed by a limit (memory, pids) or by the code itself (its own process
  or its supervisor, ``os.kill(os.getppid(), 9)``) is restarted the same way, the step raising
  ``InterpreterError("Code execution failed: the sandboxed interpreter died (...)")``.
- **Sandbox ended**: a step that ends the whole session (kills its init) raises
  ``InterpreterError("Code execution failed: the lowlevel sandbox ended (...); it was
  restarted ...")`` and the executor runs on in a fresh session (its ``/tmp`` and scratch files
  are gone too; tools and variables are sent again); a session found ended before a step is
  restarted the same way, that step raising the same error without running.
  :meth:`LowlevelPythonExecutor.restart` starts a fresh sandbox on demand.

Call :meth:`cleanup` (``CodeAgent`` does on ``__exit__``/``cleanup()``) to end the session.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any, TYPE_CHECKING

try:
    from smolagents.agents import CodeAgent
    from smolagents.local_python_executor import (BASE_BUILTIN_MODULES, DEFAULT_MAX_LEN_OUTPUT,
                                                  MAX_EXECUTION_TIME_SECONDS, CodeOutput, InterpreterError)
    from smolagents.monitoring import AgentLogger, LogLevel
    from smolagents.remote_executors import RemotePythonExecutor
    from smolagents.tools import Tool
    from smolagents.utils import truncate_content
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError("lowlevel.integrations.smolagents_executor needs smolagents: "
                      "pip install '.[smolagents]' in the lowlevel checkout") from _err

import lowlevel.workspace
from lowlevel import LowlevelError, Policy, SessionError

if TYPE_CHECKING:  # the lazy names of lowlevel/__init__.py, spelled for the type checker
    from lowlevel.session import Session
else:
    from lowlevel import Session

from ._config import SandboxConfig
from ._smolagents_kernel import CLIENT, KERNEL

log = logging.getLogger("lowlevel.smolagents")

#: Seconds to wait for a (re)started kernel to listen.
KERNEL_START_TIMEOUT_S = 30.0


class LowlevelPythonExecutor(RemotePythonExecutor):  # type: ignore[misc]
    """Runs a smolagents ``CodeAgent``'s code in a lowlevel session (see the module docstring).

    Args:
        additional_authorized_imports: modules the agent's code may import on top of
            smolagents' ``BASE_BUILTIN_MODULES`` (``"pkg.*"`` for submodules, ``"*"`` for all).
        logger: a smolagents ``AgentLogger`` (default: one at ``LogLevel.INFO``).
        policy: the :class:`lowlevel.Policy` (or a mapping in the TOML format of
            :mod:`lowlevel.integrations._config`); fixed for the executor's life.
        timeout_seconds: wall-clock seconds per step (None: no limit), as the local executor.
        max_print_outputs_length: cap of ``CodeOutput.logs`` (characters).
        python: the interpreter inside the sandbox (found on its PATH).
        allow_pickle: let variables and final answers travel as pickle (smolagents' flag;
            unpickling on the host runs code the sandbox chose: leave it False).
    Raises:
        InterpreterError: an authorized module is not importable in the sandbox.
        lowlevel.PolicyError, lowlevel.LaunchError: the session could not start.
    """

    def __init__(self, additional_authorized_imports: list[str] | None = None, logger: Any = None, *,
                 policy: Policy | Mapping[str, Any] | None = None,
                 timeout_seconds: int | None = MAX_EXECUTION_TIME_SECONDS,
                 max_print_outputs_length: int | None = None, python: str = "python3",
                 allow_pickle: bool = False) -> None:
        # RemotePythonExecutor keeps the list as ``additional_imports`` (to pip-install; we install nothing).
        self.additional_authorized_imports = list(additional_authorized_imports or [])
        super().__init__(self.additional_authorized_imports, logger or AgentLogger(level=LogLevel.INFO),
                         allow_pickle=allow_pickle)
        if policy is None or isinstance(policy, Policy):
            self.config = SandboxConfig(policy=policy or Policy())
        else:
            self.config = SandboxConfig.from_mapping(policy, where="LowlevelPythonExecutor policy")
        self.authorized_imports = sorted(set(BASE_BUILTIN_MODULES) | set(self.additional_authorized_imports))
        self.timeout_seconds = timeout_seconds
        self.max_print_outputs_length = max_print_outputs_length or DEFAULT_MAX_LEN_OUTPUT
        self.python = python
        self.state: dict[str, Any] = {"_print_outputs": ""}
        self._setup_code: list[str] = []  # tools and variables, sent again after a kernel restart
        self._trusted = False
        # commit=False: the agent's scratch files stay in the copy-on-write layer and go with it.
        self.session: Session | None = Session(self.config.policy, workspace_base=self.config.workspace_base,
                                               commit=False)
        self._kernel: Any = None
        self._socket = ""
        try:
            missing = self._start_kernel()
        except BaseException:
            self.cleanup()
            raise
        if missing:
            self.cleanup()
            raise InterpreterError(f"Non-installed authorized modules: {', '.join(missing)}. Please install these "
                                   "modules or remove them from the authorized imports list.")

    # -- kernel ---------------------------------------------------------------------------
    def _start_kernel(self) -> list[str]:
        assert self.session is not None
        self._socket = "lowlevel-smolagents-" + secrets.token_hex(8)
        argv = [self.python, "-c", KERNEL, self._socket, json.dumps(self.authorized_imports)]
        self._kernel = self.session.start(argv)
        deadline = time.monotonic() + KERNEL_START_TIMEOUT_S
        seen = b""
        while time.monotonic() < deadline:
            out, err = self._kernel.read(timeout=0.5)
            seen += out
            if b"\n" in seen:
                hello = json.loads(seen.split(b"\n", 1)[0])
                return list(hello.get("missing", []))
            if self._kernel.poll() is not None:
                result = self._kernel.wait()
                raise InterpreterError(f"the sandboxed Python ({self.python}) did not start: exit "
                                       f"{result.exit_code}: {result.stderr.decode('utf-8', 'replace')[-2000:]}")
        raise InterpreterError(f"the sandboxed Python did not start within {KERNEL_START_TIMEOUT_S} s")

    def _restart_kernel(self) -> None:
        """A fresh kernel in the session (the tools and variables sent again); a fresh session
        when the session itself ended (or ends meanwhile)."""
        assert self.session is not None
        if self.session.alive:
            try:
                if self._kernel is not None:
                    self._kernel.kill()
                    try:
                        self._kernel.wait(timeout=10)
                    except LowlevelError:  # its outcome is an error (its supervisor was killed...)
                        pass
                self._start_kernel()
            except SessionError:
                if self.session.alive:
                    raise
            else:
                self._send_setup()
                return
        self._restart_session()

    def _restart_session(self) -> None:
        """A fresh session and kernel (the tools and variables sent again); the old session is
        closed and its workspace removed once the new one runs (if its start fails, the old one
        stays, dead: the next step tries again)."""
        old = self.session
        assert old is not None
        self.session = Session(self.config.policy, workspace_base=self.config.workspace_base, commit=False)
        self._kernel = None
        self._close_session(old)
        self._start_kernel()
        self._send_setup()

    def _send_setup(self) -> None:
        for code in self._setup_code:
            self._request(code, trusted=True)

    def restart(self) -> None:
        """Start a fresh sandbox (session and interpreter): its processes, ``/tmp`` and scratch
        files are gone and so are the variables of earlier steps; the tools and the variables
        sent (``send_tools``, ``send_variables``) are sent again. A step after which the sandbox
        ended does this by itself.

        Raises:
            InterpreterError: the executor was cleaned up, or the new interpreter did not start.
            lowlevel.LaunchError: the new session could not start (the old one is kept, dead).
        """
        if self.session is None:
            raise InterpreterError("the executor was cleaned up; make a new one")
        self._restart_session()

    def _request(self, code: str, *, trusted: bool) -> dict[str, Any]:
        if self.session is None:
            raise InterpreterError("the executor was cleaned up; make a new one")
        if not self.session.alive:  # it ended after the last step (or its restart failed then)
            self._restart_session()
            if not trusted:
                raise InterpreterError("Code execution failed: the lowlevel sandbox had ended; it was restarted "
                                       "and variables of earlier steps are lost (this code did not run)")
        body = json.dumps({"code": code, "check_imports": not trusted,
                           "max_logs": self.max_print_outputs_length}).encode()
        try:
            result = self.session.run([self.python, "-I", "-S", "-c", CLIENT, self._socket], stdin=body,
                                      timeout=self.timeout_seconds)
        except SessionError as err:
            if self.session.alive:
                raise InterpreterError(f"the lowlevel sandbox failed: {err}") from err
            self._restart_session()
            raise InterpreterError(f"Code execution failed: the lowlevel sandbox ended ({err}); it was restarted "
                                   "and variables of earlier steps are lost") from err
        if result.timed_out:
            self._restart_kernel()
            raise InterpreterError(f"Code execution exceeded the maximum execution time of {self.timeout_seconds} "
                                   "seconds (the sandboxed interpreter was restarted: variables of earlier steps "
                                   "are lost)")
        death = self._kernel_death()
        if result.exit_code != 0 or death is not None:
            self._restart_kernel()
            reason = death or "lost connection"
            raise InterpreterError(f"Code execution failed: the sandboxed interpreter died ({reason}); it was "
                                   "restarted and variables of earlier steps are lost")
        try:
            answer = json.loads(result.stdout)
        except ValueError as err:
            raise InterpreterError(f"the sandboxed interpreter sent a malformed answer: {err}") from err
        if not isinstance(answer, dict):
            raise InterpreterError("the sandboxed interpreter sent a malformed answer")
        return answer

    def _kernel_death(self) -> str | None:
        """Why the kernel is gone (None: it runs). Its supervisor killed, or the session ended, is
        an error where a Result would be: that is the reason, not raised."""
        if self._kernel is None:
            return "not started"
        try:
            if self._kernel.poll() is None:
                return None
            result = self._kernel.wait()
        except LowlevelError as err:
            return str(err)
        if result.killed_by:
            return f"killed: {result.killed_by}"
        return f"exit status {result.exit_code}"

    # -- RemotePythonExecutor -------------------------------------------------------------
    def run_code_raise_errors(self, code: str) -> CodeOutput:
        """Run one step (or, from send_tools/send_variables, setup code) in the kernel.

        Raises:
            InterpreterError: the code raised, timed out, or the kernel died.
        """
        trusted = self._trusted
        answer = self._request(code, trusted=trusted)
        logs = truncate_content(str(answer.get("logs") or ""), max_length=self.max_print_outputs_length)
        self.state["_print_outputs"] = logs
        if answer.get("error"):
            raise InterpreterError(str(answer["error"]))
        if trusted:
            self._setup_code.append(code)
        final = answer.get("final")
        if final is not None:
            return CodeOutput(output=self._deserialize_final_answer(final, self.allow_pickle), logs=logs,
                              is_final_answer=True)
        output = answer.get("output")
        value = None
        if isinstance(output, dict):
            value = output["json"] if "json" in output else output.get("repr")
        return CodeOutput(output=value, logs=logs, is_final_answer=False)

    def send_tools(self, tools: dict[str, Tool]) -> None:
        self._trusted = True
        try:
            super().send_tools(tools)
        finally:
            self._trusted = False

    def send_variables(self, variables: dict[str, Any]) -> None:
        self._trusted = True
        try:
            super().send_variables(variables)
        finally:
            self._trusted = False

    def install_packages(self, additional_imports: list[str]) -> list[str]:
        """Nothing is installed in a sandbox: check the packages are importable there already.

        Raises:
            InterpreterError: some are missing (bind a virtualenv that has them).
        """
        if not additional_imports:
            return []
        probe = ("import importlib.util\n"
                 f"print([m for m in {list(additional_imports)!r} "
                 "if importlib.util.find_spec(m.split('.')[0].replace('-', '_')) is None])")
        answer = self._request(probe, trusted=True)
        missing = (answer.get("output") or {}).get("json") or []
        if missing:
            raise InterpreterError(f"packages {missing} are not importable in the sandbox and lowlevel installs "
                                   "nothing: bind a virtualenv that has them (Policy(binds=...)) and pass its python")
        return list(additional_imports)

    def cleanup(self) -> None:
        """End the session (kernel and all) and remove its workspace. Idempotent."""
        session, self.session = self.session, None
        if session is not None:
            self._close_session(session)

    @staticmethod
    def _close_session(session: Session) -> None:
        session.close()
        try:
            lowlevel.workspace.remove_workspace(session.directory)
        except LowlevelError as err:
            log.warning("could not remove workspace %s: %s", session.directory, err)

    def delete(self) -> None:
        """As :meth:`cleanup` (the name smolagents' Docker executor uses)."""
        self.cleanup()

    def __del__(self) -> None:
        if getattr(self, "session", None) is not None:
            try:
                self.cleanup()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


#: The ``executor_type`` that :class:`LowlevelCodeAgent` maps to :class:`LowlevelPythonExecutor`.
EXECUTOR_TYPE = "lowlevel"


class LowlevelCodeAgent(CodeAgent):  # type: ignore[misc]
    """smolagents' ``CodeAgent`` that also takes ``executor_type="lowlevel"``.

    With that type, the agent's executor is ``LowlevelPythonExecutor(additional_authorized_imports,
    logger, **executor_kwargs)``, with the agent's ``max_print_outputs_length`` unless
    ``executor_kwargs`` sets one (``policy``, ``timeout_seconds``, ``python``... as
    :class:`LowlevelPythonExecutor` takes them). Every other ``executor_type`` and ``executor=``
    behave exactly as in ``CodeAgent``. smolagents' own ``CodeAgent`` refuses an unknown type
    (``ValueError: Unsupported executor type``), hence the subclass rather than a name
    registered in smolagents.

    Raises:
        InterpreterError, lowlevel.PolicyError, lowlevel.LaunchError: as :class:`LowlevelPythonExecutor`.
        Exception: managed agents with ``executor_type="lowlevel"`` (as smolagents' remote executors).
    """

    def create_python_executor(self) -> Any:
        """The executor for ``self.executor_type``: a :class:`LowlevelPythonExecutor` for ``"lowlevel"``."""
        if self.executor_type != EXECUTOR_TYPE:
            return super().create_python_executor()
        if self.managed_agents:
            raise Exception("Managed agents are not yet supported with remote code execution.")  # as smolagents
        kwargs = {"max_print_outputs_length": self.max_print_outputs_length, **self.executor_kwargs}
        return LowlevelPythonExecutor(self.additional_authorized_imports, self.logger, **kwargs)


__all__ = ["EXECUTOR_TYPE", "LowlevelCodeAgent", "LowlevelPythonExecutor"]
