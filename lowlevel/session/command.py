"""The host-side state of one command of a session: its pipes, captured output and verdict.

One concept: a :class:`Command` is what the host knows of one command it sent the init (its id,
argv, timeout and the host's deadline for the init's report, the pipes it created for the
command's stdio and the output read from them, the cgroup counts at its start, and its Result or
error once the init reported its end). The core (:mod:`lowlevel.session.core`) owns the table of
them; the drivers (:mod:`lowlevel.session.sync`, :mod:`lowlevel.session.aio`) move their I/O.
"""

from __future__ import annotations

import os
import time
from typing import Any

# The capped output buffer a run's capture uses too.
from lowlevel.sandbox.state import _Capture
from lowlevel.sandbox.result import Result
from lowlevel.session.protocol import GRACE_S
from lowlevel.spec.policy import Policy

#: Bytes read from an output pipe at a time.
READ_CHUNK = 262144
#: Bytes written into a stdin pipe at a time (a pipe buffer's worth).
WRITE_CHUNK = 65536


class Command:
    """Host-side state of one command."""

    def __init__(self, cid: int, argv: list[str], policy: Policy, timeout: float | None,
                 stream: bool) -> None:
        self.id = cid
        self.argv = argv
        self.timeout = timeout
        self.t0 = time.monotonic()
        self.host_deadline = None if timeout is None else self.t0 + timeout + GRACE_S
        self.out = _Capture(policy.stdout_limit_bytes)
        self.err = _Capture(policy.stderr_limit_bytes)
        self.stream = stream
        #: Started with Session.start (a background command): a commit()/reset() refuses,
        #: waits for or leaves it (``running=``); one from run() is always waited for.
        self.background = stream
        self.new_out = bytearray()
        self.new_err = bytearray()
        self.out_r: int | None = None
        self.err_r: int | None = None
        self.stdin_w: int | None = None
        self.stdin_view: memoryview | None = None
        self.pid: int | None = None
        self.done = False
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.rlimit_names: tuple[str, ...] = ()
        self.before: Any = None
        self.net_from = 0  # egress mode: index of the session's first proxy attempt during this command
        self.notes: tuple[str, ...] = ()
        # The session cgroup's (oom_kills, pids.max hits) when the command started, and
        # whether it ever ran alongside another command (then a count may be the other's).
        self.cg_before: tuple[int | None, int | None] = (None, None)
        #: ``((cg_epoch, generation) before the read, counts)`` read for its Result (Core.cg_idle).
        self.cg_after: tuple[tuple[int, int], tuple[int | None, int | None]] | None = None
        self.alone = True

    def outcome(self) -> Result:
        """The finished command's Result, or raise the error that ended it."""
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def fds(self) -> list[int]:
        return [fd for fd in (self.out_r, self.err_r, self.stdin_w) if fd is not None]

    def read(self, fd: int) -> None:
        """Drain readable data from one of our output pipes; close it at EOF."""
        is_out = fd == self.out_r
        cap = self.out if is_out else self.err
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                os.close(fd)
                if is_out:
                    self.out_r = None
                else:
                    self.err_r = None
                return
            cap.feed(data)
            if self.stream:
                (self.new_out if is_out else self.new_err).extend(data)

    def feed_stdin(self) -> None:
        fd = self.stdin_w
        if fd is None:
            return
        view = self.stdin_view
        try:
            while view:
                view = view[os.write(fd, view[:WRITE_CHUNK]):]
        except BlockingIOError:
            self.stdin_view = view
            return
        except OSError:
            pass
        os.close(fd)
        self.stdin_w = None
        self.stdin_view = None

    def close_fds(self) -> None:
        for attr in ("out_r", "err_r", "stdin_w"):
            fd = getattr(self, attr)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, attr, None)

