"""Recording a run: :func:`execute_recorded` (run and build the record) and :func:`record_run`
(write it next to its input store, atomically, never raising once the program ran). One
concept: record writing. The record's fields are listed in ``docs/records.md``.

The caller's own environment is never read into a record: ``environment`` is the sandbox's
(:meth:`lowlevel.spec.policy.Policy.environment`), which holds only BASE_ENV, the Policy's
``env`` and the per-run ``env``. Whatever a caller passes into the sandbox (an API token in
``env``) is in the sandbox and therefore in the record.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lowlevel.host import seccomp_filter as _seccomp_filter
from lowlevel import workspace as _ws
from lowlevel.errors import CommitConflictError, CommitIncompleteError, LowlevelError
from lowlevel.paths import unreachable
from lowlevel.record.canonical import canonical_policy, canonical_value, policy_sha256, seccomp_rules_sha256
from lowlevel.record.hashing import HASH_BUDGET_BYTES, HASH_BUDGET_S, HashBudget, InputStore, hash_workspace
from lowlevel.record.schema import SCHEMA_ID, STORE_SUFFIX, RecordError, store_dir_for
from lowlevel.rootfs.store import image_record
from lowlevel.sandbox.drive import run as _run
from lowlevel.sandbox.facts import host_facts, planned_policy
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S, RunRequest
from lowlevel.sandbox.run_workspace import drop_fresh_workspace
from lowlevel.sandbox.result import Result
from lowlevel.spec import seccomp as _seccomp
from lowlevel.spec import validate as _validate
from lowlevel.spec.policy import WORKSPACE_DEST, Policy
from lowlevel.spec.report import RECORD_NOT_WRITTEN, json_safe

log = logging.getLogger("lowlevel")

#: Start of the Result's note (and the record's) when the run's commit failed after the program ran.
COMMIT_FAILED_NOTE = "commit: failed: "


def _versions(bwrap_version: tuple[int, ...] | None) -> dict[str, Any]:
    from lowlevel.version import __version__
    libseccomp = None
    try:
        fn = getattr(_seccomp_filter, "libseccomp_version", None)
        v = fn() if fn is not None else _seccomp_filter._backend().version()
        libseccomp = ".".join(map(str, v)) if v else None
    except Exception as err:  # noqa: BLE001 - a record notes what it cannot learn
        log.debug("lowlevel: libseccomp version unknown: %s", err)
    uname = os.uname()
    return {"bwrap": ".".join(map(str, bwrap_version)) if bwrap_version else None,
            "libseccomp": libseccomp, "kernel": uname.release, "kernel_build": uname.version,
            "machine": uname.machine, "python": platform.python_version(),
            "python_implementation": platform.python_implementation(), "lowlevel": __version__}


def _seccomp_doc(policy: Policy) -> dict[str, Any] | None:
    if policy.seccomp is None:
        return None
    fn = getattr(_seccomp, "profile_sha256", None)
    bpf = _seccomp_filter.compile_bpf(policy.seccomp, compat_32bit=policy.compat_32bit)
    arches = [_seccomp.ARCH_NAMES.get(a, hex(a))
              for a in _seccomp_filter.filter_arches(compat_32bit=policy.compat_32bit)]
    return {"profile": policy.seccomp.name, "rules_sha256": seccomp_rules_sha256(policy.seccomp),
            "bpf_sha256": hashlib.sha256(bpf).hexdigest(), "bpf_bytes": len(bpf), "arches": arches,
            "profile_sha256": fn(policy.seccomp) if fn is not None else None}


def _stream_doc(data: bytes, truncated: bool, dropped: int) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "truncated": truncated,
            "dropped_bytes": dropped}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")


def execute_recorded(command: Sequence[str], *, policy: Policy | None = None,
                     workspace: str | os.PathLike[str] | None = None,
                     inputs: Sequence[str | os.PathLike[str]] = (), timeout: float | None = DEFAULT_TIMEOUT_S,
                     stdin: bytes | None = None, env: Mapping[str, str] | None = None, capture: bool = True,
                     cwd: str | None = None, workspace_base: str | None = None,
                     store_dir: str | None = None,
                     allow_sensitive_workspace: bool = False,
                     hash_budget: tuple[int, float] = (HASH_BUDGET_BYTES, HASH_BUDGET_S),
                     commit: bool | str = True, kill_after: float = 0.0,
                     stdio_fds: Sequence[int | None] | None = None, keep_workspace: bool = True,
                     ) -> tuple[Result, dict[str, Any]]:
    """Run ``command`` like :func:`lowlevel.run` and build its record (not written).

    Same arguments as :func:`lowlevel.run`, plus ``store_dir``: where to copy the inputs for
    replay (None: hash only; the record then cannot be replayed), and ``hash_budget``:
    ``(bytes, seconds)`` for each of the two workspace walks (before and after the run; see
    :class:`lowlevel.record.HashBudget`). The Policy is planned first
    (:func:`lowlevel.rootfs.resolve.resolve`): the record holds the image it pins. ``commit``
    other than True, ``kill_after`` and ``stdio_fds`` are refused (PolicyError:
    :meth:`lowlevel.sandbox.request.RunRequest.check_recordable`); ``keep_workspace=False``
    removes the fresh workspace once the record is built.

    Returns:
        ``(result, record)``; the record is a JSON-ready dict in its JSON form (names that are
        not valid UTF-8 as ``{"b64", "text"}`` objects: :mod:`lowlevel.spec.report`).
    Raises:
        Whatever :func:`lowlevel.run` raises (PolicyError for a bad argument, before anything
        is created); RecordError when the input store cannot be written. No record is made for
        a run that never started. A failed commit (CommitConflictError, CommitIncompleteError) is
        raised once the record is built: ``err.result`` (noted), ``err.record``.
    """
    policy = planned_policy(policy or Policy())
    if cwd is None:
        cwd = policy.workdir or WORKSPACE_DEST
    request = RunRequest(command, workspace=workspace, inputs=inputs, timeout=timeout, kill_after=kill_after,
                         stdin=stdin, env=env, capture=capture, cwd=cwd, workspace_base=workspace_base,
                         allow_sensitive_workspace=allow_sensitive_workspace, stdio_fds=stdio_fds,
                         keep_workspace=keep_workspace, commit=commit)
    request.check_recordable()
    command = list(request.command)
    ws, created = _workspace(workspace, inputs, workspace_base, allow_sensitive_workspace)
    try:
        store = InputStore(store_dir)
        t_hash = time.monotonic()
        budget_before = HashBudget(*hash_budget)
        before, before_complete = hash_workspace(ws, store, budget=budget_before)
        stdin_doc = None
        if stdin is not None:
            digest = hashlib.sha256(stdin).hexdigest()
            stdin_doc = {"sha256": digest, "bytes": len(stdin), "stored": store.put(digest, bytes(stdin))}
        hash_before_s = time.monotonic() - t_hash
        started_at = _now()
        result, commit_error = _run_keeping_commit_error(
            command, policy=policy, workspace=ws, timeout=timeout, stdin=stdin, env=env, capture=capture, cwd=cwd,
            allow_sensitive_workspace=allow_sensitive_workspace)
    except BaseException:
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise
    finished_at = _now()
    after, after_complete, budget_after = _hash_after(ws, result, hash_budget)
    budget_notes = [n for n in (budget_before.note("before"), budget_after.note("after")) if n]
    record = _record_doc(result, policy, command=list(command), cwd=cwd, env=env, stdin_doc=stdin_doc,
                         timeout=timeout, capture=capture, notes=list(result.notes) + budget_notes)
    record["timings"].update(started_at=started_at, finished_at=finished_at, hash_before_s=hash_before_s)
    record["created_at"] = finished_at
    record["workspace"] = {"path": ws, "before": before, "before_complete": before_complete,
                           "after": after, "after_complete": after_complete}
    record["inputs"] = {"store": os.path.basename(store_dir) if store_dir else None,
                        "complete": bool(store_dir) and store.complete and before_complete
                        and all(e["stored"] for e in before if e["kind"] == "file")}
    if budget_notes:
        result.notes = (*result.notes, *budget_notes)
    safe: dict[str, Any] = json_safe(record)
    if created and not keep_workspace:
        result = drop_fresh_workspace(result)
    if commit_error is not None:
        commit_error.result, commit_error.record = result, safe
        raise commit_error
    return result, safe


def _hash_after(ws: str, result: Result, hash_budget: tuple[int, float]) -> tuple[list[Any], bool, HashBudget]:
    """The workspace's hashes after the run (entries, complete, the budget used); a failure is
    a note of the Result and no entries."""
    budget = HashBudget(*hash_budget)
    try:
        after, complete = hash_workspace(ws, budget=budget)
    except LowlevelError as err:
        result.notes = (*result.notes, f"record: cannot hash the workspace after the run: {err}")
        return [], False, budget
    return after, complete, budget


def _run_keeping_commit_error(command: Sequence[str], **kwargs: Any) -> tuple[
        Result, CommitConflictError | CommitIncompleteError | None]:
    """:func:`lowlevel.sandbox.drive.run`; a commit that failed after the program ran gives the
    Result (a note says why) and the error, so the run is recorded before the error is raised
    (carrying ``.result`` and ``.record``)."""
    try:
        return _run(command, **kwargs), None
    except (CommitConflictError, CommitIncompleteError) as err:
        if err.result is None:
            raise
        result: Result = err.result
        result.notes = (*result.notes, f"{COMMIT_FAILED_NOTE}{err}")
        return result, err


def _workspace(workspace: str | os.PathLike[str] | None, inputs: Sequence[str | os.PathLike[str]],
               workspace_base: str | None, allow_sensitive: bool) -> tuple[str, str | None]:
    """The run's workspace with its inputs copied in: ``(path, path if made here else None)``."""
    if workspace is None:
        ws = _ws.create_workspace(inputs, workspace_base)
        return ws, ws
    ws = os.path.realpath(os.fspath(workspace))
    _ws.check_workspace_path(ws, allow_sensitive=allow_sensitive)
    if inputs:
        _ws.copy_inputs(ws, inputs)
    return ws, None


