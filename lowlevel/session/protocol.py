"""The wire format between the host and the session's in-sandbox init (``native/lowlevel_init.c``).

One concept: what crosses the boundary with the init, and how it is laid out. The init's
executable and how it gets in (an fd bwrap execs, :func:`init_fd`), its argv and fd numbers,
the message types, flags and struct layouts (native byte order, mirrored from the C source and
cross-checked against it by ``tests/unit/test_session_protocol.py``), the encoders of what the
host sends (SPAWN, SIGNAL) and the decoders of what it receives (HELLO, STARTED, EXIT, BYE), and
the time limits the host gives the init to answer. No state: the session's core
(:mod:`lowlevel.session.core`) keeps that.

Layout (``SOCK_SEQPACKET`` socketpair; one record per message):
    host -> init: ``SPAWN`` (header, rlimits, cwd, argv, env; stdio pipes attached with
        ``SCM_RIGHTS``; a body over :data:`MAX_INLINE` travels in a memfd), ``SIGNAL`` (id,
        signo, or "kill the tree").
    init/shepherd -> host: ``HELLO`` (version, Landlock ABI; the kernel attaches the init's host
        PID with ``SO_PASSCRED``), ``STARTED`` (id, PID inside; only when the SPAWN asked for it
        with ``SPAWN_STARTED``), ``EXIT`` (:class:`ExitReport`),
        ``BYE`` (idle/total timeout).

Sources: unix(7) (SOCK_SEQPACKET, SCM_RIGHTS, SO_PASSCRED, SCM_CREDENTIALS).
"""

from __future__ import annotations

import functools
import os
import resource
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from lowlevel.errors import UnsupportedError
from lowlevel.paths import native
from lowlevel.sandbox.argv import encode_args
from lowlevel.sandbox.plan import nr_open
from lowlevel.spec import limits as _limits
from lowlevel.spec.limits import Limits

#: Extra seconds the host waits past a command's timeout before it declares the session
#: unresponsive (the shepherd enforces the timeout itself, and the init continues a shepherd a
#: command stopped; this covers a stopped init, or a shepherd stopped again and again).
GRACE_S = 2.0
#: How long the host waits for the init's HELLO after bwrap released it, seconds.
HELLO_TIMEOUT_S = 10.0
#: How long the host waits for the init to take a message (socket buffer full), seconds.
SEND_TIMEOUT_S = 10.0
#: How many more open files the init (the sandbox's RLIMIT_NOFILE) may hold than a command (the
#: Policy's ``Limits.nofile``, set per command). Two uses: the init's fds (one control socket per
#: running command), and the fds a uid may have in flight in unix sockets, which the kernel caps
#: at the *sender's* RLIMIT_NOFILE (unix(7), ETOOMANYREFS) and counts per uid: a command that
#: parks fds in a socket it never reads reaches at most its own limit plus one message's 253
#: (SCM_MAX_FD), so the init, above that, can still pass the next command its pipes. Bounded by
#: the caller's own hard limit where it may not raise it (then no headroom is kept, silently).
INIT_NOFILE_HEADROOM = 1024
#: What an ETOOMANYREFS from sendmsg(2) means here (the host's or the init's).
TOO_MANY_REFS = ("ETOOMANYREFS: the sandbox's uid has more file descriptors in flight in unix sockets than "
                 "RLIMIT_NOFILE allows (a command holds them in a socket it does not read: unix(7)); end "
                 "that command. For an unprivileged caller the sandbox's uid is its own, so its other "
                 "programs passing fds fail alike until then")
#: Path of the init executable built at install time (``setup.py`` ``build_ext``).
INIT_PATH = native("_lowlevel_init")

# Fd numbers inside the sandbox (extra_fds of the Run: 9 and up are ours).
SOCK_FD = 9
EXE_FD = 10

