#!/usr/bin/env python3
"""Reproducers of what bench/kill_campaign.py found (bench/README.md, "kill_campaign.py").

    python bench/kill_campaign_repro.py empty-record       # any user; deterministic
    python bench/kill_campaign_repro.py session-commit     # any user; first attempt before 2f15ab3
    python bench/kill_campaign_repro.py commit-finish      # any user; deterministic (a patched hook)
    python bench/kill_campaign_repro.py pool-close         # root (cgroups); first attempt, usually
    python bench/kill_campaign_repro.py arun-sigterm [N]   # root; timing: 1-3 hits in 300 attempts before f63938a;
                                                           # also counts exits over SLOW_S after the SIGTERM

Each prints what it saw and exits 1 when it reproduced the finding, 0 when not. State is
redirected into a temporary directory (``LOWLEVEL_RECORD_DIR``, ``LOWLEVEL_WORKSPACE_BASE``,
``LOWLEVEL_CGROUP_ROOTS=""``) and removed afterwards, after a ``lowlevel cleanup`` with the same
environment.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(REPO, "tests", "helpers"))
from interrupt_scripts import POOL_CLOSE  # noqa: E402  (the test's own script)


def _env(d: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO, "LOWLEVEL_RECORD_DIR": os.path.join(d, "records"),
            "LOWLEVEL_WORKSPACE_BASE": os.path.join(d, "base"), "LOWLEVEL_CGROUP_ROOTS": ""}


def _records(d: str) -> dict[str, int]:
    r = os.path.join(d, "records")
    return {n: os.path.getsize(os.path.join(r, n)) for n in os.listdir(r)} if os.path.isdir(r) else {}


def _cleanup(d: str) -> str:
    out = subprocess.run([sys.executable, "-m", "lowlevel", "cleanup"], env=_env(d), capture_output=True, text=True)
    return f"exit {out.returncode}: {out.stdout.strip()}"


def _until_reproduced(attempts: int, prefix: str, trial: Callable[[str, int], bool], *,
                      parent: str | None = None) -> bool:
    """Run ``trial(d, i)`` for i in range(attempts), each in a fresh directory ``d`` (its state:
    :func:`_env`) that is cleaned up (``lowlevel cleanup``) and removed afterwards; True at the
    first trial that reproduced the finding (it printed what it saw), else "not reproduced"."""
    for i in range(attempts):
        d = tempfile.mkdtemp(prefix=prefix, dir=parent)
        try:
            if trial(d, i):
                return True
        finally:
            _cleanup(d)
            shutil.rmtree(d)
    print("not reproduced")
    return False


EMPTY_RECORD = r'''
import os, signal
from lowlevel.host import run_records
real = os.write
def write(fd, data):  # the kill lands after the record's open(O_CREAT|O_EXCL), before its write(2)
    if data.startswith(b"C "):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd, data)
os.write = write
run_records.write("run-x", ["/sys/fs/cgroup/pids/lowlevel/run-x"])
'''


def empty_record() -> bool:
    """A caller killed between the open and the write of its run record leaves an empty file
    that cleanup's ``run_records.load`` refuses (ValueError: skipped), so no cleanup removes it."""
    d = tempfile.mkdtemp(prefix="repro-record-")
    try:
        subprocess.run([sys.executable, "-c", EMPTY_RECORD], env=_env(d), check=False)
        for n in (1, 2):
            print(f"lowlevel cleanup #{n}: {_cleanup(d)}; records (name: bytes): {_records(d)}")
        return any(size == 0 for size in _records(d).values())
    finally:
        shutil.rmtree(d)


SESSION_COMMIT = r'''
import os, signal, sys
import lowlevel
ws, base, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
def interrupt(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
try:
    with lowlevel.Session(workspace=ws, workspace_base=base) as s:
        s.run(["sh", "-c", "for i in $(seq 400); do echo $i > f$i; done"])
        signal.setitimer(signal.ITIMER_REAL, delay)  # lands inside commit()'s apply pass
        s.commit()
        signal.setitimer(signal.ITIMER_REAL, 0)
except KeyboardInterrupt as err:
    print("interrupted; note:", (getattr(err, "__notes__", None) or ["none"])[0][:240])
'''


