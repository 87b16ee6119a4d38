"""The host side of network egress: one small HTTP proxy per run, served by a shared asyncio thread.

For ``Policy(network=Egress(...))`` each run (or session) gets a :class:`Listener`: a unix
socket in a private directory under ``/dev/shm`` (or ``/tmp``), bound read-only into the sandbox at
:data:`lowlevel.spec.egress.SOCKET_DEST`, where the in-sandbox relay (``native/lowlevel_relay.c``,
listening on ``127.0.0.1:3128``) connects once per TCP connection the program opens. Every
listener of the process is served by one event loop in one daemon thread
(``lowlevel-egress``), started on first use; a sync :func:`lowlevel.run`, an
:func:`lowlevel.arun` and a Session all use it, so no run pays for a thread or a process.
Creating a listener is a ``socket``/``bind``/``listen`` and an ``epoll_ctl`` in the caller's
thread (connections wait in the backlog until the loop accepts them), so the sandbox's proxy is
ready before the program starts, and a run that never connects never wakes the loop thread;
closing a listener that served connections is one round trip to the loop thread.

Per connection (all decisions are :class:`lowlevel.spec.egress.Egress`'s, see that module):
    1. read the request head (at most :data:`MAX_HEAD_BYTES`, within :data:`HEAD_TIMEOUT_S`);
    2. ``CONNECT host:port`` (a tunnel) or a plain-HTTP request in absolute form
       (``GET http://host[:port]/path``) or origin form with ``Host:``; anything else is a
       ``400``;
    3. :meth:`Egress.decide` on the name and port; refused: ``403`` with the reason;
    4. resolve the name once (``getaddrinfo``, in the proxy's resolver threads, at most
       :data:`RESOLVE_PER_RUN` lookups of a run at once and :data:`RESOLVE_QUEUE_PER_RUN`
       waiting, so a run whose names never resolve holds a few threads and cannot stall
       another run), then :meth:`Egress.check_addresses` on every answer, with the host's
       own addresses (:func:`host_addresses`); refused: ``403``, too many lookups: ``503``;
    5. connect to the checked addresses in order (never to a name: no second lookup, so no
       DNS rebinding between check and connect); failure: ``502``/``504``;
    6. tunnel: ``200 Connection established``; the program's first bytes are held until they
       show a TLS ClientHello (:func:`parse_client_hello`), whose server name (SNI) must be
       the CONNECT name (:meth:`Egress.check_server_name`: else a TLS ``unrecognized_name``
       alert and the tunnel ends, so an allowed name cannot front a denied one); bytes that
       are not TLS pass. Plain HTTP: one request per connection: the head is sent on in
       origin form with ``Host`` set from the URL, ``Proxy-*`` and hop-by-hop headers
       dropped and ``Connection: close``, then its body (``Content-Length`` bytes; a
       ``Transfer-Encoding`` gets ``411``); a second request pipelined after it is recorded
       as refused and never forwarded (only the first request's host was checked). Bytes
       move both ways by splice(2) through a kernel pipe per direction (:class:`_Flow`). The
       exchange ends when the server closes (the program's half-close is passed on).
Bytes are counted per connection and per run; with ``Limits(net_bytes=N)`` the connection
that crosses N is cut after exactly N bytes in total, every other connection of the run is
closed and later requests get ``403``. The run's :attr:`lowlevel.Result.network` lists each
attempt (:class:`lowlevel.spec.egress.NetworkAttempt`).

Bounds per run: :data:`MAX_CONNECTIONS` open at once (more get ``503``),
:data:`CONNECTING_PER_RUN` connects in progress, :data:`RESOLVE_PER_RUN` lookups running
and :data:`RESOLVE_QUEUE_PER_RUN` waiting (within :data:`RESOLVE_TIMEOUT_S`), :data:`MAX_ATTEMPTS`
recorded (later ones counted in a note). The host process holds two fds per open connection
and at most :data:`RESOLVER_THREADS` resolver threads.

Library choice (the rule: a well-kept library where one fits). Evaluated: proxy.py
(abhinavsingh) has the hooks (``before_upstream_connection`` can reject, ``resolve_dns`` can
pin the address) but runs its own acceptor processes/threads and event loops configured by
process-wide flags, so a per-run listener with a per-run policy and an in-process report
would mean one proxy instance (processes) per run or IPC for every decision, plus a large
surface (TLS interception, web server, plugins) we would never use. mitmproxy (addons can
decide per connection) is far larger still, built around TLS interception. pproxy is
asyncio-native but unmaintained since 2021 and has no per-connection decision hook. So the
proxy is ours and small (this module), and the decisions live apart, pure and unit-tested,
in :mod:`lowlevel.spec.egress`.

Test-only: :func:`override_resolver_for_tests` replaces ``getaddrinfo`` in this process so
tests can name local servers. It is not part of :class:`lowlevel.Policy` (so no record, CLI
flag, MCP request or environment variable can set it), nothing inside a sandbox can reach it
(the sandbox only speaks HTTP to the proxy), and every attempt made under it says
``resolver="test-override"`` and the run's notes say so.

Sources: RFC 9110 (CONNECT 9.3.6, absolute-form 7.1, 403/411/502/503/504), RFC 9112 section 6.3
(message body length), 9.3.2 (pipelining) and 9.6 (``Connection: close``), RFC 7230 section 6.1
(hop-by-hop headers); RFC 8446 sections 4.1.2, 5.1 and 6 (ClientHello, records, alerts), RFC 6066
section 3 (server_name); netdevice(7) (SIOCGIFCONF); asyncio streams docs.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import logging
import os
import re
import select
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from lowlevel.paths import native
from lowlevel.spec.egress import CA_BUNDLE_DEST, PROXY_PORT, SOCKET_DEST, Decision, Egress, NetworkAttempt
from lowlevel.errors import LowlevelError, UnsupportedError

log = logging.getLogger("lowlevel")

#: Largest request head the proxy reads (request line and headers), bytes.
MAX_HEAD_BYTES = 64 * 1024
#: How long a connection may take to send its request head, seconds.
HEAD_TIMEOUT_S = 30.0
#: How long one name resolution may take, seconds.
RESOLVE_TIMEOUT_S = 10.0
#: How long connecting to one upstream address may take, seconds.
CONNECT_TIMEOUT_S = 10.0
#: Connections one run may have open through the proxy at once.
MAX_CONNECTIONS = 128
#: Name lookups one run may have running in the resolver threads at once. A lookup that timed
#: out for its request keeps its thread (a thread cannot be stopped) and its slot until the
#: resolver returns, so one run never holds more than this many threads, however many of its
#: lookups hang. Concurrent requests of one run for the same name and port share one lookup.
RESOLVE_PER_RUN = 4
#: Lookups one run may have waiting for one of its slots; beyond that a request gets ``503``.
RESOLVE_QUEUE_PER_RUN = 32
#: Resolver threads of the process (shared by all runs, started as needed); at least
#: ``RESOLVE_PER_RUN`` times the number of runs that may hang their lookups at once.
RESOLVER_THREADS = 64
#: Upstream connects one run may have in progress at once (more get ``503``).
CONNECTING_PER_RUN = 32
#: How long the host's own addresses (:func:`host_addresses`) are cached, seconds.
HOST_ADDRESSES_TTL_S = 1.0
#: Largest TLS ClientHello the proxy reads to check its server name, bytes (the handshake
#: message across its records; a post-quantum key share makes it ~1.8 KB).
MAX_HELLO_BYTES = 64 * 1024
#: Attempts recorded per run; later ones are counted in a note.
MAX_ATTEMPTS = 10_000
#: How long the proxy waits to send a response head or a refusal, seconds.
SEND_TIMEOUT_S = 10.0
#: Kernel pipe size per direction of a tunnel (``F_SETPIPE_SZ``; bytes in flight per splice).
PIPE_BYTES = 256 * 1024
#: Fd numbers inside the sandbox: the relay executable (exec'd as /proc/self/fd/N, closed by
#: the relay first thing) and the CA bundle memfd (``--ro-bind-data``). Sessions use 9 and 10.
RELAY_FD = 20
CA_FD = 21
#: The relay executable built by setup.py from ``native/lowlevel_relay.c``.
RELAY_PATH = native("_lowlevel_relay")
#: The host's CA bundle, the base of the sandbox's bundle when ``extra_ca_pem`` is given.
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

#: Headers a proxy does not pass on (RFC 7230 6.1 hop-by-hop, and the proxy's own).
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authorization",
                         "proxy-authenticate", "te", "trailer", "upgrade", "host"})

Resolver = Callable[[str, int], "Sequence[str] | None"]
_resolver_override: tuple[Resolver, frozenset[str]] | None = None


@contextlib.contextmanager
def override_resolver_for_tests(resolver: Resolver, *, pretend_public: Sequence[str] = ()) -> Iterator[None]:
    """TEST ONLY: answer the proxy's name lookups with ``resolver(name, port)`` in this process.

    The test suite uses it to give allowlisted names the addresses of servers on host
    loopback. It changes nothing the sandbox can reach and is not a Policy field; attempts
    made under it carry ``resolver="test-override"`` and the run's notes say so. Listeners
    take the override in force when they are created (a run's whole life).

    Args:
        resolver: called in a worker thread with the normalized name and the port; returns
            numeric addresses (str) in order, or None to ask the system resolver instead; may
            raise OSError (then the request gets 502).
        pretend_public: addresses that count as public when ``resolver`` returns them (so a
            test server on 127.0.0.1 can stand for a public host). IP literals and the system
            resolver's answers are never affected.
    """
    global _resolver_override
    previous, _resolver_override = _resolver_override, (resolver, frozenset(pretend_public))
    try:
        yield
    finally:
        _resolver_override = previous


# --- the shared loop --------------------------------------------------------------------------

class _ProxyThread:
    """One asyncio loop in a daemon thread serving every listener of the process, and the
    epoll set (``mux``) through which it learns of their connections.

    A run's listening socket is added to ``mux`` (``epoll_ctl``, from the caller's thread) and
    taken out again when the run ends, so a run that opens no connection never wakes the loop
    thread: measured here, each wake-up of another Python thread costs the run ~0.4 ms of CPU
    (GIL hand-offs), more than the whole listener. The loop watches ``mux`` alone; when it is
    readable it accepts on the listeners that have connections waiting.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.mux = select.epoll()
        self.lock = threading.Lock()
        self.listeners: dict[int, Listener] = {}
        ready = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(ready,), name="lowlevel-egress", daemon=True)
        self.thread.start()
        ready.wait()

    def _main(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.add_reader(self.mux.fileno(), self._on_mux)
        self.loop.call_soon(ready.set)
        self.loop.run_forever()

    def _on_mux(self) -> None:
        for fd, _events in self.mux.poll(0, 64):
            with self.lock:
                listener = self.listeners.get(fd)
            if listener is not None:
                listener._on_accept()

    def add(self, listener: Listener, fd: int) -> None:
        with self.lock:
            self.listeners[fd] = listener
        self.mux.register(fd, select.EPOLLIN)

    def remove(self, fd: int) -> None:
        with self.lock:
            self.listeners.pop(fd, None)
        with contextlib.suppress(OSError):
            self.mux.unregister(fd)


_thread_lock = threading.Lock()
_thread: _ProxyThread | None = None


def _shared() -> _ProxyThread:
    """The process's proxy thread, started on first use (and again in a forked child)."""
    global _thread
    with _thread_lock:
        if _thread is None or _thread.pid != os.getpid() or not _thread.thread.is_alive():
            _thread = _ProxyThread()
        return _thread


@functools.lru_cache(maxsize=None)
def _relay_fd() -> int:
    """An O_RDONLY fd of the relay executable, opened once per process (as the session init's)."""
    if not os.access(RELAY_PATH, os.X_OK):
        raise UnsupportedError("egress-relay", f"the egress relay {RELAY_PATH} is missing or not executable",
                               "reinstall lowlevel (pip install .) with a C compiler present")
    return os.open(RELAY_PATH, os.O_RDONLY | os.O_CLOEXEC)


@functools.lru_cache(maxsize=8)
def _ca_bundle(extra_pem: str) -> bytes:
    """The host's CA bundle (when it exists) followed by ``extra_pem``."""
    try:
        with open(HOST_CA_BUNDLE, "rb") as f:
            base = f.read()
    except OSError:
        base = b""
    if base and not base.endswith(b"\n"):
        base += b"\n"
    return base + extra_pem.encode("ascii", "strict").rstrip(b"\n") + b"\n"


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


# --- the host's own addresses ---------------------------------------------------------------------

_SIOCGIFCONF = 0x8912  # linux/sockios.h
_IFREQ_BYTES = 40 if struct.calcsize("P") == 8 else 32  # struct ifreq: 16-byte name + the union
_host_cache: tuple[float, dict[str, str]] | None = None
_host_lock = threading.Lock()


def _ipv4_addresses() -> dict[str, str]:
    """``{address: interface}`` of every IPv4 address of this network namespace (SIOCGIFCONF,
    netdevice(7): one ``struct ifreq`` per address, secondary addresses included)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        size = 64 * _IFREQ_BYTES
        while True:
            buf = array.array("B", bytes(size))
            ifc = struct.pack("iL", size, buf.buffer_info()[0])
            used = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, ifc))[0]
            if used < size or size >= 1 << 22:
                break
            size *= 4
    data = buf.tobytes()
    for off in range(0, used - _IFREQ_BYTES + 1, _IFREQ_BYTES):
        name = data[off:off + 16].split(b"\0", 1)[0].decode("ascii", "replace")
        family = struct.unpack_from("H", data, off + 16)[0]
        if family == socket.AF_INET:
            out[socket.inet_ntop(socket.AF_INET, data[off + 20:off + 24])] = name
    return out


def _ipv6_addresses() -> dict[str, str]:
    """``{address: interface}`` from ``/proc/net/if_inet6`` (one line per address: hex
    address, ifindex, prefix length, scope, flags, name); empty without IPv6."""
    out: dict[str, str] = {}
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and len(fields[0]) == 32:
            with contextlib.suppress(ValueError):
                out[socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))] = fields[5]
    return out


def host_addresses() -> dict[str, str]:
    """The addresses assigned to this host's interfaces (in the proxy's network namespace),
    loopback ranges left out: ``{address (compressed str): interface name}``, e.g.
    ``{"192.0.2.2": "eth0", "fd00::2": "eth0", "fe80::fc:ff:fe00:1": "eth0"}``.

    Read from the kernel (IPv4: the SIOCGIFCONF ioctl, netdevice(7); IPv6:
    ``/proc/net/if_inet6``) at most every :data:`HOST_ADDRESSES_TTL_S` seconds, so an
    address added while the proxy runs counts within that time. A reader that fails gives
    no addresses of its family (logged): the classification table still refuses the
    non-public ones. Why: a server bound to ``0.0.0.0`` on the host answers on every one of
    them, a public one included (CVE-2023-48022, the Ray dashboard on 8265).
    """
    global _host_cache
    now = time.monotonic()
    with _host_lock:
        if _host_cache is not None and now - _host_cache[0] < HOST_ADDRESSES_TTL_S:
            return _host_cache[1]
        found: dict[str, str] = {}
        for reader in (_ipv4_addresses, _ipv6_addresses):
            try:
                found.update(reader())
            except OSError as err:
                log.warning("lowlevel: egress proxy cannot list the host's addresses (%s): %s", reader.__name__, err)
        found = {a: n for a, n in found.items() if not a.startswith("127.") and a != "::1"}
        _host_cache = (now, found)
        return found


# --- resolver threads -----------------------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_pool_busy = 0  # lookups running in the pool's threads, every run's (under _pool_lock)


def _resolver_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's resolver threads (at most :data:`RESOLVER_THREADS`, made as needed)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                RESOLVER_THREADS, thread_name_prefix="lowlevel-egress-resolve"))
        return _pool[1]


def _lookup_in_thread(resolver: Resolver | None, name: str, port: int) -> tuple[list[str], bool]:
    """One lookup, in a resolver thread: (answers, whether the test resolver gave them); the
    test resolver first (its None: the system's)."""
    global _pool_busy
    try:
        if resolver is not None:
            answers = resolver(name, port)
            if answers is not None:
                return [str(a) for a in answers], True
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        return [str(info[4][0]) for info in infos], False
    finally:
        with _pool_lock:
            _pool_busy -= 1


# --- TLS: the server name of a ClientHello ----------------------------------------------------------

class ClientHello:
    """What the proxy reads from a tunnel's first TLS handshake message.

    Attributes:
        sni: the ``host_name`` of the server_name extension (lower case, trailing dot
            removed), or None when the ClientHello has none.
        ech: True when it carries an ``encrypted_client_hello`` extension (0xfe0d): then
            ``sni`` is the ECH public name, and the real one is encrypted.
    """

    __slots__ = ("sni", "ech")

    def __init__(self, sni: str | None, ech: bool) -> None:
        self.sni = sni
        self.ech = ech


class _NotTlsError(Exception):
    """The first bytes are not a TLS handshake record (another protocol in the tunnel)."""


def parse_client_hello(data: bytes) -> ClientHello | None:
    """The ClientHello at the start of a tunnel, or None while more bytes are needed.

    Reads TLS records (RFC 8446 section 5.1: type 22 handshake, length at most 2^14 + 256)
    until the first handshake message (section 4: ``msg_type`` 1, 3-byte length) is complete,
    across records when it is fragmented, then its extensions (section 4.1.2) and the
    server_name list (RFC 6066 section 3). Bounded by :data:`MAX_HELLO_BYTES`.

    Raises:
        _NotTlsError: the data does not start with a TLS handshake record.
        ValueError: a malformed or oversized ClientHello (a length past its container, a
            repeated extension, more than one host_name, a non-ASCII or empty name).
    """
    if not data:
        return None
    if data[:1] != b"\x16":
        raise _NotTlsError()
    hs = bytearray()
    off = 0
    while True:
        if len(data) < off + 5:
            return None
        ctype, major, length = data[off], data[off + 1], struct.unpack_from("!H", data, off + 3)[0]
        if ctype != 22 or major != 3 or length == 0 or length > (1 << 14) + 256:
            raise ValueError("not a TLS handshake record")
        if len(data) < off + 5 + length:
            return None
        hs += data[off + 5:off + 5 + length]
        off += 5 + length
        if len(hs) >= 4:
            if hs[0] != 1:
                raise ValueError("the first handshake message is not a ClientHello")
            need = 4 + int.from_bytes(hs[1:4], "big")
            if need > MAX_HELLO_BYTES:
                raise ValueError(f"a ClientHello over {MAX_HELLO_BYTES} bytes")
            if len(hs) >= need:
                return _client_hello_body(bytes(hs[4:need]))


def _client_hello_body(body: bytes) -> ClientHello:
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(body):
            raise ValueError("truncated ClientHello")
        pos += n
        return body[pos - n:pos]

    def vector(width: int) -> bytes:
        return take(int.from_bytes(take(width), "big"))

    take(2 + 32)  # legacy_version, random
    vector(1)  # legacy_session_id
    vector(2)  # cipher_suites
    vector(1)  # legacy_compression_methods
    if pos == len(body):
        return ClientHello(None, False)  # no extensions (SSL 3.0-style): no name
    extensions = vector(2)
    if pos != len(body):
        raise ValueError("bytes after the ClientHello's extensions")
    seen: set[int] = set()
    sni: str | None = None
    i = 0
    while i < len(extensions):
        if i + 4 > len(extensions):
            raise ValueError("truncated extension")
        etype, elen = struct.unpack_from("!HH", extensions, i)
        ext = extensions[i + 4:i + 4 + elen]
        if len(ext) != elen:
            raise ValueError("truncated extension")
        i += 4 + elen
        if etype in seen:
            raise ValueError(f"extension {etype} appears twice (RFC 8446 section 4.2)")
        seen.add(etype)
        if etype != 0:
            continue
        if len(ext) < 2 or int.from_bytes(ext[:2], "big") != len(ext) - 2:
            raise ValueError("malformed server_name extension")
        j = 2
        while j < len(ext):
            if j + 3 > len(ext):
                raise ValueError("malformed server_name extension")
            ntype, nlen = ext[j], int.from_bytes(ext[j + 1:j + 3], "big")
            raw = ext[j + 3:j + 3 + nlen]
            if len(raw) != nlen:
                raise ValueError("malformed server_name extension")
            j += 3 + nlen
            if ntype != 0:
                continue
            if sni is not None:
                raise ValueError("more than one host_name in server_name (RFC 6066 section 3)")
            if not raw or not raw.isascii():
                raise ValueError("an empty or non-ASCII server name")
            sni = raw.decode("ascii").lower()
            sni = sni[:-1] if sni.endswith(".") else sni
    return ClientHello(sni, 0xFE0D in seen)


#: TLS alert record sent when a tunnel's ClientHello is refused: fatal unrecognized_name
#: (RFC 8446 section 6, description 112; RFC 6066 section 3), record version TLS 1.2.
_TLS_ALERT_UNRECOGNIZED_NAME = bytes([21, 3, 3, 0, 2, 2, 112])


# --- requests ---------------------------------------------------------------------------------

class _RefusedError(Exception):
    """A request the proxy answers itself: ``status`` and the reason shown to the program."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


_STATUS = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 411: "Length Required",
           431: "Request Header Fields Too Large",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


def _response(status: int, reason: str) -> bytes:
    """An HTTP/1.1 error response with the reason in the status line and the body."""
    safe = "".join(c if 32 <= ord(c) < 127 else "?" for c in reason)
    phrase = f"{_STATUS[status]} (lowlevel egress: {safe[:200]})"
    body = f"lowlevel egress proxy: {_STATUS[status].lower()}: {safe}\n".encode()
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nX-Lowlevel-Egress: refused\r\n\r\n").encode() + body


class _Request:
    """A parsed request head."""

    def __init__(self, method: str, host: str, port: int, head_out: bytes | None, body_len: int = 0) -> None:
        self.method = method
        self.host = host
        self.port = port
        self.head_out = head_out  # what to send upstream first (plain HTTP), None for CONNECT
        self.body_len = body_len  # plain HTTP: the request body's length (Content-Length, or 0)


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (port optional when ``default_port``) -> (host, port)."""
    text = authority.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _RefusedError(400, f"bad authority {authority!r}")
        host, rest = text[1:end], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise _RefusedError(400, f"bad authority {authority!r}")
        port_text = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise _RefusedError(400, f"bad authority {authority!r}: write an IPv6 address in brackets")
    else:
        host, port_text = text, ""
    if not port_text:
        if default_port is None:
            raise _RefusedError(400, f"CONNECT {authority!r} has no port")
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _RefusedError(400, f"bad port in {authority!r}")
    return host, int(port_text)


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
#: Bytes never allowed in a request head line once it is split on CRLF: a bare CR or LF, NUL and
#: the other controls but HTAB (RFC 9112 section 2.2: a recipient of a bare CR must reject or
#: replace it, and section 5.5 field values). An origin that takes a bare LF as a line end would
#: otherwise read a second request smuggled inside a header value, past the proxy's checks.
_HEAD_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def parse_request(head: bytes) -> _Request:
    """Parse a request head (up to and including the blank line) into what the proxy needs.

    Raises:
        _RefusedError: 400 for anything that is not a CONNECT or a plain-HTTP request.
    """
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise _RefusedError(400, "undecodable request head") from None
    lines = text.split("\r\n")
    while lines and not lines[-1]:
        lines.pop()  # the blank line that ends the head
    for line in lines:
        bad = _HEAD_CONTROL.search(line)
        if bad:
            raise _RefusedError(400, f"a control character ({bad.group()!r}: a bare CR or LF, NUL...) in the request "
                                "head (RFC 9112 section 2.2); end every line with CRLF")
        if not line:
            raise _RefusedError(400, "a blank line inside the request head")
        if line[0] in " \t":
            raise _RefusedError(400, "a folded header line (obs-fold, RFC 9112 section 5.2): send each header "
                                "on one line")
    if not lines:
        raise _RefusedError(400, "an empty request head")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _RefusedError(400, f"not an HTTP/1.x request line: {lines[0][:80]!r}")
    method, target, version = parts
    if not method.isalpha() or not method.isupper():
        raise _RefusedError(400, f"bad method {method[:20]!r}")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.match(name):
            raise _RefusedError(400, f"bad header line {line[:80]!r}")
        headers.append((name, value.strip()))
    if method == "CONNECT":
        host, port = _split_authority(target, None)
        return _Request(method, host.lower(), port, None)
    if target.startswith("/"):
        hosts = [v for k, v in headers if k.lower() == "host"]
        if len(hosts) != 1:
            raise _RefusedError(400, "an origin-form request needs exactly one Host header")
        host, port = _split_authority(hosts[0], 80)
        path = target
    else:
        url = urlsplit(target)
        if url.scheme.lower() != "http":
            raise _RefusedError(400, f"only http:// URLs are forwarded (use CONNECT for {url.scheme or 'this'}; "
                           "HTTPS_PROXY does that)")
        netloc = url.netloc.rpartition("@")[2]
        host, port = _split_authority(netloc, 80)
        path = target[len(url.scheme) + 3 + len(url.netloc):] or "/"
        if not path.startswith("/"):
            path = "/" + path
    host = host.lower()
    body_len = _body_length(headers)
    shown = f"[{host}]" if ":" in host else host
    authority = shown if port == 80 else f"{shown}:{port}"
    out = [f"{method} {path} {version}", f"Host: {authority}"]
    out += [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_BY_HOP]
    out.append("Connection: close")
    return _Request(method, host, port, ("\r\n".join(out) + "\r\n\r\n").encode("latin-1"), body_len)


def _body_length(headers: list[tuple[str, str]]) -> int:
    """The length of a plain-HTTP request's body, so that the proxy forwards that request and
    nothing after it (RFC 9112 section 6.3: no Content-Length and no Transfer-Encoding means
    no body).

    Raises:
        _RefusedError: 411 for a Transfer-Encoding (chunked bodies are not forwarded over
            plain HTTP: their end cannot be found without decoding them; HTTPS tunnels carry
            them), 400 for Content-Length values that disagree or are not digits (the
            request-smuggling forms of RFC 9112 section 6.3 and 11.2).
    """
    if any(k.lower() == "transfer-encoding" for k, _ in headers):
        raise _RefusedError(411, "plain-HTTP request bodies need a Content-Length (no Transfer-Encoding): "
                            "send the body with its length, or use HTTPS")
    values = {v.strip() for k, value in headers if k.lower() == "content-length" for v in value.split(",")}
    if not values:
        return 0
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise _RefusedError(400, f"bad Content-Length {sorted(values)!r}")
    return int(next(iter(values)))


# --- tunnels: bytes both ways with splice(2) ---------------------------------------------------

_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)


