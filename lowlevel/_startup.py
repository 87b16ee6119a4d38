"""SIGINT while the ``lowlevel`` command starts: one line, never a ``KeyboardInterrupt`` traceback.

The console script imports ``lowlevel.cli`` (until issue 27 the whole package: ~110 ms here) before
:func:`lowlevel.cli.main` runs; a ^C in that window raised ``KeyboardInterrupt`` out of an
``import`` and Python printed its traceback (21 of 300 root and 15 of 120 unprivileged runs,
issue 23). The first statements of ``lowlevel/__init__.py`` (using only modules the interpreter
has loaded already, so that nothing before them can be interrupted) replace Python's default
SIGINT handler with one that prints the one-line notice, and only when the process's main program
is lowlevel's own command (the ``lowlevel`` console script, ``python -m lowlevel`` or ``python -m
lowlevel.cli``): never for a program that imports the library, whose SIGINT stays its own. The
handler imports nothing (the interrupted import may be half done), prints the CLI's one-line
notice (with ``--json``, its error object too) and exits 130: nothing was started yet, so
there is nothing to kill or give back. :func:`lowlevel.cli.main` puts Python's handler back
first thing (:func:`disarm`: its own ``KeyboardInterrupt`` handling then applies)
and drops SIGINT once it has its exit status (:func:`finished`). A SIGINT the parent ignored
(``nohup``, ``&`` in a script) stays ignored.

A SIGINT that lands while those first statements run, before the handler is armed (CI caught
one inside the ``signal()`` call: 1 of 100 random instants), is Python's ``KeyboardInterrupt``
raised inside their ``try`` block, whose handler gives the same notice when this is the command
(and re-raises for a library caller); the block opens with definitions and constants, which
cannot be interrupted (a pending signal is acted on at calls, backward jumps and function
entries). ``tests/integration/test_cli_startup_sigint.py`` raises it on each of those lines.

Since issue 27 the package's names are lazy (``lowlevel/__init__.py``), so the window this
handler covers is short (``lowlevel.cli`` and its parser); ``run``'s machinery is imported by
:func:`lowlevel.cli.main` after :func:`disarm`, where a ^C gives the same one-line notice
(:data:`lowlevel.cli.STARTING_NOTICE`) and exit 130.

Out of reach: a ^C before the package's first statement (Python's own start-up, the ``site``
module and its ``.pth`` files, the console script's ``import re``) gets Python's default
behaviour.

Source: signal(2); the Python library reference, :mod:`signal` ("Python installs a small number
of signal handlers by default: ... SIGINT is translated into a KeyboardInterrupt exception").
"""

from __future__ import annotations

import signal
import sys


def _armed() -> bool:
    import lowlevel
    handler = getattr(lowlevel, "_startup_sigint", None)
    return handler is not None and signal.getsignal(signal.SIGINT) is handler


#: Set by :func:`disarm` when the start-up handler was in place (this process is the CLI).
was_armed = False


def disarm() -> None:
    """Python's SIGINT handler back (the CLI's ``KeyboardInterrupt`` handling takes over)."""
    global was_armed
    if _armed():
        was_armed = True
        signal.signal(signal.SIGINT, signal.default_int_handler)


def finished() -> None:
    """The CLI has its exit status: a SIGINT from now on is dropped (no traceback at exit)."""
    if was_armed:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def exit_now(status: int) -> None:
    """End the CLI's process with ``status`` as Python's own exit would, minus the interpreter's teardown.

    Python's exit (``Py_FinalizeEx``) waits for the non-daemon threads (``threading._shutdown``),
    runs the :mod:`atexit` handlers (the sandbox teardown's :func:`~lowlevel.sandbox.teardown.drain`,
    ``logging.shutdown``, ``weakref.finalize``'s), flushes ``sys.stdout`` and ``sys.stderr``, and
    then frees every module and object: ~8-15 ms of CPU for the ~200 modules of a ``lowlevel
    run``, 4 ms for ``python -c pass`` (bench/README.md "The CLI, round 2"). This does the first
    three, in that order, then ``os._exit(status)``: the kernel closes the fds and frees the
    memory. Returns (Python's exit follows, as before) when a stream cannot be flushed (a closed
    pipe: Python reports it and exits 120, as it always did) or in development mode (``-X dev``:
    its warnings at teardown stay visible). Only for the console command's process
    (:data:`was_armed`, no ``argv`` given to :func:`lowlevel.cli.main`), never for a program that
    calls :func:`lowlevel.cli.main` or imports the library.
    Source: Python/pylifecycle.c ``Py_FinalizeEx``; os._exit(2) in the Python library reference.
    """
    import atexit
    import os
    import threading

    if sys.flags.dev_mode:
        return
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        return
    os._exit(status)
