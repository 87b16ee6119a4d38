"""lowlevel's dataclasses without compiling their methods again at every start.

:data:`dataclass` is :func:`dataclasses.dataclass` (same arguments, the same class out), except
that the code objects of the methods it generates come from a cache on disk. CPython 3.11's
:mod:`dataclasses` writes each generated method (``__init__``, ``__repr__``, ``__eq__``,
``__hash__``, a frozen class's ``__setattr__`` and ``__delattr__``) as source text and compiles
it with ``exec``: 174 compiles for the 33 classes a ``lowlevel run`` process loads, 7-15 ms of
the CLI's imports here, the largest single part (bench/README.md, "Issue 27", "The CLI"). The
compiled code depends on nothing but that text, the interpreter and its optimization level,
so it is cached by exactly those: the text is the key (compared in full), the file is keyed
by ``sys.version``, the bytecode cache tag and ``sys.flags.optimize``.

How: while :func:`dataclasses.dataclass` processes one of lowlevel's classes, the name ``exec``
in the :mod:`dataclasses` module is :func:`_exec`, which runs the cached code object of the
text (compiling and remembering it when missing) in the globals and locals
:mod:`dataclasses` gives. ``compile(text, "<string>", "exec", dont_inherit=True)`` is what
``exec(text)`` compiles there (:mod:`dataclasses` has no ``__future__`` imports), so a class is
the same with or without the cache (tests/unit/test_dataclass_cache.py compares them). Another
thread's dataclass made in that window goes through :func:`_exec` too and gets the same code
``exec`` would have made; the name is restored after each class.

Where: ``dataclass-code.marshal`` in the caller's cache directory (:func:`lowlevel.paths.cache_dir`:
ours, mode 0700; ``LOWLEVEL_NO_CACHE=1`` turns it off, ``LOWLEVEL_CACHE_DIR`` moves it). The
file is read only when it is a regular file of ours that nobody else may write: it holds code
this process runs, so it is trusted exactly as much as the directory it is in (a cached seccomp
filter, :mod:`lowlevel.host.hostcache`, is the same). An unreadable, foreign, truncated or
mismatched file means "no cache": the methods are compiled as :mod:`dataclasses` always did.
New code is written back (atomically: a temporary renamed into place) by :func:`save`, which
the CLI and the package's lazy attributes call after their imports, and :mod:`atexit` at the
end of any other process that compiled some. Nothing in it is state of a
run: code objects are immutable, and each class gets fresh function objects from them.

Importing this module imports :mod:`dataclasses` without its :mod:`inspect` (:func:`_import_dataclasses`),
which it uses only for a class without a docstring; lowlevel's classes all have one.
"""

from __future__ import annotations

import atexit
import builtins
import marshal
import sys
import threading
import types

from lowlevel.paths import cache_enabled, read_cache_file, write_cache_file

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CodeType

#: Name of the cache file in :func:`lowlevel.paths.cache_dir`.
FILE = "dataclass-code.marshal"
#: Format of the file: bump when its layout changes.
FORMAT = 1
#: The largest cache file read, bytes (this package's classes make ~150 KB).
MAX_BYTES = 8 << 20
#: Entries kept when saving; past it only the ones this process used are written (stale texts
#: of edited classes do not pile up).
MAX_ENTRIES = 2000

_lock = threading.RLock()


class _LazyInspect(types.ModuleType):
    """What :mod:`dataclasses` sees as ``inspect``: the real module, imported on first attribute use.

    CPython 3.11's :mod:`dataclasses` imports :mod:`inspect` (with it ``ast``, ``dis``,
    ``tokenize``, ``linecache``: ~3.5 ms of a ``lowlevel run``'s start-up here, bench/README.md
    "The CLI, round 2") for one call, ``inspect.signature(cls)``, made only for a class without a
    docstring. Every attribute is the real module's, so such a class gets the same ``__doc__``.
    """

    def __getattr__(self, name: str) -> object:
        with _lock:  # another thread: wait until _import_dataclasses took this out of sys.modules
            import inspect
        if inspect is self:  # pragma: no cover  (only inside the window, and dataclasses makes no call there)
            raise AttributeError(name)
        return getattr(inspect, name)