class _Flow:
    """One direction of a tunnel: ``src`` -> a kernel pipe -> ``dst`` with splice(2), so the bytes
    never enter Python (a copy through user space costs ~3 ms of CPU per MiB here). Callback
    driven in the loop thread: read readiness on ``src`` while the pipe has room, write readiness
    on ``dst`` while it holds bytes (backpressure both ways). Counts and caps the bytes taken
    from ``src``. The pipe is made on first use (a direction that never carries data costs no fds).
    Where no pipe can be made (EMFILE) or splice(2) refuses the fds (EINVAL, ENOSYS), the same
    loop copies through a ``bytearray`` with read(2)/write(2) instead.

    Source: splice(2) (SPLICE_F_NONBLOCK, SPLICE_F_MOVE), fcntl(2) F_SETPIPE_SZ.
    """

    def __init__(self, tunnel: _Tunnel, src: socket.socket, dst: socket.socket, up: bool) -> None:
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
        self.done = False
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

    def _read_off(self) -> None:
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
            listener = self.tunnel.listener
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
                            listener._pipelined(extra)
                        self.eof = True
                        break
                    want = min(want, self.limit)
                if listener.net_bytes is not None:
                    want = min(want, listener.net_bytes - listener.used)
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
                listener.used += n
                self.queued += n
                if self.limit is not None:
                    self.limit -= n
                if self.up:
                    attempt.up += n
                else:
                    attempt.down += n
            if self.eof or self.cut:
                self._read_off()
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
                self._read_off()  # backpressure: read again once dst took the pipe's bytes
                self._write_on()
                return
            self.queued -= m
        self._write_off()
        if self.cut:
            self.tunnel.attempt.error = "net_bytes"
            self.tunnel.listener._cut_all()
        elif self.eof:
            self.done = True
            if self.up:
                with contextlib.suppress(OSError):
                    self.dst_sock.shutdown(socket.SHUT_WR)
            self.tunnel.flow_done(self)
        else:
            self._read_on()

    def close(self) -> None:
        self.closed = True
        self._read_off()
        self._write_off()
        for fd in (self.r, self.w):
            if fd >= 0:
                os.close(fd)
        self.r = self.w = -1


