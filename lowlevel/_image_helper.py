"""Read hostile image archives and layers; runs *inside* a sandbox, never in the caller.

:mod:`lowlevel.image` runs this file with the host's ``python3`` in a lowlevel sandbox (the
caller's uid, or a leased per-run uid for root callers; no network; memory bounded), because archives
and layers are hostile input and Python's tarfile reads a PAX header wholly into memory.
Standard library only; it imports nothing from lowlevel. Request on stdin (JSON, ``"mode"``
picks the job), answer on stdout (JSON ``{"ok": true, ...}`` or ``{"ok": false, "error": MSG}``).

``inspect``: ``{"path"}``: what the archive or directory at ``path`` is: ``{"kind":
"oci"|"oci-archive"|"docker-archive", "gzip": bool, "index": <index.json>|null, "manifest":
<docker manifest.json>|null}``.

``gunzip``: ``{"path", "dest", "max_bytes"}``: decompress a gzip file (a compressed ``docker
save`` archive, which skopeo cannot read) to ``dest``, at most ``max_bytes``.

``scan``: ``{"layout", "layers": [{"digest", "media_type", "size", "diff_id"}], "max_bytes",
"max_entries", "progress"}``: check every layer before anything is unpacked; answer
``{"layers": [{"entries", "bytes", "devices", "setid", "fifos", "caps"}], "entries", "bytes",
"devices": [PATH, ...]}``. While it reads, it rewrites the file ``progress`` with ``"<layer
index> <compressed bytes read>"``. RefusedError (the whole image): an absolute member name or one
with a ``..`` component, a hard link whose target is absolute or has ``..``, a member type
outside regular/hard link/symlink/directory/character or block device/fifo, more than
``max_entries`` members or ``max_bytes`` of file content in all layers, a layer whose
uncompressed SHA-256 differs from the config's ``diff_id``, zstd compression, a truncated or
corrupt stream. Reported for the caller to neutralise: device nodes (by the path they end at),
setuid/setgid files, fifos, ``security.capability`` extended attributes.

Source: OCI image-spec layer.md (changesets, whiteouts, diff_ids) and image-layout.md;
tarfile docs ("never extract archives from untrusted sources without prior inspection").
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import time
import zlib
from typing import Any, BinaryIO

#: Longest member name or link target accepted, bytes (Linux PATH_MAX).
MAX_NAME = 4096
#: Device paths reported at most; beyond, the image is refused.
MAX_DEVICES = 10_000
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"
_KNOWN_TYPES = {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE, tarfile.GNUTYPE_SPARSE, tarfile.LNKTYPE,
                tarfile.SYMTYPE, tarfile.DIRTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE}


class RefusedError(Exception):
    """The image breaks a rule; the message says which member and why."""


class _Meter(io.RawIOBase):
    """Counts (and optionally hashes) the bytes read through it; refuses past ``cap``.

    With ``trailer``, the end of the stream is followed by zeros up to the next 512-byte block
    and two more blocks (neither counted nor hashed): Go's archive/tar, which container tools
    use to read layers, accepts a layer without its end-of-archive blocks or its last padding
    (``umoci insert`` writes such layers), and Python's tarfile does not.
    """

    def __init__(self, raw: BinaryIO, cap: int | None, what: str, hasher: Any = None,
                 trailer: bool = False) -> None:
        self.raw = raw
        self.cap = cap
        self.what = what
        self.hasher = hasher
        self.count = 0
        self.trailer = trailer
        self.padding: int | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.padding is not None:
            n = min(len(b), self.padding)
            b[:n] = b"\0" * n
            self.padding -= n
            return n
        data = self.raw.read(len(b))
        n = len(data)
        if not n and self.trailer:
            self.padding = (-self.count) % 512 + 1024
            return self.readinto(b)
        b[:n] = data
        self.count += n
        if self.hasher is not None:
            self.hasher.update(data)
        if self.cap is not None and self.count > self.cap:
            raise RefusedError(f"{self.what} expands beyond {self.cap} bytes (a decompression bomb, or raise "
                          "the import's byte bound)")
        return n


def _clean(name: str, what: str) -> str:
    """A member name as a relative path, or RefusedError."""
    if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME:
        raise RefusedError(f"{what} has a name longer than {MAX_NAME} bytes")
    if "\0" in name:
        raise RefusedError(f"{what} has a NUL byte in its name")
    if name.startswith("/"):
        raise RefusedError(f"{what} {name!r} is an absolute path: a layer holds relative paths only")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise RefusedError(f"{what} {name!r} has a '..' component (path traversal)")
    return "/".join(parts)


class _Totals:
    """What the layers scanned so far hold, against the import's bounds."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.entries = 0
        self.bytes = 0
        self.devices: set[str] = set()


