"""lowlevel._dataclass under threads: a class made while another thread imports :mod:`typing`
waits for that import (a fresh interpreter each: the suite's has :mod:`typing` already)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


#: A fresh interpreter where ``import typing`` stops half-way in a thread (the module is in
#: sys.modules, its ``__spec__._initializing`` set, no ``ClassVar`` yet) while the main thread
#: makes a dataclass: it must wait for the import, not read the half-made module.
HALF_TYPING = r"""
import importlib.machinery, importlib.util, sys, threading
assert "typing" not in sys.modules
started, go = threading.Event(), threading.Event()

class Slow(importlib.machinery.SourceFileLoader):
    def exec_module(self, module):
        started.set()
        go.wait(10)
        super().exec_module(module)

class Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "typing":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = Slow(spec.loader.name, spec.loader.path)
        return spec

sys.meta_path.insert(0, Finder)
from lowlevel._dataclass import cached_dataclass
threading.Thread(target=lambda: __import__("typing"), daemon=True).start()
assert started.wait(10)
threading.Timer(0.3, go.set).start()

@cached_dataclass(frozen=True)
class Made:
    "A class made while another thread imports typing."
    name: str
    size: int = 0

print(Made("x").size, hasattr(sys.modules["typing"], "ClassVar"))
"""


def test_a_class_made_while_another_thread_imports_typing_waits_for_it(tmp_path: Path) -> None:
    """CPython 3.11's dataclasses reads ``sys.modules["typing"].ClassVar`` without importing: a
    class made while another thread was half-way through ``import typing`` failed with
    AttributeError (threads starting their first ``lowlevel.run`` together, 1 process in 30).
    Control: the stdlib decorator in the same spot fails."""
    env = {**os.environ, "LOWLEVEL_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    ours = subprocess.run([sys.executable, "-c", HALF_TYPING], capture_output=True, text=True, env=env, timeout=60)
    assert ours.returncode == 0 and ours.stdout.split() == ["0", "True"], ours.stderr
    stdlib = HALF_TYPING.replace("from lowlevel._dataclass import cached_dataclass",
                                 "from dataclasses import dataclass as cached_dataclass")
    control = subprocess.run([sys.executable, "-c", stdlib], capture_output=True, text=True, env=env, timeout=60)
    assert control.returncode != 0 and "has no attribute 'ClassVar'" in control.stderr, control.stderr
