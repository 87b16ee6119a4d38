"""The session protocol's two halves (native/lowlevel_init.c, lowlevel/session/__init__.py) agree
(pure: the C source's text; the struct sizes, which need the compiler, are
tests/integration/test_protocol_layouts.py)."""

from __future__ import annotations

import re
from pathlib import Path

from lowlevel import session as S

SOURCE = Path(__file__).resolve().parents[2] / "native" / "lowlevel_init.c"

# C #define -> the Python constant that mirrors it.
MIRRORED = {
    "PROTO_VERSION": S._PROTO_VERSION, "MSG_SPAWN": S._MSG_SPAWN, "MSG_SIGNAL": S._MSG_SIGNAL,
    "MSG_HELLO": S._MSG_HELLO, "MSG_STARTED": S._MSG_STARTED, "MSG_EXIT": S._MSG_EXIT, "MSG_BYE": S._MSG_BYE,
    "SPAWN_STDIN_PIPE": S._SPAWN_STDIN_PIPE, "SPAWN_BODY_MEMFD": S._SPAWN_BODY_MEMFD,
    "SIGNAL_TREE": S._SIGNAL_TREE, "EXIT_WAIT_STATUS": S._EXIT_WAIT_STATUS,
    "EXIT_SETUP_FAILED": S._EXIT_SETUP_FAILED, "EXIT_SPAWN_FAILED": S._EXIT_SPAWN_FAILED,
    "EXIT_SHEPHERD_DIED": S._EXIT_SHEPHERD_DIED, "EXITF_TIMED_OUT": S._EXITF_TIMED_OUT,
    "EXITF_CANCELLED": S._EXITF_CANCELLED,
}


def _defines() -> dict[str, int]:
    out = {}
    for m in re.finditer(r"^#define\s+([A-Z_]+)\s+(\d+)u?\b", SOURCE.read_text(), re.M):
        out[m.group(1)] = int(m.group(2))
    return out


def test_constants_match():
    defines = _defines()
    assert {k: defines.get(k) for k in MIRRORED} == MIRRORED
    stages = {"chdir": "STAGE_CHDIR", "setrlimit": "STAGE_RLIMIT", "execve": "STAGE_EXEC", "stdio": "STAGE_STDIO",
              "landlock": "STAGE_LANDLOCK", "working directory outside the sandbox": "STAGE_CWD"}
    assert {defines[stages[v]]: v for v in S._STAGES.values()} == S._STAGES
    assert {defines[f"BYE_{v.split('_')[0].upper()}"]: v for v in S._BYE_REASONS.values()} == S._BYE_REASONS
    max_msg = re.search(r"^#define MAX_MSG \((\d+) \* 1024\)", SOURCE.read_text(), re.M)
    assert max_msg and S._MAX_INLINE < int(max_msg.group(1)) * 1024