def _check_member(m: tarfile.TarInfo, what: str, totals: _Totals, stats: dict[str, int]) -> None:
    """Refuse a member a layer may not hold (or one over a bound); count it in ``stats``."""
    totals.entries += 1
    stats["entries"] += 1
    if totals.entries > totals.max_entries:
        raise RefusedError(f"the image has more than {totals.max_entries} entries in its layers "
                           "(raise the import's entry bound if you trust it)")
    name = _clean(m.name, f"{what}: member")
    if m.type not in _KNOWN_TYPES:
        raise RefusedError(f"{what}: member {m.name!r} has tar type {m.type!r}, which a layer may not hold")
    if m.islnk():
        link = _clean(m.linkname, f"{what}: hard link {m.name!r} -> target")
        if not link:
            raise RefusedError(f"{what}: hard link {m.name!r} points at the root")
    if m.isreg():
        totals.bytes += m.size
        stats["bytes"] += m.size
        if totals.bytes > totals.max_bytes:
            raise RefusedError(f"the image's files add up to more than {totals.max_bytes} bytes "
                               f"({what}: {m.name!r} is {m.size} bytes); raise the import's "
                               "byte bound if you trust it")
        if m.mode & 0o6000:
            stats["setid"] += 1
    if m.ischr() or m.isblk():
        stats["devices"] += 1
        totals.devices.add(name)
        if len(totals.devices) > MAX_DEVICES:
            raise RefusedError(f"the image has more than {MAX_DEVICES} device nodes")
    elif name in totals.devices:
        totals.devices.discard(name)
    base = name.rsplit("/", 1)[-1]
    if base.startswith(".wh.") and base != ".wh..wh..opq":
        if base[4:] in ("", ".", ".."):  # a whiteout of its own directory or of the parent: no entry to delete
            raise RefusedError(f"{what}: member {m.name!r} is a whiteout of {base[4:] or 'nothing'!r}, which no "
                               "layer may hold (OCI image-spec layer.md: a whiteout names one entry of its directory)")
        gone = name[: len(name) - len(base)] + base[4:]
        totals.devices = {d for d in totals.devices if d != gone and not d.startswith(gone + "/")}
    if m.isfifo():
        stats["fifos"] += 1
    if any(k.startswith("SCHILY.xattr.security.capability") for k in m.pax_headers):
        stats["caps"] += 1


def _scan_layer(spec: dict[str, Any], index: int, layer: dict[str, Any], totals: _Totals) -> dict[str, int]:
    """Read one layer blob to its end (digest and ``diff_id`` checked); return its counts."""
    progress_file = spec.get("progress")
    digest = str(layer["digest"])
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise RefusedError(f"layer {index + 1} has a malformed digest {digest!r}")
    what = f"layer {index + 1} ({digest[:19]})"
    path = os.path.join(spec["layout"], "blobs", "sha256", hexd)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    last_progress = 0.0
    with os.fdopen(fd, "rb") as raw:
        head = raw.read(4)
        raw.seek(0)
        if head.startswith(_ZSTD_MAGIC) or str(layer.get("media_type", "")).endswith("zstd"):
            raise RefusedError(f"{what} is zstd-compressed, which this unpacker (umoci 0.4) cannot read: convert "
                               "the image first with `skopeo copy --dest-compress-format gzip oci-archive:IN "
                               "oci-archive:OUT`")
        compressed = _Meter(raw, None, what)
        stream: Any = compressed
        if head.startswith(_GZIP_MAGIC):
            stream = gzip.GzipFile(fileobj=compressed, mode="rb")
        diff = hashlib.sha256()
        # Headers and padding take at most 3 blocks per entry on top of the content.
        cap = totals.max_bytes - totals.bytes + (totals.max_entries - totals.entries + 1) * 3 * 512 + (1 << 20)
        plain = _Meter(stream, cap, what, diff, trailer=True)
        stats = {"entries": 0, "bytes": 0, "devices": 0, "setid": 0, "fifos": 0, "caps": 0}
        try:
            with tarfile.open(fileobj=plain, mode="r|") as tar:
                for m in tar:
                    _check_member(m, what, totals, stats)
                    now = time.monotonic()
                    if progress_file and now - last_progress > 0.2:
                        last_progress = now
                        _progress(progress_file, index, compressed.count)
                while plain.read(1 << 20):  # the rest (end-of-archive blocks), for the diff_id
                    pass
        except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
            raise RefusedError(f"{what} is truncated or corrupt: {err}") from err
        want = str(layer.get("diff_id") or "")
        if want and want != "sha256:" + diff.hexdigest():
            raise RefusedError(f"{what}: its uncompressed content hashes to sha256:{diff.hexdigest()}, not to "
                               f"the config's diff_id {want}")
        if progress_file:
            _progress(progress_file, index, compressed.count)
    return stats


