"""Pipes, or a pty of our own, between the caller's stdio and a sandbox: the program never
holds the caller's own terminal or files.

A program given the caller's fds 0-2 can do more to them than read and write (issue 12,
item 1):

- on a terminal: ``ioctl(TIOCSETD)`` swaps its line discipline (the terminal then swallows
  input; restoring termios does not undo it), ``TIOCEXCL`` makes every later open fail with
  EBUSY, ``TCXONC TCOOFF`` stops its output, ``TIOCSTI`` types into the caller's shell
  (CVE-2017-5226; denied by seccomp, as is TIOCSETD, but the rest are ordinary terminal use);
- on a file (``lowlevel run ... >> agent.log``): reopen ``/proc/self/fd/1`` read-only and
  read the log's earlier content, or write-only without ``O_APPEND`` and rewrite it, even
  when the file lives in a directory the sandbox could never traverse.

:class:`StdioRelay` hands the program fds that lead only to us, and copies bytes both ways
while the run is live (output is not buffered until the end):

- a stream whose caller side is not a terminal gets a pipe: the caller's stdin is copied
  into it; the program's stdout and stderr are copied out. ``/proc/self/fd/N`` then names a
  pipe of ours. A broken caller stdout (``lowlevel run -- yes | head -1``) closes the
  program's pipe, so the program sees EPIPE/SIGPIPE as it would have.
- when the caller's stdin or stdout is a terminal, the program gets a fresh pty (made with
  ``openpty``; its settings and window size copied from the caller's terminal) on the
  streams whose caller side is a terminal. Whatever the program does to it ends with the
  run. When stdin and stdout both are the caller's terminal (interactive use) the caller's
  terminal is put in raw mode for the run, so the program's own line discipline (echo,
  line editing, raw mode for a REPL) is the one that applies, as ``script(1)`` and ``ssh -t``
  do; the caller's INTR and QUIT characters (``^C``, ``^\\``) are not passed on but raise
  SIGINT and SIGQUIT in the caller, which kills the sandbox as before. The termios settings
  are restored on every way out (exceptions, SIGINT/SIGTERM/SIGHUP/SIGQUIT through
  :mod:`lowlevel.cli`'s handlers). SIGWINCH in the caller copies the new window size to the
  pty (``TIOCGWINSZ``/``TIOCSWINSZ``).
- a caller stdin that is a terminal the caller does not own (a background job) is not
  read: the program's stdin is at end of file.

The sandbox runs with ``--new-session`` (no controlling terminal) and bwrap is spawned with
``setsid``, so ``/dev/tty`` inside names no terminal at all.

Limits: the relay reads ahead of the program (up to a pipe buffer and one read, 128 KiB), so
the caller's stdin offset moves further than the program read (as with ``ssh``); in raw mode ``^Z`` is
passed to the program rather than stopping the caller; the program gets no SIGWINCH (it has
no controlling terminal) but sees the new size with ``TIOCGWINSZ``.

Sources: pty(7), termios(3), tty_ioctl(4) (TIOCSETD, TIOCEXCL, TCXONC, TIOCSWINSZ),
proc(5) ``/proc/pid/fd``, bwrap(1) ``--new-session``, script(1).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import struct
import termios
import threading
import tty
from types import FrameType, TracebackType

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

_CHUNK = 1 << 20
#: Read size on the caller's stdin: small, as what the relay reads ahead of the program is
#: taken from a stdin the caller may share (see the module docstring).
_IN_CHUNK = 65536
#: Pipe buffer asked for (F_SETPIPE_SZ; capped by /proc/sys/fs/pipe-max-size, 1 MiB by
#: default): fewer wake-ups of the relay thread per byte of output.
_PIPE_BYTES = 1 << 20
#: How much of the program's stderr the relay keeps (:attr:`StdioRelay.stderr_tail`), bytes.
_TAIL = 4096
#: termios local-mode bits that echo input; cleared on our pty when the caller's terminal
#: stays in canonical mode and echoes the typed line itself.
_ECHO_BITS = termios.ECHO | termios.ECHOE | termios.ECHOK | termios.ECHONL | getattr(termios, "ECHOCTL", 0) \
    | getattr(termios, "ECHOKE", 0)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _owns_terminal(fd: int) -> bool:
    """False when ``fd`` is our controlling terminal and another process group is in its
    foreground (we are a background job: reading would stop us with SIGTTIN, and changing its
    settings with SIGTTOU). A terminal that is not our controlling one is ours to use."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return True


