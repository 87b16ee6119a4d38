"""The ``lowlevel`` command line.

``lowlevel run [OPTIONS] -- COMMAND [ARG...]`` runs COMMAND in a fresh sandbox. By default the
program's output streams live to the terminal (inherited stdio, like ``timeout(1)`` or
``bwrap``); ``--json`` captures it and prints one JSON object with the Result.

Exit status (as ``timeout(1)`` does): the program's own status; 124 when the timeout killed
it; 125 when lowlevel itself failed (bad option value, bad workspace, sandbox setup); 126 when
the command is not executable; 127 when it is not found; 128+N when signal N killed it.

``lowlevel doctor [--json]`` reports what the host can do and exits non-zero when the default
policy cannot run.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from collections.abc import Sequence

from . import __version__
from .errors import LowlevelError
from .launcher import ExecError, run
from .limits import Limits
from .policy import Bind, Policy

EXIT_TIMEOUT = 124
EXIT_FAILED = 125
EXIT_NOEXEC = 126
EXIT_NOTFOUND = 127

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(text: str) -> int:
    """Parse a byte count with an optional binary suffix: ``"512"``, ``"64K"``, ``"256M"``, ``"2G"``.

    K, M, G, T are powers of 1024 (``KiB``/``MB`` spellings accepted alike).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use a number of bytes with an optional "
                                         "K, M or G suffix, e.g. 256M")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: use a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _env_pair(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"invalid --env {text!r}: use KEY=VALUE")
    key, value = text.split("=", 1)
    return key, value


def _bind_spec(text: str) -> tuple[str, str]:
    """``SRC`` or ``SRC:DEST``."""
    if ":" in text:
        src, dest = text.split(":", 1)
        return src, dest
    return text, ""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for ``lowlevel`` (exposed for docs and tests)."""
    parser = argparse.ArgumentParser(prog="lowlevel", description="Run untrusted programs in a bubblewrap "
                                     "sandbox with seccomp and resource limits.")
    parser.add_argument("--version", action="version", version=f"lowlevel {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{run,doctor}")

    p = sub.add_parser("run", help="run a command in a fresh sandbox",
                       description="Run COMMAND in a fresh sandbox. Put -- before the command.")
    p.add_argument("--workspace", metavar="DIR", help="existing host dir bound read-write at /workspace "
                   "(default: a fresh per-run dir, its path printed to stderr)")
    p.add_argument("--input", metavar="PATH", action="append", default=[],
                   help="file or dir copied into the workspace before the run (repeatable)")
    p.add_argument("--timeout", metavar="SECONDS", type=_positive_float, default=60.0,
                   help="wall-clock limit, seconds (default 60); exit 124 when it fires")
    p.add_argument("--network", action="store_true", help="keep the host network (default: none)")
    p.add_argument("--ro", metavar="PATH[:DEST]", action="append", default=[], type=_bind_spec,
                   help="extra read-only bind (repeatable)")
    p.add_argument("--rw", metavar="PATH[:DEST]", action="append", default=[], type=_bind_spec,
                   help="extra writable bind (repeatable)")
    p.add_argument("--allow-sensitive", action="store_true",
                   help="allow binds of credential dirs, home, /run, sockets (dangerous)")
    p.add_argument("--env", metavar="KEY=VALUE", action="append", default=[], type=_env_pair,
                   help="environment variable inside (repeatable)")
    p.add_argument("--memory", metavar="BYTES", type=parse_size, help="memory limit of the run (cgroup; "
                   "RLIMIT_DATA fallback), e.g. 512M (default 1G)")
    p.add_argument("--cpu", metavar="SECONDS", type=_positive_float, help="CPU seconds (RLIMIT_CPU), default 60")
    p.add_argument("--pids", metavar="N", type=_positive_int, help="processes+threads (cgroup pids.max; "
                   "RLIMIT_NPROC fallback), default 256")
    p.add_argument("--fsize", metavar="BYTES", type=parse_size, help="largest file written (RLIMIT_FSIZE), "
                   "default 1G")
    p.add_argument("--nofile", metavar="N", type=_positive_int, help="open files (RLIMIT_NOFILE), default 1024")
    p.add_argument("--tmp-size", metavar="BYTES", type=parse_size, help="size of /tmp tmpfs, default 256M")
    p.add_argument("--json", action="store_true", help="capture output; print one JSON object with the Result")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")

    d = sub.add_parser("doctor", help="check what this host can do")
    d.add_argument("--json", action="store_true", help="print a JSON report")
    return parser


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"lowlevel: {message}", file=sys.stderr)
    return code


def _policy_from_args(args: argparse.Namespace) -> Policy:
    overrides = {name: getattr(args, attr) for name, attr in (
        ("memory_bytes", "memory"), ("cpu_s", "cpu"), ("pids", "pids"), ("fsize_bytes", "fsize"),
        ("nofile", "nofile"), ("tmp_size_bytes", "tmp_size")) if getattr(args, attr) is not None}
    binds = [Bind(src, dest, writable=False, allow_sensitive=args.allow_sensitive) for src, dest in args.ro]
    binds += [Bind(src, dest, writable=True, allow_sensitive=args.allow_sensitive) for src, dest in args.rw]
    return Policy(network=args.network, binds=tuple(binds), env=tuple(args.env), limits=Limits(**overrides))


def cmd_run(args: argparse.Namespace) -> int:
    """``lowlevel run``: returns the exit status to use."""
    try:
        return _cmd_run(args)
    except ExecError as err:
        return _fail(str(err), EXIT_NOTFOUND if err.errno == errno.ENOENT else EXIT_NOEXEC)
    except LowlevelError as err:
        return _fail(str(err))


def _cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        return _fail("no command given: write `lowlevel run [OPTIONS] -- COMMAND [ARG...]`", 2)
    created = None
    try:
        policy = _policy_from_args(args)
        workspace = args.workspace
        if workspace is None:
            from .workspace import create_workspace
            workspace = created = create_workspace(args.input)
            inputs: list[str] = []
        else:
            inputs = args.input
        result = run(command, policy=policy, workspace=workspace, inputs=inputs, timeout=args.timeout,
                     capture=args.json)
        if created:
            print(f"lowlevel: workspace {created}", file=sys.stderr)
    except BaseException:
        if created:
            import shutil
            shutil.rmtree(created, ignore_errors=True)
        raise
        return _fail(str(err), EXIT_NOTFOUND if err.errno == errno.ENOENT else EXIT_NOEXEC)
    except (PolicyError, UnsupportedError, LaunchError) as err:
        return _fail(str(err))
    except LowlevelError as err:
        return _fail(str(err))
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    if result.timed_out:
        if not args.json:
            print(f"lowlevel: timed out after {args.timeout:g} s; the sandbox was killed", file=sys.stderr)
        return EXIT_TIMEOUT
    if result.killed_by and not args.json:
        print(f"lowlevel: killed by {result.killed_by}"
              + (f" ({result.signal_name()})" if result.term_signal else ""), file=sys.stderr)
    return result.exit_code


def cmd_doctor(args: argparse.Namespace) -> int:
    """``lowlevel doctor``: report host capabilities; non-zero when the default policy cannot run."""
    from .doctor import diagnose

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lowlevel`` console script. Returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "run":
            return cmd_run(args)
        return cmd_doctor(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
