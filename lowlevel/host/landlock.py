"""Landlock, the second wall: the ruleset a sandbox's program runs under, and the run guard.

bwrap's mount namespace decides what the sandbox *sees*; Landlock (an LSM any unprivileged
process can apply to itself, Linux >= 5.13) decides what the program may *do* with what it
reaches, independently: a path the first wall exposes by mistake (a bind the operator added,
an fd to a host directory passed in, a handle opened outside the namespace) or a shared host
network is still fenced by the second.

The rules (sandbox paths; built inside the sandbox by ``native/lowlevel_landlock.h``):

- read files and execute beneath the read-only mounts: ``/usr``, the host's read-only
  top-level dirs (``/lib64``... when not usr-merged), ``/etc``, read-only binds; with a
  ``Policy.rootfs`` (or image), its top-level directories and files instead (every right in
  the ones ``rootfs_writable`` makes writable);
- every filesystem right beneath ``/workspace``, ``/tmp``, ``/dev/shm`` and writable binds;
- read, write and ioctl existing files beneath ``/dev`` and ``/proc`` (both mounted so that
  nothing can be created there; ``/proc/sys`` is read-only);
- list directories anywhere in the sandbox's tree (so ``ls /`` works), nothing else there;
- the standard streams when they are files or terminals (so ``/dev/stdout`` reopens);
- TCP (ABI >= 4): no bind; connect to any port with ``Policy(network=True)``, to the egress
  relay's port (``127.0.0.1:3128``) only with ``network=Egress(...)``, to none without network;
- scopes (ABI >= 6): no connecting to abstract unix sockets made outside the sandbox's
  domain (the host's, with a shared network), no signals to processes outside it;
- pathname unix sockets (ABI >= 9, ``LANDLOCK_ACCESS_FS_RESOLVE_UNIX``): connecting to one made
  outside the program's domain only beneath ``/tmp``, ``/dev/shm``, ``/workspace`` and binds
  with ``allow_sockets`` (or a socket bound itself with ``allow_sensitive``); below ABI 9 the
  sockets found in bound directories are masked instead (:mod:`lowlevel.sandbox.bind_sockets`).

Everything else is denied, whatever the mounts allow: a writable host directory reached by
any other path cannot be written, read or executed (only listed, when it is mounted in the
sandbox's tree). Rights the kernel lacks are dropped (best effort down to ABI 1; with
ABI 1, renames and links across directories fail with EXDEV, which ``mv``, ``shutil.move``
and npm answer with a copy). UDP is not covered by Landlock (ABI 7).

Where it is applied:

- fresh sandboxes (``run``, ``arun``, the CLI, MCP): bwrap execs the *guard*
  (``native/lowlevel_guard.c``, through an fd: no bind mount) in place of the program, as the
  PID 1 of the sandbox's PID namespace (``bwrap --as-pid-1``: the guard reaps orphans in place
  of bwrap's reaper; behind the egress relay it is not PID 1). The guard builds the ruleset,
  starts a child that restricts itself and execs the program, then reports the program's exact
  wait status over a pipe (so ``exit 152`` and death by SIGXCPU, both 152 to bwrap, are told
  apart by fact) and exits with the same code. The guard stays outside the program's domain:
  with ABI >= 6 the program cannot signal it (and as PID 1 the kernel drops the program's
  signals to it anyway).
- sessions and pools: the session init (``native/lowlevel_init.c``) restricts itself once with
  the TCP rules and the scopes (a domain the commands share: they can still signal each other
  and reach each other's abstract sockets, as they share everything else); each command then
  restricts itself, between vfork and exec, with the filesystem rules in a nested domain. That
  ruleset is rebuilt when a writable mount point changes: ``Session.reset`` stacks a fresh
  overlay on ``/workspace``, and Landlock ignores rules on a mount point another mount covers.

Sources: Documentation/userspace-api/landlock.rst (kernel); landlock(7),
landlock_create_ruleset(2), landlock_add_rule(2), landlock_restrict_self(2).
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import struct
from dataclasses import dataclass

from lowlevel.paths import native
from lowlevel.errors import UnsupportedError
from lowlevel.spec.policy import WORKSPACE_DEST, Policy

#: The guard executable (``native/lowlevel_guard.c``), built next to this module by setup.py.
GUARD_PATH = native("_lowlevel_guard")

#: Records the guard writes on its status fd (16 bytes each, native byte order).
_REC = struct.Struct("=IIII")
REC_START, REC_EXIT, REC_FAIL = 1, 2, 3
STAGE_LANDLOCK, STAGE_EXEC, STAGE_FORK, STAGE_CHDIR, STAGE_CWD = 1, 2, 3, 4, 5
STAGES = {STAGE_LANDLOCK: "landlock", STAGE_EXEC: "execve", STAGE_FORK: "vfork", STAGE_CHDIR: "chdir",
          STAGE_CWD: "working directory outside the sandbox"}

#: Tests only: cap the ABI the guard and the init use (to exercise the fallbacks). None: no cap.
_ABI_MAX: int | None = None

_SYS_LANDLOCK_CREATE_RULESET = 444  # the same on every architecture
_CREATE_RULESET_VERSION = 1


@functools.lru_cache(maxsize=None)
def kernel_abi() -> int:
    """The running kernel's Landlock ABI version (1 for Linux 5.13 ... 7 for 6.15), or 0.

    0 when the kernel is built without Landlock or boots without it in ``lsm=`` (the call
    fails with ENOSYS or EOPNOTSUPP). Cached per process.
    Source: landlock_create_ruleset(2), ``LANDLOCK_CREATE_RULESET_VERSION``.
    """
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        v = libc.syscall(ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                         ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return int(v) if v > 0 else 0


def describe(abi: int) -> str:
    """What ABI ``abi`` lets the sandbox enforce, in words (for ``doctor`` and notes)."""
    if abi < 1:
        return "not available (kernel without Landlock, or not in the lsm= list)"
    parts = ["filesystem"]
    parts.append("cross-directory rename/link" if abi >= 2 else "no cross-directory rename/link (EXDEV)")
    if abi >= 3:
        parts.append("truncate")
    if abi >= 4:
        parts.append("TCP bind/connect")
    if abi >= 5:
        parts.append("device ioctl")
    if abi >= 6:
        parts.append("abstract unix socket and signal scopes")
    if abi >= 9:
        parts.append("pathname unix socket connect (RESOLVE_UNIX)")
    else:
        parts.append("no pathname unix socket rules (ABI 9, Linux 7.1: sockets in bound directories are only "
                     "masked as found when a Policy is planned)")
    return f"ABI {abi}: " + ", ".join(parts)


def require_supported(policy: Policy) -> None:
    """Raise UnsupportedError when ``policy.landlock == "require"`` and the kernel lacks Landlock.

    Checked on the host before a sandbox starts (same kernel); the guard and the init check
    again inside and fail closed.
    """
    if policy.landlock == "require" and kernel_abi() < 1:
        raise UnsupportedError("landlock", "Policy(landlock='require') but this kernel has no Landlock "
                               "(needs Linux >= 5.13 with CONFIG_SECURITY_LANDLOCK and landlock in lsm=)",
                               "boot with lsm=...,landlock, or use Policy(landlock=True) for best effort")


def ruleset_args(policy: Policy, ro_dirs: tuple[str, ...],
                 bwrap_options: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The ``--ll...`` options of the guard and the init for ``policy`` (cached per Policy).

    Args:
        policy: the sandbox description (``landlock``, ``binds``, ``network``, ``landlock_omit``,
            ``rootfs``/``rootfs_writable``).
        ro_dirs: the host's read-only top-level dirs the base layout binds
            (:attr:`lowlevel.host.probe.HostLayout.ro_dirs`); unused with a ``rootfs``.
        bwrap_options: the installed bwrap's options (a writable rootfs is an overlay per
            top-level directory where bwrap has ``--tmp-overlay``: those are then writable).
    Returns:
        options for ``native/lowlevel_landlock.h``; ``("--ll=off",)`` when Landlock is off.
    """
    return _ruleset_args(policy, ro_dirs, bwrap_options, _ABI_MAX)


