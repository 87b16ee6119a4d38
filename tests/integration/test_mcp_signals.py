"""``lowlevel mcp`` ended by a signal stops gracefully: the runs in flight killed, every session
closed with its work committed, no run cgroup left, exit 128+N with one line. And the other ends
of a call: a cancelled call kills its run, a client that closes stdin or stops reading stdout
ends the calls in flight (no traceback), and ``max_concurrent_runs`` bounds a flood of calls
while the transport still answers.

A fresh-user trial found that ``lowlevel mcp`` installed no handler: SIGTERM or SIGHUP (the MCP
SDK's own client sends SIGTERM 2 s after closing the server's stdin) killed the process at once,
so a session's finished work (a file its command wrote, shown by ``list_files``) was lost
uncommitted and the run cgroups stayed; SIGINT left the server blocked on stdin after printing a
message about a sandbox that was not running. The server here is a real ``python -m lowlevel
mcp`` over pipes; a run in flight is a ``sleep`` with a marker, looked for in /proc.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from helpers.identities import tmpdir_fixture  # noqa: E402
from helpers.procs import cmdlines, pids_with  # noqa: E402

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]

base = tmpdir_fixture("lowlevel-mcp-signals-")


class Server:
    """``python -m lowlevel mcp`` over pipes, initialized; stderr to a file."""

    def __init__(self, base: Path, *extra: str, base_flag: bool = True) -> None:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]),
               "LOWLEVEL_CGROUP_ROOTS": ""}
        self.log = base / "stderr.txt"
        with open(self.log, "wb") as err:
            flag = ["--workspace-base", str(base / "ws")] if base_flag else []
            self.proc = subprocess.Popen([sys.executable, "-m", "lowlevel", "mcp", *flag, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=env, cwd=base)
        self.next_id = 0
        self.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                    "clientInfo": {"name": "test_mcp_signals", "version": "0"}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def finish(self) -> None:
        """Kill the server if it still runs, reap it, close our pipe ends."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.close_pipes()

    def close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def request(self, method: str, params: dict[str, Any], wait: bool = True) -> dict[str, Any] | None:
        self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        if not wait:
            return None
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            assert line, f"the server closed stdout: {self.log.read_text()}"
            answer = json.loads(line)
            if answer.get("id") == self.next_id:
                return answer

    def call(self, tool: str, arguments: dict[str, Any], wait: bool = True) -> dict[str, Any] | None:
        answer = self.request("tools/call", {"name": tool, "arguments": arguments}, wait)
        if answer is not None:
            assert not answer["result"].get("isError"), answer
        return answer


def _run_cgroups(pid: int) -> list[str]:
    return [p for p in glob.glob("/sys/fs/cgroup/**/lowlevel/run-*", recursive=True)
            if os.path.basename(p).startswith(f"run-{pid}-")]


def _sleeps(marker: str) -> int:
    """How many sandboxed ``sleep MARKER`` programs run (not their anchors, whose command lines hold it too)."""
    return sum(1 for _pid, raw in cmdlines() if raw == b"sleep\0" + marker.encode() + b"\0")


def _wait(cond: Any, bound_s: float) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end and not cond():
        time.sleep(0.02)
    return bool(cond())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_commits_the_sessions_and_kills_the_runs_in_flight(base: Path, sig: signal.Signals) -> None:
    server = Server(base)
    marker = f"9{os.getpid()}{time.time_ns() % 10**8}"
    try:
        server.call("run_in_session", {"session": "w", "command": ["sh", "-c", "echo important > result.txt"]})
        server.call("run", {"command": ["sleep", marker], "timeout_s": 120}, wait=False)
        assert _wait(lambda: bool(pids_with(marker, whole_arg=True)), 60), "the run never started"
        t0 = time.monotonic()
        server.proc.send_signal(sig)
        server.proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        server.finish()
    err = server.log.read_text()
    assert server.proc.returncode == 128 + sig, err
    assert f"lowlevel mcp: {sig.name}: stopped" in err and "Traceback" not in err, err
    assert took < 30, f"the server took {took:.1f} s to stop"
    assert (base / "ws" / "w" / "result.txt").read_text() == "important\n", "the session's work was lost"
    assert _wait(lambda: not pids_with(marker, whole_arg=True), 10), "the run in flight outlived the server"
    assert _wait(lambda: not _run_cgroups(server.proc.pid), 5), _run_cgroups(server.proc.pid)


def test_control_sigkill_loses_the_uncommitted_session_work(base: Path) -> None:
    """The control: with no chance to handle it (SIGKILL), the session's work is not committed."""
    server = Server(base)
    try:
        server.call("run_in_session", {"session": "w", "command": ["sh", "-c", "echo important > result.txt"]})
        server.proc.kill()
        server.proc.wait(timeout=30)
    finally:
        server.finish()
    assert not (base / "ws" / "w" / "result.txt").exists()


