"""One syntax for sizes and durations, wherever lowlevel reads them from people.

The CLI (``--memory 512M``, ``--timeout 2m``), the MCP server's TOML config
(``memory_bytes = "128M"``) and the Inspect/integrations config accept the same spellings:

* a size is a whole number of bytes, or a number with a K, M, G or T suffix (powers of 1024;
  ``KiB``/``MB``/``mb`` spellings alike): ``"512"``, ``"64K"``, ``"1.5M"``, ``"2G"``;
* a duration is a number of seconds, or a number with an ``s``, ``m``, ``h`` or ``d`` suffix,
  as GNU ``timeout(1)`` reads DURATION (plus ``ms``): ``"10"``, ``"10s"``, ``"2m"``, ``"0.5h"``,
  ``"250ms"``.

Source: coreutils ``timeout`` manual ("DURATION is a floating point number with an optional
suffix: s for seconds (the default), m for minutes, h for hours or d for days").
"""

from __future__ import annotations

import math
import re

from lowlevel.errors import PolicyError

# Patterns, compiled on first use by re's own cache (not at import: a run that parses no size or
# duration string does not pay for them).
_SIZE = r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$"
_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_DURATION = r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(ms|s|m|h|d)?\s*$"
_DURATION_UNITS = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0, "d": 86400.0}


def size_bytes(value: object, name: str) -> int:
    """A byte count from an int or a size string (see the module docstring).

    Args:
        value: ``int`` (returned as is) or ``str`` such as ``"128M"``.
        name: what the message calls the value (``"--memory"``, ``"[limits] memory_bytes"``).

    Raises:
        PolicyError: not a size; the message names ``name`` and shows the syntax.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.match(_SIZE, value)
        if m:
            number, unit = m.group(1), m.group(2).lower()
            if not unit and "." in number:
                raise PolicyError(f"{name}: invalid size {value!r}: a byte count is a whole number "
                                  "(or use a suffix: 1.5M)")
            return int(float(number) * _SIZE_UNITS[unit])
    raise PolicyError(f"{name}: invalid size {value!r}: use a number of bytes with an optional K, M or G "
                      "suffix, e.g. 256M")


def duration_seconds(value: object, name: str) -> float:
    """Seconds from a number or a duration string (``"10s"``, ``"2m"``, ``"1.5h"``, ``"250ms"``).

    Raises:
        PolicyError: not a duration, or not finite; the message names ``name``.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := re.match(_DURATION, value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise PolicyError(f"{name}: invalid duration {value!r}: use seconds with an optional s, m, h or d "
                          "suffix, e.g. 30, 10s, 2m")
    if not math.isfinite(seconds):
        raise PolicyError(f"{name}: invalid duration {value!r}: not a finite number")
    return seconds


__all__ = ["duration_seconds", "size_bytes"]
