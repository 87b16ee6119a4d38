"""The server name (SNI) of a tunnel's TLS ClientHello: a bounded parser. Pure: no sockets.

Concept: the proxy holds a CONNECT tunnel's first bytes until they show a TLS ClientHello
(:func:`parse_client_hello`), whose ``server_name`` must be the CONNECT name
(:meth:`lowlevel.spec.egress.Egress.check_server_name` decides; :mod:`lowlevel.net.proxy`
asks), else the program gets :data:`TLS_ALERT_UNRECOGNIZED_NAME` and the tunnel ends, so an
allowed name cannot front a denied one. Bytes that are not TLS (:class:`NotTlsError`) end
the tunnel on ``Egress.tls_ports`` (default 443: :meth:`lowlevel.spec.egress.Egress.check_not_tls`),
so a ClientHello cannot hide behind a non-TLS prefix there (a PROXY-protocol line); on other
ports they pass, with whatever follows them, never parsed (README, Egress: the guarantee there
is the address and port, not the names a server accepts behind such a prefix).
Only the handshake framing and the extensions are read: no cryptography, nothing decrypted.

Library choice: Python's :mod:`ssl` shows a ClientHello's SNI only to a server that
terminates the TLS (``sni_callback``), which the proxy must not; packet libraries (dpkt's
``ssl``, scapy's TLS layer) would add a dependency and still leave the bounds and the
refusals (a repeated extension, two host_names) to us. So the parser is ours, ~100 lines.

Sources: RFC 8446 sections 4.1.2 (ClientHello), 4.2 (one extension of each type), 5.1
(records) and 6 (alerts); RFC 6066 section 3 (server_name); RFC 9849 (ECH, 0xfe0d).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

#: Largest TLS ClientHello the proxy reads to check its server name, bytes (the handshake
#: message across its records; a post-quantum key share makes it ~1.8 KB).
MAX_HELLO_BYTES = 64 * 1024


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


class NotTlsError(Exception):
    """The first bytes are not a TLS handshake record (another protocol in the tunnel: the
    proxy ends the tunnel on ``Egress.tls_ports`` and passes them on unchecked elsewhere)."""


def parse_client_hello(data: bytes) -> ClientHello | None:
    """The ClientHello at the start of a tunnel, or None while more bytes are needed.

    Reads TLS records (RFC 8446 section 5.1: type 22 handshake, length at most 2^14 + 256)
    until the first handshake message (section 4: ``msg_type`` 1, 3-byte length) is complete,
    across records when it is fragmented, then its extensions (section 4.1.2) and the
    server_name list (RFC 6066 section 3). Bounded by :data:`MAX_HELLO_BYTES`.

    Raises:
        NotTlsError: the data does not start with a TLS handshake record.
        ValueError: a malformed or oversized ClientHello (a length past its container, a
            repeated extension, more than one host_name, a non-ASCII or empty name).
    """
    if not data:
        return None
    if data[:1] != b"\x16":
        raise NotTlsError()
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
    """The ClientHello message body (after its 4-byte header) -> :class:`ClientHello`."""
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
    for etype, ext in _extensions(extensions):
        if etype in seen:
            raise ValueError(f"extension {etype} appears twice (RFC 8446 section 4.2)")
        seen.add(etype)
        if etype == 0:
            sni = _server_name(ext)
    return ClientHello(sni, 0xFE0D in seen)


def _extensions(data: bytes) -> Iterator[tuple[int, bytes]]:
    """The (type, body) of each extension in a ClientHello's extensions block, in order."""
    i = 0
    while i < len(data):
        if i + 4 > len(data):
            raise ValueError("truncated extension")
        etype, elen = struct.unpack_from("!HH", data, i)
        ext = data[i + 4:i + 4 + elen]
        if len(ext) != elen:
            raise ValueError("truncated extension")
        i += 4 + elen
        yield etype, ext


def _server_name(ext: bytes) -> str | None:
    """The one ``host_name`` of a server_name extension body (lower case, trailing dot
    removed), None when it lists none; other name types are skipped."""
    if len(ext) < 2 or int.from_bytes(ext[:2], "big") != len(ext) - 2:
        raise ValueError("malformed server_name extension")
    sni: str | None = None
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
    return sni


#: TLS alert record sent when a tunnel's ClientHello is refused: fatal unrecognized_name
#: (RFC 8446 section 6, description 112; RFC 6066 section 3), record version TLS 1.2.
TLS_ALERT_UNRECOGNIZED_NAME = bytes([21, 3, 3, 0, 2, 2, 112])


__all__ = ["MAX_HELLO_BYTES", "TLS_ALERT_UNRECOGNIZED_NAME", "ClientHello", "NotTlsError",
           "parse_client_hello"]
