"""The ``lowlevel`` command line.

``lowlevel run [OPTIONS] -- COMMAND [ARG...]`` runs COMMAND in a fresh sandbox. By default the
program's output streams live to the terminal; ``--json`` captures it and prints one JSON
object with the Result. The program never gets the caller's own stdin, stdout or stderr:
they are pipes of ours, or a pty of ours when the caller's side is a terminal, relayed live
(:mod:`lowlevel.sandbox.relay`). Stdin that is not a terminal is passed on in every mode: streamed
live, or with ``--record`` read first (at most :data:`MAX_RECORD_STDIN_BYTES`) so the record
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
``--kill-after`` later (:data:`DEFAULT_KILL_AFTER_S`); ``--cpus`` is CPU bandwidth in cores
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
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import json
import os
import re
import signal
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any, NoReturn

from lowlevel import __version__
from lowlevel.spec.egress import DEFAULT_PORTS, Egress
from lowlevel.errors import LaunchError, LowlevelError, PolicyError, UnsupportedError
from lowlevel.api import run
from lowlevel.sandbox.failures import ExecError, classify_setup_failure
from lowlevel.spec.limits import CPU_QUOTA_FALLBACK_NOTE, VERDICT_NOTE_PREFIXES, Limits
from lowlevel.spec.policy import WORKSPACE_DEST, Bind, Policy
from lowlevel.spec.report import RECORD_NOT_WRITTEN, WARNING_PREFIX, json_safe
from lowlevel.sandbox.result import Result
from lowlevel.units import duration_seconds, size_bytes

EXIT_TIMEOUT = 124
EXIT_FAILED = 125
EXIT_NOEXEC = 126
EXIT_NOTFOUND = 127

#: ``lowlevel run``'s grace between the SIGTERM at the timeout and the SIGKILL (``--kill-after``), seconds.
DEFAULT_KILL_AFTER_S = 2.0

#: The most stdin ``--record`` reads (and stores in the record), bytes.
MAX_RECORD_STDIN_BYTES = 64 * 1024 * 1024


class UsageError(Exception):
    """A bad command line: one line on stderr and exit 125 (argparse would exit 2, which
    cannot be told from a program's own exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with lowlevel's exit status: a usage error raises :class:`UsageError`."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split()) + self._suggestion(message)
        where = self.prog.partition(" ")[2]
        raise UsageError(f"{where + ': ' if where else ''}{text} (see `{self.prog} --help`)")

    def _suggestion(self, message: str) -> str:
        """``"; did you mean --timeout?"`` for an unknown option close to a known one (Python
        3.11's argparse has no ``suggest_on_error``; :func:`difflib.get_close_matches`)."""
        m = re.match(r"unrecognized arguments: (-\S+)", message)
        if not m:
            return ""
        unknown = m.group(1).split("=", 1)[0]
        known = sorted(self._option_strings())
        close = difflib.get_close_matches(unknown, known, n=1, cutoff=0.6)
        return f"; did you mean {close[0]}?" if close else ""

    def _option_strings(self) -> set[str]:
        """Every option string of this parser and of its subcommands' parsers."""
        found: set[str] = set()
        for action in self._actions:
            found.update(s for s in action.option_strings if s.startswith("--") or len(s) == 2)
            if isinstance(action, argparse._SubParsersAction):
                for parser in action.choices.values():
                    if isinstance(parser, _Parser):
                        found |= parser._option_strings()
        found.discard("--help")
        return found

def parse_size(text: str) -> int:
    """Parse a byte count with an optional binary suffix: ``"512"``, ``"64K"``, ``"256M"``, ``"2G"``.

    K, M, G, T are powers of 1024 (``KiB``/``MB`` spellings accepted alike); the same syntax as
    the MCP and Inspect configs (:func:`lowlevel.units.size_bytes`).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    try:
        return size_bytes(text, "size")
    except PolicyError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("size: ")) from None


def _positive_float(text: str) -> float:
    """Seconds > 0: a number, or a duration with an s, m, h or d suffix as ``timeout(1)``
    takes (``10s``, ``2m``; :func:`lowlevel.units.duration_seconds`)."""
    try:
        value = duration_seconds(text, "duration")
    except PolicyError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("duration: ")) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _grace(text: str) -> float:
    """``--kill-after``: a duration >= 0."""
    try:
        value = duration_seconds(text, "duration")
    except PolicyError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("duration: ")) from None
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _cores(text: str) -> float:
    """``--cpus``: CPU cores (``0.5`` = half a core), as ``docker run --cpus``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of cores {text!r}: use e.g. 0.5 or 2") from None
    if not 0.01 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"must be between 0.01 and 4096 cores, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: use a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _network_mode(text: str) -> str:
    """``none`` or ``host``; ``bare`` is the value argparse passes (through this) for a bare --network."""
    if text not in ("none", "host", "bare"):
        raise argparse.ArgumentTypeError(f"invalid network mode {text!r}: use --network=none, --network=host, "
                                         "or --allow-host PATTERN for an allowlist (put -- before the command)")
    return text


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: use a number from 1 to 65535")
    return int(text)


def _env_pair(text: str) -> tuple[str, str] | None:
    """``KEY=VALUE``; a bare ``KEY`` takes the caller's value, or is left out when the caller
    has none (as ``docker run -e KEY``)."""
    key, eq, value = text.partition("=")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"invalid --env {text!r}: use KEY=VALUE (or KEY to pass on the caller's "
                                         "value), KEY of letters, digits and _ (not starting with a digit)")
    if not eq:
        return (key, os.environ[key]) if key in os.environ else None
    return key, value