def session_commit() -> bool:
    """An interrupt inside ``Session.commit()``'s apply pass: the ``with`` block's ``close()``
    commits the same upper again, meets the entries the first pass applied as host changes,
    refuses all, and saves the whole change set to ``<workspace base>/conflict-*``."""
    def trial(d: str, i: int) -> bool:
        ws, base = os.path.join(d, "ws"), os.path.join(d, "base")
        os.mkdir(ws)
        os.mkdir(base)
        delay = 0.002 + 0.001 * i
        out = subprocess.run([sys.executable, "-c", SESSION_COMMIT, ws, base, str(delay)], env=_env(d),
                             capture_output=True, text=True)
        conflicts = [n for n in os.listdir(base) if n.startswith("conflict-")]
        if conflicts:
            print(f"interrupt {delay:.3f} s into commit(): {len(os.listdir(ws))} of 400 files applied, "
                  f"then close() saved {conflicts}\n{out.stdout.strip()}")
        return bool(conflicts)

    return _until_reproduced(40, "repro-session-", trial)


COMMIT_FINISH = r'''
import os, sys
import lowlevel
from lowlevel.workspace.overlay import apply
exc = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[sys.argv[2]]
real, hit = apply.Applier.abort_cleanup, []
def abort_cleanup(self):  # the interrupt lands in the commit's finish(), as a signal handler's would
    if not hit:
        hit.append(1)
        raise exc(143) if exc is SystemExit else exc()
    return real(self)
apply.Applier.abort_cleanup = abort_cleanup
try:
    lowlevel.run(["sh", "-c", "mkdir -p d; echo new > d/f"], workspace=sys.argv[1])
except (KeyboardInterrupt, SystemExit) as err:
    print("interrupted:", type(err).__name__)
'''


def commit_finish() -> bool:
    """An interrupt inside the commit's ``Applier.finish()`` (where it removes its temporaries
    and journal): a KeyboardInterrupt there is retried (``except KeyboardInterrupt: continue``),
    a SIGTERM handler's SystemExit is not, and ``.lowlevel-commit-<pid>.journal`` stays in the
    workspace; the run's record is gone with its cgroup, so a plain ``lowlevel cleanup`` does
    not look there (``--workspace DIR`` or the next commit into it removes it)."""
    found = False
    for what in ("KeyboardInterrupt", "SystemExit"):
        d = tempfile.mkdtemp(prefix="repro-finish-")
        try:
            ws = os.path.join(d, "ws")
            os.makedirs(os.path.join(ws, "d"))
            with open(os.path.join(ws, "d", "f"), "w") as f:
                f.write("old\n")
            out = subprocess.run([sys.executable, "-c", COMMIT_FINISH, ws, what], env=_env(d), capture_output=True,
                                 text=True)
            left = [n for n in os.listdir(ws) if n.startswith(".lowlevel-commit-")]
            print(f"{what} in finish(): {out.stdout.strip() or out.stderr.strip()[-200:]}; left in the workspace: "
                  f"{left}; lowlevel cleanup: {_cleanup(d)}; left after it: "
                  f"{[n for n in os.listdir(ws) if n.startswith('.lowlevel-commit-')]}")
            found |= bool(left) and what == "SystemExit"
        finally:
            shutil.rmtree(d)
    return found


def pool_close() -> bool:
    """An interrupt inside ``Pool.close()`` abandons the sandboxes it had not closed: close()
    is never run again (``_closed`` is set), their run cgroups and records stay for the next
    sweep or ``lowlevel cleanup`` (their processes die with the caller)."""
    def trial(d: str, i: int) -> bool:
        delay = 0.001 + 0.002 * i
        subprocess.run([sys.executable, "-c", POOL_CLOSE, str(delay)], env=_env(d), check=False,
                       stdout=subprocess.DEVNULL)
        left = _records(d)
        pids = {n.split("-")[0] for n in left}
        cgroups = [os.path.join(dp, n) for dp, dns, _f in os.walk("/sys/fs/cgroup") if dp.endswith("/lowlevel")
                   for n in dns if n.split("-")[1:2] and n.split("-")[1] in pids]
        if left:
            print(f"interrupt {delay:.3f} s into close(): records {sorted(left)}, cgroups {cgroups}; "
                  f"lowlevel cleanup: {_cleanup(d)}")
        return bool(left)

    return _until_reproduced(40, "repro-pool-", trial)