def test_an_idle_server_stops_at_once_on_sigint(base: Path) -> None:
    """SIGINT on a server waiting for its client's next line: it used to print "the sandbox was
    killed" and wait on stdin until the client closed it."""
    server = Server(base)
    try:
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(timeout=30)
    finally:
        server.finish()
    err = server.log.read_text()
    assert server.proc.returncode == 130 and "SIGINT: stopped" in err and "sandbox was killed" not in err, err


def _sleep_call(server: Server, marker: str) -> int:
    server.call("run", {"command": ["sleep", marker], "timeout_s": 120}, wait=False)
    return server.next_id


def test_a_cancelled_call_kills_its_run(base: Path) -> None:
    """``notifications/cancelled`` left the sandbox running to its timeout. Control: the server
    goes on serving (a later call runs)."""
    server = Server(base)
    marker = f"8{os.getpid()}{time.time_ns() % 10**8}"
    try:
        rid = _sleep_call(server, marker)
        assert _wait(lambda: bool(pids_with(marker, whole_arg=True)), 60), "the run never started"
        server.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": rid}})
        assert _wait(lambda: not pids_with(marker, whole_arg=True), 15), "the cancelled run kept running"
        answer = server.call("run", {"command": ["echo", "next"]})
        assert answer is not None and "next" in json.dumps(answer)
    finally:
        server.finish()


def test_a_cancelled_session_call_kills_its_command_and_the_session_goes_on(base: Path) -> None:
    """A cancelled ``run_in_session`` left its command running to its timeout. Control: the
    session's next command runs, and what an earlier one wrote is still there."""
    server = Server(base)
    marker = f"5{os.getpid()}{time.time_ns() % 10**8}"
    try:
        server.call("run_in_session", {"session": "w", "command": ["sh", "-c", "echo before > f"]})
        server.call("run_in_session", {"session": "w", "command": ["sleep", marker], "timeout_s": 120}, wait=False)
        rid = server.next_id
        assert _wait(lambda: _sleeps(marker) == 1, 60), "the command never started"
        server.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": rid}})
        assert _wait(lambda: _sleeps(marker) == 0, 15), "the cancelled session command kept running"
        answer = server.call("run_in_session", {"session": "w", "command": ["cat", "f"]})
        assert answer is not None and "before" in json.dumps(answer)
    finally:
        server.finish()


@pytest.mark.parametrize("end", ["stdin", "stdout"])
def test_a_client_gone_ends_the_calls_in_flight(base: Path, end: str) -> None:
    """stdin closed: the server waited for the run in flight (up to max_timeout). stdout's reader
    gone (EPIPE): an ExceptionGroup traceback and exit 1. Now both kill the run and exit 0
    without a traceback; a session's work is committed as at any close."""
    server = Server(base)
    marker = f"7{os.getpid()}{time.time_ns() % 10**8}"
    try:
        server.call("run_in_session", {"session": "w", "command": ["sh", "-c", "echo kept > f"]})
        _sleep_call(server, marker)
        assert _wait(lambda: bool(pids_with(marker, whole_arg=True)), 60), "the run never started"
        if end == "stdin":
            assert server.proc.stdin is not None
            server.proc.stdin.close()
        else:
            assert server.proc.stdout is not None
            server.proc.stdout.close()
            server.call("run", {"command": ["true"]}, wait=False)  # its answer meets EPIPE
            server.call("run", {"command": ["true"]}, wait=False)
        server.proc.wait(timeout=60)
    finally:
        server.finish()
    err = server.log.read_text()
    assert server.proc.returncode == 0 and "Traceback" not in err, err
    assert _wait(lambda: not pids_with(marker, whole_arg=True), 10), "the run in flight outlived its client"
    assert (base / "ws" / "w" / "f").read_text() == "kept\n"


def test_max_concurrent_runs_bounds_a_flood_and_the_transport_still_answers(base: Path) -> None:
    """40 concurrent calls took every anyio worker thread, so the stdio reader and writer (which
    need one) starved: a ``ping`` waited 20 s. Now at most ``max_concurrent_runs`` calls run (the
    others wait), and a ping is answered while they do. The config file's relative
    ``workspace_base`` is taken from the file's directory, not the server's cwd."""
    config = base / "conf"
    config.mkdir()
    (config / "mcp.toml").write_text('max_concurrent_runs = 2\nworkspace_base = "rel-ws"\n')
    server = Server(base, "--config", str(config / "mcp.toml"), base_flag=False)
    marker = f"6{os.getpid()}{time.time_ns() % 10**8}"
    try:
        for _ in range(6):
            _sleep_call(server, marker)
        assert _wait(lambda: _sleeps(marker) == 2, 60), _sleeps(marker)
        time.sleep(1)
        assert _sleeps(marker) == 2, "more runs than max_concurrent_runs"
        t0 = time.monotonic()
        assert server.request("ping", {}) is not None
        assert time.monotonic() - t0 < 5
        assert (config / "rel-ws").is_dir() and not (base / "rel-ws").exists()
    finally:
        server.finish()
    assert _wait(lambda: not pids_with(marker, whole_arg=True), 15)


