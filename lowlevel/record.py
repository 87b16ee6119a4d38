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

Workspace content is untrusted: it is walked with :func:`lowlevel.workspace.list_files` and
read with :func:`lowlevel.workspace.read_file` (no symlink followed, special files and
multiply-linked files refused), files larger than :data:`MAX_HASH_BYTES` are listed with
``sha256: null`` and a ``skipped`` reason.
"""

from __future__ import annotations

import dataclasses
import datetime
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

from . import workspace as _ws
from .errors import LowlevelError, WorkspaceError
from .launcher import DEFAULT_TIMEOUT_S, host_facts
from .launcher import run as _run
from .limits import Limits
from .policy import WORKSPACE_DEST, Bind, Policy
from .result import Result

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
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


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
        else:
            out[f.name] = _canon(value)
    return out


def policy_sha256(policy: Policy) -> str:
    """SHA-256 (hex) of :func:`canonical_policy`'s compact, key-sorted UTF-8 JSON."""
    return hashlib.sha256(_dumps(canonical_policy(policy))).hexdigest()


def _known_profiles(extra: Sequence[Any]) -> dict[str, Any]:
    from . import seccomp as _seccomp
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


# --- host facts ---------------------------------------------------------------------------

def _versions(bwrap_version: tuple[int, ...] | None) -> dict[str, Any]:
    from . import __version__
    libseccomp = None
    try:
        from . import seccomp as _seccomp
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
    from . import seccomp as _seccomp
    fn = getattr(_seccomp, "profile_sha256", None)
    bpf = _seccomp.compile_bpf(policy.seccomp)
    return {"profile": policy.seccomp.name, "rules_sha256": seccomp_rules_sha256(policy.seccomp),
            "bpf_sha256": hashlib.sha256(bpf).hexdigest(), "bpf_bytes": len(bpf),
            "profile_sha256": fn(policy.seccomp) if fn is not None else None}


# --- workspace hashing --------------------------------------------------------------------

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


@dataclass
class _Store:
    """The input store of one record being written: ``dir`` (created lazily) and bytes used."""

    dir: str | None
    used: int = 0
    complete: bool = True

    def put(self, digest: str, data: bytes) -> bool:
        if self.dir is None:
            return False
        if self.used + len(data) > MAX_STORE_BYTES:
            self.complete = False
            return False
        os.makedirs(self.dir, 0o700, exist_ok=True)
        path = os.path.join(self.dir, digest)
        if not os.path.exists(path):
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            self.used += len(data)
        return True


def hash_workspace(root: str, store: _Store | None = None,
                   max_bytes: int = MAX_HASH_BYTES) -> tuple[list[dict[str, Any]], bool]:
    """List every entry of ``root`` with the SHA-256 of each regular file.

    Args:
        root: host path of a workspace (untrusted content).
        store: when given, regular files are also copied into it (the input store).
        max_bytes: files larger than this are listed with ``sha256: None`` and ``skipped``.
    Returns:
        ``(entries, complete)``: entries sorted by path, each ``{"path", "kind", "size",
        "mode", "sha256", "link", "stored", "skipped"}``; ``complete`` is False when the walk
        stopped at :data:`lowlevel.workspace.MAX_SNAPSHOT_ENTRIES`.
    Raises:
        WorkspaceError: root is missing or unreadable.
    """
    entries = _ws.list_files(root)
    complete = len(entries) < _ws.MAX_SNAPSHOT_ENTRIES
    out: list[dict[str, Any]] = []
    for e in entries:
        doc: dict[str, Any] = {"path": e.path, "kind": e.kind, "size": e.size, "mode": e.mode,
                               "sha256": None, "link": None, "stored": False, "skipped": None}
        if e.kind == "file":
            if e.size > max_bytes:
                doc["skipped"] = f"larger than {max_bytes} bytes"
            else:
                try:
                    data = _ws.read_file(root, e.path, max_bytes)
                except WorkspaceError as err:
                    doc["skipped"] = str(err)
                else:
                    doc["sha256"] = hashlib.sha256(data).hexdigest()
                    doc["size"] = len(data)
                    if store is not None:
                        doc["stored"] = store.put(doc["sha256"], data)
        elif e.kind == "symlink":
            doc["link"] = _readlink(root, e.path)
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
                     allow_sensitive_workspace: bool = False) -> tuple[Result, dict[str, Any]]:
    """Run ``command`` like :func:`lowlevel.run` and build its record (not written).

    Same arguments as :func:`lowlevel.run`, plus ``store_dir``: where to copy the inputs for
    replay (None: hash only; the record then cannot be replayed).

    Returns:
        ``(result, record)``; the record is a JSON-ready dict.
    Raises:
        Whatever :func:`lowlevel.run` raises; no record is made for a run that never started.
    """
    policy = policy or Policy()
    if cwd is None:
        cwd = policy.workdir or WORKSPACE_DEST
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
        before, before_complete = hash_workspace(ws, store)
        stdin_doc = None
        if stdin is not None:
            digest = hashlib.sha256(stdin).hexdigest()
            stdin_doc = {"sha256": digest, "bytes": len(stdin), "stored": store.put(digest, bytes(stdin))}
        hash_before_s = time.monotonic() - t_hash
        environment = policy.environment(env)
        started_at = _now()
        result = _run(command, policy=policy, workspace=ws, timeout=timeout, stdin=stdin, env=env,
                      capture=capture, cwd=cwd, allow_sensitive_workspace=allow_sensitive_workspace)
    except BaseException:
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise
    finished_at = _now()
    after, after_complete = hash_workspace(ws)
    facts = host_facts()
    from .image import image_record
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
        "host": {"caller_uid": os.getuid(), "caller_is_root": facts.caller_is_root},
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
        "notes": list(result.notes),
        "rootfs": rootfs_doc,
    }
    return result, record