class _Tunnel:
    """A connection after its head: bytes both ways until the server's side ends (or an error,
    or the run's cap, or the run's end). The program's half-close is passed on."""

    def __init__(self, listener: Listener, client: socket.socket, upstream: socket.socket, attempt: _Attempt) -> None:
        self.listener = listener
        self.loop = listener.loop
        self.attempt = attempt
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.upflow = _Flow(self, client, upstream, True)
        self.downflow = _Flow(self, upstream, client, False)

    async def run(self) -> None:
        try:
            self.upflow.start()
            self.downflow.start()
            await self.done
        finally:
            self.close()

    def close(self) -> None:
        self.upflow.close()
        self.downflow.close()

    def flow_done(self, flow: _Flow) -> None:
        if flow is self.downflow:
            self.finish(None)

    def finish(self, error: str | None) -> None:
        if error is not None and self.attempt.error is None:
            self.attempt.error = error
        self.upflow._read_off()
        self.downflow._read_off()
        if not self.done.done():
            self.done.set_result(None)


# --- one run's listener -------------------------------------------------------------------------

class _Attempt:
    """A connection attempt while it runs (mutable; frozen into a NetworkAttempt)."""

    __slots__ = ("method", "host", "port", "address", "allowed", "reason", "up", "down", "error", "resolver")

    def __init__(self, method: str, host: str, port: int, resolver: str) -> None:
        self.method, self.host, self.port = method, host, port
        self.address: str | None = None
        self.allowed = False
        self.reason = ""
        self.up = self.down = 0
        self.error: str | None = None
        self.resolver = resolver

    def decided(self, d: Decision) -> None:
        self.host = d.host
        self.allowed = d.allowed
        self.reason = d.reason
        if d.address is not None:
            self.address = d.address

    def freeze(self) -> NetworkAttempt:
        return NetworkAttempt(method=self.method, host=self.host, port=self.port, address=self.address,
                              allowed=self.allowed, reason=self.reason, bytes_up=self.up, bytes_down=self.down,
                              error=self.error, resolver=self.resolver)


