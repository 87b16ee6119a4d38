"""The per-test host-facts cache (lowlevel.host.hostcache) of the hostcache tests, unit and
integration: import ``cache`` into a test module to use the fixture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lowlevel.host import hostcache


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "cache"
    monkeypatch.setenv("LOWLEVEL_CACHE_DIR", str(d))
    monkeypatch.delenv("LOWLEVEL_NO_CACHE", raising=False)
    hostcache.clear_memory()
    yield d
    hostcache.clear_memory()


def fresh_process() -> None:
    """What a new process starts with: nothing in memory, the files on disk."""
    hostcache.clear_memory()
