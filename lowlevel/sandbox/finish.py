"""A run's end: the :class:`~lowlevel.sandbox.result.Result` once the sandbox is gone, or the
error of a program that never started (the guard's report, bwrap's stderr, the cgroup's OOM kill).
"""

from __future__ import annotations

import errno
import os
import signal
import time

from lowlevel.errors import CommitIncompleteError, LaunchError, LowlevelError, UnsupportedError, WorkspaceError
from lowlevel.host import cgroups as _cgroups
from lowlevel.host import landlock as _landlock
from lowlevel.sandbox.failures import (
    PROCESS_LIMIT_HINT,
    ExecError,
    classify_setup_failure,
    network_denial_note,
    pids_note,
)
from lowlevel.sandbox.prepare import RunPrepare
from lowlevel.sandbox.result import Result, classify_kill, decode_exit, wait_status_exit
from lowlevel.spec import limits as _limits
from lowlevel.spec.report import WARNING_PREFIX
from lowlevel.workspace import overlay as _overlay

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any


class RunFinish(RunPrepare):
    """The end of a run (see the module docstring)."""

    # -- 5. finish -----------------------------------------------------------------------
    def result(self) -> Result:
        """Build the Result once bwrap is reaped and the pipes are drained; then commit or discard
        the run's changes (:meth:`finish_cow`).

        Raises:
            ExecError, LaunchError, UnsupportedError: the program never started (the guard's or
                bwrap's report, :meth:`_verdict`).
            CommitConflictError, CommitIncompleteError: see :meth:`finish_cow`.
        """
        rep = self.read_guard_report()
        stats: _cgroups.CgroupStats | None = None
        if self.cgroup is not None:
            try:
                stats = self.cgroup.stats()
            except OSError as err:
                self.notes.append(f"cgroup figures unavailable: {err}")
        exit_code, term, killed_by = self._verdict(rep, stats)
        out, out_t, out_d = self.out.value()
        errout, err_t, err_d = self.err.value()
        changes = self._final_changes()  # the sandbox is dead: its writes are final
        landlock_abi = rep.abi if rep is not None and rep.started else None
        enforced, denials, network = self._enforced(rep, landlock_abi, exit_code, errout)
        result = Result(
            exit_code=exit_code, term_signal=term, timed_out=self.timed_out, killed_by=killed_by,
            stdout=out, stderr=errout, stdout_truncated=out_t, stderr_truncated=err_t,
            stdout_dropped_bytes=out_d, stderr_dropped_bytes=err_d,
            wall_time_s=(self.t_end or time.monotonic()) - self.t0,
            cpu_user_s=stats.cpu_user_s if stats else None, cpu_system_s=stats.cpu_system_s if stats else None,
            peak_memory_bytes=stats.peak_memory_bytes if stats else None,
            max_rss_bytes=(self.rusage.ru_maxrss * 1024) if self.rusage is not None else None,
            oom_kills=stats.oom_kills if stats else None,
            limits_enforced=enforced, changes=changes, workspace=self.workspace,
            notes=tuple(self.notes), argv=tuple(self.full_argv), seccomp_denials=denials, network=network,
            landlock_abi=landlock_abi,
        )
        if self.cow:
            try:
                self.finish_cow(success=exit_code == 0 and killed_by is None, result=result)
            except (_overlay.CommitConflictError, CommitIncompleteError):
                raise
            except WorkspaceError as err:
                self.notes.append(f"{WARNING_PREFIX}{err}")
            result.notes = tuple(self.notes)
        return result

    def _verdict(self, rep: _landlock.GuardReport | None,
                 stats: _cgroups.CgroupStats | None) -> tuple[int, int | None, str | None]:
        """``(exit_code, term_signal, killed_by)`` of the program; raises when it never started.

        A list of cases, in order: the guard could not start it; the memory cgroup's OOM killer
        took bwrap or the anchor; the supervisor was killed from outside while it ran; bwrap's
        setup failed; else the program's own end, from the guard's report (its exact wait status)
        or bwrap's exit code.
        """
        docs = self._docs()
        exit_doc = next((d for d in docs if "exit-code" in d), None)
        if rep is not None and rep.fail_stage is not None:
            raise self._guard_failure(rep)
        unexplained = exit_doc is None and not self.timed_out and self.killed_by is None
        if unexplained and stats is not None and stats.oom_kills:
            # The memory cgroup's OOM killer took bwrap or the anchor instead of the program (its
            # files in the tmpfs layers are charged to the run but belong to no process's RSS):
            # a verdict on the program's memory use, not a setup failure (issue 25).
            if rep is not None and not rep.started:
                raise LaunchError(f"the memory limit (memory_bytes={self.policy.limits.memory_bytes}) is too small "
                                  "for the sandbox's own setup: the memory cgroup's OOM killer killed bwrap before "
                                  "the program started; raise memory_bytes", argv=self.full_argv, errno=errno.ENOMEM)
            self.killed_by = "memory"
            self.notes.append(_limits.memory_kill_note(self.policy.limits, "bwrap or lowlevel's anchor (not the "
                                                       "program), the sandbox's outer processes"))
        elif unexplained and self._program_started(rep):
            # bwrap reported its child (or the guard its program) started, then died without an
            # exit code: the anchor or bwrap was killed from outside while the program ran (the
            # program died with them: PID namespace). A killed program, not a setup failure, so
            # its output and workspace are delivered (issue 23).
            self.killed_by = "signal"
            self.notes.append("the sandbox's supervisor (lowlevel's anchor or bwrap, outside the sandbox) was "
                              "killed while the program ran; the program was killed with it")
        elif unexplained:
            stderr, _, _ = self.err.value()
            if self.guard and b"execvp /proc/self/fd/" in stderr:
                raise LaunchError("bwrap could not execute lowlevel's guard (lowlevel/_lowlevel_guard): "
                                  f"{stderr.decode('utf-8', 'replace').strip()}", argv=self.full_argv)
            raise classify_setup_failure(stderr, self.full_argv, self.command)
        term: int | None
        if rep is not None and rep.wait_status is not None:
            # The guard's report: the program's own wait status, a fact (bwrap's exit code says
            # 152 both for "exit 152" and for death by SIGXCPU).
            exit_code, term = wait_status_exit(rep.wait_status)
        else:
            exit_code = int(exit_doc["exit-code"]) if exit_doc is not None else 128 + signal.SIGKILL
            # Without a guard report (the sandbox was killed, or no guard) the code is bwrap's;
            # with a guard, a code above 128 then is the guard's own death by that signal: the
            # guard exits above 128 on its own only after reporting.
            term = decode_exit(exit_code)
            if rep is not None and rep.started and exit_doc is not None and self.killed_by is None:
                if stats is not None and stats.oom_kills:
                    self.notes.append(_limits.memory_kill_note(self.policy.limits, "lowlevel's guard (the program's "
                                                               "parent inside the sandbox), not the program"))
                else:
                    self.notes.append("the guard (the program's parent inside the sandbox) ended before reporting "
                                      f"the program's end (bwrap exit code {exit_code}); the sandbox was torn down")
        killed_by = self.killed_by or self._killed_by(exit_code, term, stats)
        if killed_by == "memory" and not any("OOM killer" in n for n in self.notes):
            self.notes.append(_limits.memory_kill_note(self.policy.limits))
        return exit_code, term, killed_by

    def _enforced(self, rep: _landlock.GuardReport | None, landlock_abi: int | None, exit_code: int,
                  errout: bytes) -> tuple[tuple[str, ...], tuple[str, ...] | None, Any]:
        """``(limits_enforced, seccomp_denials, network)``, with the notes they bring."""
        enforced = tuple(self.rlimits_applied) + tuple(
            f"cgroup:{c}" for c in (self.cgroup.enforced if self.cgroup is not None else ()))
        if self.seccomp_loaded:
            enforced += ("seccomp",)
        if landlock_abi:
            enforced += ("landlock",)
        elif rep is not None and rep.started and self.policy.landlock is not False:
            self.notes.append("Landlock not applied: " + _landlock.describe(0))
        net_note = network_denial_note(self.policy, landlock_abi, exit_code, errout)
        if net_note:
            self.notes.append(net_note)
        denials = None
        if self.audit is not None:
            denials = tuple(self.audit.finish())
            self.audit = None
        network = None
        if self.egress is not None:
            network, egress_notes, egress_enforced = self.egress.finish()
            self.notes.extend(egress_notes)
            enforced += egress_enforced
        return enforced, denials, network

    def _program_started(self, rep: _landlock.GuardReport | None) -> bool:
        """After READY, the sandbox was set up and then killed from outside: the guard reported
        its program started, or bwrap (the anchor's EXIT) or the anchor itself died by a signal
        (bwrap's own setup failures exit 1: never a signal)."""
        return self.ready and ((rep is not None and rep.started) or self.supervisor_signaled)

    def setup_error(self) -> LaunchError:
        """The error for a sandbox that ended before the program started (the anchor exited
        before READY): :func:`classify_setup_failure` of bwrap's stderr, unless the memory
        cgroup's OOM killer fired meanwhile, which is then the cause named (issue 25)."""
        oom = None
        if self.cgroup is not None:
            try:
                oom = self.cgroup.event_counts()[0]
            except OSError:
                pass
        if oom:
            return LaunchError(f"the memory limit (memory_bytes={self.policy.limits.memory_bytes}) is too small for "
                               "the sandbox's own setup: the memory cgroup's OOM killer killed a process of it before "
                               "the program started; raise memory_bytes", argv=self.full_argv, errno=errno.ENOMEM)
        return classify_setup_failure(self.err.value()[0], self.full_argv, self.command)

    def read_guard_report(self) -> _landlock.GuardReport | None:
        """What the guard reported (read once, after bwrap exited); None without a guard."""
        if self.guard_report is None and self.status_r is not None:
            self.guard_report = _landlock.read_report(self.status_r)
            self._close_fd("status_r")
        return self.guard_report

    def _guard_failure(self, rep: _landlock.GuardReport) -> LowlevelError:
        """The error for a program the guard could not start (exec or Landlock failed)."""
        code = rep.fail_errno or 0
        text = self.err.value()[0].decode("utf-8", "replace").strip()
        if rep.fail_stage == _landlock.STAGE_EXEC:
            return ExecError(f"{self.command[0]}: {os.strerror(code).lower()} in the sandbox", argv=self.full_argv,
                             stderr=text, errno=code)
        if rep.fail_stage == _landlock.STAGE_CWD:
            return LaunchError(f"the working directory {self.cwd!r} resolves outside the sandbox (through a magic "
                               "link such as /proc/self/fd/N, or a symlink to one: CVE-2024-21626 class); refused "
                               "before the program ran: use a directory of the sandbox's own tree, e.g. /workspace",
                               argv=self.full_argv, stderr=text, errno=code)
        if rep.fail_stage == _landlock.STAGE_CHDIR:
            return LaunchError(f"cannot change to the working directory {self.cwd!r} in the sandbox: "
                               f"{os.strerror(code)}; create it (e.g. under /workspace) or pass another cwd",
                               argv=self.full_argv, stderr=text, errno=code)
        if rep.fail_stage == _landlock.STAGE_LANDLOCK and code in (errno.EOPNOTSUPP, errno.ENOSYS):
            return UnsupportedError("landlock", "Policy(landlock='require') but Landlock is not available "
                                    "inside the sandbox", "use Policy(landlock=True) for best effort")
        stage = _landlock.STAGES.get(rep.fail_stage or 0, str(rep.fail_stage))
        hint = f" ({PROCESS_LIMIT_HINT})" if code == errno.EAGAIN else ""
        return LaunchError(f"the sandbox's guard could not start {self.command[0]!r}: {stage}: {os.strerror(code)}"
                           f"{hint}", argv=self.full_argv, stderr=text, errno=code)

    def _killed_by(self, exit_code: int, term: int | None, stats: _cgroups.CgroupStats | None) -> str | None:
        """:func:`lowlevel.sandbox.result.classify_kill` of the run from its cgroup's figures
        (the CPU total: the cgroup's); a refused fork at ``pids.max`` adds :func:`pids_note`."""
        if stats is not None and not stats.oom_kills and stats.pids_limit_hit:
            self.notes.append(pids_note(self.policy.limits.pids, exit_code, term))
        return classify_kill(term=term, oom=bool(stats is not None and stats.oom_kills),
                             pids_hit=bool(stats is not None and stats.pids_limit_hit),
                             cpu_used_s=None if stats is None else (stats.cpu_user_s or 0) + (stats.cpu_system_s or 0),
                             cpu_limit_s=self.policy.limits.cpu_s, rlimit_cpu="RLIMIT_CPU" in self.rlimits_applied)


__all__ = ["RunFinish"]
