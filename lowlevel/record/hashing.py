"""Hashing a workspace for a record, within a budget, and the record's input store.

Workspace content is untrusted: it is walked without following a symlink and each file is
opened relative to directory fds with ``O_NOFOLLOW`` (special files and multiply-linked files
refused). Each walk is bounded (:class:`HashBudget`: total bytes and seconds); files larger
than :data:`MAX_HASH_BYTES`, sparse files, and files past the budget are listed with
``sha256: null`` and a ``skipped`` reason. :class:`InputStore` copies the files a replay needs
into ``<record>.inputs/``, content-addressed. One concept: what a record says a workspace held.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from typing import Any

from lowlevel._dataclass import dataclass
from lowlevel.paths import write_private_atomically
from lowlevel.workspace import changes as _ws_changes
from lowlevel.workspace import files as _ws_files
from lowlevel.workspace import walk as _ws_walk
from lowlevel import workspace as _ws
from lowlevel.errors import WorkspaceError
from lowlevel.record.schema import RecordError

#: Files larger than this (bytes) are listed but not hashed or stored.
MAX_HASH_BYTES = 64 * 1024 * 1024
#: Total bytes copied into one record's input store; beyond it files are hashed, not stored.
MAX_STORE_BYTES = 512 * 1024 * 1024

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
        parts = _ws_files._split_rel(rel)
    except WorkspaceError as err:
        return None, 0, None, str(err)
    try:
        dfd = _ws_files._open_parent(root, parts)
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
class InputStore:
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
        try:
            os.makedirs(self.dir, 0o700, exist_ok=True)
            if not os.path.exists(path):
                write_private_atomically(path, data, f"{path}.tmp{os.getpid()}", exclusive=False)
                self.used += len(data)
        except OSError as err:
            raise RecordError(f"cannot write the input store {self.dir}: {err.strerror or err}") from err
        return True


def hash_workspace(root: str, store: InputStore | None = None, max_bytes: int = MAX_HASH_BYTES,
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
    walked, _ = _ws_walk._walk(root)
    complete = len(walked) < _ws.MAX_SNAPSHOT_ENTRIES
    out: list[dict[str, Any]] = []
    for rel, st in sorted(walked, key=lambda e: e[0]):
        kind = _ws_changes._kind(st.st_mode)
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


__all__ = ["HASH_BUDGET_BYTES", "HASH_BUDGET_S", "MAX_HASH_BYTES", "MAX_HOLE_BYTES", "MAX_STORE_BYTES", "HashBudget",
           "InputStore", "hash_workspace"]
