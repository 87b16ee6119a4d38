"""The values of ``lowlevel``'s command line: argparse with lowlevel's exit status and the option types.

:class:`Parser` turns a usage error into :class:`UsageError` (one line, exit 125, with a "did you
mean" for a mistyped option); the ``type=`` functions here read sizes, durations, cores, ports,
``KEY=VALUE`` pairs, ``-v`` volumes and ``--env-file`` files the way ``timeout(1)`` and ``docker run``
do (:mod:`lowlevel.units` for sizes and durations).
"""

from __future__ import annotations

import argparse
import os
import re
import stat

from lowlevel.errors import PolicyError
from lowlevel.units import duration_seconds, size_bytes

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from collections.abc import Sequence
    from typing import NoReturn


class UsageError(Exception):
    """A bad command line: one line on stderr and exit 125 (argparse would exit 2, which
    cannot be told from a program's own exit 2)."""


class Parser(argparse.ArgumentParser):
    """argparse with lowlevel's exit status: a usage error raises :class:`UsageError`."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """argparse's, but an unknown argument is reported by the subcommand it came with (its
        ``prog`` and its ``--help``: ``lowlevel run --help``, ``lowlevel image ls --help``)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> "Parser":
        """The deepest (sub)command parser ``parsed`` went through (this one when none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, Parser):
                    return chosen._chosen(parsed)
        return self

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
        import difflib  # only on this error: it is ~2 ms of imports at every start
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
                    if isinstance(parser, Parser):
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


def _duration(text: str) -> float:
    """Seconds of a duration option (:func:`lowlevel.units.duration_seconds`), its refusal as argparse's."""
    try:
        return duration_seconds(text, "duration")
    except PolicyError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("duration: ")) from None