def test_failed_calls_do_not_fill_stderr(base: Path) -> None:
    """The SDK logged every failed call at INFO, several lines each, on stderr: a client that
    never drains stderr stopped the server after ~64 KiB (a fresh-user trial). Now only
    warnings reach stderr. Control: the calls did fail."""
    server = Server(base)
    try:
        for _ in range(5):
            answer = server.request("tools/call", {"name": "read_file", "arguments": {"workspace": "nope",
                                                                                       "path": "x"}})
            assert answer is not None and answer["result"]["isError"], answer
        assert server.proc.stdin is not None
        server.proc.stdin.close()
        server.proc.wait(timeout=30)
    finally:
        server.finish()
    assert server.proc.returncode == 0 and server.log.read_text() == "", server.log.read_text()


def test_a_close_session_commit_finishes_when_the_client_leaves_and_signals(base: Path) -> None:
    """The SDK client's exit (stdin closed, SIGTERM soon after) during a ``close_session`` whose
    commit takes a while: the server had let the call's thread go, the signal handlers were
    back at their defaults, and the SIGTERM killed it mid-commit (0 of 30,000 files applied as
    root, half as the user: a fresh-user trial). Now it waits for the commit, signals recorded,
    and exits 128+N with the workspace whole and no commit temporary left."""
    server = Server(base)
    try:
        server.call("run_in_session", {"session": "big", "timeout_s": 120, "command": [
            "sh", "-c", "mkdir d && cd d && i=0; while [ $i -lt 8000 ]; do echo $i > f$i; i=$((i+1)); done; "
            "echo last > ../zz-last"]})
        server.call("close_session", {"session": "big"}, wait=False)
        time.sleep(0.05)
        assert server.proc.stdin is not None
        server.proc.stdin.close()
        time.sleep(0.1)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=120)
    finally:
        server.finish()
    err = server.log.read_text()
    assert server.proc.returncode in (0, 128 + signal.SIGTERM) and "Traceback" not in err, (server.proc.returncode, err)
    ws = base / "ws" / "big"
    assert (ws / "zz-last").read_text() == "last\n"
    assert len(os.listdir(ws / "d")) == 8000
    assert not [n for n in os.listdir(ws) if n.startswith(".lowlevel-")], os.listdir(ws)


def test_requests_written_before_stdin_closes_are_all_answered(base: Path) -> None:
    """``printf '...' | lowlevel mcp``: the requests before the end of stdin got no answers once
    it ended (the server dropped its answers as soon as stdin ended: a fresh-user trial). A
    client that closes stdin may still read stdout: every answer is written."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    lines = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "pipe", "version": "0"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "write_file", "arguments": {"workspace": "p", "path": "f", "content": "x"}}},
        {"jsonrpc": "2.0", "id": 3, "method": "ping"},
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    out = subprocess.run([sys.executable, "-m", "lowlevel", "mcp", "--workspace-base", str(base / "ws")], input=data,
                         capture_output=True, env=env, cwd=base, timeout=120)
    ids = sorted(json.loads(line)["id"] for line in out.stdout.splitlines() if line.strip())
    assert out.returncode == 0 and ids == [1, 2, 3], (ids, out.stderr[-2000:])
    assert (base / "ws" / "p" / "f").read_text() == "x"


def test_calls_queued_behind_max_concurrent_runs_at_stdin_end_are_all_answered(base: Path) -> None:
    """A client that writes 1,000 run calls (``max_concurrent_runs = 1``: one runs, the others
    wait for the limiter) and a ping, then closes stdin, gets an answer to every one: the server
    keeps its read stream open until each request read has been answered. It closed after a
    fixed 0.5 s grace before, and the SDK dropped the handlers still waiting: 776 of 1,003 ids
    went unanswered (a fresh-user trial's "left" item, reproduced)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), "LOWLEVEL_CGROUP_ROOTS": ""}
    config = base / "c.toml"
    config.write_text(f'workspace_base = "{base / "ws"}"\nmax_concurrent_runs = 1\n')
    n = 1000
    lines: list[dict[str, Any]] = [
        {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "pipe", "version": "0"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "run", "arguments": {"command": ["sleep", "60"]}}},
        *({"jsonrpc": "2.0", "id": 2 + i, "method": "tools/call", "params": {
            "name": "run", "arguments": {"command": ["true"]}}} for i in range(n)),
        {"jsonrpc": "2.0", "id": "c", "method": "tools/call", "params": {
            "name": "run", "arguments": {"command": ["sleep", "60"]}}},
        {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "c"}},
        {"jsonrpc": "2.0", "id": 2 + n, "method": "ping"},
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "lowlevel", "mcp", "--config", str(config)], input=data,
                         capture_output=True, env=env, cwd=base, timeout=150)
    took = time.monotonic() - started
    ids = [json.loads(line)["id"] for line in out.stdout.splitlines() if line.strip()]
    missing = sorted(set(range(n + 3)) - set(ids))
    assert out.returncode == 0 and not missing, (len(missing), missing[:10], out.stderr[-2000:])
    assert "c" not in ids  # a cancelled request is never answered (MCP "Cancellation"), and not waited for
    assert took < 60, took  # the sleeps were killed, not waited out