def _system_rules(policy: Policy, ro_dirs: tuple[str, ...], bwrap_options: frozenset[str]) -> list[str]:
    """Read/exec rules for the sandbox's system: the host's ``/usr`` (+ read-only top-level dirs
    and ``/etc``), or the top level of ``Policy.rootfs`` as :func:`lowlevel.rootfs.base_args`
    mounts it (writable where ``rootfs_writable`` makes it so)."""
    if policy.rootfs is None:
        return ["--ll-rx=/usr", *(f"--ll-rx={d}" for d in ro_dirs), "--ll-rx=/etc"]
    from lowlevel.rootfs import rootfs_layout
    layout = rootfs_layout(policy.rootfs)
    # A writable root is an overlay of each top-level directory where the anchor's overlay
    # works (or bwrap >= 0.9's --tmp-overlay), else tmpfs scratch dirs: the mounts decide what
    # is writable (an rw rule on a read-only mount grants nothing), so both are rw here.
    writable = policy.rootfs_writable
    out = [f"--ll-{'rw' if writable else 'rx'}=/{name}" for name in layout.dirs]
    out += [f"--ll-rx=/{name}" for name in layout.files]
    if writable:
        out += [f"--ll-rw=/{rel}" for rel in layout.scratch_dirs]
    return out


