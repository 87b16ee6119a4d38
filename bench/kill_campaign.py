#!/usr/bin/env python3
"""Callers killed at random instants: does a killed caller leave its workspace old or new, and nothing else?

    python bench/kill_campaign.py [--trials N] [--kinds run,session,...] [--as root|user|both]
                                  [--signals KILL,TERM,INT,HUP,QUIT] [--double] [--seed S] [--json FILE]
                                  [--user NAME] [--keep-user]
    python bench/kill_campaign.py --kinds KIND --as root|user --replay TRIAL_SEED   # one trial again
    python bench/kill_campaign.py --victim sandbox ...   # SIGKILL a process the caller started instead

Root only (it runs the unprivileged half through setpriv(1) as ``--user``, default
``lowlevel-kill``, created with ``useradd -M`` when missing and removed at the end unless
``--keep-user``). Each trial, one at a time:

1. a workspace (or several) with known content is made in a fresh trial directory and its
   manifest taken (every entry: kind, sha256 or link target, owner); the expected *new* manifest
   is what the same operations give when applied here, in a scratch copy;
2. a caller script (a temporary file run by this venv's python, with this checkout on
   PYTHONPATH; as the trial's user) does one of the kinds below; it installs a SIGTERM handler
   that raises SystemExit (what a service framework does), so SIGTERM exercises the library's
   unwinding paths and SIGKILL the ones that never run;
3. after a random instant in [0, 1 s] the caller gets SIGKILL or SIGTERM (``--signals`` adds
   SIGINT, left to Python's own handler: KeyboardInterrupt, as a ^C; SIGHUP and SIGQUIT, whose
   default actions kill at once, SIGQUIT's without a core file; ``--double`` sends a non-KILL
   signal again 0-0.3 s later, into the unwinding) (one seeded RNG: the
   campaign seed is printed, each trial has a seed of its own derived from it); this process is
   a child subreaper (``PR_SET_CHILD_SUBREAPER``), so whatever the caller leaves running is
   reparented here and seen (and its zombies reaped);
4. it waits for the caller, then up to ``GRACE_S`` for what it started to go (a sandbox dies with
   its anchor, a moment after the caller: only what is still there after that counts), runs
   ``python -m lowlevel cleanup --json`` as the same user with the same environment, and
   checks:

   - workspace: every entry is old or new (its manifest entry before or after the operations:
     an interrupted commit is atomic per entry, not per tree, so a tree that is part old and
     part new is counted as ``mixed``, not as an anomaly; an entry that is neither, or missing
     although old and new both have it, is one); no ``.lowlevel-commit-*`` temporary left after
     the cleanup; a ``.part-*`` file (the program's own temporary, renamed into place once
     written) only after SIGTERM (a Session's ``close()`` on the SystemExit commits what its
     killed command had written so far: documented, counted as ``partial``);
   - processes: none left among this process's descendants, nor anywhere whose command line
     names the campaign directory or the trial's marker (the sandboxed program's last argument);
   - mounts: no new line naming the campaign directory or /run/lowlevel in /proc/self/mountinfo
     and /proc/1/mountinfo (against the lines there before the campaign; other new lines
     naming ``lowlevel`` are another user's, counted as ``foreign_mounts``);
   - cgroups: no ``<...>/lowlevel/[run-]<caller pid>-*`` directory in any cgroup hierarchy;
   - loop devices: none whose ``/sys/block/loop*/loop/backing_file`` is under the campaign dir;
   - cleanup: only what names the caller's pid or lies in the campaign dir counts as the
     trial's (cleanup also sweeps the shared cgroup bases for any dead pid's empty run cgroups:
     counted as ``cleanup_foreign_removed``);
   - records: no run record of the caller's pid in ``$LOWLEVEL_RECORD_DIR``, no hand-over journal
     of it in /run/lowlevel/handover;
   - the workspace base (``$LOWLEVEL_WORKSPACE_BASE``, per trial) holds nothing but an empty
     ``.mnt`` (the unprivileged callers' mount directory) and, for ``pool``, its fresh ``run-*``
     workspaces (kept after use by design; each checked as a workspace whose old state is
     empty); the disk uppers' directory (``$LOWLEVEL_UPPER_DIR``, per trial) is empty;
   - the caller: exit by the signal sent (or by SystemExit 143 after SIGTERM), or 0 when it had
     finished before the instant came; anything else is an anomaly, and so is a traceback on
     its stderr (the handler's SystemExit prints none: one is an error while unwinding), but
     for the SystemExit itself raised where Python ignores exceptions ("Exception ignored in":
     an import's weakref callback, the interpreter's shutdown): Python drops it and the caller
     goes on, exit 0 (counted as ``sigterm_swallowed``; the other checks apply);
   - a caller that unwound (exit 143) left ``lowlevel cleanup`` nothing to remove (what only a
     SIGKILL may leave: run cgroups, records, commit temporaries);
   - ``lowlevel cleanup`` exits 0 (nothing stayed); a ``conflict-*`` directory in the workspace
     base (a commit refused as a conflict saved the run's changes there) is an anomaly too.

``--victim sandbox``: the caller is left alone; at the instant (drawn from the span in which the
kind's last control trial had processes below its caller: a run's commit, after its sandbox is
gone, has none) one of its descendants, picked at
random (the anchor, bwrap, the guard, a Session's init or shepherd, the program, a process the
program started; what the kernel's OOM killer or an operator's ``kill -9`` may pick), gets
SIGKILL. The caller must then end on its own, in time: exit 0, or exit 1 with a lowlevel error
(``lowlevel.*Error``: one line, no traceback) or the workload's own complaint about a program
that did not exit 0; the CLI kinds with any status and no traceback. It lived, so it ran its
own clean-up: ``lowlevel cleanup`` must find nothing of it (``survived_but_left``). Every other
check is as above (a program killed mid-write may leave its ``.part-`` file committed).

Kinds (a caller-owned workspace, the default ``commit=True``):

- ``run``: ``lowlevel.run`` of a program (python3 inside) that adds, modifies and deletes
  files in the workspace, then the commit; ``run_disk``: the same with
  ``Limits(upper="disk")`` (root only);
- ``session``: a ``Session`` on the workspace running three commands that each write a disjoint
  part, then ``commit()``; ``session_disk``: the same with ``Limits(upper="disk")`` (root only);
- ``run_nooverlay``: ``run`` with ``LOWLEVEL_NO_OVERLAY=1`` in the caller: no copy-on-write
  layer, the program writes into the workspace itself; a root caller hands its entries to the
  per-run uid and back (journal in ``/run/lowlevel/handover``, which ``lowlevel cleanup``
  replays after a SIGKILL: every entry must be back with its owner, ``with_owner``); a
  ``.part-`` file of the program's, killed mid-write, may stay (no commit step leaves it out);
- ``run_egress``, ``session_egress``: ``run`` and ``session`` with ``network=Egress(allow=...)``
  (the host-side proxy and its socket directory: started, then stopped by the caller or
  ``lowlevel cleanup``; the program makes no connection);
- ``arun``: three concurrent ``lowlevel.arun`` calls, each on a workspace of its own;
- ``pool``: a ``Pool(size=2)`` serving three calls, each writing files into its own fresh
  workspace under the trial's workspace base; ``pool_template``: a ``Pool(size=2,
  template=WS)`` serving three calls of the ``run`` changes, each in a copy-on-write view of the
  template, which must stay exactly old (``template_written``: never committed to);
- ``cli``: ``lowlevel run --workspace WS -- ...`` of the ``run`` program: the caller script
  execs the CLI (same pid), which has its own handlers (SIGTERM, SIGHUP, SIGQUIT: unwind, then
  exit 128+N; SIGINT: 130); ``cli_rm``: ``lowlevel run --rm -- ...`` of the ``pool`` program
  in a fresh workspace under the trial's base, which must be gone afterwards (the
  unwinding's ``--rm``, or ``lowlevel cleanup`` after a SIGKILL): nothing may stay in the base.

Unprivileged callers have no per-run uid and no disk upper (UnsupportedError): the ``*_disk``
kinds are skipped for them. Before its trials, each (kind, user) runs one control trial without
a kill: it must end with the caller's exit 0 and every workspace equal to the new manifest (else
the kind is reported as broken and skipped); its duration is reported.

Isolation: ``LOWLEVEL_CACHE_DIR``, ``LOWLEVEL_RECORD_DIR`` (per user, under the campaign dir),
``LOWLEVEL_WORKSPACE_BASE``, ``LOWLEVEL_UPPER_DIR`` (per trial) and ``LOWLEVEL_CGROUP_ROOTS=""``
(cleanup does not walk the host's cgroup hierarchies: another user's orphaned run cgroups are
not this campaign's to remove; the records name ours) point into the campaign's temporary
directory (``--dir``, default a fresh ``/var/tmp/lowlevel-kill-*``, removed at the end). Not
redirectable, shared with the host: root's ``/run/lowlevel/mnt`` (the empty directory the
runs mount their upper on, in their own mount namespaces), ``/run/lowlevel/uids.lock`` (the
per-run uid leases: sharing them is what keeps two sandboxes off one uid) and
``/run/lowlevel/handover`` (only the fallback without overlay writes there); the run cgroups
live under the host's ``<caller's cgroup>/lowlevel`` bases, and each lowlevel call removes the
empty run cgroups of dead pids it finds there (as every lowlevel call on this host does);
``lowlevel cleanup`` also looks at egress socket directories in /dev/shm and /tmp.

Output: per (kind, user) the trials, the kills by signal (and how many callers had finished
before their instant), where the kills landed (the caller's last phase mark), the workspace
outcomes (old / new / mixed / partial, temporaries seen before the cleanup), what cleanup
removed, and the anomalies, each with its trial seed, instant, signal and what was found
(``--replay`` runs that trial again and keeps its directory). ``--json FILE`` writes it all.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import hashlib
import json
import os
import pwd
import random
import resource
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("run", "run_disk", "run_egress", "run_nooverlay", "session", "session_disk", "session_egress", "arun", "pool",
         "pool_template", "cli", "cli_rm")
ROOT_ONLY = ("run_disk", "session_disk")
#: How long what a killed caller started may take to go by itself before it counts as left.
GRACE_S = 5.0
#: How long a SIGTERMed caller may take to unwind (its finally blocks: kill, reap, commit).
TERM_WAIT_S = 30.0
KILL_WINDOW_S = 1.0
#: The control caller's lifetime the workload is scaled to (s): a bit longer than the window.
TARGET_S = (0.9, 1.4)
COMMIT_TEMP = ".lowlevel-commit-"
PART = ".part-"
DEFAULT_USER = "lowlevel-kill"
PR_SET_CHILD_SUBREAPER = 36

# The operations a sandboxed program applies to /workspace, and this harness to a scratch copy
# (the expected new state): one function, exec'd in both places. Each file is written to a
# ``.part-`` name and renamed into place, so a file has its old or its new content, never half.
OPS_CODE = r'''
import hashlib, json, os, sys

def content(seed, size):
    block = hashlib.sha256(seed.encode()).digest()
    return (block * (size // len(block) + 1))[:size]

def apply(root, ops):
    for op in ops:
        kind, rel = op[0], op[1]
        path = os.path.join(root, rel)
        parent = os.path.dirname(path)
        if kind == "write":
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, ".part-" + os.path.basename(path))
            with open(tmp, "wb") as f:
                f.write(content(op[2], op[3]))
            os.replace(tmp, path)
        elif kind == "delete":
            os.unlink(path)
        elif kind == "symlink":
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, ".part-" + os.path.basename(path))
            os.symlink(op[2], tmp)
            os.replace(tmp, path)
        elif kind == "mkdir":
            os.makedirs(path, exist_ok=True)
        elif kind == "sleep":  # the program's own work before it writes: rel is the seconds
            if root == "/workspace":
                import time
                time.sleep(float(rel))

if __name__ == "__main__":
    apply("/workspace", json.loads(sys.argv[1]))
'''

# The caller: argv[1] is its JSON parameters. Phase marks go to a file (a pipe could be held
# open by what the caller starts), each "<CLOCK_MONOTONIC> <name>".
CALLER = r'''
import os, signal, sys
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
def _hook(t, v, tb, _default=sys.excepthook):  # ^C (SIGINT): Python's own KeyboardInterrupt, exit -2
    if t is KeyboardInterrupt:
        sys.stderr.write("KeyboardInterrupt\n")
    elif t.__module__.startswith("lowlevel") and t.__name__.endswith("Error"):  # what the library raises
        sys.stderr.write(f"lowlevel-error {t.__name__}: {v}\n")
    else:
        _default(t, v, tb)
sys.excepthook = _hook
import json, time
P = json.load(open(sys.argv[1]))
if P["kind"].endswith("_nooverlay"):
    os.environ["LOWLEVEL_NO_OVERLAY"] = "1"  # read when the first run looks for overlay support
_marks = os.open(P["marks"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

def mark(name):
    os.write(_marks, f"{time.monotonic():.6f} {name}\n".encode())

mark("python")
import lowlevel
mark("imported")
policy = lowlevel.Policy(limits=lowlevel.Limits(upper=P["upper"], workspace_bytes=P["workspace_bytes"]),
                         network=lowlevel.Egress(allow=("pypi.org",)) if P["egress"] else False)

def cmd(ops):
    return ["python3", "-c", P["ops_code"], json.dumps(ops), P["marker"]]

def check(r, what):
    if r.exit_code != 0:
        raise SystemExit(f"{what}: exit {r.exit_code}: {r.stderr[-2000:]!r} {r.notes}")

kind = P["kind"]
if kind in ("run", "run_disk", "run_egress", "run_nooverlay"):
    mark("call")
    r = lowlevel.run(cmd(P["ops"]), policy=policy, workspace=P["workspaces"][0], timeout=60)
    mark("returned")
    check(r, "run")
elif kind in ("session", "session_disk", "session_egress"):
    with lowlevel.Session(policy, workspace=P["workspaces"][0]) as s:
        mark("started")
        for i, part in enumerate(P["parts"]):
            check(s.run(cmd(part), timeout=60), f"command {i}")
            mark(f"command{i}")
        mark("commit")
        s.commit()
        mark("committed")
    mark("closed")
elif kind == "arun":
    import asyncio
    async def main():
        mark("call")
        rs = await asyncio.gather(*(lowlevel.arun(cmd(P["ops"]), policy=policy, workspace=w, timeout=60)
                                    for w in P["workspaces"]))
        mark("returned")
        for i, r in enumerate(rs):
            check(r, f"arun {i}")
    asyncio.run(main())
elif kind == "cli":  # the CLI is the caller (the same pid: exec), with its own signal handling
    mark("exec")
    os.execv(sys.executable, [sys.executable, "-m", "lowlevel", "run", "--workspace", P["workspaces"][0],
                              "--timeout", "60", "--", *cmd(P["ops"])])
elif kind == "cli_rm":  # the same with a fresh workspace (in $LOWLEVEL_WORKSPACE_BASE) that --rm removes
    mark("exec")
    os.execv(sys.executable, [sys.executable, "-m", "lowlevel", "run", "--rm", "--timeout", "60", "--",
                              *cmd(P["ops"])])
elif kind == "pool_template":  # every call in a copy-on-write view of the template, never written
    with lowlevel.Pool(policy=policy, size=2, template=P["workspaces"][0], workspace_base=P["base"]) as pool:
        mark("pool")
        for i in range(P["calls"]):
            check(pool.run(cmd(P["ops"]), timeout=60), f"pool call {i}")
            mark(f"call{i}")
    mark("closed")
elif kind == "pool":
    with lowlevel.Pool(policy=policy, size=2, workspace_base=P["base"]) as pool:
        mark("pool")
        for i in range(P["calls"]):
            check(pool.run(cmd(P["ops"]), timeout=60), f"pool call {i}")
            mark(f"call{i}")
    mark("closed")
mark("done")
'''


def _ops_namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "kill_campaign_ops"}
    exec(compile(OPS_CODE, "<ops>", "exec"), ns)
    return ns


OPS = _ops_namespace()


# ---------------------------------------------------------------------------- workloads

def old_tree_ops() -> list[list[Any]]:
    """What a prepared workspace holds: 30 files kept, 50 to modify, 20 to delete, a 2 MiB file."""
    ops: list[list[Any]] = []
    ops += [["write", f"keep/k{i:03d}.txt", f"keep{i}", 512 + 37 * i] for i in range(30)]
    ops += [["write", f"mod/m{i:03d}.txt", f"old-mod{i}", 1024 + 91 * i] for i in range(50)]
    ops += [["write", f"del/d{i:03d}.txt", f"old-del{i}", 700 + 13 * i] for i in range(20)]
    ops += [["write", "big.bin", "old-big", 2 << 20], ["write", "sub/deep/x.txt", "old-x", 333]]
    return ops


#: Per kind: (files added, MiB of the big file rewritten, seconds the program works first). Sized
#: so that a caller lives about 1 s here (the kill window) and its commit a good part of it.
WORKLOAD = {"run": (400, 8, 0.1), "cli": (400, 8, 0.1), "cli_rm": (400, 8, 0.1), "run_disk": (400, 8, 0.1),
            "run_egress": (400, 8, 0.1), "run_nooverlay": (400, 8, 0.1), "session": (300, 8, 0.05),
            "session_disk": (300, 8, 0.05),
            "session_egress": (300, 8, 0.05), "arun": (120, 4, 0.1), "pool": (60, 1, 0.05),
            "pool_template": (60, 1, 0.05)}


def sized(kind: str, scale: float) -> tuple[int, int, float]:
    """``WORKLOAD[kind]`` times ``scale`` (files, MiB, seconds)."""
    nadd, big, work = WORKLOAD[kind]
    return max(10, round(nadd * scale)), max(1, round(big * scale)), round(work * scale, 3)


def change_parts(kind: str, scale: float) -> list[list[list[Any]]]:
    """The run's changes in three disjoint parts (a Session runs one command per part)."""
    nadd, big, work = sized(kind, scale)
    adds = [["sleep", str(work)]]
    adds += [["write", f"add/a{i:04d}.txt", f"add{i}", 1024 + 23 * (i % 150)] for i in range(nadd)]
    mods = [["write", f"mod/m{i:03d}.txt", f"new-mod{i}", 2048 + 17 * i] for i in range(50)]
    mods += [["delete", f"del/d{i:03d}.txt"] for i in range(20)]
    rest = [["write", "big.bin", "new-big", big << 20], ["symlink", "link", "add/a0000.txt"],
            ["mkdir", "new/deep/tree"], ["write", "new/deep/tree/y.txt", "new-y", 4096],
            ["delete", "sub/deep/x.txt"]]
    return [adds, mods, rest]




