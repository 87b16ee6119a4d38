#!/usr/bin/env python3
"""What does each part of lowlevel's bwrap command line cost over the seed recipe?

    python bench/bwrap_parts.py [--calls N] [--json FILE]

A ladder from ``seed_bwrap`` (bench/startup.py: what a user hand-rolls from bwrap's README) to
``raw_bwrap`` (lowlevel's exact bwrap argv for the default Policy, behind the anchor, without
the launcher) and one step past it (the guard), each step adding one part of lowlevel's
command line to the previous one:

| step | adds |
|---|---|
| ``seed`` | the seed recipe |
| ``userns`` | ``--unshare-user --disable-userns`` |
| ``env`` | the Policy's ``--setenv``s and ``--hostname`` |
| ``etc`` | the seven ``/etc`` entries (``probe.ETC_ENTRIES``) as lowlevel gives them |
|  | (``argv.etc_plan``: files copied, a symlink, two binds; ``--etc-as-binds``: seven binds) |
| ``tmpfs`` | ``--size`` on ``/tmp``, a sized ``/dev/shm`` tmpfs, ``--remount-ro /dev`` |
| ``passwd`` | the synthesized ``/etc/passwd`` and ``/etc/group`` (two memfds), as files of the |
|  | root tmpfs (``--perms 0644 --file``; ``--passwd-as-bind``: ``--ro-bind-data``, as before) |
| ``remount_ro`` | ``--remount-ro /`` |
| ``seccomp`` | ``--seccomp FD``: the default profile's filter (a sealed memfd) |
| ``as_pid_1`` | ``--as-pid-1`` (the program is the sandbox's PID 1: no bwrap reaper process) |
| ``anchor`` | ``_lowlevel_exec`` in front (PID namespace, parent-death signal), no uid change |
| ``uid_drop`` | ``--uid/--gid``: bwrap runs as a per-run unprivileged uid = ``raw_bwrap`` |
| ``overlay`` | the copy-on-write workspace: the anchor's private mount namespace, sized tmpfs, |
|  | an empty lower (a fresh workspace; ``--idmapped-lower``: an idmapped clone of it, the |
|  | form a given workspace gets), overlay bound at ``/workspace`` |
| ``guard`` | the guard (``_lowlevel_guard``: Landlock rules, exact wait status) execs the program |

Interleaved (every round runs every step once, the order rotated); per step: wall p50 and
mean, and CPU per call: the ``cpuacct.usage`` of a cgroup v1 ``cpuacct`` directory of the
step's own that the bench's thread joins (``tasks``, itself) before each spawn, so every process
of the call is counted, dead or alive, reaped by anyone (rusage misses what bwrap does not
wait for); without a writable ``cpuacct`` hierarchy, ``os.wait4``'s rusage. CPU is the figure a
busy host does not distort. Root only (the seed recipe runs bwrap as root, as a root user would).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import lowlevel  # noqa: E402
from lowlevel.sandbox import argv as _argv# noqa: E402
from lowlevel.host import landlock as _landlock  # noqa: E402
from lowlevel.sandbox import landlock_rules as _landlock_rules  # noqa: E402
from lowlevel.sandbox import facts as _facts  # noqa: E402
from lowlevel.sandbox import plan as _plan  # noqa: E402
from lowlevel.host import seccomp_filter as _seccomp_filter  # noqa: E402

STEPS = ("seed", "userns", "env", "etc", "tmpfs", "passwd", "remount_ro", "seccomp", "as_pid_1", "anchor",
         "uid_drop", "overlay", "guard")

_NULL = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)


def _high(fd: int) -> int:
    """Move ``fd`` above every number the file actions target (so no dup2 clobbers a source)."""
    import fcntl
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 32)
    os.close(fd)
    return new


class Ladder:
    def __init__(self, cmd: list[str], passwd_as_bind: bool = False, etc_as_binds: bool = False,
                 idmapped_lower: bool = False) -> None:
        self.idmapped_lower = idmapped_lower
        self.cmd = cmd
        self.facts = _facts.host_facts()
        self.ws = tempfile.mkdtemp(prefix="lowlevel-bench-parts-", dir="/tmp")
        os.chmod(self.ws, 0o777)
        policy = lowlevel.Policy()
        self.ids = (0x70000000 + 4242, 0x70000000 + 4242)
        self.passwd, self.group = _plan.passwd_group(*self.ids)
        self.bpf = _seccomp_filter.compile_bpf(policy.seccomp) if policy.seccomp is not None else b""
        env: list[str] = []
        for k, v in sorted(policy.environment({}).items()):
            env += ["--setenv", k, v]
        layout = self.facts.layout
        base = ["--ro-bind", "/usr", "/usr"]
        for target, name in layout.symlinks:
            base += ["--symlink", target, name]
        for d in layout.ro_dirs:
            base += ["--ro-bind", d, d]
        # As lowlevel writes them (argv.etc_plan): small files copied into the root tmpfs from an
        # fd, /etc/localtime as a symlink, directories bound; --etc-as-binds: all seven bound.
        etc: list[str] = []
        self.etc_fds: list[tuple[int, bytes]] = []
        for kind, p, arg in _argv.etc_plan(layout.etc_files):
            if kind == "file" and not etc_as_binds:
                child = _argv.ETC_COPY_FD + len(self.etc_fds)
                with open(p, "rb") as f:
                    self.etc_fds.append((child, f.read()))
                etc += ["--perms", "0644", "--file", str(child), p]
            elif kind == "symlink" and not etc_as_binds:
                etc += ["--symlink", arg, p]
            else:
                etc += ["--ro-bind", p, p]
        size = str(policy.limits.tmp_size_bytes)
        self.parts: dict[str, list[str]] = {
            "userns": ["--unshare-user", "--disable-userns"],
            "env": [*env, "--hostname", "sandbox"],
            "etc": etc,
            # As lowlevel writes them (argv.dynamic_args): files of the root tmpfs, read-only with
            # it; --passwd-as-bind measures the --ro-bind-data form lowlevel used before.
            "passwd": ["--perms", "0644", "--file", "7", "/etc/passwd", "--perms", "0644", "--file", "8", "/etc/group"]
            if not passwd_as_bind else ["--ro-bind-data", "7", "/etc/passwd", "--ro-bind-data", "8", "/etc/group"],
            "remount_ro": ["--remount-ro", "/"],
            "seccomp": ["--seccomp", "6"],
            "as_pid_1": ["--as-pid-1"] if self.facts.bwrap.has("--as-pid-1") else [],
        }
        self.base = base
        self.size = size
        self.rules = _landlock_rules.ruleset_args(policy, layout.ro_dirs, self.facts.bwrap.options)
        from lowlevel.workspace import cow
        self.mnt = cow.mount_dir(None)

    def argv(self, step: str) -> tuple[list[str], list[tuple[int, bytes]]]:
        """The command line of ``step`` and the memfds it needs, ``[(child fd, data)]``."""
        upto = STEPS.index(step)
        opts = ["--unshare-all", "--new-session", "--die-with-parent", "--clearenv", "--cap-drop", "ALL"]
        if upto >= STEPS.index("userns"):
            opts += self.parts["userns"]
        opts += ["--setenv", "PATH", "/usr/bin:/bin"] if upto < STEPS.index("env") else self.parts["env"]
        mounts = [*self.base]
        fds: list[tuple[int, bytes]] = []
        if upto >= STEPS.index("etc"):
            mounts += self.parts["etc"]
            fds += self.etc_fds
        mounts += ["--proc", "/proc", "--dev", "/dev"]
        if upto >= STEPS.index("tmpfs"):
            mounts += ["--size", self.size, "--tmpfs", "/tmp", "--size", self.size, "--tmpfs", "/dev/shm",
                       "--remount-ro", "/dev"]
        else:
            mounts += ["--tmpfs", "/tmp"]
        overlay = upto >= STEPS.index("overlay")
        mounts += ["--bind", f"{self.mnt}/ws" if overlay else self.ws, "/workspace"]
        if upto >= STEPS.index("passwd"):
            mounts += self.parts["passwd"]
            fds += [(7, self.passwd), (8, self.group)]
        if upto >= STEPS.index("remount_ro"):
            mounts += self.parts["remount_ro"]
        # As lowlevel: with the guard, bwrap gets --chdir / and the guard changes to the cwd.
        mounts += ["--chdir", "/" if upto >= STEPS.index("guard") else "/workspace"]
        if upto >= STEPS.index("seccomp") and self.bpf:
            mounts += self.parts["seccomp"]
            fds.append((6, self.bpf))
        if upto >= STEPS.index("as_pid_1"):
            mounts += self.parts["as_pid_1"]
        inner = list(self.cmd)
        if upto >= STEPS.index("guard"):
            inner = [*_landlock.guard_argv(9, 10, self.rules, cwd="/workspace"), *self.cmd]
        argv = [self.facts.bwrap.path, *opts, *mounts, "--", *inner]
        if upto >= STEPS.index("anchor"):
            keep = sorted({fd for fd, _ in fds} | ({9, 10} if upto >= STEPS.index("guard") else set()))
            pre = [_facts._exec_helper(), f"--parent={os.getpid()}"]
            if upto >= STEPS.index("uid_drop"):
                pre += [f"--uid={self.ids[0]}", f"--gid={self.ids[1]}"]
            if overlay:
                st = os.stat(self.ws)
                pre += [f"--mnt={self.mnt}", "--lower-fd=11", f"--upper-bytes={1 << 30}",
                        f"--upper-inodes={1 << 20}", f"--idmap={st.st_uid}:{st.st_gid}"]
                if not self.idmapped_lower:
                    pre.append("--empty-lower")  # a fresh, empty workspace, as lowlevel.run's default
                fds.append((11, b""))  # the workspace's directory fd (opened in call())
            if keep:
                pre.append(f"--pass-fds={','.join(map(str, keep))}")
            argv = [*pre, "--", *argv]
        return argv, fds

    def call(self, step: str) -> float:
        """Run ``step`` once; return its CPU (ms: rusage of it and its waited-for children)."""
        argv, fds = self.argv(step)
        opened: list[int] = []
        actions: list[Any] = [(os.POSIX_SPAWN_DUP2, _NULL, 0), (os.POSIX_SPAWN_DUP2, _NULL, 1),
                              (os.POSIX_SPAWN_DUP2, _NULL, 2)]
        try:
            for child_fd, data in fds:
                if child_fd == 11:
                    fd = _high(os.open(self.ws, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
                    opened.append(fd)
                    actions.append((os.POSIX_SPAWN_DUP2, fd, child_fd))
                    continue
                fd = _high(_seccomp_filter.bpf_memfd(data) if child_fd == 6 else _plan.memfd("bench", data))
                opened.append(fd)
                actions.append((os.POSIX_SPAWN_DUP2, fd, child_fd))
            if step == "guard":
                r, w = os.pipe()
                r, w = _high(r), _high(w)
                opened += [r, w]
                actions += [(os.POSIX_SPAWN_DUP2, _landlock.guard_fd(), 9), (os.POSIX_SPAWN_DUP2, w, 10)]
            pid = os.posix_spawn(argv[0], argv, {}, file_actions=actions)
        finally:
            for fd in opened:
                os.close(fd)
        _, status, ru = os.wait4(pid, 0)
        if status:
            raise RuntimeError(f"step {step} exited with status {status:#x}: {argv}")
        return (ru.ru_utime + ru.ru_stime) * 1e3

    def close(self) -> None:
        import shutil
        shutil.rmtree(self.ws, ignore_errors=True)


class CpuAcct:
    """A cgroup v1 ``cpuacct`` directory per step; :meth:`enter` moves this thread into one.

    Every directory it makes goes again in :meth:`close` (children first, with any child cgroup
    something else made under them), also when :meth:`__init__` fails half-way: call
    :meth:`close` in a ``finally``. A directory still holding a process after the bench's own
    thread left is emptied with SIGKILL (only this bench's calls run there). If this process is
    SIGKILLed, lowlevel's own sweep (``cgroup_detect._sweep``: ``<pid>-...`` of a dead pid, nested
    children included) removes the tree at the next run.
    """

    def __init__(self) -> None:
        from lowlevel.host import cgroup_detect
        h = cgroup_detect.detect_cgroups().hierarchy_for("cpuacct")
        self.base = os.path.join(h.base, f"{os.getpid()}-bench-parts") if h is not None and h.version == 1 \
            and h.base else None
        self.dirs: dict[str, str] = {}
        self.home: str | None = None
        self._made: list[str] = []
        if self.base is None:
            return
        try:
            with open("/proc/self/cgroup") as f:
                own = cgroup_detect.parse_proc_cgroup(f.read())
            key = next(k for k in own if "cpuacct" in k.split(","))
            assert h is not None
            self.home = os.path.join(h.mount, own[key].lstrip("/"))
            os.mkdir(self.base)
            self._made.append(self.base)
            for s in STEPS:
                self.dirs[s] = os.path.join(self.base, s)
                os.mkdir(self.dirs[s])
                self._made.append(self.dirs[s])
        except BaseException:
            self.close()
            raise

    def _join(self, d: str) -> None:
        fd = os.open(os.path.join(d, "tasks"), os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    def usage_ns(self, step: str) -> int:
        with open(os.path.join(self.dirs[step], "cpuacct.usage")) as f:
            return int(f.read())

    def enter(self, step: str) -> None:
        self._join(self.dirs[step])

    def leave(self) -> None:
        if self.home is not None:
            self._join(self.home)

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave, then rmdir(2) every directory made here and everything under them, deepest
        first. Raises ``RuntimeError`` naming what stayed (after ``timeout_s`` seconds)."""
        if not self._made:
            return
        try:
            self.leave()
        except OSError:
            pass
        tree: list[str] = []
        for top in self._made[:1]:  # the base: every step directory and any nested child is under it
            for parent, dirs, _files in os.walk(top, topdown=False):
                tree += [os.path.join(parent, d) for d in dirs]
            tree.append(top)
        deadline = time.monotonic() + timeout_s
        left: list[str] = []
        for d in tree:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        left.append(d)
                        break
                    _kill_members(d)
                    time.sleep(0.01)
        self._made.clear()
        if left:
            raise RuntimeError(f"bench cgroups left behind (remove them with rmdir, children first): {left}")


