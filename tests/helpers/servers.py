"""Host servers the sandbox must not reach (or, in a control, does), in one place (issue 26:
three copies of the same accept loop): each answers every connection with a fixed reply and
counts them, so a test asserts both what the program saw and that the server saw nothing.

- :func:`tcp_loopback`: TCP on host ``127.0.0.1`` (the ``server`` fixture of tests/conftest.py);
- :func:`abstract_unix`: a host abstract unix socket (the kind D-Bus, X11 and containerd use);
- :func:`unix_at`: a pathname unix socket at ``path``, mode 0777 (anyone may connect, as a
  daemon's socket meant for its group would be to its members);
- :func:`listener_when`: :func:`unix_at` made by a thread once a file appears (a socket the host
  creates while a run is going).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path


class AnsweringServer:
    """Accepts on ``sock`` (bound, not yet listening) in a daemon thread and answers ``reply``.

    ``accepted``: connections so far (counted before the reply is sent, so a client that read it
    has been counted); ``port``: a TCP server's port (else 0); ``name``: an abstract unix
    socket's name without its leading NUL (else ""). ``close()`` stops the thread (within
    0.2 s) and closes the socket."""

    def __init__(self, sock: socket.socket, reply: bytes) -> None:
        self.sock = sock
        self.reply = reply
        addr = sock.getsockname()
        self.port: int = addr[1] if isinstance(addr, tuple) else 0
        self.name: str = addr[1:].decode() if isinstance(addr, bytes) and addr[:1] == b"\0" else ""
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            with conn:
                conn.sendall(self.reply)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def tcp_loopback() -> AnsweringServer:
    """``b"pong"`` on ``127.0.0.1:server.port`` (a free port)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return AnsweringServer(sock, b"pong")


def abstract_unix() -> AnsweringServer:
    """``b"pong"`` on the host abstract unix socket ``"\\0" + server.name``."""
    name = f"lowlevel-test-{secrets.token_hex(6)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    return AnsweringServer(sock, b"pong")


def unix_at(path: Path) -> AnsweringServer:
    """``b"hello"`` on a pathname unix socket at ``path``, mode 0777."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    os.chmod(path, 0o777)
    return AnsweringServer(sock, b"hello")


@contextlib.contextmanager
def listener_when(flag: Path, path: Path, wait_s: float = 60.0) -> Iterator[list[AnsweringServer]]:
    """A thread that makes :func:`unix_at` ``path`` once ``flag`` exists (polled every 50 ms for
    ``wait_s``); yields the list it appends that listener to, and closes it on leaving."""
    made: list[AnsweringServer] = []

    def make() -> None:
        for _ in range(int(wait_s / 0.05)):
            if flag.exists():
                made.append(unix_at(path))
                return
            threading.Event().wait(0.05)

    maker = threading.Thread(target=make)
    maker.start()
    try:
        yield made
    finally:
        maker.join(90)
        for server in made:
            server.close()
