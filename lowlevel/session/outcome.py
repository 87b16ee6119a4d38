"""How a session's command ended, as the caller sees it: its Result, or the error of a failed start.

One concept: turning the init's EXIT report (and the host's counts over the command's life)
into what :meth:`lowlevel.session.Session.run` returns or raises. :func:`command_result` holds the
session's copy of the exit-code/``killed_by`` classification and of the Result assembly (the one
:func:`lowlevel.run` makes in :mod:`lowlevel.sandbox.launcher`): kept apart so that it can be
switched to the sandbox's result builder in one place. :func:`start_error` names a command the
init could not start, :func:`shepherd_died_error` one whose supervisor died, and
:func:`init_death_message` says how the session itself ended.
"""

from __future__ import annotations

import errno
import os
import signal

from lowlevel import workspace as _ws
from lowlevel.errors import LaunchError, LowlevelError, SessionError
from lowlevel.sandbox.failures import ExecError, network_denial_note, pids_note
from lowlevel.sandbox.result import Result, classify_kill, wait_status_exit
from lowlevel.session import protocol as proto
from lowlevel.session.command import Command
from lowlevel.spec import limits as _limits
from lowlevel.spec.egress import NetworkAttempt
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Policy


_PROCESS_LIMIT_HINT = (": the session is at a process limit (its cgroup's pids.max, Limits(pids=...), or RLIMIT_NPROC, "
                       "which counts every process of the sandbox's uid: for an unprivileged caller, its own); wait "
                       "for commands to end, or give the Session a larger limit")


def start_error(cmd: Command, kind: int, status: int, stage: int) -> LowlevelError | None:
    """The error of a command that never ran (``kind`` EXIT_SETUP_FAILED or EXIT_SPAWN_FAILED,
    ``status`` an errno, ``stage`` a :data:`protocol.STAGES` key); None for another kind."""
    argv = list(cmd.argv)
    hint = _PROCESS_LIMIT_HINT if status == errno.EAGAIN else ""
    if status == errno.ETOOMANYREFS:
        hint = f" ({proto.TOO_MANY_REFS})"
    elif status == errno.EMFILE and kind == proto.EXIT_SPAWN_FAILED:
        hint = (": the session init's open-file limit (one fd per running command, Limits.nofile plus "
                f"{proto.INIT_NOFILE_HEADROOM}): run fewer commands at once, or give the Session a larger nofile")
    if kind == proto.EXIT_SPAWN_FAILED:
        return LaunchError(f"the session init could not start {cmd.argv[0]!r}: {os.strerror(status)}{hint}",
                           argv=argv, errno=status)
    if kind != proto.EXIT_SETUP_FAILED:
        return None
    stage_name = proto.STAGES.get(stage, str(stage))
    msg = os.strerror(status)
    if stage == proto.STAGE_CWD:
        return LaunchError(f"the working directory of {cmd.argv[0]!r} resolves outside the sandbox "
                           "(through a magic link such as /proc/self/fd/N, or a symlink to one: "
                           "CVE-2024-21626 class); refused before it ran: use a directory of the "
                           "sandbox's own tree, e.g. /workspace", argv=argv, errno=status)
    if stage_name == "execve" and status == errno.EAGAIN:
        # execve(2)'s EAGAIN: the uid is above its RLIMIT_NPROC (a process limit, not the program).
        return LaunchError(f"the session could not exec {cmd.argv[0]!r}: {msg}{hint}", argv=argv, errno=status)
    if stage_name == "execve":
        return ExecError(f"{cmd.argv[0]}: {msg.lower()} in the sandbox", argv=argv, errno=status)
    return LaunchError(f"{stage_name} failed for {cmd.argv[0]!r} in the session: {msg}", argv=argv, errno=status)


def image_removed_error(policy: Policy, error: LowlevelError) -> LowlevelError:
    """``error`` (a command that could not start), unless the session runs on an image whose
    tree is gone from the host (``lowlevel image rm`` while it ran): then the error that says
    so. The tree's absence made the command's checks fail in ways that named the wrong cause
    (its working directory "resolves outside the sandbox": a fresh-user trial)."""
    if policy.image is None or policy.rootfs is None or os.path.isdir(policy.rootfs):
        return error
    return LaunchError(f"the image this session runs on ({policy.image}) was removed from the store (`lowlevel image "
                       "rm`) while the session ran: its files are gone; close the session and start a new one "
                       "(import the image again first)", argv=list(error.argv) if isinstance(error, LaunchError) else
                       None, errno=errno.ENOENT)


def shepherd_died_error(cmd: Command, status: int) -> SessionError:
    """The error of a command whose shepherd (its supervisor in the session) died before it
    reported (EXIT_SHEPHERD_DIED, ``status`` the shepherd's wait status): killed by a command or
    the kernel, or unable to set itself up. Its processes were killed; the session goes on."""
    if os.WIFSIGNALED(status):
        return SessionError(f"the supervisor of {cmd.argv[0]!r} was killed ({status}: "
                            f"{_signal_name(os.WTERMSIG(status))}) by a command of the session or the kernel; its "
                            "processes were killed (the session goes on)", "unresponsive")
    return SessionError(f"the supervisor of {cmd.argv[0]!r} ended before it reported (wait status {status}: it could "
                        "not set itself up, e.g. out of file descriptors); its processes were killed (the session goes "
                        "on)", "unresponsive")