def scan(spec: dict[str, Any]) -> dict[str, Any]:
    """Scan every layer of ``spec`` (see the module docstring); return the summary."""
    totals = _Totals(int(spec["max_bytes"]), int(spec["max_entries"]))
    out_layers = [_scan_layer(spec, index, layer, totals) for index, layer in enumerate(spec["layers"])]
    return {"ok": True, "layers": out_layers, "entries": totals.entries, "bytes": totals.bytes,
            "devices": sorted(totals.devices)}


def _progress(path: str, index: int, done: int) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(f"{index} {done}\n")
        os.replace(tmp, path)
    except OSError:
        pass


#: Members of an outer archive read at most while inspecting it.
MAX_OUTER_MEMBERS = 100_000
#: Largest index.json / manifest.json read from an outer archive, bytes.
MAX_JSON = 1 << 20


def _read_json_member(tar: tarfile.TarFile, m: tarfile.TarInfo, what: str) -> Any:
    if not m.isreg() or m.size > MAX_JSON:
        raise RefusedError(f"the archive's {what} is not a regular file of at most {MAX_JSON} bytes")
    f = tar.extractfile(m)
    if f is None:
        raise RefusedError(f"cannot read the archive's {what}")
    try:
        return json.loads(f.read(MAX_JSON + 1))
    except ValueError as err:
        raise RefusedError(f"the archive's {what} is not JSON: {err}") from err


def inspect(spec: dict[str, Any]) -> dict[str, Any]:
    """Say what the archive or directory at ``spec["path"]`` is (see the module docstring)."""
    path = spec["path"]
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "oci-layout")):
            raise RefusedError("the directory is not an OCI image layout (no oci-layout file)")
        with open(os.path.join(path, "index.json"), "rb") as f:
            data = f.read(MAX_JSON + 1)
        if len(data) > MAX_JSON:
            raise RefusedError(f"its index.json is larger than {MAX_JSON} bytes")
        return {"ok": True, "kind": "oci", "gzip": False, "index": json.loads(data), "manifest": None}
    with open(path, "rb") as raw:
        head = raw.read(4)
    if head.startswith(_ZSTD_MAGIC):
        raise RefusedError("the archive is zstd-compressed: decompress it first (zstd -d)")
    gz = head.startswith(_GZIP_MAGIC)
    index = manifest = None
    layout = False
    count = 0
    try:
        with tarfile.open(path, mode="r|gz" if gz else "r|") as tar:
            for m in tar:
                count += 1
                if count > MAX_OUTER_MEMBERS:
                    raise RefusedError(f"the archive has more than {MAX_OUTER_MEMBERS} members: not an image archive")
                name = "/".join(p for p in m.name.split("/") if p not in ("", "."))
                if name == "oci-layout":
                    layout = True
                elif name == "index.json":
                    index = _read_json_member(tar, m, "index.json")
                elif name == "manifest.json":
                    manifest = _read_json_member(tar, m, "manifest.json")
    except (tarfile.TarError, EOFError, zlib.error) as err:
        raise RefusedError(f"it is not a readable tar archive (truncated or corrupt?): {err}") from err
    if layout and index is not None:
        return {"ok": True, "kind": "oci-archive", "gzip": gz, "index": index, "manifest": manifest}
    if manifest is not None:
        return {"ok": True, "kind": "docker-archive", "gzip": gz, "index": index, "manifest": manifest}
    raise RefusedError("it is neither an OCI archive (oci-layout and index.json) nor a `docker save` archive "
                  "(manifest.json)")


def gunzip(spec: dict[str, Any]) -> dict[str, Any]:
    """Decompress ``spec["path"]`` to ``spec["dest"]``, refusing past ``spec["max_bytes"]``."""
    cap = int(spec["max_bytes"])
    done = 0
    try:
        with gzip.open(spec["path"], "rb") as src, open(spec["dest"], "xb") as dst:
            while True:
                chunk = src.read(1 << 20)
                if not chunk:
                    break
                done += len(chunk)
                if done > cap:
                    raise RefusedError(f"the archive decompresses to more than {cap} bytes")
                dst.write(chunk)
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise RefusedError(f"the gzip stream is truncated or corrupt: {err}") from err
    return {"ok": True, "bytes": done}


def main() -> int:
    spec = json.loads(sys.stdin.read())
    jobs = {"inspect": inspect, "gunzip": gunzip, "scan": scan}
    try:
        doc = jobs[spec["mode"]](spec)
    except RefusedError as err:
        doc = {"ok": False, "error": str(err)}
    except MemoryError:
        doc = {"ok": False, "error": "reading it needed more memory than the import allows (a hostile archive?)"}
    except RecursionError:  # json's parser recurses per nesting level: "[" * 100000 is valid JSON
        doc = {"ok": False, "error": "its JSON is nested deeper than the import reads (a hostile archive?)"}
    except (OSError, ValueError) as err:
        doc = {"ok": False, "error": f"cannot read it: {err}"}
    sys.stdout.write(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
