"""What the CLI prints when there is no Result: exit statuses, the ``--json`` error object, and
writing to a stdout whose reader may have gone (``| head -1``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any


EXIT_TIMEOUT = 124

EXIT_FAILED = 125

EXIT_NOEXEC = 126

EXIT_NOTFOUND = 127


def silence_stdout() -> None:
    """Point fd 1 at /dev/null after the reader of our stdout went away (``| head -1``), so the
    interpreter's final flush does not print "Exception ignored ... BrokenPipeError".
    Source: Python docs, "Note on SIGPIPE" (signal module)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Write to stdout; if its reader is gone (EPIPE), drop the rest silently and go on, so the
    exit status is still the program's."""
    try:
        yield
    except BrokenPipeError:
        silence_stdout()


def fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"lowlevel: {message}", file=sys.stderr)
    return code


def _one_line(text: str) -> str:
    """``text`` on one line, its library hints in the CLI's spelling: the library's messages
    say "pass allow_sensitive=True (CLI: --allow-sensitive)"; the CLI's say "pass
    --allow-sensitive"."""
    text = " ".join(str(text).split())
    if "(CLI: " in text:
        import re
        text = re.sub(r"\b[a-z_]+=\S* \(CLI: (--[a-z-]+)\)", r"\1", text)
    return text


def error_object(kind: str, message: str, exit_status: int, *, err_no: int | None = None,
                 workspace: str | None = None, **extra: Any) -> dict[str, Any]:
    """The ``--json`` object for an outcome without a Result (see the module docstring)."""
    return {"error": kind, "message": _one_line(message), "exit_status": exit_status, "errno": err_no,
            "workspace": workspace, **extra}


def print_json(doc: dict[str, Any], last: tuple[str, ...] = ()) -> None:
    """Print ``doc`` with its keys sorted at every level, except that the top-level keys in
    ``last`` come at the end (a Result's ``argv``, ~150 lines of bwrap options, after the
    verdict rather than before it)."""
    if last:
        ordered = json.loads(json.dumps(doc, sort_keys=True))
        doc = {**{k: v for k, v in ordered.items() if k not in last}, **{k: ordered[k] for k in last if k in ordered}}
        json.dump(doc, sys.stdout, indent=2)
    else:
        json.dump(doc, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    sys.stdout.flush()


def report_error(args: argparse.Namespace | None, err: BaseException, code: int, *,
                 workspace: str | None = None) -> int:
    """Report one of lowlevel's own errors: one line on stderr, and the error object with --json."""
    message = _one_line(str(err))
    print(f"lowlevel: {message}", file=sys.stderr)
    if args is not None and getattr(args, "json", False):
        print_json(error_object(type(err).__name__, message, code, err_no=getattr(err, "errno", None),
                                 workspace=workspace))
    return code
