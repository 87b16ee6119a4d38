"""The egress proxy's one event loop: an asyncio loop in a daemon thread, shared by every run of the process.

Concept: every listener of the process (:class:`lowlevel.net.proxy.Listener`) is served by
one loop in one thread (``lowlevel-egress``), started on first use and again in a forked
child; a sync :func:`lowlevel.run`, an :func:`lowlevel.arun` and a Session all use it, so no
run pays for a thread or a process. A run's listening socket is added to the thread's epoll
set (``mux``, ``epoll_ctl`` from the caller's thread) and taken out when the run ends, so a run
that opens no connection never wakes the loop thread: measured here, each wake-up of another
Python thread costs the run ~0.4 ms of CPU (GIL hand-offs), more than the whole listener.

Sources: epoll(7); asyncio event loop docs (``add_reader``, ``run_forever``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
from collections.abc import Callable


class ProxyThread:
    """One asyncio loop in a daemon thread, and the epoll set (``mux``) through which it learns
    of the listeners' connections: the loop watches ``mux`` alone; when it is readable it calls
    the ``on_ready`` of each listening fd with connections waiting.

    Attributes:
        pid: the process that started it (a forked child starts its own).
        loop: the event loop (run it only from ``thread``).
        mux: the epoll object of the listening fds.
        thread: the daemon thread.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.mux = select.epoll()
        self.lock = threading.Lock()
        self.ready: dict[int, Callable[[], None]] = {}
        started = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(started,), name="lowlevel-egress", daemon=True)
        self.thread.start()
        started.wait()

    def _main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.add_reader(self.mux.fileno(), self._on_mux)
        self.loop.call_soon(started.set)
        self.loop.run_forever()

    def _on_mux(self) -> None:
        for fd, _events in self.mux.poll(0, 64):
            with self.lock:
                on_ready = self.ready.get(fd)
            if on_ready is not None:
                on_ready()

    def add(self, fd: int, on_ready: Callable[[], None]) -> None:
        """Watch listening ``fd`` (any thread): ``on_ready()`` runs in the loop thread when it
        has connections waiting."""
        with self.lock:
            self.ready[fd] = on_ready
        self.mux.register(fd, select.EPOLLIN)

    def remove(self, fd: int) -> None:
        """Stop watching ``fd`` (any thread; idempotent)."""
        with self.lock:
            self.ready.pop(fd, None)
        with contextlib.suppress(OSError):
            self.mux.unregister(fd)


_thread_lock = threading.Lock()
_thread: ProxyThread | None = None


def shared() -> ProxyThread:
    """The process's proxy thread, started on first use (and again in a forked child)."""
    global _thread
    with _thread_lock:
        if _thread is None or _thread.pid != os.getpid() or not _thread.thread.is_alive():
            _thread = ProxyThread()
        return _thread


def running() -> ProxyThread | None:
    """The process's proxy thread when it runs in this process, else None (never starts one)."""
    with _thread_lock:
        thread = _thread
    if thread is None or thread.pid != os.getpid() or not thread.thread.is_alive():
        return None
    return thread


__all__ = ["ProxyThread", "running", "shared"]
