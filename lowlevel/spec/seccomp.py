"""Seccomp rule tables -> BPF bytes for ``bwrap --seccomp FD``; the only importer of ``lowlevel._native``.

Glossary (libseccomp's words):

- **filter**: a classic-BPF program the kernel runs on every syscall; it sees the arch, the
  syscall number and the six raw argument registers, never memory behind pointers.
- **action**: what the filter returns: ``SCMP_ACT_ALLOW``, ``SCMP_ACT_ERRNO(errno)`` (fail
  with that errno, the call does nothing), ``SCMP_ACT_LOG`` (allow, and log to the kernel
  audit log), ``SCMP_ACT_TRAP`` (SIGSYS), ``SCMP_ACT_KILL_PROCESS``.
- **rule**: syscall + action + optional argument comparisons ``Arg(index, op, datum_a,
  datum_b)``, ANDed; several rules for one syscall are ORed.
- **arch**: the syscall ABI the call came in on. On x86_64 one process can use three: the
  native one (``syscall``), i386 (``int 0x80``, its own numbers) and x32 (native numbers
  with bit 30, ``0x40000000``, set). Each has its own syscall table in the kernel.
- **default action**: what happens to a syscall no rule matches (here: ALLOW, a deny-list).
- **bad-arch action**: what happens to a call from an arch the filter does not list.

How the arches are covered (issue 3, item 3; issue 12, item 8). By default the filter lists
only the native arch: a call through the 32-bit compat entry point (i386 ``int 0x80`` or
``sysenter`` on x86_64, AArch32 on aarch64) takes the bad-arch action,
``SCMP_ACT_KILL_PROCESS``, like x32. Agent code is 64-bit, and the compat syscall paths are
separate kernel code with bugs of their own (CVE-2010-3081 ``compat_alloc_user_space``,
CVE-2010-3301 and CVE-2007-4573 the IA32 syscall table entry); closing an entry point nobody
uses removes them, and every rule of the table then has one ABI to hold on. With
``compile_bpf(profile, compat_32bit=True)`` (``Policy(compat_32bit=True)``) the compat arch
(x86_64 + ``x86``; aarch64 + ``arm``) is listed with the same rules, so 32-bit binaries
(``gcc -m32`` output, old toolchains) run and meet the same walls, as Docker's default profile
and flatpak's multiarch filter do. x32 is never listed, so an x32 call (bit 30 set) takes the
bad-arch action: libseccomp's x86_64 code jumps there for any ``nr >= 0x40000000`` (except
-1). We kill x32 instead of filtering it because no distribution ships x32 user space
(Debian's kernel does not even build ``CONFIG_X86_X32_ABI``), while its table carries aliases
(numbers 512-547) a deny-list could miss; a dead ABI costs nothing to close. Any other arch a
CPU could report is also killed.

What the filter can't see: arguments in memory (``clone3``'s flags, i386 ``socketcall``'s
socket family), io_uring operations (they never pass through seccomp), syscalls added to
the kernel after this table (a deny-list lets them through; the table lists what we chose).

Public API::

    SeccompProfile(name, rules, default_action=SCMP_ACT_ALLOW, log=False)   frozen, hashable
        .with_extra_deny(*syscalls) -> SeccompProfile
        .with_log() -> SeccompProfile
    DEFAULT_PROFILE
    compile_bpf(profile, compat_32bit=False) -> bytes
                                           cached per (profile, arches, libseccomp version)
    bpf_memfd(bpf) -> int                  sealed memfd, offset 0, O_CLOEXEC; caller closes
    DenialAudit                            opt-in report of what a log-mode run tripped

Sources: seccomp(2); seccomp_rule_add(3), seccomp_export_bpf(3), seccomp_arch_add(3)
(libseccomp 2.5); bwrap(1) ``--seccomp``; flatpak ``common/flatpak-run.c`` ``setup_seccomp``;
moby ``profiles/seccomp/default.json``; Documentation/userspace-api/seccomp_filter.rst.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import re
import select
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from lowlevel.paths import PACKAGE_DIR
from lowlevel.errors import PolicyError, SeccompError, UnsupportedError

#: ``_native`` (the CFFI extension built from native/) is loaded on first use, not at import:
#: loading it and libseccomp costs ~3 ms that a process whose filter comes from the disk cache
#: (:mod:`lowlevel.host.hostcache`; the CLI, once per command) never pays. Read it with
#: :func:`_native_module`; ``seccomp._native`` (tests set it to None) goes through
#: :func:`__getattr__`.
_NOT_LOADED: Any = object()


def _native_module() -> Any:
    """The ``lowlevel._native`` extension, or None when it is not built (pyseccomp then)."""
    m = globals().get("_native", _NOT_LOADED)
    if m is _NOT_LOADED:
        try:
            from lowlevel import _native as loaded
        except ImportError:  # pragma: no cover - depends on the build
            loaded = None
        globals()["_native"] = m = loaded
    return m


def __getattr__(name: str) -> Any:
    if name == "_native":
        return _native_module()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# --- actions, comparisons, arches (libseccomp's values, checked against the library in tests) ---

SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_KILL_THREAD = 0x00000000
SCMP_ACT_TRAP = 0x00030000
SCMP_ACT_LOG = 0x7FFC0000
SCMP_ACT_ALLOW = 0x7FFF0000


def SCMP_ACT_ERRNO(errnum: int) -> int:  # noqa: N802 - libseccomp's name
    """The action "fail with ``errnum``" (``SCMP_ACT_ERRNO`` in seccomp.h)."""
    if not 0 <= errnum <= 0xFFFF:
        raise ValueError(f"SCMP_ACT_ERRNO({errnum}): errnum must be in 0..65535")
    return 0x00050000 | errnum


def _errno_of(action: int) -> int | None:
    return action & 0xFFFF if action & 0xFFFF0000 == 0x00050000 else None


SCMP_CMP_NE = 1
SCMP_CMP_LT = 2
SCMP_CMP_LE = 3
SCMP_CMP_EQ = 4
SCMP_CMP_GE = 5
SCMP_CMP_GT = 6
SCMP_CMP_MASKED_EQ = 7

#: Audit arch values (``AUDIT_ARCH_*``), which libseccomp uses as its arch tokens.
SCMP_ARCH_X86 = 0x40000003
SCMP_ARCH_X86_64 = 0xC000003E
SCMP_ARCH_X32 = 0x4000003E
SCMP_ARCH_ARM = 0x40000028
SCMP_ARCH_AARCH64 = 0xC00000B7

ARCH_NAMES = {SCMP_ARCH_X86: "x86", SCMP_ARCH_X86_64: "x86_64", SCMP_ARCH_X32: "x32",
              SCMP_ARCH_ARM: "arm", SCMP_ARCH_AARCH64: "aarch64"}

#: Native arch -> the compat arches that get the same rules with ``compat_32bit=True``.
#: Everything else (x32 included, and these without the flag) takes the bad-arch action. See
#: the module docstring.
COMPAT_ARCHES = {SCMP_ARCH_X86_64: (SCMP_ARCH_X86,), SCMP_ARCH_AARCH64: (SCMP_ARCH_ARM,)}

#: Action for a call from an arch the filter does not list (x32, anything unexpected).
BAD_ARCH_ACTION = SCMP_ACT_KILL_PROCESS

_VALID_OPS = frozenset(range(SCMP_CMP_NE, SCMP_CMP_MASKED_EQ + 1))
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Arg:
    """One argument comparison, ``SCMP_Ax(op, datum_a[, datum_b])``.

    Args:
        index: argument number, 0..5.
        op: ``SCMP_CMP_*``. For ``SCMP_CMP_MASKED_EQ``, ``datum_a`` is the mask and ``datum_b``
            the value: matches when ``arg & datum_a == datum_b``.
        datum_a, datum_b: unsigned 64-bit values.
    """

    index: int
    op: int
    datum_a: int
    datum_b: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.index, int) or not 0 <= self.index <= 5:
            raise PolicyError(f"Arg index {self.index!r}: pass 0..5")
        if self.op not in _VALID_OPS:
            raise PolicyError(f"Arg op {self.op!r}: pass one of the SCMP_CMP_* constants")
        for d in (self.datum_a, self.datum_b):
            if not isinstance(d, int) or not 0 <= d <= _U64:
                raise PolicyError(f"Arg datum {d!r}: pass an unsigned 64-bit int")


@dataclass(frozen=True)
class Rule:
    """One row of a rule table.

    ``reason`` and ``source`` document the row; they do not take part in equality or hashing,
    so two tables that differ only in prose share a compiled filter.

    Args:
        syscall: the man-2 name (``"clone3"``), as libseccomp resolves it.
        action: ``SCMP_ACT_*``.
        args: comparisons, all of which must hold (AND).
        reason: why the row exists, and how it differs from flatpak/Docker if it does.
        source: CVE, man page or upstream file the reason rests on.
    """

    syscall: str
    action: int
    args: tuple[Arg, ...] = ()
    reason: str = field(default="", compare=False)
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class SeccompProfile:
    """An immutable, hashable seccomp rule table, validated on construction.

    Args:
        name: shown in diagnostics (``"default"``, ``"default+log"``).
        rules: the rows, in order (order is kept in the filter and in the cache key).
        default_action: for calls no rule matches; ``SCMP_ACT_ALLOW`` makes a deny-list.
        log: audit mode: every action other than ``SCMP_ACT_ALLOW`` is compiled as
            ``SCMP_ACT_LOG``, so the run proceeds as if unfiltered and the kernel logs each
            call the profile would have stopped (see :class:`DenialAudit`). Bad-arch calls
            are still killed.
    Raises:
        PolicyError: unknown syscall name, malformed Arg, or a rule whose action equals the
            default action (libseccomp refuses it with EACCES).
    """

    name: str
    rules: tuple[Rule, ...] = ()
    default_action: int = SCMP_ACT_ALLOW
    log: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PolicyError("SeccompProfile.name: pass a non-empty str")
        if not isinstance(self.rules, tuple):
            object.__setattr__(self, "rules", tuple(self.rules))
        known: set[str] = set()
        for r in self.rules:
            if not isinstance(r, Rule):
                raise PolicyError(f"SeccompProfile.rules: {r!r} is not a Rule")
            if r.action == self.default_action:
                raise PolicyError(f"rule for {r.syscall!r} has the default action {r.action:#x}; "
                                  "drop the rule or pick another action")
            if r.syscall not in known:
                _check_syscall_name(r.syscall)
                known.add(r.syscall)

        object.__setattr__(self, "_hash", hash((self.name, self.rules, self.default_action, self.log)))

    def __hash__(self) -> int:  # cached: compile_bpf looks the profile up on every run
        return self._hash  # type: ignore[attr-defined, no-any-return]

    def with_extra_deny(self, *syscalls: str) -> SeccompProfile:
        """Return a copy that also fails ``syscalls`` with EPERM, whatever their arguments.

        Rows already in the table for those syscalls are replaced (a whole-syscall EPERM
        supersedes argument rules and e.g. ``clone3``'s ENOSYS).

        Raises:
            PolicyError: a name libseccomp does not know.
        """
        for s in syscalls:
            if not isinstance(s, str):
                raise TypeError(f"with_extra_deny: pass syscall names as str, got {s!r}")
            _check_syscall_name(s)
        names = tuple(dict.fromkeys(syscalls))
        if not names:
            return self
        kept = tuple(r for r in self.rules if r.syscall not in names)
        added = tuple(Rule(s, SCMP_ACT_ERRNO(errno.EPERM), reason="extra deny from the policy")
                      for s in names)
        return replace(self, name=f"{self.name}+deny({','.join(names)})", rules=kept + added)

    def with_log(self) -> SeccompProfile:
        """Return the audit-mode copy (``log=True``); see the ``log`` field."""
        return self if self.log else replace(self, name=f"{self.name}+log", log=True)

    def effective_rules(self) -> tuple[tuple[int, str, tuple[Arg, ...]], ...]:
        """``(action, syscall, args)`` as compiled: log mode turns denials into SCMP_ACT_LOG."""
        default = self.effective_default_action()
        out = []
        for r in self.rules:
            action = r.action
            if self.log and action != SCMP_ACT_ALLOW:
                action = SCMP_ACT_LOG
            if action != default:
                out.append((action, r.syscall, r.args))
        return tuple(out)

    def effective_default_action(self) -> int:
        """The default action as compiled (an ``SCMP_ACT_*`` int): ``SCMP_ACT_LOG`` in log mode unless it allows."""
        if self.log and self.default_action != SCMP_ACT_ALLOW:
            return SCMP_ACT_LOG
        return self.default_action


# --- the default profile --------------------------------------------------------------------

_EPERM = SCMP_ACT_ERRNO(errno.EPERM)
_ENOSYS = SCMP_ACT_ERRNO(errno.ENOSYS)
_EAFNOSUPPORT = SCMP_ACT_ERRNO(errno.EAFNOSUPPORT)

TIOCSTI = 0x5412
TIOCLINUX = 0x541C
TIOCSETD = 0x5423
CLONE_NEWUSER = 0x10000000
#: personality(2) values Docker's default profile allows: PER_LINUX, PER_LINUX32, UNAME26,
#: PER_LINUX32|UNAME26, and 0xffffffff (query the current persona).
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
#: socket(2) families tools need: AF_UNSPEC, AF_UNIX, AF_INET, AF_INET6, AF_NETLINK.
SOCKET_FAMILIES_ALLOWED = (0, 1, 2, 10, 16)


def _deny(syscall: str, reason: str, source: str, action: int = _EPERM,
          args: tuple[Arg, ...] = ()) -> Rule:
    return Rule(syscall, action, args, reason, source)


def _personality_rules() -> tuple[Rule, ...]:
    """Deny personality(2) unless the low 32 bits are one of PERSONALITY_ALLOWED.

    libseccomp 2.5 allows one comparison per argument per rule and no ALLOW rule under an
    ALLOW default, so "not in the set" is spelled as an OR of masked bit tests: with bit 31
    clear, any bit outside {3, 17} denies; with bit 31 set, any clear bit in 0..30 denies
    (only 0xffffffff survives). The masks cover the low 32 bits only, like the kernel,
    which takes an ``unsigned int``: high bits neither help nor hurt.
    """
    reason = ("Other personas change the ABI under the filter (READ_IMPLIES_EXEC, "
              "ADDR_NO_RANDOMIZE, foreign ABIs). Values: Docker's allowed set. flatpak allows "
              "only PER_LINUX (and blocks the 0xffffffff query), which breaks setarch/linux32.")
    source = "personality(2); moby default.json personality rows; flatpak-run.c"
    allowed_bits = 0
    for v in PERSONALITY_ALLOWED:
        if v != 0xFFFFFFFF:
            allowed_bits |= v
    bit31 = 1 << 31
    rules = []
    for b in range(31):
        if not allowed_bits & (1 << b):
            rules.append(_deny("personality", reason, source,
                               args=(Arg(0, SCMP_CMP_MASKED_EQ, bit31 | (1 << b), 1 << b),)))
    for b in range(31):
        rules.append(_deny("personality", reason, source,
                           args=(Arg(0, SCMP_CMP_MASKED_EQ, bit31 | (1 << b), bit31),)))
    return tuple(rules)


def _socket_family_rules() -> tuple[Rule, ...]:
    """socket(2) with a family outside SOCKET_FAMILIES_ALLOWED fails with EAFNOSUPPORT."""
    reason = ("Rare protocol families are unprivileged kernel attack surface that network "
              "namespaces do not contain: AF_VSOCK reaches the VM host, AF_ALG, AF_CAN bcm, AF_RDS, "
              "AF_TIPC, AF_LLC had local-root bugs. EAFNOSUPPORT is what programs expect for a "
              "missing family and fall back on. Same allowlist as flatpak (no CAN/Bluetooth "
              "options); Docker denies only AF_VSOCK. The GE row is a 64-bit compare, so a "
              "family with high bits set is denied too. On i386 libseccomp also denies "
              "socketcall(SYS_SOCKET) (the family is in memory): 32-bit programs using "
              "socketcall cannot create sockets.")
    source = ("flatpak-run.c socket_family_allowlist; moby default.json (socket a0 != 40); "
              "CVE-2021-3609 (CAN bcm), CVE-2010-3904 (RDS), CVE-2021-43267 (TIPC)")
    rules = []
    last = -1
    for fam in SOCKET_FAMILIES_ALLOWED:
        for bad in range(last + 1, fam):
            rules.append(_deny("socket", reason, source, _EAFNOSUPPORT, (Arg(0, SCMP_CMP_EQ, bad),)))
        last = fam
    rules.append(_deny("socket", reason, source, _EAFNOSUPPORT, (Arg(0, SCMP_CMP_GE, last + 1),)))
    return tuple(rules)


def _setid_rules() -> tuple[Rule, ...]:
    """Deny making setuid/setgid files: chmod-family calls, and creating calls with those mode bits.

    A setuid file left in a workspace runs with the sandbox's host uid *outside* the sandbox
    (no seccomp, host network, other sandboxes' /proc/PID/root) for any local user who reaches
    it; for an unprivileged caller that uid is the caller's own. The mode argument is masked,
    so ordinary chmod/open calls pass. open/openat only carry a mode with O_CREAT or
    O_TMPFILE: the rule tests the flag too, so garbage in an unused mode register cannot
    trip it. openat2 passes mode in a struct seccomp cannot read: ENOSYS, so libc falls back
    to openat. Cost: ``chmod g+s`` on a directory (``git init --shared``) fails with EPERM.
    """
    src = ("flatpak-run.c (chmod/fchmod/fchmodat with S_ISUID|S_ISGID, CVE-2021-41133 follow-up); "
           "Docker has no rule (no shared workspace); lowlevel red-team finding")
    why = "creating a setuid/setgid file that runs outside the sandbox with its uid"
    rows: list[Rule] = []
    for bit in (stat.S_ISUID, stat.S_ISGID):
        name = "S_ISUID" if bit == stat.S_ISUID else "S_ISGID"
        for syscall, mode_arg in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2),
                                  ("creat", 1)):
            rows.append(_deny(syscall, f"{syscall} with {name}: {why}", src,
                              args=(Arg(mode_arg, SCMP_CMP_MASKED_EQ, bit, bit),)))
        for syscall, mode_arg in (("mknod", 1), ("mknodat", 2)):
            rows.append(_deny(syscall, f"{syscall} of a file with {name}: {why}", src,
                              args=(Arg(mode_arg, SCMP_CMP_MASKED_EQ, bit, bit),)))
        for syscall, flags_arg in (("open", 1), ("openat", 2)):
            for flag, fname in ((os.O_CREAT, "O_CREAT"), (_O_TMPFILE_BIT, "O_TMPFILE")):
                rows.append(_deny(syscall, f"{syscall}({fname}) with mode {name}: {why}", src,
                                  args=(Arg(flags_arg, SCMP_CMP_MASKED_EQ, flag, flag),
                                        Arg(flags_arg + 1, SCMP_CMP_MASKED_EQ, bit, bit))))
    rows.append(_deny("openat2", "openat2's mode sits in struct open_how, which seccomp cannot read; "
                      "ENOSYS makes libc fall back to openat, which the rules above check.", src,
                      action=_ENOSYS))
    return tuple(rows)


#: __O_TMPFILE without O_DIRECTORY (O_TMPFILE = __O_TMPFILE | O_DIRECTORY), x86 and arm values.
_O_TMPFILE_BIT = 0o20000000


_NO_TOOL_NEEDS = "no tool we run needs it"
_MOUNT_REASON = ("Mount table changes. bwrap drops CAP_SYS_ADMIN so the kernel says EPERM anyway; "
                 "denying them here keeps that true if a policy ever keeps capabilities. flatpak "
                 "returns ENOSYS for the new mount API (so libmount falls back to mount(2) and "
                 "reports EPERM there); we return EPERM directly: same outcome for tools.")

_DEFAULT_RULES: tuple[Rule, ...] = (
    # Terminal injection: the sandbox may share the caller's tty.
    _deny("ioctl", "TIOCSTI pushes bytes into the tty's input queue: a command typed into the "
          "caller's shell after the sandbox exits. Compared on the low 32 bits only: the kernel "
          "truncates the request to unsigned int, so high bits must not slip past (CVE-2019-10063).",
          "CVE-2017-5226 (bwrap), CVE-2019-10063 (flatpak); same as flatpak; Docker has no rule "
          "(relies on no shared tty)",
          args=(Arg(1, SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, TIOCSTI),)),
    _deny("ioctl", "TIOCLINUX copy/paste on a virtual console has TIOCSTI's effect.",
          "CVE-2023-28100 (flatpak); same as flatpak",
          args=(Arg(1, SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, TIOCLINUX),)),
    _deny("ioctl", "TIOCSETD sets a tty's line discipline: it loads and runs rarely used kernel code "
          "(n_hdlc, n_gsm...; with dev.tty.ldisc_autoload=1 any unprivileged process can make the kernel "
          "load the module) that has given local root more than once; and on a terminal shared with "
          "the caller it leaves that terminal swallowing input after the run (termios cannot undo it). "
          "No tool we run needs it. Low 32 bits compared, as TIOCSTI.",
          "CVE-2017-2636 (n_hdlc), CVE-2023-6546 (n_gsm); Linux 5.1 dev.tty.ldisc_autoload; "
          "tty_ioctl(4); flatpak and Docker have no rule",
          args=(Arg(1, SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, TIOCSETD),)),
    # Nested namespaces: a new user namespace hands back every capability bwrap dropped.
    _deny("clone", "CLONE_NEWUSER: a nested user namespace regains full capabilities inside it "
          "and opens kernel code paths reachable only as (namespaced) root. Other CLONE_NEW* "
          "flags need CAP_SYS_ADMIN, which bwrap drops and only a new userns gives back. arg0 "
          "holds the flags on x86, x86_64, arm and aarch64 (s390 swaps them; not supported).",
          "flatpak-run.c (same); Docker masks all CLONE_NEW* without CAP_SYS_ADMIN",
          args=(Arg(0, SCMP_CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER),)),
    _deny("unshare", "Every unshare(2) flag that matters makes a namespace; tools that need "
          "unshare(CLONE_FS/FILES) alone are vanishingly rare. Whole syscall, like flatpak and "
          "Docker (without CAP_SYS_ADMIN).", "flatpak-run.c; moby default.json"),
    _deny("setns", "Joining another namespace (e.g. through an inherited /proc/PID/ns fd).",
          "flatpak-run.c; moby default.json"),
    _deny("clone3", "clone3 passes its flags in struct clone_args in memory, which seccomp cannot "
          "read; ENOSYS makes glibc (2.34+) fall back to clone(2), which the rule above checks.",
          "CVE-2021-41133 (flatpak); moby commit 9f6b562d (ENOSYS); same as both",
          action=_ENOSYS),
    # Other processes' memory and fds.
    _deny("ptrace", "Reading/writing a sibling's memory and registers; also the old "
          "ptrace-changes-the-syscall seccomp bypass (fixed in 4.8). Docker allows it on >= 4.8 "
          "so debuggers work; our workloads don't need gdb/strace inside the sandbox.",
          "flatpak-run.c (non-devel); moby default.json (CAP_SYS_PTRACE or >= 4.8)"),
    _deny("process_vm_readv", "Another process's memory without ptrace.", "moby default.json (CAP_SYS_PTRACE)"),
    _deny("process_vm_writev", "Another process's memory without ptrace.", "moby default.json (CAP_SYS_PTRACE)"),
    _deny("process_madvise", "Acts on another process's memory.", "moby default.json (CAP_SYS_PTRACE)"),
    _deny("kcmp", "Probes other processes' kernel objects (fd/mm identity, KASLR-ish leaks).",
          "moby default.json (CAP_SYS_PTRACE)"),
    _deny("pidfd_getfd", "Steals an fd from another process.", "moby default.json (CAP_SYS_PTRACE)"),
    _deny("migrate_pages", "Moves another process's pages between NUMA nodes.", "flatpak-run.c"),
    _deny("move_pages", "Moves/queries another process's pages.", "flatpak-run.c"),
    # Kernel attack surface rarely needed by tools.
    _deny("bpf", "eBPF verifier and maps: a long line of local-root bugs.", "moby default.json (CAP_BPF)"),
    _deny("perf_event_open", "perf is the source of many CVEs and a side channel.",
          "flatpak-run.c (non-devel); moby default.json (CAP_PERFMON)"),
    _deny("userfaultfd", "Lets an attacker stall kernel copy_from_user at will: the standard "
          "race-widening primitive of kernel exploits.", "moby default.json (not allowed)"),
    _deny("keyctl", "Kernel keyrings are not namespaced: other users' keys, keyring bugs.",
          "flatpak-run.c; moby default.json (not allowed)"),
    _deny("add_key", "Kernel keyrings, as keyctl.", "flatpak-run.c; moby default.json"),
    _deny("request_key", "Kernel keyrings, as keyctl.", "flatpak-run.c; moby default.json"),
    _deny("io_uring_setup", "io_uring operations bypass seccomp entirely, and io_uring is a rich "
          "CVE source (Google disabled it on ChromeOS/Android/prod). The Docker version we read "
          "still allows it; newer Docker releases deny it.", "moby default.json; Google security blog 2023"),
    _deny("io_uring_enter", "As io_uring_setup.", "as io_uring_setup"),
    _deny("io_uring_register", "As io_uring_setup.", "as io_uring_setup"),
    _deny("kexec_load", "Replaces the running kernel.", "moby default.json (not allowed)"),
    _deny("kexec_file_load", "Replaces the running kernel.", "moby default.json (not allowed)"),
    _deny("init_module", "Loads kernel code.", "moby default.json (CAP_SYS_MODULE)"),
    _deny("finit_module", "Loads kernel code.", "moby default.json (CAP_SYS_MODULE)"),
    _deny("delete_module", "Unloads kernel code.", "moby default.json (CAP_SYS_MODULE)"),
    _deny("mount", _MOUNT_REASON, "flatpak-run.c; moby default.json (CAP_SYS_ADMIN)"),
    _deny("umount", _MOUNT_REASON + " (i386 only)", "flatpak-run.c"),
    _deny("umount2", _MOUNT_REASON, "flatpak-run.c; moby default.json"),
    _deny("pivot_root", _MOUNT_REASON, "flatpak-run.c; moby default.json"),
    _deny("chroot", "Nested chroot games; needs CAP_SYS_CHROOT, which bwrap drops.",
          "flatpak-run.c; moby default.json (CAP_SYS_CHROOT)"),
    _deny("move_mount", _MOUNT_REASON, "CVE-2021-41133; flatpak-run.c (ENOSYS)"),
    _deny("open_tree", _MOUNT_REASON, "CVE-2021-41133; flatpak-run.c (ENOSYS)"),
    _deny("fsopen", _MOUNT_REASON, "CVE-2021-41133; flatpak-run.c (ENOSYS)"),
    _deny("fsconfig", _MOUNT_REASON, "CVE-2021-41133; flatpak-run.c (ENOSYS)"),
    _deny("fsmount", _MOUNT_REASON, "CVE-2021-41133; flatpak-run.c (ENOSYS)"),
    _deny("fspick", _MOUNT_REASON, "CVE-2021-41133; flatpak-run.c (ENOSYS)"),
    _deny("mount_setattr", _MOUNT_REASON, "flatpak-run.c (ENOSYS); moby default.json"),
    _deny("swapon", "Host swap configuration.", "moby default.json (not allowed)"),
    _deny("swapoff", "Host swap configuration.", "moby default.json (not allowed)"),
    _deny("reboot", "Reboots the host (or kills a PID namespace's init).", "moby default.json (CAP_SYS_BOOT)"),
    _deny("acct", "Process accounting is host-global.", "flatpak-run.c; moby default.json (CAP_SYS_PACCT)"),
    _deny("quotactl", "Host quota state.", "flatpak-run.c; moby default.json (CAP_SYS_ADMIN)"),
    _deny("quotactl_fd", "Host quota state.", "moby default.json (CAP_SYS_ADMIN)"),
    _deny("syslog", "The kernel log leaks addresses and other tenants' activity (dmesg).",
          "flatpak-run.c; moby default.json (CAP_SYSLOG)"),
    _deny("open_by_handle_at", "Opens files by handle, outside the mount namespace's view "
          "(the 2014 'shocker' Docker escape).", "moby default.json (CAP_DAC_READ_SEARCH)"),
    _deny("name_to_handle_at", "Makes the handles open_by_handle_at consumes; flatpak and Docker "
          "allow it (harmless alone), we deny it with its partner since no tool needs it.",
          "issue 3; moby default.json allows it"),
    _deny("iopl", "Raw I/O port access.", "moby default.json (CAP_SYS_RAWIO)"),
    _deny("ioperm", "Raw I/O port access.", "moby default.json (CAP_SYS_RAWIO)"),
    _deny("uselib", "Obsolete a.out loader, historical bugs.", "flatpak-run.c; moby default.json (not allowed)"),
    _deny("vhangup", "Hangs up the (possibly shared) terminal.", "moby default.json (CAP_SYS_TTY_CONFIG)"),
    _deny("modify_ldt", "16-bit segments: historic info leaks (CVE-2015-5157 class); Docker allows "
          "it on x86 for Wine-style programs, flatpak denies; tools don't need it.", "flatpak-run.c"),
    _deny("vm86", "i386 only: virtual-8086 mode, historical local-root bugs.", "moby default.json (not allowed)"),
    _deny("vm86old", "i386 only: as vm86.", "moby default.json (not allowed)"),
    _deny("lookup_dcookie", "Obsolete oprofile interface.", "moby default.json (CAP_SYS_ADMIN)"),
    _deny("nfsservctl", "Removed in Linux 3.1; no reason to reach it.", "moby default.json (not allowed)"),
    _deny("_sysctl", "Removed in Linux 5.5; no reason to reach it.", "moby default.json (not allowed)"),
    _deny("settimeofday", "The host clock is global; needs CAP_SYS_TIME, which bwrap drops.",
          "moby default.json (CAP_SYS_TIME)"),
    _deny("clock_settime", "As settimeofday.", "moby default.json (CAP_SYS_TIME)"),
    _deny("stime", "As settimeofday (i386 only).", "moby default.json (CAP_SYS_TIME)"),
) + _personality_rules() + _socket_family_rules() + _setid_rules()

#: Calls flatpak or Docker deny that the default profile allows, and why (the other half of
#: the line-by-line comparison; rows above name their flatpak/Docker counterpart).
ALLOWED_DIFFERENCES: tuple[tuple[str, str], ...] = (
    ("mbind, get_mempolicy, set_mempolicy, set_mempolicy_home_node",
     "flatpak denies; Docker needs CAP_SYS_NICE. They only set the caller's own NUMA policy, and "
     "JVMs (-XX:+UseNUMA), hwloc/OpenMP runtimes and numactl call them."),
    ("sethostname, setdomainname",
     "Docker needs CAP_SYS_ADMIN. The UTS namespace is the sandbox's own (--unshare-uts) and the "
     "kernel still requires CAP_SYS_ADMIN over it."),
    ("fanotify_init", "Docker needs CAP_SYS_ADMIN; the kernel restricts unprivileged fanotify itself."),
    ("adjtimex, clock_adjtime", "Same as Docker: read-only queries (ntp_gettime) are common; setting "
     "needs CAP_SYS_TIME."),
    ("everything Docker's allow-list omits (create_module, get_kernel_syms, query_module, ustat, "
     "sysfs, afs_syscall, tuxcall, ... and syscalls newer than the table)",
     "Deny-list by design (issue 3): the obsolete ones return ENOSYS in the kernel; new syscalls "
     "arrive allowed until this table is reviewed, the known cost of a deny-list."),
    ("AF_CAN, AF_BLUETOOTH", "flatpak allows them behind --allow=canbus/bluetooth; we have no such option."),
)



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
        UnsupportedError: neither ``lowlevel._native`` nor ``pyseccomp`` (libseccomp) loads.
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
                    "seccomp", "neither lowlevel._native nor pyseccomp could load libseccomp",
                    "apt-get install libseccomp-dev && pip install --force-reinstall lowlevel") from e
            b = _PySeccompBackend(pyseccomp)
        _backends[key] = b
        return b


def _warn_fallback() -> bool:
    """Warn (True) when the extension is known to be missing: every compile_bpf call warns."""
    if globals().get("_native", _NOT_LOADED) is None:
        warnings.warn("lowlevel._native is not built; compiling the seccomp filter with pyseccomp "
                      "(ctypes). Install libseccomp-dev and reinstall lowlevel to build it.",
                      RuntimeWarning, stacklevel=3)
        return True
    return False


#: While the built-in tables are constructed at import, names are checked for their shape only:
#: asking libseccomp means loading it (~3 ms at every import). The tables are checked against
#: libseccomp by the test suite, and compile_bpf refuses a name it cannot resolve.
_TRUST_NAMES = True


def _check_syscall_name(name: str) -> None:
    """Raise PolicyError unless libseccomp knows ``name`` (on some arch)."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        raise PolicyError(f"syscall name {name!r}: pass a man-2 name such as 'ptrace'")
    if _TRUST_NAMES:
        return
    try:
        b = _backend()
    except UnsupportedError:  # checked again, loudly, by compile_bpf
        return
    if b.resolve(name) == -1:  # __NR_SCMP_ERROR
        raise PolicyError(f"unknown syscall {name!r}: libseccomp {'.'.join(map(str, b.version()))} "
                          "does not know it; check the spelling against syscalls(2)")


#: The profile every run uses unless its Policy says otherwise (built here, after the
#: backends, because construction validates names against libseccomp).
DEFAULT_PROFILE = SeccompProfile("default", _DEFAULT_RULES)
_TRUST_NAMES = False  # every profile built after import: names checked against libseccomp


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
        compat_32bit: also admit the native arch's 32-bit compat ABI (:data:`COMPAT_ARCHES`:
            i386 ``int 0x80`` on x86_64) with the same rules. False (the default) kills a
            process at its first compat syscall (``SCMP_ACT_KILL_PROCESS``, SIGSYS).
    Returns:
        The program as bytes: a whole, non-zero number of 8-byte ``struct sock_filter``,
        ready for ``bwrap --seccomp``. Cached per (profile, native arch, libseccomp
        version, backend); later calls cost a dict lookup.
    Raises:
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
        if nr == -1:  # __NR_SCMP_ERROR: a built-in table names a syscall this libseccomp lacks
            raise PolicyError(f"unknown syscall {name!r} in seccomp profile {profile.name!r}: libseccomp "
                              f"{'.'.join(map(str, b.version()))} does not know it (upgrade libseccomp)")
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
    from lowlevel.host.hostcache import file_key
    pkg = PACKAGE_DIR
    try:
        names = sorted(n for n in os.listdir(pkg) if n.startswith("_native") and n.endswith(".so"))
    except OSError:
        return None
    return [file_key(os.path.join(pkg, n)) for n in names] or None


def _libseccomp_file() -> list[Any] | None:
    """libseccomp's file as this process mapped it (the backend is loaded), for the key."""
    from lowlevel.host.hostcache import file_key
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                if "/libseccomp.so" in path:
                    return file_key(path)
    except OSError:
        pass
    return None


def _disk_lookup(profile: SeccompProfile, compat_32bit: bool) -> bytes | None:
    """The filter from :mod:`lowlevel.host.hostcache`, when the same extension and libseccomp made it."""
    if globals().get("_native", _NOT_LOADED) is None:
        return None  # pyseccomp (forced or not built): compile
    from lowlevel.host import hostcache
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
    from lowlevel.host import hostcache
    if not hostcache.enabled():
        return
    ext, lib = _native_files(), _libseccomp_file()
    if ext is None or lib is None:
        return
    text = _profile_key(profile, compat_32bit)
    hostcache.put("seccomp", hostcache.entry_name(text), [text, ext], {"bpf": bpf.hex(), "libseccomp": lib})


def filter_arches(native: int | None = None, compat_32bit: bool = False) -> tuple[int, ...]:
    """The arches a filter lists (``SCMP_ARCH_*``): the native one, plus its compat arch when
    ``compat_32bit``. ``native`` defaults to this machine's."""
    if native is None:
        native = _backend().native_arch()
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


# --- denial report (opt-in audit mode) -------------------------------------------------------

_AUDIT_RE = re.compile(
    rb"type=1326 .*? pid=(?P<pid>\d+) .*? arch=(?P<arch>[0-9a-f]+) syscall=(?P<nr>\d+) "
    rb".*? code=0x(?P<code>[0-9a-f]+)")
_active_audits = 0
_active_lock = threading.Lock()


class DenialAudit:
    """Collect the syscalls a log-mode run tripped, from the kernel's audit records.

    Use with a profile from :meth:`SeccompProfile.with_log`: each call the profile would
    have denied is allowed and logged by the kernel as an ``audit: type=1326 ... pid=P
    arch=A syscall=N ... code=0x7ffc0000`` line in ``/dev/kmsg`` (x32 kills appear with
    ``code=0x80000000``). Records are attributed to the run by the PID namespace of the
    logging process, checked while it is alive; a record whose process is already gone is
    kept only when no other audit is running in this Python process.

    Lifecycle, for the launcher::

        audit = DenialAudit()                 # before the spawn; opens /dev/kmsg at its end
        ...spawn bwrap, read child-pid N from --json-status-fd...
        audit.attach(N)                       # N = host PID of the sandbox's PID 1
        ...wait for the run to end...
        result.seccomp_denials = audit.finish()   # sorted names; closes everything

    Cost: one fd and one thread polling kmsg while the run lasts; nothing in the default
    (ERRNO) fast path.

    Limits: needs CAP_SYSLOG (root) when ``kernel.dmesg_restrict=1``; sees nothing when
    auditd consumes the records instead of the kernel log; the kernel rate-limits these
    lines (printk_ratelimit, about 10 per 5 s host-wide), so a burst can hide names.

    Raises:
        UnsupportedError: ``/dev/kmsg`` can't be opened (feature ``"seccomp-audit"``).

    Source: seccomp(2) SECCOMP_RET_LOG (Linux 4.14), /proc/sys/kernel/seccomp/actions_logged;
    Documentation/ABI/testing/dev-kmsg; kernel/auditsc.c audit_seccomp.
    """

    def __init__(self, kmsg_path: str = "/dev/kmsg") -> None:
        global _active_audits
        try:
            self._fd = os.open(kmsg_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise UnsupportedError("seccomp-audit", f"cannot read {kmsg_path} for seccomp audit "
                                   f"records: {e.strerror}", "run as root, or sysctl "
                                   "kernel.dmesg_restrict=0") from e
        os.lseek(self._fd, 0, os.SEEK_END)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._pidns: int | None = None
        self._names: set[str] = set()
        self._dead: list[tuple[int, int, int]] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        with _active_lock:
            _active_audits += 1

    def attach(self, sandbox_pid: int) -> None:
        """Start attributing records to the PID namespace of ``sandbox_pid`` (host PID).

        Raises:
            ProcessLookupError: ``sandbox_pid`` is gone.
        """
        try:
            self._pidns = os.stat(f"/proc/{sandbox_pid}/ns/pid").st_ino
        except FileNotFoundError as e:
            raise ProcessLookupError(errno.ESRCH, f"sandbox PID {sandbox_pid} is gone") from e
        self._thread = threading.Thread(target=self._loop, name="lowlevel-seccomp-audit", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            ready, _, _ = select.select([self._fd, self._stop_r], [], [])
            if self._fd in ready:
                self._drain()
            if self._stop_r in ready:
                return

    def _drain(self) -> int:
        """Read every pending record; return how many were read."""
        n = 0
        while True:
            try:
                rec = os.read(self._fd, 8192)
            except BlockingIOError:
                return n
            except BrokenPipeError:  # records overwritten before we read them: skip ahead
                continue
            if not rec:  # EOF: only a regular file (tests) gets here
                return n
            n += 1
            self._take(rec)

    def _take(self, rec: bytes) -> None:
        m = _AUDIT_RE.search(rec)
        if m is None:
            return
        code = int(m["code"], 16)
        if code not in (SCMP_ACT_LOG, SCMP_ACT_KILL_PROCESS, SCMP_ACT_KILL_THREAD):
            return
        pid, arch, nr = int(m["pid"]), int(m["arch"], 16), int(m["nr"])
        try:
            ns = os.stat(f"/proc/{pid}/ns/pid").st_ino
        except (FileNotFoundError, PermissionError):
            with self._lock:
                self._dead.append((arch, nr, code))
            return
        if ns == self._pidns:
            with self._lock:
                self._names.add(self._label(arch, nr, code))

    @staticmethod
    def _label(arch: int, nr: int, code: int) -> str:
        if code != SCMP_ACT_LOG and arch == SCMP_ARCH_X86_64 and nr & 0x40000000:
            return f"x32:{nr & ~0x40000000}"
        name = syscall_name(arch, nr) or str(nr)
        if arch != _backend().native_arch():
            name = f"{ARCH_NAMES.get(arch, hex(arch))}:{name}"
        return name

    def finish(self, settle_s: float = 0.05) -> tuple[str, ...]:
        """Stop collecting and return the sorted, distinct names the run tripped.

        Args:
            settle_s: keep reading until the log has been quiet this long (seconds): the
                kernel's kauditd thread prints records asynchronously, shortly after the call.
        Returns:
            Native-arch calls as plain names (``"ptrace"``), others prefixed with the arch
            (``"x86:ptrace"``, ``"x32:101"``). Idempotent; closes the fds.
        """
        if not self._closed:
            if self._thread is not None:
                os.write(self._stop_w, b"x")
                self._thread.join()
            self._drain()
            while select.select([self._fd], [], [], settle_s)[0] and self._drain():
                pass
            with _active_lock:
                alone = _active_audits == 1
            if alone:
                for arch, nr, code in self._dead:
                    self._names.add(self._label(arch, nr, code))
            self.close()
        return tuple(sorted(self._names))

    def close(self) -> None:
        global _active_audits
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join()
        for fd in (self._fd, self._stop_r, self._stop_w):
            os.close(fd)
        with _active_lock:
            _active_audits -= 1

    def __enter__(self) -> DenialAudit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn("DenialAudit was not finished or closed", ResourceWarning, stacklevel=1)
            self.close()


__all__ = [
    "ALLOWED_DIFFERENCES", "Arg", "BAD_ARCH_ACTION", "COMPAT_ARCHES", "DEFAULT_PROFILE",
    "DenialAudit", "Rule", "SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO", "SCMP_ACT_KILL_PROCESS",
    "SCMP_ACT_KILL_THREAD", "SCMP_ACT_LOG", "SCMP_ACT_TRAP", "SCMP_CMP_EQ", "SCMP_CMP_GE",
    "SCMP_CMP_GT", "SCMP_CMP_LE", "SCMP_CMP_LT", "SCMP_CMP_MASKED_EQ", "SCMP_CMP_NE",
    "SeccompProfile", "bpf_memfd", "compile_bpf", "filter_arches", "syscall_name",
]