def pool_ops(scale: float, kind: str = "pool") -> list[list[Any]]:
    """What each pool call (or ``cli_rm``'s one run) writes into its fresh (empty) workspace."""
    nadd, big, work = sized(kind, scale)
    ops: list[list[Any]] = [["sleep", str(work)]]
    ops += [["write", f"out/p{i:03d}.txt", f"pool{i}", 2048 + 11 * i] for i in range(nadd)]
    return ops + [["write", "out/big.bin", "pool-big", big << 20], ["symlink", "out/link", "p000.txt"]]


# ---------------------------------------------------------------------------- manifests

def manifest(root: str) -> dict[str, tuple[Any, ...]]:
    """``{relative path: (kind, sha256 | target, owner uid)}`` of every entry under ``root``."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", None, st.st_uid)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path), st.st_uid)
            elif stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                        h.update(chunk)
                out[rel] = ("file", h.hexdigest(), st.st_uid)
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode), st.st_uid)
        # os.walk does not descend into symlinked dirs (followlinks=False): as wanted
    return out


def with_owner(m: dict[str, tuple[Any, ...]], uid: int) -> dict[str, tuple[Any, ...]]:
    return {k: (v[0], v[1], uid) for k, v in m.items()}


def expected(ops_before: list[list[Any]], ops_after: list[list[Any]], uid: int,
             scratch: str) -> tuple[dict[str, tuple[Any, ...]], dict[str, tuple[Any, ...]]]:
    """(old, new) manifests: ``ops_before`` applied to an empty directory, then ``ops_after``."""
    d = tempfile.mkdtemp(dir=scratch, prefix="expect-")
    try:
        OPS["apply"](d, ops_before)
        old = with_owner(manifest(d), uid)
        OPS["apply"](d, ops_after)
        new = with_owner(manifest(d), uid)
    finally:
        shutil.rmtree(d)
    return old, new


def compare(now_full: dict[str, tuple[Any, ...]], old: dict[str, tuple[Any, ...]],
            new: dict[str, tuple[Any, ...]], allow_part: bool) -> dict[str, Any]:
    """Check one workspace's state against old and new, entry by entry."""
    temps = sorted(k for k in now_full if os.path.basename(k).startswith(COMMIT_TEMP)
                   or any(p.startswith(COMMIT_TEMP) for p in k.split(os.sep)))
    parts = sorted(k for k in now_full if os.path.basename(k).startswith(PART) and k not in temps)
    now = {k: v for k, v in now_full.items() if k not in temps and k not in parts}
    bad = []
    for rel in sorted(set(old) | set(new) | set(now)):
        got = now.get(rel)
        if got != old.get(rel) and got != new.get(rel):
            bad.append({"path": rel, "found": got, "old": old.get(rel), "new": new.get(rel)})
    state = "old" if now == old else "new" if now == new else "mixed"
    out: dict[str, Any] = {"state": state, "bad": bad, "temporaries": temps, "parts": parts}
    if parts and not allow_part:
        out["bad"].append({"path": parts, "found": "program temporaries (.part-*) committed without SIGTERM"})
    return out


