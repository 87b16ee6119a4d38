"""Reading a record as untrusted input: :func:`load_record` (bounded, strict JSON) and
:func:`validate_record` (every field a replay uses, checked and decoded, one line naming the
first bad field). One concept: the hostile record's check.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from lowlevel._dataclass import dataclass
from lowlevel.workspace import files as _ws_files
from lowlevel import workspace as _ws
from lowlevel.errors import PolicyError, WorkspaceError
from lowlevel.record.schema import MAX_RECORD_BYTES, MAX_REPLAY_ENTRIES, SCHEMA_ID, TOP_LEVEL_KEYS, RecordError
from lowlevel.sandbox.result import KILLED_BY
from lowlevel.spec import validate as _validate
from lowlevel.spec.report import name_from_json


def load_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a record (at most :data:`MAX_RECORD_BYTES`) and check its ``schema``.

    The rest is checked by :func:`validate_record`.

    Raises:
        RecordError: unreadable, a device, too large, not JSON (or nested too deep), or not a
            ``lowlevel-run-record/1`` document.
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
                raise RecordError(f"cannot read record {name!r}: not a regular file")
            os.set_blocking(f.fileno(), True)
            data = f.read(MAX_RECORD_BYTES + 1)
    except OSError as err:
        raise RecordError(f"cannot read record {name!r}: {err.strerror or err}") from err
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"cannot read record {name!r}: larger than {MAX_RECORD_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as err:
        what = "nested too deep" if isinstance(err, RecursionError) else str(err)
        raise RecordError(f"cannot read record {name!r}: not valid JSON ({what})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_ID:
        raise RecordError(f"{name!r} is not a {SCHEMA_ID} record")
    unknown = sorted(set(doc) - TOP_LEVEL_KEYS)
    if unknown:
        raise RecordError(f"refusing the record {name!r}: unknown field {', '.join(map(repr, unknown[:5]))} "
                          f"(docs/record-schema.json allows no other; a record this version did not write)")
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object of the record, refusing a key given twice: readers disagree on which one counts
    (Python's json keeps the last, others the first), so a record could show a reviewer one
    command and replay another (RFC 8259 section 4: names SHOULD be unique)."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {twice[:80]!r} appears twice in one object")
    return doc


_DIGEST = re.compile(r"[0-9a-f]{64}")
_KINDS = ("file", "dir", "symlink", "other")


def _bad(where: str, what: str) -> RecordError:
    return RecordError(f"refusing the record: {where} {what}")


def _get(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, Mapping):
        raise _bad(where or "the record", "is not an object")
    if key not in obj:
        raise _bad(f"{where}.{key}" if where else key, "is missing")
    return obj[key]


def _int(value: Any, where: str, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise _bad(where, f"must be an integer in [{lo}, {hi if hi is not None else 'inf'}], got {value!r:.60}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(where, f"must be true or false, got {value!r:.60}")
    return value


def _digest(value: Any, where: str, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        raise _bad(where, f"must be a SHA-256 in lowercase hex, got {value!r:.80}")
    return value


def _name(value: Any, where: str) -> str:
    try:
        return name_from_json(value)
    except ValueError as err:
        raise _bad(where, str(err)) from None


def _checked(fn: Any, where: str, *args: Any, **kwargs: Any) -> Any:
    """Call a :mod:`lowlevel.spec.validate` check, turning its PolicyError into RecordError."""
    try:
        return fn(*args, **kwargs)
    except PolicyError as err:
        raise _bad(where, f"is refused: {err}") from None


@dataclass
class ParsedRecord:
    """The fields :func:`replay` uses, checked and decoded (names as Python strs).

    Attributes:
        command, cwd, env, timeout_s: the run's arguments.
        stdin_sha256: the stdin blob's digest, or None.
        policy: the canonical policy object (rebuilt by :func:`policy_from_canonical`).
        policy_sha256: its recorded hash.
        store: the input store's name next to the record, or None.
        before: the workspace before the run: dicts with decoded ``path`` and ``link``.
        before_complete: the listing is complete.
    """

    command: list[str]
    cwd: str
    env: dict[str, str]
    timeout_s: float | None
    stdin_sha256: str | None
    policy: Mapping[str, Any]
    policy_sha256: str
    store: str | None
    before: list[dict[str, Any]]
    before_complete: bool


def _entries(value: Any, where: str, limit: int) -> list[dict[str, Any]]:
    """Check a workspace listing (``before`` or ``after``): paths relative without ``..`` and
    at most MAX_DEPTH + 1 levels, kinds, modes 0..0o7777, sizes, digests, symlink texts."""
    if not isinstance(value, list):
        raise _bad(where, "is not a list")
    if len(value) > limit:
        raise _bad(where, f"has {len(value)} entries; the limit is {limit}")
    out = []
    for i, e in enumerate(value):
        at = f"{where}[{i}]"
        path = _name(_get(e, "path", at), f"{at}.path")
        try:
            _ws_files._split_rel(path)
        except WorkspaceError as err:
            raise _bad(f"{at}.path", f"is refused: {err}") from None
        kind = _get(e, "kind", at)
        if kind not in _KINDS:
            raise _bad(f"{at}.kind", f"must be one of {_KINDS}, got {kind!r:.40}")
        mode = _int(_get(e, "mode", at), f"{at}.mode", 0, 0o7777)
        size = _int(_get(e, "size", at), f"{at}.size")
        digest = _digest(_get(e, "sha256", at), f"{at}.sha256", nullable=True)
        link_raw = _get(e, "link", at)
        link = None
        if link_raw is not None:
            link = _name(link_raw, f"{at}.link")
            _checked(_validate.text, f"{at}.link", link, "symlink target", max_bytes=_validate.MAX_PATH_BYTES - 1,
                     empty=False)
        stored = _bool(_get(e, "stored", at), f"{at}.stored")
        skipped = _get(e, "skipped", at)
        if skipped is not None and not isinstance(skipped, str):
            raise _bad(f"{at}.skipped", "must be a string or null")
        out.append({"path": path, "kind": kind, "mode": mode, "size": size, "sha256": digest, "link": link,
                    "stored": stored, "skipped": skipped})
    return out


def validate_record(doc: Any) -> ParsedRecord:
    """Check every field a replay and :func:`compare` use against ``docs/record-schema.json``
    (types, ranges, NUL bytes, lengths, paths) before anything is created, and decode names.

    A record is untrusted input: a field it cannot hold is refused here with one line naming
    the field, never a traceback later. Strings bound for bwrap's argv or the workspace (the
    command, cwd, env, symlink targets, paths) get the same checks as the API's
    (:mod:`lowlevel.spec.validate`), so a NUL never gets further.

    Raises:
        RecordError: the first bad field.
    """
    if not isinstance(doc, Mapping) or doc.get("schema") != SCHEMA_ID:
        raise RecordError(f"not a {SCHEMA_ID} record")
    cmd_raw = _get(doc, "command", "")
    if not isinstance(cmd_raw, list):
        raise _bad("command", "is not a list")
    if len(cmd_raw) > _validate.MAX_ARGS:
        raise _bad("command", f"has {len(cmd_raw)} arguments; the limit is {_validate.MAX_ARGS}")
    command = _checked(_validate.command, "command", [_name(a, f"command[{i}]") for i, a in enumerate(cmd_raw)])
    cwd = _checked(_validate.sandbox_cwd, "cwd", _name(_get(doc, "cwd", ""), "cwd"), "cwd")
    env_raw = _get(doc, "env", "")
    env: dict[str, str] = {}
    if env_raw is not None:
        if not isinstance(env_raw, Mapping):
            raise _bad("env", "is not an object")
        if len(env_raw) > _validate.MAX_ENV:
            raise _bad("env", f"has {len(env_raw)} variables; the limit is {_validate.MAX_ENV}")
        for key, value in env_raw.items():
            _checked(_validate.env_name, "env", key)
            env[key] = _checked(_validate.text, f"env[{key!r}]", _name(value, f"env[{key!r}]"), f"env[{key!r}]")
    stdin_raw = _get(doc, "stdin", "")
    stdin_sha = None
    if stdin_raw is not None:
        stdin_sha = _digest(_get(stdin_raw, "sha256", "stdin"), "stdin.sha256")
        _int(_get(stdin_raw, "bytes", "stdin"), "stdin.bytes")
    timeout_s = _get(doc, "timeout_s", "")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool)
                                  or not 0 < timeout_s < 2**31):
        raise _bad("timeout_s", f"must be a number of seconds in (0, 2**31) or null, got {timeout_s!r:.40}")
    policy = _get(doc, "policy", "")
    if not isinstance(policy, Mapping):
        raise _bad("policy", "is not an object")
    digest = _digest(_get(doc, "policy_sha256", ""), "policy_sha256")
    assert digest is not None
    inputs = _get(doc, "inputs", "")
    store = _get(inputs, "store", "inputs")
    if store is not None and (not isinstance(store, str) or not store or "/" in store or store in (".", "..")
                              or "\0" in store or len(store) > 255):
        raise _bad("inputs.store", f"must be a name next to the record, got {store!r:.80}")
    ws = _get(doc, "workspace", "")
    before = _entries(_get(ws, "before", "workspace"), "workspace.before", MAX_REPLAY_ENTRIES)
    before_complete = _bool(_get(ws, "before_complete", "workspace"), "workspace.before_complete")
    _entries(_get(ws, "after", "workspace"), "workspace.after", _ws.MAX_SNAPSHOT_ENTRIES)
    _bool(_get(ws, "after_complete", "workspace"), "workspace.after_complete")
    ex = _get(doc, "exit", "")
    _int(_get(ex, "exit_code", "exit"), "exit.exit_code", 0, 255)
    killed_by = _get(ex, "killed_by", "exit")
    if killed_by is not None and killed_by not in KILLED_BY:
        raise _bad("exit.killed_by", f"must be null or one of {KILLED_BY}, got {killed_by!r:.40}")
    _bool(_get(ex, "timed_out", "exit"), "exit.timed_out")
    out = _get(doc, "output", "")
    _bool(_get(out, "captured", "output"), "output.captured")
    for stream in ("stdout", "stderr"):
        doc_s = _get(out, stream, "output")
        _digest(_get(doc_s, "sha256", f"output.{stream}"), f"output.{stream}.sha256")
        _int(_get(doc_s, "bytes", f"output.{stream}"), f"output.{stream}.bytes")
    return ParsedRecord(command=command, cwd=cwd, env=env, timeout_s=timeout_s, stdin_sha256=stdin_sha,
                        policy=policy, policy_sha256=digest, store=store, before=before,
                        before_complete=before_complete)


__all__ = ["ParsedRecord", "load_record", "validate_record"]
