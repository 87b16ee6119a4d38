"""The ``lowlevel`` command line.

``lowlevel run [OPTIONS] -- COMMAND [ARG...]`` runs COMMAND in a fresh sandbox. By default the
program's output streams live to the terminal; ``--json`` captures it and prints one JSON
object with the Result. The program never gets the caller's own stdin, stdout or stderr:
they are pipes of ours, or a pty of ours when the caller's side is a terminal, relayed live
(:mod:`lowlevel.sandbox.relay`). Stdin that is not a terminal is passed on in every mode: streamed
live, or with ``--record`` read first (at most :data:`lowlevel.cli.run_cmd.MAX_RECORD_STDIN_BYTES`) so the record
stores it and ``replay`` feeds it again.

Exit status (as ``timeout(1)`` does): the program's own status; 124 when the timeout killed
it; 125 when lowlevel itself failed (a usage error or bad option value, bad workspace,
sandbox setup), always with one line on stderr; 126 when the command is not executable; 127
when it is not found; 128+N when signal N killed it, or when signal N (SIGINT, SIGTERM,
SIGHUP, SIGQUIT) interrupted lowlevel, which then killed the sandbox. With ``--json`` every
outcome prints exactly one JSON object on stdout: the Result, or, when there is none, an
error object ``{"error": TYPE, "message": LINE, "exit_status": N, "errno": E | null,
"workspace": PATH | null}`` (TYPE is the exception's name, ``UsageError`` or ``Interrupted``;
an interruption adds ``"signal": "SIGINT"``).

Habits from ``timeout(1)`` and ``docker run`` mean the same here: durations take s/m/h/d
suffixes (``--timeout 2m``); at the timeout every process gets SIGTERM and the sandbox SIGKILL
``--kill-after`` later (:data:`lowlevel.cli.parser.DEFAULT_KILL_AFTER_S`); ``--cpus`` is CPU bandwidth in cores
(``--cpu`` is CPU seconds); ``-e``, ``--env-file``, ``-v SRC:DEST[:ro]``, ``-w``. An unknown option
gets a "did you mean"; ``--json`` prints the Result's keys sorted, ``argv`` last.

``lowlevel doctor [--json]`` reports what the host can do and exits non-zero when the default
policy cannot run.

``lowlevel run --record FILE`` also writes a run record (docs/record-schema.json) and copies
the inputs to ``FILE.inputs/``; ``lowlevel replay FILE`` reruns it and exits 0 when the outputs
match, 1 when they differ, 125 when it cannot replay.

``lowlevel image import FILE`` / ``ls`` / ``rm REF`` / ``inspect REF`` manage images (OCI archives,
OCI layout dirs, ``docker save`` archives: :mod:`lowlevel.cli.image_cli`); ``lowlevel run --image REF``
(or ``--rootfs DIR``) runs on one instead of the host's ``/usr``.

``lowlevel mcp [--config FILE.toml] [--workspace-base DIR] [--network/--no-network] ...`` serves
the Model Context Protocol over stdio (see :mod:`lowlevel.mcp_server`).

This module is :func:`main` (the console script ``lowlevel``, and ``python -m lowlevel``). The
rest: :mod:`~lowlevel.cli.args` (option types), :mod:`~lowlevel.cli.parser` (the argparse tree),
:mod:`~lowlevel.cli.run_cmd` (``run``), :mod:`~lowlevel.cli.commands` (the others),
:mod:`~lowlevel.cli.output` (exit statuses, error lines), :mod:`~lowlevel.cli.signals`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from lowlevel.cli.args import UsageError
from lowlevel.cli.output import EXIT_FAILED, error_object, print_json, report_error, silence_stdout
from lowlevel.cli.parser import COMMANDS, build_parser
from lowlevel.cli.signals import Interrupted, Terminated, clean_shutdown, is_interrupt

#: What a ^C while the command's modules import says (as lowlevel._startup's notice): nothing ran.
STARTING_NOTICE = "SIGINT: interrupted while starting; nothing was run"


def _wants_json(argv: Sequence[str]) -> bool:
    """``--json`` among the options (before ``--``), for errors found before parsing ends."""
    head = list(argv[:list(argv).index("--")] if "--" in argv else argv)
    return "--json" in head


def _interrupted_while_starting(args: argparse.Namespace) -> int:
    print(f"lowlevel: {STARTING_NOTICE}", file=sys.stderr)
    if getattr(args, "json", False):
        print_json(error_object("Interrupted", STARTING_NOTICE, 128 + signal.SIGINT, signal="SIGINT"))
    return 128 + signal.SIGINT


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lowlevel`` console script. Returns the exit status.

    Run as the command itself (the console script, ``python -m lowlevel``: ``argv`` None), the
    process ends here once the status is known, without the interpreter's teardown
    (:func:`lowlevel._startup.exit_now`: threads joined, atexit handlers run, output flushed).
    """
    from lowlevel import _startup
    status = 128 + signal.SIGINT
    try:
        _startup.disarm()  # the start-up ^C notice (lowlevel._startup) hands over to the handling below
        status = _main(argv)
    except KeyboardInterrupt:  # between the two, or a second ^C while _main reported the first
        print("lowlevel: SIGINT: interrupted", file=sys.stderr)
    finally:
        try:
            _startup.finished()
        except KeyboardInterrupt:  # landed while SIGINT was being dropped: the status stands
            _startup.finished()  # and drop it now (a second ^C during the exit: no traceback)
        cached = sys.modules.get("lowlevel._dataclass")  # no import here: a finally of an exit
        if cached is not None:
            cached.save()  # code of the dataclasses compiled by this process, for the next (lowlevel._dataclass)
    if argv is None and _startup.was_armed:
        _startup.exit_now(status)
    return status


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args: argparse.Namespace | None = None
    try:
        # Only the named subcommand's parser (the others cost imports and set-up); all of them for
        # --help, --version or a name argparse must refuse with the list of choices.
        parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
        args = parser.parse_args(argv)
        if args.cmd == "run":
            try:  # the run machinery, all of it (its failure and cleanup paths too) before the sandbox
                from lowlevel.cli.run_cmd import cmd_run
            except (KeyboardInterrupt, RuntimeError) as err:
                if not is_interrupt(err):
                    raise
                return _interrupted_while_starting(args)
            with clean_shutdown():
                return cmd_run(args)
        from lowlevel.cli import commands  # not for `run`: its start-up pays only for what it uses
        if args.cmd == "replay":
            with clean_shutdown():
                return commands.cmd_replay(args)
        if args.cmd == "mcp":
            return commands.cmd_mcp(args)
        if args.cmd == "image":
            from lowlevel.cli.image_cli import cmd_image
            with clean_shutdown():  # SIGTERM/SIGHUP: the import's sandboxes killed, its staging removed
                return cmd_image(args)
        if args.cmd == "cleanup":
            return commands.cmd_cleanup(args)
        return commands.cmd_doctor(args)
    except UsageError as err:
        return report_error(args if args is not None else argparse.Namespace(json=_wants_json(argv)), err,
                            EXIT_FAILED)
    except BrokenPipeError:
        silence_stdout()  # the reader of our stdout went away: no traceback
        return 128 + signal.SIGPIPE
    except RuntimeError as err:  # a ^C in a class statement of a command's module (is_interrupt)
        if not is_interrupt(err):
            raise
        print("lowlevel: SIGINT: interrupted", file=sys.stderr)
        if args is not None and getattr(args, "json", False):
            print_json(error_object("Interrupted", "SIGINT: interrupted", 128 + signal.SIGINT, signal="SIGINT"))
        return 128 + signal.SIGINT
    except (KeyboardInterrupt, Terminated, Interrupted) as err:
        signum = err.signum if isinstance(err, (Terminated, Interrupted)) else signal.SIGINT
        name = signal.Signals(signum).name
        workspace = err.workspace if isinstance(err, Interrupted) else None
        message = f"{name}: the sandbox was killed"
        if args is not None and getattr(args, "image_cmd", None) == "import":
            message = f"{name}: interrupted; nothing was imported, the staging directory was removed"
        elif workspace is not None:
            message += (f"; workspace {workspace} removed (--rm)" if err.removed  # type: ignore[union-attr]
                        else f"; the workspace is kept: {workspace}")
        else:
            message += "; the workspace is kept"
        print(f"lowlevel: {message}", file=sys.stderr)
        if args is not None and getattr(args, "json", False):
            print_json(error_object("Interrupted", message, 128 + signum, workspace=workspace, signal=name))
        return 128 + signum


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
