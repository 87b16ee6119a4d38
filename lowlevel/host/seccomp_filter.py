"""Seccomp filters for ``bwrap --seccomp FD``: a :class:`~lowlevel.spec.seccomp.SeccompProfile`
compiled to BPF by libseccomp, cached, and handed over in a sealed memfd.

One concept: turning the rule table (:mod:`lowlevel.spec.seccomp`, pure data) into the bytes the
kernel loads. The only importer of ``lowlevel.host._native``, the CFFI extension built from
native/ (``seccomp_helper.c``); pyseccomp (ctypes) is the fallback when it is not built.

Public API::

    compile_bpf(profile, compat_32bit=False) -> bytes
                                           cached per (profile, arches, libseccomp version), in
                                           this process and on disk (lowlevel.host.hostcache)
    bpf_memfd(bpf) -> int                  sealed memfd, offset 0, O_CLOEXEC; caller closes
    filter_arches(native=None, compat_32bit=False) -> arches listed (SCMP_ARCH_*)
    native_arch() -> int, syscall_name(arch, num) -> str | None

A syscall name libseccomp does not know (a typo in ``with_extra_deny``, a name newer than the
installed libseccomp) is refused here, by :func:`compile_bpf`, with a PolicyError before any
sandbox starts: the spec layer checks names for their shape only.

Sources: seccomp(2); seccomp_rule_add(3), seccomp_export_bpf(3), seccomp_arch_add(3)
(libseccomp 2.5); bwrap(1) ``--seccomp``; memfd_create(2), fcntl(2) "File Sealing".
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import warnings
from collections.abc import Iterable

from lowlevel.errors import PolicyError, SeccompError, UnsupportedError
from lowlevel.host import hostcache
from lowlevel.spec.seccomp import ARCH_NAMES, BAD_ARCH_ACTION, COMPAT_ARCHES, Arg, SeccompProfile

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: ``_native`` (the CFFI extension built from native/) is loaded on first use, not at import:
#: loading it and libseccomp costs ~3 ms that a process whose filter comes from the disk cache
#: (:mod:`lowlevel.host.hostcache`; the CLI, once per command) never pays. Read it with
#: :func:`_native_module`; ``seccomp_filter._native`` (tests set it to None) goes through
#: :func:`__getattr__`.
_NOT_LOADED: Any = object()


def _native_module() -> Any:
    """The ``lowlevel.host._native`` extension, or None when it is not built (pyseccomp then)."""
    m = globals().get("_native", _NOT_LOADED)
    if m is _NOT_LOADED:
        try:
            import lowlevel.host._native as loaded
        except ImportError:  # pragma: no cover - depends on the build
            loaded = None
        globals()["_native"] = m = loaded
    return m


def __getattr__(name: str) -> Any:
    if name == "_native":
        return _native_module()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- backends: the CFFI extension, or pyseccomp (ctypes) as fallback ---------------------------


class _NativeBackend:
    def __init__(self, native: Any) -> None:
        self.ffi, self.lib = native.ffi, native.lib

    def version(self) -> tuple[int, int, int]:
        v = self.lib.seccomp_version()
        return (v.major, v.minor, v.micro)

    def native_arch(self) -> int:
        return int(self.lib.seccomp_arch_native())

    def resolve(self, name: str) -> int:
        return int(self.lib.seccomp_syscall_resolve_name(name.encode()))

    def syscall_name(self, arch: int, num: int) -> str | None:
        buf = self.ffi.new("char[]", 128)
        rc = self.lib.ll_syscall_name(arch, num, buf, 128)
        return self.ffi.string(buf).decode() if rc == 0 else None

    def build(self, default_action: int, arches: Iterable[int],
              rules: Iterable[tuple[int, int, tuple[Arg, ...]]]) -> bytes:
        ffi, lib = self.ffi, self.lib
        raw = lib.seccomp_init(default_action)
        if raw == ffi.NULL:
            raise SeccompError("seccomp_init", errno.EINVAL,
                               f"seccomp_init({default_action:#x}) failed: invalid default action or ENOMEM")
        ctx = ffi.gc(raw, lib.seccomp_release)
        _check("seccomp_attr_set(SCMP_FLTATR_ACT_BADARCH)",
               lib.seccomp_attr_set(ctx, lib.SCMP_FLTATR_ACT_BADARCH, BAD_ARCH_ACTION))
        for arch in arches:
            rc = lib.seccomp_arch_add(ctx, arch)
            if rc != -errno.EEXIST:
                _check(f"seccomp_arch_add({ARCH_NAMES.get(arch, hex(arch))})", rc)
        for action, nr, args in rules:
            n = len(args)
            rc = lib.ll_rule_add(ctx, action, nr, n,
                                 ffi.new("unsigned int[]", [a.index for a in args] or [0]),
                                 ffi.new("int[]", [a.op for a in args] or [0]),
                                 ffi.new("uint64_t[]", [a.datum_a for a in args] or [0]),
                                 ffi.new("uint64_t[]", [a.datum_b for a in args] or [0]))
            _check(f"seccomp_rule_add({_name_of(self, nr)}, {action:#x}, {n} args)", rc)
        cap = 1 << 16
        while True:
            buf = ffi.new("unsigned char[]", cap)
            size = ffi.new("size_t *", cap)
            rc = lib.ll_export_bpf(ctx, buf, size)
            if rc == -errno.ERANGE and size[0] > cap:
                cap = size[0]
                continue
            _check("seccomp_export_bpf", rc)
            return bytes(ffi.buffer(buf, size[0]))


class _PySeccompBackend:
    def __init__(self, pyseccomp: Any) -> None:
        self.m = pyseccomp

    def version(self) -> tuple[int, int, int]:
        import ctypes

        class _V(ctypes.Structure):
            _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]

        f = self.m._libseccomp.seccomp_version
        f.restype = ctypes.POINTER(_V)
        v = f().contents
        return (v.major, v.minor, v.micro)

    def native_arch(self) -> int:
        return int(self.m.system_arch())

    def resolve(self, name: str) -> int:
        return int(self.m.resolve_syscall(self.m.Arch.NATIVE, name))

    def syscall_name(self, arch: int, num: int) -> str | None:
        try:
            return str(self.m.resolve_syscall(arch, num).decode())
        except ValueError:
            return None

    def build(self, default_action: int, arches: Iterable[int],
              rules: Iterable[tuple[int, int, tuple[Arg, ...]]]) -> bytes:
        m = self.m
        op = "seccomp_init"
        try:
            f = m.SyscallFilter(default_action)
            op = "seccomp_attr_set(SCMP_FLTATR_ACT_BADARCH)"
            f.set_attr(m.Attr.ACT_BADARCH, BAD_ARCH_ACTION)
            for arch in arches:
                op = f"seccomp_arch_add({ARCH_NAMES.get(arch, hex(arch))})"
                try:
                    f.add_arch(arch)
                except OSError as e:
                    if e.errno != errno.EEXIST:
                        raise
            for action, nr, args in rules:
                op = f"seccomp_rule_add({_name_of(self, nr)}, {action:#x}, {len(args)} args)"
                f.add_rule(action, nr, *(m.Arg(a.index, a.op, a.datum_a, a.datum_b) for a in args))
            op = "seccomp_export_bpf"
            fd = os.memfd_create("lowlevel-seccomp-export", os.MFD_CLOEXEC)
            with os.fdopen(fd, "w+b") as fh:
                f.export_bpf(fh)
                fh.seek(0)
                return fh.read()
        except OSError as e:
            raise SeccompError(op, e.errno or errno.EIO) from e


def _check(operation: str, rc: int) -> None:
    if rc < 0:
        raise SeccompError(operation, -rc, f"{operation} failed: {os.strerror(-rc)} (errno {-rc})")


def _name_of(backend: Any, nr: int) -> str:
    return backend.syscall_name(backend.native_arch(), nr) or str(nr)


_backend_lock = threading.Lock()
_backends: dict[str, Any] = {}


def _backend() -> Any:
    """The CFFI backend, or pyseccomp with a RuntimeWarning; never "no filter".

    Raises:
        UnsupportedError: neither ``lowlevel.host._native`` nor ``pyseccomp`` (libseccomp) loads.
    """
    native = _native_module()
    key = "native" if native is not None else "pyseccomp"
    with _backend_lock:
        b = _backends.get(key)
        if b is not None:
            return b
        if native is not None:
            b = _NativeBackend(native)
        else:
            try:
                import pyseccomp
            except (ImportError, RuntimeError) as e:
                raise UnsupportedError(
                    "seccomp", "neither lowlevel.host._native nor pyseccomp could load libseccomp",
                    "apt-get install libseccomp-dev && pip install --force-reinstall lowlevel") from e
            b = _PySeccompBackend(pyseccomp)
        _backends[key] = b
        return b


def _warn_fallback() -> bool:
    """Warn (True) when the extension is known to be missing: every compile_bpf call warns."""
    if globals().get("_native", _NOT_LOADED) is None:
        warnings.warn("lowlevel.host._native is not built; compiling the seccomp filter with pyseccomp "
                      "(ctypes). Install libseccomp-dev and reinstall lowlevel to build it.",
                      RuntimeWarning, stacklevel=3)
        return True
    return False


# --- compile + hand over ---------------------------------------------------------------------

_cache_lock = threading.Lock()
#: Filters this process compiled with libseccomp, by (profile, arches, version, backend).
_cache: dict[tuple[Any, ...], bytes] = {}
#: Every filter this process handed out (compiled or from the disk cache), by (profile, compat).
_filters: dict[tuple[Any, bool], bytes] = {}


def compile_bpf(profile: SeccompProfile, *, compat_32bit: bool = False) -> bytes:
    """Compile ``profile`` to BPF for this machine's arches, once per distinct profile.

    Args:
        profile: the rule table.
        compat_32bit: also admit the native arch's 32-bit compat ABI
            (:data:`lowlevel.spec.seccomp.COMPAT_ARCHES`:
            i386 ``int 0x80`` on x86_64) with the same rules. False (the default) kills a
            process at its first compat syscall (``SCMP_ACT_KILL_PROCESS``, SIGSYS).
    Returns:
        The program as bytes: a whole, non-zero number of 8-byte ``struct sock_filter``,
        ready for ``bwrap --seccomp``. Cached per (profile, native arch, libseccomp
        version, backend); later calls cost a dict lookup.
    Raises:
        PolicyError: a syscall name of the profile that this libseccomp does not know (a typo,
            or a name newer than the library).
        SeccompError: libseccomp refused a step (``.operation`` names it).
        UnsupportedError: no libseccomp at all.
        TypeError: ``profile`` is not a SeccompProfile.

    Warns:
        RuntimeWarning: the CFFI extension is missing and pyseccomp is used instead.
    """
    if not isinstance(profile, SeccompProfile):
        raise TypeError(f"compile_bpf: pass a SeccompProfile, got {type(profile).__name__}")
    warned = _warn_fallback()
    quick = (profile, bool(compat_32bit))
    with _cache_lock:
        hit = _filters.get(quick)
    if hit is not None:
        return hit
    disk = _disk_lookup(profile, compat_32bit)
    if disk is not None:
        with _cache_lock:
            _filters.setdefault(quick, disk)
        return disk
    bpf = _compile(profile, compat_32bit)
    if not warned:
        _warn_fallback()  # the first compile found the extension missing
    with _cache_lock:
        _filters.setdefault(quick, bpf)
    _disk_store(profile, compat_32bit, bpf)
    return bpf


def _compile(profile: SeccompProfile, compat_32bit: bool) -> bytes:
    b = _backend()
    native = b.native_arch()
    arches = filter_arches(native, compat_32bit)
    key = (profile, arches, b.version(), type(b).__name__)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    rules = []
    for action, name, args in profile.effective_rules():
        nr = b.resolve(name)
        if nr == -1:  # __NR_SCMP_ERROR: a typo, or a syscall this libseccomp lacks
            raise PolicyError(f"unknown syscall {name!r} in seccomp profile {profile.name!r}: libseccomp "
                              f"{'.'.join(map(str, b.version()))} does not know it; check the spelling against "
                              "syscalls(2), or upgrade libseccomp")
        rules.append((action, nr, args))
    bpf: bytes = b.build(profile.effective_default_action(), arches, rules)
    if not bpf or len(bpf) % 8:
        raise SeccompError("seccomp_export_bpf", errno.EINVAL,
                           f"seccomp_export_bpf returned {len(bpf)} bytes, not a whole number of "
                           "8-byte sock_filter instructions")
    with _cache_lock:
        _cache.setdefault(key, bpf)
    return bpf


def _profile_key(profile: SeccompProfile, compat_32bit: bool) -> str:
    """What the filter is made of, as text: the disk cache's key (prose left out)."""
    rules = [[action, name, [[a.index, a.op, a.datum_a, a.datum_b] for a in args]]
             for action, name, args in profile.effective_rules()]
    return json.dumps([profile.effective_default_action(), rules, bool(compat_32bit)], separators=(",", ":"))


