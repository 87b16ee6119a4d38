"""Density: how many live ``lowlevel.Session``s one machine holds, and what each one costs (issue 27, item 4).

    python bench/density.py [--sizes 100,300,1000] [--as root,user] [--seconds 5] [--step 100]
                            [--limits] [--upper tmpfs] [--json FILE]

For each caller (``root``, and ``user``: the unprivileged ``lowlevel-test``, through
``runuser -u lowlevel-test`` with PYTHONPATH at this checkout) and each N, a fresh child process:

1. raises its soft RLIMIT_NOFILE to the hard limit (each live Session holds ~11 fds in the
   caller; both figures are reported), then starts N Sessions one after another, in steps of
   ``--step`` (a progress line per step), timing each start (``start_ms`` p50/p99);
2. lets them settle ``--settle`` s, then measures them idle: the caller's fds, threads and RSS
   (per session: the growth over the child's baseline); each run cgroup's memory charge
   (v2 ``memory.current``, v1 ``memory.usage_in_bytes``; None without a memory cgroup); the PSS of
   every process of the sessions (the caller's descendants, ``/proc/PID/smaps_rollup``), by
   command name; and the host's ``MemAvailable`` drop (noisy: the machine is shared);
3. runs ``/usr/bin/true`` in the sessions round-robin (``sessions[i % N].run``) for ``--seconds``
   s, one command at a time: per-command p50/p90/p99/max;
4. closes every session (in ``finally``), times that, and checks that no process of them is left
   and the fd count is back to the baseline.

Each child is killed (its whole process group) if it exceeds ``--child-timeout`` s: a hang is a
result (``"hang": true``), never a stuck bench. ``--limits`` adds the probes of what stops density,
each in a child of its own, each with a small N: the uid range (root: ``LOWLEVEL_UID_RANGE`` of 8
uids above the default range, which other callers' runs rotate through), RLIMIT_NOFILE (a soft
limit of 120), and RLIMIT_NPROC (user: a soft limit a few dozen processes above what the user runs
already; the kernel does not apply it to root), and memory (root, cgroup v1: a memory cgroup of
``MEMORY_PROBE_MIB`` for the child, which its sessions' run cgroups nest in: who the OOM killer
takes, the child or its sessions, ``sessions_ended``). Each probe records how many sessions started, the
error (type, message) at the limit, how long the failing start took, and what was left afterwards.

``--upper`` picks the workspace's upper layer (issue 27, item 6): ``tmpfs`` (the default: the
sandbox's writes live in RAM, charged to its cgroup) or ``disk`` (``Limits(upper="disk")``: an ext4
on a per-session loop device, root callers only; the unprivileged child reports the refusal).
Benchmarks never assert: the figures go to stdout and ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)
TEST_USER = "lowlevel-test"
COMMAND = ["/usr/bin/true"]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` (0..100) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, Any]:
    """``{n, p50, p90, p99, max, mean}`` of ``values`` (milliseconds or bytes), rounded."""
    if not values:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(values)}
    for q in (50, 90, 99):
        out[f"p{q}"] = round(percentile(values, q) or 0, 3)
    return out | {"max": round(max(values), 3), "mean": round(sum(values) / len(values), 3)}


def upper_policy(upper: str) -> dict[str, Any]:
    """The Policy fields that select the workspace's upper layer (``--upper``).

    ``tmpfs``: the default, nothing to set. ``disk``: ``Limits(upper="disk")``.
    """
    if upper == "tmpfs":
        return {}
    import lowlevel
    return {"limits": lowlevel.Limits(upper=upper)}


# -- what the child measures -------------------------------------------------------------

def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def status_kib(pid: int | str, key: str) -> int | None:
    """A ``kB`` field of /proc/PID/status (``VmRSS``...)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def descendants(root: int) -> list[tuple[int, str]]:
    """``(pid, comm)`` of every process below ``root`` (from each /proc/PID/stat's ppid)."""
    children: dict[int, list[int]] = {}
    comm: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        close = stat.rfind(b")")
        ppid = int(stat[close + 2:].split()[1])
        comm[int(name)] = stat[stat.find(b"(") + 1:close].decode("utf-8", "replace")
        children.setdefault(ppid, []).append(int(name))
    out: list[tuple[int, str]] = []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append((pid, comm.get(pid, "?")))
        todo.extend(children.get(pid, ()))
    return out


