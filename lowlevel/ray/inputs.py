"""A call's files: inputs packed into a tar archive on the driver and unpacked into a fresh workspace on
the node (fd-relative, no symlink followed, no ``..``, no setuid bits), and the run's changed files read back.

Source: tar(5) (GNU format).
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


from lowlevel.workspace.files import open_dir_at
from lowlevel.errors import PolicyError, WorkspaceError
from lowlevel.paths import unreachable
from lowlevel.ray.results import DEFAULT_MAX_INPUT_BYTES, MAX_INPUT_ENTRIES


def _norm_name(name: str | bytes) -> str:
    text = os.fsdecode(name) if isinstance(name, bytes) else name
    if not isinstance(text, str) or not text or "\0" in text:
        raise PolicyError(f"input name {name!r} is invalid: use a non-empty relative path")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if text.startswith("/") or not parts or ".." in parts:
        raise PolicyError(f"input name {name!r} must be a relative path without '..'")
    return "/".join(parts)


def pack_inputs(inputs: Any, *, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> bytes:
    """Pack a call's inputs into one tar archive (bytes) for the object store.

    Args:
        inputs: one of
            - a mapping ``{relative path (str or bytes): content (bytes)}``; parent
              directories are implied; a ``str`` content is encoded as UTF-8;
            - a sequence of host paths on *this* machine (files or directories), each packed
              under its base name as ``lowlevel.run(inputs=...)`` copies them (symlinks kept
              as symlinks);
            - ``bytes``: an already packed tar archive (checked on the node).
        max_bytes: refuse archives larger than this (bytes).
    Returns:
        The archive (GNU tar; names are the raw bytes of the paths).
    Raises:
        PolicyError: a bad name, a content that is not bytes, or over ``max_bytes``.
        WorkspaceError: a host path is missing or unreadable.
    """
    if isinstance(inputs, (bytes, bytearray, memoryview)):
        data = bytes(inputs)
    else:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding="utf-8",
                          errors="surrogateescape") as tar:
            if isinstance(inputs, Mapping):
                total = 0
                for raw_name, content in inputs.items():
                    name = _norm_name(raw_name)
                    if isinstance(content, str):
                        content = content.encode()
                    if not isinstance(content, (bytes, bytearray, memoryview)):
                        raise PolicyError(f"input {name!r}: content must be bytes, got {type(content).__name__}")
                    content = bytes(content)
                    total += len(content)
                    if total > max_bytes:
                        raise PolicyError(f"inputs exceed max_input_bytes={max_bytes} (at {name!r}): ship "
                                          "less, or raise max_input_bytes")
                    info = tarfile.TarInfo(name)
                    info.size = len(content)
                    info.mode = 0o644
                    info.mtime = int(time.time())
                    tar.addfile(info, io.BytesIO(content))
            elif isinstance(inputs, (str, os.PathLike)):
                raise PolicyError("inputs must be a mapping, a sequence of paths or tar bytes; wrap a single "
                                  f"path in a list: [{os.fspath(inputs)!r}]")
            else:
                seen: set[str] = set()
                for item in inputs:
                    src = os.fspath(item)
                    name = os.path.basename(os.path.normpath(src))
                    missing = unreachable(src)
                    if missing is not None:
                        raise WorkspaceError(missing[0], f"input {src!r} {missing[1]}")
                    if not name or name in (".", ".."):
                        raise WorkspaceError(errno.EINVAL, f"input {src!r} has no usable base name")
                    if name in seen:
                        raise WorkspaceError(errno.EEXIST, f"input {src!r}: two inputs are named {name!r}")
                    seen.add(name)

                    def scrub(info: tarfile.TarInfo) -> tarfile.TarInfo:
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        info.mode &= 0o777
                        return info

                    try:
                        tar.add(src, arcname=name, recursive=True, filter=scrub)
                    except OSError as err:
                        raise WorkspaceError(err.errno or errno.EIO, f"cannot pack input {src!r}: {err}") from err
                    if buf.tell() > max_bytes:
                        raise PolicyError(f"inputs exceed max_input_bytes={max_bytes} (at {src!r}): ship less, "
                                          "or raise max_input_bytes")
        data = buf.getvalue()
    if len(data) > max_bytes:
        raise PolicyError(f"inputs archive is {len(data)} bytes > max_input_bytes={max_bytes}: ship less, "
                          "or raise max_input_bytes")
    return data


def unpack_inputs(data: bytes, root: str) -> list[str]:
    """Unpack a :func:`pack_inputs` archive into the (empty, caller-owned) directory ``root``.

    Only regular files, directories and symlinks; permission bits kept without
    setuid/setgid/sticky; mtimes kept; every path opened component by component with
    ``O_NOFOLLOW`` below ``root`` (a symlink in the archive never redirects a later entry);
    a duplicate name is an error (``O_EXCL``).

    Returns:
        The relative paths created, in archive order.
    Raises:
        WorkspaceError: a corrupt archive, an absolute or ``..`` name, a hard link, device,
            fifo or sparse member, a duplicate, more than :data:`MAX_INPUT_ENTRIES` entries,
            or a symlink in the way (EINVAL / ELOOP / EEXIST with the member named).
    """
    created: list[str] = []
    dir_times: list[tuple[list[str], int]] = []
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:", encoding="utf-8", errors="surrogateescape")
        except tarfile.TarError as err:
            raise WorkspaceError(errno.EINVAL, f"inputs are not a tar archive: {err}") from err
        with tar:
            for count, member in enumerate(_members(tar)):
                if count >= MAX_INPUT_ENTRIES:
                    raise WorkspaceError(errno.E2BIG, f"inputs hold more than {MAX_INPUT_ENTRIES} entries")
                try:
                    rel = _norm_name(member.name)
                except PolicyError as err:
                    raise WorkspaceError(errno.EINVAL, f"refusing input member {member.name!r}: {err}") from None
                try:
                    _unpack_member(tar, member, rootfd, rel, dir_times)
                except WorkspaceError:
                    raise
                except OSError as err:
                    why = "a symlink is in the way" if err.errno in (errno.ELOOP, errno.ENOTDIR) else err.strerror
                    raise WorkspaceError(err.errno or errno.EIO, f"cannot unpack input {rel!r}: {why}") from err
                created.append(rel)
        for parts, mtime in reversed(dir_times):
            dfd = open_dir_at(rootfd, parts, create=False)
            try:
                os.utime(dfd, (mtime, mtime))
            finally:
                os.close(dfd)
    finally:
        os.close(rootfd)
    return created


def _unpack_member(tar: tarfile.TarFile, member: tarfile.TarInfo, rootfd: int, rel: str,
                   dir_times: list[tuple[list[str], int]]) -> None:
    """Create one archive member ``rel`` below ``rootfd`` (see :func:`unpack_inputs`); a directory's
    mtime is set at the end (``dir_times``), after its entries.

    Raises:
        WorkspaceError: a sparse file, an empty symlink, a hard link, device or fifo.
        OSError: creating it failed (a symlink in the way: ELOOP/ENOTDIR; a duplicate: EEXIST).
    """
    parts = rel.split("/")
    mode = member.mode & 0o777
    if member.isdir():
        dfd = open_dir_at(rootfd, parts, create=True)
        try:
            os.chmod(dfd, mode | 0o700)
        finally:
            os.close(dfd)
        dir_times.append((parts, int(member.mtime)))
    elif member.isreg():
        if member.issparse():
            raise WorkspaceError(errno.EINVAL, f"refusing input member {rel!r}: sparse file")
        src = tar.extractfile(member)
        assert src is not None
        dfd = open_dir_at(rootfd, parts[:-1], create=True)
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, mode, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            with os.fdopen(fd, "wb", closefd=False) as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.fchmod(fd, mode)
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)
    elif member.issym():
        if not member.linkname or "\0" in member.linkname:
            raise WorkspaceError(errno.EINVAL, f"refusing input member {rel!r}: empty symlink")
        dfd = open_dir_at(rootfd, parts[:-1], create=True)
        try:
            os.symlink(member.linkname, parts[-1], dir_fd=dfd)
        finally:
            os.close(dfd)
    else:
        kind = "hard link" if member.islnk() else "device or fifo"
        raise WorkspaceError(errno.EINVAL, f"refusing input member {rel!r}: a {kind} "
                             "(only files, directories and symlinks travel)")


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    try:
        while True:
            member = tar.next()
            if member is None:
                return
            yield member
    except tarfile.TarError as err:
        raise WorkspaceError(errno.EINVAL, f"inputs are not a valid tar archive: {err}") from err


def collect_outputs(root: str, paths: Iterable[str], max_bytes: int) -> tuple[dict[str, bytes], int, list[str]]:
    """Read the regular files among ``paths`` (workspace-relative) with a total budget.

    The workspace is untrusted: every component is opened with ``O_NOFOLLOW``; only
    regular files with one link are read; a file is kept whole or not at all.

    Returns:
        ``(files, dropped_bytes, omitted)``: contents by path; bytes of regular files left
        out by the budget; every path not carried (budget, kind, vanished), sorted.
    """
    files: dict[str, bytes] = {}
    omitted: list[str] = []
    dropped = 0
    budget = max_bytes
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for rel in sorted(set(paths)):
            parts = rel.split("/")
            try:
                dfd = open_dir_at(rootfd, parts[:-1], create=False)
            except OSError:
                omitted.append(rel)
                continue
            try:
                try:
                    st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    omitted.append(rel)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    continue  # a directory is implied by the files under it
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    omitted.append(rel)
                    continue
                if st.st_size > budget:
                    omitted.append(rel)
                    dropped += st.st_size
                    continue
                try:
                    fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                except OSError:
                    omitted.append(rel)
                    continue
                with os.fdopen(fd, "rb") as f:
                    fst = os.fstat(f.fileno())
                    if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(fst.st_mode):
                        omitted.append(rel)
                        continue
                    content = f.read(budget + 1)
                if len(content) > budget:
                    omitted.append(rel)
                    dropped += len(content)
                    continue
                files[rel] = content
                budget -= len(content)
            finally:
                os.close(dfd)
    finally:
        os.close(rootfd)
    return files, dropped, sorted(omitted)