def read_env_file(path: str) -> list[tuple[str, str]]:
    """``--env-file FILE`` as ``docker run`` reads it: one ``KEY=VALUE`` a line, taken
    literally (no quotes removed, no ``$`` expansion); a line ``KEY`` passes on the caller's
    value (left out when it has none); blank lines and lines starting with ``#`` are skipped.

    Raises:
        UsageError: the file cannot be read, or a line is neither ``KEY=VALUE`` nor ``KEY``
            (the message names the file and the line number).
    Source: Docker CLI reference, ``docker run --env-file``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"run: --env-file {path}: cannot read it: {err}") from None
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(lines, 1):
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            pair = _env_pair(stripped if "=" in stripped else stripped.rstrip())
        except argparse.ArgumentTypeError:
            raise UsageError(f"run: --env-file {path}:{number}: not KEY=VALUE: {line[:60]!r}") from None
        if pair is not None:
            pairs.append(pair)
    return pairs


def _volume_spec(text: str) -> tuple[str, str, bool]:
    """``-v SRC:DEST[:ro|:rw]`` as ``docker run -v``: a bind, writable unless ``:ro``."""
    parts = text.split(":")
    mode = "rw"
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        mode = parts.pop()
    if len(parts) != 2 or not parts[0] or not parts[1]:
        raise argparse.ArgumentTypeError(f"invalid --volume {text!r}: use SRC:DEST, SRC:DEST:ro or SRC:DEST:rw "
                                         "(named volumes and other options are not supported)")
    return parts[0], parts[1], mode == "rw"


def _bind_spec(text: str) -> tuple[str, str]:
    """``SRC`` or ``SRC:DEST``."""
    if ":" in text:
        src, dest = text.split(":", 1)
        return src, dest
    return text, ""


def _input_spec(text: str) -> str | tuple[str, str]:
    """``SRC`` (copied under its base name) or ``SRC:DEST`` (DEST relative to the workspace)."""
    if ":" in text:
        src, dest = text.split(":", 1)
        if not src or not dest:
            raise argparse.ArgumentTypeError(f"invalid --input {text!r}: use PATH or PATH:DEST")
        return src, dest
    return text


def _cwd_spec(text: str) -> str:
    """``--cwd``: absolute inside the sandbox, or relative to /workspace."""
    from lowlevel.spec.validate import sandbox_cwd

    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"invalid --cwd {text!r}")
    try:
        return sandbox_cwd(text if text.startswith("/") else f"{WORKSPACE_DEST}/{text}", "--cwd")
    except PolicyError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


#: ``lowlevel run --help``'s closing text: exit statuses and examples.
RUN_EPILOG = """\
exit status (as timeout(1)):
  N        the program's own exit status
  124      the --timeout fired (SIGTERM to the sandbox, SIGKILL --kill-after later)
  125      lowlevel failed: a usage error, a bad option value, workspace or sandbox setup
  126      the command is not executable
  127      the command is not found
  128+N    signal N killed the program, or interrupted lowlevel (SIGINT, SIGTERM...)

examples:
  lowlevel run -- python3 -c 'print(42)'
  lowlevel run --timeout 10s --memory 512M --cpus 0.5 -- make test
  lowlevel run --timeout 2m -k 10s -- ./server       # 10 s to shut down after the SIGTERM
  lowlevel run -v "$PWD/data:/data:ro" -e API_MODE=test -w src -- ./run.sh
  lowlevel run --input main.py --json -- python3 main.py    # one JSON object (argv last)
  lowlevel run --allow-host pypi.org -- pip download requests
  lowlevel run --image python:3.12 --rm -- python3 -V
"""


#: The subcommands, in the order ``lowlevel --help`` lists them.
COMMANDS = ("run", "doctor", "cleanup", "replay", "mcp", "image")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser for ``lowlevel`` (exposed for docs and tests).

    Args:
        only: build just this subcommand's parser (what :func:`main` does once it knows the
            command: the others, ``image`` above all, cost ~10-40 ms of imports and argparse
            set-up at every CLI start); None builds them all (``lowlevel --help``, an unknown
            command, docs).
    """
    parser = _Parser(prog="lowlevel", description="Run untrusted programs in a bubblewrap "
                                     "sandbox with seccomp and resource limits.")
    parser.add_argument("--version", action="version", version=f"lowlevel {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{run,doctor,cleanup,replay,mcp,image}")
    if only in (None, "run"):
        _add_run(sub)
    if only in (None, "cleanup", "doctor", "replay", "mcp"):
        _add_others(sub, only)
    if only in (None, "image"):
        from lowlevel.cli.image_cli import add_image_parser
        add_image_parser(sub)
    return parser