def positive_float(text: str) -> float:
    """Seconds > 0: a number, or a duration with an s, m, h or d suffix as ``timeout(1)``
    takes (``10s``, ``2m``; :func:`lowlevel.units.duration_seconds`)."""
    value = _duration(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def timeout_arg(text: str) -> float | None:
    """``--timeout``: a duration as :func:`positive_float` takes it, below 2**31 s; ``0`` is no
    timeout at all (None), as ``timeout 0`` is for ``timeout(1)``."""
    value = _duration(text)
    if value == 0:
        return None
    if not 0 < value < 2**31:
        raise argparse.ArgumentTypeError(f"must be a duration > 0 below 2**31 s (about 68 years), or 0 for no "
                                         f"timeout, got {text!r}")
    return value


def grace(text: str) -> float:
    """``--kill-after``: a duration >= 0."""
    value = _duration(text)
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def cores(text: str) -> float:
    """``--cpus``: CPU cores (``0.5`` = half a core), as ``docker run --cpus``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of cores {text!r}: use e.g. 0.5 or 2") from None
    if not 0.01 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"must be between 0.01 and 4096 cores, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: use a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def network_mode(text: str) -> str:
    """``none`` or ``host``; ``bare`` is the value argparse passes (through this) for a bare --network."""
    if text not in ("none", "host", "bare"):
        raise argparse.ArgumentTypeError(f"invalid network mode {text!r}: use --network=none, --network=host, "
                                         "or --allow-host PATTERN for an allowlist (put -- before the command)")
    return text


def port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: use a number from 1 to 65535")
    return int(text)


def tls_port(text: str) -> int | None:
    """``--tls-port``: a port, or ``none`` (None: no port requires TLS, 443 included)."""
    if text.lower() == "none":
        return None
    try:
        return port(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: use a number from 1 to 65535, "
                                         "or none (no port requires TLS)") from None


def env_pair(text: str) -> tuple[str, str] | None:
    """``KEY=VALUE``; a bare ``KEY`` takes the caller's value, or is left out when the caller
    has none (as ``docker run -e KEY``)."""
    key, eq, value = text.partition("=")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"invalid --env {text!r}: use KEY=VALUE (or KEY to pass on the caller's "
                                         "value), KEY of letters, digits and _ (not starting with a digit)")
    if not eq:
        return (key, os.environ[key]) if key in os.environ else None
    return key, value


#: The largest ``--env-file`` read, bytes (the whole environment of a run is far smaller).
ENV_FILE_MAX_BYTES = 1024 * 1024


def read_env_file(path: str) -> list[tuple[str, str]]:
    """``--env-file FILE`` as ``docker run`` reads it: one ``KEY=VALUE`` a line, taken
    literally (no quotes removed, no ``$`` expansion); a line ``KEY`` passes on the caller's
    value (left out when it has none); blank lines and lines starting with ``#`` are skipped.

    Raises:
        UsageError: the file cannot be read, is not a regular file or a pipe, is over
            :data:`ENV_FILE_MAX_BYTES`, or a line is neither ``KEY=VALUE`` nor ``KEY`` or holds
            a NUL (the message names the file and the line number, never the line's text).
    Source: Docker CLI reference, ``docker run --env-file``.
    """
    try:
        # A regular file or a pipe (``--env-file <(cmd)``), read within a bound: not a device
        # (/dev/zero never ends). Opened non-blocking so a FIFO without a writer cannot hang
        # the open; read blocking (a FIFO nobody writes to reads as empty).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
                raise UsageError(f"run: --env-file {path}: not a regular file or a pipe")
            os.set_blocking(fd, True)
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(ENV_FILE_MAX_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > ENV_FILE_MAX_BYTES:
            raise UsageError(f"run: --env-file {path}: larger than {ENV_FILE_MAX_BYTES // 1024} KiB")
        lines = data.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"run: --env-file {path}: cannot read it: {err}") from None
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(lines, 1):
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        # The messages never quote the line: a wrong file (--env-file /etc/shadow, a key file)
        # must not end up in the caller's logs through the error.
        if "\0" in stripped:
            raise UsageError(f"run: --env-file {path}:{number}: the line holds a NUL byte, which no environment "
                             "value can; is this an env file (KEY=VALUE lines)?")
        try:
            pair = env_pair(stripped if "=" in stripped else stripped.rstrip())
        except argparse.ArgumentTypeError:
            raise UsageError(f"run: --env-file {path}:{number}: not KEY=VALUE (a name of letters, digits and _, "
                             "then =); is this an env file?") from None
        if pair is not None:
            pairs.append(pair)
    return pairs


def volume_spec(text: str) -> tuple[str, str, bool]:
    """``-v SRC:DEST[:ro|:rw]`` as ``docker run -v``: a bind, writable unless ``:ro``."""
    parts = text.split(":")
    mode = "rw"
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        mode = parts.pop()
    if len(parts) != 2 or not parts[0] or not parts[1]:
        raise argparse.ArgumentTypeError(f"invalid --volume {text!r}: use SRC:DEST, SRC:DEST:ro or SRC:DEST:rw "
                                         "(named volumes and other options are not supported)")
    return parts[0], parts[1], mode == "rw"


def bind_spec(text: str) -> tuple[str, str]:
    """``--ro``/``--rw``: ``SRC`` or ``SRC:DEST``. An empty side, or a third field (``-v``'s
    ``:ro``/``:rw``, which bound at a literal ``/x:ro``), is refused: the option is the mode."""
    if ":" in text:
        src, dest = text.split(":", 1)
        if not src or not dest or ":" in dest:
            raise argparse.ArgumentTypeError(
                f"invalid bind {text!r}: use SRC or SRC:DEST (the option says the mode: --ro read-only, --rw "
                "writable; -v SRC:DEST:ro takes docker's suffix)")
        return src, dest
    return text, ""


def input_spec(text: str) -> str | tuple[str, str]:
    """``SRC`` (copied under its base name) or ``SRC:DEST`` (DEST relative to the workspace)."""
    if ":" in text:
        src, dest = text.split(":", 1)
        if not src or not dest:
            raise argparse.ArgumentTypeError(f"invalid --input {text!r}: use PATH or PATH:DEST")
        return src, dest
    return text


def cwd_spec(text: str) -> str:
    """``--cwd``: absolute inside the sandbox, or relative to /workspace."""
    from lowlevel.spec.policy import WORKSPACE_DEST
    from lowlevel.spec.validate import sandbox_cwd

    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"invalid --cwd {text!r}")
    try:
        return sandbox_cwd(text if text.startswith("/") else f"{WORKSPACE_DEST}/{text}", "--cwd")
    except PolicyError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
