"""The outcome of a sandboxed run: what the program did, never whether lowlevel failed.

The program exiting non-zero, dying on a signal, timing out or hitting a limit is a
:class:`Result`; the sandbox failing to start is a :class:`lowlevel.errors.LaunchError`.

bwrap reports the program's death by signal N as exit status 128+N (like a shell), so a
program that calls ``exit(152)`` looks the same to bwrap as one killed by SIGXCPU (bubblewrap
``propagate_exit_status``). ``term_signal`` is therefore taken from the program's own wait
status, which the run guard inside the sandbox (:mod:`lowlevel.host.landlock`) or the session init
reports; ``exit_code`` keeps the shell's 128+N convention for a death by signal N.
"""

from __future__ import annotations

import os
import signal
from dataclasses import asdict, field

from lowlevel._dataclass import dataclass
from lowlevel.spec.egress import NetworkAttempt
from lowlevel.errors import LowlevelError
from lowlevel.spec.report import bytes_fields, json_safe
from lowlevel.workspace import Changes

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: Values of :attr:`Result.killed_by`.
KILLED_BY = ("timeout", "cpu", "memory", "pids", "signal", "cancelled")


class RunFailedError(LowlevelError):
    """Raised by :meth:`Result.check` when the program did not exit 0. ``.result`` has the Result."""

    def __init__(self, result: "Result") -> None:
        why = (f"killed by {result.killed_by}" if result.killed_by else
               f"exited with status {result.exit_code}")
        super().__init__(f"sandboxed program {why}")
        self.result = result


@dataclass
class Result:
    """What one sandboxed run did.

    Attributes:
        exit_code: the program's exit status (0-255; 128+N after death by signal N).
        term_signal: the signal that killed the program (from its wait status), else None.
        timed_out: the wall-clock timeout fired and the sandbox was killed.
        killed_by: why the run died early: ``"timeout"``, ``"cpu"`` (RLIMIT_CPU),
            ``"memory"`` (the memory cgroup's OOM kill, whichever process of the sandbox it
            took), ``"pids"`` (a fork failed at pids.max and the program then died by a
            signal; one that exits with a status of its own is not "pids", a note says the
            limit was hit), ``"signal"``
            (any other signal death), ``"cancelled"`` (the caller cancelled), or None.
        stdout, stderr: captured output (bytes), capped: when over the cap, the head and tail
            are kept and the middle dropped.
        stdout_truncated, stderr_truncated: a cap applied.
        stdout_dropped_bytes, stderr_dropped_bytes: how many bytes the cap dropped.
        wall_time_s: seconds from spawn to reap (float).
        cpu_user_s, cpu_system_s: CPU seconds of the whole sandbox, from its cgroup; None
            when no cgroup applied (bwrap's parent never reaps the sandbox's processes, so
            os.wait4 cannot see them).
        peak_memory_bytes: the cgroup's peak memory (``memory.peak`` /
            ``memory.max_usage_in_bytes``), or None.
        max_rss_bytes: the largest max RSS of bwrap and the processes it waited for (the
            program's included), from bwrap's ``wait4`` rusage (``ru_maxrss``), bytes.
        oom_kills: OOM kills counted in the cgroup, or None.
        limits_enforced: what actually applied, e.g. ``("RLIMIT_CPU", "cgroup:memory", ...)``.
        changes: files added, modified and deleted in the workspace.
        workspace: host path of the workspace.
        seccomp_denials: syscall names the filter denied (audit mode only), else None.
        network: egress mode (``Policy(network=Egress(...))``) only, else None: every
            connection attempt through the proxy, in order (:class:`lowlevel.spec.egress.NetworkAttempt`:
            method, host, port, address, allowed and why, bytes up and down, error).
        notes: human-readable notes on degraded behaviour (no cgroup, etc.).
        argv: the full bwrap argv used (for records and debugging).
        landlock_abi: the Landlock ABI the program ran under (1-7; 0: none, the kernel lacks
            it or ``Policy(landlock=False)``), or None when unknown (the program never started).
    """

    exit_code: int
    term_signal: int | None = None
    timed_out: bool = False
    killed_by: str | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_dropped_bytes: int = 0
    stderr_dropped_bytes: int = 0
    wall_time_s: float = 0.0
    cpu_user_s: float | None = None
    cpu_system_s: float | None = None
    peak_memory_bytes: int | None = None
    max_rss_bytes: int | None = None
    oom_kills: int | None = None
    limits_enforced: tuple[str, ...] = ()
    changes: Changes = field(default_factory=Changes)
    workspace: str = ""
    seccomp_denials: tuple[str, ...] | None = None
    network: tuple[NetworkAttempt, ...] | None = None
    notes: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()
    landlock_abi: int | None = None

    @property
    def ok(self) -> bool:
        """True when the program exited 0 and nothing killed it."""
        return self.exit_code == 0 and self.killed_by is None

    def check(self) -> "Result":
        """Return self if :attr:`ok`, else raise :class:`RunFailedError`."""
        if not self.ok:
            raise RunFailedError(self)
        return self

    def signal_name(self) -> str | None:
        """``"SIGKILL"`` etc. for :attr:`term_signal`, or None."""
        if self.term_signal is None:
            return None
        try:
            return signal.Signals(self.term_signal).name
        except ValueError:
            return f"SIG{self.term_signal}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, lossless (:mod:`lowlevel.spec.report`): ``stdout``/``stderr`` as text, with
        ``stdout_b64``/``stderr_b64`` holding the exact bytes (base64) when they are not valid
        UTF-8 (else None); names that are not valid UTF-8 (in ``changes``, ``notes``, ``argv``,
        ``workspace``) as ``{"b64", "text"}`` objects; changes as lists."""
        d = asdict(self)
        d["stdout"], d["stdout_b64"] = bytes_fields(self.stdout)
        d["stderr"], d["stderr_b64"] = bytes_fields(self.stderr)
        d["changes"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.changes).items()}
        d["limits_enforced"] = list(self.limits_enforced)
        d["notes"] = list(self.notes)
        d["argv"] = list(self.argv)
        d["signal"] = self.signal_name()
        if self.seccomp_denials is not None:
            d["seccomp_denials"] = list(self.seccomp_denials)
        if self.network is not None:
            d["network"] = [asdict(a) for a in self.network]
        d["argv"] = d.pop("argv")  # last: ~150 lines of bwrap options after the verdict, not before it
        safe: dict[str, Any] = json_safe(d)
        return safe


def decode_exit(exit_code: int) -> int | None:
    """Return N when ``exit_code`` is bwrap's 128+N encoding of death by signal N, else None."""
    if 128 < exit_code <= 128 + 64:
        return exit_code - 128
    return None


