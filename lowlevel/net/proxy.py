"""The host side of network egress: one small HTTP proxy endpoint per run (:class:`Listener`), serving its connections.

For ``Policy(network=Egress(...))`` each run (or session) gets a :class:`Listener`: a unix
socket in a private directory under ``/dev/shm`` (or ``/tmp``), bound read-only into the
sandbox at :data:`lowlevel.spec.egress.SOCKET_DEST` (:mod:`lowlevel.net.egress_run`), where
the in-sandbox relay connects once per TCP connection the program opens. Every listener of
the process is served by one event loop in one daemon thread (:mod:`lowlevel.net.loop`).
Creating a listener is a ``socket``/``bind``/``listen`` and an ``epoll_ctl`` in the caller's
thread (connections wait in the backlog until the loop accepts them), so the sandbox's proxy
is ready before the program starts, and a run that never connects never wakes the loop
thread; closing a listener that served connections is one round trip to the loop thread.

Per connection (all decisions are :class:`lowlevel.spec.egress.Egress`'s, see that module):
    1. read the request head (at most :data:`lowlevel.net.http_head.MAX_HEAD_BYTES`, within
       :data:`HEAD_TIMEOUT_S`) and parse it (:func:`lowlevel.net.http_head.parse_request`):
       ``CONNECT host:port`` or a plain-HTTP request; anything else is a ``400``;
    2. :meth:`Egress.decide` on the name and port; refused: ``403`` with the reason;
    3. resolve the name once and check every answer with the host's own addresses
       (:mod:`lowlevel.net.resolve`); refused: ``403``, too many lookups: ``503``;
    4. connect to the checked addresses in order (never to a name: no second lookup, so no
       DNS rebinding between check and connect); failure: ``502``/``504``;
    5. tunnel: ``200 Connection established``; the program's first bytes are held until they
       show a TLS ClientHello (:mod:`lowlevel.net.tls_sni`), whose server name must be the
       CONNECT name (:meth:`Egress.check_server_name`: else a TLS ``unrecognized_name`` alert
       and the tunnel ends, so an allowed name cannot front a denied one); bytes that are not
       TLS end the tunnel on ``Egress.tls_ports`` (default 443, :meth:`Egress.check_not_tls`)
       and pass elsewhere. Plain HTTP: one request per connection: the rewritten head, then its body
       (``Content-Length`` bytes); a second request pipelined after it is recorded as refused
       and never forwarded (only the first request's host was checked). Bytes move both ways
       by splice(2) (:mod:`lowlevel.net.tunnel`) until the server closes.
Bytes are counted per connection and per run; with ``Limits(net_bytes=N)`` the connection
that crosses N is cut after exactly N bytes in total, every other connection of the run is
closed and later requests get ``403``. The run's :attr:`lowlevel.Result.network` lists each
attempt (:mod:`lowlevel.net.attempts`).

Bounds per run: :data:`MAX_CONNECTIONS` open at once (more get ``503``),
:data:`CONNECTING_PER_RUN` connects in progress, the lookups of :mod:`lowlevel.net.resolve`,
:data:`lowlevel.net.attempts.MAX_ATTEMPTS` recorded. The host process holds two fds per open
connection.

Library choice (the rule: a well-kept library where one fits). Evaluated: proxy.py
(abhinavsingh) has the hooks (``before_upstream_connection`` can reject, ``resolve_dns`` can
pin the address) but runs its own acceptor processes/threads and event loops configured by
process-wide flags, so a per-run listener with a per-run policy and an in-process report
would mean one proxy instance (processes) per run or IPC for every decision, plus a large
surface (TLS interception, web server, plugins) we would never use. mitmproxy (addons can
decide per connection) is far larger still, built around TLS interception. pproxy is
asyncio-native but unmaintained since 2021 and has no per-connection decision hook. So the
proxy is ours and small (the modules of :mod:`lowlevel.net`), and the decisions live apart,
pure and unit-tested, in :mod:`lowlevel.spec.egress`.

Sources: RFC 9110 (CONNECT 9.3.6, 403/408/431/502/503/504), RFC 9112 section 9.3.2
(pipelining) and 9.6 (``Connection: close``); asyncio streams and low-level socket docs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import tempfile
import threading
from typing import Any

from lowlevel.net import loop as proxy_loop
from lowlevel.net import resolve
from lowlevel.net.attempts import MAX_ATTEMPTS, Attempt, AttemptLog
from lowlevel.net.http_head import MAX_HEAD_BYTES, RefusedError, Request, parse_request, refusal, starts_http_request
from lowlevel.net.tls_sni import MAX_HELLO_BYTES, TLS_ALERT_UNRECOGNIZED_NAME, NotTlsError, parse_client_hello
from lowlevel.net.tunnel import Tunnel
from lowlevel.spec.egress import Egress, NetworkAttempt

log = logging.getLogger("lowlevel")

#: How long a connection may take to send its request head, seconds.
HEAD_TIMEOUT_S = 30.0
#: How long connecting to one upstream address may take, seconds.
CONNECT_TIMEOUT_S = 10.0
#: Connections one run may have open through the proxy at once.
MAX_CONNECTIONS = 128
#: Upstream connects one run may have in progress at once (more get ``503``).
CONNECTING_PER_RUN = 32
#: How long the proxy waits to send a response head or a refusal, seconds.
SEND_TIMEOUT_S = 10.0


@functools.lru_cache(maxsize=None)
def _socket_base() -> str:
    """Where the per-run socket directories go: ``/dev/shm`` (a tmpfs on Linux: creating and
    removing a directory and a socket there costs ~0.03 ms, against 1-3 ms on a busy ext4
    ``/tmp``), else ``/tmp``. Both are sticky and world-writable; each run's directory is
    private (0700, or 0710 for the sandbox's group)."""
    for base in ("/dev/shm", "/tmp"):
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            return base
    return tempfile.gettempdir()


def _remove(path: str, directory: str) -> None:
    for fn, target in ((os.unlink, path), (os.rmdir, directory)):
        try:
            fn(target)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("lowlevel: cannot remove the egress socket %s: %s", target, err)


class Listener:
    """The proxy endpoint of one run or session: a unix socket and the connections through it.

    Args:
        egress: the decisions.
        net_bytes: the byte cap of the whole run (both directions), or None.
        group: for a root caller, the sandbox's host gid: the socket's directory becomes
            ``root:group 0710`` and the socket ``root:group 0660`` so bwrap (running as the
            sandbox's uid) can bind it and the program can connect; None: the caller's own
            uid runs the sandbox, modes 0700 and 0600.
    Attributes:
        path: the socket's path on the host.
        attempts: the run's :class:`lowlevel.net.attempts.AttemptLog` (``len()`` is the
            index the next attempt gets; see :meth:`attempts_since`).
    Raises:
        OSError: the directory or socket cannot be made.
    """

    def __init__(self, egress: Egress, net_bytes: int | None = None, group: int | None = None) -> None:
        self.egress = egress
        self.net_bytes = net_bytes
        self.used = 0
        self.exhausted = False
        self.lock = threading.Lock()
        self.override = resolve.override
        self.attempts = AttemptLog("test-override" if self.override is not None else "system")
        self.tasks: set[asyncio.Task[None]] = set()
        self.tunnels: set[Tunnel] = set()
        self.closed = False
        self.accepted = 0  # connections accepted (under self.lock, with self.closed)
        self.connecting = 0  # upstream connects in progress (loop thread only)
        self.dir = tempfile.mkdtemp(prefix="lowlevel-egress-", dir=_socket_base())
        self.path = os.path.join(self.dir, "proxy.sock")
        self.sock: socket.socket | None = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock = sock
            sock.bind(self.path)
            if group is not None:
                os.chown(self.dir, -1, group)
                os.chmod(self.dir, 0o710)
                os.chown(self.path, -1, group)
                os.chmod(self.path, 0o660)
            else:
                os.chmod(self.path, 0o600)
            sock.listen(128)
            sock.setblocking(False)
            self.proxy = proxy_loop.shared()
            self.loop = self.proxy.loop
            self.lookups = resolve.RunLookups(self.loop, self.override)
            self.fd = sock.fileno()
            self.proxy.add(self.fd, self._on_accept)
        except BaseException:
            if self.sock is not None:
                self.sock.close()
            _remove(self.path, self.dir)
            raise

    # -- loop thread ---------------------------------------------------------------------------
    def _on_accept(self) -> None:
        """Accept what is waiting (the loop thread, through the proxy's ``mux``)."""
        conns = []
        with self.lock:  # accept() under the lock: close() cannot close the socket meanwhile
            if self.closed or self.sock is None:
                return
            for _ in range(64):
                try:
                    conn, _addr = self.sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as err:
                    log.warning("lowlevel: egress proxy accept failed: %s", err)
                    break
                conns.append(conn)
            self.accepted += len(conns)
        for conn in conns:
            if len(self.tasks) >= MAX_CONNECTIONS:
                reason = f"more than {MAX_CONNECTIONS} connections open at once"
                self.attempts.record("?", "", 0).reason = reason
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(refusal(503, reason))
                conn.close()
                continue
            task = self.loop.create_task(self._serve(conn))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        """One connection: its request, the decision, the upstream connection, the exchange."""
        upstream: socket.socket | None = None
        attempt: Attempt | None = None
        try:
            conn.setblocking(False)
            received = await self._receive(conn)
            if received is None:
                return
            req, rest = received
            attempt = self.attempts.record(req.method, req.host, req.port)
            upstream = await self._open_upstream(req, attempt)
            await self._exchange(conn, upstream, req, rest, attempt)
        except RefusedError as ref:
            if attempt is not None and not attempt.reason:
                attempt.reason = ref.reason
            with contextlib.suppress(OSError, TimeoutError):
                await self._sendall(conn, refusal(ref.status, ref.reason))
        except (OSError, TimeoutError):
            pass
        except asyncio.CancelledError:
            if attempt is not None and attempt.allowed and attempt.error is None and not self.exhausted:
                attempt.error = "closed: the run ended"
            raise
        finally:
            for sock in (upstream, conn):
                if sock is not None:
                    sock.close()

    async def _receive(self, conn: socket.socket) -> tuple[Request, bytes] | None:
        """The connection's request and the bytes after its head, or None when the program sent
        nothing; a head that is late, too long, incomplete or refused by the parser is recorded
        as a ``"?"`` attempt and raised (408, 431, 400)."""
        try:
            try:
                async with asyncio.timeout(HEAD_TIMEOUT_S):
                    head, rest = await self._read_head(conn)
            except TimeoutError:
                raise RefusedError(408, f"no complete request head within {HEAD_TIMEOUT_S:g} s") from None
            if head is None:
                if not rest.strip():
                    return None
                if len(rest) > MAX_HEAD_BYTES:
                    raise RefusedError(431, f"request head over {MAX_HEAD_BYTES} bytes")
                raise RefusedError(400, "incomplete request head")
            return parse_request(head), rest
        except RefusedError as ref:
            self.attempts.record("?", "", 0).reason = ref.reason
            raise

    async def _read_head(self, conn: socket.socket) -> tuple[bytes | None, bytes]:
        """(head, bytes after it), or (None, what came) when the peer closed or sent too much."""
        buf = bytearray()
        while True:
            data = await self.loop.sock_recv(conn, 65536)
            if not data:
                return None, bytes(buf)
            start = max(0, len(buf) - 3)
            buf += data
            end = buf.find(b"\r\n\r\n", start)
            if end >= 0:
                return bytes(buf[:end + 4]), bytes(buf[end + 4:])
            if len(buf) > MAX_HEAD_BYTES:
                return None, bytes(buf)

    async def _exchange(self, conn: socket.socket, upstream: socket.socket, req: Request, rest: bytes,
                        attempt: Attempt) -> None:
        """The connection after its upstream is open: the first bytes (checked), then the tunnel."""
        tunnel = Tunnel(self, conn, upstream, attempt)
        self.tunnels.add(tunnel)
        try:
            first = await self._first_bytes(tunnel, conn, req, rest, attempt)
            if first is None:
                return
            if first and not await self._send_first(upstream, first, attempt):
                return
            if tunnel.upflow.started and not tunnel.upflow.reading:
                with contextlib.suppress(OSError):
                    upstream.shutdown(socket.SHUT_WR)
            await tunnel.run()
        finally:
            tunnel.close()
            self.tunnels.discard(tunnel)

    async def _first_bytes(self, tunnel: Tunnel, conn: socket.socket, req: Request, rest: bytes,
                           attempt: Attempt) -> bytes | None:
        """What goes upstream first: for CONNECT the program's first bytes once their
        ClientHello passed (None: refused or ended); for plain HTTP the rewritten head and the
        body bytes already read. One request per connection: what follows the body is a
        second request, recorded and refused (:meth:`pipelined`)."""
        if req.head_out is None:
            await self._sendall(conn, b"HTTP/1.1 200 Connection established\r\n\r\n")
            return await self._check_hello(tunnel, conn, attempt, rest)
        body, extra = rest[:req.body_len], rest[req.body_len:]
        tunnel.upflow.limit = req.body_len - len(body)
        if extra:
            self.pipelined(extra)
            tunnel.upflow.started = True  # never read more from the program
        return req.head_out + body

    async def _send_first(self, upstream: socket.socket, first: bytes, attempt: Attempt) -> bool:
        """Send ``first`` upstream within the run's cap; False when the cap cut it (the run's
        connections are then cut)."""
        allowed = self._take(len(first))
        attempt.up += allowed
        await self._sendall(upstream, first[:allowed])
        if allowed < len(first):
            attempt.error = "net_bytes"
            self.cut_all()
            return False
        return True

    async def _check_hello(self, tunnel: Tunnel, conn: socket.socket, attempt: Attempt,
                           rest: bytes) -> bytes | None:
        """Hold the program's first bytes in a tunnel until they show whether they are a TLS
        ClientHello, and check its server name (:meth:`Egress.check_server_name`). The
        server's bytes flow meanwhile (a protocol where the server speaks first works).

        Returns:
            The bytes to send on (not TLS on a port outside ``Egress.tls_ports``, or a
            ClientHello that passed), or None when the tunnel ended meanwhile, the ClientHello
            was refused (then the program got a TLS ``unrecognized_name`` alert and the attempt
            says why) or bytes that are not TLS came first on a TLS port (the tunnel just ends).
        """
        tunnel.downflow.start()
        buf = bytearray(rest)
        while True:
            reason = None
            try:
                hello = parse_client_hello(bytes(buf))
            except NotTlsError:
                decided, out = self._not_tls(tunnel, attempt, buf)
                if decided:
                    return out
                hello = None  # the start of an HTTP request line so far: more bytes decide
            except ValueError as err:
                hello, reason = None, f"the tunnel's TLS ClientHello is malformed ({err})"
            if hello is not None:
                d = self.egress.check_server_name(attempt.host, hello.sni, ech=hello.ech)
                if d.allowed:
                    attempt.reason += f"; {d.reason}"
                    return bytes(buf)
                reason = d.reason
            elif reason is None and len(buf) > 8 * MAX_HELLO_BYTES:
                reason = f"no complete TLS ClientHello in the tunnel's first {len(buf)} bytes"
            if reason is not None:
                attempt.refused(reason)
                tunnel.close()
                with contextlib.suppress(OSError, TimeoutError):
                    await self._sendall(conn, TLS_ALERT_UNRECOGNIZED_NAME)
                return None
            data = await self._recv_or_end(tunnel, conn)
            if not data:
                return b"" if data is not None and not buf else None
            buf += data

    def _not_tls(self, tunnel: Tunnel, attempt: Attempt, buf: bytearray) -> tuple[bool, bytes | None]:
        """Decide a tunnel whose first bytes are not TLS (:meth:`Egress.check_not_tls`): (False,
        None) while they may still be the start of an HTTP request line, else (True, the bytes to
        send on, or None: refused, the tunnel closed). A request line refuses the tunnel on any
        port: inside a tunnel its ``Host`` would go unchecked (:func:`starts_http_request`)."""
        http = starts_http_request(bytes(buf)) if attempt.port not in self.egress.tls_ports else False
        if http is None and len(buf) <= MAX_HEAD_BYTES:
            return False, None
        d = self.egress.check_not_tls(attempt.host, attempt.port, http=http is not False)
        if d.allowed:
            attempt.reason += f"; {d.reason}"
            return True, bytes(buf)
        attempt.refused(d.reason)
        tunnel.close()
        return True, None  # not a TLS client: no alert, the tunnel just ends

    async def _recv_or_end(self, tunnel: Tunnel, conn: socket.socket) -> bytes | None:
        """The program's next bytes (b"" at its EOF), or None when the tunnel ended first or
        the read failed."""
        recv = self.loop.create_task(self.loop.sock_recv(conn, 65536))
        try:
            waiters: set[asyncio.Future[Any]] = {recv, tunnel.done}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not recv.done():
                recv.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await recv
        if recv.cancelled() or recv.exception() is not None:
            return None
        return recv.result()

    def pipelined(self, data: bytes) -> None:
        """Record the request that came after a plain-HTTP connection's first one (not forwarded)."""
        method, host, port = "?", "", 0
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            with contextlib.suppress(RefusedError):
                req = parse_request(data[:end + 4])
                method, host, port = req.method, req.host, req.port
        attempt = self.attempts.record(method, host, port)
        reason = ("a second request on one plain-HTTP connection (pipelined) is not forwarded: the proxy takes "
                  "one request per connection (it sent Connection: close); send it on a new connection")
        if host:
            d = self.egress.decide(host, port, tunnel=method == "CONNECT")
            attempt.host = d.host
            if not d.allowed:
                reason += f" (and {d.reason})"
        attempt.reason = reason

    async def _sendall(self, sock: socket.socket, data: bytes) -> None:
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await self.loop.sock_sendall(sock, data)

    async def _open_upstream(self, req: Request, attempt: Attempt) -> socket.socket:
        """Decide, resolve once, check the answers and connect to them; raise RefusedError otherwise."""
        if self.exhausted:
            attempt.reason = f"the run's net_bytes cap of {self.net_bytes} bytes is used up"
            raise RefusedError(403, attempt.reason)
        d = self.egress.decide(req.host, req.port, tunnel=req.head_out is None)
        attempt.decided(d)
        if not d.allowed:
            raise RefusedError(403, d.reason)
        allow_reason = d.reason
        if d.address is not None:
            addresses = [d.address]
        else:
            try:
                addresses, pretend = await self.lookups.resolve(d.host, req.port)
            except RefusedError as ref:
                attempt.refused(ref.reason)
                raise
            checked = resolve.check_answers(self.egress, d.host, addresses, pretend)
            attempt.decided(checked)
            if not checked.allowed:
                raise RefusedError(403, checked.reason)
            attempt.reason = f"{allow_reason}; {checked.reason}"
        if self.connecting >= CONNECTING_PER_RUN:
            attempt.refused(f"{self.connecting} connects of this run are in progress (at most "
                            f"{CONNECTING_PER_RUN} at once): retry when one ends")
            raise RefusedError(503, attempt.reason)
        self.connecting += 1
        try:
            return await self._connect(d.host, req.port, addresses, attempt)
        finally:
            self.connecting -= 1

    async def _connect(self, host: str, port: int, addresses: list[str], attempt: Attempt) -> socket.socket:
        """A connected socket to the first of ``addresses`` that answers, in order; 502/504 otherwise."""
        errors = []
        for address in addresses:
            attempt.address = address
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    await self.loop.sock_connect(sock, (address, port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except TimeoutError:
                sock.close()
                errors.append(f"{address}: timed out after {CONNECT_TIMEOUT_S:g} s")
            except OSError as err:
                sock.close()
                errors.append(f"{address}: {err.strerror or err}")
            except BaseException:
                sock.close()
                raise
        attempt.address = addresses[0] if addresses else None
        attempt.error = "connect: " + "; ".join(errors)
        timed_out = all("timed out" in e for e in errors)
        raise RefusedError(504 if timed_out else 502, f"cannot connect to {host} port {port}: "
                           + "; ".join(errors))

    def _take(self, n: int) -> int:
        """How many of ``n`` bytes may pass under the run's cap (all of them without one)."""
        if self.net_bytes is None:
            self.used += n
            return n
        room = max(0, self.net_bytes - self.used)
        self.used += min(n, room)
        return min(n, room)

    def cut_all(self) -> None:
        """The cap is reached: close every connection of the run, refuse new ones (loop thread)."""
        self.exhausted = True
        for tunnel in list(self.tunnels):
            tunnel.finish("net_bytes")

    async def _aclose(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- caller's thread -----------------------------------------------------------------------
    def attempts_since(self, index: int) -> tuple[tuple[NetworkAttempt, ...], int]:
        """The attempts recorded from ``index`` on (running ones as they are now), and the next index."""
        return self.attempts.since(index)

    def notes(self) -> list[str]:
        """Notes for the Result: the cap reached, attempts not recorded, a resolver override."""
        out = []
        if self.exhausted:
            out.append(f"egress: the net_bytes cap ({self.net_bytes} bytes) was reached: connections were "
                       "cut and later requests refused")
        if self.attempts.dropped:
            out.append(f"egress: {self.attempts.dropped} more connection attempts were not recorded "
                       f"(at most {MAX_ATTEMPTS} per run)")
        if self.override is not None:
            out.append("egress: TEST-ONLY resolver override in force (lowlevel.net.resolve.override)")
        return out

    def close(self) -> tuple[NetworkAttempt, ...]:
        """Stop listening, close every connection, remove the socket; return every attempt. Idempotent.

        A run that never connected costs no round trip to the loop thread; otherwise this waits
        (at most 10 s) until the loop has cancelled its connections and recorded their bytes.
        """
        with self.lock:
            if self.closed:
                return self.attempts.since(0)[0]
            self.closed = True
            busy = self.accepted > 0
        self.proxy.remove(self.fd)
        if busy:
            try:
                asyncio.run_coroutine_threadsafe(self._aclose(), self.loop).result(timeout=10)
            except Exception as err:  # noqa: BLE001 - cleanup must go on; the loop thread may be gone
                log.warning("lowlevel: egress proxy did not close cleanly: %s", err)
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        _remove(self.path, self.dir)
        return self.attempts.since(0)[0]


__all__ = ["CONNECTING_PER_RUN", "CONNECT_TIMEOUT_S", "HEAD_TIMEOUT_S", "Listener", "MAX_CONNECTIONS",
           "SEND_TIMEOUT_S"]
