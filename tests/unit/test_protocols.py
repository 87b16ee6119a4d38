"""docs/architecture.md's protocol tables agree with both sides (native/*.c, *.h and the Python
constants): every fd number, message, record, stage and exit code the doc names.

Pure: reads the C sources' and the doc's text, imports the Python constants and calls the pure
argv builders; starts no process (tests/unit/conftest.py). The session init's codes and
``_STAGES``/``_BYE_REASONS`` are also checked C-against-Python by test_session_protocol.py, and
the struct sizes as gcc lays them out by tests/integration/test_protocol_layouts.py; here the
doc is the third party.

How a table row is checked (4 cells: value | meaning | C | Python): the value must equal
- C ``\\`native/F\\` \\`#define NAME\\```: the ``#define NAME`` of F;
- C ``\\`native/F\\` usage \\`TOKEN\\```: a number F takes on its command line: TOKEN must be in
  F's usage line (the argv builders are checked below to put the constant there);
- C ``bwrap``: bubblewrap's own option, nothing in native/ to compare;
- Python ``\\`lowlevel.module.NAME[.attr]\\```: that constant (``—``: the C side only).
"""

from __future__ import annotations

import importlib
import inspect
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from lowlevel.session import core as session_core
from lowlevel.session import protocol as S
from lowlevel.host import landlock
from lowlevel.net import egress_run
from lowlevel.sandbox import argv as argv_mod
from lowlevel.sandbox import landlock_rules
from lowlevel.sandbox import aio as sandbox_aio
from lowlevel.sandbox import drive, launcher, plan, run_workspace
from lowlevel.spec import egress

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "architecture.md").read_text()
PROTOCOLS = DOC[DOC.index("## The Python <-> C protocols"):]


def _section(number: int) -> str:
    """The text of ``### N. ...`` up to the next ``### ``."""
    start = PROTOCOLS.index(f"### {number}. ")
    end = PROTOCOLS.find("\n### ", start + 1)
    return PROTOCOLS[start:end if end >= 0 else None]


def _flat(text: str) -> str:
    """``text`` with every run of whitespace one space (the doc wraps its lines)."""
    return " ".join(text.split())


def _source(name: str) -> str:
    return (REPO / name).read_text()


