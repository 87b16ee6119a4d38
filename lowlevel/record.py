"""Run records: one JSON document per run, to audit it and to replay it.

A record (schema ``docs/record-schema.json``, prose in ``docs/records.md``) holds the full
bwrap argv, the Policy in a canonical form and its SHA-256, the seccomp profile hash, the
versions of bwrap, libseccomp, the kernel, Python and lowlevel, the environment inside the
sandbox, the limits requested and enforced, timings, rusage and cgroup figures, the exit
status, ``killed_by``, and the SHA-256 of every workspace file before and after the run.

Glossary:
    canonical policy: :func:`canonical_policy`: the Policy as a JSON object with sorted keys,
        every field by its own name; the seccomp profile appears as its name, default action,
        log flag and the SHA-256 of its rule table (see :func:`seccomp_rules_sha256`). Its
        SHA-256 (``policy_sha256``) is the hash of ``json.dumps(canonical, sort_keys=True,
        separators=(",", ":"), ensure_ascii=False)`` encoded as UTF-8.
    input store: the sibling directory ``<record>.inputs/`` holding a copy of every regular
        file that was in the workspace before the run (and stdin, if any), each named by its
        SHA-256 (content-addressed, so a file used twice is stored once). Replay needs the
        record and its store, nothing else: the original input paths may be gone.

The caller's own environment is never read into a record: ``environment`` is the sandbox's
(:meth:`Policy.environment`), which holds only BASE_ENV, the Policy's ``env`` and the
per-run ``env``. Whatever a caller passes into the sandbox (an API token in ``env``) is in
the sandbox and therefore in the record.

Workspace content is untrusted: it is walked without following a symlink and each file is
opened relative to directory fds with ``O_NOFOLLOW`` (special files and multiply-linked files
refused). Each walk is bounded (:class:`HashBudget`: total bytes and seconds); files larger
than :data:`MAX_HASH_BYTES`, sparse files, and files past the budget are listed with
``sha256: null`` and a ``skipped`` reason, and the record's notes count them.

A record is untrusted input to :func:`replay`: :func:`validate_record` checks every field it
uses first. Names that are not valid UTF-8 are written as ``{"b64", "text"}`` objects
(:mod:`lowlevel.spec.report`), so a record is always strict UTF-8 JSON and loses nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lowlevel.spec import validate as _validate
from lowlevel import workspace as _ws
from lowlevel.sandbox.argv import BWRAP_ARITY, build_argv
from lowlevel.spec.egress import egress_from_mapping
from lowlevel.errors import LowlevelError, PolicyError, WorkspaceError
from lowlevel.sandbox.drive import run as _run
from lowlevel.sandbox.facts import host_facts
from lowlevel.sandbox.run_workspace import drop_fresh_workspace
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import WORKSPACE_DEST, Bind, Policy
from lowlevel.spec.report import RECORD_NOT_WRITTEN, display, json_safe, name_from_json
from lowlevel.sandbox.result import KILLED_BY, Result

log = logging.getLogger("lowlevel")

#: The ``schema`` value of records this module writes and reads.
SCHEMA_ID = "lowlevel-run-record/1"
#: Files larger than this (bytes) are listed but not hashed or stored.
MAX_HASH_BYTES = 64 * 1024 * 1024
#: Total bytes copied into one record's input store; beyond it files are hashed, not stored.
MAX_STORE_BYTES = 512 * 1024 * 1024
#: Suffix of the input store directory next to the record file.
STORE_SUFFIX = ".inputs"


class RecordError(LowlevelError):
    """A record cannot be written, read or replayed (bad schema, missing input, policy drift)."""


# --- canonical policy ---------------------------------------------------------------------

def _canon(value: Any) -> Any:
    """JSON-ready form of a policy value: dataclasses by their comparable fields, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canon(getattr(value, f.name)) for f in dataclasses.fields(value) if f.compare}
    if isinstance(value, Mapping):
        return {str(k): _canon(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _dumps(value: Any) -> bytes:
    return json.dumps(json_safe(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seccomp_rules_sha256(profile: Any) -> str:
    """SHA-256 of a SeccompProfile's rule table: rows (syscall, action, args), default action, log.

    Prose (``reason``, ``source``) does not count, as it does not for equality. Host-independent,
    unlike the BPF bytes (which depend on the arch and the libseccomp version).
    """
    canon = _canon(profile)
    canon.pop("name", None)
    return hashlib.sha256(_dumps(canon)).hexdigest()


def canonical_policy(policy: Policy) -> dict[str, Any]:
    """The Policy as a JSON object (see the module glossary). Pure."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if f.name == "seccomp":
            out[f.name] = None if value is None else {
                "name": value.name, "default_action": value.default_action, "log": value.log,
                "rules_sha256": seccomp_rules_sha256(value)}
        elif f.name == "rootfs" and policy.image is not None:
            out[f.name] = None  # the image's tree: a path in this host's store; the image id pins it
        elif f.name == "binds":
            # allow_sockets (issue 22) only when set: records made before it hash as they did.
            out[f.name] = [{k: v for k, v in _canon(b).items() if not (k == "allow_sockets" and v is False)}
                           for b in value]
        else:
            out[f.name] = _canon(value)
    return out


def policy_sha256(policy: Policy) -> str:
    """SHA-256 (hex) of :func:`canonical_policy`'s compact, key-sorted UTF-8 JSON."""
    return hashlib.sha256(_dumps(canonical_policy(policy))).hexdigest()


def _known_profiles(extra: Sequence[Any]) -> dict[str, Any]:
    from lowlevel.spec import seccomp as _seccomp
    profiles = [_seccomp.DEFAULT_PROFILE, _seccomp.DEFAULT_PROFILE.with_log(), *extra]
    return {seccomp_rules_sha256(p): p for p in profiles}


def policy_from_canonical(canon: Mapping[str, Any], *, profiles: Sequence[Any] = ()) -> Policy:
    """Rebuild a Policy from :func:`canonical_policy` output.

    Args:
        canon: the ``policy`` object of a record.
        profiles: SeccompProfiles to look the record's profile up in (by rules hash), besides
            the default profile and its log-mode copy.
    Raises:
        RecordError: an unknown field, or a seccomp profile not among ``profiles``.
        PolicyError: the rebuilt Policy is invalid here (a bind source missing on this host).
    """
    canon = _decode_names(canon)
    if not isinstance(canon, Mapping):
        raise RecordError("the record's policy is not an object")
    names = {f.name for f in dataclasses.fields(Policy)}
    unknown = set(canon) - names
    if unknown:
        raise RecordError(f"record policy has fields this lowlevel does not know: {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in canon.items():
        if name == "binds":
            kwargs[name] = tuple(Bind(**b) for b in value)
        elif name == "limits":
            limit_kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
            kwargs[name] = Limits(**limit_kwargs)
        elif name == "env":
            kwargs[name] = tuple((k, v) for k, v in value)
        elif name == "network" and isinstance(value, Mapping):
            kwargs[name] = egress_from_mapping(value)
        elif name == "seccomp":
            if value is None:
                kwargs[name] = None
            else:
                found = _known_profiles(profiles).get(value["rules_sha256"])
                if found is None:
                    raise RecordError(f"the record's seccomp profile {value['name']!r} (rules sha256 "
                                      f"{value['rules_sha256']}) is not known here: pass it to replay(profiles=...)")
                kwargs[name] = found
        else:
            kwargs[name] = tuple(value) if isinstance(value, list) else value
    return Policy(**kwargs)


def _decode_names(value: Any) -> Any:
    """Turn every ``{"b64", "text"}`` name object (:mod:`lowlevel.spec.report`) in a JSON value back
    into the str it stands for."""
    if isinstance(value, Mapping):
        if set(value) == {"b64", "text"}:
            return name_from_json(value)
        return {k: _decode_names(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_names(v) for v in value]
    return value


# --- host facts ---------------------------------------------------------------------------

def _versions(bwrap_version: tuple[int, ...] | None) -> dict[str, Any]:
    from lowlevel import __version__
    libseccomp = None
    try:
        from lowlevel.spec import seccomp as _seccomp
        fn = getattr(_seccomp, "libseccomp_version", None)
        v = fn() if fn is not None else _seccomp._backend().version()
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
    from lowlevel.spec import seccomp as _seccomp
    fn = getattr(_seccomp, "profile_sha256", None)
    bpf = _seccomp.compile_bpf(policy.seccomp, compat_32bit=policy.compat_32bit)
    arches = [_seccomp.ARCH_NAMES.get(a, hex(a)) for a in _seccomp.filter_arches(compat_32bit=policy.compat_32bit)]
    return {"profile": policy.seccomp.name, "rules_sha256": seccomp_rules_sha256(policy.seccomp),
            "bpf_sha256": hashlib.sha256(bpf).hexdigest(), "bpf_bytes": len(bpf), "arches": arches,
            "profile_sha256": fn(policy.seccomp) if fn is not None else None}


# --- workspace hashing ---------------------------------------------------------------------

#: Total bytes one walk of :func:`hash_workspace` reads (every file's apparent size counts).
HASH_BUDGET_BYTES = 512 * 1024 * 1024
#: Wall-clock seconds one walk of :func:`hash_workspace` may spend reading and hashing.
HASH_BUDGET_S = 10.0
#: A file with more bytes in holes than this is not hashed (reading holes costs time, not disk).
MAX_HOLE_BYTES = 1024 * 1024
_CHUNK = 1024 * 1024


@dataclass
class HashBudget:
    """What one :func:`hash_workspace` walk may spend: bytes read and wall-clock seconds.

    A program can make a 64 MiB file with no data in it (``truncate -s 64M``) in microseconds;
    reading it back costs the host 64 MiB of zeros to hash. So after a run the walk is bounded
    in total (not only per file), sparse files are found by their allocated blocks
    (``st_blocks``) and confirmed with ``SEEK_DATA``/``SEEK_HOLE`` (a compressed file system
    also reports few blocks), and every file left out is listed with its reason.

    Attributes:
        max_bytes: total bytes to read (apparent sizes, holes included).
        max_seconds: seconds from the first file.
        used_bytes: bytes read so far.
        skipped_budget, skipped_sparse: files not hashed because the budget was spent, or
            because they are mostly holes.
    Source: lseek(2) SEEK_DATA/SEEK_HOLE; stat(2) st_blocks (512-byte units).
    """

    max_bytes: int = HASH_BUDGET_BYTES
    max_seconds: float = HASH_BUDGET_S
    used_bytes: int = 0
    skipped_budget: int = 0
    skipped_sparse: int = 0
    t0: float | None = None

    def expired(self) -> bool:
        """True once ``max_seconds`` have passed since the first file."""
        if self.t0 is None:
            self.t0 = time.monotonic()
        return time.monotonic() - self.t0 > self.max_seconds

    def reason(self) -> str:
        """Why a file was left out for the budget (for an entry's ``skipped``)."""
        return (f"post-run hash budget spent ({self.max_bytes} bytes or {self.max_seconds:g} s per walk): "
                "not hashed")

    def note(self, when: str) -> str | None:
        """One line for the record's notes, or None when nothing was left out."""
        parts = []
        if self.skipped_budget:
            parts.append(f"{self.skipped_budget} file(s) not hashed: the hash budget of {self.max_bytes} bytes / "
                         f"{self.max_seconds:g} s was spent")
        if self.skipped_sparse:
            parts.append(f"{self.skipped_sparse} sparse file(s) not hashed (more than {MAX_HOLE_BYTES} bytes of "
                         "holes)")
        return f"record: workspace {when} the run: " + "; ".join(parts) if parts else None


def _readlink(root: str, relpath: str) -> str | None:
    """Read a symlink's text without following any symlink on the way (openat per component)."""
    parts = relpath.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return os.readlink(parts[-1], dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _data_bytes(fd: int, size: int) -> int | None:
    """Bytes of ``fd`` in data extents (``SEEK_DATA``/``SEEK_HOLE``), or None when the file
    system cannot say or the file has too many extents to count (then it counts as dense)."""
    pos = total = 0
    for _ in range(4096):
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as err:
            return total if err.errno == errno.ENXIO else None
        end = os.lseek(fd, start, os.SEEK_HOLE)
        total += end - start
        pos = end
        if pos >= size:
            return total
    return None


def _hash_file(root: str, rel: str, max_bytes: int, budget: HashBudget,
               keep: bool) -> tuple[str | None, int, bytes | None, str | None]:
    """Hash one workspace file as untrusted content (no symlink followed, one hard link only).

    Returns:
        ``(sha256 or None, size, data (when ``keep`` and hashed) or None, skipped reason or None)``.
    """
    try:
        parts = _ws._split_rel(rel)
    except WorkspaceError as err:
        return None, 0, None, str(err)
    try:
        dfd = _ws._open_parent(root, parts)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY,
                         dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as err:
        return None, 0, None, f"cannot open: {err.strerror}"
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):
            return None, size, None, "not a regular file"
        if st.st_nlink > 1:
            return None, size, None, f"it has {st.st_nlink} hard links"
        if size > max_bytes:
            return None, size, None, f"larger than {max_bytes} bytes"
        if st.st_blocks * 512 + MAX_HOLE_BYTES < size:
            data_bytes = _data_bytes(fd, size)
            if data_bytes is not None and size - data_bytes > MAX_HOLE_BYTES:
                budget.skipped_sparse += 1
                return None, size, None, (f"sparse file: {size} bytes apparent, {data_bytes} in data extents "
                                          f"({st.st_blocks * 512} allocated): holes are not hashed")
        if budget.used_bytes + size > budget.max_bytes or budget.expired():
            budget.skipped_budget += 1
            return None, size, None, budget.reason()
        h = hashlib.sha256()
        chunks: list[bytes] = []
        got = 0
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            got += len(chunk)
            budget.used_bytes += len(chunk)
            if got > max_bytes:
                return None, got, None, f"larger than {max_bytes} bytes"
            h.update(chunk)
            if keep:
                chunks.append(chunk)
            if budget.expired():
                budget.skipped_budget += 1
                return None, got, None, budget.reason()
        return h.hexdigest(), got, b"".join(chunks) if keep else None, None


@dataclass
class _Store:
    """The input store of one record being written: ``dir`` (created lazily) and bytes used."""

    dir: str | None
    used: int = 0
    complete: bool = True

    def put(self, digest: str, data: bytes) -> bool:
        """Copy ``data`` in as ``<dir>/<digest>`` unless over MAX_STORE_BYTES.

        Raises:
            RecordError: the store cannot be written (ENOSPC...); no temp file is left.
        """
        if self.dir is None:
            return False
        if self.used + len(data) > MAX_STORE_BYTES:
            self.complete = False
            return False
        path = os.path.join(self.dir, digest)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            os.makedirs(self.dir, 0o700, exist_ok=True)
            if not os.path.exists(path):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                os.replace(tmp, path)
                self.used += len(data)
        except OSError as err:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise RecordError(f"cannot write the input store {self.dir}: {err.strerror or err}") from err
        return True


def hash_workspace(root: str, store: _Store | None = None, max_bytes: int = MAX_HASH_BYTES,
                   budget: HashBudget | None = None) -> tuple[list[dict[str, Any]], bool]:
    """List every entry of ``root`` with the SHA-256 of each regular file, within a budget.

    Args:
        root: host path of a workspace (untrusted content).
        store: when given, regular files are also copied into it (the input store).
        max_bytes: files larger than this are listed with ``sha256: None`` and ``skipped``.
        budget: the walk's total :class:`HashBudget` (default: a fresh one with
            :data:`HASH_BUDGET_BYTES` and :data:`HASH_BUDGET_S`); files beyond it, and sparse
            files, are listed with ``sha256: None`` and the reason in ``skipped``.
    Returns:
        ``(entries, complete)``: entries sorted by path, each ``{"path", "kind", "size",
        "mode", "sha256", "link", "stored", "skipped"}`` (``path`` and ``link`` as Python
        strs: :func:`lowlevel.spec.report.json_safe` makes them JSON); ``complete`` is False when
        the walk stopped at :data:`lowlevel.workspace.MAX_SNAPSHOT_ENTRIES`.
    Raises:
        WorkspaceError: root is missing or unreadable. RecordError: the store cannot be written.
    """
    budget = budget if budget is not None else HashBudget()
    walked, _ = _ws._walk(root)
    complete = len(walked) < _ws.MAX_SNAPSHOT_ENTRIES
    out: list[dict[str, Any]] = []
    for rel, st in sorted(walked, key=lambda e: e[0]):
        kind = _ws._kind(st.st_mode)
        doc: dict[str, Any] = {"path": rel, "kind": kind, "size": st.st_size, "mode": stat.S_IMODE(st.st_mode),
                               "sha256": None, "link": None, "stored": False, "skipped": None}
        if kind == "file":
            digest, size, data, skipped = _hash_file(root, rel, max_bytes, budget, keep=store is not None)
            doc["skipped"] = skipped
            if digest is not None:
                doc["sha256"] = digest
                doc["size"] = size
                if store is not None and data is not None:
                    doc["stored"] = store.put(digest, data)
        elif kind == "symlink":
            doc["link"] = _readlink(root, rel)
        out.append(doc)
    return out, complete


def _stream_doc(data: bytes, truncated: bool, dropped: int) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "truncated": truncated,
            "dropped_bytes": dropped}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")


def store_dir_for(record_path: str) -> str:
    """The input store directory of the record at ``record_path``: ``<record_path>.inputs``."""
    return os.path.abspath(record_path) + STORE_SUFFIX


# --- recording ----------------------------------------------------------------------------

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
    :class:`HashBudget`). ``commit`` other than True, ``kill_after`` and ``stdio_fds`` are
    refused (PolicyError: :meth:`lowlevel.sandbox.request.RunRequest.check_recordable`);
    ``keep_workspace=False`` removes the fresh workspace once the record is built.

    Returns:
        ``(result, record)``; the record is a JSON-ready dict in its JSON form (names that are
        not valid UTF-8 as ``{"b64", "text"}`` objects: :mod:`lowlevel.spec.report`).
    Raises:
        Whatever :func:`lowlevel.run` raises (PolicyError for a bad argument, before anything
        is created); RecordError when the input store cannot be written. No record is made for
        a run that never started.
    """
    from lowlevel.sandbox.request import RunRequest

    policy = policy or Policy()
    if not isinstance(policy, Policy):
        raise PolicyError(f"policy must be a lowlevel.Policy, got {type(policy).__name__}")
    if cwd is None:
        cwd = policy.workdir or WORKSPACE_DEST
    request = RunRequest(command, workspace=workspace, inputs=inputs, timeout=timeout, kill_after=kill_after,
                         stdin=stdin, env=env, capture=capture, cwd=cwd, workspace_base=workspace_base,
                         allow_sensitive_workspace=allow_sensitive_workspace, stdio_fds=stdio_fds,
                         keep_workspace=keep_workspace, commit=commit)
    request.check_recordable()
    command = list(request.command)
    environment = policy.environment(env)
    created = None
    if workspace is None:
        ws = created = _ws.create_workspace(inputs, workspace_base)
    else:
        ws = os.path.realpath(os.fspath(workspace))
        _ws.check_workspace_path(ws, allow_sensitive=allow_sensitive_workspace)
        if inputs:
            _ws.copy_inputs(ws, inputs)
    try:
        store = _Store(store_dir)
        t_hash = time.monotonic()
        budget_before = HashBudget(*hash_budget)
        before, before_complete = hash_workspace(ws, store, budget=budget_before)
        stdin_doc = None
        if stdin is not None:
            digest = hashlib.sha256(stdin).hexdigest()
            stdin_doc = {"sha256": digest, "bytes": len(stdin), "stored": store.put(digest, bytes(stdin))}
        hash_before_s = time.monotonic() - t_hash
        started_at = _now()
        result = _run(command, policy=policy, workspace=ws, timeout=timeout, stdin=stdin, env=env,
                      capture=capture, cwd=cwd, allow_sensitive_workspace=allow_sensitive_workspace)
    except BaseException:
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise
    finished_at = _now()
    budget_after = HashBudget(*hash_budget)
    try:
        after, after_complete = hash_workspace(ws, budget=budget_after)
    except LowlevelError as err:
        after, after_complete = [], False
        result.notes = (*result.notes, f"record: cannot hash the workspace after the run: {err}")
    budget_notes = [n for n in (budget_before.note("before"), budget_after.note("after")) if n]
    facts = host_facts()
    from lowlevel.image import image_record
    rootfs_doc = image_record(policy)
    record: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "created_at": finished_at,
        "command": list(command),
        "cwd": cwd,
        "env": dict(sorted((env or {}).items())),
        "environment": dict(sorted(environment.items())),
        "stdin": stdin_doc,
        "timeout_s": timeout,
        "policy": canonical_policy(policy),
        "policy_sha256": policy_sha256(policy),
        "seccomp": _seccomp_doc(policy),
        "bwrap_argv": list(result.argv),
        "versions": _versions(facts.bwrap.version),
        "host": {"caller_uid": os.getuid(), "caller_is_root": facts.caller_is_root,
                 "landlock_abi": result.landlock_abi},
        "limits": {"requested": _canon(policy.limits), "enforced": list(result.limits_enforced)},
        "timings": {"started_at": started_at, "finished_at": finished_at, "wall_time_s": result.wall_time_s,
                    "hash_before_s": hash_before_s},
        "usage": {"cpu_user_s": result.cpu_user_s, "cpu_system_s": result.cpu_system_s,
                  "peak_memory_bytes": result.peak_memory_bytes, "max_rss_bytes": result.max_rss_bytes,
                  "oom_kills": result.oom_kills},
        "exit": {"exit_code": result.exit_code, "term_signal": result.term_signal, "signal": result.signal_name(),
                 "timed_out": result.timed_out, "killed_by": result.killed_by},
        "output": {"captured": capture,
                   "stdout": _stream_doc(result.stdout, result.stdout_truncated, result.stdout_dropped_bytes),
                   "stderr": _stream_doc(result.stderr, result.stderr_truncated, result.stderr_dropped_bytes)},
        "workspace": {"path": ws, "before": before, "before_complete": before_complete,
                      "after": after, "after_complete": after_complete},
        "inputs": {"store": os.path.basename(store_dir) if store_dir else None,
                   "complete": bool(store_dir) and store.complete and before_complete
                   and all(e["stored"] for e in before if e["kind"] == "file")},
        "notes": list(result.notes) + budget_notes,
        "rootfs": rootfs_doc,
    }
    if result.network is not None:
        record["network"] = [dataclasses.asdict(a) for a in result.network]
    if budget_notes:
        result.notes = (*result.notes, *budget_notes)
    safe: dict[str, Any] = json_safe(record)
    if created and not keep_workspace:
        result = drop_fresh_workspace(result)
    return result, safe


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
    from lowlevel.spec import validate as _validate

    raw = _validate.host_path(path, "record")
    full = os.path.abspath(raw)
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        raise RecordError(f"cannot write the record {full}: it is a directory; name a file, e.g. {full}/run.json")
    if os.path.islink(full) or (os.path.lexists(full) and not os.path.isfile(full)):
        raise RecordError(f"cannot write the record {full}: it exists and is not a regular file")
    if not os.path.isdir(parent):
        raise RecordError(f"cannot write the record {full}: the directory {parent} does not exist")
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


def write_record(path: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    """Write ``record`` as indented, key-sorted UTF-8 JSON to ``path`` atomically (temp file in the
    same directory + rename; mode 0600: a record holds the environment inside the sandbox).

    Raises:
        RecordError: the path is refused (:func:`check_record_path`) or the write failed (ENOSPC,
            EROFS...); the temp file is removed either way.
    """
    f = _RecordFile(check_record_path(path))
    try:
        f.commit(record)
    except (OSError, ValueError) as err:
        f.discard()
        raise RecordError(f"cannot write the record {f.path}: {getattr(err, 'strerror', None) or err}") from err


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
        or input store.
    """
    path = check_record_path(record)
    f = _RecordFile(path)
    try:
        result, doc = execute_recorded(command, store_dir=store_dir_for(path), **kwargs)
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
    return result


# --- replay -------------------------------------------------------------------------------

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


#: Largest record file :func:`load_record` reads (bytes).
MAX_RECORD_BYTES = 256 * 1024 * 1024
#: Default cap on the bytes a replay writes into its workspace (every copy of a file counts).
MAX_REPLAY_BYTES = 256 * 1024 * 1024
#: Default cap on the entries a replay creates (files, directories, symlinks).
MAX_REPLAY_ENTRIES = _ws.MAX_SNAPSHOT_ENTRIES


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
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:
        what = "nested too deep" if isinstance(err, RecursionError) else str(err)
        raise RecordError(f"cannot read record {name!r}: not valid JSON ({what})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_ID:
        raise RecordError(f"{name!r} is not a {SCHEMA_ID} record")
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


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
            _ws._split_rel(path)
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
    from lowlevel.image import ImageStore
    store = ImageStore()
    image_id = str(image.get("id"))
    try:
        store.get(image_id)
    except LowlevelError:
        names = ", ".join(map(str, image.get("names") or ())) or "no name"
        raise RecordError(f"refusing to replay: the record ran on image {image_id} ({names}, manifest "
                          f"{image.get('manifest_digest')}), which is not in the image store {store.path}. Import "
                          "the archive it came from (`lowlevel image import ARCHIVE`), or point --image-store "
                          "($LOWLEVEL_IMAGE_STORE) at the store that has it") from None


def policy_loosening(policy: Policy, timeout_s: float | None = DEFAULT_TIMEOUT_S, *,
                     profiles: Sequence[Any] = ()) -> list[str]:
    """Where ``policy`` (and the timeout) give a sandbox more than ``Policy()`` does; one line each.

    Looser: any bind (it names host paths; writable or ``allow_sensitive`` said so), the host
    network, Landlock off, no seccomp filter or a profile in log mode (denials only logged) or one that is
    neither the default nor among ``profiles``, other host ids, a limit above its default or
    removed, larger capture caps, and a timeout above :data:`DEFAULT_TIMEOUT_S` or none.
    Environment, hostname, ids inside and deterministic mode are not looser.
    """
    from lowlevel.spec.seccomp import DEFAULT_PROFILE

    default = Policy()
    out: list[str] = []
    for b in policy.binds:
        flags = ["writable" if b.writable else "read-only"] + (["allow_sensitive"] if b.allow_sensitive else []) \
            + (["allow_sockets"] if b.allow_sockets else [])
        out.append(f"bind {b.source} -> {b.dest} ({', '.join(flags)}); default: no binds")
    if policy.network is True:
        out.append("network=True (the host network); default: no network")
    elif policy.network:
        out.append(f"network=Egress({policy.network.describe()}) (egress through the proxy); default: no network")
    if policy.rootfs is not None and policy.image is None:
        out.append(f"rootfs {policy.rootfs} (a host directory shown to the sandbox); default: the host's /usr")
    if policy.landlock is False:
        out.append("landlock=False (no Landlock ruleset); default: Landlock, best effort")
    if policy.seccomp is None:
        out.append("seccomp=None (no syscall filter); default: the default profile")
    elif policy.seccomp.log:
        out.append(f"seccomp profile {policy.seccomp.name!r} in log mode (denied syscalls are allowed and "
                   "logged); default: the default profile")
    elif policy.seccomp != DEFAULT_PROFILE and all(policy.seccomp != p for p in profiles):
        out.append(f"seccomp profile {policy.seccomp.name!r} instead of the default")
    if policy.compat_32bit and policy.seccomp is not None:
        out.append("compat_32bit=True (the i386 int 0x80 entry point is open); default: killed")
    for name in ("host_uid", "host_gid"):
        if getattr(policy, name) != getattr(default, name):
            out.append(f"{name}={getattr(policy, name)} (the sandbox runs as that host id); "
                       f"default: {getattr(default, name)}")
    for f in dataclasses.fields(Limits):
        mine, theirs = getattr(policy.limits, f.name), getattr(default.limits, f.name)
        if f.name == "require":
            missing = sorted(set(theirs) - set(mine))
            if missing:
                out.append(f"limits.require drops {missing}")
        elif theirs is not None and (mine is None or mine > theirs):
            out.append(f"limits.{f.name}={mine!r}; default: {theirs!r}")
    for name in ("stdout_limit_bytes", "stderr_limit_bytes"):
        if getattr(policy, name) > getattr(default, name):
            out.append(f"{name}={getattr(policy, name)}; default: {getattr(default, name)}")
    if timeout_s is None or timeout_s > DEFAULT_TIMEOUT_S:
        out.append(f"timeout_s={timeout_s!r}; default: {DEFAULT_TIMEOUT_S:g}")
    return out


def _as_bwrap_reads(argv: Sequence[str]) -> list[tuple[str, ...]]:
    """The options bwrap would read from ``argv`` written NUL-separated (without refusing a NUL,
    as :func:`lowlevel.sandbox.argv.encode_args` does), grouped with their arguments."""
    raw = b"\0".join(os.fsencode(a) if _is_encodable(a) else a.encode("utf-8", "surrogatepass") for a in argv)
    tokens = [os.fsdecode(t) for t in raw.split(b"\0")]
    out: list[tuple[str, ...]] = []
    i = 0
    while i < len(tokens):
        n = BWRAP_ARITY.get(tokens[i], 0)
        out.append(tuple(tokens[i:i + 1 + n]))
        i += 1 + n
    return out


def _is_encodable(text: str) -> bool:
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return True


def argv_loosening(policy: Policy, *, env: Mapping[str, str] | None) -> list[str]:
    """What a record's env would add to bwrap's argv beyond its policy; one line each.

    Builds the options bwrap would read (:func:`lowlevel.sandbox.argv.build_argv`, NUL-split the way
    bwrap splits ``--args``) with the record's env, and with no env, and lists every option of
    the first that the second lacks, ignoring only ``--chdir``, ``--setenv`` and ``--clearenv``
    themselves (they act inside the sandbox). The record's cwd never reaches bwrap's argv
    (bwrap gets ``--chdir /``; the guard changes directory: :func:`lowlevel.spec.validate.sandbox_cwd`) The command is
    not in ``--args`` (it follows ``--`` on the real argv, where a NUL cannot split it).
    :func:`validate_record` already refuses a NUL in these fields; this is the second line, in
    :func:`replay`'s looser-policy check, so whatever a crafted field smuggles shows up there.
    """
    from lowlevel.sandbox.plan import CHILD_FDS

    facts = host_facts()

    def options(env_: Mapping[str, str] | None) -> list[tuple[str, ...]]:
        argv = build_argv(policy, facts, workspace="/.lowlevel-replay-workspace", fds=CHILD_FDS,
                          extra_env=dict(env_) if env_ else None)
        return [t for t in _as_bwrap_reads(argv) if t[0] not in ("--chdir", "--setenv", "--clearenv")]

    mine = options(env)
    ref = list(options(None))
    out = []
    for opt in mine:
        if opt in ref:
            ref.remove(opt)
        else:
            out.append(f"bwrap would read the extra option {' '.join(display(t) for t in opt)!r} from the record's "
                       "cwd or env")
    return out


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
        policy = policy_from_canonical(rec.policy, profiles=profiles)
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as err:
        raise RecordError(f"refusing the record: its policy cannot be rebuilt: {err}") from err
    except LowlevelError as err:
        raise RecordError(f"refusing the record: its policy cannot be rebuilt: {err}") from err
    from lowlevel.image import check_record_rootfs
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


__all__ = ["HASH_BUDGET_BYTES", "HASH_BUDGET_S", "MAX_HASH_BYTES", "MAX_HOLE_BYTES", "MAX_RECORD_BYTES",
           "MAX_REPLAY_BYTES", "MAX_REPLAY_ENTRIES", "MAX_STORE_BYTES", "RECORD_NOT_WRITTEN", "HashBudget",
           "ParsedRecord", "RecordError", "ReplayReport", "SCHEMA_ID", "argv_loosening", "canonical_policy",
           "check_record_path", "compare", "execute_recorded", "hash_workspace", "load_record",
           "policy_from_canonical", "policy_loosening", "policy_sha256", "record_run", "replay",
           "seccomp_rules_sha256", "store_dir_for", "validate_record", "write_record"]