def write_record(path: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    """Write ``record`` as indented, key-sorted JSON to ``path`` (atomically: temp file + rename; mode 0600)."""
    path = os.path.abspath(os.fspath(path))
    tmp = f"{path}.tmp{os.getpid()}"
    # 0600: a record holds the environment inside the sandbox, which may carry tokens the
    # caller passed in on purpose.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def record_run(command: Sequence[str], *, record: str | os.PathLike[str], **kwargs: Any) -> Result:
    """Run like :func:`lowlevel.run` and write the run's record to ``record``.

    The inputs (every regular file in the workspace before the run, and stdin) are copied
    into ``<record>.inputs/`` for :func:`replay`. ``lowlevel.run(..., record=PATH)`` calls this.

    Args:
        command: as for :func:`lowlevel.run`.
        record: path of the JSON record to write (replaced if it exists).
        **kwargs: the other keyword arguments of :func:`lowlevel.run`.
    Returns:
        The run's :class:`Result`.
    Raises:
        Whatever :func:`lowlevel.run` raises; OSError when the record cannot be written.
    """
    path = os.fspath(record)
    result, doc = execute_recorded(command, store_dir=store_dir_for(path), **kwargs)
    write_record(path, doc)
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


def load_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a record and check its ``schema``.

    Raises:
        RecordError: not JSON, or not a ``lowlevel-run-record/1`` document.
    """
    try:
        with open(os.fspath(path), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        raise RecordError(f"cannot read record {os.fspath(path)!r}: {err}") from err
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_ID:
        raise RecordError(f"{os.fspath(path)!r} is not a {SCHEMA_ID} record")
    return doc


_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_KINDS = ("file", "dir", "symlink", "other")


def _check_entries(entries: Any) -> list[Mapping[str, Any]]:
    """Validate a record's ``workspace.before`` (untrusted input) before anything is created.

    Raises:
        RecordError: not a list of entries, or an entry with an absolute path, a ``..``
            component, an unknown kind, a mode outside 0..0o7777, a malformed SHA-256 or
            symlink text.
    """
    if not isinstance(entries, list):
        raise RecordError("the record's workspace.before is not a list")
    out = []
    for e in entries:
        if not isinstance(e, Mapping) or not isinstance(e.get("path"), str):
            raise RecordError(f"bad workspace entry in the record: {e!r}")
        try:
            _ws._split_rel(e["path"])
        except WorkspaceError as err:
            raise RecordError(f"refusing the record: {err}") from err
        if e.get("kind") not in _KINDS:
            raise RecordError(f"refusing the record: entry {e['path']!r} has kind {e.get('kind')!r}")
        mode = e.get("mode")
        if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
            raise RecordError(f"refusing the record: entry {e['path']!r} has mode {mode!r}")
        if e["kind"] == "file" and e.get("sha256") is not None and not _DIGEST.match(str(e["sha256"])):
            raise RecordError(f"refusing the record: entry {e['path']!r} has sha256 {e['sha256']!r}")
        if e["kind"] == "symlink" and e.get("link") is not None and (
                not isinstance(e["link"], str) or "\0" in e["link"]):
            raise RecordError(f"refusing the record: symlink {e['path']!r} has target {e['link']!r}")
        out.append(e)
    return out


def _restore_inputs(doc: Mapping[str, Any], store: str, root: str) -> bytes | None:
    """Recreate the workspace as it was before the recorded run; return stdin (or None).

    The record is untrusted: every path is checked (relative, no ``..``) before anything is
    made, and everything is made relative to directory fds without following a symlink
    (:func:`lowlevel.workspace.make_dir`, ``make_symlink``, ``write_file``, ``set_mode``), so
    nothing outside ``root`` is created or changed. Setuid/setgid bits are never recreated.
    """
    ws = doc["workspace"]
    if not ws["before_complete"]:
        raise RecordError("the record's workspace listing is incomplete (too many entries): cannot replay")
    entries = _check_entries(ws["before"])
    stdin = doc.get("stdin")
    if stdin is not None and (not isinstance(stdin, Mapping) or not _DIGEST.match(str(stdin.get("sha256")))):
        raise RecordError(f"refusing the record: bad stdin entry {stdin!r}")

    def blob(digest: str, what: str) -> bytes:
        try:
            fd = os.open(os.path.join(store, digest), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise RecordError(f"input {what} in the store {store} is not a regular file")
                data = f.read(MAX_HASH_BYTES + 1)
        except OSError as err:
            raise RecordError(f"input {what} (sha256 {digest}) is missing from the store {store}: {err}") from err
        if hashlib.sha256(data).hexdigest() != digest:
            raise RecordError(f"input {what} in the store {store} does not match its sha256")
        return data

    try:
        for e in entries:
            if e["kind"] == "dir":
                _ws.make_dir(root, e["path"], 0o755)
        for e in entries:
            if e["kind"] == "file":
                if e["sha256"] is None:
                    raise RecordError(f"input {e['path']!r} was not hashed ({e['skipped']}): cannot replay")
                _ws.write_file(root, e["path"], blob(e["sha256"], repr(e["path"])))
                _ws.set_mode(root, e["path"], e["mode"] & ~_ws.SETID_BITS)
            elif e["kind"] == "symlink" and e["link"] is not None:
                _ws.make_symlink(root, e["path"], e["link"])
        for e in reversed(entries):
            if e["kind"] == "dir":
                _ws.set_mode(root, e["path"], e["mode"] & ~_ws.SETID_BITS)
    except WorkspaceError as err:
        raise RecordError(f"cannot rebuild the record's workspace: {err}") from err
    return blob(stdin["sha256"], "stdin") if stdin else None


def _check_image_present(doc: Mapping[str, Any]) -> None:
    """Refuse a record whose image is not in the store, saying how to get it back."""
    image = (doc.get("rootfs") or {}).get("image") if isinstance(doc.get("rootfs"), Mapping) else None
    if not isinstance(image, Mapping):
        return
    from .image import ImageStore
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
    network, no seccomp filter or a profile in log mode (denials only logged) or one that is
    neither the default nor among ``profiles``, other host ids, a limit above its default or
    removed, larger capture caps, and a timeout above :data:`DEFAULT_TIMEOUT_S` or none.
    Environment, hostname, ids inside and deterministic mode are not looser.
    """
    from .seccomp import DEFAULT_PROFILE

    default = Policy()
    out: list[str] = []
    for b in policy.binds:
        flags = ["writable" if b.writable else "read-only"] + (["allow_sensitive"] if b.allow_sensitive else [])
        out.append(f"bind {b.source} -> {b.dest} ({', '.join(flags)}); default: no binds")
    if policy.network:
        out.append("network=True (the host network); default: no network")
    if policy.rootfs is not None and policy.image is None:
        out.append(f"rootfs {policy.rootfs} (a host directory shown to the sandbox); default: the host's /usr")
    if policy.seccomp is None:
        out.append("seccomp=None (no syscall filter); default: the default profile")
    elif policy.seccomp.log:
        out.append(f"seccomp profile {policy.seccomp.name!r} in log mode (denied syscalls are allowed and "
                   "logged); default: the default profile")
    elif policy.seccomp != DEFAULT_PROFILE and all(policy.seccomp != p for p in profiles):
        out.append(f"seccomp profile {policy.seccomp.name!r} instead of the default")
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


def _entry_key(e: Mapping[str, Any]) -> tuple[Any, ...]:
    return (e["kind"], e["mode"], e["sha256"] if e["kind"] == "file" else None, e["link"])


def compare(original: Mapping[str, Any], replayed: Mapping[str, Any]) -> list[str]:
    """Differences between two records' outcomes (exit, killed_by, output, workspace after)."""
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
    before = {e["path"]: e for e in original["workspace"]["after"]}
    after = {e["path"]: e for e in replayed["workspace"]["after"]}
    for p in sorted(set(before) | set(after)):
        if p not in after:
            diffs.append(f"workspace: {p} missing after replay")
        elif p not in before:
            diffs.append(f"workspace: {p} appeared only in the replay")
        elif _entry_key(before[p]) != _entry_key(after[p]):
            a, b = before[p], after[p]
            what = [k for k in ("kind", "mode", "sha256", "link") if a[k] != b[k]]
            diffs.append(f"workspace: {p} differs ({', '.join(what)})")
    return diffs


def replay(path: str | os.PathLike[str], *, workspace_base: str | None = None,
           profiles: Sequence[Any] = (), keep_workspace: bool = False, trust_policy: bool = False) -> ReplayReport:
    """Rerun a recorded run with the same policy, command, environment and inputs.

    The workspace is rebuilt from the record's input store in a fresh directory; the run
    uses the recorded Policy (checked against ``policy_sha256``), command, cwd, per-run env,
    stdin and timeout, and always captures output.

    Args:
        path: the record file; its store ``<path>.inputs/`` must sit next to it.
        workspace_base: parent of the fresh workspace (default as for :func:`lowlevel.run`).
        profiles: SeccompProfiles other than the default that the record may name.
        keep_workspace: keep the replay's workspace (its path is ``report.result.workspace``).
        trust_policy: run even when the record's policy is looser than ``Policy()`` (see
            :func:`policy_loosening`: binds, network, seccomp off or in log mode, other host
            ids, higher limits). A record is untrusted input: without this, such a record is
            refused and the message lists each difference. CLI: ``--trust-record-policy``.
    Returns:
        A :class:`ReplayReport`.
    Raises:
        RecordError: bad record (a workspace path that is absolute or has ``..``...), missing
            inputs, a policy that does not hash the same here, or a looser policy without
            ``trust_policy``.
        Whatever :func:`lowlevel.run` raises.
    """
    doc = load_record(path)
    _check_image_present(doc)
    try:
        policy = policy_from_canonical(doc["policy"], profiles=profiles)
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise RecordError(f"refusing the record: its policy cannot be rebuilt: {err}") from err
    from .image import check_record_rootfs
    try:
        check_record_rootfs(doc.get("rootfs"), policy)
    except LowlevelError as err:
        raise RecordError(f"refusing to replay: {err}") from err
    if policy_sha256(policy) != doc["policy_sha256"]:
        raise RecordError("the rebuilt policy does not hash to the recorded policy_sha256 "
                          "(a lowlevel version with different Policy fields?)")
    timeout_s = doc["timeout_s"]
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool)):
        raise RecordError(f"refusing the record: timeout_s is {timeout_s!r}")
    if not trust_policy:
        loose = policy_loosening(policy, timeout_s, profiles=profiles)
        if loose:
            raise RecordError("refusing to replay: the record's policy is looser than the default:\n  "
                              + "\n  ".join(loose) + "\nA record is untrusted input. If you trust it, pass "
                              "trust_policy=True (CLI: --trust-record-policy)")
    store_name = doc["inputs"]["store"]
    if not store_name:
        raise RecordError("the record has no input store: it was written without inputs and cannot be replayed")
    if not isinstance(store_name, str) or "/" in store_name or store_name in (".", "..") or "\0" in store_name:
        raise RecordError(f"refusing the record: its input store {store_name!r} is not a name next to the record")
    store = os.path.join(os.path.dirname(os.path.abspath(os.fspath(path))), store_name)
    root = _ws.create_workspace((), workspace_base)
    try:
        stdin = _restore_inputs(doc, store, root)
        result, new = execute_recorded(doc["command"], policy=policy, workspace=root, timeout=doc["timeout_s"],
                                       stdin=stdin, env=doc["env"] or None, cwd=doc["cwd"])
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    if not keep_workspace:
        shutil.rmtree(root, ignore_errors=True)
    diffs = compare(doc, new)
    if doc["policy"].get("deterministic") is False and diffs:
        diffs.append("note: the recorded run was not in deterministic mode (Policy(deterministic=True))")
    return ReplayReport(matched=not diffs, differences=diffs, result=result, record=new)


__all__ = ["MAX_HASH_BYTES", "MAX_STORE_BYTES", "RecordError", "ReplayReport", "SCHEMA_ID", "canonical_policy",
           "compare", "execute_recorded", "hash_workspace", "load_record", "policy_from_canonical",
           "policy_loosening", "policy_sha256", "record_run", "replay", "seccomp_rules_sha256", "store_dir_for",
           "write_record"]