# Protocol, mirrored from native/lowlevel_init.c (tests/unit/test_session_protocol.py checks it).
PROTO_VERSION = 1
MSG_SPAWN, MSG_SIGNAL = 1, 2
MSG_HELLO, MSG_STARTED, MSG_EXIT, MSG_BYE = 100, 101, 102, 103
SPAWN_STDIN_PIPE, SPAWN_BODY_MEMFD = 1, 2
#: SPAWN flag: report STARTED (the command's pid: a background command's ``Process.pid``); a
#: command of ``run()`` goes without, so the host is woken once per command, by its EXIT.
SPAWN_STARTED = 4
SIGNAL_TREE = 1
EXIT_WAIT_STATUS, EXIT_SETUP_FAILED, EXIT_SPAWN_FAILED, EXIT_SHEPHERD_DIED = 0, 1, 2, 3
EXITF_TIMED_OUT, EXITF_CANCELLED = 1, 2
STAGES = {1: "chdir", 2: "setrlimit", 3: "execve", 4: "stdio", 5: "landlock",
          6: "working directory outside the sandbox"}
#: The stage of a command whose working directory resolved outside the sandbox (STAGE_CWD).
STAGE_CWD = 6
BYE_REASONS = {1: "idle_timeout", 2: "total_timeout"}
SPAWN_HDR = struct.Struct("=IIIIqII")
RLIM = struct.Struct("=IIQQ")
SIGNAL = struct.Struct("=IIII")
SMALL = struct.Struct("=IIII")
EXIT = struct.Struct("=IIIIIIqqqq")
MAX_INLINE = 128 * 1024
#: Room for the largest message the init sends (EXIT), for recv().
RECV_SIZE = 256
#: Room for the HELLO, for recvmsg().
HELLO_RECV_SIZE = 64
#: ``struct ucred`` (pid, uid, gid) of ``SCM_CREDENTIALS``: unix(7).
UCRED = struct.Struct("=iII")
_U64 = 2**64 - 1


def init_path() -> str:
    """Path of the ``lowlevel_init`` executable: ``$LOWLEVEL_INIT`` or the one installed.

    Raises:
        UnsupportedError: it is missing (the package was installed without building it).
    """
    path = os.environ.get("LOWLEVEL_INIT") or INIT_PATH
    if not os.access(path, os.X_OK):
        raise UnsupportedError("session-init", f"the session init executable {path} is missing or not "
                               "executable", "reinstall lowlevel (pip install .) with a C compiler present")
    return path


@functools.lru_cache(maxsize=None)
def init_fd(path: str) -> int:
    """An O_RDONLY fd of the init executable, opened once per process.

    bwrap execs it as ``/proc/self/fd/10``: no bind mount is needed and its host path need
    not be reachable by the sandbox's uid (only its mode, 0755, matters).
    """
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def init_argv(idle_timeout: float | None, total_timeout: float | None, landlock_args: Sequence[str]) -> list[str]:
    """The init's argv inside the sandbox: its own fd, the socket's, its idle and total timeouts
    (ms, 0: none), then the Landlock ruleset arguments (:func:`lowlevel.sandbox.landlock_rules.ruleset_args`)."""
    return [f"/proc/self/fd/{EXE_FD}", str(SOCK_FD), str(_ms(idle_timeout)), str(_ms(total_timeout)),
            str(EXE_FD), *landlock_args]


def init_nofile(nofile: int | None, may_raise: bool) -> int | None:
    """The sandbox's RLIMIT_NOFILE for a Session (its init's): ``nofile`` (the commands') plus
    :data:`INIT_NOFILE_HEADROOM`, within what this caller can set
    (its own hard limit, or ``/proc/sys/fs/nr_open`` with ``may_raise``: CAP_SYS_RESOURCE), never
    below ``nofile``; None (no limit set) stays None."""
    if nofile is None:
        return None
    bound = nr_open() if may_raise else resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = nofile + INIT_NOFILE_HEADROOM
    if bound is not None and bound != resource.RLIM_INFINITY:
        want = min(want, bound)
    return max(nofile, want)


def rlimit_records(limits: Limits, cgroup: Any, nofile_cap: int | None = None) -> tuple[tuple[str, ...], bytes]:
    """The SPAWN body's rlimit records for ``limits`` (``RLIM`` each) and the names they set;
    ``RLIMIT_NOFILE`` no higher than ``nofile_cap`` (a command's per-call limits: the session's,
    not the init's, which is higher by :data:`INIT_NOFILE_HEADROOM`)."""
    triples = _limits.rlimits(limits, cgroup)
    if nofile_cap is not None:
        triples = tuple((n, min(s, nofile_cap), min(h, nofile_cap)) if n == "RLIMIT_NOFILE" else (n, s, h)
                        for n, s, h in triples)
    names = tuple(name for name, _s, _h in triples)
    data = b"".join(RLIM.pack(getattr(resource, name), 0, soft & _U64, hard & _U64)
                    for name, soft, hard in triples)
    return names, data


