#!/usr/bin/env python3
"""What does the sandbox cost per call?

Measures, in one process and interleaved (each round runs every case once, in a rotated
order, so machine drift hits all cases alike), for ``/usr/bin/true`` and
``/usr/bin/python3 -c pass``:

- ``floor``: ``os.posix_spawn`` of the command + ``waitpid``, no sandbox;
- ``subprocess``: ``subprocess.run(cmd, capture_output=True)``, no sandbox;
- ``raw_bwrap``: the exact bwrap argv lowlevel builds for the default Policy (the
  ``_lowlevel_exec`` or ``setpriv`` prefix for root callers included), spawned with
  ``posix_spawn`` and the same sealed seccomp memfd and passwd/group memfds; no
  ``--json-status-fd``/``--block-fd`` handshake, no rlimits, no cgroup, no capture. Driven
  synchronously (concurrency 1) and from asyncio (pidfd readers) at each concurrency;
- ``run``: ``lowlevel.run`` with the default Policy (seccomp, rlimits, cgroup, handshake);
- ``run_egress``: ``lowlevel.run`` with ``Policy(network=Egress(allow=("bench.invalid",)))``: a
  fresh sandbox whose egress proxy (host listener, relay inside on 127.0.0.1:3128) is ready
  before the program starts;
- ``arun``: ``lowlevel.arun`` at each concurrency, bounded by a semaphore;
- ``session``: ``Session.run`` in one long-lived session (sync, concurrency 1) and
  ``AsyncSession.run`` at each concurrency: the cost of a command once the sandbox exists;
- ``image``, ``image_session``: ``lowlevel.run`` and ``Session.run`` of ``/usr/bin/true`` on an
  imported image holding the host's ``/usr/bin/true`` and its libraries (``Policy(image=...)``),
  imported once before the rounds (``one_time``: import, first and second run);
- ``pool``: ``Pool.run`` (a fresh pre-started sandbox per call; sync, concurrency 1, calls
  spaced so the pool is full and idle when each call starts: the untimed wait is the refill);
  ``floor_spaced``: ``floor`` with the same idle gap before each call (the median of the
  pool's waits), for ``ratios.pool_vs_floor_spaced``
  and ``Pool.arun`` at each concurrency (unspaced: sustained throughput, refill-bound).

``--soak N`` (default 10000, ``--quick`` 1000) also runs N sequential ``/usr/bin/true`` in one
session and records fds, processes and memory before and after (``session_soak``).

``egress_download`` (``--download-rounds``, 0 skips): a 1 MiB download (``curl -o /dev/null``)
from a server on host loopback, from inside one Session with the host network
(``--network=host``, ``curl http://127.0.0.1:PORT/``) and one with egress (the same URL through
the proxy, allowed by ``allow_cidrs=("127.0.0.1/32",)``: no resolver override), interleaved; the
difference of the p50s is what the proxy adds, and the proxy thread's and the relay's CPU per
call (``/proc/.../schedstat``) what it costs whatever the load. ``egress_cpu``: CPU per
``lowlevel.run`` (ours + reaped children), default Policy vs egress.

``cli`` (``--cli N``, default 100, ``--quick`` 5, 0 skips; after the rounds): whole processes,
rotated: ``lowlevel run --rm -- /usr/bin/true`` (the venv's console script), ``python -c pass``
and ``python -c 'import lowlevel.cli'`` (same interpreter), with ``ratios.cli_vs_python_startup``.
``host.loadavg_before``/``loadavg_after``: how busy the machine was.

Latency of a call runs from its start (for concurrent cases: from taking a slot) to its
end; ``calls_per_s`` is calls divided by the wall time the case's batches took.

Usage: ``python bench/startup.py [--quick] [--json FILE] [--cli N] [--profile]``; draw the JSON
with ``python bench/plot.py FILE.json``. Never asserts.
The JSON schema is documented in bench/README.md (``schema`` = 1).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_T_IMPORT = time.perf_counter_ns()
import lowlevel  # noqa: E402
from lowlevel.sandbox import argv as _argv# noqa: E402
from lowlevel.sandbox import drive as _drive  # noqa: E402
from lowlevel.sandbox import facts as _facts  # noqa: E402
from lowlevel.sandbox import launcher as _launcher  # noqa: E402
from lowlevel.sandbox import plan as _plan  # noqa: E402
from lowlevel.sandbox.request import RunRequest  # noqa: E402
from lowlevel.host import seccomp_filter as _seccomp_filter  # noqa: E402

IMPORT_MS = (time.perf_counter_ns() - _T_IMPORT) / 1e6

SCHEMA = 1
COMMANDS: dict[str, list[str]] = {
    "/usr/bin/true": ["/usr/bin/true"],
    "/usr/bin/python3 -c pass": ["/usr/bin/python3", "-c", "pass"],
}
CONCURRENCY = (1, 2, 8, 64)


# --- statistics -------------------------------------------------------------------------------

def percentile(sorted_ms: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100) of an ascending list."""
    if not sorted_ms:
        return float("nan")
    k = (len(sorted_ms) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (k - lo)


class Case:
    """One measured case: name, command, concurrency, driver; raw samples and wall time."""

    def __init__(self, name: str, command: str, concurrency: int, driver: str, fn: Any) -> None:
        self.name = name
        self.command = command
        self.concurrency = concurrency
        self.driver = driver
        self.fn = fn
        self.samples_ns: list[int] = []
        self.wall_ns = 0
        self.errors = 0
        self.skipped: str | None = None
        #: Untimed hooks: ``before`` runs before each call, ``settle`` after each round.
        self.before: Callable[[], None] | None = None
        self.settle: Callable[[], None] | None = None

    def summary(self) -> dict[str, Any]:
        ms = sorted(s / 1e6 for s in self.samples_ns)
        d: dict[str, Any] = {"name": self.name, "command": self.command, "concurrency": self.concurrency,
                             "driver": self.driver, "n": len(ms)}
        if self.skipped:
            d.update(skipped=True, reason=self.skipped, p50_ms=None, p90_ms=None, p99_ms=None,
                     mean_ms=None, calls_per_s=None, samples_ms=[])
            return d
        d.update(p50_ms=round(percentile(ms, 50), 4), p90_ms=round(percentile(ms, 90), 4),
                 p99_ms=round(percentile(ms, 99), 4), mean_ms=round(sum(ms) / len(ms), 4) if ms else None,
                 calls_per_s=round(len(ms) / (self.wall_ns / 1e9), 2) if self.wall_ns else None,
                 errors=self.errors, skipped=False,
                 samples_ms=[round(s / 1e6, 4) for s in self.samples_ns])
        return d


# --- the cases --------------------------------------------------------------------------------

_DEVNULL_W = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)


