"""Host facts cached on disk, so a fresh process (the CLI, once per command) skips the probes.

What is cached, and what each entry is keyed by (an entry is used only when every key field
equals the live value; otherwise it is probed again and rewritten):

- ``bwrap``: :func:`lowlevel.host.probe.bwrap_info` (``bwrap --version`` and ``--help``: two
  processes, ~3-7 ms), keyed by bwrap's resolved path, its ``st_mtime_ns``, size, inode and
  mode (a reinstalled or upgraded bwrap is another file);
- ``cow``: :func:`lowlevel.workspace.cow.cow_support` (a trial run of the anchor with an overlay on the
  workspace's filesystem, ~5-10 ms), keyed by that filesystem's ``st_dev``, the caller's euid
  and the anchor executable (path, mtime, size). A probe that failed for a reason of the
  caller's (EMFILE, ENOMEM, EINTR, a signal: ``CowSupport.transient``) is never stored; a "no"
  is stored with the workspace path it was probed on, and ``lowlevel doctor`` probes it again;
- ``bpf``: :func:`lowlevel.host.seccomp_filter.compile_bpf`'s output (libseccomp through CFFI: ~1.5 ms,
  plus ~3 ms to load the extension), keyed by the profile's rules, the compat flag, the machine,
  lowlevel's version, and the extension and libseccomp files (path, mtime, size).

Every entry is also keyed by the kernel (``uname`` release and version), the boot
(``/proc/sys/kernel/random/boot_id``), the caller's euid and lowlevel's version, so a reboot or
a kernel or lowlevel upgrade invalidates everything.

Stale in one documented way: a host change within one boot that touches none of the keys,
e.g. ``sysctl user.max_user_namespaces=0`` (or an AppArmor userns restriction) after a probe
said the overlay works. Runs then fail at setup with the kernel's own error, as they would
without the cache, and the failure drops the ``cow`` entries (:func:`forget`); ``lowlevel
doctor`` probes afresh and says what changed. ``LOWLEVEL_NO_CACHE=1`` turns the cache off.

Where: root ``/run/lowlevel/cache`` (tmpfs: gone at reboot); others ``$XDG_RUNTIME_DIR/lowlevel``
when that is set and ours, else ``~/.cache/lowlevel``; ``LOWLEVEL_CACHE_DIR`` overrides. The
directory must be ours and mode 0700, each file ours and not writable by others (a cached
seccomp filter is a security decision: nobody but the caller's own uid may plant one); a file
failing the checks is ignored. Writes are atomic (a temporary file renamed into place), and
any I/O error means "no cache": the probe runs, as before.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib

from lowlevel.paths import cache_dir, cache_enabled as enabled, read_cache_file, write_cache_file

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: Cache file format version: bump when the meaning of an entry changes.
FORMAT = 1
#: Entries kept per file (the most recently written).
MAX_ENTRIES = 16

_lock = threading.Lock()
_docs: dict[str, dict[str, Any]] = {}
_base_key: dict[str, Any] | None = None


def base_key() -> dict[str, Any]:
    """What every entry is keyed by: kernel, boot, euid, lowlevel version, cache format."""
    global _base_key
    if _base_key is None:
        u = os.uname()
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        from lowlevel.version import __version__ as version
        _base_key = {"format": FORMAT, "lowlevel": version, "kernel": f"{u.release} {u.version}",
                     "machine": u.machine, "boot_id": boot, "euid": os.geteuid()}
    return _base_key


def file_key(path: str) -> list[Any] | None:
    """``[path, st_mtime_ns, st_size, st_ino, st_mode]`` of a file (following symlinks), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [path, st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode]


def entry_name(text: str) -> str:
    """A short entry name for a long key (a seccomp profile): CRC-32 of ``text``. Not a
    security measure: the entry's key is compared in full, a collision only overwrites."""
    return f"{zlib.crc32(text.encode('utf-8', 'surrogatepass')):08x}"


def _load(name: str) -> dict[str, Any]:
    doc = _docs.get(name)
    if doc is not None:
        return doc
    doc = {}
    data = read_cache_file(f"{name}.json", (4 << 20) - 1)
    if data is not None:
        try:
            got = json.loads(data)
            if isinstance(got, dict) and got.get("base") == base_key() and isinstance(got.get("entries"), dict):
                doc = got["entries"]
        except (ValueError, UnicodeDecodeError):
            doc = {}
    _docs[name] = doc
    return doc


def get(name: str, entry: str, key: Any) -> Any:
    """The cached value of ``entry`` in file ``name`` if its key equals ``key``, else None.

    ``key`` must be JSON data (lists, not tuples: it is compared after a JSON round trip).
    """
    if not enabled():
        return None
    with _lock:
        item = _load(name).get(entry)
    if isinstance(item, dict) and item.get("key") == key:
        return item.get("value")
    return None


def put(name: str, entry: str, key: Any, value: Any) -> None:
    """Store ``value`` (JSON data) under ``entry`` of file ``name``; errors are ignored."""
    if not enabled():
        return
    with _lock:
        doc = _load(name)
        doc[entry] = {"key": key, "value": value, "t": time.time()}
        if len(doc) > MAX_ENTRIES:  # the oldest go (tests and odd profiles must not grow it)
            for old in sorted(doc, key=lambda e: doc[e].get("t", 0) if isinstance(doc[e], dict) else 0)[
                    :len(doc) - MAX_ENTRIES]:
                del doc[old]
        _write(name, doc)


def entries(name: str) -> list[tuple[str, Any]]:
    """``(entry, {"key": ..., "value": ..., "t": ...})`` for every entry of file ``name`` (doctor)."""
    if not enabled():
        return []
    with _lock:
        return sorted(_load(name).items())


def drop(name: str, entry: str) -> None:
    """Remove one entry of file ``name`` (a verdict about to be probed again); errors are ignored."""
    if not enabled():
        return
    with _lock:
        doc = _load(name)
        if doc.pop(entry, None) is not None:
            _write(name, doc)


def forget(name: str) -> None:
    """Drop every entry of file ``name`` (after a setup failure the cache may have caused)."""
    with _lock:
        _docs[name] = {}
        d = cache_dir(create=False)
        if d is not None:
            try:
                os.unlink(os.path.join(d, f"{name}.json"))
            except OSError:
                pass


def _write(name: str, entries: dict[str, Any]) -> None:
    write_cache_file(f"{name}.json", json.dumps({"base": base_key(), "entries": entries}, sort_keys=True).encode())


def clear_memory() -> None:
    """Forget what this process loaded (tests; the files stay)."""
    global _base_key
    with _lock:
        _docs.clear()
        _base_key = None


__all__ = ["FORMAT", "MAX_ENTRIES", "base_key", "cache_dir", "clear_memory", "drop", "enabled", "entries",
           "entry_name", "file_key", "forget", "get", "put"]
