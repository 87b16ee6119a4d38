"""The session protocol's two halves (native/lowlevel_init.c, lowlevel/session/protocol.py) agree
(pure: the C source's text; the struct sizes, which need the compiler, are
tests/integration/test_protocol_layouts.py)."""

from __future__ import annotations

import re
from pathlib import Path


from lowlevel.session import protocol as S

SOURCE = Path(__file__).resolve().parents[2] / "native" / "lowlevel_init.c"

# C #define -> the Python constant that mirrors it.
MIRRORED = {
    "PROTO_VERSION": S.PROTO_VERSION, "MSG_SPAWN": S.MSG_SPAWN, "MSG_SIGNAL": S.MSG_SIGNAL,
    "MSG_HELLO": S.MSG_HELLO, "MSG_STARTED": S.MSG_STARTED, "MSG_EXIT": S.MSG_EXIT, "MSG_BYE": S.MSG_BYE,
    "SPAWN_STDIN_PIPE": S.SPAWN_STDIN_PIPE, "SPAWN_BODY_MEMFD": S.SPAWN_BODY_MEMFD,
    "SPAWN_STARTED": S.SPAWN_STARTED,
    "SIGNAL_TREE": S.SIGNAL_TREE, "EXIT_WAIT_STATUS": S.EXIT_WAIT_STATUS,
    "EXIT_SETUP_FAILED": S.EXIT_SETUP_FAILED, "EXIT_SPAWN_FAILED": S.EXIT_SPAWN_FAILED,
    "EXIT_SHEPHERD_DIED": S.EXIT_SHEPHERD_DIED, "EXITF_TIMED_OUT": S.EXITF_TIMED_OUT,
    "EXITF_CANCELLED": S.EXITF_CANCELLED, "STAGE_CWD": S.STAGE_CWD,
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
    assert {defines[stages[v]]: v for v in S.STAGES.values()} == S.STAGES
    assert {defines[f"BYE_{v.split('_')[0].upper()}"]: v for v in S.BYE_REASONS.values()} == S.BYE_REASONS
    max_msg = re.search(r"^#define MAX_MSG \((\d+) \* 1024\)", SOURCE.read_text(), re.M)
    assert max_msg and S.MAX_INLINE < int(max_msg.group(1)) * 1024
