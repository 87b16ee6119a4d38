"""What went wrong: the errors and notes of a run the host or bwrap stopped before (or while) it ran.

:class:`ExecError` (the command cannot be executed), :func:`classify_setup_failure` (bwrap's or
the anchor's stderr after a setup that never exec'd -> the most specific
:class:`~lowlevel.errors.LaunchError`), and the notes a Result gets when a limit or the network
policy is why the program failed (:func:`network_denial_note`, :func:`pids_note`). Pure but for
:func:`classify_setup_failure` dropping the cached host facts.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Sequence

from lowlevel.errors import BwrapNotFoundError, LaunchError
from lowlevel.spec.policy import Policy


class ExecError(LaunchError):
    """The sandbox was set up but the command could not be executed inside it.

    ``errno`` is ENOENT (not found: the CLI exits 127) or EACCES/ENOEXEC (not executable: 126).
    """


_EXEC_FAIL = rb"bwrap: execvp ([^\n]*): ([^\n]*)"  # the patterns here: compiled on first use (re's cache)
#: native/lowlevel_exec.c's message when its execv of bwrap fails.
_HELPER_EXEC_FAIL = rb"lowlevel_exec: execv ([^\n]*): ([^\n]*)"
#: What to do when a process cannot be created (EAGAIN from clone/fork/posix_spawn).
PROCESS_LIMIT_HINT = ("the caller's process limit is reached (EAGAIN: RLIMIT_NPROC, `ulimit -u`, counts every "
                      "process of your uid; or the pids.max of your cgroup, e.g. a systemd TasksMax). Raise it, or "
                      "run fewer sandboxes at once")
_USERNS_HINTS = (b"No permissions to create new namespace", b"setting up uid map", b"Creating new namespace failed",
                 b"unprivileged_userns_clone", b"user namespace")
def classify_setup_failure(stderr: bytes, argv: list[str], command: Sequence[str]) -> LaunchError:
    """Turn bwrap's stderr after a run that never exec'd into the most specific exception.

    A failure other than "command not found/not executable" also drops the cached host facts
    (:func:`lowlevel.host.hostcache.forget`): they may be what changed (a sysctl, a new bwrap), so
    the next run probes again.
    """
    err = _classify_setup_failure(stderr, argv, command)
    if not isinstance(err, ExecError):
        from lowlevel.host import hostcache
        hostcache.forget("host")
    return err


def _classify_setup_failure(stderr: bytes, argv: list[str], command: Sequence[str]) -> LaunchError:
    text = stderr.decode("utf-8", "replace").strip()
    m = re.search(_EXEC_FAIL, stderr)
    if m:
        reason = m.group(2).decode("utf-8", "replace")
        code = errno.ENOENT if "No such file" in reason else errno.EACCES
        return ExecError(f"{command[0]}: {reason.lower()} in the sandbox", argv=argv, stderr=text, errno=code)
    m = re.search(_HELPER_EXEC_FAIL, stderr)
    if m:
        # _lowlevel_exec dropped to the sandbox's host uid, then could not exec bwrap.
        path, reason = (g.decode("utf-8", "replace") for g in m.groups())
        return BwrapNotFoundError(f"cannot execute bwrap {path} as the sandbox's host uid (root callers drop to "
                                  f"it before bwrap starts): {reason}. Install bwrap where every user can run "
                                  "it (apt-get install bubblewrap puts it in /usr/bin)",
                                  argv=argv, stderr=text, errno=errno.ENOENT if "No such" in reason
                                  else errno.EACCES)
    bwrap_lines = b"\n".join(line for line in stderr.splitlines() if line.startswith(b"bwrap:"))
    anchor_lines = b"\n".join(line for line in stderr.splitlines() if line.startswith(b"lowlevel_exec:"))
    if b"Resource temporarily unavailable" in anchor_lines:
        # The anchor's own fork/clone (the sandbox's PID 1, the idmap helper) hit the limit.
        return LaunchError(f"the sandbox's processes could not be created: {PROCESS_LIMIT_HINT}. lowlevel_exec "
                           f"said: {text}", argv=argv, stderr=text, errno=errno.EAGAIN)
    if b"Resource temporarily unavailable" in bwrap_lines:
        # clone(2) fails with EAGAIN at the caller's RLIMIT_NPROC or its cgroup's pids.max, and
        # bwrap says "Creating new namespace failed": not a user-namespace restriction.
        return LaunchError(f"bwrap could not create the sandbox's processes: {PROCESS_LIMIT_HINT}. "
                           f"bwrap said: {text}", argv=argv, stderr=text, errno=errno.EAGAIN)
    if b"Cannot allocate memory" in bwrap_lines:
        return LaunchError("bwrap ran out of memory while creating the sandbox (ENOMEM: the caller's memory "
                           f"limit or its cgroup's memory.max?). bwrap said: {text}", argv=argv, stderr=text,
                           errno=errno.ENOMEM)
    if b"Can't find source path" in bwrap_lines and b"Permission denied" in bwrap_lines:
        # bwrap opens bind sources as the sandbox's host uid: a root caller's per-run uid.
        return LaunchError("the sandbox's host uid cannot reach a bind source (a root caller's sandbox runs as "
                           "an unprivileged per-run uid, and bwrap opens binds as that uid): make the source "
                           "readable and every directory above it traversable by others (chmod o+x). "
                           f"bwrap said: {text}", argv=argv, stderr=text, errno=errno.EACCES)
    if any(h in bwrap_lines for h in _USERNS_HINTS):
        return LaunchError(
            "bwrap could not create a user namespace: the host restricts unprivileged user namespaces. "
            "Fix: `sysctl -w kernel.unprivileged_userns_clone=1` (Debian < 11), "
            "`sysctl -w user.max_user_namespaces=15000`, or on Ubuntu >= 23.10 "
            "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor profile for bwrap. "
            f"bwrap said: {text}", argv=argv, stderr=text)
    if b"Error 24" in stderr or b"Too many open files" in stderr:
        # EMFILE before the program: the run's RLIMIT_NOFILE (set before bwrap's exec) is below
        # what bwrap itself opens while it builds the sandbox (ld.so loading libselinux, its
        # pipes): 12 with bwrap 0.8.0 here.
        return LaunchError("the sandbox's open-file limit is too small for bwrap itself to start (EMFILE before "
                           "the program ran): raise Limits.nofile (--nofile) to at least 16. "
                           f"bwrap said: {text}", argv=argv, stderr=text, errno=errno.EMFILE)
    what = text or ("bwrap exited during setup (its stderr was not captured: in live mode its message, if any, "
                    "is on your stderr above)")
    return LaunchError(f"sandbox setup failed: {what}", argv=argv, stderr=text)


#: A program's own report of a connect() refused with EACCES: Python's bare ``PermissionError:
#: [Errno 13] Permission denied`` (a file error names its path after a colon), node's ``connect
#: EACCES``, or a line mentioning connect with "Permission denied" (wget, nc, ...).
_CONNECT_EACCES = (rb"(?mi)PermissionError: \[Errno 13\] Permission denied\s*$|connect[^\n]*(EACCES|Permission "
                   rb"denied)|(EACCES|Permission denied)[^\n]*connect")
def network_denial_note(policy: Policy, landlock_abi: int | None, exit_code: int, stderr: bytes) -> str | None:
    """The note of a failed run whose program reported a connect() refused with EACCES, when
    the sandbox's own network policy is the cause: Landlock (ABI >= 4) denies TCP connect to
    every port without network, and to all but the egress relay's with ``network=Egress``
    (lowlevel/host/landlock.py). Cheap: one regex over the captured stderr; None otherwise."""
    if exit_code == 0 or policy.network is True or not landlock_abi or landlock_abi < 4 \
            or not re.search(_CONNECT_EACCES, stderr[-65536:]):
        return None
    if policy.network is False:
        return ("connect() refused by the sandbox's network policy (network=False: Landlock denies every TCP "
                "connect, EACCES): allow hosts with Policy(network=Egress(allow=[...])) / --allow-host, or give "
                "the host's network with network=True / --network host")
    return ("connect() refused by the sandbox's network policy (network=Egress: Landlock lets TCP reach only the "
            "egress proxy, named in HTTPS_PROXY/HTTP_PROXY; EACCES for any other address): connect through the "
            "proxy, and allow the host with Egress(allow=[...]) / --allow-host")


def pids_note(pids: int | None, exit_code: int, term: int | None) -> str:
    """The note of a run (or Session command) during which a fork/clone failed at the pids
    limit (``max`` in ``pids.events`` rose): what happened, and what the program did then."""
    then = (f"the program then exited with status {exit_code} on its own (killed_by is None: the pids limit "
            "kills nothing)" if term is None else f"the program then died by signal {term}")
    return (f"the pids limit was hit: a fork/clone failed with EAGAIN at pids.max={pids} (Limits.pids); {then}; "
            "raise Limits.pids if the program needs more processes or threads")


__all__ = ["ExecError", "PROCESS_LIMIT_HINT", "classify_setup_failure", "network_denial_note", "pids_note"]
