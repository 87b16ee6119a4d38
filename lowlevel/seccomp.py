"""STUB: replaced by the seccomp work (issue 3). Interface contract only.

compile_bpf(profile) -> bytes   (cached per profile)
bpf_memfd(bpf) -> int           (sealed memfd at offset 0, O_CLOEXEC; caller closes)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeccompProfile:
    name: str = "default"


DEFAULT_PROFILE = SeccompProfile()


def compile_bpf(profile: SeccompProfile) -> bytes:
    return b""


def bpf_memfd(bpf: bytes) -> int:
    raise NotImplementedError
