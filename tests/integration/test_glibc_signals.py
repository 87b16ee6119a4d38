"""Signals 32 and 33 (glibc's internal SIGCANCEL and SIGSETXID) reach no sandboxed program ignored.

glibc's ``posix_spawn`` sets them to SIG_IGN in its child (spawni.c), glibc's ``sigaction``
refuses to touch them (so ``posix_spawnattr_setsigdefault`` cannot reset them), and SIG_IGN
survives every execve: the anchor, spawned that way, passed them ignored through bwrap to every
program of a one-shot run and every Session command, whether or not the caller ignored them
(a caller's own ignore, set with the raw syscall before its exec, reached them the same way).
A shell's fork+exec gives SIG_DFL. The run guard (``native/lowlevel_guard.c``) and the session
init's command child (``native/lowlevel_init.c``) now reset exactly these two with the raw
``rt_sigaction`` before the program's exec. Blocked 32/33 never reached a program: the anchor's
``setsigmask=()`` empties the mask.

Observed, not assumed: the program prints its ``/proc/self/status``; the control is a plain
``os.posix_spawn`` on the host in the same caller, whose child has both ignored (the condition
the reset removes). Root and the unprivileged user; a caller with the two ignored, blocked, or
neither. Source: signal(7) ("a child created via fork(2) inherits ... during an execve(2), the
dispositions of handled signals are reset to the default; the dispositions of ignored signals
are left unchanged"); glibc sysdeps/unix/sysv/linux/spawni.c; nptl/pthreadP.h (SIGCANCEL 32,
SIGSETXID 33).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import lowlevel
from helpers.identities import last_json_line, runuser

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]

#: The caller: sets 32/33 ignored (IGN) or blocked (BLK) with the raw syscalls (x86_64 numbers;
#: glibc refuses them), execs itself so that the interpreter starts that way, then reports the
#: bits 32/33 of SigIgn/SigBlk of itself, a host posix_spawn child, a run's and a Session's program.
CALLER = r'''
import ctypes, json, os, platform, sys
mode = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": (13, 14), "aarch64": (134, 135)}[platform.machine()]  # rt_sigaction, rt_sigprocmask
if len(sys.argv) == 2:
    if mode == "IGN":
        ksa = (ctypes.c_ulong * 4)(1, 0, 0, 0)  # SIG_IGN
        for s in (32, 33):
            assert libc.syscall(NR[0], s, ksa, None, 8) == 0, ctypes.get_errno()
    elif mode == "BLK":
        m = ctypes.c_ulong((1 << 31) | (1 << 32))
        assert libc.syscall(NR[1], 0, ctypes.byref(m), None, 8) == 0, ctypes.get_errno()
    os.execv(sys.executable, [sys.executable, "-c", CODE, mode, "again"])  # CODE: this text (see _caller)

def bits(status):
    out = {}
    for line in status.splitlines():
        k, _, v = line.partition(":")
        if k in ("SigIgn", "SigBlk"):
            out[k] = [s for s in (32, 33) if int(v, 16) >> (s - 1) & 1]
    return out

cat = ["/bin/cat", "/proc/self/status"]
res = {"caller": bits(open("/proc/self/status").read())}
r, w = os.pipe()
pid = os.posix_spawn(cat[0], cat, {}, file_actions=[(os.POSIX_SPAWN_DUP2, w, 1)], setsigmask=())
os.close(w)
out = b""
while chunk := os.read(r, 65536):
    out += chunk
os.waitpid(pid, 0)
res["host_posix_spawn"] = bits(out.decode())
import lowlevel
res["run"] = bits(lowlevel.run(cat).stdout.decode())
with lowlevel.Session() as s:
    res["session_run"] = bits(s.run(cat).stdout.decode())
    res["session_start"] = bits(s.start(cat).wait(timeout=30).stdout.decode())
print(json.dumps(res))
'''


def _caller(sandbox, mode: str) -> dict[str, dict[str, list[int]]]:
    code = "CODE = " + repr(CALLER) + "\n" + CALLER
    proc = subprocess.run(runuser(sandbox.user, [sys.executable, "-c", code, mode]), capture_output=True, text=True,
                          timeout=150, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": sandbox.home,
                                                     "PYTHONPATH": str(Path(lowlevel.__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return last_json_line(proc)


@pytest.mark.parametrize("mode", ["none", "IGN", "BLK"])
def test_signals_32_and_33_reach_no_program_ignored_or_blocked(sandbox, mode: str) -> None:
    res = _caller(sandbox, mode)
    # The caller is what the mode says (the raw syscalls worked).
    assert res["caller"] == {"SigIgn": [32, 33] if mode == "IGN" else [],
                             "SigBlk": [32, 33] if mode == "BLK" else []}, res
    # Control: glibc's posix_spawn (what starts the anchor) leaves its child with both ignored.
    assert res["host_posix_spawn"]["SigIgn"] == [32, 33], res
    for where in ("run", "session_run", "session_start"):
        assert res[where] == {"SigIgn": [], "SigBlk": []}, (where, res)