def _native_files() -> list[Any] | None:
    """Disk-cache key of the compiler: the extension's file (no libseccomp load needed)."""
    pkg = os.path.dirname(os.path.abspath(__file__))  # the extension is lowlevel/host/_native*.so
    try:
        names = sorted(n for n in os.listdir(pkg) if n.startswith("_native") and n.endswith(".so"))
    except OSError:
        return None
    return [hostcache.file_key(os.path.join(pkg, n)) for n in names] or None


def _libseccomp_file() -> list[Any] | None:
    """libseccomp's file as this process mapped it (the backend is loaded), for the key."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                if "/libseccomp.so" in path:
                    return hostcache.file_key(path)
    except OSError:
        pass
    return None


def _disk_lookup(profile: SeccompProfile, compat_32bit: bool) -> bytes | None:
    """The filter from :mod:`lowlevel.host.hostcache`, when the same extension and libseccomp made it."""
    if globals().get("_native", _NOT_LOADED) is None:
        return None  # pyseccomp (forced or not built): compile
    if not hostcache.enabled():
        return None
    text = _profile_key(profile, compat_32bit)
    ext = _native_files()
    if ext is None:
        return None
    got = hostcache.get("seccomp", hostcache.entry_name(text), [text, ext])
    if not isinstance(got, dict) or not isinstance(got.get("bpf"), str):
        return None
    lib = got.get("libseccomp")
    if lib is None or hostcache.file_key(lib[0]) != lib:
        return None  # libseccomp changed (an upgrade): compile again
    try:
        bpf = bytes.fromhex(got["bpf"])
    except ValueError:
        return None
    return bpf if bpf and len(bpf) % 8 == 0 else None


def _disk_store(profile: SeccompProfile, compat_32bit: bool, bpf: bytes) -> None:
    if globals().get("_native", _NOT_LOADED) is None:
        return
    if not hostcache.enabled():
        return
    ext, lib = _native_files(), _libseccomp_file()
    if ext is None or lib is None:
        return
    text = _profile_key(profile, compat_32bit)
    hostcache.put("seccomp", hostcache.entry_name(text), [text, ext], {"bpf": bpf.hex(), "libseccomp": lib})


def native_arch() -> int:
    """This machine's arch as libseccomp names it (an ``SCMP_ARCH_*``, e.g. ``SCMP_ARCH_X86_64``)."""
    return int(_backend().native_arch())