ARUN = r'''
import asyncio, faulthandler, signal, sys
def dump(*_):  # on a hang: every thread's stack, then the loop's tasks and readers
    faulthandler.dump_traceback(all_threads=True)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    for t in asyncio.all_tasks(loop):
        print("task", t, file=sys.stderr)
    print("readers", sorted(loop._selector.get_map()), file=sys.stderr)
signal.signal(signal.SIGUSR1, dump)
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
import lowlevel
async def main():
    await asyncio.gather(*(lowlevel.arun(["sleep", "1"], workspace=w) for w in sys.argv[1:]))
asyncio.run(main())
'''


SLOW_S = 3.0  # an exit this long after the SIGTERM is reported (the 12 s form fixed in 7d740b7)


def arun_sigterm(attempts: int) -> bool:
    """A SIGTERM handler's SystemExit while three concurrent ``arun`` calls are in their setup
    step (one is starting the executor's thread): ``asyncio.run``'s cancellation of the others
    is cut short, their coroutines are closed later, and ``lowlevel.sandbox.aio._step`` turns
    the GeneratorExit into ``InvalidStateError: Exception is not set.`` (it catches
    BaseException, then calls ``fut.exception()`` on an unfinished future): that Run is never
    closed, and its run cgroups and record may stay for ``lowlevel cleanup``. Seen too: the caller
    never exits (both threads in futex waits, a zombie ``_lowlevel_exec`` child) until a
    second SIGTERM."""
    rng = random.Random(1)
    slow: list[float] = []  # seconds from the SIGTERM to the exit, for exits over SLOW_S

    def trial(d: str, i: int) -> bool:
        wss = [os.path.join(d, f"ws{k}") for k in range(3)]
        for w in wss:
            os.mkdir(w)
        p = subprocess.Popen([sys.executable, "-c", ARUN, *wss], stderr=subprocess.PIPE, env=_env(d))
        time.sleep(rng.uniform(0.02, 0.10))
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            _, err = p.communicate(timeout=20)
            hung = False
            if time.monotonic() - t0 > SLOW_S:
                slow.append(time.monotonic() - t0)
                print(f"attempt {i}: exited {slow[-1]:.1f} s after SIGTERM (slow; exit {p.returncode})")
        except subprocess.TimeoutExpired:
            hung = True
            kids = subprocess.run(["ps", "--ppid", str(p.pid), "-o", "pid=,stat=,cmd="], capture_output=True,
                                  text=True).stdout.strip()
            p.send_signal(signal.SIGUSR1)
            time.sleep(1)
            print(f"attempt {i}: the caller is still running 20 s after SIGTERM; threads' wchan "
                  f"{[open(f'/proc/{p.pid}/task/{t}/wchan').read() for t in os.listdir(f'/proc/{p.pid}/task')]}"
                  f"; children: {kids or 'none'}; a second SIGTERM ends it")
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate()
        if hung:
            print("its stacks and tasks:\n" + err.decode(errors="replace")[-6000:])
        if hung or b"InvalidStateError" in err:
            if not hung:
                print(f"attempt {i}: exit {p.returncode}; stderr ends:\n"
                      + "\n".join(err.decode().splitlines()[-3:]))
            print(f"records left: {sorted(_records(d))}; lowlevel cleanup: {_cleanup(d)}")
            return True
        return False

    found = _until_reproduced(attempts, "repro-arun-", trial, parent="/var/tmp")
    print(f"slow exits (over {SLOW_S} s, not hangs): {len(slow)}"
          + (f": {', '.join(f'{s:.1f}' for s in slow)} s" if slow else ""))
    return found or bool(slow)


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "empty-record":
        return int(empty_record())
    if what == "session-commit":
        return int(session_commit())
    if what == "commit-finish":
        return int(commit_finish())
    if what == "pool-close":
        return int(pool_close())
    if what == "arun-sigterm":
        return int(arun_sigterm(int(sys.argv[2]) if len(sys.argv) > 2 else 300))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
