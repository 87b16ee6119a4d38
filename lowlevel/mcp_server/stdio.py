"""The stdio transport of ``lowlevel mcp``: the SDK's line loop, with each line checked at the edge.

The SDK's own ``stdio_server`` hands a line it cannot read to the server as an exception, and the
server drops it without a word: a client that sent ``[]``, ``{"id": {...}, ...}``, a line that is
not JSON or not UTF-8 waited forever. Here every input line gets either the message the SDK's
reader would have built from it, or one JSON-RPC error line on stdout (JSON-RPC 2.0, section 5.1
https://www.jsonrpc.org/specification#error_object), and the server goes on reading:

=========  ==================  ==========================================================
code       id                  for
=========  ==================  ==========================================================
-32700     null                not UTF-8; not JSON (RFC 8259: no ``NaN``/``Infinity``, no
                               lone surrogate ``"\\ud800"``, at most the SDK parser's depth)
-32600     null                an array (empty: JSON-RPC 2.0 section 6; non-empty: MCP
                               2025-06-18 removed batching, its elements are not run), not
                               an object, a request whose ``id`` is not a string or an
                               integer (object, array, bool, fraction, null: MCP forbids
                               null), a response the SDK cannot read, a line over the limit
-32600     the request's id    ``jsonrpc`` not ``"2.0"``, ``method`` not a string,
                               ``params`` not an object or array, or any other request the
                               SDK's message model refuses
-32602     the request's id    ``params`` an array (JSON-RPC allows positional params; MCP
                               takes named ones only)
=========  ==================  ==========================================================

The id is echoed only for a request (an object with ``method``) whose ``id`` is a valid one:
that is the request the client waits on. A line that is empty or only whitespace carries no
message and is skipped, as the SDK does. Each error is ``{"jsonrpc": "2.0", "id": ..., "error":
{"code": ..., "message": "Parse error" | "Invalid Request" | "Invalid params", "data": "<why>"}}``.

Every other line goes to the server unchanged: parsed by the SDK's parser (``pydantic_core``) and
validated by its message model, as its HTTP transport does. Answers keep the SDK's serialization.
The SDK's responses and these errors are written by one writer under one lock, one line each,
flushed, so lines never interleave.

Bounds: a line is read at most ``max_line_bytes`` (:data:`MAX_LINE_BYTES`, 16 MiB by default)
at a time; a longer one is answered -32600 (id null: it is not read, so its id is unknown) and
skipped to its newline in 64 KiB pieces, so hostile input never makes the server hold more than
one line's bytes (plus its parse: up to about 10 times that, see :data:`MAX_LINE_BYTES`).

While serving, fd 0 reads ``/dev/null`` and fd 1 writes to stderr, so a handler or a child that
reads stdin or prints misses the wire (the SDK 2.x stdio transport does the same); the wire is a
private duplicate of each, and both fds are restored on exit.

Source: JSON-RPC 2.0 specification (sections 4, 5, 5.1, 6); MCP specification, basic protocol
(2025-06-18: ids are strings or integers, not null; no JSON-RPC batching) and stdio transport
(one message per line, UTF-8).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, BinaryIO

import anyio
import anyio.to_thread
import pydantic_core

log = logging.getLogger("lowlevel")

#: Longest input line read (bytes, its newline not counted). The largest message a client sends
#: is a ``write_file`` of ``max_file_bytes`` (1 MiB by default): 1.4 MiB in base64, at worst 6 MiB
#: as a JSON string (``\\u0001`` for each control byte); 16 MiB holds that with room. A line's
#: parse takes up to about 10 times its size (160 MiB measured for 16 MiB of tiny object keys),
#: so the bound is also the server's memory bound per line. :func:`line_limit` raises it for a
#: larger ``max_file_bytes``.
MAX_LINE_BYTES = 16 * 1024 * 1024

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
_MESSAGES = {PARSE_ERROR: "Parse error", INVALID_REQUEST: "Invalid Request", INVALID_PARAMS: "Invalid params"}
_SKIP_CHUNK = 64 * 1024


def line_limit(max_file_bytes: int) -> int:
    """The line limit (bytes) for a server whose ``write_file`` takes ``max_file_bytes`` bytes:
    :data:`MAX_LINE_BYTES`, or room for such a file written as JSON text at its worst (6 bytes a
    byte) plus 64 KiB, whichever is more."""
    return max(MAX_LINE_BYTES, 6 * max_file_bytes + 64 * 1024)


def error_line(code: int, request_id: str | int | None, why: str) -> bytes:
    """One JSON-RPC 2.0 error response (section 5, 5.1) as a UTF-8 line ending in ``\\n``.

    ``code``: :data:`PARSE_ERROR`, :data:`INVALID_REQUEST` or :data:`INVALID_PARAMS` (its
    standard message goes in ``message``); ``request_id``: echoed, or None for ``"id": null``;
    ``why``: the detail, in ``data``."""
    body = {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": _MESSAGES[code], "data": why}}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


def _valid_id(value: object) -> bool:
    """MCP's request id: a string or an integer (not a bool, a fraction or null)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type."""
    if value is None:
        return "null"
    return {bool: "a boolean", str: "a string"}.get(type(value), "a number")


