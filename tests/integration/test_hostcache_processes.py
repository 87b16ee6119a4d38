"""lowlevel.host.hostcache and probe with the processes they are about (moved from
tests/unit/test_hostcache.py: tests/unit starts no process): a fresh interpreter importing
lowlevel, and the bwrap facts probed from a stand-in ``bwrap`` script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lowlevel.host import probe

from helpers import caches

cache = caches.cache  # the fixture (tests/helpers/caches.py)
_fresh_process = caches.fresh_process


def test_importing_lowlevel_does_not_load_libseccomp() -> None:
    code = "import sys, lowlevel, lowlevel.cli; print('lowlevel.host._native' in sys.modules, 'cffi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def _fake_bwrap(path: Path, version: str) -> None:
    path.write_text(f"#!/bin/sh\ncase \"$1\" in --version) echo 'bubblewrap {version}';; "
                    "*) echo 'usage: bwrap'; echo '    --unshare-all            Unshare every namespace';; esac\n")
    path.chmod(0o755)


def test_bwrap_facts_follow_the_executable(cache: Path, tmp_path: Path) -> None:
    fake = tmp_path / "bwrap"
    _fake_bwrap(fake, "0.8.0")
    probe.bwrap_info.cache_clear()
    info = probe.bwrap_info(str(fake))
    assert info.version == (0, 8, 0) and info.options == frozenset({"--unshare-all"})
    _fresh_process()
    probe.bwrap_info.cache_clear()
    assert probe.bwrap_info(str(fake)) == info  # from the cache
    _fake_bwrap(fake, "0.11.0")  # upgraded: another mtime and size
    os.utime(fake, ns=(1, 1))
    _fresh_process()
    probe.bwrap_info.cache_clear()
    assert probe.bwrap_info(str(fake)).version == (0, 11, 0)
    probe.bwrap_info.cache_clear()