def init_death_message(code: int | None, oom_limits: Limits | None) -> str:
    """What ended the session, for its SessionError: bwrap's ``exit-code`` (its json-status;
    128+N: the init was killed by signal N; None: unknown), and ``oom_limits`` the session's
    cgroup limits when its memory cgroup's OOM killer struck since the start (else None)."""
    how = "exited"
    if code is not None and 128 < code <= 192:
        how = f"was killed by {_signal_name(code - 128)}"
    elif code is not None:
        how = f"exited with status {code}"
    if oom_limits is not None:
        return (f"the session's init {how}: {_limits.memory_kill_note(oom_limits, 'the init or bwrap')}"
                "; the session is over: start a new Session, with a larger memory_bytes if its commands need "
                "more memory or room for files")
    return (f"the session's init {how}: the session is over (a command can kill it: commands run as the "
            "same uid); start a new Session")


def _signal_name(signo: int) -> str:
    try:
        return signal.Signals(signo).name
    except ValueError:
        return f"signal {signo}"


def command_result(cmd: Command, *, status: int, flags: int, utime_us: int, stime_us: int, maxrss_kib: int,
                   wall_s: float, oom_kills: int | None, pids_hits: int | None, policy: Policy,
                   cgroup_limits: Limits, enforced: tuple[str, ...], landlock_abi: int,
                   session_notes: tuple[str, ...], changes: _ws.Changes, network: tuple[NetworkAttempt, ...] | None,
                   network_notes: tuple[str, ...], workspace: str) -> Result:
    """The Result of a command that ran: the session's result builder.

    Args:
        cmd: the finished command (its argv, captured output, rlimits, notes; ``cmd.notes``
            gains the memory and pids notes its verdict calls for).
        status: its wait status; ``flags``: the EXIT's ``EXITF_*``.
        utime_us, stime_us, maxrss_kib: its tree's rusage (µs, µs, KiB); ``wall_s``: seconds.
        oom_kills, pids_hits: the session cgroup's OOM kills and pids.max refusals during its
            life (None: no cgroup or no counter).
        policy, cgroup_limits: the session's Policy and the limits its cgroup enforces now.
        enforced: ``Result.limits_enforced``; ``landlock_abi``: the init's (0: none).
        session_notes: the notes of every Result of the session; ``network``/``network_notes``:
            the egress proxy's attempts and notes during the command (None/() without egress).
        changes: ``Result.changes``; ``workspace``: ``Result.workspace``.

    ``killed_by`` is judged as :func:`lowlevel.run` judges a run: any OOM kill means
    ``"memory"``, a fork refused at pids.max with a failed exit ``"pids"``; a command that shared
    the session with others (``cmd.alone`` False) is charged only if it failed too.
    """
    exit_code, term = wait_status_exit(status)
    killed_by: str | None
    failed = exit_code != 0
    if flags & proto.EXITF_TIMED_OUT:
        killed_by = "timeout"
    elif flags & proto.EXITF_CANCELLED or cmd.cancelled:
        killed_by = "cancelled"
    else:  # the one classification of lowlevel.run's Results too
        killed_by = classify_kill(term=term, oom=bool(oom_kills and (cmd.alone or failed)),
                                  pids_hit=bool(pids_hits and failed), cpu_used_s=(utime_us + stime_us) / 1e6,
                                  cpu_limit_s=policy.limits.cpu_s, rlimit_cpu="RLIMIT_CPU" in cmd.rlimit_names)
        if killed_by == "memory" and not any("OOM killer" in n for n in cmd.notes):
            cmd.notes += (_limits.memory_kill_note(cgroup_limits, session=True),)
    if pids_hits and failed and killed_by in ("pids", None):
        cmd.notes += (pids_note(cgroup_limits.pids, exit_code, term),)
    out, out_t, out_d = cmd.out.value()
    err, err_t, err_d = cmd.err.value()
    net_note = network_denial_note(policy, landlock_abi, exit_code, err)
    notes = session_notes + cmd.notes + ((net_note,) if net_note else ()) + network_notes
    return Result(
        exit_code=exit_code, term_signal=term, timed_out=bool(flags & proto.EXITF_TIMED_OUT), killed_by=killed_by,
        stdout=out, stderr=err, stdout_truncated=out_t, stderr_truncated=err_t,
        stdout_dropped_bytes=out_d, stderr_dropped_bytes=err_d, wall_time_s=wall_s,
        cpu_user_s=utime_us / 1e6, cpu_system_s=stime_us / 1e6, peak_memory_bytes=None,
        max_rss_bytes=maxrss_kib * 1024, oom_kills=oom_kills, limits_enforced=enforced, changes=changes,
        workspace=workspace, notes=notes, argv=tuple(cmd.argv), network=network, landlock_abi=landlock_abi)
