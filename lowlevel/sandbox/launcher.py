"""Start a sandbox under lowlevel's anchor with os.posix_spawn, and supervise it.

The life of one run (:class:`Run`), the same for the sync and the async drivers:

1. ``prepare``: everything that can fail or allocate happens before the spawn, and every fd
   is owned the moment it exists: the workspace (opened once, by fd), the run's host ids (a
   per-run uid lease for root callers, :class:`lowlevel.workspace.cow.UidLease`), the cgroup and an
   O_WRONLY fd on each of its ``cgroup.procs``, the rlimits, the seccomp BPF (compiled once
   per profile), the Policy's static argv (cached) and the fds: an ``--args`` memfd (so a
   long policy never hits E2BIG), the ``--json-status-fd`` pipe, the ``--seccomp`` memfd, the
   ``/etc/passwd``/``/etc/group`` memfds, the stdio pipes and the anchor's report socket.
2. ``spawn``: ``os.posix_spawn`` of the anchor (``native/lowlevel_exec.c``: see
   :func:`lowlevel.sandbox.argv.anchor_argv`) with an empty environment (bwrap's PID 1 keeps the
   environment it was started with, and ``/proc/1/environ`` is readable from the sandbox). The
   file actions dup2 our fds onto fixed numbers; the anchor closes every other inherited fd (a
   leaked directory fd is a path out of any mount namespace). The anchor dies with us (checked
   ``PR_SET_PDEATHSIG``), joins the cgroups, mounts the copy-on-write workspace in a private
   mount namespace, and runs bwrap as PID 1 of a new PID namespace with the rlimits set.
   The program itself is behind the guard (:mod:`lowlevel.host.landlock`): bwrap execs
   ``/proc/self/fd/N`` (the static ``_lowlevel_guard``), which applies the Policy's Landlock
   ruleset to the program and reports its exact wait status on a pipe read in ``result``.
3. handshake: the anchor sends READY with bwrap's pidfd (and the overlay's upper directory)
   before bwrap starts. Limits are in force before any process of the sandbox exists: no
   ``--block-fd`` (bwrap reads EOF on it as "go").
4. supervise: poll the anchor's pidfd, the output pipes and the deadline; at the deadline
   ``pidfd_send_signal(SIGKILL)`` bwrap, the PID 1 of the run's namespace, which makes the
   kernel kill every process of it (a double-forked ``setsid`` daemon included).
5. finish: reap the anchor with ``os.waitpid``, wait until bwrap's pidfd reports exit (a PID 1
   exits only after every process of its namespace is gone: ``zap_pid_ns_processes``), read
   cgroup figures, build the :class:`Result`, read the upper layer's changes and commit or
   discard them (:mod:`lowlevel.workspace.overlay`), remove the cgroup.

Fds each run holds in the parent after the handshake: the anchor's pidfd, bwrap's pidfd, the
report socket, the upper directory and the workspace, json-status read end, stdout and stderr
read ends (capture mode), stdin write end (when stdin is bytes), the guard's report pipe.

Where each part lives: the call (:mod:`lowlevel.sandbox.request`), the Run's state and phase
(:mod:`lowlevel.sandbox.state`), its workspace side (:mod:`lowlevel.sandbox.run_workspace`,
:mod:`lowlevel.sandbox.commit`), step 1 (:mod:`lowlevel.sandbox.prepare`, :mod:`lowlevel.sandbox.plan`,
:mod:`lowlevel.sandbox.argv`, :mod:`lowlevel.sandbox.precheck`, :mod:`lowlevel.sandbox.facts`),
step 5's Result (:mod:`lowlevel.sandbox.finish`, :mod:`lowlevel.sandbox.result`,
:mod:`lowlevel.sandbox.failures`); this module holds steps 2-4 and the kill and reap (the
:class:`Run` class itself); the drivers: :mod:`lowlevel.sandbox.drive`, :mod:`lowlevel.sandbox.aio`.

Sources: bwrap(1) --args, --json-status-fd, --seccomp, --die-with-parent; pidfd_open(2);
pidfd_send_signal(2); posix_spawn(3); prctl(2) PR_SET_PDEATHSIG; pid_namespaces(7).
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import time
from collections.abc import Mapping

from lowlevel.errors import LaunchError, LowlevelError, PolicyError, WorkspaceError
from lowlevel.host.probe import ETC_ENTRIES
from lowlevel.sandbox import teardown as _teardown
from lowlevel.sandbox._interrupts import deferred_interrupts
from lowlevel.sandbox.argv import redact_env_values
from lowlevel.sandbox.facts import host_facts, planned_policy
from lowlevel.sandbox.failures import PROCESS_LIMIT_HINT
from lowlevel.sandbox.plan import ETC_COPY_FD, EXTRA_FDS_MIN
from lowlevel.sandbox.finish import RunFinish
from lowlevel.sandbox.state import Phase, _ExitUsage, log
from lowlevel.sandbox.request import RunRequest
from lowlevel.spec import validate as _validate
from lowlevel.spec.policy import WORKSPACE_DEST, Policy


#: Signals reset to their default action in bwrap (and so in the program): Python ignores
#: SIGPIPE and SIGXFSZ, and an ignored disposition survives exec, which would turn a write past
#: RLIMIT_FSIZE into EFBIG instead of a kill and break `yes | head`. The caller may ignore
#: others (SIGINT in a daemon). 32 and 33 (glibc's own) cannot be named here, and glibc's posix_spawn
#: sets them to SIG_IGN: the run guard and the session init reset those two before the program's exec
#: (tests/integration/test_glibc_signals.py). Source: posix_spawnattr_setsigdefault(3), signal(7).
_DEFAULT_SIGNALS = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                         and s < signal.SIGRTMIN)


#: How long the handshake (bwrap setting up namespaces and mounts) may take, seconds.
SETUP_TIMEOUT_S = 30.0
#: How long the drivers wait for the output pipes to reach EOF after the sandbox is gone (they
#: do at once unless a process outside the sandbox holds a copy), seconds.
DRAIN_TIMEOUT_S = 1.0
#: How long bwrap (the sandbox's PID 1) may outlive the anchor's exit (its parent-death signal
#: kills it) before the driver SIGKILLs it itself, then how long it waits for that, seconds.
INIT_EXIT_TIMEOUT_S = 2.0
INIT_KILL_TIMEOUT_S = 10.0


def _readable(fd: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``fd`` to be readable (a pidfd: the process exited).

    poll(2), not select(2): select cannot take fds >= FD_SETSIZE (1024), which a process
    with hundreds of runs in flight reaches.
    """
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(timeout_s * 1000))