def _defines(name: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^#define\s+([A-Z_0-9]+)\s+(\d+)u?\b", _source(name), re.M)}


def _usage(name: str) -> str:
    """The C file's usage line(s): ``Usage:`` in its header comment, or the argv it is run with."""
    head = _source(name).split("*/", 1)[0]
    lines = [line for line in head.splitlines() if "Usage:" in line or "/proc/self/fd/" in line]
    assert lines, f"{name} has no usage line in its header comment"
    return "\n".join(lines)


def _python(dotted: str) -> Any:
    """``lowlevel.a.b.NAME.attr``: import the longest module prefix, getattr the rest."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"no module in {dotted}")


def _rows() -> list[tuple[str, int, str, str]]:
    """``(section heading, value, C cell, Python cell)`` of every numbered 4-cell table row."""
    out = []
    heading = ""
    for line in PROTOCOLS.splitlines():
        if line.startswith("### "):
            heading = line
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) == 4 and cells[0].isdigit():
            out.append((heading, int(cells[0]), cells[2], cells[3]))
    return out


ROWS = _rows()


def test_the_doc_has_its_tables() -> None:
    """A reformatted doc must not pass by having no rows left to check."""
    assert len(ROWS) >= 45, ROWS
    for n in range(1, 6):
        _section(n)
    assert "## Layers" in DOC and "## One call's path" in DOC
    assert DOC.index("## Layers") < DOC.index("## One call's path") < DOC.index("## The Python <-> C protocols")


@pytest.mark.parametrize("heading, value, c_cell, py_cell", ROWS,
                         ids=[f"{h.split('(')[0][4:].strip()}:{c or p}" for h, _v, c, p in ROWS])
def test_each_number_matches_c_and_python(heading: str, value: int, c_cell: str, py_cell: str) -> None:
    define = re.fullmatch(r"`(native/[\w.]+)` `#define ([A-Z_0-9]+)`", c_cell)
    usage = re.fullmatch(r"`(native/[\w.]+)` usage `([A-Z_]+)`", c_cell)
    if define:
        defines = _defines(define.group(1))
        assert defines.get(define.group(2)) == value, (heading, c_cell, defines.get(define.group(2)))
    elif usage:
        assert re.search(rf"\b{usage.group(2)}\b", _usage(usage.group(1))), (heading, c_cell, _usage(usage.group(1)))
    else:
        assert c_cell == "bwrap", f"{heading}: unknown C cell {c_cell!r}"
    if py_cell != "—":
        name = re.fullmatch(r"`(lowlevel(?:\.\w+)+)`", py_cell)
        assert name, f"{heading}: unknown Python cell {py_cell!r}"
        assert _python(name.group(1)) == value, (heading, py_cell, _python(name.group(1)))
    else:
        assert define, f"{heading}: a row with neither a Python constant nor a #define checks nothing"


# --- the fds passed on the command line go where the C reads them ------------------------------

def test_guard_argv_puts_its_fds_where_the_guard_parses_them() -> None:
    """``--fd=``/``--status=``/``--cwd=`` (lowlevel_guard.c's usage and parser) from guard_argv."""
    assert landlock.guard_argv(31, 32, ("--ll=off",), cwd="/workspace") == [
        "/proc/self/fd/31", "--fd=31", "--status=32", "--cwd=/workspace", "--ll=off", "--"]
    guard = _source("native/lowlevel_guard.c")
    for option in ("--fd=", "--status=", "--cwd="):
        assert f'"{option}"' in guard and option in _usage("native/lowlevel_guard.c")


def test_relay_argv_matches_its_usage_line() -> None:
    """``/proc/self/fd/EXE_FD PORT SOCKET_PATH EXE_FD -- COMMAND`` (lowlevel_relay.c)."""
    assert "/proc/self/fd/EXE_FD PORT SOCKET_PATH EXE_FD -- COMMAND" in _usage("native/lowlevel_relay.c")
    fd = egress_run.RELAY_FD
    assert egress_run.EgressRun.wrap(None, ["true"]) == [  # type: ignore[arg-type]  # uses no state
        f"/proc/self/fd/{fd}", str(egress.PROXY_PORT), egress.SOCKET_DEST, str(fd), "--", "true"]
    assert f"`/proc/self/fd/{fd} {egress.PROXY_PORT} {egress.SOCKET_DEST} {fd} -- COMMAND...`" in _flat(_section(4))


def test_session_argv_matches_the_init_usage_line() -> None:
    """``lowlevel_init SOCK_FD IDLE_MS TOTAL_MS [CLOSE_FD [--ll...]]`` run as /proc/self/fd/EXE_FD,
    the Run's extra_fds putting the socket on SOCK_FD and the executable on EXE_FD."""
    assert "lowlevel_init SOCK_FD IDLE_MS TOTAL_MS [CLOSE_FD [--ll...]]" in _usage("native/lowlevel_init.c")
    argv = S.init_argv(None, 2.5, ["--ll-x"])
    assert argv == [f"/proc/self/fd/{S.EXE_FD}", str(S.SOCK_FD), "0", "2500", str(S.EXE_FD), "--ll-x"]
    src = inspect.getsource(session_core)
    assert "extra_fds={proto.SOCK_FD: child.fileno(), proto.EXE_FD: proto.init_fd(exe)}" in src
    assert f"`/proc/self/fd/{S.EXE_FD} {S.SOCK_FD} IDLE_MS TOTAL_MS {S.EXE_FD} [--ll...]`" in _flat(_section(3))


def test_fixed_fds_are_distinct_and_below_the_etc_copies() -> None:
    """The table's fixed numbers never collide (an fd dup2'd twice would lose one)."""
    fixed = [v for h, v, _c, p in ROWS if h.startswith("### Fd numbers")]
    assert len(fixed) == len(set(fixed)) and max(fixed) == argv_mod.ETC_COPY_FD
    fds = plan.CHILD_FDS
    assert {plan.ARGS_FD, fds.json_status, fds.seccomp, fds.passwd, fds.group} <= set(fixed)


# --- the anchor: options and report-socket records ---------------------------------------------

def test_anchor_options_are_parsed_by_the_c_and_built_by_anchor_argv() -> None:
    doc = _section(1)
    options = re.findall(r"`(--[a-z-]+=?)`", doc[doc.index("Its options"):doc.index("The report socket")])
    assert len(options) == 21, options
    c = _source("native/lowlevel_exec.c")
    built = inspect.getsource(argv_mod.anchor_argv)
    for option in options:
        assert f'"{option}"' in c, option
        assert f'"{option}' in built or f'f"{option}' in built, option


def test_anchor_report_records_are_sent_and_read_by_both_sides() -> None:
    doc = _section(1)
    words = {m.group(1) for m in re.finditer(r"^\| [a-z>< -]+ \| `([A-Z_]+)[ `]", doc, re.M)}
    assert words == {"READY", "RESET", "RESET_OK", "RESET_ERR", "EXIT"}, words
    c = _source("native/lowlevel_exec.c")
    py = "".join(inspect.getsource(m) for m in (launcher, drive, sandbox_aio, run_workspace))
    for word in words:
        assert re.search(rf'"{word}[ "]', c), word
        assert re.search(rf"""["']{word}""", py), word  # b"READY", "RESET_ERR " (removeprefix)
    assert '"READY overlay"' in c and "`READY overlay`" in doc
    assert '"EXIT %d %ld %lld %d"' in c  # status, maxrss, end ns, flags: the doc's four fields
    assert "`EXIT <wait status> <maxrss KiB> <end ns> <flags>`" in doc


# --- the guard's status records ------------------------------------------------------------------

def test_guard_record_layout_and_decoding() -> None:
    assert "struct rec { uint32_t type, a, b, c; };" in _source("native/lowlevel_guard.c")
    assert landlock._REC.format in ("=IIII", b"=IIII") and landlock._REC.size == 16
    assert "records of 16 bytes, four native-endian `uint32`" in _flat(_section(2))
    data = (struct.pack("=IIII", landlock.REC_START, 6, 0, 0)
            + struct.pack("=IIII", landlock.REC_FAIL, 2, landlock.STAGE_EXEC, 0))
    rep = landlock.parse_report(data)
    assert (rep.started, rep.abi, rep.fail_errno, rep.fail_stage) == (True, 6, 2, landlock.STAGE_EXEC)
    assert set(landlock.STAGES) == {v for h, v, c, _p in ROWS if h.startswith("### 2.") and "STAGE_" in c}


# --- the session init's record sizes as the doc states them --------------------------------------

def test_session_record_sizes_in_the_doc() -> None:
    doc = _flat(_section(3))
    for struct_name, size in (("spawn_hdr", S.SPAWN_HDR.size), ("rlim_rec", S.RLIM.size),
                              ("exit_msg", S.EXIT.size)):
        assert f"`struct {struct_name}` ({size} bytes" in doc, struct_name
    assert "(`u32` x 4)" in doc and S.SIGNAL.size == S.SMALL.size == 16


# --- the Landlock options ------------------------------------------------------------------------

def test_landlock_options_match_the_header_and_the_builder() -> None:
    doc = _section(5)
    documented = set(re.findall(r"`(--ll[a-z-]*=[a-z:]*)", doc))
    header = _source("native/lowlevel_landlock.h")
    parsed = set(re.findall(r'"(--ll[a-z-]*=[a-z:]*)"', header))
    assert documented == parsed, (documented ^ parsed)
    built = set(re.findall(r"--ll[a-z-]*=[a-z:]*", inspect.getsource(landlock_rules)))
    built |= {"--ll=" + m for m in ("on", "require")}  # "--ll=require" if ... else "--ll=on"
    assert built <= parsed, built - parsed