def _kill_members(d: str) -> None:
    """SIGKILL every process of cgroup ``d`` but this one (which moves back to ``d``'s parent)."""
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            pids = [int(x) for x in f.read().split()]
    except OSError:
        return
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # so the finally blocks remove the bench's cgroups and workspace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per step (default 200)")
    ap.add_argument("--json", help="write the figures as JSON")
    ap.add_argument("--passwd-as-bind", action="store_true", help="the passwd step as --ro-bind-data (the old form)")
    ap.add_argument("--etc-as-binds", action="store_true", help="the etc step as seven read-only binds (the old form)")
    ap.add_argument("--idmapped-lower", action="store_true",
                    help="the overlay step over an idmapped clone of the workspace (a given workspace's form)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("run as root (the seed recipe is root's bwrap)", file=sys.stderr)
        return 2
    import signal
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    wall: dict[str, list[float]] = {s: [] for s in STEPS}
    cpu: dict[str, list[float]] = {s: [] for s in STEPS}
    ladder: Ladder | None = None
    acct: CpuAcct | None = None
    try:
        ladder = Ladder(["/usr/bin/true"], passwd_as_bind=args.passwd_as_bind, etc_as_binds=args.etc_as_binds,
                        idmapped_lower=args.idmapped_lower)
        acct = CpuAcct()
        for s in STEPS:  # warm-up
            ladder.call(s)
        for i in range(args.calls):
            k = i % len(STEPS)
            for s in STEPS[k:] + STEPS[:k]:
                if acct.base is not None:
                    u0 = acct.usage_ns(s)
                    acct.enter(s)
                t = time.perf_counter_ns()
                c = ladder.call(s)
                wall[s].append((time.perf_counter_ns() - t) / 1e6)
                if acct.base is not None:
                    acct.leave()
                    c = (acct.usage_ns(s) - u0) / 1e6
                cpu[s].append(c)
    finally:
        try:
            if acct is not None:
                acct.close()
        finally:
            if ladder is not None:
                ladder.close()
    assert acct is not None  # made in the try, or it raised
    out_cpu = "cpuacct" if acct.base is not None else "rusage"
    out: dict[str, Any] = {"calls": args.calls, "cpu_source": out_cpu, "steps": {}}
    prev_cpu = prev_wall = None
    print(f"{'step':<11} {'wall p50':>9} {'+p50':>7} {'cpu mean':>9} {'+cpu':>7}  (ms)")
    for s in STEPS:
        w50 = statistics.median(wall[s])
        cm = sum(cpu[s]) / len(cpu[s])
        out["steps"][s] = {"wall_p50_ms": round(w50, 3), "wall_mean_ms": round(sum(wall[s]) / len(wall[s]), 3),
                           "cpu_mean_ms": round(cm, 3)}
        dw = "" if prev_wall is None else f"{w50 - prev_wall:+7.2f}"
        dc = "" if prev_cpu is None else f"{cm - prev_cpu:+7.2f}"
        print(f"{s:<11} {w50:9.2f} {dw:>7} {cm:9.2f} {dc:>7}")
        prev_wall, prev_cpu = w50, cm
    seed, raw = out["steps"]["seed"], out["steps"]["uid_drop"]
    out["raw_vs_seed_wall_p50"] = round(raw["wall_p50_ms"] / seed["wall_p50_ms"], 3)
    out["raw_vs_seed_cpu"] = round(raw["cpu_mean_ms"] / seed["cpu_mean_ms"], 3)
    print(f"raw (uid_drop) vs seed: wall p50 x{out['raw_vs_seed_wall_p50']}, cpu x{out['raw_vs_seed_cpu']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
