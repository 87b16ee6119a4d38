"""What egress adds to one sandbox: the run's listener, the relay in front of the command, its fds and mounts.

Concept: for ``Policy(network=Egress(...))`` the launcher (``Run.prepare``) opens an
:class:`EgressRun`: a :class:`lowlevel.net.proxy.Listener` whose unix socket is bound
read-only at :data:`lowlevel.spec.egress.SOCKET_DEST`; the relay executable
(``native/lowlevel_relay.c``, passed as an fd and exec'd as ``/proc/self/fd/N``) runs first
inside, listens on ``127.0.0.1:3128`` and connects to that socket once per TCP connection the
program opens, then runs the command; with ``extra_ca_pem`` a memfd holds the host's CA bundle
plus those CAs, bound at :data:`lowlevel.spec.egress.CA_BUNDLE_DEST`. At the run's end
:meth:`EgressRun.finish` closes the listener and returns the attempts and notes.

Sources: bwrap(1) (``--ro-bind``, ``--ro-bind-data FD``); memfd_create(2).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from lowlevel.errors import LowlevelError, UnsupportedError
from lowlevel.net.proxy import Listener
from lowlevel.paths import native
from lowlevel.spec.egress import CA_BUNDLE_DEST, PROXY_PORT, SOCKET_DEST, Egress, NetworkAttempt

#: Fd numbers inside the sandbox: the relay executable (exec'd as /proc/self/fd/N, closed by
#: the relay first thing) and the CA bundle memfd (``--ro-bind-data``). Sessions use 9 and 10.
RELAY_FD = 20
CA_FD = 21
#: The relay executable built by setup.py from ``native/lowlevel_relay.c``.
RELAY_PATH = native("_lowlevel_relay")
#: The host's CA bundle, the base of the sandbox's bundle when ``extra_ca_pem`` is given.
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


@functools.lru_cache(maxsize=None)
def relay_fd() -> int:
    """An O_RDONLY fd of the relay executable, opened once per process (as the session init's)
    and kept open for the process's life.

    Raises:
        UnsupportedError: the relay is missing or not executable (reinstall with a C compiler).
    """
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


def _ca_memfd(extra_pem: str) -> int:
    """A memfd (CLOEXEC, at offset 0) holding the sandbox's CA bundle."""
    fd = os.memfd_create("lowlevel-ca-bundle", os.MFD_CLOEXEC)
    try:
        data = memoryview(_ca_bundle(extra_pem))
        while data:
            data = data[os.write(fd, data):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class EgressRun:
    """What egress adds to one sandbox: the listener, bwrap mounts, fds and the relay in front
    of the command. Built by the launcher in ``Run.prepare`` for ``Policy(network=Egress)``.

    Attributes:
        listener: the run's :class:`lowlevel.net.proxy.Listener`.
        mounts: bwrap options (before ``--remount-ro /``): the socket bound read-only at
            :data:`SOCKET_DEST`, and with ``extra_ca_pem`` the CA bundle at :data:`CA_BUNDLE_DEST`.
        child_fds: ``{fd inside: fd here}`` for the spawn (relay executable, CA memfd).
        owned_fds: fds created here that the launcher closes after the spawn.
    """

    def __init__(self, egress: Egress, net_bytes: int | None, group: int | None) -> None:
        relay = relay_fd()
        self.listener = Listener(egress, net_bytes, group)
        self.mounts = ["--ro-bind", self.listener.path, SOCKET_DEST]
        self.child_fds = {RELAY_FD: relay}
        self.owned_fds: list[int] = []
        self.net_bytes = net_bytes
        if egress.extra_ca_pem:
            try:
                fd = _ca_memfd(egress.extra_ca_pem)
            except BaseException:
                self.listener.close()
                raise
            self.owned_fds.append(fd)
            self.child_fds[CA_FD] = fd
            self.mounts += ["--ro-bind-data", str(CA_FD), CA_BUNDLE_DEST]

    @classmethod
    def open(cls, egress: Egress, net_bytes: int | None, *, caller_is_root: bool, host_gid: int) -> EgressRun:
        """Start the run's listener (see :class:`lowlevel.net.proxy.Listener` for ``group``).

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


__all__ = ["CA_FD", "HOST_CA_BUNDLE", "RELAY_FD", "RELAY_PATH", "EgressRun", "relay_fd"]