def _add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="run a command in a fresh sandbox",
                       description="Run COMMAND in a fresh sandbox. Put -- before the command.",
                       epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workspace", metavar="DIR", help="existing host dir bound read-write at /workspace "
                   "(default: a fresh per-run dir, its path printed to stderr)")
    p.add_argument("--input", metavar="PATH[:DEST]", action="append", default=[], type=_input_spec,
                   help="file or dir copied into the workspace before the run, under its base name or at "
                   "DEST (relative to the workspace) (repeatable)")
    p.add_argument("-w", "--cwd", "--workdir", dest="cwd", metavar="DIR", type=_cwd_spec, default=None,
                   help="working directory inside the sandbox, absolute or relative to /workspace "
                   "(default /workspace, or the image's WorkingDir)")
    p.add_argument("--timeout", metavar="DURATION", type=_positive_float, default=60.0,
                   help="wall-clock limit: seconds, or with an s/m/h/d suffix as timeout(1) (10s, 2m; "
                   "default 60); exit 124 when it fires")
    p.add_argument("-k", "--kill-after", metavar="DURATION", type=_grace, default=None,
                   help="as timeout -k: at the timeout, SIGTERM every process of the sandbox, and SIGKILL "
                   f"it this long after if it has not ended (default {DEFAULT_KILL_AFTER_S:g}s; 0: SIGKILL at "
                   "once; with --record: 0)")
    p.add_argument("--network", nargs="?", const="bare", default=None, type=_network_mode, metavar="{none,host}",
                   help="none (default): the sandbox's own loopback only; host: the host's whole network "
                   "(its 127.0.0.1 services, cloud metadata and abstract unix sockets included). A bare "
                   "--network means host and prints a warning. For an allowlist use --allow-host")
    p.add_argument("--allow-host", metavar="PATTERN", action="append", default=[],
                   help="egress by allowlist: let the sandbox reach this host through lowlevel's HTTP proxy "
                   "(exact name, *.suffix, or *; repeatable; HTTP_PROXY/HTTPS_PROXY are set inside, no DNS). "
                   "Names resolving to loopback/private/link-local addresses and IP literals are refused")
    p.add_argument("--deny-host", metavar="PATTERN", action="append", default=[],
                   help="egress: refuse this host pattern even when --allow-host matches (repeatable)")
    p.add_argument("--allow-cidr", metavar="CIDR", action="append", default=[],
                   help="egress: also allow addresses in this network, private ones included (repeatable)")
    p.add_argument("--allow-port", metavar="PORT", action="append", default=[], type=_port,
                   help="egress: allow this port besides 80 and 443 (repeatable)")
    p.add_argument("--ca-cert", metavar="FILE.pem", action="append", default=[],
                   help="egress: CA certificate(s) the sandbox trusts besides the system's (repeatable)")
    p.add_argument("--net-bytes", metavar="BYTES", type=parse_size,
                   help="egress: bytes the run may move through the proxy, both ways; past it connections are cut")
    p.add_argument("--ro", metavar="PATH[:DEST]", action="append", default=[], type=_bind_spec,
                   help="extra read-only bind (repeatable)")
    p.add_argument("--rw", metavar="PATH[:DEST]", action="append", default=[], type=_bind_spec,
                   help="extra writable bind (repeatable)")
    p.add_argument("-v", "--volume", metavar="SRC:DEST[:ro]", action="append", default=[], type=_volume_spec,
                   help="bind as docker run -v: writable, read-only with :ro (repeatable; the same checks "
                   "as --ro/--rw)")
    p.add_argument("--allow-sensitive", action="store_true",
                   help="allow binds of credential dirs, home, /run, sockets, and a --workspace that is a "
                   "system or home dir (dangerous)")
    p.add_argument("--allow-sockets", action="store_true",
                   help="keep the unix sockets inside --ro/--rw directories reachable (default: the ones found "
                   "are masked; a D-Bus or Docker socket there is a way out of the sandbox)")
    p.add_argument("-e", "--env", metavar="KEY=VALUE", action="append", default=[], type=_env_pair,
                   help="environment variable inside (repeatable); a bare KEY passes on the caller's value")
    p.add_argument("--env-file", metavar="FILE", action="append", default=[],
                   help="read KEY=VALUE lines from FILE, as docker run --env-file (repeatable; -e wins)")
    p.add_argument("--memory", metavar="BYTES", type=parse_size, help="memory limit of the run (cgroup; "
                   "RLIMIT_DATA fallback), e.g. 512M (default 2.5G: 1G for the program + the tmpfs bounds of "
                   "--workspace-size and twice --tmp-size, whose files are RAM counted in it)")
    p.add_argument("--cpu", metavar="DURATION", type=_positive_float, help="CPU time, seconds or with a "
                   "suffix (RLIMIT_CPU; the program is killed past it), default 60")
    p.add_argument("--cpus", metavar="CORES", type=_cores, help="CPU bandwidth in cores, as docker run --cpus "
                   "(0.5 = half a core; cgroup cpu.max / cpu.cfs_quota_us): throttles, never kills. Without a "
                   "writable cpu cgroup (an unprivileged caller) it is not enforced and a warning says so")
    p.add_argument("--pids", metavar="N", type=_positive_int, help="processes+threads (cgroup pids.max; "
                   "RLIMIT_NPROC fallback), default 256")
    p.add_argument("--fsize", metavar="BYTES", type=parse_size, help="largest file written (RLIMIT_FSIZE), "
                   "default 2G (above the workspace bound: filling it is ENOSPC, not SIGXFSZ)")
    p.add_argument("--nofile", metavar="N", type=_positive_int, help="open files (RLIMIT_NOFILE), default 1024")
    p.add_argument("--tmp-size", metavar="BYTES", type=parse_size, help="size of /tmp tmpfs, default 256M")
    p.add_argument("--workspace-size", metavar="BYTES", type=parse_size,
                   help="total bytes the run may write into its workspace (the copy-on-write upper "
                   "layer's tmpfs: ENOSPC inside beyond it), default 1G")
    keep = p.add_mutually_exclusive_group()
    keep.add_argument("--discard", action="store_true", help="drop the run's changes: the workspace stays "
                      "exactly as it was (they are still listed with --json)")
    keep.add_argument("--commit-on-success", action="store_true", help="apply the run's changes to the "
                      "workspace only if the program exited 0 and was not killed (default: always)")
    p.add_argument("--json", action="store_true", help="capture output; print one JSON object with the Result")
    p.add_argument("--rm", action="store_true", help="remove the fresh per-run workspace after the run "
                   "(--json still lists its changes); not with --workspace")
    p.add_argument("--deterministic", action="store_true", help="deterministic mode: TZ=UTC, LANG, "
                   "SOURCE_DATE_EPOCH, PYTHONHASHSEED=0, fixed uid/gid, sorted env")
    p.add_argument("--record", metavar="FILE", help="write a run record (JSON) to FILE and copy the inputs "
                   "to FILE.inputs/ for `lowlevel replay`")
    p.add_argument("--image", metavar="REF", help="run on an imported image (NAME[:TAG] or sha256:ID) instead of "
                   "the host's /usr; without a COMMAND, its Entrypoint+Cmd (see `lowlevel image`)")
    p.add_argument("--rootfs", metavar="DIR", help="run on this root filesystem tree instead of the host's /usr")
    p.add_argument("--writable-root", action="store_true", help="a per-run writable layer over --image/--rootfs, "
                   "discarded after the run")
    p.add_argument("--image-store", metavar="DIR", help="image store for --image (default $LOWLEVEL_IMAGE_STORE, "
                   "else /var/lib/lowlevel/images for root, ~/.local/share/lowlevel/images otherwise)")
    p.add_argument("--landlock", choices=("on", "off", "require"), default="on",
                   help="Landlock, the second wall (default on: best effort; require: fail without it)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")