class StdioRelay:
    """Stand between the caller's stdio and a sandboxed program; see the module docstring.

    Use as a context manager around the run; pass :attr:`child_fds` as ``stdio_fds`` to
    :func:`lowlevel.run`, and call :meth:`finish` once the run returned (before printing
    anything of your own), so the program's last output is copied out first::

        with StdioRelay() as relay:
            result = lowlevel.run(cmd, capture=False, stdio_fds=relay.child_fds)
            relay.finish()

    Args:
        stdin: relay the caller's stdin (``fds[0]``). False leaves ``child_fds[0]`` None.
        output: relay stdout and stderr (``fds[1]``, ``fds[2]``). False leaves
            ``child_fds[1:]`` None (for ``capture=True``, which pipes them into the Result).
        fds: the caller's stdin, stdout and stderr fds (default 0, 1, 2). The relay never
            changes their flags (O_NONBLOCK belongs to whoever shares them).

    Attributes:
        child_fds: ``(stdin, stdout, stderr)`` for the program, each an fd of ours or None.
        pty: True when a pty stands in for a terminal.
        raw: True when the caller's terminal is in raw mode for the run.
        stderr_tail: the last 4 KiB the sandbox wrote to its stderr (and to the pty), e.g.
            bwrap's own ``execvp`` error, read once :meth:`finish` returned.

    Raises:
        OSError: a pipe or the pty could not be made (EMFILE, ENFILE...); nothing is left
            open or changed.
    """

    def __init__(self, *, stdin: bool = True, output: bool = True, fds: tuple[int, int, int] = (0, 1, 2)) -> None:
        self.fds = fds
        self.want_stdin = stdin
        self.want_output = output
        self.child_fds: tuple[int | None, int | None, int | None] = (None, None, None)
        self.pty = False
        self.raw = False
        self._owned: list[int] = []          # every fd we opened, closed by close()
        self._child_ends: list[int] = []     # the program's ends, closed once the run is over
        self._master: int | None = None
        self._slave: int | None = None
        self._in_src: int | None = None       # caller fd we read input from
        self._in_dst: int | None = None       # our fd the input goes to (pipe write end or master)
        self._in_is_tty = False
        self._outs: dict[int, int] = {}       # our read end -> caller fd it is copied to (-1: dropped)
        self._winsize_src: int | None = None
        self._saved_termios: list[Any] | None = None
        self._intr: bytes = b""
        self._quit: bytes = b""
        self._veof = b"\x04"
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._thread: threading.Thread | None = None
        self._old_winch: Any = None
        self._winch_installed = False
        self._main_ident = threading.main_thread().ident
        self._err_srcs: set[int] = set()     # our read ends carrying the program's stderr
        self.stderr_tail = b""                # the last bytes the program wrote to its stderr
        self.error: BaseException | None = None

    # -- setup -------------------------------------------------------------------------
    def _pipe(self, size: int | None = None) -> tuple[int, int]:
        r, w = os.pipe()
        self._owned += [r, w]
        if size is not None:
            with contextlib.suppress(OSError):
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, size)
        return r, w

    def __enter__(self) -> StdioRelay:
        try:
            self._setup()
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(drain=exc_type is None)

    def _setup(self) -> None:
        fin, fout, ferr = self.fds
        tty_in = self.want_stdin and self.want_output and _isatty(fin)
        in_owned = tty_in and _owns_terminal(fin)
        tty_out = self.want_output and _isatty(fout)
        tty_err = self.want_output and _isatty(ferr)
        self.pty = in_owned or tty_out
        child: list[int | None] = [None, None, None]
        if self.pty:
            master, slave = os.openpty()  # both O_CLOEXEC (PEP 446)
            self._owned += [master, slave]
            self._master, self._slave = master, slave
            self._child_ends.append(slave)
            self.raw = in_owned and tty_out
            self._setup_pty(fin if in_owned else fout, echo=self.raw or not in_owned, opost=self.raw)
            self._winsize_src = fout if tty_out else fin
            self._copy_winsize()
            sink = fout if tty_out else (ferr if tty_err else -1)
            self._outs[master] = sink
            self._err_srcs.add(master)
        if self.want_stdin:
            if in_owned:
                child[0] = self._slave
                self._in_src, self._in_dst, self._in_is_tty = fin, self._master, True
            else:
                r, w = self._pipe()
                child[0] = r
                self._child_ends.append(r)
                if tty_in or not _is_open(fin) or (_isatty(fin) and not self.want_output):
                    os.close(w)       # a terminal we do not own, or no stdin: end of file
                    self._owned.remove(w)
                else:
                    self._in_src, self._in_dst = fin, w
        if self.want_output:
            for i, (fd, is_tty) in enumerate(((fout, tty_out), (ferr, tty_err)), start=1):
                if is_tty and self.pty:
                    child[i] = self._slave
                    continue
                r, w = self._pipe(_PIPE_BYTES)
                child[i] = w
                self._child_ends.append(w)
                self._outs[r] = fd if _is_open(fd) else -1
                if i == 2:
                    self._err_srcs.add(r)
        if self._in_dst is not None:
            os.set_blocking(self._in_dst, False)
        for r in self._outs:
            os.set_blocking(r, False)
        self.child_fds = (child[0], child[1], child[2])
        self._wake_r, self._wake_w = self._pipe()
        if self.raw:
            self._enter_raw(fin)
        if self.pty and threading.current_thread() is threading.main_thread():
            self._old_winch = signal.signal(signal.SIGWINCH, self._on_winch)
            self._winch_installed = True

    def _setup_pty(self, src: int, *, echo: bool, opost: bool) -> None:
        assert self._slave is not None
        try:
            attrs = termios.tcgetattr(src)
        except termios.error:
            return
        if not echo:
            attrs[3] &= ~_ECHO_BITS
        if not opost:
            # The caller's terminal does the output processing (ONLCR) itself.
            attrs[1] &= ~termios.OPOST
        with contextlib.suppress(termios.error):
            termios.tcsetattr(self._slave, termios.TCSANOW, attrs)
        veof = attrs[6][termios.VEOF]
        if isinstance(veof, bytes) and veof != b"\0":
            self._veof = veof

    def _enter_raw(self, fd: int) -> None:
        attrs = termios.tcgetattr(fd)
        self._saved_termios = attrs
        if attrs[3] & termios.ISIG:
            cc = attrs[6]
            self._intr = cc[termios.VINTR] if cc[termios.VINTR] != b"\0" else b""
            self._quit = cc[termios.VQUIT] if cc[termios.VQUIT] != b"\0" else b""
        tty.setraw(fd, termios.TCSADRAIN)

    def _restore_terminal(self) -> None:
        if self._saved_termios is not None:
            with contextlib.suppress(termios.error, OSError):
                termios.tcsetattr(self.fds[0], termios.TCSADRAIN, self._saved_termios)
            self._saved_termios = None

    def _copy_winsize(self) -> None:
        if self._winsize_src is None or self._master is None:
            return
        try:
            size = fcntl.ioctl(self._winsize_src, termios.TIOCGWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
            fcntl.ioctl(self._master, termios.TIOCSWINSZ, size)
        except OSError:
            pass

    def _on_winch(self, signum: int, frame: FrameType | None) -> None:
        self._copy_winsize()
        old = self._old_winch
        if callable(old):
            old(signum, frame)

    def _start(self) -> None:
        # The thread blocks every signal, so they all go to the main thread, where Python runs
        # handlers (and where run() sits in poll): a SIGINT or SIGWINCH taken by the relay
        # thread would wait until the main thread next woke up.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            self._thread = threading.Thread(target=self._loop, name="lowlevel-stdio-relay", daemon=True)
            self._thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    # -- the copy loop (relay thread) ----------------------------------------------------
    def _loop(self) -> None:
        try:
            self._copy()
        except BaseException as err:  # noqa: BLE001 - reported by finish()
            self.error = err

    def _copy(self) -> None:
        pending = b""
        in_open = self._in_src is not None
        outs = dict(self._outs)
        stopping = False
        assert self._wake_r is not None
        while outs or (in_open and not stopping):
            masks: dict[int, int] = {self._wake_r: select.POLLIN}
            for r in outs:
                masks[r] = select.POLLIN
            if in_open and not stopping and self._in_dst is not None:
                if pending:
                    masks[self._in_dst] = masks.get(self._in_dst, 0) | select.POLLOUT
                elif self._in_src is not None:
                    masks[self._in_src] = masks.get(self._in_src, 0) | select.POLLIN
            poller = select.poll()
            for fd, mask in masks.items():
                poller.register(fd, mask)
            for fd, ev in poller.poll():
                if fd == self._wake_r:
                    os.read(fd, 64)
                    stopping = True
                    continue
                if fd in outs and ev & (select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    if not self._copy_out(fd, outs[fd]):
                        del outs[fd]
                        if fd == self._in_dst:
                            in_open = False
                if not in_open or stopping:
                    continue
                if fd == self._in_dst and ev & select.POLLOUT:
                    pending, in_open = self._write_in(pending)
                elif fd == self._in_src and fd not in outs:
                    pending, in_open = self._read_in(ev)
            if stopping:
                in_open = False

    def _read_in(self, ev: int) -> tuple[bytes, bool]:
        """Read the caller's stdin (poll said ``ev``) and pass it on; return (unwritten rest,
        input still open)."""
        assert self._in_src is not None
        try:
            data = os.read(self._in_src, _IN_CHUNK)
        except BlockingIOError:
            return b"", True
        except OSError:
            return b"", self._end_input(final=True)
        if not data:
            # A terminal's read of 0 bytes is its EOF character (more may follow), unless
            # it hung up; a pipe or file is done.
            return b"", self._end_input(final=not self._in_is_tty or bool(ev & select.POLLHUP))
        return self._write_in(self._signals_in(data))

    def _signals_in(self, data: bytes) -> bytes:
        """Raw mode: the caller's INTR/QUIT characters signal the caller, as the terminal would."""
        if not self.raw:
            return data
        for char, sig in ((self._intr, signal.SIGINT), (self._quit, signal.SIGQUIT)):
            if char and char in data:
                if self._main_ident is not None:
                    signal.pthread_kill(self._main_ident, sig)
                return data[:data.index(char)]
        return data

    def _write_in(self, data: bytes) -> tuple[bytes, bool]:
        """Write what the program's stdin takes now; return (the rest, input still open)."""
        assert self._in_dst is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._in_dst, view):]
        except BlockingIOError:
            return bytes(view), True
        except OSError:
            # EPIPE: the program closed its stdin (or exited); EIO: the pty is gone.
            return b"", self._end_input(final=True, broken=True)
        return b"", True

    def _end_input(self, *, final: bool, broken: bool = False) -> bool:
        """The caller's stdin reached end of file: pass it on. Returns whether input stays open."""
        dst = self._in_dst
        if dst is None:
            return False
        if dst == self._master:
            if not broken:
                # A terminal's ^D in canonical mode (the caller's, or the bytes of a file fed
                # to the pty): the program reads end of file at the start of a line.
                with contextlib.suppress(OSError):
                    os.write(dst, self._veof)
            return not final
        self._in_dst = None
        self._owned.remove(dst)
        os.close(dst)
        return False

    def _copy_out(self, src: int, dst: int) -> bool:
        """Copy what ``src`` holds to ``dst``; return False at end of file."""
        try:
            data = os.read(src, _CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            data = b""  # EIO: every slave end of the pty is closed
        if not data:
            return False
        if src in self._err_srcs:
            self.stderr_tail = (self.stderr_tail + data)[-_TAIL:]
        if dst < 0:
            return True
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(dst, view):]
            except BlockingIOError:
                select.select([], [dst], [])
            except InterruptedError:
                continue
            except OSError as err:
                if err.errno in (errno.EPIPE, errno.EIO, errno.EBADF, errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    # The caller's side is gone or full: the program sees a broken pipe next.
                    if src != self._master:
                        self._owned.remove(src)
                        os.close(src)
                    return False
                raise
        return True

    # -- teardown ------------------------------------------------------------------------
    def finish(self, timeout: float | None = None) -> None:
        """The run is over: close the program's ends, copy out what is left, stop reading
        the caller's stdin, and restore the terminal. Idempotent.

        Args:
            timeout: seconds to wait for the copy to finish (None: until done; the program
                is dead by now, so only a stalled reader of the caller's stdout can delay it).
        """
        for fd in self._child_ends:
            if fd in self._owned:
                self._owned.remove(fd)
                os.close(fd)
        self._child_ends.clear()
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None
        self._restore_terminal()
        self._uninstall_winch()

    def _uninstall_winch(self) -> None:
        if self._winch_installed:
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGWINCH, self._old_winch)
            self._winch_installed = False

    def close(self, drain: bool = False) -> None:
        """Finish (waiting at most 2 s unless ``drain``), restore the terminal, close every fd."""
        try:
            self.finish(timeout=None if drain else 2.0)
        finally:
            self._restore_terminal()
            self._uninstall_winch()
            if self._thread is None:
                for fd in self._owned:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                self._owned.clear()
            # else: the thread still copies to a stalled reader; it is a daemon and its fds
            # die with the process.


def is_terminal_or_none(fd: int) -> bool:
    """True when ``fd`` is a terminal or not open (nothing to read from it without a user)."""
    if not _is_open(fd):
        return True
    return _isatty(fd)


__all__ = ["StdioRelay", "is_terminal_or_none"]
