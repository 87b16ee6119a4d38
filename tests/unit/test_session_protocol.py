"""The session protocol's two halves (native/lowlevel_init.c, lowlevel/session/__init__.py) agree."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

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


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc to compile the struct-size probe")
def test_struct_layouts_match(tmp_path):
    probe = tmp_path / "probe.c"
    src = SOURCE.read_text().replace("int main(int argc, char **argv)", "int real_main(int argc, char **argv)")
    src += ("\nint main(void) { printf(\"%zu %zu %zu %zu %zu\\n\", sizeof(struct spawn_hdr), "
            "sizeof(struct rlim_rec), sizeof(struct signal_msg), sizeof(struct exit_msg), "
            "sizeof(struct hello_msg)); return 0; }\n")
    probe.write_text(src)
    exe = tmp_path / "probe"
    subprocess.run(["gcc", "-w", "-I", str(SOURCE.parent), "-o", str(exe), str(probe)], check=True)
    sizes = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert sizes == [S._SPAWN_HDR.size, S._RLIM.size, S._SIGNAL.size, S._EXIT.size, S._SMALL.size]