def env_block(env: Mapping[str, str]) -> tuple[int, bytes]:
    """``(count, NUL-separated "K=V" strings)`` of a command's environment.

    Raises:
        PolicyError: a name or value holds a NUL.
    """
    return len(env), encode_args([f"{k}={v}" for k, v in env.items()])  # refuses a NUL: the last line


def spawn_strings(cwd: str, command: Sequence[str], envb: bytes) -> bytes:
    """The SPAWN body's strings: cwd, argv, then the environment block (NUL-separated).

    Raises:
        PolicyError: an argument holds a NUL.
    """
    return encode_args([cwd, *command]) + envb


def spawn_header(cid: int, flags: int, rlimit_bytes: int, timeout: float | None, argc: int, envc: int) -> bytes:
    """The SPAWN header (``SPAWN_HDR``); ``timeout`` in seconds (None: -1, none)."""
    timeout_ms = -1 if timeout is None else max(1, round(timeout * 1000))
    return SPAWN_HDR.pack(MSG_SPAWN, cid, flags, rlimit_bytes // RLIM.size, timeout_ms, argc, envc)


def signal_msg(cid: int, signo: int, tree: bool) -> bytes:
    """A SIGNAL message: ``signo`` to command ``cid``'s group (``tree``: SIGKILL its whole tree)."""
    return SIGNAL.pack(MSG_SIGNAL, cid, int(signo), SIGNAL_TREE if tree else 0)


class Hello(NamedTuple):
    """The init's HELLO: its message type and protocol version (both checked by the caller) and
    the Landlock ABI it found (0: none)."""
    mtype: int
    version: int
    landlock_abi: int


def decode_hello(data: bytes) -> Hello | None:
    """The HELLO in ``data``; None when it is too short to be one."""
    if len(data) < SMALL.size:
        return None
    mtype, version, _pid, abi = SMALL.unpack_from(data)
    return Hello(mtype, version, abi)


def sender_pid(ancdata: Sequence[tuple[int, int, bytes]]) -> int | None:
    """The sender's PID from the ``SCM_CREDENTIALS`` of a recvmsg()'s ancillary data (None: none)."""
    pid = None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = UCRED.unpack(payload[:UCRED.size])[0]
    return pid


class Started(NamedTuple):
    """STARTED: command ``cid`` runs as ``pid`` inside the sandbox."""
    cid: int
    pid: int


class ExitReport(NamedTuple):
    """EXIT: how command ``cid`` ended (``kind``: an ``EXIT_*``; ``status``: its wait status, or
    an errno for a failed setup/spawn; ``flags``: ``EXITF_*``; ``stage``: a :data:`STAGES` key),
    its tree's CPU times (µs) and max RSS (KiB), and the shepherd's wall time (ns, 0: unknown)."""
    cid: int
    kind: int
    status: int
    flags: int
    stage: int
    utime_us: int
    stime_us: int
    maxrss_kib: int
    wall_ns: int


class Bye(NamedTuple):
    """BYE: the init ended the session itself; ``reason`` is a :data:`BYE_REASONS` value."""
    reason: str


def decode(data: bytes) -> Started | ExitReport | Bye | None:
    """One message from the init; None when it is malformed (unknown type or wrong size)."""
    mtype = struct.unpack_from("=I", data)[0] if len(data) >= 4 else None
    if mtype == MSG_STARTED and len(data) == SMALL.size:
        _t, cid, pid, _ = SMALL.unpack(data)
        return Started(cid, pid)
    if mtype == MSG_EXIT and len(data) == EXIT.size:
        return ExitReport(*EXIT.unpack(data)[1:])
    if mtype == MSG_BYE and len(data) == SMALL.size:
        return Bye(BYE_REASONS.get(SMALL.unpack(data)[1], "idle_timeout"))
    return None


def message_type(data: bytes) -> int | None:
    """The type field of a message (None when too short to hold one)."""
    return struct.unpack_from("=I", data)[0] if len(data) >= 4 else None


def _ms(seconds: float | None) -> int:
    return 0 if seconds is None else max(1, round(seconds * 1000))
