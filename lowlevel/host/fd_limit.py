"""The caller's open-file limit: what to say when it stops another sandbox (EMFILE, ENFILE).

Each live Session holds about a dozen fds of the caller for its whole life (its socket to the
init, bwrap's pidfd and the anchor's, the setup report socket, bwrap's status and output pipes,
the upper layer's and the workspace's directory fds, the cgroup's event files: ``bench/density.py``
counts them), so a caller with the common soft ``RLIMIT_NOFILE`` of 1024 stops near 90 Sessions
although its hard limit allows far more. lowlevel does not raise the soft limit itself: that is the
program's decision, not a library's (a caller still using ``select(2)`` breaks on fds past 1023:
select(2) BUGS, "FD_SETSIZE"); the message says how.

Sources: getrlimit(2) ``RLIMIT_NOFILE``; errno(3) EMFILE ("too many open files", the process's
limit) and ENFILE (the system's, ``fs.file-max``: proc_sys_fs(5)).
"""

from __future__ import annotations

import errno
import resource

#: Errnos that mean "no fd could be made": the process's limit, or the whole system's.
FD_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE})


def open_files_hint(code: int | None = errno.EMFILE, holder: str = "each live Session holds about 11") -> str:
    """What to do when the caller ran out of fds: one sentence, the current limits in it.

    Args:
        code: the errno seen: ``ENFILE`` names the system's limit (``fs.file-max``); anything
            else the process's (``RLIMIT_NOFILE``).
        holder: how many fds what is being made keeps in the caller (said in the message).
    Returns:
        e.g. "the caller's open-file limit is reached (EMFILE: RLIMIT_NOFILE soft 1024, hard
        20000; each live Session holds about 11 fds of the caller): raise the soft limit ..."
    """
    if code == errno.ENFILE:
        return ("the system's open-file limit is reached (ENFILE: fs.file-max, proc_sys_fs(5)): raise it "
                "(sysctl fs.file-max) or run fewer sandboxes at once")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    room = (f"raise the soft limit up to {shown} (`ulimit -n {shown}` before starting the program, or "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({shown}, {shown})) in it)" if hard != soft
            else "raise the hard limit (`ulimit -Hn` as root, LimitNOFILE= of a systemd unit, limits.conf)")
    return (f"the caller's open-file limit is reached (EMFILE: RLIMIT_NOFILE soft {soft}, hard {shown}; "
            f"{holder} fds of the caller): {room}, or close sessions you no longer use")


__all__ = ["FD_EXHAUSTED", "open_files_hint"]