def _high(fd: int, low: int = 64) -> int:
    """Move ``fd`` to a number >= ``low`` (so no dup2 in the file actions clobbers a source)."""
    if fd >= low:
        return fd
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, low)
    os.close(fd)
    return new


def floor_call(cmd: list[str]) -> None:
    pid = os.posix_spawn(cmd[0], cmd, os.environ,
                         file_actions=[(os.POSIX_SPAWN_DUP2, _DEVNULL_W, 1), (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 2)])
    os.waitpid(pid, 0)


def subprocess_call(cmd: list[str]) -> None:
    subprocess.run(cmd, capture_output=True, check=False)


class RawBwrap:
    """bwrap with lowlevel's exact bwrap options for the default Policy, minus the anchor's work.

    The options come from :meth:`lowlevel.sandbox.launcher.Run.prepare` (its ``argv``: what it writes to
    the ``--args`` memfd) with ``--json-status-fd`` dropped and the copy-on-write workspace
    replaced by a plain directory bound as it is. A root caller's bwrap still drops to an
    unprivileged uid, through the anchor with nothing else to do (``--uid``/``--gid`` only:
    no cgroup, no rlimits, no overlay; it still forks bwrap as PID 1 of a PID namespace). Each
    call makes the same three memfds lowlevel makes (sealed seccomp BPF, /etc/passwd,
    /etc/group) and dup2s them onto the same numbers.
    """

    def __init__(self, cmd: list[str]) -> None:
        policy = lowlevel.Policy()
        r = _launcher.Run(RunRequest(cmd), policy=policy)
        try:
            r.prepare()
            options = list(r.argv)
            self.workspace = r.workspace
            ids = r.host_ids
            facts = r.facts
        finally:
            r.close()
        if facts.caller_is_root:
            os.chown(self.workspace, *ids)
        i = options.index("--json-status-fd")
        del options[i:i + 2]
        i = next(j for j in range(len(options) - 2) if options[j] == "--bind" and options[j + 2] == "/workspace")
        options[i + 1] = self.workspace
        outer = [facts.bwrap.path, "--args", str(_plan.ARGS_FD), "--", *cmd]
        if facts.caller_is_root:
            fds = _plan.CHILD_FDS
            etc = "".join(f",{_argv.ETC_COPY_FD + i}" for i in range(len(_argv.etc_copies(policy, facts))))
            outer = [_facts._exec_helper(), f"--parent={os.getpid()}", f"--uid={ids[0]}", f"--gid={ids[1]}",
                     f"--pass-fds={_plan.ARGS_FD},{fds.seccomp},{fds.passwd},{fds.group}{etc}", "--", *outer]
        i = outer.index("--args")
        self.argv = [*outer[:i], *options, *outer[i + 2:]]
        self.bpf = _seccomp_filter.compile_bpf(policy.seccomp)
        self.passwd, self.group = _plan.passwd_group(*ids)
        self.fds = _plan.CHILD_FDS
        self.etc_copies = _argv.etc_copies(policy, facts)

    def spawn(self) -> int:
        """posix_spawn one raw bwrap; return its pid (the caller waits)."""
        sfd = _high(_seccomp_filter.bpf_memfd(self.bpf))
        pfd = _high(_plan.memfd("passwd", self.passwd))
        gfd = _high(_plan.memfd("group", self.group))
        efds = [_high(_plan.open_etc_copy(path)) for path in self.etc_copies]
        try:
            return os.posix_spawn(self.argv[0], self.argv, {}, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 1), (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 2),
                (os.POSIX_SPAWN_DUP2, sfd, self.fds.seccomp), (os.POSIX_SPAWN_DUP2, pfd, self.fds.passwd),
                (os.POSIX_SPAWN_DUP2, gfd, self.fds.group),
                *((os.POSIX_SPAWN_DUP2, fd, _argv.ETC_COPY_FD + i) for i, fd in enumerate(efds))])
        finally:
            for fd in (sfd, pfd, gfd, *efds):
                os.close(fd)

    def call(self) -> None:
        pid = self.spawn()
        _, status = os.waitpid(pid, 0)
        if status:
            raise RuntimeError(f"raw bwrap exited with status {status:#x}: {self.argv}")

    async def acall(self) -> None:
        await _await_pid(self.spawn(), "raw bwrap")

    def close(self) -> None:
        shutil.rmtree(self.workspace, ignore_errors=True)


class SeedBwrap:
    """The seed recipe: what a user hand-rolls from bwrap's README, with nothing of lowlevel.

    ``bwrap --ro-bind /usr /usr`` + the usr-merge symlinks, ``--proc /proc --dev /dev --tmpfs
    /tmp``, one ``--bind`` of a directory at ``/workspace`` (``--chdir`` there), ``--unshare-all
    --new-session --die-with-parent --clearenv --cap-drop ALL``: no seccomp, no limits, no
    cgroup, no uid drop (a root caller's bwrap runs as root), no capture (output to /dev/null).
    The yardstick of issue 16: the safety lowlevel adds should be nearly free against it.
    """

    def __init__(self, cmd: list[str]) -> None:
        import tempfile
        self.workspace = tempfile.mkdtemp(prefix="lowlevel-bench-seed-", dir="/tmp")
        layout = _facts.host_facts().layout
        base = ["--ro-bind", "/usr", "/usr"]
        for target, name in layout.symlinks:
            base += ["--symlink", target, name]
        for d in layout.ro_dirs:
            base += ["--ro-bind", d, d]
        self.argv = [_facts.host_facts().bwrap.path, *base, "--proc", "/proc", "--dev", "/dev",
                     "--tmpfs", "/tmp", "--bind", self.workspace, "/workspace", "--chdir", "/workspace",
                     "--unshare-all", "--new-session", "--die-with-parent", "--clearenv",
                     "--setenv", "PATH", "/usr/bin:/bin", "--cap-drop", "ALL", "--", *cmd]

    def spawn(self) -> int:
        return os.posix_spawn(self.argv[0], self.argv, {}, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 1), (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 2)])

    def call(self) -> None:
        _, status = os.waitpid(self.spawn(), 0)
        if status:
            raise RuntimeError(f"seed bwrap exited with status {status:#x}: {self.argv}")

    async def acall(self) -> None:
        await _await_pid(self.spawn(), "seed bwrap")

    def close(self) -> None:
        shutil.rmtree(self.workspace, ignore_errors=True)


