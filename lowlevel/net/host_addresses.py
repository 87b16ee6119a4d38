"""The host's own addresses, read from the kernel, which the egress proxy refuses to connect to.

Concept: a server bound to ``0.0.0.0`` on the proxy's host answers on every address of the
host, a public one included (CVE-2023-48022, the Ray dashboard on 8265), so an allowlisted
name that resolves to one of them must be refused like a private address.
:func:`host_addresses` lists them (IPv4: the SIOCGIFCONF ioctl; IPv6: ``/proc/net/if_inet6``)
for :meth:`lowlevel.spec.egress.Egress.check_addresses`, which decides (pure; the addresses
are passed in). This is the only host I/O of the address check.

Library choice: psutil's ``net_if_addrs`` gives the same (through getifaddrs(3)) but is a
compiled dependency for two reads; the stdlib has no interface-address call
(``socket.if_nameindex`` lists names only).

Sources: netdevice(7) (SIOCGIFCONF, ``struct ifreq``); linux/sockios.h; proc(5)
(``/proc/net/if_inet6``).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import socket
import struct
import threading
import time

log = logging.getLogger("lowlevel")

#: How long the host's own addresses (:func:`host_addresses`) are cached, seconds.
HOST_ADDRESSES_TTL_S = 1.0

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



__all__ = ["HOST_ADDRESSES_TTL_S", "host_addresses"]