def _record_doc(result: Result, policy: Policy, *, command: list[str], cwd: str, env: Mapping[str, str] | None,
                stdin_doc: dict[str, Any] | None, timeout: float | None, capture: bool,
                notes: list[str]) -> dict[str, Any]:
    """The record of a finished run but for its workspace listings, inputs and times (which
    :func:`execute_recorded` adds); in the key order ``docs/records.md`` lists."""
    facts = host_facts()
    record: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "created_at": None,
        "command": command,
        "cwd": cwd,
        "env": dict(sorted((env or {}).items())),
        "environment": dict(sorted(policy.environment(env).items())),
        "stdin": stdin_doc,
        "timeout_s": timeout,
        "policy": canonical_policy(policy),
        "policy_sha256": policy_sha256(policy),
        "seccomp": _seccomp_doc(policy),
        "bwrap_argv": list(result.argv),
        "versions": _versions(facts.bwrap.version),
        "host": {"caller_uid": os.getuid(), "caller_is_root": facts.caller_is_root,
                 "landlock_abi": result.landlock_abi},
        "limits": {"requested": canonical_value(policy.limits), "enforced": list(result.limits_enforced)},
        "timings": {"started_at": None, "finished_at": None, "wall_time_s": result.wall_time_s,
                    "hash_before_s": None},
        "usage": {"cpu_user_s": result.cpu_user_s, "cpu_system_s": result.cpu_system_s,
                  "peak_memory_bytes": result.peak_memory_bytes, "max_rss_bytes": result.max_rss_bytes,
                  "oom_kills": result.oom_kills},
        "exit": {"exit_code": result.exit_code, "term_signal": result.term_signal, "signal": result.signal_name(),
                 "timed_out": result.timed_out, "killed_by": result.killed_by},
        "output": {"captured": capture,
                   "stdout": _stream_doc(result.stdout, result.stdout_truncated, result.stdout_dropped_bytes),
                   "stderr": _stream_doc(result.stderr, result.stderr_truncated, result.stderr_dropped_bytes)},
        "workspace": None,
        "inputs": None,
        "notes": notes,
        "rootfs": image_record(policy),
    }
    if result.network is not None:
        record["network"] = [dataclasses.asdict(a) for a in result.network]
    return record