def _first_errors(err: Exception) -> str:
    """The first validation errors, their places and reasons only (never the client's input)."""
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return type(err).__name__
    parts = [f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in errors(include_input=False)[:3]]
    return "; ".join(parts)[:300]


class Codec:
    """The installed SDK's message model, as its stdio transport uses it.

    ``decode(obj)`` turns a parsed JSON value into the SDK's ``JSONRPCMessage`` and raises
    ValueError (pydantic's ValidationError) for one it refuses; ``wrap(message)`` is what its
    read stream carries (a ``SessionMessage``); ``encode(item)`` is the line (bytes, ending in a
    newline) its stdio writer writes for a ``SessionMessage`` of its write stream. mcp 2.x
    (``mcp_types``) and 1.x (``mcp.types``; 1.8 and later, which have ``SessionMessage``) are read.
    """

    def __init__(self) -> None:
        self.decode: Callable[[Any], Any]
        self.encode_message: Callable[[Any], str]
        try:
            from mcp_types import jsonrpc_message_adapter
        except ImportError:  # mcp 1.x
            from mcp import types as types_1x
            model: Any = types_1x.JSONRPCMessage  # a RootModel on 1.x
            self.decode = model.model_validate
            self.encode_message = lambda m: m.model_dump_json(by_alias=True, exclude_none=True)
        else:
            self.decode = lambda obj: jsonrpc_message_adapter.validate_python(obj, by_name=False)
            self.encode_message = lambda m: m.model_dump_json(by_alias=True, exclude_unset=True)
        from mcp.shared.message import SessionMessage

        self.wrap: Callable[[Any], Any] = SessionMessage

    def encode(self, item: Any) -> bytes:
        return self.encode_message(item.message).encode("utf-8") + b"\n"

    def check(self, line: bytes) -> Any:
        """The SDK's message for one input line (without its newline), None for a blank line,
        or the error line (bytes) to answer it with (the table of the module docstring)."""
        if not line.strip():
            return None
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            return error_line(PARSE_ERROR, None, f"the line is not UTF-8 (byte {err.start})")
        try:
            obj = pydantic_core.from_json(text, allow_inf_nan=False)
        except ValueError as err:
            return error_line(PARSE_ERROR, None, f"the line is not JSON: {str(err)[:200]}")
        if isinstance(obj, list):
            why = ("an empty array is no message (JSON-RPC 2.0 section 6)" if not obj else
                   "batches are not supported (MCP 2025-06-18 removed JSON-RPC batching): none of its "
                   "messages was run; send one message per line")
            return error_line(INVALID_REQUEST, None, why)
        if not isinstance(obj, dict):
            return error_line(INVALID_REQUEST, None, f"a message is a JSON object, not {_json_type(obj)}")
        is_request = "method" in obj
        rid = obj["id"] if is_request and _valid_id(obj.get("id")) else None
        if obj.get("jsonrpc") != "2.0":
            return error_line(INVALID_REQUEST, rid, 'the member "jsonrpc" must be exactly "2.0"')
        if is_request:
            if not isinstance(obj["method"], str):
                return error_line(INVALID_REQUEST, rid, 'the member "method" must be a string')
            if "id" in obj and rid is None:
                return error_line(INVALID_REQUEST, None, 'the member "id" must be a string or an integer '
                                  "(not null, a fraction, a bool, an object or an array)")
            params = obj.get("params")
            if isinstance(params, list):
                return error_line(INVALID_PARAMS, rid, '"params" must be an object (MCP takes named parameters)')
            if params is not None and not isinstance(params, dict):
                return error_line(INVALID_REQUEST, rid, 'the member "params" must be an object')
        try:
            return self.wrap(self.decode(obj))
        except ValueError as err:
            if not is_request:
                return error_line(INVALID_REQUEST, None, 'neither a request (no "method") nor a response '
                                  '(an "id" and an object "result", or an "error" object)')
            return error_line(INVALID_REQUEST, rid, f"not a valid JSON-RPC request: {_first_errors(err)}")


