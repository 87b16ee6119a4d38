"""The public entry point :func:`run`: one call, dispatched by what it asks for.

The top of the library's own layers (below only the frontends: the CLI, the MCP server, the
integrations, :mod:`lowlevel.ray`): the call is checked once as a
:class:`~lowlevel.sandbox.request.RunRequest`, then a call with ``record=`` goes to
:func:`lowlevel.record.record_run` (which runs the sandbox itself, a layer below) and every
other to the sandbox layer's :func:`lowlevel.sandbox.drive.run_request`. The sandbox layer
never sees ``record`` (it refuses one with PolicyError).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from lowlevel.sandbox.drive import run_request
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S, RunRequest
from lowlevel.sandbox.result import Result
from lowlevel.spec.policy import Policy


def run(command: Sequence[str], *, policy: Policy | None = None, workspace: str | os.PathLike[str] | None = None,
        inputs: Sequence[str | os.PathLike[str] | tuple[str, str]] = (), timeout: float | None = DEFAULT_TIMEOUT_S,
        stdin: bytes | None = None, env: Mapping[str, str] | None = None, capture: bool = True,
        cwd: str | None = None, workspace_base: str | None = None,
        record: str | os.PathLike[str] | None = None, allow_sensitive_workspace: bool = False,
        stdio_fds: Sequence[int | None] | None = None, keep_workspace: bool = True,
        commit: bool | str = True, kill_after: float = 0.0) -> Result:
    """Run ``command`` in a fresh bwrap sandbox and wait for it.

    Args:
        command: program and arguments as seen inside, e.g. ``["python3", "main.py"]``;
            a bare name is searched on the sandbox's PATH.
        policy: the sandbox description; default ``Policy()`` (the hardened recipe).
        workspace: host directory bound read-write at ``/workspace`` (must exist). None makes
            a fresh per-run directory under ``workspace_base`` (kept after the run; its path
            is ``Result.workspace``). ``/``, system directories (``/etc``, ``/usr``, ``/var``,
            ``/tmp`` itself...), home directories and credential locations are refused
            (:func:`lowlevel.workspace.workspace_refusal`).
        inputs: host files or directories copied into the workspace before the run, each
            under its base name, or ``(host path, dest)`` pairs with ``dest`` relative to the
            workspace (:func:`lowlevel.workspace.copy_inputs`).
        timeout: wall-clock limit in seconds (None: no limit); on expiry the whole sandbox is
            SIGKILLed and the Result has ``timed_out=True``, ``killed_by="timeout"``.
        kill_after: seconds of grace at the timeout, as ``timeout -k`` (coreutils): > 0 sends
            SIGTERM to every process of the sandbox (but its PID 1) at the deadline, and
            SIGKILLs the whole sandbox ``kill_after`` seconds later if it has not ended (a
            program that exits on SIGTERM ends at once: ``term_signal`` SIGTERM, or its own exit
            status if it handles it); ``timed_out`` either way. 0 (default): SIGKILL at the
            deadline. Not with ``record``. The anchor's own backstop kill moves back by as much.
        stdin: bytes fed to the program's stdin, or None for ``/dev/null`` (capture mode) or
            the caller's stdin (``capture=False``).
        env: variables set inside on top of the Policy's.
        capture: True pipes stdout/stderr into the Result (capped per Policy); False lets the
            program use the caller's fds 0, 1, 2 (a terminal included).
        cwd: working directory inside the sandbox (default ``policy.workdir``, else ``/workspace``).
        workspace_base: parent of fresh workspaces (default ``$LOWLEVEL_WORKSPACE_BASE`` or
            ``/tmp/lowlevel-<uid>``).
        record: write a run record (JSON, ``docs/record-schema.json``) to this path after the
            run, and copy the inputs to ``<record>.inputs/`` for ``lowlevel replay``; see
            :func:`lowlevel.record.record_run`. Not with ``commit`` other than True, ``kill_after``
            or ``stdio_fds`` (PolicyError).
        allow_sensitive_workspace: accept a ``workspace`` that would be refused.
        commit: what happens to the run's changes (the workspace is the read-only lower layer
            of a copy-on-write overlay; the run writes into a bounded upper layer): True
            (default) applies them to the workspace after the run, whatever its outcome
            (timeout and limit kills included: what the program wrote is kept, as with a plain
            directory); ``"on_success"`` only when it exited 0 and was not killed; False
            discards them (the workspace is left bit-identical). ``Result.changes`` reports
            them either way.
        stdio_fds: ``(stdin_fd, stdout_fd, stderr_fd)``, open fds of the caller given to the
            program as its fds 0, 1 and 2 (None for one keeps the default above); the caller
            keeps ownership and closes them. Pass pipes or a pty of your own
            (:class:`lowlevel.sandbox.relay.StdioRelay` does for the CLI) so the program never holds
            your own terminal or files: a program holding your terminal can change its line
            discipline or lock it (``TIOCSETD``, ``TIOCEXCL``), one holding your log file can
            reopen it through ``/proc/self/fd`` and read it. stdout and stderr only with
            ``capture=False``; stdin not with ``stdin`` bytes.
        keep_workspace: True (default) keeps a fresh workspace after the run (its path is
            ``Result.workspace``). False removes it once the Result is built (``changes``
            still lists what the run did; a note says it was removed), and on failure or
            interruption too. Only for a fresh workspace: with ``workspace=`` it raises
            PolicyError (lowlevel never deletes your directory).
    Returns:
        A :class:`Result`.
    Raises:
        PolicyError: a bad argument (the message says which).
        WorkspaceError: the workspace is refused (EPERM: a system or home directory), missing,
            not a directory, too large for a root caller (E2BIG), or unreachable by the
            sandbox's uid; an input is missing.
        ExecError: the command does not exist (errno ENOENT) or is not executable (EACCES).
        BwrapNotFoundError: bwrap is not installed.
        LaunchError: bwrap failed to set up the sandbox (``.stderr`` has its message).
        UnsupportedError: the host cannot enforce a limit the Policy requires.
    """
    request = RunRequest(command, workspace=workspace, inputs=inputs, timeout=timeout, kill_after=kill_after,
                         stdin=stdin, env=env, capture=capture, cwd=cwd, workspace_base=workspace_base,
                         allow_sensitive_workspace=allow_sensitive_workspace, stdio_fds=stdio_fds,
                         keep_workspace=keep_workspace, commit=commit, record=record)
    if request.record is None:
        return run_request(request, policy)
    from lowlevel.record import record_run
    return record_run(request.command, record=request.record, policy=policy, workspace=request.workspace,
                      inputs=request.inputs, timeout=request.timeout, stdin=request.stdin, env=request.env or None,
                      capture=request.capture, cwd=request.cwd, workspace_base=request.workspace_base,
                      allow_sensitive_workspace=request.allow_sensitive_workspace,
                      keep_workspace=request.keep_workspace)


__all__ = ["run"]
