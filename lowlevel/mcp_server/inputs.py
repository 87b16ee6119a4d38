"""A client's tool arguments of ``lowlevel mcp``, decoded and checked at the edge: text encodings,
a ``cwd``, file content (utf-8 or base64), and output capped without cutting a UTF-8 sequence.

Every function raises :class:`lowlevel.errors.PolicyError` with one line naming the argument.
"""

from __future__ import annotations

import base64

from lowlevel.errors import PolicyError
from lowlevel.spec import validate as _validate
from lowlevel.spec.policy import WORKSPACE_DEST


def whole_utf8(data: bytes) -> bytes:
    """``data`` without a UTF-8 sequence cut at its end (by a byte cap), so capped text stays text."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data
        if byte >= 0xC0:  # a lead byte: keep it only if its sequence is complete
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= need else data[:-back]
    return data


def check_encoding(encoding: str) -> str:
    if encoding not in ("utf-8", "base64"):
        raise PolicyError(f"encoding must be 'utf-8' or 'base64', got {encoding!r:.40}")
    return encoding


def utf8_arg(value: str | None, what: str) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise PolicyError(f"{what} must be a string, got {type(value).__name__}")
    try:
        return value.encode()
    except UnicodeEncodeError as err:
        raise PolicyError(f"{what} is not valid Unicode ({err.reason} at index {err.start}): "
                          "send bytes with write_file(encoding='base64') instead") from None


def sandbox_cwd(cwd: str | None) -> str:
    """A request's ``cwd``: absolute inside the sandbox, or relative to ``/workspace``."""
    if cwd is None:
        return WORKSPACE_DEST
    if not isinstance(cwd, str) or not cwd:
        raise PolicyError(f"cwd {cwd!r}: give a directory inside the sandbox (absolute, or relative to "
                          "/workspace), without '..'")
    return _validate.sandbox_cwd(cwd if cwd.startswith("/") else f"{WORKSPACE_DEST}/{cwd}", "cwd")


def decode_content(content: str, encoding: str) -> bytes:
    if not isinstance(content, str):
        raise PolicyError(f"content must be a string, got {type(content).__name__}")
    if encoding == "utf-8":
        data = utf8_arg(content, "content")
        assert data is not None
        return data
    if encoding == "base64":
        try:
            return base64.b64decode(content, validate=True)
        except ValueError as err:
            raise PolicyError(f"content is not valid base64: {err}") from err
    raise PolicyError(f"encoding must be 'utf-8' or 'base64', got {encoding!r}")


__all__ = ["check_encoding", "decode_content", "sandbox_cwd", "utf8_arg", "whole_utf8"]