def _add_others(sub: Any, only: str | None) -> None:
    if only in (None, "cleanup"):
        _add_cleanup(sub)
    if only in (None, "doctor"):
        d = sub.add_parser("doctor", help="check what this host can do",
                           description="Check what this host can do for lowlevel: bwrap, user namespaces, "
                           "seccomp, Landlock, pidfds, cgroups, the workspace model and uid range, images, "
                           "leftovers of interrupted runs. Exit 0 when every required check passes.")
        d.add_argument("--json", action="store_true", help="print a JSON report")
    if only in (None, "replay"):
        _add_replay(sub)
    if only in (None, "mcp"):
        _add_mcp(sub)


def _add_cleanup(sub: Any) -> None:
    c = sub.add_parser("cleanup", help="remove what interrupted runs left (stale cgroups, egress sockets, "
                       "commit temporaries); never a workspace",
                       description="Remove what interrupted runs left on this host: per-run cgroups of dead "
                       "callers, egress socket directories whose proxy is gone, temporaries of commits killed "
                       "mid-way, workspaces a killed root caller left handed over (fallback without overlay). "
                       "Never a workspace's content. Exit 0: nothing left; 1: something stayed (listed).")
    c.add_argument("--workspace", metavar="DIR", action="append", default=[],
                   help="also remove interrupted commits' temporaries in DIR (repeatable)")
    c.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    c.add_argument("--json", action="store_true", help="print one JSON object")


def _add_replay(sub: Any) -> None:
    r = sub.add_parser("replay", help="rerun a recorded run and compare its outputs",
                       description="Rerun the run recorded in FILE (written by `lowlevel run --record FILE`) "
                       "with the same policy and inputs. Exit 0: outputs match; 1: they differ; 125: cannot replay.")
    r.add_argument("file", metavar="FILE", help="the record")
    r.add_argument("--json", action="store_true", help="print the differences and the new record as JSON")
    r.add_argument("--keep-workspace", action="store_true", help="keep the replay's workspace")
    r.add_argument("--max-bytes", metavar="BYTES", type=parse_size, default=None,
                   help="most bytes rebuilding the record's workspace may write (default 256M)")
    r.add_argument("--trust-record-policy", action="store_true",
                   help="replay even when the record's policy is looser than the default (binds, network, "
                   "seccomp off, higher limits); a record is untrusted input")
    r.add_argument("--image-store", metavar="DIR", help="image store holding the record's image")


