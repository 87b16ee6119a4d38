"""How the native helpers were linked, as setup.py promises: every one static, the guard
freestanding on x86_64/aarch64, and the anchor and the relay against musl where ``musl-gcc`` is
installed (glibc's static start-up costs ~0.45 ms of CPU per exec on a VM, most of it ``cpuid``:
bench/exec_cost.py). A build that fell back silently would keep working and lose that: these
checks read the installed binaries.
"""

from __future__ import annotations

import os
import platform
import shutil
import struct
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lowlevel"
HELPERS = ("_lowlevel_exec", "_lowlevel_guard", "_lowlevel_init", "_lowlevel_relay")
PT_INTERP = 3


def _segments(path: Path) -> list[int]:
    """The p_type of every program header of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:6] == b"\x7fELF\x02\x01", f"{path} is not a 64-bit little-endian ELF file"
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]


def _has_glibc(path: Path) -> bool:
    """glibc's start-up and abort messages ("Fatal glibc error: ...") are in every binary it links."""
    return b"glibc" in path.read_bytes()


@pytest.mark.parametrize("name", HELPERS)
def test_every_helper_is_static(name: str) -> None:
    path = PACKAGE / name
    assert path.is_file(), f"{path} is missing: build it (pip install -e . or setup.py build_ext --inplace)"
    assert PT_INTERP not in _segments(path), f"{name} is dynamically linked (it has an ELF interpreter)"


def test_the_controls_tell_glibc_from_musl(tmp_path: Path) -> None:
    """The checks below can fail: a glibc static binary has the marker and no interpreter, a
    dynamic one has an interpreter."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "t.c"
    src.write_text("int main(void) { return 0; }\n")
    assert os.system(f"{cc} -O2 -static -o {tmp_path}/s {src} && {cc} -O2 -o {tmp_path}/d {src}") == 0
    assert _has_glibc(tmp_path / "s") and PT_INTERP not in _segments(tmp_path / "s")
    assert PT_INTERP in _segments(tmp_path / "d")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="freestanding only on x86_64/aarch64")
def test_the_guard_is_freestanding() -> None:
    assert not _has_glibc(PACKAGE / "_lowlevel_guard")


@pytest.mark.parametrize("name", ("_lowlevel_exec", "_lowlevel_relay"))
def test_anchor_and_relay_are_musl_where_musl_gcc_is_installed(name: str) -> None:
    if shutil.which("musl-gcc") is None or os.environ.get("LOWLEVEL_NO_MUSL"):
        pytest.skip("musl-gcc is not installed (or LOWLEVEL_NO_MUSL is set): built with glibc")
    assert not _has_glibc(PACKAGE / name), f"{name} was linked against glibc although musl-gcc is installed"