def _read_line(wire: BinaryIO, limit: int) -> tuple[bytes, bool]:
    """The next line of ``wire`` (b"" at EOF) and whether it was longer than ``limit`` bytes
    (then only its first ``limit + 1`` bytes are returned and the rest is read and dropped)."""
    line = wire.readline(limit + 1)
    if len(line) <= limit or line.endswith(b"\n"):
        return line, False
    while True:
        rest = wire.readline(_SKIP_CHUNK)
        if not rest or rest.endswith(b"\n"):
            return line, True


class _Lines:
    """The input side: a daemon thread reads ``wire`` line by line (:func:`_read_line`) and hands
    each line over through a one-slot queue; :meth:`next` waits for one in a worker thread.

    Why a thread of its own: a read of stdin blocks until the client writes, and a blocked
    anyio worker thread (non-daemon) kept the process from exiting after a signal ended the
    server (Python joins such threads at exit). The daemon thread holding the blocked read
    dies with the process; :meth:`release` frees a worker waiting in :meth:`next`.
    """

    def __init__(self, wire: BinaryIO, limit: int) -> None:
        self.queue: queue.Queue[tuple[bytes, bool] | BaseException] = queue.Queue(maxsize=1)
        self.limiter: anyio.CapacityLimiter | None = None
        self.thread = threading.Thread(target=self._pump, args=(wire, limit), name="lowlevel-mcp-stdin", daemon=True)
        self.thread.start()

    def _pump(self, wire: BinaryIO, limit: int) -> None:
        while True:
            try:
                item: tuple[bytes, bool] | BaseException = _read_line(wire, limit)
            except BaseException as err:  # noqa: BLE001 - raised again on the loop's side by next()
                item = err
            self.queue.put(item)
            if not isinstance(item, tuple) or not item[0]:
                return

    async def next(self) -> tuple[bytes, bool]:
        """The next line (b"" at EOF) and whether it was too long; what the read raised."""
        if self.limiter is None:  # a thread of its own: tool calls holding every worker cannot starve it
            self.limiter = anyio.CapacityLimiter(1)
        item = await anyio.to_thread.run_sync(self.queue.get, abandon_on_cancel=True, limiter=self.limiter)
        if isinstance(item, BaseException):
            raise item
        return item

    def release(self) -> None:
        """Free a worker thread waiting in :meth:`next` (the server stops: it reads no more)."""
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait((b"", False))


class Unanswered:
    """The ids of the requests read and not yet answered (a count per id: a client may reuse one).

    :meth:`read` takes each message handed to the server: a request's id is counted, a
    ``notifications/cancelled`` uncounts its ``requestId`` (the SDK never answers a cancelled
    request, MCP 2025-06-18 "Cancellation"); :meth:`written` takes each message written: a
    response's or an error's id is uncounted. Truthy while any request waits for its answer.
    Messages are the SDK's (a ``RootModel`` on mcp 1.x: its ``root`` is read)."""

    def __init__(self) -> None:
        self.ids: dict[object, int] = {}

    def __bool__(self) -> bool:
        return bool(self.ids)

    def __len__(self) -> int:
        return sum(self.ids.values())

    def _drop(self, rid: object) -> None:
        left = self.ids.get(rid, 0) - 1
        if left > 0:
            self.ids[rid] = left
        else:
            self.ids.pop(rid, None)

    def read(self, message: Any) -> None:
        message = getattr(message, "root", message)
        method = getattr(message, "method", None)
        if method == "notifications/cancelled":
            params = getattr(message, "params", None)
            rid = params.get("requestId") if isinstance(params, dict) else getattr(params, "request_id", None)
            if rid is not None:
                self._drop(rid)
        elif method is not None and getattr(message, "id", None) is not None:
            self.ids[message.id] = self.ids.get(message.id, 0) + 1

    def written(self, message: Any) -> None:
        message = getattr(message, "root", message)
        if getattr(message, "method", None) is None and getattr(message, "id", None) is not None:
            self._drop(message.id)