def wait_status_exit(wait_status: int) -> tuple[int, int | None]:
    """``(exit_code, term_signal)`` of a wait status (wait(2)): the shell's 128+N for a death by
    signal N, with N as ``term_signal``; the exit status and None otherwise."""
    if os.WIFSIGNALED(wait_status):
        term = os.WTERMSIG(wait_status)
        return 128 + term, term
    return os.WEXITSTATUS(wait_status), None


def classify_kill(*, term: int | None, oom: bool, pids_hit: bool, cpu_used_s: float | None,
                  cpu_limit_s: float | None, rlimit_cpu: bool) -> str | None:
    """Why a program died when its supervisor did not kill it (:attr:`Result.killed_by`); the one
    classification of :func:`lowlevel.run` and a Session's commands.

    Args:
        term: the signal that killed it, or None (it exited).
        oom: the memory cgroup's OOM killer fired (charged to this program): ``"memory"``.
        pids_hit: a fork/clone failed at ``pids.max`` during the run. The pids limit kills
            nothing (fork fails with EAGAIN): only a death by a signal after it is ``"pids"``; a
            program that then exits on its own ended on its own (None; the caller adds
            :func:`lowlevel.sandbox.failures.pids_note`).
        cpu_used_s, cpu_limit_s: the CPU seconds it used (None: unknown) and ``Limits.cpu_s``.
        rlimit_cpu: RLIMIT_CPU was set: SIGXCPU at the soft limit, or SIGKILL at the hard one
            once the CPU used reached ``cpu_s``, is ``"cpu"``.
    Returns:
        ``"memory"``, ``"cpu"``, ``"pids"``, ``"signal"`` (any other signal) or None.
    Source: setrlimit(2) RLIMIT_CPU; the kernel's cgroup v1/v2 memory and pids controllers.
    """
    if oom:
        return "memory"
    if term == signal.SIGXCPU:
        return "cpu"
    if term == signal.SIGKILL and rlimit_cpu and cpu_limit_s is not None and cpu_used_s is not None \
            and cpu_used_s >= cpu_limit_s:
        return "cpu"
    if term is not None:
        return "pids" if pids_hit else "signal"
    return None


__all__ = ["KILLED_BY", "Result", "RunFailedError", "classify_kill", "decode_exit", "wait_status_exit"]