def pss_kib(pid: int) -> int | None:
    """The PSS of ``pid`` (``/proc/PID/smaps_rollup``, kB); None when unreadable (gone, not ours)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cgroup_memory(session: Any) -> int | None:
    """The session's run cgroup memory charge, bytes (v2 memory.current, v1 memory.usage_in_bytes)."""
    cg = session._core.run.cgroup
    node = cg.node("memory") if cg is not None else None
    if node is None:
        return None
    fname = "memory.current" if node.version == 2 else "memory.usage_in_bytes"
    try:
        with open(os.path.join(node.path, fname)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def idle_memory(sessions: list[Any], me: int) -> dict[str, Any]:
    """Per idle session: cgroup charge and PSS (by command name), summed over the caller's descendants."""
    cg = [m for m in (cgroup_memory(s) for s in sessions) if m is not None]
    by_comm: dict[str, list[int]] = {}
    unreadable = 0
    for pid, comm in descendants(me):
        pss = pss_kib(pid)
        if pss is None:
            unreadable += 1
            continue
        by_comm.setdefault(comm, []).append(pss)
    n = len(sessions)
    total_pss = sum(sum(v) for v in by_comm.values())
    return {
        "cgroup_bytes": summary([float(m) for m in cg]) if cg else None,
        "cgroup_mib_per_session": round(sum(cg) / len(cg) / 2**20, 3) if cg else None,
        "pss_mib_per_session": round(total_pss / n / 1024, 3) if n else None,
        "pss_kib_by_process": {c: {"processes": len(v), "kib_per_process": round(sum(v) / len(v), 1)}
                               for c, v in sorted(by_comm.items())},
        "processes_per_session": round(sum(len(v) for v in by_comm.values()) / n, 2) if n else None,
        "pss_unreadable": unreadable,
    }


def measure(n: int, step: int, seconds: float, settle: float, upper: str, base: str) -> dict[str, Any]:
    """Start ``n`` Sessions, measure them idle and busy, close them: the result dict of one child."""
    import lowlevel
    from lowlevel.session import Session
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    me = os.getpid()
    policy = lowlevel.Policy(**upper_policy(upper))
    with Session(policy, workspace_base=base, commit=False) as warm:  # imports, the init's pages, caches
        warm.run(COMMAND)
    fds0, threads0, rss0, avail0 = fd_count(), thread_count(), status_kib("self", "VmRSS") or 0, mem_available_kib()
    out: dict[str, Any] = {"n": n, "nofile_soft_was": soft, "nofile": hard,
                           "baseline": {"fds": fds0, "threads": threads0}}
    sessions: list[Any] = []
    starts: list[float] = []
    try:
        t_all = time.monotonic()
        try:
            for i in range(n):
                t = time.perf_counter()
                sessions.append(Session(policy, workspace_base=base, commit=False))
                starts.append((time.perf_counter() - t) * 1e3)
                if (i + 1) % step == 0 or i + 1 == n:
                    print(f"  [{os.geteuid()}] {i + 1}/{n} started, last {starts[-1]:.1f} ms",
                          file=sys.stderr, flush=True)
        except lowlevel.LowlevelError as err:
            out["start_error"] = {"after": len(sessions), "type": type(err).__name__, "message": str(err)}
        out["started"] = len(sessions)
        out["start_total_s"] = round(time.monotonic() - t_all, 2)
        out["start_ms"] = summary(starts)
        # p50 of each tenth of the starts, in order: does a start cost more with more sessions live?
        tenth = max(len(starts) // 10, 1)
        out["start_ms_p50_by_tenth"] = [round(percentile(starts[k:k + tenth], 50) or 0, 2)
                                        for k in range(0, len(starts), tenth)][:10]
        time.sleep(settle)
        k = max(len(sessions), 1)
        out["caller"] = {"fds": fd_count(), "threads": thread_count(),
                         "fds_per_session": round((fd_count() - fds0) / k, 2),
                         "threads_added": thread_count() - threads0,
                         "rss_kib_per_session": round(((status_kib("self", "VmRSS") or 0) - rss0) / k, 1)}
        out["idle"] = idle_memory(sessions, me)
        out["idle"]["mem_available_drop_mib_per_session"] = round((avail0 - mem_available_kib()) / k / 1024, 3)
        out["commands"] = round_robin(sessions, seconds)
    finally:
        t = time.perf_counter()
        close_errors = 0
        for s in sessions:
            try:
                s.close()
            except Exception:  # noqa: BLE001 - counted, the next one still closes
                close_errors += 1
        out["close_ms_per_session"] = round((time.perf_counter() - t) * 1e3 / max(len(sessions), 1), 3)
        out["close_errors"] = close_errors
    out["left_after_close"] = {"processes": len(descendants(me)), "fds_over_baseline": fd_count() - fds0}
    return out


def round_robin(sessions: list[Any], seconds: float, block: int = 20) -> dict[str, Any]:
    """Run COMMAND for ``seconds`` in blocks of ``block`` calls, alternating: round-robin over
    ``sessions`` (each call in the next one), then ``block`` calls in one session (``hot``,
    ``sessions[0]``). Same machine load for both, so ``hot`` says what N live sessions cost a
    command beyond the machine's state, and round-robin what visiting a cold session adds."""
    if not sessions:
        return {"n": 0}
    lat: dict[str, list[float]] = {"round_robin": [], "hot": []}
    cpu = {"round_robin": 0.0, "hot": 0.0}  # the caller's CPU (user+system), seconds
    errors: list[str] = []
    pauses: list[float] = []
    gc_t = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_t[0] = time.perf_counter()
        elif info.get("generation") == 2:
            pauses.append((time.perf_counter() - gc_t[0]) * 1e3)

    gc.callbacks.append(on_gc)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        for kind in ("round_robin", "hot"):
            c0 = time.process_time()
            for _ in range(block):
                s = sessions[i % len(sessions)] if kind == "round_robin" else sessions[0]
                i += kind == "round_robin"
                t = time.perf_counter()
                try:
                    r = s.run(COMMAND, timeout=30)
                    if r.exit_code != 0:
                        errors.append(f"exit {r.exit_code}")
                except Exception as err:  # noqa: BLE001 - a benchmark reports, it does not stop
                    errors.append(f"{type(err).__name__}: {err}")
                lat[kind].append((time.perf_counter() - t) * 1e3)
            cpu[kind] += time.process_time() - c0
    gc.callbacks.remove(on_gc)
    return {"latency_ms": summary(lat["round_robin"]), "hot_latency_ms": summary(lat["hot"]),
            "caller_cpu_ms_per_command": {k: round(cpu[k] * 1e3 / max(len(lat[k]), 1), 3) for k in cpu},
            "gc_gen2_pauses_ms": summary(pauses),
            "calls_per_s": round(len(lat["round_robin"]) * 2 / seconds, 1),
            "sessions_visited": min(i, len(sessions)), "errors": len(errors), "first_errors": errors[:3]}


# -- the limit probes (each in a child) ---------------------------------------------------

def probe(kind: str, cap: int, base: str) -> dict[str, Any]:
    """Open sessions until ``kind``'s limit stops them (at most ``cap``); what the error was."""
    import lowlevel
    from lowlevel.session import Session
    if kind == "nofile":
        resource.setrlimit(resource.RLIMIT_NOFILE, (120, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    elif kind == "uids":
        # Above the default range: other callers' runs rotate through all of it.
        first = 0x70000000 + 65536 + 512 + os.getpid() % 1024 * 8
        os.environ["LOWLEVEL_UID_RANGE"] = f"{first}-{first + 7}"
    elif kind == "memory":  # join the memory cgroup the parent made (MEMORY_PROBE_MIB for all of us)
        with open(os.path.join(os.environ["DENSITY_CGROUP"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    elif kind == "nproc":
        mine = sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (mine + 40, resource.getrlimit(resource.RLIMIT_NPROC)[1]))
    me = os.getpid()
    fds0 = fd_count()
    sessions: list[Any] = []
    out: dict[str, Any] = {"probe": kind}
    try:
        for _ in range(cap):
            t = time.perf_counter()
            try:
                sessions.append(Session(workspace_base=base, commit=False))
            except Exception as err:  # noqa: BLE001 - the error at the limit is the result
                out["error"] = {"type": type(err).__name__, "message": str(err),
                                "lowlevel_error": isinstance(err, lowlevel.LowlevelError),
                                "ms": round((time.perf_counter() - t) * 1e3, 1)}
                break
        out["started"] = len(sessions)
        if sessions:  # at the limit, the live sessions still work
            try:
                out["command_at_limit"] = sessions[0].run(COMMAND, timeout=30).exit_code
            except Exception as err:  # noqa: BLE001
                out["command_at_limit"] = f"{type(err).__name__}: {err}"
        if kind == "memory":  # which sessions the OOM killer took
            ended: list[str] = []
            for s in sessions:
                try:
                    s.run(COMMAND, timeout=30)
                except Exception as err:  # noqa: BLE001
                    ended.append(f"{type(err).__name__}: {err}")
            out["sessions_ended"] = {"n": len(ended), "first": ended[:2]}
    finally:
        for s in sessions:
            s.close()
    out["left_after_close"] = {"processes": len(descendants(me)), "fds_over_baseline": fd_count() - fds0}
    return out


def _owner(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


# -- the parent ---------------------------------------------------------------------------

#: The memory probe's limit for the caller and all its sessions (a v1 memory cgroup below ours).
MEMORY_PROBE_MIB = 80


def memory_probe(timeout: float) -> dict[str, Any]:
    """The memory probe (root, cgroup v1): a memory cgroup of MEMORY_PROBE_MIB below our own for
    the child, which its sessions' run cgroups nest in; removed afterwards. Records whether the
    OOM killer took the child (``crashed``, returncode -9) or its sessions."""
    with open("/proc/self/cgroup") as f:
        own = next((line.split(":", 2)[2].strip() for line in f if ":memory:" in line), None)
    if own is None or not os.path.isdir("/sys/fs/cgroup/memory"):
        return {"probe": "memory", "skipped": "no cgroup v1 memory hierarchy"}
    cg = f"/sys/fs/cgroup/memory{own.rstrip('/')}/lowlevel-density-{os.getpid()}"
    os.mkdir(cg)
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(MEMORY_PROBE_MIB << 20))
        doc = run_child("root", ["--child-probe", "memory"], timeout, env={"DENSITY_CGROUP": cg})
        return doc | {"probe": "memory", "limit_mib": MEMORY_PROBE_MIB}
    finally:
        end = time.monotonic() + 10  # a killed child's sessions die with it (--die-with-parent)
        while time.monotonic() < end:
            try:
                for root, _dirs, _files in os.walk(cg, topdown=False):
                    os.rmdir(root)
                break
            except OSError:
                time.sleep(0.2)


def run_child(who: str, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run this script as ``who`` with ``argv`` in a process group of its own; its JSON, or a hang."""
    base = tempfile.mkdtemp(prefix="lowlevel-density-")
    prefix: list[str] = []
    if who == "user":
        user = pwd.getpwnam(TEST_USER)
        os.chown(base, user.pw_uid, user.pw_gid)
        prefix = [shutil.which("runuser") or "/usr/sbin/runuser", "-u", TEST_USER, "--",
                  "env", f"PYTHONPATH={CHECKOUT}"]
    cmd = prefix + [sys.executable, os.path.abspath(__file__), "--child-base", base] + argv
    t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True, cwd="/",
                         env=dict(os.environ, **(env or {})))
    try:
        stdout, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return {"hang": True, "killed_after_s": timeout}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    try:
        doc: dict[str, Any] = json.loads(stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"hang": False, "crashed": True, "returncode": p.returncode}
    doc["child_wall_s"] = round(time.monotonic() - t, 1)
    return doc


def row(who: str, d: dict[str, Any]) -> str:
    if d.get("hang") or d.get("crashed"):
        return f"| {who} | ? | {'HANG' if d.get('hang') else 'crash'} | | | | | | | |"
    lat = d.get("commands", {}).get("latency_ms", {})
    hot = d.get("commands", {}).get("hot_latency_ms", {})
    idle, caller = d.get("idle", {}), d.get("caller", {})
    err = d.get("start_error")
    return (f"| {who} | {d['n']} | {d['started']}{' (' + err['type'] + ')' if err else ''} | "
            f"{d['start_ms'].get('p50')} / {d['start_ms'].get('p99')} | {lat.get('p50')} / {lat.get('p99')} "
            f"| {idle.get('cgroup_mib_per_session')} | {idle.get('pss_mib_per_session')} "
            f"| {idle.get('mem_available_drop_mib_per_session')} | {caller.get('fds_per_session')} "
            f"| {caller.get('threads_added')} | {hot.get('p50')} / {hot.get('p99')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100,300,1000")
    ap.add_argument("--as", dest="who", default="root,user",
                    help="root, user (lowlevel-test), root,user or both (the default)")
    ap.add_argument("--seconds", type=float, default=6.0, help="command time per size (round-robin and hot)")
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--step", type=int, default=100)
    ap.add_argument("--limits", action="store_true", help="also probe what stops density")
    ap.add_argument("--only-limits", action="store_true")
    ap.add_argument("--upper", default="tmpfs", choices=["tmpfs", "disk"],
                    help="the workspace's upper layer: tmpfs (RAM) or disk (a loop-mounted ext4; root only)")
    ap.add_argument("--child-timeout", type=float, default=900.0)
    ap.add_argument("--json")
    ap.add_argument("--child-base", help=argparse.SUPPRESS)
    ap.add_argument("--child-n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_base:
        doc = (probe(args.child_probe, 150 if args.child_probe == "memory" else 64, args.child_base)
               if args.child_probe
               else measure(args.child_n, args.step, args.seconds, args.settle, args.upper, args.child_base))
        print(json.dumps(doc), flush=True)
        return
    if os.geteuid() != 0:
        raise SystemExit("run as root (the bench runs the unprivileged half through runuser)")
    who_list = ["root", "user"] if args.who == "both" else [w for w in args.who.split(",") if w]
    if not who_list or set(who_list) - {"root", "user"}:
        raise SystemExit(f"--as {args.who}: say root, user, root,user or both")
    results: dict[str, Any] = {"schema": 1, "host": host_facts(), "seconds": args.seconds, "upper": args.upper,
                               "runs": [], "limits": []}
    common = ["--step", str(args.step), "--seconds", str(args.seconds), "--settle", str(args.settle),
              "--upper", args.upper]
    print("| caller | N | started | start p50 / p99 ms | command p50 / p99 ms | cgroup MiB/session "
          "| PSS MiB/session | MemAvailable drop MiB/session | caller fds/session | caller threads added "
          "| hot p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for n in ([] if args.only_limits else [int(x) for x in args.sizes.split(",")]):
            for who in who_list:
                d = run_child(who, ["--child-n", str(n)] + common, args.child_timeout)
                d["who"] = who
                results["runs"].append(d)
                print(row(who, d), flush=True)
        if args.limits or args.only_limits:
            for who in who_list:
                for kind in (("uids", "nofile") if who == "root" else ("nofile", "nproc")):
                    d = run_child(who, ["--child-probe", kind], 300.0) | {"who": who}
                    results["limits"].append(d)
                    print(f"limit {kind} ({who}): {json.dumps(d)}", flush=True)
                if who == "root":
                    d = memory_probe(300.0) | {"who": who}
                    results["limits"].append(d)
                    print(f"limit memory ({who}): {json.dumps(d)}", flush=True)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    left = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.count("_lowlevel_init")
    print(f"session inits left on the host after the bench: {left}")


def host_facts() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "mem_total_kib": _meminfo("MemTotal"), "kernel": os.uname().release,
            "threads_main": threading.active_count()}


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


if __name__ == "__main__":
    main()