def filter_arches(native: int | None = None, compat_32bit: bool = False) -> tuple[int, ...]:
    """The arches a filter lists (``SCMP_ARCH_*``): the native one, plus its compat arch when
    ``compat_32bit``. ``native`` defaults to this machine's."""
    if native is None:
        native = native_arch()
    return (native,) + (COMPAT_ARCHES.get(native, ()) if compat_32bit else ())


_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def bpf_memfd(bpf: bytes) -> int:
    """Put ``bpf`` in a sealed memfd for ``bwrap --seccomp FD``.

    Args:
        bpf: from :func:`compile_bpf`.
    Returns:
        An O_CLOEXEC fd at offset 0, sealed with F_SEAL_WRITE|SHRINK|GROW|SEAL so nothing
        can change the program between now and bwrap's read. The caller closes it (after
        the spawn; the child gets its own copy through dup2 in the file actions).
    Raises:
        ValueError: ``bpf`` is empty or not a whole number of 8-byte instructions.
        OSError: memfd_create, write or F_ADD_SEALS failed (e.g. EMFILE).

    Source: memfd_create(2), fcntl(2) "File Sealing"; bwrap(1) --seccomp.
    """
    if not isinstance(bpf, (bytes, bytearray, memoryview)):
        raise TypeError(f"bpf_memfd: pass bytes from compile_bpf, got {type(bpf).__name__}")
    if not bpf or len(bpf) % 8:
        raise ValueError(f"bpf_memfd: {len(bpf)} bytes is not a whole number of 8-byte sock_filters")
    fd = os.memfd_create("lowlevel-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(bpf)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.lseek(fd, 0, os.SEEK_SET)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def syscall_name(arch: int, num: int) -> str | None:
    """libseccomp's name for syscall ``num`` on ``arch`` (an ``SCMP_ARCH_*``), or None."""
    name: str | None = _backend().syscall_name(arch, num)
    return name


__all__ = ["bpf_memfd", "compile_bpf", "filter_arches", "native_arch", "syscall_name"]
