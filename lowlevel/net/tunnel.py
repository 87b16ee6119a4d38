"""A proxied connection after its request head: bytes both ways with splice(2), counted and capped.

Concept: a :class:`Tunnel` joins the program's connection and the upstream one with two
:class:`Flow` objects, one per direction, each moving bytes through a kernel pipe
(splice(2): they never enter Python) with backpressure both ways. The flows count the bytes
into the run's :class:`RunBytes` (``Limits(net_bytes=N)``: the flow that crosses N is cut
after exactly N bytes in total and the run cuts every other) and, for plain HTTP, stop the
program's side after its one request's body (bytes after it are a pipelined second request:
handed to the run to record, never forwarded). The exchange ends when the server closes;
the program's half-close is passed on.

Sources: splice(2) (SPLICE_F_NONBLOCK, SPLICE_F_MOVE), fcntl(2) (F_SETPIPE_SZ); RFC 9112
section 9.3.2 (pipelining).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import socket
from typing import Protocol

from lowlevel.net.attempts import Attempt
from lowlevel.net.http_head import MAX_HEAD_BYTES

#: Kernel pipe size per direction of a tunnel (``F_SETPIPE_SZ``; bytes in flight per splice).
PIPE_BYTES = 256 * 1024

_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)


class RunBytes(Protocol):
    """What a tunnel needs of its run (:class:`lowlevel.net.proxy.Listener` is one)."""

    loop: asyncio.AbstractEventLoop
    #: The run's byte cap (both directions, every connection), or None.
    net_bytes: int | None
    #: Bytes the run's connections have moved so far.
    used: int

    def pipelined(self, data: bytes) -> None:
        """Record the request that came after a plain-HTTP connection's first (not forwarded)."""

    def cut_all(self) -> None:
        """The cap is reached: close every connection of the run, refuse new ones."""


