"""Session mode: one sandbox, many commands; and a warm Pool of fresh sandboxes.

A :class:`Session` sets the sandbox up once (one bwrap, same Policy, seccomp filter and limits
as :func:`lowlevel.run`) with a small C init as its program (``native/lowlevel_init.c``), then
runs each command inside it at the cost of a fork and an exec. :class:`AsyncSession` is the
asyncio form. A :class:`Pool` keeps N sandboxes started in advance, each with its own fresh
workspace, and gives each call a sandbox of its own: the isolation of ``run`` at close to a
session's latency.

Glossary:
    init: ``lowlevel_init``, the sandbox's program (PID 2, under bwrap's PID-1 reaper). It
        receives commands over a socket, forks a shepherd per command and reaps shepherds.
    shepherd: one per command: a child subreaper that vforks and execs the command, enforces
        its timeout, kills its whole tree when it ends and reports status and rusage.
    command: what the caller asked to run; the leader of its own process group.

Isolation between commands of one session (exactly):
    Shared: the workspace (``/workspace``) and ``/tmp`` and ``/dev/shm`` (one tmpfs each, for the
        session's life); every namespace (mount, PID, network, IPC, UTS, user); the seccomp
        filter; the Landlock TCP rules and scopes (the init's domain); the uid and gid; the
        session's cgroup, hence its ``memory_bytes``, ``pids`` and ``cpu_quota`` limits and its
        CPU/memory accounting (a command that fills memory can get another one OOM-killed); in
        egress mode the proxy, its ``net_bytes`` budget and its report (each Result lists the
        attempts made while its command ran); the environment given to bwrap (each command
        gets the Policy's environment plus its own ``env``, nothing else: the init passes an
        explicit environment to execve).
    Separate: each command runs in its own process group with its own stdin/stdout/stderr
        pipes (outputs are never mixed), its own rlimits (``RLIMIT_CPU``, ``RLIMIT_FSIZE``,
        ``RLIMIT_NOFILE``, ``RLIMIT_CORE``, and ``RLIMIT_DATA``/``RLIMIT_NPROC`` where the
        cgroup does not enforce memory/pids), its own cwd, its own timeout, its own Landlock
        domain for the filesystem rules (the same rules for every command; nested in the
        init's, so commands still signal each other: :mod:`lowlevel.host.landlock`).
    Not isolated: commands run as the same uid in one PID namespace, so a command can see
        the others in ``/proc``, signal them and read their ``/proc/PID/{environ,cmdline}``
        (ptrace, process_vm_*, pidfd_getfd and prlimit(2) of another process are denied by the
        seccomp profile). A command can also renice the init (setpriority(2)), move it to
        ``SCHED_IDLE`` or pin it to one CPU (sched_setaffinity(2)): the same uid is all the
        kernel asks, threads set their own by thread id so seccomp cannot tell the two apart,
        and the commands after it inherit the change (slower, never with other limits or
        rights). Use a Pool, or one ``run`` per call, when calls must not see or slow each
        other.
    Lifetime: no command outlives its own end: when a command's main process exits, times
        out or is killed, its shepherd SIGKILLs its process group and then every process
        reparented to it (a double-forked ``setsid`` daemon included) until none is left, and
        only then reports. Background commands (:meth:`Session.start`) live until they exit,
        time out, are killed, or the session closes.
    Commit and reset: :meth:`Session.commit` and :meth:`Session.reset` replace the workspace's
        upper layer, so no command runs across one: they wait for the commands :meth:`Session.run`
        started, hold commands submitted meanwhile until they are done, and refuse while a
        background command runs (``running="wait"`` waits for it, ``running="leave"`` leaves it
        in the old layer). A command that exited 0 before or during a commit is in it.
    The init: not dumpable (``PR_SET_DUMPABLE`` 0: no ptrace, no ``/proc/2/fd``), shrugs off
        every catchable signal (a no-op handler, which execve resets for the commands), and
        keeps no command's fds. A command can still SIGKILL or SIGSTOP it (same uid; the kernel
        offers no way to refuse those). Killing it ends the session at once (bwrap's PID 1
        exits with it and the kernel kills the PID namespace): every waiting call and every
        later one raises :class:`SessionError` with
        ``reason="init_died"``. A stopped init or shepherd is found by the host when a command
        overruns its timeout by :data:`GRACE_S` (or, for a command without timeout, when the
        init's state is ``T``), and the session is then killed (``reason="unresponsive"``).
        Either way the caller never hangs and nothing is left running.

The session ends on :meth:`Session.close`, on the caller's death (bwrap ``--die-with-parent``),
on its idle or total timeout (enforced by the init, which then exits), or on the init's death;
in every case the kernel kills the sandbox's PID namespace, and ``close()`` reaps bwrap and
removes the session's cgroup.

How the init gets in: the host opens the installed ``lowlevel/_lowlevel_init`` (static, mode
0755) once per process and passes the fd to bwrap, which execs ``/proc/self/fd/10``; the init
closes that fd first thing. No bind mount, nothing added to the sandbox's file tree, and the
package's host path need not be reachable by the sandbox's uid (a per-run uid for root callers).

Protocol (``SOCK_SEQPACKET`` socketpair; one record per message; native byte order; layouts in
``native/lowlevel_init.c``, mirrored in :mod:`lowlevel.session.protocol`):
    host -> init: ``SPAWN`` (header, rlimits, cwd, argv, env; stdio pipes attached with
        ``SCM_RIGHTS``; a body over 128 KiB travels in a memfd), ``SIGNAL`` (id, signo, or
        "kill the tree").
    init/shepherd -> host: ``HELLO`` (version; the kernel attaches the init's host PID with
        ``SO_PASSCRED``), ``STARTED`` (id, PID inside; background commands only), ``EXIT`` (id, kind, wait status or
        errno and stage, flags timed-out/cancelled, user and system CPU and max RSS of the
        command's tree from ``getrusage(RUSAGE_CHILDREN)``), ``BYE`` (idle/total timeout).
    Output never travels over the socket: the command writes into pipes the host created.

Sources: unix(7) (SOCK_SEQPACKET, SCM_RIGHTS, SO_PASSCRED); prctl(2) (PR_SET_CHILD_SUBREAPER,
Linux 3.4; PR_SET_DUMPABLE); credentials(7) (process groups); bwrap(1).

The package, one concept per module (bottom to top):
    :mod:`~lowlevel.session.protocol`: the wire format with the init (message layouts, fd
        numbers, encode/decode), the init's executable and argv, the host's answer timeouts.
    :mod:`~lowlevel.session.phase`: the phases of a session's life (STARTING, OPEN, ENDED, CLOSED).
    :mod:`~lowlevel.session.command`: the host-side state of one command (pipes, output, verdict).
    :mod:`~lowlevel.session.outcome`: a finished command's Result (``killed_by``) or start error.
    :mod:`~lowlevel.session.start`: the start handshake (bwrap from a lasting thread, HELLO).
    :mod:`~lowlevel.session.gate`: the live workspace and the gate that makes commit/reset exclusive.
    :mod:`~lowlevel.session.core`: the session's state and decisions (``Core``: the sandbox, the
        command table, submit, the init's reports, health and failure, close).
    :mod:`~lowlevel.session.sync`: the threaded driver (:class:`Session`, :class:`Process`).
    :mod:`~lowlevel.session.aio`: the asyncio driver (:class:`AsyncSession`, :class:`AsyncProcess`).
    :mod:`~lowlevel.session.pool`: :class:`Pool`, warm sandboxes used once each.
"""

from lowlevel.errors import SessionError
from lowlevel.session.aio import AsyncProcess, AsyncSession
from lowlevel.session.pool import Pool
from lowlevel.session.protocol import GRACE_S, init_path
from lowlevel.session.sync import Process, Session

__all__ = ["AsyncProcess", "AsyncSession", "GRACE_S", "Pool", "Process", "Session", "SessionError", "init_path"]