def _add_mcp(sub: Any) -> None:
    m = sub.add_parser("mcp", help="serve the Model Context Protocol over stdio",
                       description="MCP tool server over stdio. The operator's settings (file and flags) bound "
                       "every request: clients can narrow limits, never widen them.")
    m.add_argument("--config", metavar="FILE.toml", help="operator config (see lowlevel.mcp_server)")
    m.add_argument("--workspace-base", metavar="DIR", help="directory of the workspaces")
    m.add_argument("--network", action=argparse.BooleanOptionalAction, default=None,
                   help="let clients request the host's whole network (default: --no-network)")
    m.add_argument("--allow-host", metavar="PATTERN", action="append", default=None,
                   help="egress allowlist for every run (repeatable; config [egress] allow); clients may "
                   "narrow it with allow_hosts, never widen it")
    m.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="deterministic mode for every run")
    m.add_argument("--max-timeout", metavar="DURATION", type=_positive_float, help="ceiling for timeout_s")
    m.add_argument("--max-output-bytes", metavar="BYTES", type=parse_size, help="per stream in results")
    m.add_argument("--memory", metavar="BYTES", type=parse_size, help="memory ceiling per run")
    m.add_argument("--cpu", metavar="DURATION", type=_positive_float, help="CPU seconds ceiling")
    m.add_argument("--pids", metavar="N", type=_positive_int, help="process ceiling")
    m.add_argument("--allow-bind", metavar="PATH", action="append", default=None,
                   help="host path clients may ask to bind read-only (repeatable)")


def _silence_stdout() -> None:
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
def _reader_may_leave() -> Iterator[None]:
    """Write to stdout; if its reader is gone (EPIPE), drop the rest silently and go on, so the
    exit status is still the program's."""
    try:
        yield
    except BrokenPipeError:
        _silence_stdout()


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"lowlevel: {message}", file=sys.stderr)
    return code


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def error_object(kind: str, message: str, exit_status: int, *, err_no: int | None = None,
                 workspace: str | None = None, **extra: Any) -> dict[str, Any]:
    """The ``--json`` object for an outcome without a Result (see the module docstring)."""
    return {"error": kind, "message": _one_line(message), "exit_status": exit_status, "errno": err_no,
            "workspace": workspace, **extra}


def _print_json(doc: dict[str, Any], last: tuple[str, ...] = ()) -> None:
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


def _error(args: argparse.Namespace | None, err: BaseException, code: int, *, workspace: str | None = None) -> int:
    """Report one of lowlevel's own errors: one line on stderr, and the error object with --json."""
    message = _one_line(str(err))
    print(f"lowlevel: {message}", file=sys.stderr)
    if args is not None and getattr(args, "json", False):
        _print_json(error_object(type(err).__name__, message, code, err_no=getattr(err, "errno", None),
                                 workspace=workspace))
    return code


def _policy_from_args(args: argparse.Namespace) -> Policy:
    overrides = {name: getattr(args, attr) for name, attr in (
        ("memory_bytes", "memory"), ("cpu_s", "cpu"), ("pids", "pids"), ("fsize_bytes", "fsize"),
        ("nofile", "nofile"), ("tmp_size_bytes", "tmp_size"),
        ("workspace_bytes", "workspace_size")) if getattr(args, attr) is not None}
    binds = [Bind(src, dest, writable=False, allow_sensitive=args.allow_sensitive,
                  allow_sockets=args.allow_sockets) for src, dest in args.ro]
    binds += [Bind(src, dest, writable=True, allow_sensitive=args.allow_sensitive,
                   allow_sockets=args.allow_sockets) for src, dest in args.rw]
    binds += [Bind(src, dest, writable=writable, allow_sensitive=args.allow_sensitive,
                   allow_sockets=args.allow_sockets) for src, dest, writable in args.volume]
    if args.cpus is not None:
        overrides["cpu_quota"] = args.cpus
    env = [pair for path in args.env_file for pair in read_env_file(path)]
    env += [pair for pair in args.env if pair is not None]
    if args.net_bytes is not None:
        overrides["net_bytes"] = args.net_bytes
    network: bool | Egress = args.network in ("host", "bare")
    if _egress_requested(args):
        pem = ""
        for path in args.ca_cert:
            try:
                with open(path, encoding="ascii") as f:
                    pem += f.read().rstrip("\n") + "\n"
            except (OSError, UnicodeDecodeError) as err:
                raise PolicyError(f"--ca-cert {path}: cannot read it: {err}") from None
        network = Egress(allow=tuple(args.allow_host), deny=tuple(args.deny_host),
                         allow_cidrs=tuple(args.allow_cidr), allow_ports=DEFAULT_PORTS + tuple(args.allow_port),
                         extra_ca_pem=pem)
    if args.image and args.rootfs:
        raise PolicyError("give --image or --rootfs, not both")
    landlock = {"on": True, "off": False}.get(args.landlock, args.landlock)
    return Policy(network=network, binds=tuple(binds), env=tuple(env), limits=Limits(**overrides),
                  deterministic=args.deterministic, image=args.image, rootfs=args.rootfs,
                  rootfs_writable=args.writable_root, landlock=landlock)


def _egress_requested(args: argparse.Namespace) -> bool:
    return bool(args.allow_host or args.deny_host or args.allow_cidr or args.allow_port or args.ca_cert)