class Flow:
    """One direction of a tunnel: ``src`` -> a kernel pipe -> ``dst`` with splice(2), so the bytes
    never enter Python (a copy through user space costs ~3 ms of CPU per MiB here). Callback
    driven in the loop thread: read readiness on ``src`` while the pipe has room, write readiness
    on ``dst`` while it holds bytes (backpressure both ways). Counts and caps the bytes taken
    from ``src``. The pipe is made on first use (a direction that never carries data costs no fds).
    Where no pipe can be made (EMFILE) or splice(2) refuses the fds (EINVAL, ENOSYS), the same
    loop copies through a ``bytearray`` with read(2)/write(2) instead.

    Source: splice(2) (SPLICE_F_NONBLOCK, SPLICE_F_MOVE), fcntl(2) F_SETPIPE_SZ.
    """

    def __init__(self, tunnel: Tunnel, src: socket.socket, dst: socket.socket, up: bool) -> None:
        self.tunnel = tunnel
        self.loop = tunnel.loop
        self.src, self.dst = src.fileno(), dst.fileno()
        self.dst_sock = dst
        self.up = up
        self.r = self.w = -1
        self.buf: bytearray | None = None  # copy mode
        self.cap = 0
        self.queued = 0
        self.eof = False
        self.cut = False
        self.reading = self.writing = False
        self.closed = False
        self.started = False
        #: Bytes still to pass before the request is complete (plain HTTP, up direction), or
        #: None (no limit). At 0, more bytes are a second request: recorded, refused, and
        #: taken as the program's end of sending.
        self.limit: int | None = None

    def start(self) -> None:
        if not self.started:
            self.started = True
            self._read_on()

    def _read_on(self) -> None:
        if not self.reading:
            self.loop.add_reader(self.src, self._on_readable)
            self.reading = True

    def stop_reading(self) -> None:
        """Take no more bytes from ``src`` (bytes already queued still go out)."""
        if self.reading:
            self.loop.remove_reader(self.src)
            self.reading = False

    def _write_on(self) -> None:
        if not self.writing:
            self.loop.add_writer(self.dst, self._on_writable)
            self.writing = True

    def _write_off(self) -> None:
        if self.writing:
            self.loop.remove_writer(self.dst)
            self.writing = False

    def _pipe(self) -> None:
        if not hasattr(os, "splice"):
            return self._to_copy()
        try:
            self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return self._to_copy()
        try:
            fcntl.fcntl(self.w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
        except OSError:
            pass
        self.cap = fcntl.fcntl(self.w, getattr(fcntl, "F_GETPIPE_SZ", 1032))
        return None

    def _to_copy(self) -> None:
        for fd in (self.r, self.w):
            if fd >= 0:
                os.close(fd)
        self.r = self.w = -1
        self.buf = bytearray()
        self.cap = PIPE_BYTES

    def _take(self, want: int) -> int:
        """Move up to ``want`` bytes from ``src`` in; 0 at EOF; BlockingIOError when none wait."""
        if self.buf is None:
            try:
                return os.splice(self.src, self.w, want, flags=_SPLICE_FLAGS)
            except OSError as err:
                if err.errno not in (errno.EINVAL, errno.ENOSYS) or self.queued:
                    raise
                self._to_copy()
        assert self.buf is not None
        data = os.read(self.src, want)
        self.buf += data
        return len(data)

    def _give(self) -> int:
        """Move queued bytes out to ``dst``; BlockingIOError when it takes none."""
        if self.buf is None:
            return os.splice(self.r, self.dst, self.queued, flags=_SPLICE_FLAGS)
        m = os.write(self.dst, self.buf)
        del self.buf[:m]
        return m

    def _on_readable(self) -> None:
        if self.closed:  # a callback already queued when the tunnel ended
            return
        try:
            if self.r < 0 and self.buf is None:
                self._pipe()
            owner = self.tunnel.owner
            attempt = self.tunnel.attempt
            while self.queued < self.cap and not self.eof:
                want = self.cap - self.queued
                if self.limit is not None:
                    if self.limit == 0:
                        try:
                            extra = os.read(self.src, MAX_HEAD_BYTES)
                        except BlockingIOError:
                            break
                        if extra:
                            owner.pipelined(extra)
                        self.eof = True
                        break
                    want = min(want, self.limit)
                if owner.net_bytes is not None:
                    want = min(want, owner.net_bytes - owner.used)
                    if want <= 0:
                        self.cut = True
                        break
                try:
                    n = self._take(want)
                except BlockingIOError:
                    break
                if n == 0:
                    self.eof = True
                    break
                owner.used += n
                self.queued += n
                if self.limit is not None:
                    self.limit -= n
                if self.up:
                    attempt.up += n
                else:
                    attempt.down += n
            if self.eof or self.cut:
                self.stop_reading()
            self._flush()
        except OSError as err:
            self.tunnel.finish(None if err.errno in (errno.ECONNRESET, errno.EPIPE) else f"{err.strerror or err}")

    def _on_writable(self) -> None:
        if self.closed:
            return
        try:
            self._flush()
        except OSError as err:
            self.tunnel.finish(None if err.errno in (errno.ECONNRESET, errno.EPIPE) else f"{err.strerror or err}")

    def _flush(self) -> None:
        while self.queued:
            try:
                m = self._give()
            except BlockingIOError:
                self.stop_reading()  # backpressure: read again once dst took the pipe's bytes
                self._write_on()
                return
            self.queued -= m
        self._write_off()
        if self.cut:
            self.tunnel.attempt.error = "net_bytes"
            self.tunnel.owner.cut_all()
        elif self.eof:
            if self.up:
                with contextlib.suppress(OSError):
                    self.dst_sock.shutdown(socket.SHUT_WR)
            self.tunnel.flow_done(self)
        else:
            self._read_on()

    def close(self) -> None:
        self.closed = True
        self.stop_reading()
        self._write_off()
        for fd in (self.r, self.w):
            if fd >= 0:
                os.close(fd)
        self.r = self.w = -1


class Tunnel:
    """A connection after its head: bytes both ways until the server's side ends (or an error,
    or the run's cap, or the run's end). The program's half-close is passed on.

    Args:
        owner: the run (its loop, byte cap and count).
        client: the program's connection (non-blocking).
        upstream: the connection to the server (non-blocking).
        attempt: the attempt whose bytes and error this tunnel records.
    """

    def __init__(self, owner: RunBytes, client: socket.socket, upstream: socket.socket, attempt: Attempt) -> None:
        self.owner = owner
        self.loop = owner.loop
        self.attempt = attempt
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.upflow = Flow(self, client, upstream, True)
        self.downflow = Flow(self, upstream, client, False)

    async def run(self) -> None:
        """Move bytes both ways until :meth:`finish`; the flows are closed on return."""
        try:
            self.upflow.start()
            self.downflow.start()
            await self.done
        finally:
            self.close()

    def close(self) -> None:
        """Close both flows (their pipes; the sockets are the caller's)."""
        self.upflow.close()
        self.downflow.close()

    def flow_done(self, flow: Flow) -> None:
        """A flow passed its EOF on: the server's side ending ends the tunnel."""
        if flow is self.downflow:
            self.finish(None)

    def finish(self, error: str | None) -> None:
        """End the tunnel (loop thread); ``error`` goes to the attempt unless it already has
        one (None: a normal end)."""
        if error is not None and self.attempt.error is None:
            self.attempt.error = error
        self.upflow.stop_reading()
        self.downflow.stop_reading()
        if not self.done.done():
            self.done.set_result(None)


__all__ = ["PIPE_BYTES", "Flow", "RunBytes", "Tunnel"]