class Listener:
    """The proxy endpoint of one run or session: a unix socket and the connections through it.

    Args:
        egress: the decisions.
        net_bytes: the byte cap of the whole run (both directions), or None.
        group: for a root caller, the sandbox's host gid: the socket's directory becomes
            ``root:group 0710`` and the socket ``root:group 0660`` so bwrap (running as the
            sandbox's uid) can bind it and the program can connect; None: the caller's own
            uid runs the sandbox, modes 0700 and 0600.
    Raises:
        OSError: the directory or socket cannot be made.
    """

    def __init__(self, egress: Egress, net_bytes: int | None = None, group: int | None = None) -> None:
        self.egress = egress
        self.net_bytes = net_bytes
        self.used = 0
        self.exhausted = False
        self.dropped = 0
        self.lock = threading.Lock()
        self.attempts: list[_Attempt] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.tunnels: set[_Tunnel] = set()
        self.closed = False
        self.accepted = 0  # connections accepted (under self.lock, with self.closed)
        self.test_resolver = _resolver_override
        # name lookups and connects in progress (loop thread only; see RESOLVE_PER_RUN)
        self.resolving = 0
        self.resolve_waiting = 0
        self.resolve_slots = asyncio.Semaphore(RESOLVE_PER_RUN)
        self.lookups: dict[tuple[str, int], asyncio.Future[tuple[list[str], bool]]] = {}
        self.connecting = 0
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
            self.proxy = _shared()
            self.loop = self.proxy.loop
            self.fd = sock.fileno()
            self.proxy.add(self, self.fd)
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
                self._record("?", "", 0).reason = reason
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(_response(503, reason))
                conn.close()
                continue
            task = self.loop.create_task(self._serve(conn))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _record(self, method: str, host: str, port: int) -> _Attempt:
        attempt = _Attempt(method, host, port, "test-override" if self.test_resolver is not None else "system")
        with self.lock:
            if len(self.attempts) < MAX_ATTEMPTS:
                self.attempts.append(attempt)
            else:
                self.dropped += 1
        return attempt

    async def _serve(self, conn: socket.socket) -> None:
        upstream: socket.socket | None = None
        attempt: _Attempt | None = None
        try:
            conn.setblocking(False)
            try:
                async with asyncio.timeout(HEAD_TIMEOUT_S):
                    head, rest = await self._read_head(conn)
            except TimeoutError:
                attempt = self._record("?", "", 0)
                raise _RefusedError(408, f"no complete request head within {HEAD_TIMEOUT_S:g} s") from None
            if head is None:
                if rest.strip():
                    attempt = self._record("?", "", 0)
                    raise _RefusedError(431 if len(rest) > MAX_HEAD_BYTES else 400,
                                        f"request head over {MAX_HEAD_BYTES} bytes" if len(rest) > MAX_HEAD_BYTES
                                        else "incomplete request head")
                return
            try:
                req = parse_request(head)
            except _RefusedError:
                attempt = self._record("?", "", 0)
                raise
            attempt = self._record(req.method, req.host, req.port)
            upstream = await self._open_upstream(req, attempt)
            tunnel = _Tunnel(self, conn, upstream, attempt)
            self.tunnels.add(tunnel)
            try:
                first: bytes | None
                if req.head_out is None:
                    await self._sendall(conn, b"HTTP/1.1 200 Connection established\r\n\r\n")
                    first = await self._check_hello(tunnel, conn, attempt, rest)
                    if first is None:
                        return
                else:
                    # One request per connection: its head and body go on, what follows is a
                    # second request, recorded and refused (Listener._pipelined).
                    body, extra = rest[:req.body_len], rest[req.body_len:]
                    first = req.head_out + body
                    tunnel.upflow.limit = req.body_len - len(body)
                    if extra:
                        self._pipelined(extra)
                        tunnel.upflow.started = True  # never read more from the program
                if first:
                    allowed = self._take(len(first))
                    attempt.up += allowed
                    await self._sendall(upstream, first[:allowed])
                    if allowed < len(first):
                        attempt.error = "net_bytes"
                        self._cut_all()
                        return
                if tunnel.upflow.started and not tunnel.upflow.reading:
                    with contextlib.suppress(OSError):
                        upstream.shutdown(socket.SHUT_WR)
                await tunnel.run()
            finally:
                tunnel.close()
                self.tunnels.discard(tunnel)
        except _RefusedError as ref:
            if attempt is not None and not attempt.reason:
                attempt.reason = ref.reason
            with contextlib.suppress(OSError, TimeoutError):
                await self._sendall(conn, _response(ref.status, ref.reason))
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

    async def _check_hello(self, tunnel: _Tunnel, conn: socket.socket, attempt: _Attempt,
                           rest: bytes) -> bytes | None:
        """Hold the program's first bytes in a tunnel until they show whether they are a TLS
        ClientHello, and check its server name (:meth:`Egress.check_server_name`). The
        server's bytes flow meanwhile (a protocol where the server speaks first works).

        Returns:
            The bytes to send on (not TLS, or a ClientHello that passed), or None when the
            tunnel ended meanwhile or the ClientHello was refused (then the program got a TLS
            ``unrecognized_name`` alert and the attempt says why).
        """
        tunnel.downflow.start()
        buf = bytearray(rest)
        while True:
            reason = None
            try:
                hello = parse_client_hello(bytes(buf))
            except _NotTlsError:
                return bytes(buf)
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
                attempt.allowed = False
                attempt.reason = reason
                tunnel.close()
                with contextlib.suppress(OSError, TimeoutError):
                    await self._sendall(conn, _TLS_ALERT_UNRECOGNIZED_NAME)
                return None
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
            data = recv.result()
            if not data:
                return b"" if not buf else None
            buf += data

    def _pipelined(self, data: bytes) -> None:
        """Record the request that came after a plain-HTTP connection's first one (not forwarded)."""
        method, host, port = "?", "", 0
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            with contextlib.suppress(_RefusedError):
                req = parse_request(data[:end + 4])
                method, host, port = req.method, req.host, req.port
        attempt = self._record(method, host, port)
        reason = ("a second request on one plain-HTTP connection (pipelined) is not forwarded: the proxy takes "
                  "one request per connection (it sent Connection: close); send it on a new connection")
        if host:
            d = self.egress.decide(host, port)
            attempt.host = d.host
            if not d.allowed:
                reason += f" (and {d.reason})"
        attempt.reason = reason

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

    async def _sendall(self, sock: socket.socket, data: bytes) -> None:
        async with asyncio.timeout(SEND_TIMEOUT_S):
            await self.loop.sock_sendall(sock, data)

    async def _open_upstream(self, req: _Request, attempt: _Attempt) -> socket.socket:
        """Decide, resolve once, check the answers and connect to them; raise _RefusedError otherwise."""
        if self.exhausted:
            attempt.reason = f"the run's net_bytes cap of {self.net_bytes} bytes is used up"
            raise _RefusedError(403, attempt.reason)
        d = self.egress.decide(req.host, req.port)
        attempt.decided(d)
        if not d.allowed:
            raise _RefusedError(403, d.reason)
        allow_reason = d.reason
        if d.address is not None:
            addresses = [d.address]
        else:
            addresses, pretend = await self._resolve(d.host, req.port, attempt)
            checked = self.egress.check_addresses(d.host, addresses, host_addresses=host_addresses(),
                                                  assume_public=pretend)
            if checked.allowed and pretend:
                checked = Decision(True, f"{d.host!r} resolves to addresses the test resolver calls public",
                                   d.host, checked.address)
            attempt.decided(checked)
            if not checked.allowed:
                raise _RefusedError(403, checked.reason)
            attempt.reason = f"{allow_reason}; {checked.reason}"
        if self.connecting >= CONNECTING_PER_RUN:
            attempt.allowed = False
            attempt.reason = (f"{self.connecting} connects of this run are in progress (at most "
                              f"{CONNECTING_PER_RUN} at once): retry when one ends")
            raise _RefusedError(503, attempt.reason)
        self.connecting += 1
        try:
            return await self._connect(d.host, req.port, addresses, attempt)
        finally:
            self.connecting -= 1

    async def _connect(self, host: str, port: int, addresses: list[str], attempt: _Attempt) -> socket.socket:
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
        raise _RefusedError(504 if timed_out else 502, f"cannot connect to {host} port {port}: "
                            + "; ".join(errors))

    async def _resolve(self, name: str, port: int, attempt: _Attempt) -> tuple[list[str], frozenset[str]]:
        """Resolve ``name`` once: (unique addresses in order, those a test resolver calls public).

        At most :data:`RESOLVE_PER_RUN` lookups of this run hold resolver threads (slots are
        given back when the thread returns, not when the request gives up), at most
        :data:`RESOLVE_QUEUE_PER_RUN` wait for a slot (more: ``503``), each request waits at
        most :data:`RESOLVE_TIMEOUT_S` in all (then ``504``); requests for a name and port
        whose lookup is running share it.
        """
        global _pool_busy
        resolver, public = self.test_resolver if self.test_resolver is not None else (None, frozenset())
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                lookup = self.lookups.get((name, port))
                if lookup is None:
                    if self.resolve_slots.locked() and self.resolve_waiting >= RESOLVE_QUEUE_PER_RUN:
                        raise _RefusedError(503, f"too many name lookups of this run at once ({self.resolving} "
                                            f"running, {self.resolve_waiting} waiting; at most {RESOLVE_PER_RUN} "
                                            f"and {RESOLVE_QUEUE_PER_RUN}): retry when they end")
                    self.resolve_waiting += 1
                    try:
                        await self.resolve_slots.acquire()
                    finally:
                        self.resolve_waiting -= 1
                    with _pool_lock:
                        busy = _pool_busy
                        if busy < RESOLVER_THREADS:
                            _pool_busy += 1
                    if busy >= RESOLVER_THREADS:
                        self.resolve_slots.release()
                        raise _RefusedError(503, f"all {RESOLVER_THREADS} resolver threads of the proxy are busy: "
                                            "retry later")
                    self.resolving += 1
                    future = _resolver_pool().submit(_lookup_in_thread, resolver, name, port)
                    future.add_done_callback(self._lookup_done)
                    lookup = asyncio.wrap_future(future, loop=self.loop)
                    self.lookups[(name, port)] = lookup
                    lookup.add_done_callback(functools.partial(self._lookup_forget, (name, port)))
                answers, from_test = await asyncio.shield(lookup)
        except _RefusedError as ref:
            attempt.allowed = False
            attempt.reason = f"cannot resolve {name!r} now: {ref.reason}"
            raise _RefusedError(ref.status, attempt.reason) from None
        except TimeoutError:
            attempt.allowed = False
            attempt.reason = f"cannot resolve {name!r}: no answer within {RESOLVE_TIMEOUT_S:g} s"
            raise _RefusedError(504, attempt.reason) from None
        except OSError as err:
            attempt.allowed = False
            attempt.reason = f"cannot resolve {name!r}: {err.strerror or err}"
            raise _RefusedError(502, attempt.reason) from None
        unique: list[str] = []
        for address in answers:
            if address not in unique:
                unique.append(address)
        return unique, (public & set(unique)) if from_test else frozenset()

    def _lookup_forget(self, key: tuple[str, int], lookup: asyncio.Future[tuple[list[str], bool]]) -> None:
        """A lookup ended (loop thread): later requests ask again; its exception counts as retrieved."""
        if self.lookups.get(key) is lookup:
            del self.lookups[key]
        if not lookup.cancelled():
            lookup.exception()

    def _lookup_done(self, _future: concurrent.futures.Future[tuple[list[str], bool]]) -> None:
        """A resolver thread returned (in that thread): give the run's slot back in the loop."""
        def release() -> None:
            self.resolving -= 1
            self.resolve_slots.release()
        with contextlib.suppress(RuntimeError):  # the loop is gone (interpreter exit)
            self.loop.call_soon_threadsafe(release)

    def _take(self, n: int) -> int:
        """How many of ``n`` bytes may pass under the run's cap (all of them without one)."""
        if self.net_bytes is None:
            self.used += n
            return n
        room = max(0, self.net_bytes - self.used)
        self.used += min(n, room)
        return min(n, room)

    def _cut_all(self) -> None:
        """The cap is reached: close every connection of the run, refuse new ones."""
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
        with self.lock:
            current = list(self.attempts[index:])
            return tuple(a.freeze() for a in current), index + len(current)

    def notes(self) -> list[str]:
        """Notes for the Result: the cap reached, attempts not recorded, a test resolver."""
        out = []
        if self.exhausted:
            out.append(f"egress: the net_bytes cap ({self.net_bytes} bytes) was reached: connections were "
                       "cut and later requests refused")
        if self.dropped:
            out.append(f"egress: {self.dropped} more connection attempts were not recorded "
                       f"(at most {MAX_ATTEMPTS} per run)")
        if self.test_resolver is not None:
            out.append("egress: TEST-ONLY resolver override in force (override_resolver_for_tests)")
        return out

    def close(self) -> tuple[NetworkAttempt, ...]:
        """Stop listening, close every connection, remove the socket; return every attempt. Idempotent.

        A run that never connected costs no round trip to the loop thread; otherwise this waits
        (at most 10 s) until the loop has cancelled its connections and recorded their bytes.
        """
        with self.lock:
            if self.closed:
                return tuple(a.freeze() for a in self.attempts)
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
        return self.attempts_since(0)[0]