def _traceback_tail(stderr: str) -> str:
    """The last exception lines of each traceback in ``stderr`` (the frames cut)."""
    keep = [ln for ln in stderr.splitlines()
            if ln and not ln.startswith(" ") and not ln.startswith("Traceback") or ln.startswith("  File")]
    return "\n".join(keep[-12:])


# ---------------------------------------------------------------------------- host scans

def proc_table() -> dict[int, tuple[int, str]]:
    """``{pid: (ppid, state)}`` of every process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rindex(b")") + 2:].split()
        out[int(name)] = (int(fields[1]), fields[0].decode())
    return out


def _read(path: str, binary: bool = False) -> Any:
    try:
        with open(path, "rb" if binary else "r") as f:
            return f.read()
    except OSError:
        return b"" if binary else ""


def describe(pid: int) -> dict[str, Any]:
    status = _read(f"/proc/{pid}/status")
    uid = re.search(r"^Uid:\s+(\d+)", status, re.M)
    state = re.search(r"^State:\s+(.*)$", status, re.M)
    return {"pid": pid, "uid": int(uid.group(1)) if uid else None, "state": state.group(1) if state else None,
            "cmdline": _read(f"/proc/{pid}/cmdline", True).replace(b"\0", b" ").decode(errors="replace")[:300]}


def reap() -> int:
    """Reap the zombies reparented to us (we are a subreaper); how many."""
    n = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid == 0:
            return n
        n += 1


def trial_processes(needles: list[bytes]) -> list[int]:
    """Our descendants (all of them are the trial's: trials run one at a time) and every process
    whose command line holds one of ``needles``."""
    me = os.getpid()
    table = proc_table()
    out = []
    for pid in table:
        if pid == me:
            continue
        p, hops = pid, 0
        while p > 1 and hops < 64:
            p = table.get(p, (0, ""))[0]
            hops += 1
            if p == me:
                out.append(pid)
                break
        else:
            cmdline = _read(f"/proc/{pid}/cmdline", True)
            if any(n in cmdline for n in needles):
                out.append(pid)
    return out


def mount_lines() -> set[str]:
    lines = set()
    for src in ("/proc/self/mountinfo", "/proc/1/mountinfo"):
        for line in _read(src).splitlines():
            if "lowlevel" in line:
                lines.add(line)
    return lines


def cgroup_mounts() -> list[str]:
    out = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ")[:1] and right.split(" ")[0] in ("cgroup", "cgroup2"):
            out.append(left.split(" ")[4])
    return out


def run_cgroups(pid: int) -> list[str]:
    pat = re.compile(rf"^(run-)?{pid}-")
    out = []
    for mount in cgroup_mounts():
        for dirpath, dirnames, _files in os.walk(mount):
            if os.path.basename(dirpath) == "lowlevel":
                out += [os.path.join(dirpath, d) for d in dirnames if pat.match(d)]
    return out


def loop_devices(prefix: str) -> list[str]:
    out = []
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return out
    for name in names:
        if name.startswith("loop"):
            backing = _read(f"/sys/block/{name}/loop/backing_file").strip()
            if backing.startswith(prefix):
                out.append(f"{name}: {backing}")
    return out


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


# ---------------------------------------------------------------------------- the campaign

class Identity:
    def __init__(self, who: str, pw: pwd.struct_passwd | None, root: str) -> None:
        self.who = who
        self.pw = pw
        self.uid = 0 if pw is None else pw.pw_uid
        self.gid = 0 if pw is None else pw.pw_gid
        self.state = os.path.join(root, who)
        self.home = os.path.join(self.state, "home")
        self.cache = os.path.join(self.state, "cache")
        self.records = os.path.join(self.state, "records")
        for d in (self.state, self.home, self.cache, self.records):
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o700 if d != self.state else 0o755)
            os.chown(d, self.uid, self.gid)

    def argv(self, argv: list[str]) -> list[str]:
        if self.pw is None:
            return argv
        # setpriv execs: the process we signal is the caller itself (runuser would fork).
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--", *argv]

    def env(self, trial_dir: str) -> dict[str, str]:
        return {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": self.home,
                "PYTHONPATH": REPO, "LOWLEVEL_CACHE_DIR": self.cache, "LOWLEVEL_RECORD_DIR": self.records,
                "LOWLEVEL_WORKSPACE_BASE": os.path.join(trial_dir, "base"),
                "LOWLEVEL_UPPER_DIR": os.path.join(trial_dir, "upper"), "LOWLEVEL_CGROUP_ROOTS": ""}


#: The signals a trial may send (``--signals``): SIGTERM to a caller whose handler raises
#: SystemExit, SIGINT to one left with Python's own handler (KeyboardInterrupt: ^C), SIGHUP with
#: its default action (a library caller dies at once, as by SIGKILL; the cli kind unwinds).
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT, "HUP": signal.SIGHUP,
           "QUIT": signal.SIGQUIT}
#: ``--double``: the same signal again after a delay drawn in [0, DOUBLE_WINDOW_S] (a second ^C,
#: a supervisor's second SIGTERM), landing in the caller's unwinding.
DOUBLE_WINDOW_S = 0.3
#: The signals whose caller unwinds (its finally blocks run) and the exit statuses that say so
#: (a negative one: killed by the signal before its handler was installed, or Python's own exit
#: after an uncaught KeyboardInterrupt).
UNWINDING = {signal.SIGTERM: (-15, 143), signal.SIGINT: (-2,)}
#: The same for ``lowlevel run`` (lowlevel.cli.signals: SIGTERM, SIGHUP, SIGQUIT and SIGINT
#: unwind, then exit 128+N).
CLI_UNWINDING = {signal.SIGTERM: (-15, 143), signal.SIGINT: (-2, 130), signal.SIGHUP: (-1, 129),
                 signal.SIGQUIT: (-3, 131)}


def _no_core() -> None:
    """The caller's preexec: no core file (SIGQUIT's default action dumps one into its cwd, /)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _only_interrupts(stderr: str) -> bool:
    """Every exception in a traceback's chain is a KeyboardInterrupt (a second ^C while the first unwound)."""
    raised = [ln for ln in stderr.splitlines() if ln and not ln.startswith((" ", "Traceback", "During handling"))]
    return bool(raised) and all(ln.startswith("KeyboardInterrupt") for ln in raised)