class Interrupted(BaseException):
    """SIGINT, SIGTERM, SIGHUP or SIGQUIT ended ``lowlevel run``; carries what main() reports."""

    def __init__(self, signum: int, workspace: str | None, removed: bool) -> None:
        super().__init__(signum)
        self.signum = signum
        self.workspace = workspace
        self.removed = removed


def read_stdin_for_record(limit: int = MAX_RECORD_STDIN_BYTES, fd: int = 0) -> bytes | None:
    """Stdin for ``--record``: all of it (at most ``limit`` bytes), or None for a terminal or
    a closed fd (the program then gets ``/dev/null``).

    Raises:
        UsageError: more than ``limit`` bytes.
    """
    from lowlevel.sandbox.relay import is_terminal_or_none

    if is_terminal_or_none(fd):
        return None
    chunks: list[bytes] = []  # an empty stdin is recorded as none: the program reads EOF either way
    total = 0
    while True:
        try:
            data = os.read(fd, min(1 << 20, limit + 1 - total))
        except InterruptedError:
            continue
        if not data:
            break
        chunks.append(data)
        total += len(data)
        if total > limit:
            raise UsageError(f"stdin is larger than {limit} bytes, the most --record stores: "
                             "put the data in a file and pass it with --input")
    return b"".join(chunks) or None


