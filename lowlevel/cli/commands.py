"""The small subcommands: ``lowlevel cleanup``, ``doctor``, ``replay`` and ``mcp``.

Each imports what it runs only when called, so ``lowlevel run`` never loads them.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys

from lowlevel.cli.output import EXIT_FAILED, fail, print_json, reader_may_leave, report_error
from lowlevel.cli.signals import SignalRecorder
from lowlevel.errors import LowlevelError
from lowlevel.paths import unreachable
from lowlevel.spec.report import json_safe


def cmd_cleanup(args: argparse.Namespace) -> int:
    """``lowlevel cleanup``: exit 0 when nothing is left, 1 when something stayed; with
    ``--dry-run``: 0 when nothing would be removed, 1 when it lists leftovers (scripts: ``if !
    lowlevel cleanup --dry-run; then ...``)."""
    from lowlevel.cleanup import clean, find_leftovers

    workspaces = tuple(os.path.abspath(w) for w in args.workspace)
    for given, path in zip(args.workspace, workspaces, strict=True):
        if not os.path.isdir(path):  # a typo must not read as "nothing left over"
            missing = unreachable(path)
            why = "no such directory" if missing is None or missing[0] == errno.ENOENT else missing[1]
            return report_error(args, FileNotFoundError(f"cleanup: --workspace {given}: {why} "
                                                        f"({path}); name the workspace directory a run used"),
                                EXIT_FAILED)
    from lowlevel.cleanup import Leftover
    found: list[Leftover] = []
    removed: list[Leftover] = []
    problems: list[str] = []
    stores = tuple(os.path.abspath(d) for d in args.store)
    for given, path in zip(args.store, stores, strict=True):
        if not os.path.isdir(path):
            return report_error(args, FileNotFoundError(f"cleanup: --store {given}: no such directory ({path}); "
                                                        "name the image store an import used"), EXIT_FAILED)
    if args.dry_run:
        found = find_leftovers(workspaces, stores=stores)
    else:
        removed, problems = clean(workspaces, stores=stores)
    if args.json:
        print_json({"found": [vars(x) for x in found], "removed": [vars(x) for x in removed],
                     "problems": problems})
    else:
        for x in found:
            print(f"{x.kind:7} {x.path}: {x.detail}")
        for x in removed:
            print(f"removed {x.kind:7} {x.path}")
        for line in problems:
            print(f"left    {line}", file=sys.stderr)
        if not (found or removed or problems):
            print("nothing left over")
    return 1 if problems or found else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """``lowlevel doctor``: report host capabilities; non-zero when the default policy cannot run."""
    from lowlevel.doctor import diagnose

    report = diagnose()
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        for check in report["checks"]:
            mark = "ok " if check["ok"] else ("-- " if not check.get("required") else "FAIL")
            line = f"[{mark:>4}] {check['name']}: {check['detail']}"
            if not check["ok"] and check.get("fix"):
                line += f"\n        fix: {check['fix']}"
            print(line)
        print("default policy can run: " + ("yes" if report["ok"] else "NO"))
    return 0 if report["ok"] else 1


def cmd_replay(args: argparse.Namespace) -> int:
    """``lowlevel replay FILE``: 0 when the outputs match, 1 when they differ, 125 on failure."""
    from lowlevel.record import replay

    if args.image_store:
        from lowlevel.cli.image_cli import use_store
        use_store(args.image_store)
    try:
        report = replay(args.file, keep_workspace=args.keep_workspace, trust_policy=args.trust_record_policy,
                        **({"max_bytes": args.max_bytes} if args.max_bytes is not None else {}))
    except (LowlevelError, OSError) as err:
        return report_error(args, err, EXIT_FAILED)
    except Exception as err:  # noqa: BLE001 - a record is untrusted input: one line, never a traceback
        return report_error(args, RuntimeError(f"replay: cannot replay {args.file!r}: {type(err).__name__}: {err}"),
                      EXIT_FAILED)
    if args.keep_workspace and report.result is not None and report.result.workspace:
        print(f"lowlevel: workspace {report.result.workspace}", file=sys.stderr)  # as `run` says where it is
    if args.json:
        with reader_may_leave():
            json.dump(json_safe({"matched": report.matched, "differences": report.differences,
                                 "record": report.record}), sys.stdout, indent=2, sort_keys=True)
            sys.stdout.write("\n")
            sys.stdout.flush()
    else:
        for line in report.differences:
            print(f"lowlevel: replay: {line}", file=sys.stderr)
        print("outputs match" if report.matched else "outputs DIFFER")
    return 0 if report.matched else 1


def cmd_mcp(args: argparse.Namespace) -> int:
    """``lowlevel mcp``: serve MCP over stdio until the client goes away or a signal stops it
    (SIGTERM, SIGHUP, SIGQUIT, SIGINT: recorded from the first line on, so one during the start
    or during the final commits stops the server cleanly instead of killing it)."""
    recorder = SignalRecorder()
    try:
        return _cmd_mcp(args, recorder)
    finally:
        recorder.restore()


def _cmd_mcp(args: argparse.Namespace, recorder: SignalRecorder) -> int:
    from lowlevel.mcp_server import ServerConfig, serve

    overrides: dict[str, object] = {}
    for key, attr in (("workspace_base", "workspace_base"), ("network", "network"),
                      ("deterministic", "deterministic"), ("max_timeout_s", "max_timeout"),
                      ("max_output_bytes", "max_output_bytes"), ("allowed_binds", "allow_bind")):
        if getattr(args, attr) is not None:
            overrides[key] = getattr(args, attr)
    flag_base = overrides.get("workspace_base")
    if isinstance(flag_base, str):
        overrides["workspace_base"] = os.path.abspath(flag_base)  # a flag: from the shell's cwd
    if args.allow_host is not None:
        overrides["egress"] = {"allow": args.allow_host}
    limits = {name: getattr(args, attr) for name, attr in (
        ("memory_bytes", "memory"), ("cpu_s", "cpu"), ("pids", "pids")) if getattr(args, attr) is not None}
    if limits:
        overrides["limits"] = limits  # on top of the file's [limits] (ServerConfig.from_toml)
    try:
        config = ServerConfig.from_toml(args.config, **overrides) if args.config else \
            ServerConfig.from_mapping(overrides)
    except (LowlevelError, OSError, ValueError) as err:
        text = str(err)  # ServerConfig's own errors start with "mcp config"; a missing file does not
        return fail(text if text.startswith("mcp config") else f"mcp config: {text}")
    if recorder.pending() is not None:
        signum: int | None = recorder.pending()
    else:
        try:
            signum = serve(config, recorder.pending)
        except ImportError as err:
            return fail(f"{err}: install the MCP SDK with `pip install '.[mcp]'` in the lowlevel checkout")
        except LowlevelError as err:  # e.g. a refused --workspace-base
            return fail(f"mcp: {err}")
    if signum is not None:
        print(f"lowlevel mcp: {signal.Signals(signum).name}: stopped (the runs in flight killed, the sessions closed "
              "and their work committed)", file=sys.stderr)
        return 128 + signum
    return 0
