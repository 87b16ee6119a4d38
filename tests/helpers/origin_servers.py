"""Real HTTP and HTTPS servers on host loopback for the egress tests.

One handler serves, for any Host:

- ``/hello``: ``hello from <label>`` (the label tells which server answered);
- ``/bytes/N``: N bytes of ``x`` (streamed in 64 KiB writes);
- ``/simple/`` and ``/simple/tinypkg/``: a PEP 503 simple index with one wheel, and the wheel at
  ``/files/tinypkg-1.0-py3-none-any.whl`` (a real, minimal wheel: pip reads its METADATA);
- ``/tinynpm`` and ``/tinynpm/-/tinynpm-1.0.0.tgz``: an npm registry stub: the packument
  (``name``, ``dist-tags``, ``versions`` with ``dist.tarball``, ``shasum``, ``integrity``)
  and a real package tarball. Honest about what it is: the two documents ``npm install``
  fetches for a package without dependencies, nothing of the registry's search or auth API.

HTTPS uses a test CA from trustme (``TlsOrigin.ca_pem``), with a certificate for the names
the tests resolve to 127.0.0.1.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import ssl
import tarfile
import threading
import zipfile
from typing import Any


def make_wheel() -> bytes:
    """A minimal valid wheel ``tinypkg-1.0-py3-none-any.whl``."""
    files = {
        "tinypkg/__init__.py": b"VALUE = 42\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: lowlevel-tests\nRoot-Is-Purelib: true\n"
                                       b"Tag: py3-none-any\n",
    }
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for name, data in files.items()) + "tinypkg-1.0.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("tinypkg-1.0.dist-info/RECORD", record)
    return buf.getvalue()


def make_npm_tarball() -> bytes:
    """``tinynpm-1.0.0.tgz``: package/package.json and package/index.js."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in (("package/package.json", json.dumps(
                {"name": "tinynpm", "version": "1.0.0", "main": "index.js"}).encode()),
                ("package/index.js", b"module.exports = 42;\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


WHEEL = make_wheel()
WHEEL_NAME = "tinypkg-1.0-py3-none-any.whl"
NPM_TGZ = make_npm_tarball()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes, ctype: str = "text/plain") -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        self.server.hits += 1
        host = self.headers.get("Host", "")
        base = f"{self.server.scheme}://{host}"
        path = self.path.split("?", 1)[0]
        if path == "/hello":
            return self._send(f"hello from {self.server.label}\n".encode())
        if path.startswith("/bytes/"):
            n = int(path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = b"x" * 65536
            try:
                while n > 0:
                    self.wfile.write(chunk[:n])
                    n -= min(n, len(chunk))
            except OSError:
                pass
            return None
        if path in ("/simple", "/simple/"):
            return self._send(b'<!DOCTYPE html><html><body><a href="tinypkg/">tinypkg</a></body></html>',
                              "text/html")
        if path in ("/simple/tinypkg", "/simple/tinypkg/"):
            digest = hashlib.sha256(WHEEL).hexdigest()
            return self._send(f'<!DOCTYPE html><html><body><a href="{base}/files/{WHEEL_NAME}#sha256={digest}">'
                              f'{WHEEL_NAME}</a></body></html>'.encode(), "text/html")
        if path == f"/files/{WHEEL_NAME}":
            return self._send(WHEEL, "application/octet-stream")
        if path == "/tinynpm":
            doc = {"name": "tinynpm", "dist-tags": {"latest": "1.0.0"}, "versions": {"1.0.0": {
                "name": "tinynpm", "version": "1.0.0", "main": "index.js",
                "dist": {"tarball": f"{base}/tinynpm/-/tinynpm-1.0.0.tgz",
                         "shasum": hashlib.sha1(NPM_TGZ).hexdigest(),
                         "integrity": "sha512-" + base64.b64encode(hashlib.sha512(NPM_TGZ).digest()).decode()}}}}
            return self._send(json.dumps(doc).encode(), "application/json")
        if path == "/tinynpm/-/tinynpm-1.0.0.tgz":
            return self._send(NPM_TGZ, "application/octet-stream")
        self.send_error(404)
        return None


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    hits = 0
    label = ""
    scheme = "http"


class Origin:
    """A plain HTTP server on ``address`` (default 127.0.0.1), port chosen by the kernel or given."""

    def __init__(self, label: str, address: str = "127.0.0.1", port: int = 0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.server = _Server((address, port), _Handler)
        self.server.label = label
        if tls is not None:
            self.server.scheme = "https"
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def hits(self) -> int:
        return self.server.hits

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TlsOrigin(Origin):
    """An HTTPS server whose certificate (for ``names``) is signed by a fresh trustme test CA."""

    def __init__(self, label: str, names: tuple[str, ...]) -> None:
        import trustme

        self.ca = trustme.CA()
        self.ca_pem = self.ca.cert_pem.bytes().decode()
        cert = self.ca.issue_cert(*names)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(ctx)
        super().__init__(label, tls=ctx)


class PipelineOrigin:
    """A bare HTTP/1.1 server that answers every request of a connection, pipelined ones
    included, and ignores ``Connection: close`` (as some servers and CDN front ends do): the
    upstream a pipelining attack needs. ``hosts`` lists the Host header of each request served,
    in order; each answer is ``served <host> <method> <body length>``."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.hosts: list[str] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Any) -> None:
        buf = b""
        conn.settimeout(30)
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
                length = int(fields.get("content-length", "0"))
                while len(buf) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                buf = buf[length:]
                host = fields.get("host", "")
                self.hosts.append(host)
                body = f"served {host} {lines[0].split(' ')[0]} {length}\n".encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def close(self) -> None:
        import socket

        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the server thread
        except OSError:
            pass
        self.sock.close()
