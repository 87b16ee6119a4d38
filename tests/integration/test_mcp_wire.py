"""``lowlevel mcp`` answers every malformed input line with its JSON-RPC error (JSON-RPC 2.0
section 5.1) and keeps serving.

A red-team pass found that for a line that was not JSON, an empty batch ``[]``, a request whose
``id`` was an object (array, bool, fraction), or a lone surrogate ``"\\ud800"``, the SDK's stdio
loop sent nothing: the client waited forever. Invalid UTF-8 was replaced and run, a float id
turned a request into a notification, and a line had no length bound. Now
:mod:`lowlevel.mcp_server.stdio` checks each line at the edge.

The server runs as ``python -m lowlevel mcp`` with raw pipes (the SDK's client cannot send
malformed lines); after each bad line a ``tools/list`` must still be answered. Timeouts here are
hang guards only.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from lowlevel.mcp_server.stdio import MAX_LINE_BYTES  # noqa: E402
from helpers.identities import owned_tmpdir  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
TOOLS = {"run", "run_in_session", "close_session", "write_file", "read_file", "list_files"}
MESSAGES = {-32700: "Parse error", -32600: "Invalid Request", -32602: "Invalid params"}


class Wire:
    """A ``lowlevel mcp`` subprocess driven line by line over its stdin/stdout, initialized."""

    def __init__(self, base: Path) -> None:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
        self.log = base / "stderr.txt"
        with open(self.log, "wb") as err:   # a file: a chatty stderr can never block the server
            self.proc = subprocess.Popen([sys.executable, "-m", "lowlevel", "mcp", "--workspace-base",
                                          str(base / "ws"), "--no-network"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, cwd=base)
        self.ids = itertools.count(1000)
        init = self.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                           "clientInfo": {"name": "test_mcp_wire", "version": "0"}})
        assert init["result"]["serverInfo"]["name"] == "lowlevel", init
        self.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')

    def send(self, *lines: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"".join(line + b"\n" for line in lines))
        self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.endswith(b"\n"), f"server closed stdout; stderr: {self.stderr()}"
        message = json.loads(line)
        assert isinstance(message, dict), message
        return message

    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one request and return its answer (nothing else may come before it)."""
        rid = next(self.ids)
        self.send(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method,
                              **({"params": params} if params is not None else {})}).encode())
        answer = self.receive()
        assert answer.get("id") == rid, answer
        return answer

    def answers_to(self, *lines: bytes) -> list[dict[str, Any]]:
        """What the server writes for ``lines``, up to the answer of a ``tools/list`` sent after
        them, which must list the tools (the server kept serving)."""
        rid = next(self.ids)
        self.send(*lines, json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/list"}).encode())
        seen = []
        while (message := self.receive()).get("id") != rid:
            seen.append(message)
        assert {t["name"] for t in message["result"]["tools"]} == TOOLS, message
        return seen

    def stderr(self) -> str:
        """The end of the server's stderr, once it has exited."""
        self.close()
        return self.log.read_text(errors="replace")[-2000:]

    def close(self) -> None:
        """Close stdin (the server exits at EOF) and wait for it."""
        if self.proc.returncode is None:
            try:
                self.proc.communicate(timeout=30)   # hang guard
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    base = owned_tmpdir(None, "lowlevel-mcp-wire-", 0o711)
    w = Wire(base)
    try:
        yield w
        err = w.stderr()
        assert w.proc.returncode == 0 and "Traceback" not in err, err
    finally:
        w.close()
        shutil.rmtree(base, ignore_errors=True)


def assert_error(answers: list[dict[str, Any]], code: int, rid: str | int | None) -> None:
    assert len(answers) == 1, answers
    (answer,) = answers
    assert set(answer) == {"jsonrpc", "id", "error"} and answer["jsonrpc"] == "2.0", answer
    assert answer["id"] == rid and type(answer["id"]) is type(rid), answer
    assert answer["error"]["code"] == code and answer["error"]["message"] == MESSAGES[code], answer
    assert isinstance(answer["error"]["data"], str) and answer["error"]["data"], answer


PING = b'{"jsonrpc":"2.0","id":5,"method":"ping"'

MALFORMED = [
    # name, line, code, id of the answer
    ("not JSON", b"hello", -32700, None),
    ("truncated JSON", PING, -32700, None),
    ("trailing garbage", PING + b"} x", -32700, None),
    ("invalid UTF-8 byte", PING + b',"params":{"x":"\xff"}}', -32700, None),
    ("UTF-8 encoded surrogate", PING + b',"params":{"x":"\xed\xa0\x80"}}', -32700, None),
    ("lone surrogate escape", PING + b',"params":{"x":"\\ud800"}}', -32700, None),
    ("lone surrogate method", b'{"jsonrpc":"2.0","id":5,"method":"\\ud800"}', -32700, None),
    ("NaN", PING + b',"params":{"x":NaN}}', -32700, None),
    ("empty batch", b"[]", -32600, None),
    ("batch [1]", b"[1]", -32600, None),
    ("batch of a valid request", b"[" + PING + b"}]", -32600, None),
    ("object id", b'{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}', -32600, None),
    ("array id", b'{"jsonrpc":"2.0","id":[5],"method":"ping"}', -32600, None),
    ("bool id", b'{"jsonrpc":"2.0","id":true,"method":"ping"}', -32600, None),
    ("fraction id", b'{"jsonrpc":"2.0","id":1.5,"method":"ping"}', -32600, None),
    ("float id", b'{"jsonrpc":"2.0","id":5.0,"method":"ping"}', -32600, None),
    ("null id", b'{"jsonrpc":"2.0","id":null,"method":"ping"}', -32600, None),
    ("a number", b"5", -32600, None),
    ("a string", b'"ping"', -32600, None),
    ("null", b"null", -32600, None),
    ('jsonrpc "1.0"', b'{"jsonrpc":"1.0","id":5,"method":"ping"}', -32600, 5),
    ('jsonrpc "1.0", no id', b'{"jsonrpc":"1.0","method":"ping"}', -32600, None),
    ("jsonrpc missing", b'{"id":"a","method":"ping"}', -32600, "a"),
    ("jsonrpc a number", b'{"jsonrpc":2.0,"id":5,"method":"ping"}', -32600, 5),
    ("method a number", b'{"jsonrpc":"2.0","id":5,"method":5}', -32600, 5),
    ("method null, no id", b'{"jsonrpc":"2.0","method":null}', -32600, None),
    ("method and a bad id", b'{"jsonrpc":"2.0","id":{},"method":5}', -32600, None),
    ("params a string", PING + b',"params":"x"}', -32600, 5),
    ("params an array", PING + b',"params":[1]}', -32602, 5),
    ("response without id", b'{"jsonrpc":"2.0","result":{}}', -32600, None),
    ("response with a scalar result", b'{"jsonrpc":"2.0","id":5,"result":1}', -32600, None),
    ("empty object", b"{}", -32600, None),
]


@pytest.mark.parametrize(("line", "code", "rid"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_line_is_answered_and_the_server_goes_on(wire: Wire, line: bytes, code: int,
                                                           rid: str | int | None) -> None:
    assert_error(wire.answers_to(line), code, rid)


def test_valid_requests_get_their_normal_answers(wire: Wire) -> None:
    """The control: what the SDK answered before, it answers still (ping, an unknown method, a
    request with extra members, a string id, CRLF), and blank lines get no answer."""
    assert wire.answers_to(b"", b"   ", b"\t") == []
    assert wire.answers_to(PING + b"}") == [{"jsonrpc": "2.0", "id": 5, "result": {}}]
    assert wire.answers_to(b'{"jsonrpc":"2.0","id":"s-1","method":"ping","extra":1}\r') == \
        [{"jsonrpc": "2.0", "id": "s-1", "result": {}}]
    assert wire.answers_to(b'{"jsonrpc":"2.0","id":-7,"method":"ping","params":null}') == \
        [{"jsonrpc": "2.0", "id": -7, "result": {}}]
    unknown = wire.answers_to(b'{"jsonrpc":"2.0","id":6,"method":"no/such"}')   # the SDK's own error
    assert [(a["id"], sorted(a)) for a in unknown] == [(6, ["error", "id", "jsonrpc"])], unknown
    assert wire.answers_to(b'{"jsonrpc":"2.0","method":"notifications/no-such"}') == []
    tools = wire.request("tools/list")["result"]["tools"]
    assert {t["name"] for t in tools} == TOOLS


def test_over_long_line_is_refused_unread_and_the_limit_itself_is_served(wire: Wire) -> None:
    head, tail = PING + b',"params":{"pad":"', b'"}}'
    at_limit = head + b"a" * (MAX_LINE_BYTES - len(head) - len(tail)) + tail
    assert len(at_limit) == MAX_LINE_BYTES
    assert wire.answers_to(at_limit) == [{"jsonrpc": "2.0", "id": 5, "result": {}}]
    over = head + b"a" * (MAX_LINE_BYTES + 1 - len(head) - len(tail)) + tail
    assert_error(wire.answers_to(over), -32600, None)
    # Far longer (four times the limit): still answered once, and the next line is read whole.
    assert_error(wire.answers_to(head + b"a" * (4 * MAX_LINE_BYTES) + tail), -32600, None)


def test_errors_and_answers_never_share_a_line(wire: Wire) -> None:
    """Errors (written by the reader) and the SDK's answers (by its writer) go through one lock."""
    lines = []
    for i in range(200):
        lines += [b"not json", b'{"jsonrpc":"2.0","id":%d,"method":"ping"}' % (10_000 + i), b"[]"]
    seen = wire.answers_to(*lines)
    assert len(seen) == 600, len(seen)
    answered = sorted(m["id"] for m in seen if "result" in m)
    assert answered == list(range(10_000, 10_200))
    assert sorted(m["error"]["code"] for m in seen if "error" in m) == [-32700] * 200 + [-32600] * 200
