"""Unit tests for lowlevel.spec.seccomp, lowlevel.host.seccomp_filter and lowlevel.host.seccomp_audit: no
sandbox, no processes.

The compiled BPF is checked twice: against pyseccomp's export of the same table (byte for
byte, an independent build through ctypes), and by simulating the program over a table of
(arch, syscall, args) -> action, as libseccomp's own ``*.tests`` and minijail's
``bpf.simulate`` do.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

import pytest

from lowlevel import errors

from lowlevel.host import seccomp_audit, seccomp_filter
from lowlevel.spec import seccomp
from lowlevel.spec.seccomp import (DEFAULT_PROFILE, SCMP_ACT_ALLOW, SCMP_ACT_ERRNO, SCMP_ACT_KILL_PROCESS,
                              SCMP_ACT_LOG, SCMP_ARCH_X86, SCMP_ARCH_X86_64, Arg, Rule, SeccompProfile)

from helpers.hygiene import fd_numbers

pyseccomp = pytest.importorskip("pyseccomp")

EPERM = SCMP_ACT_ERRNO(errno.EPERM)
ENOSYS = SCMP_ACT_ERRNO(errno.ENOSYS)
EAFNOSUPPORT = SCMP_ACT_ERRNO(errno.EAFNOSUPPORT)

CUSTOM = SeccompProfile("custom", (
    Rule("getpid", SCMP_ACT_ERRNO(errno.ECONNREFUSED)),
    Rule("write", EPERM, (Arg(0, seccomp.SCMP_CMP_GE, 100),)),
    Rule("ioctl", SCMP_ACT_LOG, (Arg(1, seccomp.SCMP_CMP_MASKED_EQ, 0xFFFF, 0x5401),)),
    Rule("vm86", EPERM),
)).with_extra_deny("memfd_create")


# --- BPF simulation --------------------------------------------------------------------------

def simulate(bpf: bytes, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """Run a seccomp classic-BPF program over one struct seccomp_data; return the action."""
    a6 = list(args) + [0] * (6 - len(args))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *a6)
    prog = [struct.unpack("<HBBI", bpf[i:i + 8]) for i in range(0, len(bpf), 8)]
    acc = x = 0
    mem = [0] * 16
    pc = 0
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        cls = code & 0x07
        if cls == 0x00:  # BPF_LD
            mode = code & 0xE0
            if mode == 0x20:  # ABS, W
                acc = struct.unpack_from("<I", data, k)[0]
            elif mode == 0x00:  # IMM
                acc = k
            elif mode == 0x60:  # MEM
                acc = mem[k]
            else:
                raise AssertionError(f"unsupported ld {code:#x}")
        elif cls == 0x01:  # BPF_LDX
            x = mem[k] if code & 0xE0 == 0x60 else k
        elif cls == 0x02:  # BPF_ST
            mem[k] = acc
        elif cls == 0x03:  # BPF_STX
            mem[k] = x
        elif cls == 0x04:  # BPF_ALU
            op, src = code & 0xF0, (x if code & 0x08 else k)
            acc = {0x50: acc & src, 0x40: acc | src, 0x00: (acc + src), 0x10: (acc - src)}[op] & 0xFFFFFFFF
        elif cls == 0x05:  # BPF_JMP
            op, src = code & 0xF0, (x if code & 0x08 else k)
            if op == 0x00:
                pc += k
                continue
            cond = {0x10: acc == src, 0x20: acc > src, 0x30: acc >= src, 0x40: bool(acc & src)}[op]
            pc += jt if cond else jf
        elif cls == 0x06:  # BPF_RET
            return acc if code & 0x18 == 0x10 else k
        elif cls == 0x07:  # BPF_MISC
            if code & 0xF8 == 0x00:
                x = acc
            else:
                acc = x
        else:
            raise AssertionError(f"unsupported insn {code:#x}")


#: i386 has socket(2) as a direct syscall since Linux 4.3; libseccomp names the multiplexed one.
I386_DIRECT = {"socket": 359}


def nr(arch: int, name: str) -> int:
    if arch == SCMP_ARCH_X86 and name in I386_DIRECT:
        return I386_DIRECT[name]
    n = pyseccomp.resolve_syscall(arch, name)
    assert n >= 0, (arch, name)
    return n


@pytest.fixture(scope="module")
def bpf() -> bytes:
    """The default profile with the i386 entry point admitted (``compat_32bit=True``), so the
    rule decisions can be checked on both ABIs; the default filter kills i386 calls
    (test_i386_is_killed_unless_compat_32bit)."""
    return seccomp_filter.compile_bpf(DEFAULT_PROFILE, compat_32bit=True)


@pytest.fixture(scope="module")
def bpf64() -> bytes:
    """The default profile as runs get it: native arch only."""
    return seccomp_filter.compile_bpf(DEFAULT_PROFILE)


ARCHES = [pytest.param(SCMP_ARCH_X86_64, id="x86_64"), pytest.param(SCMP_ARCH_X86, id="i386")]
HIGH = 0xDEADBEEF00000000


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name,args,action", [
    # every whole-syscall row denies with EPERM (clone3: ENOSYS)
    *[(r.syscall, (), r.action) for r in DEFAULT_PROFILE.rules if not r.args
      and r.syscall not in ("vm86", "vm86old", "umount", "stime")],
    ("ioctl", (0, 0x5412), EPERM),                       # TIOCSTI
    ("ioctl", (0, 0x541C), EPERM),                       # TIOCLINUX
    ("ioctl", (0, 0x5423), EPERM),                       # TIOCSETD
    ("ioctl", (0, 0x5424), SCMP_ACT_ALLOW),              # TIOCGETD
    ("ioctl", (0, 0x540C), SCMP_ACT_ALLOW),              # TIOCEXCL (harmless on a pty of our own)
    ("ioctl", (0, 0x5401), SCMP_ACT_ALLOW),              # TCGETS
    ("ioctl", (0, 0x5412 | 0x10000), SCMP_ACT_ALLOW),    # near miss
    ("clone", (0x10000000 | 0x11,), EPERM),              # CLONE_NEWUSER|SIGCHLD
    ("clone", (0x01200011,), SCMP_ACT_ALLOW),            # fork()'s flags
    ("clone", (0x003D0F00,), SCMP_ACT_ALLOW),            # pthread_create's flags
    ("personality", (0,), SCMP_ACT_ALLOW),
    ("personality", (8,), SCMP_ACT_ALLOW),
    ("personality", (0x20000,), SCMP_ACT_ALLOW),
    ("personality", (0x20008,), SCMP_ACT_ALLOW),
    ("personality", (0xFFFFFFFF,), SCMP_ACT_ALLOW),
    ("personality", (0x0040000,), EPERM),               # ADDR_NO_RANDOMIZE
    ("personality", (0x0400000,), EPERM),               # READ_IMPLIES_EXEC
    ("personality", (0x7FFFFFFF,), EPERM),
    ("personality", (0xFFFFFFFE,), EPERM),
    ("personality", (0x80000000,), EPERM),
    ("socket", (1,), SCMP_ACT_ALLOW),
    ("socket", (2,), SCMP_ACT_ALLOW),
    ("socket", (10,), SCMP_ACT_ALLOW),
    ("socket", (16,), SCMP_ACT_ALLOW),
    ("socket", (17,), EAFNOSUPPORT),                    # AF_PACKET
    ("socket", (38,), EAFNOSUPPORT),                    # AF_ALG
    ("socket", (40,), EAFNOSUPPORT),                    # AF_VSOCK
    ("socket", (3,), EAFNOSUPPORT),                     # AF_AX25
    ("getpid", (), SCMP_ACT_ALLOW),
    ("execve", (), SCMP_ACT_ALLOW),
    ("wait4", (), SCMP_ACT_ALLOW),
    ("exit_group", (), SCMP_ACT_ALLOW),
    ("write", (), SCMP_ACT_ALLOW),
])
def test_default_profile_decisions(bpf: bytes, arch: int, name: str, args: tuple[int, ...],
                                   action: int) -> None:
    if pyseccomp.resolve_syscall(arch, name) < 0 and not (arch == SCMP_ARCH_X86 and name in I386_DIRECT):
        pytest.skip(f"{name} does not exist on this arch")
    assert simulate(bpf, arch, nr(arch, name), args) == action


@pytest.mark.parametrize("name,args,action", [
    ("ioctl", (0, HIGH | 0x5412), EPERM),           # CVE-2019-10063: high bits must not slip past
    ("ioctl", (0, HIGH | 0x541C), EPERM),
    ("ioctl", (0, HIGH | 0x5423), EPERM),           # TIOCSETD
    ("ioctl", (0, HIGH | 0x5401), SCMP_ACT_ALLOW),
    ("clone", (HIGH | 0x10000011,), EPERM),
    ("personality", (HIGH | 0,), SCMP_ACT_ALLOW),   # the kernel takes an unsigned int
    ("personality", (HIGH | 0x40000,), EPERM),
    ("socket", (HIGH | 2,), EAFNOSUPPORT),          # 64-bit GE: high bits deny
    ("socket", ((1 << 64) - 1,), EAFNOSUPPORT),     # (int)-1 sign-extended
])
def test_default_profile_high_bits(bpf: bytes, name: str, args: tuple[int, ...], action: int) -> None:
    assert simulate(bpf, SCMP_ARCH_X86_64, nr(SCMP_ARCH_X86_64, name), args) == action


def test_i386_only_and_socketcall(bpf: bytes) -> None:
    for name in ("vm86", "vm86old", "umount", "stime"):
        assert simulate(bpf, SCMP_ARCH_X86, nr(SCMP_ARCH_X86, name)) == EPERM, name
    # the family of socketcall(SYS_SOCKET, args*) is in memory: libseccomp denies it whole
    assert simulate(bpf, SCMP_ARCH_X86, nr(SCMP_ARCH_X86, "socketcall"), (1,)) == EAFNOSUPPORT
    assert simulate(bpf, SCMP_ARCH_X86, nr(SCMP_ARCH_X86, "socketcall"), (3,)) == SCMP_ACT_ALLOW


@pytest.mark.parametrize("name", ["getpid", "ptrace", "write", "exit_group"])
def test_i386_is_killed_unless_compat_32bit(bpf64: bytes, bpf: bytes, name: str) -> None:
    assert simulate(bpf64, SCMP_ARCH_X86, nr(SCMP_ARCH_X86, name)) == SCMP_ACT_KILL_PROCESS
    assert simulate(bpf64, SCMP_ARCH_X86_64, nr(SCMP_ARCH_X86_64, name)) != SCMP_ACT_KILL_PROCESS
    # control: with compat_32bit the same call meets the rules
    assert simulate(bpf, SCMP_ARCH_X86, nr(SCMP_ARCH_X86, name)) != SCMP_ACT_KILL_PROCESS
    assert seccomp_filter.filter_arches(SCMP_ARCH_X86_64) == (SCMP_ARCH_X86_64,)
    assert seccomp_filter.filter_arches(SCMP_ARCH_X86_64, True) == (SCMP_ARCH_X86_64, SCMP_ARCH_X86)


@pytest.mark.parametrize("name", ["getpid", "ptrace", "write"])
def test_x32_and_unknown_arches_are_killed(bpf: bytes, name: str) -> None:
    assert simulate(bpf, SCMP_ARCH_X86_64, nr(SCMP_ARCH_X86_64, name) | 0x40000000) == SCMP_ACT_KILL_PROCESS
    assert simulate(bpf, seccomp.SCMP_ARCH_AARCH64, 1) == SCMP_ACT_KILL_PROCESS
    assert simulate(bpf, seccomp.SCMP_ARCH_X32, 1) == SCMP_ACT_KILL_PROCESS


def test_log_mode_turns_denials_into_log() -> None:
    bpf = seccomp_filter.compile_bpf(DEFAULT_PROFILE.with_log())
    a = SCMP_ARCH_X86_64
    assert simulate(bpf, a, nr(a, "ptrace")) == SCMP_ACT_LOG
    assert simulate(bpf, a, nr(a, "clone3")) == SCMP_ACT_LOG
    assert simulate(bpf, a, nr(a, "ioctl"), (0, 0x5412)) == SCMP_ACT_LOG
    assert simulate(bpf, a, nr(a, "getpid")) == SCMP_ACT_ALLOW
    assert simulate(bpf, a, nr(a, "getpid") | 0x40000000) == SCMP_ACT_KILL_PROCESS


# --- the oracle: pyseccomp builds the same table independently -----------------------------------

def pyseccomp_export(profile: SeccompProfile, compat_32bit: bool) -> bytes:
    f = pyseccomp.SyscallFilter(profile.effective_default_action())
    f.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.KILL_PROCESS)
    if compat_32bit:
        f.add_arch(pyseccomp.Arch.X86)
    for action, name, args in profile.effective_rules():
        f.add_rule(action, name, *(pyseccomp.Arg(a.index, a.op, a.datum_a, a.datum_b) for a in args))
    fd = os.memfd_create("oracle", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as fh:
        f.export_bpf(fh)
        fh.seek(0)
        return fh.read()


@pytest.mark.skipif(pyseccomp.system_arch() != pyseccomp.Arch.X86_64, reason="oracle written for x86_64")
@pytest.mark.parametrize("profile", [DEFAULT_PROFILE, CUSTOM, DEFAULT_PROFILE.with_log(),
                                     DEFAULT_PROFILE.with_extra_deny("getpid", "ioctl")],
                         ids=["default", "custom", "default+log", "default+deny"])
@pytest.mark.parametrize("compat_32bit", [False, True], ids=["x86_64", "x86_64+i386"])
def test_native_export_equals_pyseccomp(profile: SeccompProfile, compat_32bit: bool) -> None:
    assert seccomp_filter._native is not None, "build the extension: python native/build_seccomp.py"
    assert seccomp_filter.compile_bpf(profile, compat_32bit=compat_32bit) == pyseccomp_export(profile, compat_32bit)


def test_forced_fallback_warns_and_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    native = seccomp_filter.compile_bpf(CUSTOM)
    monkeypatch.setattr(seccomp_filter, "_native", None)
    with pytest.warns(RuntimeWarning, match="pyseccomp"):
        fallback = seccomp_filter.compile_bpf(CUSTOM)
    assert fallback == native
    assert seccomp_filter._backend().__class__.__name__ == "_PySeccompBackend"
    with pytest.warns(RuntimeWarning):  # every call warns, cached or not
        seccomp_filter.compile_bpf(CUSTOM)


# --- native smoke, constants ---------------------------------------------------------------------

def test_native_smoke_and_constants() -> None:
    from lowlevel.host._native import ffi, lib
    assert lib.ll_act_errno(errno.EPERM) == SCMP_ACT_ERRNO(errno.EPERM)
    assert lib.SCMP_ACT_ALLOW == SCMP_ACT_ALLOW
    assert lib.SCMP_ACT_LOG == SCMP_ACT_LOG
    assert lib.SCMP_ACT_KILL_PROCESS == SCMP_ACT_KILL_PROCESS
    assert lib.SCMP_ACT_KILL_THREAD == seccomp.SCMP_ACT_KILL_THREAD
    assert lib.SCMP_ACT_TRAP == seccomp.SCMP_ACT_TRAP
    assert lib.SCMP_CMP_MASKED_EQ == seccomp.SCMP_CMP_MASKED_EQ
    assert lib.SCMP_CMP_NE == seccomp.SCMP_CMP_NE and lib.SCMP_CMP_GE == seccomp.SCMP_CMP_GE
    assert lib.SCMP_ARCH_X86_64 == SCMP_ARCH_X86_64 and lib.SCMP_ARCH_X86 == SCMP_ARCH_X86
    assert lib.SCMP_ARCH_X32 == seccomp.SCMP_ARCH_X32
    assert lib.LOWLEVEL_HAS_EXPORT_BPF_MEM == (1 if (lib.SCMP_VER_MAJOR, lib.SCMP_VER_MINOR) >= (2, 6) else 0)
    buf = ffi.new("char[]", 64)
    assert lib.ll_syscall_name(SCMP_ARCH_X86, 26, buf, 64) == 0 and ffi.string(buf) == b"ptrace"
    assert lib.ll_syscall_name(SCMP_ARCH_X86, 99999, buf, 64) == -errno.ENOENT


# --- the profile object ----------------------------------------------------------------------------

def test_profile_is_hashable_and_immutable() -> None:
    again = SeccompProfile("default", tuple(DEFAULT_PROFILE.rules))
    assert again == DEFAULT_PROFILE and hash(again) == hash(DEFAULT_PROFILE)
    assert {DEFAULT_PROFILE: 1}[again] == 1
    with pytest.raises(AttributeError):
        DEFAULT_PROFILE.name = "x"  # type: ignore[misc]
    prose = SeccompProfile("default", tuple(Rule(r.syscall, r.action, r.args, "other words")
                                            for r in DEFAULT_PROFILE.rules))
    assert prose == DEFAULT_PROFILE


def test_default_profile_covers_the_issue_list() -> None:
    whole = {r.syscall: r.action for r in DEFAULT_PROFILE.rules if not r.args}
    for name in ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "bpf",
                 "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "io_uring_setup",
                 "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load", "init_module",
                 "finit_module", "delete_module", "mount", "umount2", "pivot_root", "move_mount",
                 "open_tree", "fsopen", "fsmount", "fspick", "swapon", "swapoff", "reboot", "acct",
                 "quotactl", "syslog", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm",
                 "uselib", "vhangup", "setns", "unshare"):
        assert whole.get(name) == EPERM, name
    assert whole["clone3"] == ENOSYS
    for r in DEFAULT_PROFILE.rules:
        assert r.reason and r.source, r.syscall


def test_with_extra_deny_and_with_log() -> None:
    p = DEFAULT_PROFILE.with_extra_deny("getpid", "clone3", "getpid")
    assert p.name == "default+deny(getpid,clone3)"
    assert [r.action for r in p.rules if r.syscall == "clone3"] == [EPERM]
    assert DEFAULT_PROFILE.with_extra_deny() is DEFAULT_PROFILE
    log = DEFAULT_PROFILE.with_log()
    assert log.log and log.name == "default+log" and log.with_log() is log
    assert {a for a, _, _ in log.effective_rules()} == {SCMP_ACT_LOG}
    assert hash(log) != hash(DEFAULT_PROFILE)


@pytest.mark.parametrize("make,match", [
    # A name libseccomp does not know passes the spec's shape check and is refused where the
    # table meets libseccomp: compile_bpf, before any sandbox starts.
    (lambda: seccomp_filter.compile_bpf(SeccompProfile("x", (Rule("no_such_call", EPERM),))),
     "unknown syscall 'no_such_call'"),
    (lambda: seccomp_filter.compile_bpf(DEFAULT_PROFILE.with_extra_deny("ptrace2")), "unknown syscall 'ptrace2'"),
    (lambda: DEFAULT_PROFILE.with_extra_deny("../etc"), "man-2 name"),
    (lambda: SeccompProfile("x", (Rule("getpid", SCMP_ACT_ALLOW),)), "default action"),
    (lambda: SeccompProfile("", ()), "non-empty"),
    (lambda: Arg(6, seccomp.SCMP_CMP_EQ, 0), "index"),
    (lambda: Arg(0, 99, 0), "op"),
    (lambda: Arg(0, seccomp.SCMP_CMP_EQ, 1 << 64), "64-bit"),
])
def test_validation_errors(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.PolicyError, match=match):
        make()


def test_compile_is_cached_and_checked() -> None:
    a = seccomp_filter.compile_bpf(CUSTOM)
    assert seccomp_filter.compile_bpf(CUSTOM) is a
    assert len(a) % 8 == 0 and a
    assert seccomp_filter.compile_bpf(CUSTOM.with_log()) != a
    with pytest.raises(TypeError):
        seccomp_filter.compile_bpf("default")  # type: ignore[arg-type]


def test_compile_failure_is_a_seccomp_error() -> None:
    # two rules for one syscall whose actions conflict on the same argument test: libseccomp -EEXIST
    bad = SeccompProfile("conflict", (Rule("getppid", EPERM, (Arg(0, seccomp.SCMP_CMP_EQ, 1),)),
                                      Rule("getppid", ENOSYS, (Arg(0, seccomp.SCMP_CMP_EQ, 1),))))
    with pytest.raises(errors.SeccompError) as ei:
        seccomp_filter.compile_bpf(bad)
    assert ei.value.operation.startswith("seccomp_rule_add(getppid")
    assert ei.value.errno == errno.EEXIST
    assert "File exists" in str(ei.value)


# --- memfd ----------------------------------------------------------------------------------------

def test_bpf_memfd_is_sealed_cloexec_at_offset_zero(bpf: bytes) -> None:
    before = fd_numbers()
    fd = seccomp_filter.bpf_memfd(bpf)
    try:
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & want == want
        assert os.pread(fd, len(bpf) + 8, 0) == bpf
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 8, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    assert fd_numbers() == before


@pytest.mark.parametrize("bad", [b"", b"1234567", b"x" * 12])
def test_bpf_memfd_rejects_partial_programs(bad: bytes) -> None:
    before = fd_numbers()
    with pytest.raises(ValueError, match="8-byte"):
        seccomp_filter.bpf_memfd(bad)
    assert fd_numbers() == before


# --- denial audit parsing -------------------------------------------------------------------------

def test_denial_audit_parses_and_attributes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    kmsg = tmp_path / "kmsg"
    kmsg.write_bytes(b"old record before open\n")
    audit = seccomp_audit.DenialAudit(str(kmsg))
    try:
        audit._pidns = os.stat("/proc/self/ns/pid").st_ino
        me = os.getpid()
        rec = ("5,1,1,-;audit: type=1326 audit(1.2:3): auid=4294967295 uid=0 gid=0 ses=4294967295 "
               f"pid={me} comm=\"x\" exe=\"/x\" sig=0 arch=c000003e syscall=101 compat=0 "
               "ip=0x1 code=0x7ffc0000")
        audit._take(rec.encode())
        audit._take(rec.replace("syscall=101", "syscall=26").replace("c000003e", "40000003").encode())
        audit._take(rec.replace("code=0x7ffc0000", "code=0x7fff0000").replace("=101", "=102").encode())
        audit._take(rec.replace(f"pid={me}", "pid=999999999").replace("=101", "=165").encode())
        audit._take(b"unrelated line")
        names = audit.finish()
    finally:
        audit.close()
    # 101 ptrace (x86_64), 26 ptrace (i386), the ALLOW record ignored, the dead pid's 165 (mount)
    # kept because this is the only audit running
    assert names == ("mount", "ptrace", "x86:ptrace")


def test_denial_audit_unreadable_is_unsupported(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.UnsupportedError) as ei:
        seccomp_audit.DenialAudit(str(tmp_path / "missing"))
    assert ei.value.feature == "seccomp-audit"