def _import_dataclasses() -> types.ModuleType:
    """:mod:`dataclasses`, without importing :mod:`inspect` when nothing else did (:class:`_LazyInspect`).

    While ``import dataclasses`` runs, ``sys.modules["inspect"]`` is a :class:`_LazyInspect` (so
    its ``import inspect`` binds that); afterwards the entry is removed again, and any other
    ``import inspect`` loads the real module as always. A thread that imports :mod:`inspect`
    in that window gets the stand-in, which forwards every attribute to the real module.
    """
    with _lock:
        if "dataclasses" in sys.modules or "inspect" in sys.modules:
            import dataclasses
            return dataclasses
        stand_in = _LazyInspect("inspect")
        sys.modules["inspect"] = stand_in
        try:
            import dataclasses
        finally:
            if sys.modules.get("inspect") is stand_in:
                del sys.modules["inspect"]
        return dataclasses


if TYPE_CHECKING:
    import dataclasses
else:
    dataclasses = _import_dataclasses()
_codes: dict[str, CodeType] | None = None  # text -> code, loaded on first use
_used: set[str] = set()
_new = False
_at_exit = False  # save() registered with atexit (on the first code compiled)


def _header() -> tuple[int, str, str | None, int]:
    return (FORMAT, sys.version, sys.implementation.cache_tag, sys.flags.optimize)


def _load() -> dict[str, CodeType]:
    global _codes
    if _codes is not None:
        return _codes
    codes: dict[str, CodeType] = {}
    data = read_cache_file(FILE, MAX_BYTES)
    if data is not None:
        try:
            got = marshal.loads(data)
            if isinstance(got, tuple) and len(got) == 2 and got[0] == _header() and isinstance(got[1], dict):
                code_type = type(_load.__code__)
                codes = {k: v for k, v in got[1].items() if isinstance(k, str) and type(v) is code_type}
        except (ValueError, EOFError, TypeError):
            codes = {}
    _codes = codes
    return codes


def _exec(source: str, globals: dict[str, object] | None = None, locals: dict[str, object] | None = None) -> None:
    """``exec(source, globals, locals)`` with the code object from the cache (see the module doc)."""
    global _new, _at_exit
    if not isinstance(source, str):  # not what dataclasses passes: do what exec does
        builtins.exec(source, globals, locals)
        return
    with _lock:
        codes = _load()
        code = codes.get(source)
        if code is None:
            code = codes[source] = compile(source, "<string>", "exec", dont_inherit=True)
            _new = True
            if not _at_exit:  # a process importing lowlevel's modules directly saves at its exit
                _at_exit = True
                atexit.register(save)
        _used.add(source)
    builtins.exec(code, globals, locals)


def cached_dataclass(cls: type | None = None, /, **kwargs: object) -> object:
    """:func:`dataclasses.dataclass` (same arguments and result) with cached method code; the
    module's :data:`dataclass` at run time."""
    def wrap(c: type) -> type:
        _wait_for_typing()
        with _lock:
            module = vars(dataclasses)
            previous = module.get("exec", _MISSING)
            module["exec"] = _exec
            try:
                made: type = dataclasses.dataclass(c, **kwargs)  # type: ignore[call-overload]
            finally:
                if previous is _MISSING:
                    module.pop("exec", None)
                else:
                    module["exec"] = previous
        return made

    return wrap if cls is None else wrap(cls)


_MISSING = object()


def _wait_for_typing() -> None:
    """Wait until no other thread is half-way through ``import typing``.

    CPython 3.11's :mod:`dataclasses` looks :mod:`typing` up with ``sys.modules.get("typing")``
    (not an import: it does not wait for the module's lock) and then reads ``typing.ClassVar``:
    a class made while another thread imports :mod:`typing` failed with "partially initialized
    module 'typing' has no attribute 'ClassVar'" (threads starting their first ``lowlevel.run``
    while another imported :mod:`typing`: 1 process in 30, found by a fresh-user trial). An
    ``import`` of a module another thread is initializing blocks on that module's import lock
    until it is done (importlib's ``_ModuleLock``); this thread's own partial import (never the
    case here) is returned as is.
    """
    module = sys.modules.get("typing")
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
        import typing  # noqa: F401  (waits for the other thread's import to finish)


def save() -> None:
    """Write the code compiled since the cache was read (nothing when there is none); errors are ignored."""
    global _new
    with _lock:
        if not _new or _codes is None or not cache_enabled():
            return
        _new = False
        codes = _codes if len(_codes) <= MAX_ENTRIES else {k: v for k, v in _codes.items() if k in _used}
        try:
            data = marshal.dumps((_header(), codes))
        except ValueError:
            return
        write_cache_file(FILE, data)


def forget_loaded() -> None:
    """Forget what this process read from the file (tests: the next class reads it again)."""
    global _codes, _new
    with _lock:
        _codes = None
        _new = False
        _used.clear()


if TYPE_CHECKING:  # the type checker sees the standard decorator (its dataclass support applies)
    from dataclasses import dataclass as dataclass
else:
    dataclass = cached_dataclass
