"""The protocols' record layouts as the C compiler lays them out, against the Python structs
(moved from tests/unit/test_session_protocol.py: compiling and running the probe are processes).
The fd numbers and message codes are checked in tests/unit (test_session_protocol.py,
test_protocols.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from lowlevel.session import protocol as S

SOURCE = Path(__file__).resolve().parents[2] / "native" / "lowlevel_init.c"


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
    assert sizes == [S.SPAWN_HDR.size, S.RLIM.size, S.SIGNAL.size, S.EXIT.size, S.SMALL.size]
