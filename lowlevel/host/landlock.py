"""Landlock, the second wall, on the host's side: the kernel's ABI, and the run guard that applies it.

bwrap's mount namespace decides what the sandbox *sees*; Landlock (an LSM any unprivileged
process can apply to itself, Linux >= 5.13) decides what the program may *do* with what it
reaches, independently: a path the first wall exposes by mistake (a bind the operator added,
an fd to a host directory passed in, a handle opened outside the namespace) or a shared host
network is still fenced by the second.

The rules (``--ll...`` options, built from the Policy by
:func:`lowlevel.sandbox.landlock_rules.ruleset_args`, listed there) are applied inside the
sandbox by ``native/lowlevel_landlock.h``. This module holds the host's side of the wall: the
kernel's ABI (:func:`kernel_abi`, :func:`describe`), the ``require`` check, and the run guard
(its fd, argv and the report it writes back).

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
import struct

from lowlevel._dataclass import dataclass
from lowlevel.paths import native
from lowlevel.errors import UnsupportedError
from lowlevel.spec.policy import Policy

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


def abi_cap() -> int | None:
    """The tests' cap on the ABI the guard and the init use (``_ABI_MAX``), or None: no cap."""
    return _ABI_MAX


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


__all__ = ["GUARD_PATH", "GuardReport", "abi_cap", "describe", "guard_argv", "guard_fd", "kernel_abi",
           "parse_report", "planned_abi", "read_report", "require_supported"]
