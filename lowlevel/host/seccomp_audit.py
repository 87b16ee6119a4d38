"""The opt-in seccomp denial report: which syscalls a log-mode run tripped, read from the kernel log.

One concept: :class:`DenialAudit`, attributing ``audit: type=1326`` records in ``/dev/kmsg`` to a
sandbox by its PID namespace. The profile's log mode is :meth:`lowlevel.spec.seccomp.SeccompProfile.with_log`;
names come from libseccomp through :mod:`lowlevel.host.seccomp_filter`.

Source: seccomp(2) SECCOMP_RET_LOG (Linux 4.14), /proc/sys/kernel/seccomp/actions_logged;
Documentation/ABI/testing/dev-kmsg; kernel/auditsc.c audit_seccomp.
"""

from __future__ import annotations

import errno
import os
import re
import select
import threading
import warnings

from lowlevel.errors import UnsupportedError
from lowlevel.host.seccomp_filter import native_arch, syscall_name
from lowlevel.spec.seccomp import (ARCH_NAMES, SCMP_ACT_KILL_PROCESS, SCMP_ACT_KILL_THREAD, SCMP_ACT_LOG,
                                   SCMP_ARCH_X86_64)

#: An audit record of a seccomp action (compiled on first use, by re's cache: not at import).
_AUDIT_RE = (rb"type=1326 .*? pid=(?P<pid>\d+) .*? arch=(?P<arch>[0-9a-f]+) syscall=(?P<nr>\d+) "
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
        m = re.search(_AUDIT_RE, rec)
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
        if arch != native_arch():
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


__all__ = ["DenialAudit"]
