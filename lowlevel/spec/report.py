"""Lossless JSON for reports: bytes and names that are not valid UTF-8.

Every JSON report lowlevel writes (``lowlevel run --json``, :meth:`lowlevel.Result.to_json`,
run records, ``lowlevel replay --json``, the MCP tools' results) follows two rules, documented
in ``docs/records.md`` ("Bytes and names in JSON") and ``docs/record-schema.json``:

Output streams (``stdout``, ``stderr``):
    ``"stdout"`` is always a string: the bytes themselves when they are valid UTF-8, else the
    bytes decoded with U+FFFD for each invalid byte (for display only). ``"stdout_b64"`` is
    ``null`` when the string is exact, else the base64 (RFC 4648) of the exact bytes.

Names and other strings (file names, symlink targets, change lists, command arguments, paths):
    a JSON string when the value is valid Unicode (what Linux names almost always are); else,
    for a name holding bytes that are not UTF-8 (Python spells them with ``surrogateescape``
    code points U+DC80..U+DCFF, as :func:`os.listdir` returns them), an object
    ``{"b64": <base64 of the exact bytes>, "text": <display form with U+FFFD>}``.
    :func:`name_from_json` turns either form back into the Python ``str`` the OS functions take.

So the JSON is always valid UTF-8 with no lone surrogate escapes (strict parsers such as
Rust's serde or Go's encoding/json never see one), and nothing is lost.

Source: RFC 8259 section 8.2 (strings with unpaired surrogates are not interoperable);
PEP 383 (surrogateescape); RFC 4648 (base64).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any


#: Prefix of the note :func:`lowlevel.record.record_run` adds to ``Result.notes`` when the record
#: could not be written after the run (the CLI prints that note as its one line).
RECORD_NOT_WRITTEN = "record not written: "
#: Prefix of a note in ``Result.notes`` that the caller must see (the CLI prints each on stderr).
WARNING_PREFIX = "warning: "


def _raw(text: str) -> bytes:
    """The bytes a str stands for: os.fsencode (surrogateescape), or, for a lone surrogate that
    no OS call returns, its UTF-8 form with ``surrogatepass``."""
    try:
        return os.fsencode(text)
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def is_exact(text: str) -> bool:
    """True when ``text`` is valid Unicode (encodes to UTF-8 with no surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def name_to_json(name: str) -> str | dict[str, str]:
    """A name (or any str) for a JSON report: itself when valid Unicode, else
    ``{"b64": ..., "text": ...}`` (see the module docstring)."""
    if is_exact(name):
        return name
    raw = _raw(name)
    return {"b64": base64.b64encode(raw).decode("ascii"), "text": raw.decode("utf-8", "replace")}


def name_from_json(value: Any) -> str:
    """The inverse of :func:`name_to_json`: the ``str`` to hand to OS functions.

    Raises:
        ValueError: neither a string nor a ``{"b64", "text"}`` object with valid base64.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("b64"), str):
        try:
            raw = base64.b64decode(value["b64"], validate=True)
        except ValueError as err:
            raise ValueError(f"bad base64 in name object: {err}") from None
        return os.fsdecode(raw)
    raise ValueError(f"expected a string or a {{\"b64\", \"text\"}} object, got {value!r:.80}")


def display(name: str) -> str:
    """A printable form of ``name`` for messages: invalid bytes as U+FFFD."""
    return name if is_exact(name) else _raw(name).decode("utf-8", "replace")


def bytes_fields(data: bytes) -> tuple[str, str | None]:
    """``(text, b64)`` for an output stream: the text, and the base64 of the bytes when the text
    is not exact (``None`` when it is)."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace"), base64.b64encode(data).decode("ascii")


def json_safe(value: Any) -> Any:
    """A copy of ``value`` (dicts, lists, tuples, scalars) where every str that is not valid
    Unicode became a name object (:func:`name_to_json`) and bytes became one too. Mapping keys
    that are not valid Unicode are replaced by their display form (keys are field or variable
    names, which lowlevel validates; this is a last line)."""
    if isinstance(value, str):
        return name_to_json(value)
    if isinstance(value, bytes):
        return name_to_json(os.fsdecode(value))
    if isinstance(value, Mapping):
        return {(k if not isinstance(k, str) or is_exact(k) else display(k)): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


__all__ = ["RECORD_NOT_WRITTEN", "WARNING_PREFIX", "bytes_fields", "display", "is_exact", "json_safe",
           "name_from_json", "name_to_json"]
