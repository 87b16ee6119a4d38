"""What lowlevel keeps in a process by design, for every test that counts fds or children.

The hygiene tests compare this process's fds (``/proc/self/fd``) and children
(``/proc/PID/task/*/children``, zombies included) before and after some runs. What the package
opens once per process and keeps for later runs is no leak, but it appears in whichever test
makes the first such run: run alone (or first), that test saw it as one. Every fd/child count
goes through :func:`open_fds` (or :func:`fd_numbers`) and :func:`children`, which leave out exactly these:

- the executables bwrap execs as ``/proc/self/fd/N`` (``O_RDONLY | O_CLOEXEC``, one each, opened
  on first use and kept): the run guard (:func:`lowlevel.host.landlock.guard_fd`), the session init
  (:func:`lowlevel.session.protocol.init_fd` of :func:`lowlevel.session.protocol.init_path`) and the
  egress relay (:func:`lowlevel.net.egress_run.relay_fd`);
- the egress proxy thread (:func:`lowlevel.net.loop.shared`, started by the first run with an
  allowlist, for the process's life): its epoll set, its asyncio loop's epoll and self-pipe;
- the holder of a systemd-delegated cgroup scope (``lowlevel.host.cgroup_detect._holder``, only where systemd
  delegates one): one child process and the pipe to its stdin.

Nothing else is kept: :mod:`lowlevel.host.hostcache` opens and closes its files per use, the threads
of :mod:`lowlevel.sandbox.aio`'s executor hold no fd, and no sandbox process outlives its run, Session
or Pool. The three executable fds are opened here on first call (so their numbers are taken
before a test's first snapshot, never in the middle of its runs).
"""

from __future__ import annotations

import contextlib
import glob
import os


def kept_fds() -> set[int]:
    """The fd numbers lowlevel keeps open in this process by design (see the module docstring).

    Opens the three executable fds if this process has not yet (the package would on its first
    run); lists the proxy thread's and the scope holder's only where they exist.
    """
    from lowlevel.net import egress_run
    from lowlevel.net import loop as proxy_loop
    from lowlevel.host import landlock
    from lowlevel.host import cgroup_detect
    from lowlevel.session import protocol as session_protocol

    kept: set[int] = set()
    init_fd = lambda: session_protocol.init_fd(session_protocol.init_path())  # noqa: E731
    for opener in (landlock.guard_fd, init_fd, egress_run.relay_fd):
        with contextlib.suppress(Exception):  # a broken install: the run itself reports it
            kept.add(opener())
    proxy = proxy_loop.running()
    if proxy is not None:
        kept.add(proxy.mux.fileno())
        loop = proxy.loop
        for attr in ("_selector", "_ssock", "_csock"):  # asyncio's selector event loop
            obj = getattr(loop, attr, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    kept.add(obj.fileno())
    holder = cgroup_detect._holder
    if holder is not None and holder.stdin is not None and not holder.stdin.closed:
        kept.add(holder.stdin.fileno())
    return kept


def open_fds() -> dict[int, str]:
    """``{fd: readlink target}`` of this process's open fds, less :func:`kept_fds`."""
    kept = kept_fds()
    out = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in kept:
            continue
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own fd, closed by now
    return out


def fd_numbers() -> set[int]:
    """The numbers of :func:`open_fds`: what a before/after comparison of fds looks at."""
    return set(open_fds())


def kept_children() -> set[int]:
    """PIDs of the children lowlevel keeps by design (the systemd scope holder, if any)."""
    from lowlevel.host import cgroup_detect

    holder = cgroup_detect._holder
    return {holder.pid} if holder is not None and holder.returncode is None else set()


def settle() -> None:
    """Wait for the work this process's finished runs left for later (:func:`lowlevel.host.later.drain`:
    their anchors reaped, their cgroups removed, their disk uppers closed, off the result path)
    before counting what is left."""
    from lowlevel.host import later

    later.drain()


def children(pid: int | None = None) -> list[int]:
    """PIDs of the children of ``pid`` (default: this process; every thread's, zombies
    included), less :func:`kept_children` when ``pid`` is this process (whose finished runs'
    teardown is waited for first: :func:`settle`)."""
    if pid is None or pid == os.getpid():
        settle()
    pid = os.getpid() if pid is None else pid
    out: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue  # a thread that just ended
    kept = kept_children() if pid == os.getpid() else set()
    return sorted(c for c in out if c not in kept)