# --- the launcher's hook ----------------------------------------------------------------------

class EgressRun:
    """What egress adds to one sandbox: the listener, bwrap mounts, fds and the relay in front
    of the command. Built by the launcher in ``Run.prepare`` for ``Policy(network=Egress)``.

    Attributes:
        listener: the run's :class:`Listener`.
        mounts: bwrap options (before ``--remount-ro /``): the socket bound read-only at
            :data:`SOCKET_DEST`, and with ``extra_ca_pem`` the CA bundle at :data:`CA_BUNDLE_DEST`.
        child_fds: ``{fd inside: fd here}`` for the spawn (relay executable, CA memfd).
        owned_fds: fds created here that the launcher closes after the spawn.
    """

    def __init__(self, egress: Egress, net_bytes: int | None, group: int | None) -> None:
        relay_fd = _relay_fd()
        self.listener = Listener(egress, net_bytes, group)
        self.mounts = ["--ro-bind", self.listener.path, SOCKET_DEST]
        self.child_fds = {RELAY_FD: relay_fd}
        self.owned_fds: list[int] = []
        self.net_bytes = net_bytes
        if egress.extra_ca_pem:
            try:
                fd = os.memfd_create("lowlevel-ca-bundle", os.MFD_CLOEXEC)
                data = memoryview(_ca_bundle(egress.extra_ca_pem))
                while data:
                    data = data[os.write(fd, data):]
                os.lseek(fd, 0, os.SEEK_SET)
            except BaseException:
                self.listener.close()
                raise
            self.owned_fds.append(fd)
            self.child_fds[CA_FD] = fd
            self.mounts += ["--ro-bind-data", str(CA_FD), CA_BUNDLE_DEST]

    @classmethod
    def open(cls, egress: Egress, net_bytes: int | None, *, caller_is_root: bool, host_gid: int) -> EgressRun:
        """Start the run's listener (see :class:`Listener` for ``group``).

        Raises:
            UnsupportedError: the relay executable is missing.
            LowlevelError: the socket cannot be made (the message says why).
        """
        try:
            return cls(egress, net_bytes, host_gid if caller_is_root else None)
        except OSError as err:
            raise LowlevelError(f"cannot start the egress proxy: {err}") from err

    def wrap(self, command: Sequence[str]) -> list[str]:
        """The argv bwrap runs: the relay, which listens on 127.0.0.1:3128 and then runs ``command``."""
        return [f"/proc/self/fd/{RELAY_FD}", str(PROXY_PORT), SOCKET_DEST, str(RELAY_FD), "--", *command]

    def finish(self) -> tuple[tuple[NetworkAttempt, ...], list[str], tuple[str, ...]]:
        """Close the listener; return (attempts, notes, limits enforced)."""
        attempts = self.listener.close()
        return attempts, self.listener.notes(), (("net_bytes",) if self.net_bytes is not None else ())

    def close(self) -> None:
        """Close the listener (idempotent)."""
        self.listener.close()


def describe_attempt(a: NetworkAttempt) -> str:
    """One line for logs and the CLI: ``"CONNECT pypi.org:443 -> 151.101.0.223 allowed (matches ...)"``."""
    where = f"{a.host}:{a.port}" + (f" -> {a.address}" if a.address else "")
    verdict = "allowed" if a.allowed else "DENIED"
    extra = f", {a.bytes_up} B up, {a.bytes_down} B down" if a.allowed else ""
    err = f", {a.error}" if a.error else ""
    return f"{a.method} {where} {verdict} ({a.reason}{extra}{err})"


__all__ = ["CA_FD", "CONNECTING_PER_RUN", "ClientHello", "EgressRun", "Listener", "MAX_ATTEMPTS", "MAX_CONNECTIONS",
           "RELAY_FD", "RELAY_PATH", "RESOLVER_THREADS", "RESOLVE_PER_RUN", "RESOLVE_QUEUE_PER_RUN", "describe_attempt",
           "host_addresses", "override_resolver_for_tests", "parse_client_hello", "parse_request"]