#: The exceptions the signals themselves raise (the handler's SystemExit, ^C's KeyboardInterrupt)
#: and asyncio's cancellation of the tasks they end.
_SIGNAL_EXCEPTIONS = ("KeyboardInterrupt", "SystemExit", "asyncio.exceptions.CancelledError", "CancelledError")


def _only_signal_exceptions(stderr: str) -> bool:
    """Every exception a traceback in ``stderr`` names is one of :data:`_SIGNAL_EXCEPTIONS`: with
    ``--double``, the second signal's exception raised inside the first one's unwinding (asyncio
    then logs "Task exception was never retrieved" for a task it ended), not an error."""
    named = [m.group(1) for m in re.finditer(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))\b", stderr, re.M)]
    return bool(named) and all(n in _SIGNAL_EXCEPTIONS for n in named)


class Campaign:
    def __init__(self, root: str, signals: tuple[signal.Signals, ...] = (signal.SIGKILL, signal.SIGTERM),
                 double: bool = False, victim: str = "caller") -> None:
        self.root = root
        self.signals = signals
        self.double = double
        self.victim = victim
        self.caller = os.path.join(root, "caller.py")
        with open(self.caller, "w") as f:
            f.write(CALLER)
        os.chmod(self.caller, 0o644)
        self.scratch = os.path.join(root, "scratch")
        os.makedirs(self.scratch, exist_ok=True)
        self.mounts_before = mount_lines()
        self.counter = 0
        self._states: dict[tuple[str, int, float], tuple[dict, dict]] = {}
        #: ``--victim sandbox``: per (kind, uid), when the last control's caller had descendants (s).
        self.alive_span: dict[tuple[str, int], tuple[float, float]] = {}

    def prepare(self, kind: str, ident: Identity, tdir: str, marker: str, scale: float) -> dict[str, Any]:
        """Make the trial's workspaces; return the caller's parameters and what to check."""
        parts = change_parts(kind, scale)
        params: dict[str, Any] = {"kind": kind, "marker": marker, "ops_code": OPS_CODE,
                                  "marks": os.path.join(tdir, "marks"), "upper": "disk" if "disk" in kind else "tmpfs",
                                  "egress": "egress" in kind,
                                  "workspace_bytes": None if kind.endswith("_nooverlay") else 64 << 20,
                                  "base": os.path.join(tdir, "base"),
                                  "ops": [op for p in parts for op in p], "parts": parts, "workspaces": []}
        n = {"arun": 3, "pool": 0, "cli_rm": 0}.get(kind, 1)
        for i in range(n):
            ws = os.path.join(tdir, f"ws{i}")
            os.mkdir(ws)
            OPS["apply"](ws, old_tree_ops())
            params["workspaces"].append(ws)
        if kind == "pool":
            params["ops"], params["calls"] = pool_ops(scale), 3
        elif kind == "pool_template":
            params["calls"] = 3
        elif kind == "cli_rm":
            params["ops"] = pool_ops(scale, kind)
        for d in ("base", "upper"):
            os.mkdir(os.path.join(tdir, d))
        for dirpath, dirnames, filenames in os.walk(tdir):
            for name in [dirpath, *(os.path.join(dirpath, x) for x in dirnames + filenames)]:
                os.lchown(name, ident.uid, ident.gid)
                if not os.path.islink(name):
                    os.chmod(name, 0o755 if os.path.isdir(name) else 0o644)
        with open(os.path.join(tdir, "params.json"), "w") as f:
            json.dump(params, f)
        os.chmod(os.path.join(tdir, "params.json"), 0o644)
        return params

    def states(self, kind: str, ident: Identity, scale: float) -> tuple[dict, dict]:
        key = (kind, ident.uid, scale)
        if key not in self._states:
            if kind in ("pool", "cli_rm"):
                self._states[key] = expected([], pool_ops(scale, kind), ident.uid, self.scratch)
            else:
                self._states[key] = expected(old_tree_ops(), [op for p in change_parts(kind, scale) for op in p],
                                             ident.uid, self.scratch)
        return self._states[key]

    def ours(self, item: dict[str, Any], caller_pid: int) -> bool:
        """Whether a leftover ``lowlevel cleanup`` reports is this trial's caller's."""
        path = str(item.get("path", ""))
        return bool(re.match(rf"^(run-)?{caller_pid}-", os.path.basename(path))) or path.startswith(self.root + "/")

    @staticmethod
    def descendants(caller_pid: int) -> list[int]:
        """The live (not zombie) processes below ``caller_pid``, sorted."""
        table = proc_table()
        kids: dict[int, list[int]] = {}
        for pid, (ppid, _state) in table.items():
            kids.setdefault(ppid, []).append(pid)
        found, todo = [], list(kids.get(caller_pid, []))
        while todo:
            pid = todo.pop()
            if table.get(pid, (0, "Z"))[1] not in ("Z", "X"):
                found.append(pid)
            todo += kids.get(pid, [])
        return sorted(found)

    def watch_descendants(self, proc: subprocess.Popen[bytes], t0: float) -> tuple[float, float]:
        """A control's caller until it ends: the first and last instants (s after ``t0``) at which
        it had descendants, polled every 5 ms; ``(0, KILL_WINDOW_S)`` if it never had one."""
        seen: list[float] = []
        while proc.poll() is None:
            if self.descendants(proc.pid):
                seen.append(time.monotonic() - t0)
            time.sleep(0.005)
        return (round(seen[0], 4), round(seen[-1], 4)) if seen else (0.0, KILL_WINDOW_S)

    def kill_descendant(self, caller_pid: int, rng: random.Random, out: dict[str, Any]) -> None:
        """``--victim sandbox``: SIGKILL one of the caller's descendants, picked with ``rng``; say
        which (``victim``: its comm) or that there was none (``no_victim``)."""
        found = self.descendants(caller_pid)
        if not found:
            out["no_victim"] = True
            return
        pid = rng.choice(found)
        out["victim"] = _read(f"/proc/{pid}/comm").strip() or "?"
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def trial(self, kind: str, ident: Identity, trial_seed: int | None, scale: float,
              keep: bool = False) -> dict[str, Any]:
        """One trial; ``trial_seed`` None: the control (no kill)."""
        self.counter += 1
        rng = random.Random(trial_seed)
        span = self.alive_span.get((kind, ident.uid), (0.0, KILL_WINDOW_S)) if self.victim == "sandbox" \
            else (0.0, KILL_WINDOW_S)
        instant = None if trial_seed is None else rng.uniform(*span)
        sig = None if trial_seed is None else rng.choice(self.signals)
        if self.victim == "sandbox" and sig is not None:
            sig = signal.SIGKILL
        again = rng.uniform(0, DOUBLE_WINDOW_S) if self.double and trial_seed is not None else None
        tdir = os.path.join(self.root, ident.who, f"{kind}-{self.counter:05d}")
        os.mkdir(tdir)
        marker = f"lowlevel-kill-trial-{os.getpid()}-{self.counter}"
        params = self.prepare(kind, ident, tdir, marker, scale)
        old, new = self.states(kind, ident, scale)
        out: dict[str, Any] = {"kind": kind, "user": ident.who, "trial_seed": trial_seed, "scale": scale,
                               "instant_s": None if instant is None else round(instant, 4),
                               "signal": None if sig is None else sig.name, "dir": tdir, "findings": []}
        find = out["findings"]
        logs = {s: open(os.path.join(tdir, s), "wb") for s in ("stdout", "stderr")}
        t0 = time.monotonic()
        proc = subprocess.Popen(ident.argv([sys.executable, self.caller, os.path.join(tdir, "params.json")]),
                                env=ident.env(tdir), cwd="/", stdin=subprocess.DEVNULL,
                                stdout=logs["stdout"], stderr=logs["stderr"], preexec_fn=_no_core)
        for f in logs.values():
            f.close()
        caller_pid = out["caller_pid"] = proc.pid
        if instant is not None:
            time.sleep(max(0.0, t0 + instant - time.monotonic()))
            kill_at = time.monotonic()
            out["finished_before_kill"] = proc.poll() is not None
            if self.victim == "sandbox":
                self.kill_descendant(caller_pid, rng, out)
            elif not out["finished_before_kill"]:
                os.kill(caller_pid, sig)
                if again is not None and sig != signal.SIGKILL:
                    time.sleep(again)
                    if proc.poll() is None:
                        os.kill(caller_pid, sig)
                        out["double_s"] = round(again, 4)
        else:
            kill_at = None
            if self.victim == "sandbox":
                self.alive_span[(kind, ident.uid)] = out["alive_span"] = self.watch_descendants(proc, t0)
        try:
            rc = proc.wait(timeout=TERM_WAIT_S if sig != signal.SIGKILL else 60)
        except subprocess.TimeoutExpired:
            find.append({"what": "caller_hung", "detail": f"still running {TERM_WAIT_S:.0f} s after "
                         f"{out['signal'] or 'start'}: SIGKILLed"})
            proc.kill()
            rc = proc.wait()
        out["caller_s"] = round(time.monotonic() - t0, 3)
        out["rc"] = rc
        marks = [ln.split(" ", 1) for ln in _read(params["marks"]).splitlines() if " " in ln]
        out["marks"] = {name: round(float(t) - t0, 4) for t, name in marks}
        out["phase"] = "before-python"
        if kill_at is not None:
            for t, name in marks:
                if float(t) <= kill_at:
                    out["phase"] = name
        else:
            out["phase"] = "control"
        unwinding = CLI_UNWINDING if kind.startswith("cli") else UNWINDING
        expected_rc: tuple[int, ...] = unwinding.get(sig, (0,) if sig is None else (-sig,))  # type: ignore[arg-type]
        stderr = _read(os.path.join(tdir, "stderr")).strip()
        if sig == signal.SIGINT and rc == -signal.SIGINT and stderr.endswith("KeyboardInterrupt") \
                and ("During handling" not in stderr or _only_interrupts(stderr) and "double_s" in out) \
                and "Exception ignored" not in stderr:
            # ^C's own exit: the caller's excepthook's one line, or Python's traceback of the bare
            # KeyboardInterrupt when it came before the hook was set (no other exception on top;
            # with --double, the second ^C's KeyboardInterrupt raised while handling the first).
            stderr = ""
        if "double_s" in out and sig == signal.SIGINT and rc == -signal.SIGINT and re.fullmatch(
                r"(KeyboardInterrupt\n)?Exception ignored in: <module 'threading'.*KeyboardInterrupt: ?", stderr, re.S):
            # --double: the second ^C came in the interpreter's own shutdown (threading._shutdown
            # joining a worker thread), which prints and ignores it; the checks below still apply.
            out["interrupt_in_shutdown"], stderr = True, ""
        # The handler's SystemExit raised where the interpreter ignores exceptions ("Exception
        # ignored in": an importlib weakref callback, threading._shutdown, an atexit callback such
        # as lowlevel's exit drain, lowlevel.host.later, whose items are what a SIGKILL leaves for
        # cleanup): Python drops it and the caller goes on. Counted; the checks still apply.
        swallowed = sig in unwinding and bool(re.fullmatch(
            r"Exception ignored in .*(SystemExit: 143|KeyboardInterrupt: ?)", stderr, re.S))
        if sig == signal.SIGINT and rc == 1 and "Fatal Python error: init_import_site" in stderr \
                and stderr.endswith("KeyboardInterrupt"):
            # The ^C came while the interpreter itself started (its site import): CPython exits 1
            # with a "Fatal Python error" before any code of ours ran. Counted, not an anomaly.
            out["interrupted_python_startup"] = True
            expected_rc, stderr = (1,), ""
        if out.get("finished_before_kill"):
            expected_rc = (0,)
        if self.victim == "sandbox" and sig is not None:
            # The caller was not signalled: it ends on its own, cleanly (see the module docstring).
            expected_rc, swallowed = (tuple(range(256)) if kind.startswith("cli") else (0, 1)), False
            if "Traceback" not in stderr and "Exception ignored" not in stderr:
                out["caller_said"], stderr = stderr[-300:], ""  # its own error line: kept, not an anomaly
            unwinding = {}
        elif out["phase"] == "done" or swallowed:  # no handler runs in the shutdown; or it was dropped
            expected_rc += (0,)
        if stderr:
            out["stderr"] = stderr[-500:]
            out["stderr_tail"] = _traceback_tail(stderr)[-1500:] if "Traceback" in stderr else ""
        if rc not in expected_rc:
            find.append({"what": "caller_exit", "rc": rc, "expected": expected_rc, "stderr": stderr[-1500:]})
        elif swallowed:
            out["sigterm_swallowed"] = True
        elif "double_s" in out and _only_signal_exceptions(stderr):
            out["double_traceback"] = True  # the second signal's own exception, printed by Python or asyncio
        elif "Traceback (most recent call last)" in stderr or "Exception ignored in" in stderr:
            # The SIGTERM handler's SystemExit prints nothing: a traceback is an error while unwinding.
            find.append({"what": "caller_traceback", "rc": rc, "stderr": _traceback_tail(stderr)})
        needles = [self.root.encode(), marker.encode()]
        # What the caller started: give it GRACE_S to go by itself.
        deadline = time.monotonic() + GRACE_S
        while True:
            out["reaped"] = out.get("reaped", 0) + reap()
            procs = trial_processes(needles)
            loops = loop_devices(self.root)
            if not procs and not loops or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out["settle_s"] = round(time.monotonic() - (kill_at or t0) - (0 if kill_at else out["caller_s"]), 3)
        if procs:
            find.append({"what": "processes_after_grace", "processes": [describe(p) for p in procs]})
        if loops:
            find.append({"what": "loop_devices_after_grace", "devices": loops})
        # Before the cleanup: what it will have to do (the temporaries show kills inside a commit).
        out["records_before_cleanup"] = [n for n in listdir(ident.records) if n.startswith(f"{caller_pid}-")]
        out["cgroups_before_cleanup"] = len(run_cgroups(caller_pid))
        clean = subprocess.run(ident.argv([sys.executable, "-m", "lowlevel", "cleanup", "--json"]),
                               env=ident.env(tdir), cwd="/", capture_output=True, timeout=120)
        reap()
        try:
            report = json.loads(clean.stdout)
        except ValueError:
            report = {"unparsed": clean.stdout.decode(errors="replace")[-1500:]}
        # cleanup also sweeps the host's shared cgroup bases (``/sys/fs/cgroup/pids/lowlevel``...)
        # for the empty run cgroups of any dead pid, another user's killed callers included:
        # only what names this caller's pid or lies in the campaign dir is the trial's.
        removed_all = report.get("removed", []) if isinstance(report, dict) else []
        removed = [i for i in removed_all if isinstance(i, dict) and self.ours(i, caller_pid)]
        out["cleanup"] = {"rc": clean.returncode, "removed": removed,
                          "foreign_removed": len(removed_all) - len(removed),
                          "found": report.get("found", []) if isinstance(report, dict) else report,
                          "problems": report.get("problems", []) if isinstance(report, dict) else []}
        if self.victim == "sandbox" and removed:
            find.append({"what": "survived_but_left", "removed": removed})  # the caller lived: its clean-up ran
        elif sig in unwinding and rc in unwinding[sig] and rc not in (-signal.SIGTERM, -signal.SIGHUP) and removed \
                and not out.get("sigterm_swallowed") and "double_s" not in out:
            # The caller unwound (its handler's SystemExit ran the library's finally blocks) and
            # still left cleanup something: what only a SIGKILL should leave.
            find.append({"what": "unwound_but_left", "removed": removed})
        elif "double_s" in out and removed:
            out["double_left"] = True  # a second signal may cut the unwinding short: cleanup's to remove
        problems = out["cleanup"]["problems"]
        mine = [p for p in problems if self.root in str(p) or re.search(rf"\b(run-)?{caller_pid}-", str(p))]
        if clean.returncode != 0 and (mine or not problems):
            find.append({"what": "cleanup_rc", "rc": clean.returncode, "problems": mine,
                         "stdout": clean.stdout.decode(errors="replace")[-2000:],
                         "stderr": clean.stderr.decode(errors="replace")[-1000:]})
        deadline = time.monotonic() + 2.0
        while True:
            reap()
            procs = trial_processes(needles)
            if not procs or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if procs:
            find.append({"what": "processes_after_cleanup", "processes": [describe(p) for p in procs]})
        loops = loop_devices(self.root)
        if loops:
            find.append({"what": "loop_devices_after_cleanup", "devices": loops})
        # Our runs mount only in their anchors' namespaces, on /run/lowlevel/mnt (root) or the
        # base's .mnt (under the campaign dir): a host mount elsewhere naming lowlevel is another
        # user's (the test suite's probe mounts in /tmp), counted apart.
        mounts = sorted(mount_lines() - self.mounts_before)
        ours = [ln for ln in mounts if self.root in ln or "/run/lowlevel" in ln]
        out["foreign_mounts"] = len(mounts) - len(ours)
        if ours:
            find.append({"what": "mounts", "lines": ours})
        cgs = run_cgroups(caller_pid)
        if cgs:
            find.append({"what": "cgroups", "paths": cgs})
        records = [n for n in listdir(ident.records) if n.startswith(f"{caller_pid}-")]
        records += [f"/run/lowlevel/cgroups/{n}" for n in listdir("/run/lowlevel/cgroups")
                    if n.startswith(f"{caller_pid}-")]
        records += [f"/run/lowlevel/handover/{n}" for n in listdir("/run/lowlevel/handover")
                    if n.startswith(f"{caller_pid}-")]
        if records:
            find.append({"what": "records", "paths": records})
        if listdir(os.path.join(tdir, "upper")):
            find.append({"what": "upper_dir", "entries": listdir(os.path.join(tdir, "upper"))})
        # The workspaces.
        # Without the overlay the program writes into the workspace itself: a program killed
        # mid-write leaves its own temporary there (no commit step to leave it out).
        allow_part = sig in unwinding or self.victim == "sandbox" or kind.endswith("_nooverlay")
        checks = [(ws, compare(manifest(ws), old, new, allow_part)) for ws in params["workspaces"]]
        base = os.path.join(tdir, "base")
        stray = []
        for name in listdir(base):
            path = os.path.join(base, name)
            if name == ".mnt" and os.path.isdir(path) and not listdir(path):
                continue
            if kind == "pool" and name.startswith("run-") and os.path.isdir(path) and not os.path.islink(path):
                checks.append((path, compare(manifest(path), {}, new, allow_part)))
                continue
            if name.startswith("conflict-") and os.path.isdir(path):
                # A commit refused as a conflict saved the run's changes here (user data, kept).
                find.append({"what": "conflict_saved", "path": path, "entries": len(manifest(path)),
                             "stderr": stderr[-600:]})
                continue
            stray.append(name)
        if stray:
            find.append({"what": "workspace_base", "entries": stray})
        out["workspaces"] = [{"state": c["state"], "temporaries": len(c["temporaries"]), "parts": len(c["parts"])}
                             for _ws, c in checks]
        if kind == "pool_template" and checks and checks[0][1]["state"] != "old":
            find.append({"what": "template_written", "workspace": checks[0][0], "state": checks[0][1]["state"]})
        for ws, c in checks:
            if c["bad"]:
                find.append({"what": "entries_neither_old_nor_new", "workspace": ws, "count": len(c["bad"]),
                             "entries": c["bad"][:10]})
            if c["temporaries"]:
                find.append({"what": "commit_temporaries_after_cleanup", "workspace": ws,
                             "entries": c["temporaries"][:10]})
        if trial_seed is None:
            got = [c["state"] for _ws, c in checks]
            if kind == "pool_template":
                if got != ["old"]:
                    find.append({"what": "control", "detail": f"template {got}, expected old"})
            elif kind == "pool":
                used = sum(s == "new" for s in got)
                if used < params["calls"]:
                    find.append({"what": "control", "detail": f"{used} pool workspaces new, expected "
                                 f"{params['calls']}: {got}"})
            elif any(s != "new" for s in got):
                find.append({"what": "control", "detail": f"workspaces {got}, expected all new"})
        if not find and not keep:
            shutil.rmtree(tdir, ignore_errors=True)
        return out