def cmd_run(args: argparse.Namespace) -> int:
    """``lowlevel run``: returns the exit status to use."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.image_store:
        from lowlevel.cli.image_cli import use_store
        use_store(args.image_store)
    if not command and args.image:
        # The image's Entrypoint + Cmd (an explicit COMMAND replaces both: explicit arguments win).
        from lowlevel.image import ImageStore
        try:
            command = ImageStore().get(args.image).command()
        except LowlevelError as err:  # no such image, or no Entrypoint/Cmd: one line, exit 125
            return _error(args, err, EXIT_FAILED)
    if not command:
        raise UsageError("run: no command given: write `lowlevel run [OPTIONS] -- COMMAND [ARG...]`")
    if args.rm and args.workspace is not None:
        raise UsageError("run: --rm removes the fresh per-run workspace; it does not go with "
                         "--workspace (lowlevel never deletes your directory)")
    if args.network in ("host", "bare", "none") and _egress_requested(args):
        raise UsageError(f"run: --network={'host' if args.network == 'bare' else args.network} and --allow-host "
                         "(or --deny-host/--allow-cidr/--allow-port/--ca-cert) contradict each other: "
                         "--allow-host alone gives an allowlist")
    if args.net_bytes is not None and not _egress_requested(args):
        raise UsageError("run: --net-bytes is enforced by the egress proxy: use it with --allow-host")
    if args.record is not None and args.kill_after:
        raise UsageError("run: --kill-after does not go with --record (a record replays the SIGKILL at the "
                         "timeout): drop --kill-after, or --record")
    if args.record is not None and (args.discard or args.commit_on_success):
        raise UsageError("run: --record hashes the workspace after the run, so the run's changes are always "
                         "applied: drop --discard/--commit-on-success, or --record")
    if args.network == "bare":
        print("lowlevel: warning: --network gives the sandbox the host's whole network (127.0.0.1 services, "
              "cloud metadata); say --network=host to confirm, or use --allow-host HOST", file=sys.stderr)
    created: list[str] = []  # the fresh workspace, while it exists
    try:
        return _cmd_run(args, command, created)
    except ExecError as err:
        return _error(args, err, EXIT_NOTFOUND if err.errno == errno.ENOENT else EXIT_NOEXEC,
                      workspace=created[0] if created else None)
    except LowlevelError as err:
        return _error(args, err, EXIT_FAILED, workspace=created[0] if created else None)


def _remove(path: str) -> None:
    from lowlevel.workspace import remove_workspace
    try:
        remove_workspace(path)
    except LowlevelError as err:
        print(f"lowlevel: --rm: {err}", file=sys.stderr)


def _cmd_run(args: argparse.Namespace, command: list[str], created: list[str]) -> int:
    from lowlevel.sandbox.relay import StdioRelay, is_terminal_or_none

    stdin: bytes | None = None
    if args.record is not None:
        stdin = read_stdin_for_record()
    result: Result | None = None
    try:
        policy = _policy_from_args(args)
        workspace = args.workspace
        if workspace is None:
            from lowlevel.workspace import create_workspace
            workspace = create_workspace(args.input, disposable=args.rm)
            created.append(workspace)
            inputs: list[Any] = []
        else:
            inputs = args.input
        capture = args.json or args.record is not None
        kw: dict[str, Any] = dict(policy=policy, workspace=workspace, inputs=inputs, timeout=args.timeout,
                                  capture=capture, cwd=args.cwd, allow_sensitive_workspace=args.allow_sensitive)
        if args.record is None:
            kw["commit"] = False if args.discard else "on_success" if args.commit_on_success else True
            kw["kill_after"] = DEFAULT_KILL_AFTER_S if args.kill_after is None else args.kill_after
        if args.record is not None:
            result = run(command, record=args.record, stdin=stdin, **kw)
        elif args.json and is_terminal_or_none(0):
            result = run(command, **kw)  # a terminal is not read with --json: /dev/null
        else:
            with StdioRelay(stdin=True, output=not capture) as relay:
                try:
                    result = run(command, stdio_fds=relay.child_fds, **kw)
                except LaunchError as err:
                    relay.finish()
                    # A failure the guard reported (errno set: a cwd, Landlock) is already specific.
                    if isinstance(err, ExecError) or err.stderr or err.errno is not None or not relay.stderr_tail:
                        raise
                    # bwrap's own message (an execvp failure: a missing ELF interpreter...)
                    # went through the relay, not into the Result.
                    raise classify_setup_failure(relay.stderr_tail.replace(b"\r\n", b"\n"), err.argv,
                                                 command) from None
                relay.finish()
        if args.record is not None and not args.json:
            with _reader_may_leave():
                sys.stdout.buffer.write(result.stdout)
                sys.stdout.flush()
            sys.stderr.buffer.write(result.stderr)
            sys.stderr.flush()
        if created and not args.rm:
            print(f"lowlevel: workspace {created[0]}", file=sys.stderr)
    except (KeyboardInterrupt, Terminated) as err:
        # The program may have written into its workspace: keep it (as after a normal end)
        # unless --rm asked for it to go.
        signum = err.signum if isinstance(err, Terminated) else signal.SIGINT
        if created and args.rm:
            _remove(created[0])
        raise Interrupted(signum, created[0] if created else None, bool(created and args.rm)) from None
    except BaseException as err:
        if created:
            from lowlevel.record import RecordError
            if isinstance(err, (PolicyError, UnsupportedError, UsageError, LaunchError, RecordError)):
                # Nothing ran (a bad option, the command not found, setup failed): the
                # fresh workspace holds only the inputs.
                _remove(created[0])
                created.clear()
            else:
                # Maybe after the program ran (giving the workspace back failed...): keep it.
                print(f"lowlevel: workspace {created[0]}", file=sys.stderr)
        raise
    try:
        return _report(args, result)
    finally:
        if created and args.rm:
            _remove(created[0])


def _report(args: argparse.Namespace, result: Result) -> int:
    for note in result.notes:
        if note.startswith((RECORD_NOT_WRITTEN, WARNING_PREFIX)):
            print(f"lowlevel: {note}", file=sys.stderr)
        elif note == CPU_QUOTA_FALLBACK_NOTE and args.cpus is not None:
            print(f"lowlevel: warning: --cpus {args.cpus:g}: {note}; --cpu SECONDS (RLIMIT_CPU) still bounds "
                  "CPU time", file=sys.stderr)
    if args.json:
        with _reader_may_leave():
            _print_json(result.to_json(), last=("argv",))
    if result.timed_out:
        if not args.json:
            grace = DEFAULT_KILL_AFTER_S if args.kill_after is None else args.kill_after
            how = (f"SIGTERM, then SIGKILL within {grace:g} s" if grace and args.record is None
                   else "the sandbox was killed")
            print(f"lowlevel: timed out after {args.timeout:g} s; {how}", file=sys.stderr)
        return EXIT_TIMEOUT
    if result.network and not args.json:
        from lowlevel.net.egress_proxy import describe_attempt
        for attempt in result.network:
            if not attempt.allowed or attempt.error:
                print(f"lowlevel: egress: {describe_attempt(attempt)}", file=sys.stderr)
    if result.killed_by and not args.json:
        print(f"lowlevel: killed by {result.killed_by}"
              + (f" ({result.signal_name()})" if result.term_signal else ""), file=sys.stderr)
    if not args.json:
        for note in result.notes:  # why: the memory limit and the tmpfs bounds, pids, the network policy
            if note.startswith(VERDICT_NOTE_PREFIXES):
                print(f"lowlevel: {note}", file=sys.stderr)
    return result.exit_code


def cmd_cleanup(args: argparse.Namespace) -> int:
    """``lowlevel cleanup``: exit 0 when nothing is left, 1 when something stayed."""
    from lowlevel.cleanup import clean, find_leftovers

    workspaces = tuple(os.path.abspath(w) for w in args.workspace)
    from lowlevel.cleanup import Leftover
    found: list[Leftover] = []
    removed: list[Leftover] = []
    problems: list[str] = []
    if args.dry_run:
        found = find_leftovers(workspaces)
    else:
        removed, problems = clean(workspaces)
    if args.json:
        _print_json({"found": [vars(x) for x in found], "removed": [vars(x) for x in removed],
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
    return 1 if problems else 0


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
        return _error(args, err, EXIT_FAILED)
    except Exception as err:  # noqa: BLE001 - a record is untrusted input: one line, never a traceback
        return _error(args, RuntimeError(f"replay: cannot replay {args.file!r}: {type(err).__name__}: {err}"),
                      EXIT_FAILED)
    if args.keep_workspace and report.result is not None and report.result.workspace:
        print(f"lowlevel: workspace {report.result.workspace}", file=sys.stderr)  # as `run` says where it is
    if args.json:
        with _reader_may_leave():
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
    """``lowlevel mcp``: serve MCP over stdio until the client goes away."""
    from lowlevel.mcp_server import ServerConfig, serve

    overrides: dict[str, object] = {}
    for key, attr in (("workspace_base", "workspace_base"), ("network", "network"),
                      ("deterministic", "deterministic"), ("max_timeout_s", "max_timeout"),
                      ("max_output_bytes", "max_output_bytes"), ("allowed_binds", "allow_bind")):
        if getattr(args, attr) is not None:
            overrides[key] = getattr(args, attr)
    if args.allow_host is not None:
        overrides["egress"] = {"allow": args.allow_host}
    try:
        config = ServerConfig.from_toml(args.config, **overrides) if args.config else \
            ServerConfig.from_mapping(overrides)
        limit_overrides = {name: getattr(args, attr) for name, attr in (
            ("memory_bytes", "memory"), ("cpu_s", "cpu"), ("pids", "pids")) if getattr(args, attr) is not None}
        if limit_overrides:
            import dataclasses
            config = dataclasses.replace(config, limits=dataclasses.replace(config.limits, **limit_overrides))
    except (LowlevelError, OSError, ValueError) as err:
        return _fail(f"mcp config: {err}")
    try:
        serve(config)
    except ImportError as err:
        return _fail(f"{err}: install the MCP SDK with `pip install '.[mcp]'` in the lowlevel checkout")
    except LowlevelError as err:  # e.g. a refused --workspace-base
        return _fail(f"mcp: {err}")
    return 0


class Terminated(BaseException):
    """SIGTERM, SIGHUP or SIGQUIT arrived during ``run`` or ``replay``.

    Raised from the signal handler, like KeyboardInterrupt for SIGINT, so every ``finally``
    runs before the CLI exits 128+N: the sandbox is killed and reaped and the workspace given
    back to its owners (with the default action the process would die with the tree still
    owned by the sandbox's uid). A BaseException, so ``except Exception`` cannot swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


#: Signals turned into :class:`Terminated`; SIGINT is KeyboardInterrupt already. SIGQUIT
#: (``^\``) too: its default action would dump core and skip the cleanup (the sandbox left to
#: ``--die-with-parent``, the workspace not given back, the terminal not restored).
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def clean_shutdown() -> Iterator[None]:
    """Turn SIGTERM, SIGHUP and SIGQUIT into :class:`Terminated` while the block runs; restore after.

    The first signal raises; later ones are ignored, so a second SIGTERM cannot cut the
    cleanup short. A signal the caller ignores (``nohup`` ignores SIGHUP) stays ignored.
    Outside the main thread (``signal.signal`` refuses) nothing is installed.
    """
    def handler(signum: int, _frame: FrameType | None) -> None:
        for sig in SHUTDOWN_SIGNALS:
            if sig in old:
                signal.signal(sig, signal.SIG_IGN)
        raise Terminated(signum)

    old: dict[int, object] = {}
    try:
        for sig in SHUTDOWN_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                old[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for signum, previous in old.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]


def _wants_json(argv: Sequence[str]) -> bool:
    """``--json`` among the options (before ``--``), for errors found before parsing ends."""
    head = list(argv[:list(argv).index("--")] if "--" in argv else argv)
    return "--json" in head


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lowlevel`` console script. Returns the exit status."""
    from lowlevel import _startup
    try:
        _startup.disarm()  # the start-up ^C notice (lowlevel._startup) hands over to the handling below
        return _main(argv)
    except KeyboardInterrupt:  # between the two, or a second ^C while _main reported the first
        print("lowlevel: SIGINT: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        _startup.finished()


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args: argparse.Namespace | None = None
    try:
        # Only the named subcommand's parser (the others cost imports and set-up); all of them for
        # --help, --version or a name argparse must refuse with the list of choices.
        parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
        args = parser.parse_args(argv)
        if args.cmd == "run":
            with clean_shutdown():
                return cmd_run(args)
        if args.cmd == "replay":
            with clean_shutdown():
                return cmd_replay(args)
        if args.cmd == "mcp":
            return cmd_mcp(args)
        if args.cmd == "image":
            from lowlevel.cli.image_cli import cmd_image
            with clean_shutdown():  # SIGTERM/SIGHUP: the import's sandboxes killed, its staging removed
                return cmd_image(args)
        if args.cmd == "cleanup":
            return cmd_cleanup(args)
        return cmd_doctor(args)
    except UsageError as err:
        return _error(args if args is not None else argparse.Namespace(json=_wants_json(argv)), err, EXIT_FAILED)
    except BrokenPipeError:
        _silence_stdout()  # the reader of our stdout went away: no traceback
        return 128 + signal.SIGPIPE
    except (KeyboardInterrupt, Terminated, Interrupted) as err:
        signum = err.signum if isinstance(err, (Terminated, Interrupted)) else signal.SIGINT
        name = signal.Signals(signum).name
        workspace = err.workspace if isinstance(err, Interrupted) else None
        message = f"{name}: the sandbox was killed"
        if args is not None and getattr(args, "image_cmd", None) == "import":
            message = f"{name}: interrupted; nothing was imported, the staging directory was removed"
        elif workspace is not None:
            message += (f"; workspace {workspace} removed (--rm)" if err.removed  # type: ignore[union-attr]
                        else f" and the workspace given back: {workspace}")
        else:
            message += " and the workspace given back"
        print(f"lowlevel: {message}", file=sys.stderr)
        if args is not None and getattr(args, "json", False):
            _print_json(error_object("Interrupted", message, 128 + signum, workspace=workspace, signal=name))
        return 128 + signum


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
