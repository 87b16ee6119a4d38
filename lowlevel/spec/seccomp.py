"""Seccomp rule tables as data: the ``SCMP_*`` values, :class:`Arg`, :class:`Rule`,
:class:`SeccompProfile` and the reviewed default table (each row with its reason and source).

No libseccomp here: the tables are compiled to BPF, and their syscall names resolved, by
:mod:`lowlevel.host.seccomp_filter` (``compile_bpf``, ``bpf_memfd``); a log-mode run's report is
:mod:`lowlevel.host.seccomp_audit`.

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
:func:`lowlevel.host.seccomp_filter.compile_bpf` ``(profile, compat_32bit=True)``
(``Policy(compat_32bit=True)``) the compat arch
(x86_64 + ``x86``; aarch64 + ``arm``, :data:`COMPAT_ARCHES`) is listed with the same rules, so
32-bit binaries (``gcc -m32`` output, old toolchains) run and meet the same walls, as Docker's
default profile and flatpak's multiarch filter do. x32 is never listed, so an x32 call (bit 30
set) takes the bad-arch action: libseccomp's x86_64 code jumps there for any
``nr >= 0x40000000`` (except -1). We kill x32 instead of filtering it because no distribution
ships x32 user space (Debian's kernel does not even build ``CONFIG_X86_X32_ABI``), while its
table carries aliases (numbers 512-547) a deny-list could miss; a dead ABI costs nothing to
close. Any other arch a CPU could report is also killed.

What the filter can't see: arguments in memory (``clone3``'s flags, i386 ``socketcall``'s
socket family), io_uring operations (they never pass through seccomp), syscalls added to
the kernel after this table (a deny-list lets them through; the table lists what we chose).

Public API::

    SeccompProfile(name, rules, default_action=SCMP_ACT_ALLOW, log=False)   frozen, hashable
        .with_extra_deny(*syscalls) -> SeccompProfile
        .with_log() -> SeccompProfile
    DEFAULT_PROFILE

Syscall names are checked here for their shape (a man-2 name); whether libseccomp knows them
is checked where the table is compiled (:func:`lowlevel.host.seccomp_filter.compile_bpf`, before
a sandbox starts), so building a profile never loads libseccomp.

Sources: seccomp(2); seccomp_rule_add(3), seccomp_arch_add(3) (libseccomp 2.5); bwrap(1)
``--seccomp``; flatpak ``common/flatpak-run.c`` ``setup_seccomp``; moby
``profiles/seccomp/default.json``; Documentation/userspace-api/seccomp_filter.rst.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import field, replace

from lowlevel._dataclass import dataclass
from lowlevel.errors import PolicyError

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
            call the profile would have stopped (see
            :class:`lowlevel.host.seccomp_audit.DenialAudit`). Bad-arch calls are still killed.
    Raises:
        PolicyError: a syscall name that is not a man-2 name, malformed Arg, or a rule whose
            action equals the default action (libseccomp refuses it with EACCES). A name
            libseccomp does not know is refused when the profile is compiled
            (:func:`lowlevel.host.seccomp_filter.compile_bpf`).
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
            PolicyError: a name that is not a man-2 name (one libseccomp does not know is
                refused by :func:`lowlevel.host.seccomp_filter.compile_bpf`).
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


def _check_syscall_name(name: str) -> None:
    """Raise PolicyError unless ``name`` has the shape of a man-2 syscall name."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        raise PolicyError(f"syscall name {name!r}: pass a man-2 name such as 'ptrace'")


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


_MOUNT_REASON = ("Mount table changes. bwrap drops CAP_SYS_ADMIN so the kernel says EPERM anyway; "
                 "denying them here keeps that true if a policy ever keeps capabilities. flatpak "
                 "returns ENOSYS for the new mount API (so libmount falls back to mount(2) and "
                 "reports EPERM there); we return EPERM directly: same outcome for tools.")

_IOPRIO_REASON = ("ioprio_set on anything but the caller itself (IOPRIO_WHO_PROCESS with who 0: the calling "
                  "thread): one uid runs every process of a sandbox, so a command of a Session could put the "
                  "init, and every command after it, in the idle I/O class (IOPRIO_WHO_USER covers the whole "
                  "uid). ionice -c3 CMD sets the command's own; ionice -p PID fails with EPERM. Unlike "
                  "setpriority(2) and sched_setaffinity(2), which threads call on their own thread ids, "
                  "per-thread I/O priorities go through who 0. flatpak and Docker have no rule.")
_IOPRIO_SOURCE = ("ioprio_set(2) (IOPRIO_WHO_PROCESS 1, IOPRIO_WHO_PGRP 2, IOPRIO_WHO_USER 3); lowlevel red-team "
                  "finding (issue 27)")

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
    _deny("prlimit64", "Setting another process's rlimits (pid != 0 and a new limit): every process of a "
          "sandbox runs as one uid, and prlimit(2) needs only that. A command of a Session could lower the "
          "limits of the session's init or of the next command's waiting shepherd (RLIMIT_FSIZE 0, "
          "RLIMIT_NOFILE 3: the next SPAWN's fds dropped), so a later command would start under limits "
          "the caller never set. Reading another's limits (new_limit NULL) and setting one's own "
          "(setrlimit(2), prlimit(0, ...)) stay allowed; prlimit(1) --pid on a process, even one's own "
          "pid, fails with EPERM. flatpak and Docker have no rule (one program per sandbox).",
          "prlimit(2) (permission: same real, effective and saved uid and gid); lowlevel red-team finding "
          "(issue 27)",
          args=(Arg(0, SCMP_CMP_NE, 0), Arg(2, SCMP_CMP_NE, 0))),
    _deny("ioprio_set", _IOPRIO_REASON, _IOPRIO_SOURCE, args=(Arg(0, SCMP_CMP_NE, 1),)),
    _deny("ioprio_set", _IOPRIO_REASON, _IOPRIO_SOURCE, args=(Arg(1, SCMP_CMP_NE, 0),)),
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


#: The profile every run uses unless its Policy says otherwise. Its names are checked against
#: libseccomp by the test suite (tests/unit/test_hostcache.py), and by every compile.
DEFAULT_PROFILE = SeccompProfile("default", _DEFAULT_RULES)


__all__ = [
    "ALLOWED_DIFFERENCES", "ARCH_NAMES", "Arg", "BAD_ARCH_ACTION", "COMPAT_ARCHES", "DEFAULT_PROFILE", "Rule",
    "SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD", "SCMP_ACT_LOG",
    "SCMP_ACT_TRAP", "SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM", "SCMP_ARCH_X32", "SCMP_ARCH_X86", "SCMP_ARCH_X86_64",
    "SCMP_CMP_EQ", "SCMP_CMP_GE", "SCMP_CMP_GT", "SCMP_CMP_LE", "SCMP_CMP_LT", "SCMP_CMP_MASKED_EQ",
    "SCMP_CMP_NE", "SeccompProfile",
]