def close_fds(fds: list[int]) -> None:
    """Close every fd of ``fds`` (all this Run's own and open; a duplicate is closed once): each run of
    consecutive numbers with one ``close_range(2)`` (:func:`os.closerange`), the others one by
    one; errors are ignored (an fd already closed is a bug elsewhere, never worth a second
    close). A spawn leaves ~35 such fds, mostly its ``F_DUPFD_CLOEXEC`` copies on consecutive
    numbers (issue 27: one system call for them instead of ~20).

    Safe while other threads open fds: every number in a run is one of ours, open until the
    kernel closes it, so no other thread's fd can be among them, and close_range walks the
    range upward (fs/file.c ``__range_close``), so a number another thread takes once it is
    freed is already behind the walk.
    """
    fds = sorted(set(fds))
    i = 0
    while i < len(fds):
        j = i
        while j + 1 < len(fds) and fds[j + 1] == fds[j] + 1:
            j += 1
        if j > i:
            os.closerange(fds[i], fds[j] + 1)
        else:
            try:
                os.close(fds[i])
            except OSError:
                pass
        i = j + 1


class Run(RunFinish):
    """One sandboxed run, driven by :func:`run` (sync) or :func:`lowlevel.sandbox.aio.arun` (async).

    Not thread-safe; one driver per Run. Always ends with :meth:`close` (idempotent), which
    kills whatever is left and closes every fd. Takes the call as a validated
    :class:`~lowlevel.sandbox.request.RunRequest` (its ``record`` must be None: records are
    written a layer above, :func:`lowlevel.record.record_run`), the ``policy``, plus ``bwrap``
    (the bwrap binary, None: found on PATH), ``extra_fds`` (``{fd inside: fd here}``), ``guard``
    (False: bwrap execs the command, no Landlock guard) and ``one_shot`` (False for a Session's
    sandbox, whose workspace is reset and committed while it lives: a fresh workspace then
    keeps its real lower layer).

    Raises:
        PolicyError: ``request`` or ``policy`` of the wrong type, a ``record``, a bad ``bwrap``,
            a reserved ``extra_fds`` number, or a bad environment (:meth:`Policy.environment`).
    """

    def __init__(self, request: RunRequest, *, policy: Policy, bwrap: str | None = None,
                 extra_fds: Mapping[int, int] | None = None, guard: bool = True, one_shot: bool = True) -> None:
        if not isinstance(request, RunRequest):
            raise PolicyError(f"request must be a lowlevel.sandbox.request.RunRequest, got {type(request).__name__}")
        policy = planned_policy(policy)  # plan time: the image store, the tree's checks
        request.refuse("the sandbox layer (lowlevel.sandbox)", "record",
                       why="lowlevel.run writes records through lowlevel.record.record_run")
        if bwrap is not None:
            _validate.host_path(bwrap, "bwrap")
        self.request = request
        self.command = list(request.command)
        fds = request.stdio_fds
        self.stdio_fds = (fds[0], fds[1], fds[2]) if fds is not None else (None, None, None)
        self.keep_workspace = request.keep_workspace
        self.policy = policy
        self.commit = request.commit
        self.timeout = request.timeout
        self.stdin = request.stdin
        self.capture = request.capture
        self.cwd = _validate.sandbox_cwd(request.cwd or policy.workdir or WORKSPACE_DEST)
        self.env_extra = dict(request.env or {})
        self.environment = policy.environment(self.env_extra)
        self.facts = host_facts(bwrap)
        # {fd number inside: parent fd}; the parent keeps ownership of its fds.
        self.extra_fds = dict(extra_fds or {})
        etc_copy_fds = range(ETC_COPY_FD, ETC_COPY_FD + len(ETC_ENTRIES))
        for child_fd in self.extra_fds:
            if child_fd < EXTRA_FDS_MIN or child_fd in etc_copy_fds:
                raise PolicyError(f"extra_fds: child fd {child_fd} is reserved (use {EXTRA_FDS_MIN} to "
                                  f"{ETC_COPY_FD - 1}, or {etc_copy_fds.stop} and above)")
        self.inputs = list(request.inputs)
        self.workspace_arg = request.workspace
        self.workspace_base = request.workspace_base
        self.allow_sensitive_workspace = request.allow_sensitive_workspace
        self.one_shot = one_shot
        self.guard = guard
        self._init_state()


    def spawn(self) -> None:
        """posix_spawn the anchor (which execs bwrap) with an empty environment; open its pidfd.

        A signal handler's exception (KeyboardInterrupt) is held back until the anchor's PID
        and pidfd are recorded (lowlevel.sandbox._interrupts), so :meth:`close` can always kill it.

        Raises:
            LaunchError: the spawn or pidfd_open failed; nothing is left running.
        """
        with deferred_interrupts():
            self._spawn()

    def _spawn(self) -> None:
        self.since_ns = time.time_ns()
        self.t0 = time.monotonic()
        if self.timeout is not None:
            self.deadline = self.t0 + self.timeout
        exe_argv = self.anchor_argv()
        i = exe_argv.index("--args")
        self.full_argv = [*exe_argv[:i], *self.argv, *exe_argv[i + 2:]]
        log.debug("lowlevel: spawning %s", lambda: redact_env_values(self.full_argv))
        try:
            # setsid: the host-side bwrap (and the exec helper) leave the caller's session too
            # (bwrap's --new-session detaches only the sandbox's side), so no process lowlevel
            # starts keeps the caller's controlling terminal, and a ^C or hangup there reaches
            # only the caller, which then kills the sandbox in order (issue 12 item 1).
            self.pid = os.posix_spawn(exe_argv[0], exe_argv, {}, file_actions=self.actions,
                                      setsigdef=_DEFAULT_SIGNALS, setsigmask=(), setsid=True)
        except OSError as err:
            hint = f": {PROCESS_LIMIT_HINT}" if err.errno == errno.EAGAIN else ""
            raise LaunchError(f"cannot start {exe_argv[0]}: {err.strerror}{hint}", argv=exe_argv,
                              errno=err.errno) from err
        try:
            self.pidfd = os.pidfd_open(self.pid)
            self.phase = Phase.SPAWNED
        except OSError as err:
            # Not reaped yet, so the PID is still this child: kill and reap it by PID.
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.wait_status = -1
            raise LaunchError(f"pidfd_open of the sandbox failed: {err.strerror}", errno=err.errno) from err
        if self.handover is not None and self.handover.journal is not None:
            self.handover.journal.record_process("anchor", self.pid)  # lowlevel.workspace.handover_journal
        # Close the child's ends in the parent.
        keep = {self.json_r, self.out_r, self.err_r, self.stdin_w, self.lower_fd, self.status_r}
        drop = [fd for fd in self.fds if fd not in keep]
        self.fds[:] = [fd for fd in self.fds if fd in keep]  # first: an fd is never closed twice
        close_fds(drop)
        self.cgroup_fds.clear()
        self.cgroup_dir_fd = None
        if self.lease is not None:
            self.lease.release()  # the anchor holds the lease now, for as long as it lives
        if self.report_child is not None:
            self.report_child.close()
            self.report_child = None
        for rfd in (self.out_r, self.err_r, self.json_r, self.status_r):
            if rfd is not None:
                os.set_blocking(rfd, False)

    # -- 3. handshake --------------------------------------------------------------------
    def read_report(self) -> bool:
        """Read the anchor's READY (non-blocking); return True once the sandbox is ready.

        READY carries bwrap's pidfd (the PID 1 of the run's PID namespace: readable once
        every process of the sandbox is gone) and, with the overlay, the upper directory's fd.
        EOF (the anchor died in its setup) closes the socket: its exit and stderr explain.
        """
        if self.ready or self.report is None:
            return self.ready
        with deferred_interrupts():  # the fds are ours before any KeyboardInterrupt
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self.report, 256, 4)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                msg, fds = b"", []
            for fd in fds:
                self._own(fd)
        if not msg:
            self.report.close()
            self.report = None
            for fd in fds:
                os.close(fd)
                self.fds.remove(fd)
            return False
        want = 2 if self.cow else 1
        if not msg.startswith(b"READY") or len(fds) != want:
            # No fds with READY: the kernel could not install them (MSG_CTRUNC: EMFILE). Without
            # bwrap's pidfd the sandbox cannot be supervised: kill it (the anchor's death takes
            # bwrap, which has not started yet, with it) and say why.
            self.kill(None)
            why = ("the sandbox's fds could not be received (too many open files?)" if msg.startswith(b"READY")
                   else f"the anchor sent {msg[:80]!r}, expected READY: reinstall lowlevel")
            raise LaunchError(why, argv=self.full_argv, errno=errno.EMFILE if msg.startswith(b"READY") else None)
        self.init_pidfd = fds[0]
        self.fds.remove(fds[0])
        if self.handover is not None and self.handover.journal is not None:
            try:
                with open(f"/proc/self/fdinfo/{self.init_pidfd}") as f:
                    bwrap_pid = next(int(line.split()[1]) for line in f if line.startswith("Pid:"))
                self.handover.journal.record_process("bwrap", bwrap_pid)
            except (OSError, StopIteration, ValueError):
                pass  # recovery then waits for the sandbox uid's processes instead
        if len(fds) > 1:
            self.upper_fd = fds[1]
            self.fds.remove(fds[1])  # closed by finish_cow
        self.phase = Phase.READY
        return True

    def read_exit(self) -> bool:
        """After READY: read the anchor's EXIT (non-blocking); return True once it arrived.

        EXIT comes when the anchor has reaped bwrap, i.e. every process of the sandbox is
        gone, and before the anchor's own exit, which tears down its mount namespace (the
        overlay and its tmpfs: ~0.5-1.5 ms here, two expedited RCU grace periods). It carries
        bwrap's wait status and max RSS, so the Result is built meanwhile and the anchor is
        reaped afterwards (:meth:`reap_anchor`). The status recorded is the anchor's own exit
        status as it will be (bwrap's code, or 128+N for a signal N).
        """
        if self.exit_reported or self.report is None or not self.ready:
            return self.exit_reported
        while True:
            try:
                msg = self.report.recv(256)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                msg = b""
            if not msg:
                self.report.close()  # EOF without EXIT: the anchor died; its pidfd tells
                self.report = None
                return False
            if msg.startswith(b"EXIT "):
                break
        try:
            fields = [int(x) for x in msg.split()[1:]]
            status, maxrss = fields[0], fields[1]
        except (ValueError, IndexError):
            return False
        code = os.WTERMSIG(status) + 128 if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self.supervisor_signaled = self.supervisor_signaled or os.WIFSIGNALED(status)  # bwrap killed
        self.wait_status = (code & 0xFF) << 8
        self.rusage = _ExitUsage(maxrss)
        # The end as the anchor measured it (CLOCK_MONOTONIC, time.monotonic's clock): a caller
        # stopped or starved when the run ended must not count its own delay as the run's.
        self.t_end = fields[2] / 1e9 if len(fields) > 2 and fields[2] > 0 else time.monotonic()
        if len(fields) > 3 and fields[3] & 1 and self.killed_by is None:
            # The anchor killed the sandbox at the deadline (--deadline-ns): the caller did not.
            self.killed_by = "timeout"
            self.timed_out = True
        self.phase = Phase.EXITED
        return True

    def reap_anchor(self, *, block: bool = True) -> bool:
        """Reap the anchor once it reported EXIT; True when it is reaped (or was never ours).

        Args:
            block: wait for its exit (its teardown is bounded: it does nothing else).
        """
        if self.anchor_reaped or self.pid is None:
            return True
        try:
            pid, _status = os.waitpid(self.pid, 0 if block else os.WNOHANG)  # no rusage: see teardown.finish
        except ChildProcessError:
            pid = self.pid  # reaped by someone else (a SIGCHLD handler waiting for any child)
        if pid == 0:
            return False
        self.anchor_reaped = True
        return True

    def feed_json(self, data: bytes) -> bool:
        """Feed json-status bytes; return True once the child-pid document has arrived."""
        self.json_buf += data
        if self.init_pid is None:
            doc = self._first_doc()
            if doc is not None and "child-pid" in doc:
                self.init_pid = int(doc["child-pid"])  # in bwrap's PID namespace, not ours
                if self.audit is not None:
                    self._attach_audit()
                return True
        return False

    def _attach_audit(self) -> None:
        """Audit mode: attribute kernel records to the sandbox's PID namespace (bwrap's child)."""
        assert self.audit is not None and self.init_pidfd is not None
        try:
            with open(f"/proc/self/fdinfo/{self.init_pidfd}") as f:
                bwrap_pid = next(int(line.split()[1]) for line in f if line.startswith("Pid:"))
            with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
                child = int(f.read().split()[0])
            self.audit.attach(child)
        except (OSError, StopIteration, ValueError, IndexError) as err:
            self.notes.append(f"seccomp audit: cannot find the sandbox's PID namespace ({err})")


    # -- 4. supervise --------------------------------------------------------------------
    def feed_stdin(self, *, close: bool = True) -> bool:
        """Write what the stdin pipe takes; return True when stdin is done (and closed).

        Args:
            close: close the pipe when done. The async driver passes False and closes it
                itself once the loop no longer watches the fd number.
        """
        if self.stdin_w is None:
            return True
        view = self.stdin_view
        try:
            while view:
                n = os.write(self.stdin_w, view[:65536])
                view = view[n:]
        except BlockingIOError:
            self.stdin_view = view
            return False
        except BrokenPipeError:
            pass
        self.stdin_view = None
        if close:
            self._close_fd("stdin_w")
        return True

    def read_fd(self, which: str, *, close: bool = True) -> bool:
        """Drain readable data from 'out_r', 'err_r' or 'json_r'; return False at EOF.

        Args:
            which: the attribute naming the fd.
            close: close the fd at EOF (the default). The async driver passes False and
                closes it after unregistering it from the loop: a number closed while still
                registered could be reused by a pipe another thread opens meanwhile.
        """
        fd = getattr(self, which)
        if fd is None:
            return False
        while True:
            try:
                data = os.read(fd, 262144)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                if close:
                    self._close_fd(which)
                return False
            if which == "out_r":
                self.out.feed(data)
            elif which == "err_r":
                self.err.feed(data)
            else:
                self.feed_json(data)


    def on_deadline(self) -> None:
        """The deadline passed: SIGKILL the sandbox, or with :attr:`kill_after` first SIGTERM
        every process in it and push the deadline back by ``kill_after`` (the next call kills)."""
        if self.kill_after > 0 and not self.terminated and self.deadline is not None:
            self.terminate()
            self.deadline += self.kill_after
            return
        self.kill("timeout")

    def terminate(self) -> None:
        """SIGTERM every process of the sandbox but its PID 1 (the program, what it started, the
        orphans PID 1 adopted): step one of a timeout with a grace, as ``timeout -k`` sends
        SIGTERM, then SIGKILL. Records ``killed_by="timeout"``.

        The processes are the descendants of the sandbox's PID 1 (``/proc/PID/task/*/children``,
        readable by the caller, who owns the sandbox's user namespace); each is signalled
        through a pidfd opened while its parent is still the one it was found under, so a
        recycled PID is never signalled. PID 1 itself (the guard) has no handler and is not
        signalled (the kernel would drop it). Best effort: a process forked during the walk
        gets the SIGKILL of the end of the grace.
        """
        self.terminated = True
        if self.killed_by is None:
            self.killed_by = "timeout"
            self.timed_out = True
        root = _pidfd_pid(self.init_pidfd)
        if root is None:
            return
        todo, seen = [root], {root}
        while todo and len(seen) < 1_000_000:
            parent = todo.pop()
            for pid in _children(parent):
                if pid in seen:
                    continue
                seen.add(pid)
                todo.append(pid)
                try:
                    pfd = os.pidfd_open(pid)
                except OSError:
                    continue
                try:
                    if _ppid(pid) == parent:
                        signal.pidfd_send_signal(pfd, signal.SIGTERM)
                except OSError:
                    pass
                finally:
                    os.close(pfd)

    def kill(self, reason: str | None, *, cgroup_kill: bool = True) -> None:
        """SIGKILL the whole sandbox (its PID 1 takes the PID namespace with it) and bwrap.

        Args:
            reason: recorded as ``killed_by`` (the first reason wins), or None.
            cgroup_kill: also SIGKILL every process in the run's cgroup and wait (up to 2 s,
                blocking) until it is empty. The async driver passes False and instead waits
                on the sandbox-init pidfd without blocking the loop; :meth:`close` still
                empties and removes the cgroup.
        """
        if reason and self.killed_by is None:
            self.killed_by = reason
            if reason == "timeout":
                self.timed_out = True
        for pfd in (self.init_pidfd, self.pidfd):
            if pfd is not None:
                try:
                    signal.pidfd_send_signal(pfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if cgroup_kill and self.cgroup is not None:
            try:
                self.cgroup.kill_all()
            except Exception:  # noqa: BLE001 - best effort, bwrap's death kills the namespace anyway
                pass

    def reap(self) -> None:
        """Reap the anchor (blocking: call once its pidfd is readable) and make sure the sandbox is gone.

        The anchor exits after bwrap, the PID 1 of the run's namespace, whose exit completes only
        once every process of the namespace is gone (``zap_pid_ns_processes``); if the anchor
        was killed instead, bwrap's parent-death signal takes the namespace down: wait for it.
        """
        self.reap_bwrap()
        if self.init_pidfd is not None:
            if not _readable(self.init_pidfd, INIT_EXIT_TIMEOUT_S):
                try:
                    signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _readable(self.init_pidfd, INIT_KILL_TIMEOUT_S)
        elif self.cgroup is not None and self.pid is not None:
            # Killed before READY: whatever the anchor forked is in the run's cgroup.
            try:
                self.cgroup.kill_all()
            except Exception:  # noqa: BLE001 - best effort: the PID namespace dies with bwrap anyway
                pass

    def reap_bwrap(self) -> None:
        """``os.wait4`` bwrap and record its status; blocks unless bwrap's pidfd is readable.

        The first half of :meth:`reap`; the async driver calls it once the loop reports the
        pidfd readable, then waits for the sandbox-init pidfd itself instead of blocking.
        """
        if self.pid is not None and self.wait_status is None:
            try:
                _, status, ru = os.wait4(self.pid, 0)
            except ChildProcessError:
                # Another thread of ours reaped it at the same moment (a Session's reader seeing
                # its init die while close() reaps: "[Errno 10] No child processes" from close,
                # found by a fresh-user trial): its values land in a moment.
                deadline = time.monotonic() + 1.0
                while self.wait_status is None and time.monotonic() < deadline:
                    time.sleep(0.001)
                return
            self.wait_status = status
            self.supervisor_signaled = self.supervisor_signaled or os.WIFSIGNALED(status)  # the anchor killed
            self.rusage = ru
            self.t_end = time.monotonic()
            self.anchor_reaped = True

    def sandbox_alive(self) -> bool:
        """True while the sandbox's PID 1 (and so its PID namespace) still exists."""
        if self.init_pidfd is None:
            return False
        return not _readable(self.init_pidfd, 0)


    def close(self) -> None:
        """Kill anything left, reap, commit (``commit=True``) or drop the upper layer, remove
        the cgroup, close every fd. Idempotent.

        A finished one-shot run (the anchor sent EXIT: no process of the sandbox is left) hands
        the anchor's reaping and the cgroup's removal to :mod:`lowlevel.sandbox.teardown`'s
        thread: they cost ~0.6 ms after the Result is built and nothing of the run depends on
        them (the uid lease is the anchor's own lock; the run record stays until the cgroup is
        gone, so a caller killed meanwhile leaves what ``lowlevel cleanup`` removes).

        A signal handler's exception (KeyboardInterrupt) arriving during the kill and the reap is
        held until both are done, then raised; the rest of the teardown runs as it propagates.
        """
        if self.closed:
            return
        self.closed = True
        defer = False
        try:
            # A ^C (KeyboardInterrupt, a SIGTERM handler's SystemExit) in the kill's wait for the
            # cgroup to empty, or in the reap, skipped the anchor's reaping: a zombie for the
            # process's life, and a second close() does nothing. Held until both are done (bounded:
            # kill_all's 2 s, the reap's INIT_EXIT_TIMEOUT_S + INIT_KILL_TIMEOUT_S), then raised.
            with deferred_interrupts():
                if self.pid is not None and self.wait_status is None:
                    self.kill(None)
                    self.reap()
                elif self.init_pidfd is not None and self.sandbox_alive():
                    self.kill(None)
                    self.reap()
            defer = (_teardown.ENABLED and self.one_shot and self.exit_reported and self.handover is None
                     and not self.sandbox_alive())
        finally:
            handed_pid: int | None = None
            if self.exit_reported and not self.anchor_reaped:
                if defer:
                    handed_pid, self.anchor_reaped = self.pid, True  # the reaper's from here on
                else:
                    self.reap_anchor()  # it left the run's cgroups (and released its lease) on exit
            try:
                self._close_owned()
            finally:
                # Last: an interrupted run's commit (finish_cow above) is covered by the cgroup's
                # run record until it is done (lowlevel.sandbox.commit.commit_record).
                self._end_cgroup(defer, handed_pid)

    def _close_owned(self) -> None:
        """:meth:`close`'s middle: the audit, egress, every fd, the upper layer, the lease, the hand-over."""
        if self.audit is not None:
            self.audit.close()
            self.audit = None
        if self.egress is not None:
            self.egress.close()
        owned = [*self.fds, *(fd for fd in (self.pidfd, self.init_pidfd) if fd is not None)]
        self.fds.clear()
        self.pidfd = self.init_pidfd = None
        close_fds(owned)
        self.json_r = self.stdin_w = self.out_r = self.err_r = self.status_r = None
        if self.upper_fd is not None:
            # Interrupted before result() (an exception, a signal): what the program wrote is
            # kept as commit=True promises; otherwise it is dropped with the upper layer.
            try:
                self.finish_cow(success=False)
            except LowlevelError as err:
                if self.keep_close_error:
                    self.close_error = err
                else:
                    log.warning("lowlevel: %s", err)
        for sock in (self.report, self.report_child):
            if sock is not None:
                sock.close()
        self.report = self.report_child = None
        if self.lower_fd is not None:
            os.close(self.lower_fd)
            self.lower_fd = None
        if self.lease is not None:
            self.lease.release()
        if self.handover is not None and not self.handover.done:
            try:
                self.give_back_workspace()
            except WorkspaceError as err:
                log.warning("lowlevel: %s", err)

    def _end_cgroup(self, defer: bool, handed_pid: int | None) -> None:
        """Hand the anchor ``handed_pid`` (or None) and the cgroup to the teardown thread when
        ``defer``; else (or when no thread can start) reap and remove them here."""
        if defer and _teardown.defer(handed_pid, self.cgroup):
            self.cgroup = None
            return
        if handed_pid is not None:
            _teardown.finish(handed_pid, None)  # no thread could start: reap it here
        if self.cgroup is not None:
            try:
                # A ^C (KeyboardInterrupt) arriving mid-removal is held until the cgroup is
                # gone (remove() is bounded: ~2 s at worst): raised there, it left the run's
                # cgroup directories behind for as long as this process lives.
                with deferred_interrupts():
                    self.cgroup.remove()
            except Exception as err:  # noqa: BLE001
                log.warning("lowlevel: cannot remove cgroup: %s", err)

def _pidfd_pid(pidfd: int | None) -> int | None:
    """The PID (in our namespace) a pidfd refers to (``Pid:`` of its fdinfo), or None."""
    if pidfd is None:
        return None
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pid:"):
                    pid = int(line.split()[1])
                    return pid if pid > 0 else None
    except (OSError, ValueError):
        pass
    return None


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (every thread's, ``/proc/PID/task/TID/children``; proc(5))."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                found.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def _ppid(pid: int) -> int | None:
    """The parent of ``pid`` (field 4 of ``/proc/PID/stat``, after the ``(comm)``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError):
        return None


__all__ = ["DRAIN_TIMEOUT_S", "INIT_EXIT_TIMEOUT_S", "INIT_KILL_TIMEOUT_S", "Run", "SETUP_TIMEOUT_S"]
