"""STUB: replaced by the limits work (issue 4). Interface contract only."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    tmp_size_bytes: int | None = 256 * 1024 * 1024
