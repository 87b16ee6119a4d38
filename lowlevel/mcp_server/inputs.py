"""A client's tool arguments of ``lowlevel mcp``, decoded and checked at the edge: text encodings,
a ``cwd``, file content (utf-8 or base64), and output capped without cutting a UTF-8 sequence.

Every function raises :class:`lowlevel.errors.PolicyError` with one line naming the argument.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

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


_KINDS = {"number": "a number", "integer": "an integer", "string": "a string", "boolean": "true or false",
          "array": "a list", "object": "an object", "null": "null"}


def json_kind(value: object) -> str:
    """The JSON name of a decoded value's type, with its article ("a list", "null")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}.get(
        type(value), "a value")


def _expected(schema: Mapping[str, Any]) -> str:
    """What a JSON schema of one argument takes, in words: ``a list of strings``, ``a number,
    a string or null``."""
    options = schema.get("anyOf") or [schema]
    words = []
    for option in options:
        kind = _KINDS.get(option.get("type", ""), "a value")
        item = option.get("items") or option.get("additionalProperties")
        if isinstance(item, dict) and item.get("type") in _KINDS:
            kind += f" of {_KINDS[item['type']].split(' ', 1)[-1]}s" if kind == "a list" else \
                f" of {_KINDS[item['type']].split(' ', 1)[-1]} values"
        words.append(kind)
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def argument_errors(err: BaseException, arguments: Mapping[str, Any] | None, schema: Mapping[str, Any]) -> str:
    """One line for a pydantic ``ValidationError`` of a tool's arguments, in the terms of the
    tool's published input schema (``tools/list``), e.g. ``'timeout_s' must be a number, a string
    or null, not a list; 'env'['A'] must be a string, not an integer``: the SDK's own text was
    several lines per argument, with pydantic's internal union tags and a URL per error. The
    client's values are never echoed (only their types). At most 4 arguments are named."""
    properties = schema.get("properties", {})
    given = dict(arguments or {})
    parts: dict[str, str] = {}
    errors = err.errors(include_url=False, include_input=False) if hasattr(err, "errors") else []
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if not loc or not isinstance(loc[0], str) or loc[0] in parts:
            continue
        name = loc[0]
        if error.get("type") == "missing":
            parts[name] = f"{name!r} is required ({_expected(properties.get(name, {}))})"
            continue
        value: Any = given.get(name)
        members = [o for o in properties.get(name, {}).get("anyOf", ()) if o.get("type") != "null"]
        inner = loc[2:] if len(members) > 1 else loc[1:]  # past a union's member tag ("float", "str")
        for key in inner:
            value = value[key] if isinstance(value, (list, dict)) and (isinstance(key, int) or key in value) else None
        where = repr(name) + "".join(f"[{key!r}]" for key in inner)
        if inner:
            text = str(error.get("msg", "is not valid")).replace("Input should be a valid", "must be a")
            text = text.replace("Input should be", "must be")
            parts[name] = f"{where} {text}, not {json_kind(value)}" if text.startswith("must be ") else \
                f"{where}: {text}"
        else:
            parts[name] = f"{name!r} must be {_expected(properties.get(name, {}))}, not {json_kind(value)}"
    if not parts:
        return "the arguments do not match the tool's input schema (tools/list)"
    names = list(parts)
    more = f" (and {len(names) - 4} more)" if len(names) > 4 else ""
    return "; ".join(parts[n] for n in names[:4]) + more


__all__ = ["argument_errors", "check_encoding", "decode_content", "sandbox_cwd", "json_kind", "utf8_arg", "whole_utf8"]