# ---------------------------------------------------------------------------- reporting

def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over one (kind, user)'s trials. ``cleanup_removed``: trials in which ``lowlevel
    cleanup`` removed something of that kind (``commit``: temporaries of a commit the kill
    interrupted; ``cgroup``: the run cgroups of the dead caller)."""
    s: dict[str, Any] = {"trials": len(trials), "SIGKILL": 0, "SIGTERM": 0, "SIGINT": 0, "SIGHUP": 0,
                         "SIGQUIT": 0, "doubled": 0, "double_left": 0, "finished_before_kill": 0,
                         "phases": {}, "ws_old": 0, "ws_new": 0, "ws_mixed": 0, "ws_partial": 0,
                         "records_before_cleanup": 0, "cgroups_before_cleanup": 0, "cleanup_removed": {},
                         "sigterm_cleanup_removed": 0, "cleanup_foreign_removed": 0, "sigterm_swallowed": 0,
                         "anomalies": 0, "victims": {}, "no_victim": 0,
                         "anomalies_by_what": {}}
    for t in trials:
        if t.get("finished_before_kill"):
            s["finished_before_kill"] += 1
        elif t["signal"]:
            s[t["signal"]] += 1
        s["phases"][t["phase"]] = s["phases"].get(t["phase"], 0) + 1
        for w in t["workspaces"]:
            s["ws_" + w["state"]] += 1
            s["ws_partial"] += bool(w["parts"])
        s["records_before_cleanup"] += bool(t["records_before_cleanup"])
        s["cgroups_before_cleanup"] += bool(t["cgroups_before_cleanup"])
        items = t["cleanup"]["removed"]
        s["cleanup_foreign_removed"] += t["cleanup"]["foreign_removed"]
        for k in {item.get("kind", "?") for item in items}:
            s["cleanup_removed"][k] = s["cleanup_removed"].get(k, 0) + 1
        # A SIGTERMed (SystemExit) or SIGINTed (KeyboardInterrupt) caller unwinds: did it still
        # leave cleanup something to do?
        s["sigterm_cleanup_removed"] += bool(items) and t["signal"] in ("SIGTERM", "SIGINT") \
            and not t.get("finished_before_kill")
        s["sigterm_swallowed"] += bool(t.get("sigterm_swallowed"))
        s["doubled"] += "double_s" in t
        s["double_left"] += bool(t.get("double_left"))
        s["anomalies"] += bool(t["findings"])
        s["no_victim"] += bool(t.get("no_victim"))
        if "victim" in t:
            s["victims"][t["victim"]] = s["victims"].get(t["victim"], 0) + 1
        for what in {f.get("what", "?") for f in t["findings"]}:
            s["anomalies_by_what"][what] = s["anomalies_by_what"].get(what, 0) + 1
    return s


def table(summary: dict[str, dict[str, Any]], controls: dict[str, Any]) -> str:
    """The Markdown table of the summary."""
    head = ("kind", "user", "trials", "SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "done first",
            "workspaces old/new/mixed/partial", "cleanup removed (trials)", "control s", "anomalies")
    rows = [head]
    for key, s in summary.items():
        kind, user = key.split("/")
        removed = ", ".join(f"{k} {v}" for k, v in sorted(s["cleanup_removed"].items())) or "-"
        bad = ", ".join(f"{k} {v}" for k, v in sorted(s["anomalies_by_what"].items()))
        c = controls.get(key, {})
        rows.append((kind, user, str(s["trials"]), str(s["SIGKILL"]), str(s["SIGTERM"]), str(s["SIGINT"]),
                     str(s["SIGHUP"]),
                     str(s["finished_before_kill"]),
                     f"{s['ws_old']}/{s['ws_new']}/{s['ws_mixed']}/{s['ws_partial']}", removed,
                     str(c.get("caller_s", "-")), f"{s['anomalies']}" + (f" ({bad})" if bad else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main

def _subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@contextlib.contextmanager
def throwaway_user(name: str, keep: bool):
    try:
        existing = pwd.getpwnam(name)
    except KeyError:
        existing = None
    if existing is not None:
        yield existing
        return
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
    print(f"created user {name} (useradd -M)", flush=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        if not keep:
            subprocess.run(["userdel", name], check=False)
            print(f"removed user {name}", flush=True)


def _git_head() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def self_test(root: str) -> list[str]:
    """Each check above, shown not vacuous: plant what it must find, find it, remove it. Returns
    the checks that failed to see their plant."""
    failed = []
    marker = f"lowlevel-kill-selftest-{os.getpid()}"
    # A process the "caller" left behind: an orphan, reparented to us (the subreaper).
    subprocess.run(["sh", "-c", f"sleep 30 {marker} </dev/null >/dev/null 2>&1 &"], check=True)
    time.sleep(0.2)
    left = trial_processes([marker.encode()])
    if not left:
        failed.append("processes: an orphaned 'sleep' was not seen")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)
    reap()
    # A workspace entry neither old nor new, one missing, a commit temporary.
    d = os.path.join(root, "selftest-ws")
    os.mkdir(d)
    OPS["apply"](d, [["write", "a", "old-a", 10], ["write", "b", "old-b", 10]])
    old = manifest(d)
    OPS["apply"](d, [["write", "a", "new-a", 10], ["write", "b", "new-b", 10]])
    new = manifest(d)
    OPS["apply"](d, [["write", "a", "half", 5], ["delete", "b"], ["write", COMMIT_TEMP + "1-1", "t", 1]])
    c = compare(manifest(d), old, new, allow_part=False)
    if {b["path"] for b in c["bad"]} != {"a", "b"} or not c["temporaries"] or c["state"] != "mixed":
        failed.append(f"workspace: compare() missed a half or missing entry or a temporary: {c}")
    shutil.rmtree(d)
    # A run cgroup of a dead pid under a lowlevel base.
    fake_pid = 4194304 + 7  # above pid_max's ceiling: never a live pid
    planted = [os.path.join(m, "lowlevel", f"run-{fake_pid}-selftest") for m in cgroup_mounts()
               if os.path.isdir(os.path.join(m, "lowlevel"))][:1]
    for p in planted:
        os.mkdir(p)
    if planted and not run_cgroups(fake_pid):
        failed.append(f"cgroups: {planted} not seen")
    for p in planted:
        os.rmdir(p)
    # A mount in this namespace naming the campaign dir, and a loop device backed by a file there.
    before = mount_lines()
    mnt = os.path.join(root, "selftest-mnt")
    os.mkdir(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "lowlevel-kill-selftest", mnt], check=True)
    try:
        if not mount_lines() - before:
            failed.append("mounts: a tmpfs on the campaign dir was not seen")
    finally:
        subprocess.run(["umount", mnt], check=True)
        os.rmdir(mnt)
    img = os.path.join(root, "selftest.img")
    with open(img, "wb") as f:
        f.truncate(1 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", img], capture_output=True, text=True)
    if dev.returncode == 0:
        try:
            if not loop_devices(root):
                failed.append(f"loop devices: {dev.stdout.strip()} on {img} not seen")
        finally:
            subprocess.run(["losetup", "-d", dev.stdout.strip()], check=False)
    else:
        failed.append(f"loop devices: losetup failed ({dev.stderr.strip()}): not checked")
    os.unlink(img)
    return failed


def calibrate(camp: Campaign, kind: str, ident: Identity, fixed: float | None) -> tuple[float, dict[str, Any]]:
    """The control trial (no kill), and the workload scale at which the caller lives about
    ``TARGET_S`` on this machine now (so that the kill instants in [0, 1 s] land across its
    whole life, the commit included, whatever the load): up to four controls, each rescaled by
    the last one's duration. ``fixed``: that scale, one control."""
    scale = fixed or 1.0
    for attempt in range(1 if fixed else 4):
        c = camp.trial(kind, ident, None, scale)
        if c["findings"] or fixed or TARGET_S[0] <= c["caller_s"] <= TARGET_S[1] or attempt == 3:
            break
        mid = (TARGET_S[0] + TARGET_S[1]) / 2
        scale = round(min(8.0, max(0.2, scale * mid / max(c["caller_s"], 0.05))), 2)
    return scale, c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=30, help="killed trials per kind and user (default 30)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {','.join(KINDS)}")
    ap.add_argument("--as", dest="who", choices=("root", "user", "both"), default="both")
    ap.add_argument("--seed", type=int, default=None, help="campaign seed (default: random, printed)")
    ap.add_argument("--replay", type=int, default=None, metavar="TRIAL_SEED",
                    help="run the one trial of this seed (per kind and user given) and keep its directory")
    ap.add_argument("--scale", type=float, default=None,
                    help="workload scale (default: calibrated per kind and user by the control trials; "
                    "give the one printed to --replay a trial)")
    ap.add_argument("--json", metavar="FILE", help="write every trial and the summary here")
    ap.add_argument("--user", default=DEFAULT_USER, help=f"the unprivileged user (default {DEFAULT_USER})")
    ap.add_argument("--keep-user", action="store_true", help="do not remove a user this run created")
    ap.add_argument("--signals", default="KILL,TERM",
                    help=f"comma-separated signals a trial picks from, of {','.join(SIGNALS)} (default KILL,TERM: "
                    "the seeds of earlier campaigns replay as they ran)")
    ap.add_argument("--double", action="store_true",
                    help=f"send a trial's signal (not KILL) a second time, 0-{DOUBLE_WINDOW_S} s after the first")
    ap.add_argument("--victim", choices=("caller", "sandbox"), default="caller",
                    help="who gets the signal: the caller (default), or a random process it started (SIGKILL)")
    ap.add_argument("--dir", help="campaign directory (default: a fresh /var/tmp/lowlevel-kill-*, removed after)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("run as root (the unprivileged half runs as --user through setpriv)")
    kinds = [k for k in args.kinds.split(",") if k]
    try:
        signals = tuple(SIGNALS[n] for n in args.signals.split(",") if n)
    except KeyError as err:
        ap.error(f"unknown signal {err.args[0]!r} in --signals (of {','.join(SIGNALS)})")
    if not signals:
        ap.error("--signals names no signal")
    for k in kinds:
        if k not in KINDS:
            ap.error(f"unknown kind {k!r}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    print(f"kill_campaign: seed {seed}, commit {_git_head()[:12]}, {args.trials} trials per kind and user, "
          f"kinds {','.join(kinds)}, as {args.who}, signals {args.signals}, victim {args.victim}", flush=True)
    _subreaper()
    root = args.dir or tempfile.mkdtemp(prefix="lowlevel-kill-", dir="/var/tmp")
    os.makedirs(root, exist_ok=True)
    os.chmod(root, 0o755)
    failed = self_test(root)
    print(f"self-test (each check finds a planted leftover): {'ok' if not failed else failed}", flush=True)
    if failed:
        return 2
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    controls: dict[str, Any] = {}
    started = time.time()
    who = ["root", "user"] if args.who == "both" else [args.who]
    with contextlib.ExitStack() as stack:
        camp = Campaign(root, signals, double=args.double, victim=args.victim)
        idents = []
        for w in who:
            pw = None if w == "root" else stack.enter_context(throwaway_user(args.user, args.keep_user))
            idents.append(Identity(w, pw, root))
        for ident in idents:
            for kind in kinds:
                if ident.pw is not None and kind in ROOT_ONLY:
                    continue
                key = f"{kind}/{ident.who}"
                if args.replay is not None:
                    t = camp.trial(kind, ident, args.replay, args.scale or 1.0, keep=True)
                    results.append(t)
                    print(json.dumps(t, indent=1, default=str), flush=True)
                    continue
                scale, c = calibrate(camp, kind, ident, args.scale)
                controls[key] = {"caller_s": c["caller_s"], "scale": scale, "workload": sized(kind, scale),
                                 "marks": c["marks"], "findings": c["findings"], "alive_span": c.get("alive_span")}
                if c["findings"]:
                    print(f"{key}: CONTROL FAILED, kind skipped: {json.dumps(c['findings'], default=str)[:3000]}",
                          flush=True)
                    continue
                print(f"{key}: control {c['caller_s']} s at scale {scale} (files, MiB, work s = "
                      f"{sized(kind, scale)}), marks {c['marks']}"
                      + (f", descendants alive {c['alive_span']} s" if "alive_span" in c else ""), flush=True)
                for i in range(args.trials):
                    t = camp.trial(kind, ident, rng.getrandbits(32), scale)
                    t["key"] = key
                    results.append(t)
                    if t["findings"]:
                        print(f"  ANOMALY {key} trial {i} seed {t['trial_seed']} scale {scale} {t['signal']} at "
                              f"{t['instant_s']} s ({t['phase']}): {json.dumps(t['findings'], default=str)[:3000]}",
                              flush=True)
                done = [t for t in results if t.get("key") == key]
                s = summarize(done)
                print(f"{key}: {s['trials']} trials, KILL {s['SIGKILL']} TERM {s['SIGTERM']} INT {s['SIGINT']} "
                      f"HUP {s['SIGHUP']} QUIT {s['SIGQUIT']} doubled {s['doubled']} (cleanup after: "
                      f"{s['double_left']}) done "
                      f"{s['finished_before_kill']}, ws old/new/mixed/partial {s['ws_old']}/{s['ws_new']}/"
                      f"{s['ws_mixed']}/{s['ws_partial']}, phases {s['phases']}, cleanup removed "
                      f"{s['cleanup_removed']} (after SIGTERM: {s['sigterm_cleanup_removed']}), "
                      f"victims {s['victims']} (none alive: {s['no_victim']}), anomalies "
                      f"{s['anomalies']} {s['anomalies_by_what']}", flush=True)
    if args.replay is not None:
        print(f"kept: {root}", flush=True)
        return 1 if any(t["findings"] for t in results) else 0
    summary = {}
    for key in dict.fromkeys(t["key"] for t in results):
        summary[key] = summarize([t for t in results if t["key"] == key])
    anomalies = [{**{k: t[k] for k in ("key", "trial_seed", "scale", "signal", "instant_s", "phase", "findings",
                                       "dir")},
                  "replay": f"bench/kill_campaign.py --kinds {t['kind']} --as {t['user']} --replay {t['trial_seed']} "
                            f"--scale {t['scale']} --victim {args.victim}"}
                 for t in results if t["findings"]]
    print()
    print(table(summary, controls))
    print(f"\n{len(results)} trials in {time.time() - started:.0f} s, seed {seed}, {len(anomalies)} anomalies")
    for a in anomalies:
        print(f"  {a['key']} seed {a['trial_seed']} {a['signal']} at {a['instant_s']} s ({a['phase']}): "
              f"{json.dumps(a['findings'], default=str)[:2000]}  [kept: {a['dir']}; replay: {a['replay']}]")
    if args.json:
        doc = {"schema": 1, "tool": "bench/kill_campaign.py", "date": datetime.datetime.now(datetime.UTC).isoformat(),
               "commit": _git_head(), "seed": seed, "argv": sys.argv[1:], "kernel": os.uname().release,
               "grace_s": GRACE_S, "kill_window_s": KILL_WINDOW_S, "summary": summary, "controls": controls,
               "anomalies": anomalies, "trials": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
    if not anomalies and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if anomalies else 0


if __name__ == "__main__":
    sys.exit(main())