async def _await_pid(pid: int, what: str) -> None:
    """Wait for ``pid`` from asyncio (a pidfd reader), reap it, raise on a non-zero status."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    fut = loop.create_future()
    loop.add_reader(pidfd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    if status:
        raise RuntimeError(f"{what} exited with status {status:#x}")


#: Fresh workspaces lowlevel kept (Result.workspace); removed between rounds, untimed.
_WORKSPACES: list[str] = []


def _sweep_workspaces() -> None:
    while _WORKSPACES:
        shutil.rmtree(_WORKSPACES.pop(), ignore_errors=True)


#: Sandbox CPU (the run cgroup's user+system seconds: bwrap's PID 1, the guard, the program)
#: per (case, command), in ms: what each case costs the machine, whatever the load.
_SANDBOX_CPU: dict[tuple[str, str], list[float]] = {}


def _note_cpu(case: str, cmd: list[str], r: Any) -> None:
    if r.cpu_user_s is not None and r.cpu_system_s is not None:
        _SANDBOX_CPU.setdefault((case, " ".join(cmd)), []).append((r.cpu_user_s + r.cpu_system_s) * 1e3)


EGRESS_POLICY = lowlevel.Policy(network=lowlevel.Egress(allow=("bench.invalid",)))


def run_egress_call(cmd: list[str]) -> None:
    r = lowlevel.run(cmd, policy=EGRESS_POLICY)
    _WORKSPACES.append(r.workspace)
    if r.exit_code != 0:
        raise RuntimeError(f"lowlevel.run (egress) exited {r.exit_code}: {r.stderr!r}")


def run_call(cmd: list[str]) -> None:
    r = lowlevel.run(cmd)
    _note_cpu("run", cmd, r)
    _WORKSPACES.append(r.workspace)
    if r.exit_code != 0:
        raise RuntimeError(f"lowlevel.run exited {r.exit_code}: {r.stderr!r}")


_NO_LANDLOCK = lowlevel.Policy(landlock=False)


def run_no_landlock_call(cmd: list[str]) -> None:
    """``lowlevel.run`` with ``Policy(landlock=False)``: the guard runs, without a ruleset."""
    r = lowlevel.run(cmd, policy=_NO_LANDLOCK)
    _note_cpu("run_no_landlock", cmd, r)
    _WORKSPACES.append(r.workspace)
    if r.exit_code != 0:
        raise RuntimeError(f"lowlevel.run exited {r.exit_code}: {r.stderr!r}")


def run_bare_call(cmd: list[str]) -> None:
    """``lowlevel.run`` without the guard (``Run(guard=False)``): bwrap execs the command, as
    before the guard existed (no Landlock, exit status decoded from bwrap's code)."""
    r = _launcher.Run(RunRequest(cmd), policy=lowlevel.Policy(), guard=False)
    try:
        res = _drive._drive_sync(r)
    finally:
        r.close()
    _note_cpu("run_bare", cmd, res)
    _WORKSPACES.append(res.workspace)
    if res.exit_code != 0:
        raise RuntimeError(f"bare run exited {res.exit_code}: {res.stderr!r}")


class GuardFloor:
    """``posix_spawn`` of the guard (``lowlevel/_lowlevel_guard``) with the default Policy's
    Landlock options around the command, + ``waitpid``; no sandbox. Minus ``floor``: what the
    guard adds to every fresh sandbox (its exec, the ruleset, the vfork and the report)."""

    def __init__(self, cmd: list[str]) -> None:
        from lowlevel.host import landlock
        from lowlevel.sandbox import landlock_rules
        facts = _facts.host_facts()
        ll = landlock_rules.ruleset_args(lowlevel.Policy(), facts.layout.ro_dirs)
        self.status_r, self.status_w = os.pipe()
        os.set_blocking(self.status_r, False)
        self.status_w = _high(self.status_w, 32)
        self.argv = [landlock.GUARD_PATH, f"--status={self.status_w}", *ll, "--", *cmd]

    def call(self) -> None:
        pid = os.posix_spawn(self.argv[0], self.argv, os.environ, file_actions=[
            (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 1), (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 2),
            (os.POSIX_SPAWN_DUP2, self.status_w, self.status_w)])
        _, status = os.waitpid(pid, 0)
        try:
            os.read(self.status_r, 4096)
        except BlockingIOError:
            pass
        if status:
            raise RuntimeError(f"guard exited with status {status:#x}")

    def close(self) -> None:
        os.close(self.status_r)
        os.close(self.status_w)


async def arun_call(cmd: list[str]) -> None:
    r = await lowlevel.arun(cmd)
    _WORKSPACES.append(r.workspace)
    if r.exit_code != 0:
        raise RuntimeError(f"lowlevel.arun exited {r.exit_code}: {r.stderr!r}")


# --- driving ----------------------------------------------------------------------------------

def sync_round(case: Case, calls: int) -> None:
    fn: Callable[[], None] = case.fn
    t_wall = time.perf_counter_ns()
    for _ in range(calls):
        if case.before is not None:
            case.before()
        t = time.perf_counter_ns()
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - counted and reported, never fatal
            case.errors += 1
            print(f"  {case.name} {case.command}: {err}", file=sys.stderr)
            continue
        case.samples_ns.append(time.perf_counter_ns() - t)
    case.wall_ns += time.perf_counter_ns() - t_wall
    _sweep_workspaces()
    if case.settle is not None:
        case.settle()


async def async_round(case: Case, calls: int) -> None:
    sem = asyncio.Semaphore(case.concurrency)

    async def one() -> None:
        async with sem:
            t = time.perf_counter_ns()
            try:
                await case.fn()
            except Exception as err:  # noqa: BLE001
                case.errors += 1
                print(f"  {case.name} {case.command}: {err}", file=sys.stderr)
                return
            case.samples_ns.append(time.perf_counter_ns() - t)

    t_wall = time.perf_counter_ns()
    await asyncio.gather(*(one() for _ in range(calls)))
    case.wall_ns += time.perf_counter_ns() - t_wall
    _sweep_workspaces()
    if case.settle is not None:
        case.settle()


# --- egress download ----------------------------------------------------------------------------

_SERVER = """
import http.server, sys
body = b"x" * int(sys.argv[1])
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def egress_download(rounds: int, per_round: int, size: int = 1 << 20) -> dict[str, Any]:
    """1 MiB from a host-loopback server: host network vs egress proxy, in two Sessions, interleaved.

    The server is another process (as a real upstream is), so it does not share this
    process's GIL with the proxy thread.
    """
    import tempfile

    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(size)], stdout=subprocess.PIPE)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    url = f"http://127.0.0.1:{port}/1m"
    cmd = ["curl", "-sS", "--fail", "-o", "/dev/null", url]
    no_bypass = {"NO_PROXY": "", "no_proxy": ""}  # send the loopback URL through the proxy
    policies = {"host": lowlevel.Policy(network=True),
                "egress": lowlevel.Policy(network=lowlevel.Egress(allow_cidrs=("127.0.0.1/32",),
                                                                   allow_ports=(port,)))}
    samples: dict[str, list[float]] = {k: [] for k in policies}
    sessions = {}
    dirs = []
    try:
        for name, policy in policies.items():
            d = tempfile.mkdtemp(prefix="bench-dl-", dir="/tmp")
            os.chmod(d, 0o755)
            dirs.append(d)
            sessions[name] = lowlevel.Session(policy, workspace=d)
        for s in sessions.values():  # warm-up
            for _ in range(3):
                s.run(cmd, env=no_bypass).check()
        # CPU the proxy path adds per download (load-independent, unlike latency): the proxy
        # thread's and the relay's run time from /proc/.../schedstat (ns), over the egress calls.
        from lowlevel.net.loop import running as _proxy_thread
        proxy_thread = _proxy_thread()
        assert proxy_thread is not None
        cpu_files = [f"/proc/self/task/{proxy_thread.thread.native_id}/schedstat"]
        init_pid = sessions["egress"]._core.init_host_pid
        with open(f"/proc/{init_pid}/stat") as f:
            cpu_files.append(f"/proc/{int(f.read().rsplit(')', 1)[1].split()[1])}/schedstat")  # the relay
        cpu_ns = [0, 0]
        for rnd in range(rounds):
            order = list(sessions.items())
            if rnd % 2:
                order.reverse()
            for name, s in order:
                before = [_schedstat(f) for f in cpu_files] if name == "egress" else []
                for _ in range(per_round):
                    t = time.perf_counter_ns()
                    r = s.run(cmd, env=no_bypass)
                    dt = (time.perf_counter_ns() - t) / 1e6
                    if r.exit_code == 0:
                        samples[name].append(dt)
                    else:
                        print(f"  egress_download {name}: curl exited {r.exit_code}: {r.stderr!r}", file=sys.stderr)
                for i, b in enumerate(before):
                    cpu_ns[i] += _schedstat(cpu_files[i]) - b
    finally:
        for s in sessions.values():
            s.close()
        server.kill()
        server.wait()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    out: dict[str, Any] = {"bytes": size, "command": " ".join(cmd)}
    for name, vals in samples.items():
        vals.sort()
        out[f"{name}_n"] = len(vals)
        out[f"{name}_p50_ms"] = round(percentile(vals, 50), 3)
        out[f"{name}_p90_ms"] = round(percentile(vals, 90), 3)
    out["added_p50_ms"] = round(out["egress_p50_ms"] - out["host_p50_ms"], 3)
    n = max(1, out["egress_n"])
    out["proxy_cpu_ms_per_call"] = round(cpu_ns[0] / n / 1e6, 3)
    out["relay_cpu_ms_per_call"] = round(cpu_ns[1] / n / 1e6, 3)
    return out


def _schedstat(path: str) -> int:
    """Run time of a task so far (ns), the first field of /proc/.../schedstat."""
    with open(path) as f:
        return int(f.read().split()[0])


def egress_cpu(calls: int) -> dict[str, Any]:
    """CPU per ``lowlevel.run(["/usr/bin/true"])`` (ours + reaped children, ms), default Policy vs
    egress, interleaved: what the egress path costs independently of the host's load."""
    import resource

    def cpu() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    policies = {"run": lowlevel.Policy(), "run_egress": EGRESS_POLICY}
    per: dict[str, list[float]] = {k: [] for k in policies}
    for i in range(calls):
        for name in (list(policies) if i % 2 else list(policies)[::-1]):
            c0 = cpu()
            r = lowlevel.run(["/usr/bin/true"], policy=policies[name])
            per[name].append((cpu() - c0) * 1000)
            _WORKSPACES.append(r.workspace)
        if i % 50 == 49:
            _sweep_workspaces()
    _sweep_workspaces()
    out: dict[str, Any] = {"calls": calls}
    for name, vals in per.items():
        out[f"{name}_cpu_ms_mean"] = round(sum(vals) / len(vals), 3)
    out["run_egress_vs_run_cpu"] = round(out["run_egress_cpu_ms_mean"] / out["run_cpu_ms_mean"], 3)
    return out


# --- session and pool -----------------------------------------------------------------------

class SessionCases:
    """One sync Session, one AsyncSession and one Pool per pool size, shared by the rounds."""

    def __init__(self) -> None:
        from lowlevel import session as _session
        self.mod = _session
        self.session = _session.Session()
        self.session_no_landlock = _session.Session(_NO_LANDLOCK)
        self.asession = _session.AsyncSession()
        self.pools: dict[int, Any] = {}

    def pool(self, size: int) -> Any:
        if size not in self.pools:
            self.pools[size] = self.mod.Pool(size=size)
            self.wait_full(self.pools[size])
        return self.pools[size]

    @staticmethod
    def wait_full(pool: Any, timeout_s: float = 30.0) -> None:
        """Untimed: until every sandbox is started and every used one torn down."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with pool._cond:
                if len(pool._ready) >= pool.size and not pool._retired and not pool._starting \
                        and not getattr(pool, "_retiring", 0):
                    return
            time.sleep(0.0005)

    def session_call(self, cmd: list[str]) -> None:
        r = self.session.run(cmd)
        if r.exit_code != 0:
            raise RuntimeError(f"Session.run exited {r.exit_code}: {r.stderr!r}")

    def session_no_landlock_call(self, cmd: list[str]) -> None:
        r = self.session_no_landlock.run(cmd)
        if r.exit_code != 0:
            raise RuntimeError(f"Session.run exited {r.exit_code}: {r.stderr!r}")

    async def asession_call(self, cmd: list[str]) -> None:
        r = await self.asession.run(cmd)
        if r.exit_code != 0:
            raise RuntimeError(f"AsyncSession.run exited {r.exit_code}: {r.stderr!r}")

    def pool_call(self, size: int, cmd: list[str]) -> None:
        r = self.pool(size).run(cmd)
        _WORKSPACES.append(r.workspace)
        if r.exit_code != 0:
            raise RuntimeError(f"Pool.run exited {r.exit_code}: {r.stderr!r}")

    async def apool_call(self, size: int, cmd: list[str]) -> None:
        r = await self.pool(size).arun(cmd)
        _WORKSPACES.append(r.workspace)
        if r.exit_code != 0:
            raise RuntimeError(f"Pool.arun exited {r.exit_code}: {r.stderr!r}")

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        for pool in self.pools.values():
            pool.close()
        self.session.close()
        self.session_no_landlock.close()
        if self.asession.alive:
            loop.run_until_complete(self.asession.close())


# --- images ---------------------------------------------------------------------------------

def _true_tree(dest: str) -> None:
    """The host's /usr/bin/true with its loader and libraries, laid out as on the host (usr-merged
    symlinks kept), plus /etc/passwd, /etc/group and /etc/ld.so.cache: the same program as ``run``."""
    out = subprocess.run(["ldd", "/usr/bin/true"], capture_output=True, text=True, check=True).stdout
    paths = ["/usr/bin/true", "/etc/ld.so.cache"]
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            paths.append(path)
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), os.path.join(dest, name))
    for path in paths:
        # Where the path lands once the tree's top-level symlinks are followed, and its real file.
        top, _, rest = path.lstrip("/").partition("/")
        first = os.path.join(dest, os.readlink("/" + top) if os.path.islink("/" + top) else top, rest)
        for target in {first, os.path.join(dest, os.path.realpath(path).lstrip("/"))}:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.exists(target):
                shutil.copy2(os.path.realpath(path), target)
    for name, text in (("passwd", "root:x:0:0:root:/root:/usr/sbin/nologin\n"), ("group", "root:x:0:\n")):
        with open(os.path.join(dest, "etc", name), "w") as f:
            f.write(text)


def _oci_layout(tree: str, dest: str) -> None:
    """Write an OCI image layout at ``dest`` with ``tree`` as its one (gzip) layer."""
    import gzip
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(os.listdir(tree)):
            tar.add(os.path.join(tree, name), arcname=name)
    layer = buf.getvalue()
    os.makedirs(os.path.join(dest, "blobs", "sha256"))

    def put(data: bytes) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(dest, "blobs", "sha256", digest), "wb") as f:
            f.write(data)
        return {"digest": "sha256:" + digest, "size": len(data)}

    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/bin:/bin"]},
                         "rootfs": {"type": "layers",
                                    "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                       **put(gzip.compress(layer, compresslevel=1))}]}).encode()
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                "annotations": {"org.opencontainers.image.ref.name": "bench:1"},
                                                **put(manifest)}]}
    with open(os.path.join(dest, "index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(dest, "oci-layout"), "w") as f:
        f.write('{"imageLayoutVersion": "1.0.0"}')


class ImageCases:
    """``image`` and ``image_session``: the same ``/usr/bin/true`` on an imported image.

    The image (host's true + libraries, see :func:`_true_tree`) is imported into a temp store
    before the rounds; ``one_time`` gets the import time and the first and second
    ``lowlevel.run`` on it (the first after a fresh import must cost no unpacking).
    """

    COMMAND = "/usr/bin/true"

    def __init__(self) -> None:
        from lowlevel import image as _image
        self.skipped: str | None = None
        self.dir = ""
        self.session: Any = None
        self.times: dict[str, float] = {}
        missing = [t for t in ("skopeo", "umoci") if _image.find_tool(t) is None]
        if missing:
            self.skipped = f"needs {' and '.join(missing)} (apt-get install {' '.join(missing)})"
            return
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="lowlevel-bench-image-", dir="/tmp")
        os.chmod(self.dir, 0o755)
        tree = os.path.join(self.dir, "tree")
        os.makedirs(os.path.join(tree, "etc"))
        _true_tree(tree)
        _oci_layout(tree, os.path.join(self.dir, "layout"))
        subprocess.run(["chmod", "-R", "o+rX", self.dir], check=True)
        store = os.path.join(self.dir, "store")
        os.mkdir(store, 0o755)
        os.environ[_image.STORE_ENV] = store
        t = time.perf_counter_ns()
        _image.ImageStore(store).import_archive(os.path.join(self.dir, "layout"), name="bench-true:1")
        self.times["image_import_ms"] = (time.perf_counter_ns() - t) / 1e6
        t = time.perf_counter_ns()
        self.policy = lowlevel.Policy(image="bench-true:1")
        self.times["image_policy_ms"] = (time.perf_counter_ns() - t) / 1e6
        for key in ("image_first_run_ms", "image_second_run_ms"):
            t = time.perf_counter_ns()
            self.call()
            self.times[key] = (time.perf_counter_ns() - t) / 1e6
        _sweep_workspaces()
        self.session = lowlevel.Session(policy=self.policy)

    def call(self) -> None:
        r = lowlevel.run([self.COMMAND], policy=self.policy)
        _WORKSPACES.append(r.workspace)
        if r.exit_code != 0:
            raise RuntimeError(f"lowlevel.run on the image exited {r.exit_code}: {r.stderr!r}")

    def session_call(self) -> None:
        r = self.session.run([self.COMMAND])
        if r.exit_code != 0:
            raise RuntimeError(f"Session.run on the image exited {r.exit_code}: {r.stderr!r}")

    def cases(self) -> list[Case]:
        out = [Case("image", self.COMMAND, 1, "sync", self.call),
               Case("image_session", self.COMMAND, 1, "sync", self.session_call)]
        for c in out:
            c.skipped = self.skipped
        return out

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def session_soak(n: int) -> dict[str, Any]:
    """N sequential ``/usr/bin/true`` in one session: fds, processes and memory before/after."""
    from lowlevel import session as _session

    def rss_kib(pid: int) -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))

    with _session.Session() as s:
        for _ in range(100):
            s.run(["/usr/bin/true"])
        init = s._core.init_host_pid

        def state() -> dict[str, int]:
            procs = len(s.run(["/usr/bin/ps", "-e", "--no-headers"]).stdout.splitlines()) - 1
            return {"fds": len(os.listdir("/proc/self/fd")), "host_rss_kib": rss_kib(os.getpid()),
                    "init_rss_kib": rss_kib(init) if init else -1, "sandbox_procs": procs}

        before = state()
        t = time.perf_counter_ns()
        errors = 0
        for _ in range(n):
            if s.run(["/usr/bin/true"]).exit_code != 0:
                errors += 1
        secs = (time.perf_counter_ns() - t) / 1e9
        after = state()
    return {"n": n, "seconds": round(secs, 3), "calls_per_s": round(n / secs, 1), "errors": errors,
            "before": before, "after": after}


def guard_cpu(n: int) -> dict[str, Any]:
    """CPU (ms, ``os.wait4`` rusage of the process and what it waited for) of ``/usr/bin/true``
    alone and behind the guard with and without the default Landlock rules, ``n`` interleaved
    calls each, no sandbox: the guard's own cost, independent of the machine's load."""
    from lowlevel.host import landlock
    from lowlevel.sandbox import landlock_rules
    ll = landlock_rules.ruleset_args(lowlevel.Policy(), _facts.host_facts().layout.ro_dirs)
    cases = {"floor": ["/usr/bin/true"], "guard": [landlock.GUARD_PATH, "--ll=off", "--", "/usr/bin/true"],
             "guard_landlock": [landlock.GUARD_PATH, *ll, "--", "/usr/bin/true"]}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(n):
        for name, argv in cases.items():
            quiet = [(os.POSIX_SPAWN_DUP2, _DEVNULL_W, 1), (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 2)]
            pid = os.posix_spawn(argv[0], argv, {"PATH": "/usr/bin:/bin"}, file_actions=quiet)
            _, _status, ru = os.wait4(pid, 0)
            cpu[name].append((ru.ru_utime + ru.ru_stime) * 1e3)
    out: dict[str, Any] = {f"{k}_cpu_ms": round(sum(v) / len(v), 4) for k, v in cpu.items()}
    out["guard_minus_floor_cpu_ms"] = round(out["guard_landlock_cpu_ms"] - out["floor_cpu_ms"], 4)
    out["landlock_cpu_ms"] = round(out["guard_landlock_cpu_ms"] - out["guard_cpu_ms"], 4)
    out["n"] = n
    return out


def cli_startup(n: int) -> dict[str, Any]:
    """The whole ``lowlevel`` process, paired with the interpreter's own start (issue 16).

    Alternates ``lowlevel run --rm -- /usr/bin/true`` (the console script next to this
    interpreter, else ``python -m lowlevel``), ``python -c pass`` (the same interpreter,
    so both pay its ``site`` start-up, an editable install's import hook included) and
    ``python -c 'import lowlevel.cli'`` (``cli_import``: start-up plus the CLI's imports; the
    rest of ``cli`` is the command's own work), ``n`` rounds (order rotated) after 3 warm-up
    rounds that let Python write its bytecode caches. Wall time from
    ``posix_spawn`` to ``waitpid``, and CPU (``os.wait4`` rusage: the process and every child
    it waited for: the anchor, bwrap, the program).
    """
    exe = os.path.join(os.path.dirname(sys.executable), "lowlevel")
    cli = [exe] if os.access(exe, os.X_OK) else [sys.executable, "-m", "lowlevel"]
    cases = {"cli": [*cli, "run", "--rm", "--", "/usr/bin/true"], "python_startup": [sys.executable, "-c", "pass"],
             "cli_import": [sys.executable, "-c", "import lowlevel.cli"]}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    errors = 0
    for i in range(n + 3):
        names = list(cases)
        for name in names[i % len(names):] + names[:i % len(names)]:
            argv = cases[name]
            t = time.perf_counter_ns()
            pid = os.posix_spawn(argv[0], argv, env, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 1), (os.POSIX_SPAWN_DUP2, _DEVNULL_W, 2)])
            _, status, ru = os.wait4(pid, 0)
            dt = (time.perf_counter_ns() - t) / 1e6
            if status:
                errors += 1
                continue
            if i >= 3:
                wall[name].append(dt)
                cpu[name].append((ru.ru_utime + ru.ru_stime) * 1e3)
    out: dict[str, Any] = {"command": " ".join(cases["cli"]), "n": len(wall["cli"]), "errors": errors}
    for name in cases:
        w = sorted(wall[name])
        out[f"{name}_p50_ms"] = round(percentile(w, 50), 3)
        out[f"{name}_p90_ms"] = round(percentile(w, 90), 3)
        out[f"{name}_cpu_ms_mean"] = round(sum(cpu[name]) / max(1, len(cpu[name])), 3)
        out[f"{name}_samples_ms"] = [round(x, 3) for x in wall[name]]
    out["cli_vs_python_startup"] = round(out["cli_p50_ms"] / out["python_startup_p50_ms"], 3) \
        if out["python_startup_p50_ms"] else None
    return out


def one_time_costs() -> dict[str, Any]:
    """First call of the process (probes, seccomp compile, imports), then each part alone."""
    out: dict[str, Any] = {"import_lowlevel_ms": round(IMPORT_MS, 3)}
    compiles0 = len(_seccomp_filter._cache)
    t = time.perf_counter_ns()
    r = lowlevel.run(["/usr/bin/true"])
    out["first_run_ms"] = round((time.perf_counter_ns() - t) / 1e6, 3)
    _WORKSPACES.append(r.workspace)
    out["seccomp_compiles_first_run"] = len(_seccomp_filter._cache) - compiles0
    t = time.perf_counter_ns()
    r = lowlevel.run(["/usr/bin/true"])
    out["second_run_ms"] = round((time.perf_counter_ns() - t) / 1e6, 3)
    _WORKSPACES.append(r.workspace)
    _sweep_workspaces()
    # A profile not compiled yet: what one compile costs (once per profile per process).
    profile = lowlevel.DEFAULT_PROFILE.with_extra_deny("acct")
    t = time.perf_counter_ns()
    _seccomp_filter.compile_bpf(profile)
    out["seccomp_compile_ms"] = round((time.perf_counter_ns() - t) / 1e6, 3)
    t = time.perf_counter_ns()
    _seccomp_filter.compile_bpf(profile)
    out["seccomp_cached_lookup_ms"] = round((time.perf_counter_ns() - t) / 1e6, 4)
    _facts.host_facts.cache_clear()
    _facts.bwrap_info.cache_clear()
    t = time.perf_counter_ns()
    _facts.host_facts()
    out["host_probe_ms"] = round((time.perf_counter_ns() - t) / 1e6, 3)
    t = time.perf_counter_ns()
    importlib.import_module("lowlevel.sandbox.aio")  # asyncio itself is already imported by this script
    out["import_aio_ms"] = round((time.perf_counter_ns() - t) / 1e6, 3)
    return out


def host_info() -> dict[str, Any]:
    facts = _facts.host_facts()
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    cg = None
    try:
        cg = lowlevel.host.cgroup_detect.detect_cgroups().version
    except Exception:  # noqa: BLE001
        pass
    commit = ""
    try:
        commit = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short",
                                 "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        pass
    return {"kernel": platform.release(), "bwrap": ".".join(map(str, facts.bwrap.version)),
            "python": platform.python_version(), "cpus": os.cpu_count(), "cpu_model": model,
            "machine": platform.machine(), "caller_is_root": facts.caller_is_root,
            "cap_sys_resource": facts.cap_sys_resource, "cgroup": cg, "lowlevel": lowlevel.__version__,
            "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _p50(r: dict[str, Any] | None) -> float | None:
    return r["p50_ms"] if r else None


def ratios(results: list[dict[str, Any]], command: str) -> dict[str, float | None]:
    def get(name: str, conc: int, driver: str) -> dict[str, Any] | None:
        return next((r for r in results if r["name"] == name and r["command"] == command
                     and r["concurrency"] == conc and r["driver"] == driver and not r["skipped"]), None)

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    floor, sub, raw, run = (get("floor", 1, "sync"), get("subprocess", 1, "sync"), get("raw_bwrap", 1, "sync"),
                            get("run", 1, "sync"))
    p50 = {k: (v["p50_ms"] if v else None) for k, v in
           {"floor": floor, "subprocess": sub, "raw": raw, "run": run, "arun": get("arun", 1, "asyncio")}.items()}
    out = {"run_vs_raw_bwrap": div(p50["run"], p50["raw"]),
           "raw_bwrap_vs_floor": div(p50["raw"], p50["floor"]),
           "run_vs_floor": div(p50["run"], p50["floor"]),
           "subprocess_vs_floor": div(p50["subprocess"], p50["floor"]),
           "arun_vs_run": div(p50["arun"], p50["run"]),
           "run_vs_session": div(p50["run"], _p50(get("session", 1, "sync"))),
           "run_vs_pool": div(p50["run"], _p50(get("pool", 1, "sync"))),
           "session_vs_floor": div(_p50(get("session", 1, "sync")), p50["floor"]),
           "pool_vs_floor": div(_p50(get("pool", 1, "sync")), p50["floor"]),
           "pool_vs_floor_spaced": div(_p50(get("pool", 1, "sync")), _p50(get("floor_spaced", 1, "sync"))),
           "run_vs_session_c8": div(_p50(get("arun", 8, "asyncio")), _p50(get("session", 8, "asyncio"))),
           "run_vs_pool_c8": div(_p50(get("arun", 8, "asyncio")), _p50(get("pool", 8, "asyncio"))),
           "run_p99_vs_p50": div(run["p99_ms"] if run else None, p50["run"]),
           "run_egress_vs_run": div(_p50(get("run_egress", 1, "sync")), p50["run"]),
           "image_vs_run": div(_p50(get("image", 1, "sync")), p50["run"]),
           "image_session_vs_session": div(_p50(get("image_session", 1, "sync")), _p50(get("session", 1, "sync")))}
    # The guard and Landlock (issue 17): run (guard + ruleset) over run_bare (no guard), and the
    # added milliseconds; guard_floor - floor is the guard alone, outside any sandbox.
    bare, nol = _p50(get("run_bare", 1, "sync")), _p50(get("run_no_landlock", 1, "sync"))
    sess, sess_nol = _p50(get("session", 1, "sync")), _p50(get("session_no_landlock", 1, "sync"))

    def minus(a: float | None, b: float | None) -> float | None:
        return round(a - b, 3) if a is not None and b is not None else None

    out |= {"run_landlock_vs_run": div(p50["run"], bare),
            "run_landlock_minus_run_ms": minus(p50["run"], bare),
            "run_no_landlock_minus_run_ms": minus(nol, bare),
            "guard_minus_floor_ms": minus(_p50(get("guard_floor", 1, "sync")), p50["floor"]),
            "session_landlock_minus_session_ms": minus(sess, sess_nol)}
    # The seed recipe (issue 16): what a user hand-rolls; targets run <= 1.5x, arun c8 >= 0.7x.
    seed = _p50(get("seed_bwrap", 1, "sync"))
    out |= {"run_vs_seed_bwrap": div(p50["run"], seed), "raw_bwrap_vs_seed_bwrap": div(p50["raw"], seed)}
    for c in CONCURRENCY:
        a, rb, sb = get("arun", c, "asyncio"), get("raw_bwrap", c, "asyncio"), get("seed_bwrap", c, "asyncio")
        if a and rb:
            out[f"arun_vs_raw_bwrap_calls_per_s_c{c}"] = div(a["calls_per_s"], rb["calls_per_s"])
        if a and sb:
            out[f"arun_vs_seed_bwrap_calls_per_s_c{c}"] = div(a["calls_per_s"], sb["calls_per_s"])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small N: finishes in under 30 s")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON (schema in bench/README.md)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 10, --quick 3)")
    ap.add_argument("--per-round", type=int, help="sync calls per case per round (default 30, --quick 8)")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                    help="comma-separated asyncio concurrencies (default 1,2,8,64)")
    ap.add_argument("--command", action="append", choices=sorted(COMMANDS), help="only this command (repeatable)")
    ap.add_argument("--profile", action="store_true", help="profile lowlevel.run with pyinstrument and exit")
    ap.add_argument("--soak", type=int, help="sequential session commands for session_soak (default 10000, "
                    "--quick 1000, 0: skip)")
    ap.add_argument("--only", metavar="NAMES", help="comma-separated case names to run (e.g. run,run_bare for "
                    "a focused A/B); default: all")
    ap.add_argument("--download-rounds", type=int, help="rounds of egress_download (default 10, --quick 3, 0: skip)")
    ap.add_argument("--cli", type=int, help="pairs of the cli case (whole-process `lowlevel run --rm -- "
                    "/usr/bin/true` against `python -c pass`; default 100, --quick 5, 0: skip)")
    args = ap.parse_args(argv)
    conc = tuple(int(c) for c in args.concurrency.split(",") if c)
    rounds = args.rounds or (3 if args.quick else 10)
    per_round = args.per_round or (8 if args.quick else 30)
    commands = args.command or list(COMMANDS)

    if args.profile:
        return profile(per_round * rounds)

    t_start = time.monotonic()
    load_before = os.getloadavg()
    once = one_time_costs()
    host = host_info()
    # Before the count: the import compiles its own profile (the default minus the setid rules).
    images = ImageCases() if ImageCases.COMMAND in commands else None
    compiles_before = len(_seccomp_filter._cache)

    cases: list[Case] = []
    raws: list[RawBwrap | SeedBwrap] = []
    guards: list[GuardFloor] = []
    sess = SessionCases()
    if images is not None:
        once.update({k: round(v, 3) for k, v in images.times.items()})
        if "image_first_run_ms" in images.times:
            once["image_first_vs_second_run"] = round(images.times["image_first_run_ms"]
                                                      / images.times["image_second_run_ms"], 3)
        cases += images.cases()
    for label in commands:
        cmd = COMMANDS[label]
        raw = RawBwrap(cmd)
        raws.append(raw)
        seed = SeedBwrap(cmd)
        raws.append(seed)
        cases += [Case("floor", label, 1, "sync", lambda c=cmd: floor_call(c)),
                  Case("subprocess", label, 1, "sync", lambda c=cmd: subprocess_call(c)),
                  Case("seed_bwrap", label, 1, "sync", seed.call),
                  Case("raw_bwrap", label, 1, "sync", raw.call),
                  Case("run", label, 1, "sync", lambda c=cmd: run_call(c)),
                  Case("run_egress", label, 1, "sync", lambda c=cmd: run_egress_call(c))]
        guard = GuardFloor(cmd)
        guards.append(guard)
        cases += [Case("run_bare", label, 1, "sync", lambda c=cmd: run_bare_call(c)),
                  Case("run_no_landlock", label, 1, "sync", lambda c=cmd: run_no_landlock_call(c)),
                  Case("guard_floor", label, 1, "sync", guard.call)]
        cases.append(Case("session", label, 1, "sync", lambda c=cmd: sess.session_call(c)))
        cases.append(Case("session_no_landlock", label, 1, "sync", lambda c=cmd: sess.session_no_landlock_call(c)))
        pool1 = Case("pool", label, 1, "sync", lambda c=cmd: sess.pool_call(2, c))
        gaps: list[float] = []  # seconds: the untimed wait before each pool call (its refill)

        def pool_before(gaps: list[float] = gaps) -> None:
            t = time.perf_counter()
            sess.wait_full(sess.pool(2))
            gaps.append(time.perf_counter() - t)

        pool1.before = pool_before
        # And after its round: the refill of its last call (several bwrap starts at once) must not
        # land in the next case's round.
        pool1.settle = lambda: sess.wait_full(sess.pool(2))
        cases.append(pool1)
        # The floor with the pool's spacing: a call after an idle gap costs the host too (856 ->
        # 1374 us here after the pool's refill gap: bench/README.md "Session, round 2"), so
        # pool / floor_spaced compares like with like; the gap is the median of the pool's waits.
        spaced = Case("floor_spaced", label, 1, "sync", lambda c=cmd: floor_call(c))
        spaced.before = lambda gaps=gaps: time.sleep(statistics.median(gaps[-200:]) if gaps else 0.005)
        cases.append(spaced)
        for c in conc:
            cases.append(Case("raw_bwrap", label, c, "asyncio", raw.acall))
            cases.append(Case("seed_bwrap", label, c, "asyncio", seed.acall))
            cases.append(Case("arun", label, c, "asyncio", lambda c_=cmd: arun_call(c_)))
            cases.append(Case("session", label, c, "asyncio", lambda c_=cmd: sess.asession_call(c_)))
            if c in (1, 8):
                size = max(2, c)
                pc = Case("pool", label, c, "asyncio", lambda c_=cmd, n=size: sess.apool_call(n, c_))
                pc.settle = lambda n=size: sess.wait_full(sess.pool(n))
                cases.append(pc)

    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c.name in keep]
    loop = asyncio.new_event_loop()
    try:
        # Warm-up: every case a few calls, discarded.
        for case in cases:
            if case.skipped:
                continue
            if case.driver == "sync":
                sync_round(case, 3)
            else:
                loop.run_until_complete(async_round(case, min(case.concurrency, 8)))
            case.samples_ns.clear()
            case.wall_ns = 0
        for rnd in range(rounds):
            k = rnd % len(cases)
            for case in cases[k:] + cases[:k]:
                if case.skipped:
                    continue
                if case.driver == "sync":
                    sync_round(case, per_round)
                else:
                    # At least `concurrency` calls, so every slot is used at the start of the batch.
                    loop.run_until_complete(async_round(case, max(per_round, case.concurrency)))
            print(f"round {rnd + 1}/{rounds} done ({time.monotonic() - t_start:.1f} s)", file=sys.stderr)
    finally:
        sess.close(loop)
        if images is not None:
            images.close()
        loop.close()
        for raw in raws:
            raw.close()
        for guard in guards:
            guard.close()
    once["seccomp_compiles_during_bench"] = len(_seccomp_filter._cache) - compiles_before
    soak_n = args.soak if args.soak is not None else (1000 if args.quick else 10000)
    soak = session_soak(soak_n) if soak_n else None
    gcpu = guard_cpu(100 if args.quick else 2000)
    sandbox_cpu: dict[str, dict[str, float]] = {}
    for (case_name, command), values in sorted(_SANDBOX_CPU.items()):
        sandbox_cpu.setdefault(command, {})[case_name] = round(sum(values) / len(values), 4)
    dl_rounds = args.download_rounds if args.download_rounds is not None else rounds
    download = egress_download(dl_rounds, per_round) if dl_rounds else None
    egress_cpu_doc = egress_cpu(rounds * per_round) if dl_rounds else None
    cli_n = args.cli if args.cli is not None else (5 if args.quick else 100)
    cli_doc = cli_startup(cli_n) if cli_n else None
    host["loadavg_before"] = [round(x, 2) for x in load_before]
    host["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]

    results = [c.summary() for c in cases]
    top = ratios(results, "/usr/bin/true")
    top["cli_vs_python_startup"] = cli_doc["cli_vs_python_startup"] if cli_doc else None
    doc = {"schema": SCHEMA, "results": results,
           "ratios": top,
           "ratios_by_command": {label: ratios(results, label) for label in commands},
           "one_time": once, "host": host, "session_soak": soak, "egress_download": download,
           "egress_cpu": egress_cpu_doc, "guard_cpu": gcpu, "cli": cli_doc, "sandbox_cpu_ms": sandbox_cpu,
           "config": {"quick": args.quick, "rounds": rounds, "per_round": per_round, "concurrency": list(conc),
                      "commands": commands, "duration_s": round(time.monotonic() - t_start, 2),
                      "argv": sys.argv}}
    print_table(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


def print_table(doc: dict[str, Any]) -> None:
    h = doc["host"]
    print(f"kernel {h['kernel']}, bwrap {h['bwrap']}, Python {h['python']}, {h['cpus']} CPUs ({h['cpu_model']}), "
          f"cgroup {h['cgroup']}, root={h['caller_is_root']}")
    print(f"{'name':<19} {'driver':<8} {'conc':>4} {'command':<26} {'n':>5} {'p50 ms':>8} {'p90 ms':>8} "
          f"{'p99 ms':>8} {'calls/s':>8}")
    for r in doc["results"]:
        if r["skipped"]:
            print(f"{r['name']:<19} {r['driver']:<8} {r['concurrency']:>4} {r['command']:<26} skipped: {r['reason']}")
            continue
        print(f"{r['name']:<19} {r['driver']:<8} {r['concurrency']:>4} {r['command']:<26} {r['n']:>5} "
              f"{r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['calls_per_s']:>8.1f}")
    print("ratios (/usr/bin/true, p50, concurrency 1 unless named):")
    for k, v in doc["ratios"].items():
        print(f"  {k:<36} {v}")
    print("one-time costs:")
    for k, v in doc["one_time"].items():
        print(f"  {k:<36} {v}")
    if doc.get("session_soak"):
        print(f"session soak: {doc['session_soak']}")
    print(f"guard CPU (no sandbox): {doc['guard_cpu']}")
    print(f"sandbox CPU per call, ms (run cgroup): {doc['sandbox_cpu_ms']}")
    if doc.get("egress_download"):
        print(f"egress download: {doc['egress_download']}")
    if doc.get("egress_cpu"):
        print(f"egress cpu: {doc['egress_cpu']}")
    if doc.get("cli"):
        print("cli: " + ", ".join(f"{k} {v}" for k, v in doc["cli"].items() if not k.endswith("_samples_ms")))
    print(f"load average before {h['loadavg_before']}, after {h['loadavg_after']}")


def profile(n: int) -> int:
    try:
        from pyinstrument import Profiler
    except ImportError:
        print("--profile needs pyinstrument: pip install pyinstrument", file=sys.stderr)
        return 2
    for _ in range(5):
        run_call(["/usr/bin/true"])
    prof = Profiler(interval=0.0001)
    prof.start()
    t = time.perf_counter_ns()
    for i in range(n):
        run_call(["/usr/bin/true"])
        if i % 50 == 49:
            _sweep_workspaces()
    per = (time.perf_counter_ns() - t) / n / 1e6
    prof.stop()
    print(f"{n} x lowlevel.run(['/usr/bin/true']): {per:.2f} ms per call (profiled)")
    print(prof.output_text(unicode=False, color=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
