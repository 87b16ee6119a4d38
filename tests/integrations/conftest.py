"""Fixtures for the framework adapters (the probes themselves are in ``attack_probes.py``)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from attack_probes import PlantedSecret


@pytest.fixture
def planted_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PlantedSecret:
    """A fake SSH key in a temporary HOME; ``$HOME`` points there for the test."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    secret = "SECRET-" + secrets.token_hex(12)
    key = home / ".ssh" / "id_ed25519"
    key.write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{secret}\n-----END OPENSSH PRIVATE KEY-----\n")
    key.chmod(0o600)
    monkeypatch.setenv("HOME", str(home))
    return PlantedSecret(home, key, secret)
