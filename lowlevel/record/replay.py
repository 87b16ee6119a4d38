"""Replaying a record: rebuild its workspace from the input store, rerun it under the recorded
Policy (refused when looser than the default unless trusted), and compare the outcomes. One
concept: replay.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from lowlevel import workspace as _ws
from lowlevel._dataclass import dataclass
from lowlevel.errors import LowlevelError, WorkspaceError
from lowlevel.record.canonical import policy_from_canonical, policy_sha256
from lowlevel.record.hashing import MAX_HASH_BYTES
from lowlevel.record.loosening import argv_loosening, policy_loosening
from lowlevel.record.schema import MAX_REPLAY_BYTES, MAX_REPLAY_ENTRIES, RecordError
from lowlevel.record.validation import ParsedRecord, load_record, validate_record
from lowlevel.record.writing import execute_recorded
from lowlevel.rootfs.resolve import resolve
from lowlevel.rootfs.store import StoreReader, check_record_rootfs
from lowlevel.sandbox.result import Result
from lowlevel.spec.policy import Policy
from lowlevel.spec.report import display, name_from_json


@dataclass
class ReplayReport:
    """What :func:`replay` found.

    Attributes:
        matched: True when exit status, ``killed_by``, stdout, stderr and every workspace
            entry after the run (path, kind, mode, SHA-256, symlink text) are the same.
        differences: one line per difference, empty when matched.
        result: the replayed run's Result.
        record: the replayed run's own record (same shape as the original).
    """

    matched: bool
    differences: list[str] = field(default_factory=list)
    result: Result | None = None
    record: dict[str, Any] = field(default_factory=dict)


def _restore_inputs(rec: ParsedRecord, store: str, root: str, *, max_bytes: int = MAX_REPLAY_BYTES,
                    max_entries: int = MAX_REPLAY_ENTRIES) -> bytes | None:
    """Recreate the workspace as it was before the recorded run; return stdin (or None).

    The record is untrusted: every path was checked (:func:`validate_record`: relative, no
    ``..``), the total the replay would write (every copy of a blob counts) and the number of
    entries are bounded before anything is made (:data:`MAX_REPLAY_BYTES`,
    :data:`MAX_REPLAY_ENTRIES`: a record naming one 1 MiB blob 300 times would write 300 MiB),
    and everything is made relative to directory fds without following a symlink
    (:func:`lowlevel.workspace.make_dir`, ``make_symlink``, ``write_file``, ``set_mode``), so
    nothing outside ``root`` is created or changed. Setuid/setgid bits are never recreated.
    """
    if not rec.before_complete:
        raise RecordError("the record's workspace listing is incomplete (too many entries): cannot replay")
    entries = rec.before
    if len(entries) > max_entries:
        raise RecordError(f"refusing to replay: the record lists {len(entries)} workspace entries; the limit is "
                          f"{max_entries}")

    def open_blob(digest: str, what: str) -> Any:
        try:
            fd = os.open(os.path.join(store, digest), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:
            raise RecordError(f"input {what} (sha256 {digest}) is missing from the store {store}: "
                              f"{err.strerror}") from err
        f = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            f.close()
            raise RecordError(f"input {what} in the store {store} is not a regular file")
        return f

    def blob(digest: str, what: str) -> bytes:
        with open_blob(digest, what) as f:
            data: bytes = f.read(MAX_HASH_BYTES + 1)
        if hashlib.sha256(data).hexdigest() != digest:
            raise RecordError(f"input {what} in the store {store} does not match its sha256")
        return data

    sizes: dict[str, int] = {}
    total = 0
    for e in entries:
        if e["kind"] != "file":
            continue
        if e["sha256"] is None:
            raise RecordError(f"input {display(e['path'])!r} was not hashed ({e['skipped']}): cannot replay")
        if e["sha256"] not in sizes:
            with open_blob(e["sha256"], repr(display(e["path"]))) as f:
                sizes[e["sha256"]] = os.fstat(f.fileno()).st_size
        total += sizes[e["sha256"]]
        if total > max_bytes:
            raise RecordError(f"refusing to replay: rebuilding the record's workspace would write more than "
                              f"{max_bytes} bytes (files are counted once per copy); pass max_bytes= "
                              "(CLI: --max-bytes) if you trust the record")
    try:
        for e in entries:
            if e["kind"] == "dir":
                _ws.make_dir(root, e["path"], 0o755)
        cache: dict[str, bytes] = {}  # blobs named more than once, up to 64 MiB in all
        cached = 0
        for e in entries:
            if e["kind"] == "file":
                digest = e["sha256"]
                data = cache.get(digest)
                if data is None:
                    data = blob(digest, repr(display(e["path"])))
                    if cached + len(data) <= 64 * 1024 * 1024:
                        cache[digest] = data
                        cached += len(data)
                _ws.write_file(root, e["path"], data)
                _ws.set_mode(root, e["path"], e["mode"] & ~_ws.SETID_BITS)
            elif e["kind"] == "symlink" and e["link"] is not None:
                _ws.make_symlink(root, e["path"], e["link"])
        for e in reversed(entries):
            if e["kind"] == "dir":
                _ws.set_mode(root, e["path"], e["mode"] & ~_ws.SETID_BITS)
    except WorkspaceError as err:
        raise RecordError(f"cannot rebuild the record's workspace: {err}") from err
    return blob(rec.stdin_sha256, "stdin") if rec.stdin_sha256 else None


def _check_image_present(doc: Mapping[str, Any]) -> None:
    """Refuse a record whose image is not in the store, saying how to get it back."""
    image = (doc.get("rootfs") or {}).get("image") if isinstance(doc.get("rootfs"), Mapping) else None
    if not isinstance(image, Mapping):
        return
    image_id, names_raw = image.get("id"), image.get("names")
    if not isinstance(image_id, str) or not (names_raw is None or (
            isinstance(names_raw, list) and all(isinstance(n, str) for n in names_raw))):
        raise RecordError("refusing the record: rootfs.image.id must be a string and rootfs.image.names a list "
                          "of strings")
    store = StoreReader()
    try:
        store.get(image_id)
    except LowlevelError:
        names = ", ".join(names_raw or ()) or "no name"
        raise RecordError(f"refusing to replay: the record ran on image {image_id} ({names}, manifest "
                          f"{image.get('manifest_digest')}), which is not in the image store {store.path}. Import "
                          "the archive it came from (`lowlevel image import ARCHIVE`), or point --image-store "
                          "($LOWLEVEL_IMAGE_STORE) at the store that has it") from None


def _entry_key(e: Mapping[str, Any]) -> tuple[Any, ...]:
    link = e["link"]
    return (e["kind"], e["mode"], e["sha256"] if e["kind"] == "file" else None,
            name_from_json(link) if link is not None else None)


def compare(original: Mapping[str, Any], replayed: Mapping[str, Any]) -> list[str]:
    """Differences between two records' outcomes (exit, killed_by, output, workspace after).

    Both records in their JSON form (names as strings or ``{"b64", "text"}`` objects), the
    original checked by :func:`validate_record`.
    """
    diffs: list[str] = []
    for key in ("exit_code", "killed_by", "timed_out"):
        a, b = original["exit"][key], replayed["exit"][key]
        if a != b:
            diffs.append(f"exit.{key}: recorded {a!r}, replayed {b!r}")
    if original["output"]["captured"] and replayed["output"]["captured"]:
        for stream in ("stdout", "stderr"):
            a, b = original["output"][stream], replayed["output"][stream]
            if a["sha256"] != b["sha256"]:
                diffs.append(f"{stream}: recorded {a['bytes']} bytes sha256 {a['sha256'][:12]}, "
                             f"replayed {b['bytes']} bytes sha256 {b['sha256'][:12]}")
    before = {name_from_json(e["path"]): e for e in original["workspace"]["after"]}
    after = {name_from_json(e["path"]): e for e in replayed["workspace"]["after"]}
    for p in sorted(set(before) | set(after)):
        shown = display(p)
        if p not in after:
            diffs.append(f"workspace: {shown} missing after replay")
        elif p not in before:
            diffs.append(f"workspace: {shown} appeared only in the replay")
        elif _entry_key(before[p]) != _entry_key(after[p]):
            a, b = before[p], after[p]
            what = [k for k in ("kind", "mode", "sha256", "link") if a[k] != b[k]]
            diffs.append(f"workspace: {shown} differs ({', '.join(what)})")
    return diffs


def _rebuild_policy(rec: ParsedRecord, profiles: Sequence[Any]) -> Policy:
    """The record's Policy, planned on this host (its image looked up, its tree checked: the
    errors :func:`lowlevel.rootfs.resolve.resolve` raises become "cannot be rebuilt")."""
    return resolve(policy_from_canonical(rec.policy, profiles=profiles))


def replay(path: str | os.PathLike[str], *, workspace_base: str | None = None,
           profiles: Sequence[Any] = (), keep_workspace: bool = False, trust_policy: bool = False,
           max_bytes: int = MAX_REPLAY_BYTES, max_entries: int = MAX_REPLAY_ENTRIES) -> ReplayReport:
    """Rerun a recorded run with the same policy, command, environment and inputs.

    The record is checked field by field first (:func:`validate_record`), the workspace is
    rebuilt from the record's input store in a fresh directory (bounded: ``max_bytes``,
    ``max_entries``); the run uses the recorded Policy (checked against ``policy_sha256``),
    command, cwd, per-run env, stdin and timeout, and always captures output.

    Args:
        path: the record file; its store ``<path>.inputs/`` must sit next to it.
        workspace_base: parent of the fresh workspace (default as for :func:`lowlevel.run`).
        profiles: SeccompProfiles other than the default that the record may name.
        keep_workspace: keep the replay's workspace (its path is ``report.result.workspace``).
        trust_policy: run even when the record's policy is looser than ``Policy()`` (see
            :func:`policy_loosening`: binds, network, seccomp off or in log mode, other host
            ids, higher limits; and :func:`argv_loosening`: options the record's cwd or env
            would add to bwrap's argv). A record is untrusted input: without this, such a
            record is refused and the message lists each difference. CLI:
            ``--trust-record-policy``. A malformed field (a NUL, a wrong type) is refused
            whatever this says.
        max_bytes: most bytes rebuilding the workspace may write (every copy of a stored file
            counts); default :data:`MAX_REPLAY_BYTES`. CLI: ``--max-bytes``.
        max_entries: most entries it may create; default :data:`MAX_REPLAY_ENTRIES`.
    Returns:
        A :class:`ReplayReport`.
    Raises:
        RecordError: bad record (any field: see :func:`validate_record`), missing inputs, a
            policy that does not hash the same here, a looser policy without ``trust_policy``,
            or a workspace over ``max_bytes``/``max_entries``.
        Whatever :func:`lowlevel.run` raises.
    """
    doc = load_record(path)
    rec = validate_record(doc)
    _check_image_present(doc)
    try:
        policy = _rebuild_policy(rec, profiles)
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as err:
        raise RecordError(f"refusing the record: its policy cannot be rebuilt: {err}") from err
    except LowlevelError as err:
        raise RecordError(f"refusing the record: its policy cannot be rebuilt: {err}") from err
    try:
        check_record_rootfs(doc.get("rootfs"), policy)
    except LowlevelError as err:
        raise RecordError(f"refusing to replay: {err}") from err
    if policy_sha256(policy) != rec.policy_sha256:
        raise RecordError("the rebuilt policy does not hash to the recorded policy_sha256 "
                          "(a lowlevel version with different Policy fields?)")
    if not trust_policy:
        loose = policy_loosening(policy, rec.timeout_s, profiles=profiles)
        loose += argv_loosening(policy, env=rec.env)
        if loose:
            raise RecordError("refusing to replay: the record's policy is looser than the default:\n  "
                              + ";\n  ".join(loose) + ".\nA record is untrusted input. If you trust it, pass "
                              "trust_policy=True (CLI: --trust-record-policy)")
    if not rec.store:
        raise RecordError("the record has no input store: it was written without inputs and cannot be replayed")
    store = os.path.join(os.path.dirname(os.path.abspath(os.fspath(path))), rec.store)
    root = _ws.create_workspace((), workspace_base)
    try:
        stdin = _restore_inputs(rec, store, root, max_bytes=max_bytes, max_entries=max_entries)
        result, new = execute_recorded(rec.command, policy=policy, workspace=root, timeout=rec.timeout_s,
                                       stdin=stdin, env=rec.env or None, cwd=rec.cwd)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    if not keep_workspace:
        shutil.rmtree(root, ignore_errors=True)
    diffs = compare(doc, new)
    if rec.policy.get("deterministic") is False and diffs:
        diffs.append("note: the recorded run was not in deterministic mode (Policy(deterministic=True))")
    return ReplayReport(matched=not diffs, differences=diffs, result=result, record=new)


__all__ = ["ReplayReport", "compare", "replay"]