def check_record_path(path: str | os.PathLike[str]) -> str:
    """Refuse a record path that cannot be written, before anything runs.

    Args:
        path: where the record goes.
    Returns:
        The absolute path.
    Raises:
        PolicyError: empty, a NUL... RecordError: an existing directory (or other non-file),
            a missing parent directory, an input store name (``<path>.inputs``) taken by
            something else than a directory.
    """
    raw = _validate.host_path(path, "record")
    full = os.path.abspath(raw)
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        raise RecordError(f"cannot write the record {full}: it is a directory; name a file, e.g. {full}/run.json")
    if os.path.islink(full) or (os.path.lexists(full) and not os.path.isfile(full)):
        raise RecordError(f"cannot write the record {full}: it exists and is not a regular file")
    if not os.path.isdir(parent):
        missing = unreachable(parent)
        raise RecordError(f"cannot write the record {full}: the directory {parent} "
                          + (missing[1] if missing is not None else "is not a directory"))
    store = full + STORE_SUFFIX
    if os.path.lexists(store) and (os.path.islink(store) or not os.path.isdir(store)):
        raise RecordError(f"cannot write the record {full}: its input store {store} exists and is not a directory")
    return full


class _RecordFile:
    """The record's temp file, made before the run (so an unwritable place fails first) and
    renamed into place after it; :meth:`discard` removes it on every failure."""

    def __init__(self, path: str) -> None:
        import tempfile

        self.path = path
        try:
            fd, self.tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp", dir=os.path.dirname(path))
        except OSError as err:
            raise RecordError(f"cannot write the record {path}: {err.strerror or err}") from err
        self.fd: int | None = fd  # mode 0600: a record holds the environment, which may carry tokens

    def commit(self, record: Mapping[str, Any]) -> None:
        """Write ``record`` and rename it into place. Raises OSError (the temp file stays: discard it)."""
        assert self.fd is not None
        data = (json.dumps(json_safe(record), indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        """Close and remove the temp file (idempotent, never raises)."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def record_run(command: Sequence[str], *, record: str | os.PathLike[str], **kwargs: Any) -> Result:
    """Run like :func:`lowlevel.run` and write the run's record to ``record``.

    The inputs (every regular file in the workspace before the run, and stdin) are copied
    into ``<record>.inputs/`` for :func:`replay`. ``lowlevel.run(..., record=PATH)`` calls this.

    The path is checked, and the record's temp file created, before the run: a missing
    directory, a directory, ``""`` or an unwritable place fail with RecordError before anything
    runs. Once the program ran, writing the record never raises: on failure (a full disk...)
    the temp file is removed and ``Result.notes`` gets one line starting with
    :data:`RECORD_NOT_WRITTEN`; the output and the exit status are in the Result as always.

    Args:
        command: as for :func:`lowlevel.run`.
        record: path of the JSON record to write (replaced if it exists).
        **kwargs: the other keyword arguments of :func:`lowlevel.run` (and ``hash_budget``,
            see :func:`execute_recorded`).
    Returns:
        The run's :class:`Result`.
    Raises:
        Whatever :func:`lowlevel.run` raises; RecordError (before the run) for an unusable path
        or input store, or a record inside the workspace. A failed commit
        (CommitConflictError, CommitIncompleteError) is raised after the record is written
        (its notes say so): the program's output is in ``err.result``.
    """
    path = check_record_path(record)
    _outside_workspace(path, kwargs.get("workspace"))
    f = _RecordFile(path)
    commit_error: CommitConflictError | CommitIncompleteError | None = None
    try:
        result, doc = execute_recorded(command, store_dir=store_dir_for(path), **kwargs)
    except (CommitConflictError, CommitIncompleteError) as err:
        if err.record is None:
            f.discard()
            raise
        commit_error, result, doc = err, err.result, err.record
    except BaseException:
        f.discard()
        raise
    try:
        f.commit(doc)
    except Exception as err:  # noqa: BLE001 - after the run: never raise, report in notes
        f.discard()
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        note = f"{RECORD_NOT_WRITTEN}{path}: {reason}"
        log.info("lowlevel: %s", note)  # the note is the report (the CLI prints it)
        result.notes = (*result.notes, note)
    if commit_error is not None:
        raise commit_error
    return result


def _outside_workspace(path: str, workspace: str | os.PathLike[str] | None) -> None:
    """Refuse a record (or its input store) inside the run's workspace: the program would see
    its temporary file and store, and could change or delete them to make the commit fail and
    the record vanish (a fresh-user trial)."""
    if workspace is None:
        return
    ws = os.path.realpath(os.fspath(workspace))
    where = os.path.realpath(os.path.dirname(path))
    if os.path.commonpath([ws, where]) == ws:
        raise RecordError(f"the record {path} is inside the run's workspace {ws}: the program could change or "
                          "remove it; write the record outside the workspace")


__all__ = ["COMMIT_FAILED_NOTE", "check_record_path", "execute_recorded", "record_run"]