class _Wire:
    """The output side: one lock, one line per write, flushed."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.lock = anyio.Lock()
        self.limiter = anyio.CapacityLimiter(1)  # its own thread, as _Lines'

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()

    async def send(self, data: bytes) -> None:
        async with self.lock:
            await anyio.to_thread.run_sync(self._write, data, limiter=self.limiter)


@contextmanager
def _claimed_stdio() -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """Private duplicates of fd 0 and fd 1 (the wire); meanwhile fd 0 reads /dev/null and fd 1
    writes to stderr. Both are restored on exit; the duplicates are never closed (a worker
    thread may still block in a read on them, as in the SDK)."""
    sys.stdout.flush()
    wire_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    wire_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.dup2(null, 0)
        os.dup2(2, 1)
    finally:
        os.close(null)
    try:
        yield os.fdopen(wire_in, "rb", closefd=False), os.fdopen(wire_out, "wb", closefd=False)
    finally:
        sys.stdout.flush()
        os.dup2(wire_in, 0)
        os.dup2(wire_out, 1)


def _streams(size: int) -> tuple[Any, Any]:
    """The SDK's context-carrying memory streams (2.x), else anyio's."""
    try:
        from mcp.shared._context_streams import create_context_streams
    except ImportError:  # mcp 1.x
        return anyio.create_memory_object_stream(size)
    return create_context_streams(size)


@asynccontextmanager
async def stdio_server(max_line_bytes: int = MAX_LINE_BYTES,
                       on_gone: Callable[[], None] | None = None) -> AsyncIterator[tuple[Any, Any]]:
    """Serve MCP over stdin/stdout, checking each line (the module docstring): yields the read
    stream (the SDK's messages) and the write stream (its answers), as the SDK's ``stdio_server``.

    ``max_line_bytes``: longest line read (bytes, > 0; ValueError otherwise). fd 0 and fd 1 are
    claimed meanwhile (the module docstring). ``on_gone``: called once, in a worker thread, when
    the client is gone: stdin at its end, or stdout's reader gone (EPIPE: the answers stop,
    without the BrokenPipeError traceback the SDK's task group printed); the caller's shutdown
    kills what still runs, so the calls in flight end instead of running to their timeouts.
    """
    if max_line_bytes <= 0:
        raise ValueError(f"max_line_bytes must be > 0, got {max_line_bytes!r}")
    codec = Codec()
    with _claimed_stdio() as (wire_in, wire_out):
        wire = _Wire(wire_out)
        read_send, read_receive = _streams(0)
        write_send, write_receive = _streams(0)

        lines = _Lines(wire_in, max_line_bytes)
        unanswered = Unanswered()
        gone: list[bool] = []    # on_gone was called (stdin's end, or EPIPE)
        broken: list[bool] = []  # stdout's reader is gone: answers are dropped

        async def client_gone() -> None:
            if not gone:
                gone.append(True)
                if on_gone is not None:
                    await anyio.to_thread.run_sync(on_gone)

        async def reader() -> None:
            async with read_send:
                while True:
                    line, too_long = await lines.next()
                    if not line:
                        await client_gone()  # the caller's shutdown: runs killed, calls drained
                        # Every request read gets its answer before the read stream closes (the SDK
                        # drops the handlers still running then: calls queued behind
                        # max_concurrent_runs lost their answers), within EOF_ANSWERS_S.
                        with anyio.move_on_after(EOF_ANSWERS_S):
                            while unanswered and not broken:
                                await anyio.sleep(0.01)
                        if unanswered and not broken:
                            log.warning("lowlevel: mcp: %d request(s) still unanswered %g s after stdin's end: "
                                        "stopping", len(unanswered), EOF_ANSWERS_S)
                        return
                    checked = (error_line(INVALID_REQUEST, None, f"the line is longer than {max_line_bytes} "
                                          "bytes, the server's limit: not read") if too_long else codec.check(line))
                    if isinstance(checked, bytes):
                        log.debug("lowlevel: mcp: refused an input line: %s", checked[:200].decode(errors="replace"))
                        await wire.send(checked)
                    elif checked is not None:
                        unanswered.read(checked.message)
                        await read_send.send(checked)

        async def writer() -> None:
            async with write_receive:
                async for item in write_receive:
                    if broken:
                        continue  # nobody reads the answers any more: drop them
                    try:
                        await wire.send(codec.encode(item))
                        unanswered.written(item.message)
                    except (BrokenPipeError, ConnectionResetError):
                        log.debug("lowlevel: mcp: the client stopped reading (EPIPE): stopping")
                        broken.append(True)
                        await client_gone()
                        tg.cancel_scope.cancel()  # no answer can reach it: stop serving

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                tg.start_soon(writer)
                yield read_receive, write_send
        finally:
            lines.release()


#: After stdin's end and ``on_gone``, how long the read stream stays open at most while requests
#: read are still unanswered, seconds. The SDK drops a handler still running when the stream
#: closes: ``printf ... | lowlevel mcp`` lost its last answers, and calls queued behind
#: ``max_concurrent_runs`` (776 of 1,000) lost theirs. By then every call's worker thread has
#: returned (``on_gone``) and new runs are refused at once, so what is left is the loop's work.
EOF_ANSWERS_S = 30.0

#: The signals that end the server gracefully (:func:`run`'s ``on_signal``).
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def run(server: Any, max_line_bytes: int = MAX_LINE_BYTES,
        on_signal: Callable[[int], None] | None = None, on_gone: Callable[[], None] | None = None,
        pending: Callable[[], int | None] | None = None) -> int | None:
    """Serve ``server`` (the SDK's ``MCPServer``, or ``FastMCP`` on mcp 1.x) over stdio until the
    client closes stdin: its ``run("stdio")``, with :func:`stdio_server` as the transport.

    With ``on_signal`` (in the main thread only: signal handlers are per process, set there),
    SIGTERM, SIGHUP and SIGINT end the server gracefully instead of killing it: the first one
    calls ``on_signal(signum)`` in a worker thread (the caller's shutdown: kill what runs, close
    and commit sessions) while the loop still serves the calls it ends, then stops reading and
    serving; later signals meanwhile are ignored. Without it the process dies at once: sessions
    lost uncommitted, run cgroups left (a fresh-user trial: the MCP SDK's own client ends a
    server with SIGTERM 2 s after closing its stdin).

    ``on_gone``: as :func:`stdio_server`'s. ``pending``: the first signal the caller's own
    handlers recorded, or None; given, those handlers stay in place (no receiver of the loop's)
    and a recorded signal stops the server as one received here would.

    Returns:
        The signal number that ended the server, or None (the client closed stdin).
    """
    inner = getattr(server, "_lowlevel_server", None) or server._mcp_server
    got: list[int] = []

    async def stop(signum: int, scope: anyio.CancelScope) -> None:
        assert on_signal is not None
        if not got:
            got.append(signum)
            await anyio.to_thread.run_sync(on_signal, signum)
            scope.cancel()

    async def on_signals(scope: anyio.CancelScope) -> None:
        if pending is not None:
            # The caller's handler stays installed (an event loop's own receiver would put SIG_DFL
            # back when the loop ends, and a signal during the final commits killed the process:
            # a fresh-user trial); a signal interrupts the loop's wait, this sees it within 0.1 s.
            while True:
                signum = pending()
                if signum is not None:
                    await stop(signum, scope)
                    return
                await anyio.sleep(0.1)
        with anyio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
            async for received in signals:
                await stop(int(received), scope)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            if on_signal is not None and threading.current_thread() is threading.main_thread():
                tg.start_soon(on_signals, tg.cancel_scope)
            async with stdio_server(max_line_bytes, on_gone=on_gone) as (read, write):
                await inner.run(read, write, inner.create_initialization_options())
            tg.cancel_scope.cancel()  # stdin closed: the signal task goes too

    anyio.run(main)
    return got[0] if got else None


__all__ = ["MAX_LINE_BYTES", "SHUTDOWN_SIGNALS", "Codec", "Unanswered", "error_line", "line_limit", "run",
           "stdio_server"]
