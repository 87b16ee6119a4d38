"""Where lowlevel's own files are: the package directory and the native executables in it.

The static executables (``native/*.c``, built by ``setup.py``; the CFFI extension is ``lowlevel/host/_native*.so``)
live at the top of the package whichever subpackage uses them; every module finds them here.
"""
from __future__ import annotations

import os

#: The ``lowlevel`` package directory (absolute).
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def native(name: str) -> str:
    """Absolute path of the file ``name`` at the top of the package (``_lowlevel_guard``...)."""
    return os.path.join(PACKAGE_DIR, name)
