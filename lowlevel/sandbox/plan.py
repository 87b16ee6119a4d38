"""The pure parts of a run's plan: the fd numbers the child sees, the synthesized ``/etc/passwd``
and ``/etc/group``, the rlimits as the caller can set them, and the fds that carry data in
(memfds, the host ``/etc`` files bwrap copies).

The fd table (every fd number of the Python <-> C protocols, in one place):

    =====================  =====  ==========================================================
    fd (in the anchor and   who    what
    in bwrap)
    =====================  =====  ==========================================================
    0, 1, 2                 prog   stdin, stdout, stderr (pipes, the caller's fds, /dev/null)
    3 (:data:`ARGS_FD`)     bwrap  ``--args``: the NUL-separated options (a memfd)
    4                       bwrap  ``--json-status-fd`` (:data:`CHILD_FDS`)
    6                       bwrap  ``--seccomp``: the BPF program (a memfd), when there is one
    7, 8                    bwrap  ``/etc/passwd``, ``/etc/group`` (memfds)
    9, 10                   init   a Session's socket and init executable (lowlevel.session)
    9 .. 23                 prog   ``Run(extra_fds=...)``; 20, 21: the egress relay's
                                   (:class:`lowlevel.net.egress_run.EgressRun`)
    24 .. 24+n              bwrap  the host ``/etc`` files copied in (:data:`ETC_COPY_FD`)
    next two                guard  the guard's executable and its report pipe
    above those             anchor report socket, workspace (lower), rootfs, uid lease,
                                   cgroup.procs fds, cgroup dir: never passed to bwrap
    =====================  =====  ==========================================================

:meth:`lowlevel.sandbox.prepare.RunPrepare._lay_out_fds` lays the table out (``--pass-fds`` names what the
anchor passes on to bwrap; the anchor closes every other fd it inherited).
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Sequence

from lowlevel._dataclass import dataclass
from lowlevel.errors import LaunchError
from lowlevel.sandbox.argv import ETC_COPY_FD, Fds, etc_copy_refusal
from lowlevel.spec.policy import WORKSPACE_DEST
from lowlevel.spec.limits import lowered_note

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

__all__ = ["ARGS_FD", "CHILD_FDS", "ETC_COPY_FD", "EXTRA_FDS_MIN", "FdLayout", "clamp_to_own_hard_limits",
           "guard_numbers", "lay_out", "memfd", "open_etc_copy", "passwd_group"]

#: The lowest child fd ``Run(extra_fds=...)`` may use (below: the table above).
EXTRA_FDS_MIN = 9

#: Fd numbers bwrap sees (the parent dup2s onto these in the spawn's file actions).
ARGS_FD = 3
CHILD_FDS = Fds(json_status=4, seccomp=6, passwd=7, group=8)
def memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_etc_copy(path: str) -> int:
    """Open a host ``/etc`` file that bwrap copies into the sandbox (:func:`lowlevel.sandbox.argv.etc_plan`).

    ``O_NOFOLLOW``: the plan saw a regular file; one replaced by a symlink since is refused,
    not followed. What was opened is checked again (:func:`lowlevel.sandbox.argv.etc_copy_refusal`,
    one ``fstat``): the plan is made once per process, and a file that became a FIFO, a
    device, a directory, a file over the size bound or one others may no longer read must not
    be copied (bwrap would read a FIFO or ``/dev/zero`` into the root tmpfs, and the copy is
    0644 inside whatever the host file's mode).

    Raises:
        LaunchError: the file cannot be opened (removed, replaced by a symlink, no fd left),
            or is no longer one the plan may copy.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        hint = (" (it was a regular file when this process first looked; run again in a new process if it "
                "changed kind on purpose)") if err.errno in (errno.ELOOP, errno.ENOENT, errno.ENOTDIR) else ""
        raise LaunchError(f"cannot open the host's {path} to copy it into the sandbox: {err.strerror}{hint}",
                          errno=err.errno) from err
    try:
        why = etc_copy_refusal(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        os.close(fd)
        raise LaunchError(f"refusing to copy the host's {path} into the sandbox: {why} now (it was a small regular "
                          "file every user may read when this process first looked; run again in a new process "
                          "if it changed on purpose)")
    return fd


def passwd_group(uid: int, gid: int) -> tuple[bytes, bytes]:
    passwd = (f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
              f"sandbox:x:{uid}:{gid}:sandbox:{WORKSPACE_DEST}:/bin/sh\n"
              f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    group = f"root:x:0:\nsandbox:x:{gid}:\nnogroup:x:65534:\n"
    if uid in (0, 65534):
        passwd = "".join(line + "\n" for line in passwd.splitlines() if not line.startswith("sandbox:"))
    if gid in (0, 65534):
        group = "".join(line + "\n" for line in group.splitlines() if not line.startswith("sandbox:"))
    return passwd.encode(), group.encode()


def clamp_to_own_hard_limits(triples: Sequence[tuple[str, int, int]], *, may_raise: bool = False,
                             ) -> tuple[tuple[tuple[str, int, int], ...], list[str]]:
    """Lower (name, soft, hard) rlimits to what this caller can set, saying so.

    Without CAP_SYS_RESOURCE, prlimit(2) cannot raise a hard limit above our own, and the
    stricter value stays in force anyway; with it (``may_raise``), only ``RLIMIT_NOFILE`` has a
    ceiling: ``/proc/sys/fs/nr_open`` (setrlimit(2): EPERM above it).

    Returns:
        ``(triples, notes)``: the triples to apply, and one ``"warning: ..."`` note
        (:func:`lowlevel.spec.limits.lowered_note`, which the CLI prints) per lowered limit.
    """
    import resource
    out, notes = [], []
    for name, soft, hard in triples:
        if may_raise:
            bound, what = (nr_open(), "/proc/sys/fs/nr_open") if name == "RLIMIT_NOFILE" else (None, "")
        else:
            bound, what = resource.getrlimit(getattr(resource, name))[1], "this caller's hard limit"
            bound = None if bound == resource.RLIM_INFINITY else bound
        if bound is not None and hard > bound:
            notes.append(lowered_note(name, hard, bound, what, "sandbox"))
            soft, hard = min(soft, bound), bound
        out.append((name, soft, hard))
    return tuple(out), notes


@functools.lru_cache(maxsize=1)
def nr_open() -> int | None:
    """``/proc/sys/fs/nr_open`` (read once per process: a sysctl an admin rarely changes)."""
    try:
        with open("/proc/sys/fs/nr_open", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class FdLayout:
    """Where each fd of the spawn goes (the table in the module docstring, numbered for one run).

    Attributes:
        mapping: ``(fd here, fd in the anchor)`` pairs, in dup2 order: bwrap's, then the anchor's own.
        pass_fds: the child numbers above 2 the anchor passes on to bwrap (``--pass-fds``).
        anchor_fds: the anchor's own numbers: ``report``, ``lower``, ``root``, ``lease`` (each
            when present), ``cgroups`` (a list) and ``cgroup_dir`` (when present).
        threshold: one above every child number: a source below it is first moved above it, so
            no dup2 clobbers a later source and none has src == dst.
    """

    mapping: tuple[tuple[int, int], ...]
    pass_fds: tuple[int, ...]
    anchor_fds: dict[str, Any]
    threshold: int


def guard_numbers(mapping: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The guard's executable and report-pipe child fds: the first two numbers above ``mapping``'s."""
    top = max(dst for _src, dst in mapping)
    return top + 1, top + 2


def lay_out(bwrap_fds: Sequence[tuple[int, int]], anchor_own: Sequence[tuple[str, int | None]],
            cgroup_fds: Sequence[int], cgroup_dir_fd: int | None) -> FdLayout:
    """Number the anchor's own fds right above bwrap's (never passed on to bwrap). Pure.

    Args:
        bwrap_fds: ``(fd here, child fd)`` of what bwrap (and the program) get: stdio, the data
            fds, ``extra_fds``, the guard's.
        anchor_own: ``(name, fd here or None)`` of the anchor's single fds, in order.
        cgroup_fds: the run's ``cgroup.procs`` fds; cgroup_dir_fd: its cgroup v2 directory.
    """
    mapping = list(bwrap_fds)
    pass_fds = tuple(sorted(dst for _s, dst in mapping if dst > 2))
    nxt = max(dst for _s, dst in mapping) + 1
    anchor_fds: dict[str, Any] = {}
    for name, src in anchor_own:
        if src is not None:
            mapping.append((src, nxt))
            anchor_fds[name] = nxt
            nxt += 1
    anchor_fds["cgroups"] = []
    for src in cgroup_fds:
        mapping.append((src, nxt))
        anchor_fds["cgroups"].append(nxt)
        nxt += 1
    if cgroup_dir_fd is not None:
        mapping.append((cgroup_dir_fd, nxt))
        anchor_fds["cgroup_dir"] = nxt
        nxt += 1
    return FdLayout(tuple(mapping), pass_fds, anchor_fds, nxt)