@functools.lru_cache(maxsize=256)
def _ruleset_args(policy: Policy, ro_dirs: tuple[str, ...], bwrap_options: frozenset[str],
                  abi_max: int | None) -> tuple[str, ...]:
    if policy.landlock is False:
        return ("--ll=off",)
    omit = set(policy.landlock_omit)
    a = ["--ll=require" if policy.landlock == "require" else "--ll=on", "--ll-ls=/"]
    a += _system_rules(policy, ro_dirs, bwrap_options)
    a += ["--ll-proc=/proc", "--ll-dev=/dev", "--ll-rw=/dev/shm", "--ll-rw=/tmp", f"--ll-rw={WORKSPACE_DEST}"]
    # Connecting to pathname unix sockets made outside the program's domain (ABI >= 9; the guard
    # drops the rule below; --ll-rw does not grant it): the sandbox's own places (a Session's
    # commands are sibling domains, and one may serve another over a socket there), and binds
    # that keep their sockets (allow_sockets, or a socket bound on purpose with allow_sensitive).
    # Nowhere else: a bound directory's host daemon socket (D-Bus, Docker, Podman, Ray) is
    # refused (issue 22, item 2).
    a += ["--ll-unix=/tmp", "--ll-unix=/dev/shm", f"--ll-unix={WORKSPACE_DEST}"]
    for bind in policy.binds:
        if bind.dest not in omit:
            a.append(f"--ll-{'rw' if bind.writable else 'rx'}={bind.dest}")
            if bind.allow_sockets or _is_socket(bind.source):
                a.append(f"--ll-unix={bind.dest}")
    from lowlevel.spec.egress import PROXY_PORT, Egress
    if isinstance(policy.network, Egress):
        a.append(f"--ll-net=port:{PROXY_PORT}")  # the relay's port; the relay itself runs outside
    else:
        a.append("--ll-net=connect" if policy.network else "--ll-net=none")
    if abi_max is not None:
        a.append(f"--ll-abi-max={abi_max}")
    return tuple(a)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def planned_abi() -> int:
    """The ABI the guard will use: :func:`kernel_abi`, capped by the tests' ``_ABI_MAX``."""
    abi = kernel_abi()
    return min(abi, _ABI_MAX) if _ABI_MAX is not None else abi


@functools.lru_cache(maxsize=None)
def guard_fd() -> int:
    """An O_RDONLY fd of the guard executable, opened once per process (bwrap execs
    ``/proc/self/fd/N``: no bind mount, and the package's path need not be reachable by the
    sandbox's uid).

    Raises:
        UnsupportedError: the guard is missing (the package was installed without building it).
    """
    try:
        return os.open(GUARD_PATH, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise UnsupportedError("guard", f"the run guard {GUARD_PATH} is missing ({err.strerror})",
                               "reinstall lowlevel (pip install .) with a C compiler present") from err


def guard_argv(exe_fd: int, status_fd: int, ll_args: tuple[str, ...], *, cwd: str) -> list[str]:
    """The guard's argv as bwrap execs it, before ``--`` and the program.

    ``cwd`` (validated by :func:`lowlevel.spec.validate.sandbox_cwd`) is the program's working
    directory: the guard changes to it itself, after bwrap has closed its fds (bwrap gets
    ``--chdir /``), refuses one whose ``getcwd(2)`` is outside the sandbox's root (reported as
    :data:`STAGE_CWD`) and sets ``PWD`` to it (CVE-2024-21626 class; runc 1.1.12 checks the
    same way).
    """
    return [f"/proc/self/fd/{exe_fd}", f"--fd={exe_fd}", f"--status={status_fd}", f"--cwd={cwd}", *ll_args, "--"]


@dataclass
class GuardReport:
    """What the guard said about one run (all None/False when it said nothing).

    Attributes:
        started: the guard set up and went on to start the program (START, written before the
            vfork); it ran unless ``fail_stage`` is set.
        abi: Landlock ABI the program runs under (0: none).
        wait_status: the program's wait status (``os.wait`` shape), once it ended.
        fail_errno, fail_stage: why the guard could not start it (``STAGES``).
    """

    started: bool = False
    abi: int | None = None
    wait_status: int | None = None
    fail_errno: int | None = None
    fail_stage: int | None = None


def parse_report(data: bytes) -> GuardReport:
    """Decode the guard's records (a short or unknown trailing record is ignored)."""
    rep = GuardReport()
    for off in range(0, len(data) - _REC.size + 1, _REC.size):
        kind, a, b, _c = _REC.unpack_from(data, off)
        if kind == REC_START:
            rep.started, rep.abi = True, a
        elif kind == REC_EXIT:
            rep.wait_status = a
        elif kind == REC_FAIL:
            rep.fail_errno, rep.fail_stage = a, b
    return rep


def read_report(fd: int) -> GuardReport:
    """Read everything the guard wrote on the (non-blocking) pipe ``fd``; call once bwrap exited."""
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            break
        except OSError as err:
            if err.errno == errno.EINTR:
                continue
            break
        if not data:
            break
        chunks.append(data)
    return parse_report(b"".join(chunks))


__all__ = ["GUARD_PATH", "GuardReport", "describe", "guard_argv", "guard_fd", "kernel_abi", "parse_report",
           "read_report", "require_supported", "ruleset_args"]
