"""The mount side of copy-on-write workspaces: can this host run one, and where it mounts.

A run's workspace is the lower layer of an overlayfs that the anchor (``native/lowlevel_exec.c``)
mounts in a private mount namespace before bwrap starts; the run's writes land in an upper
directory on a sized tmpfs (so a run's disk use is bounded by default), and the caller reads
them after the run through an fd the anchor hands over (:mod:`lowlevel.workspace.overlay` turns them into
a change report and applies or discards them). The user's directory is never written during
the run and never changes owner or mode.

This module holds what the launcher needs to set that up:

- :func:`cow_support`: can this host (kernel, filesystem of the workspace, caller) run the
  overlay, cached per filesystem; otherwise the launcher falls back to handing the workspace
  over (:func:`lowlevel.workspace.hand_over`) and says so in ``Result.notes``;
- :func:`mount_dir`: the empty directory the anchor mounts the run's tmpfs on (each run's
  mount exists only in its own mount namespace, so every run shares it);
- :func:`commit_budget`, :func:`upper_inodes`: the bounds of a run's upper tmpfs.

The per-run host uid of a root caller's sandbox is :class:`lowlevel.workspace.uids.UidLease`.

Sources: overlayfs.rst (userxattr: Linux 5.11; idmapped layers: 5.19), mount_setattr(2)
(MOUNT_ATTR_IDMAP: 5.12; tmpfs: 6.3), tmpfs(5) (user xattrs: 6.6).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
import threading

from lowlevel._dataclass import dataclass
from lowlevel.errors import WorkspaceError

#: Default bound on a run's writes (the upper tmpfs), bytes: ``Limits.workspace_bytes`` when
#: unset. Above it, writes inside fail with ENOSPC and the host disk is untouched.
DEFAULT_UPPER_BYTES = 1 << 30
#: Where root callers' runs mount their tmpfs (in their own mount namespaces): it must be
#: traversable by every per-run uid, so its parent is 0711.
ROOT_STATE_DIR = "/run/lowlevel"



def commit_budget(upper_bytes: int) -> int:
    """Cap on the file content a commit (or a save after a conflict) writes to the host, bytes.

    The upper layer holds at most ``upper_bytes`` of data, and a commit copies files hole for
    hole, so an honest run commits at most that much; hard-linked files the commit cannot keep
    as links (past :data:`lowlevel.workspace.overlay.MAX_LINKED` inodes, or a link over an existing name)
    are copied once per name, hence the factor 2. A hostile run that links one file over
    thousands of names would otherwise write (names x size) to the host disk from a bounded
    upper; past this cap the commit is refused (nothing applied, a warning says so).
    """
    return 2 * upper_bytes


def upper_inodes(size: int) -> int:
    """Inode bound of an upper tmpfs of ``size`` bytes: empty files and dirs cost host disk too
    (at most 2^32, the anchor's ceiling for ``nr_inodes``)."""
    return min(max(1024, size // 1024), 1 << 32)




def ensure_root_state_dir() -> str:
    """Create ``/run/lowlevel`` (0711, root's) and its ``mnt`` (0755); return the state dir.

    Raises:
        WorkspaceError: it exists but is a symlink, not a directory, or not root's.
    """
    for path, mode in ((ROOT_STATE_DIR, 0o711), (os.path.join(ROOT_STATE_DIR, "mnt"), 0o755)):
        try:
            st = os.lstat(path)  # the common case, once per run: it exists (no failing mkdir)
        except FileNotFoundError:
            try:
                os.mkdir(path, mode)
            except FileExistsError:
                pass
            except OSError as err:
                raise WorkspaceError(err.errno, f"cannot create {path}: {err.strerror}") from err
            st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o022:
            raise WorkspaceError(errno.EPERM, f"{path} must be a directory owned by root, not writable by others; "
                                 "remove it and run again")
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)
    return ROOT_STATE_DIR


def mount_dir(base: str | None = None) -> str:
    """The empty directory runs mount their upper tmpfs on (in their own mount namespaces).

    Root callers: ``/run/lowlevel/mnt``. Others: ``<workspace base>/.mnt`` (the base is the
    caller's own 0711 ``/tmp/lowlevel-<uid>``), created when missing.

    Raises:
        WorkspaceError: the directory cannot be made or is not ours.
    """
    if os.geteuid() == 0:
        return os.path.join(ensure_root_state_dir(), "mnt")
    from lowlevel.workspace.create import default_base, ensure_base
    root = ensure_base(base or default_base())
    path = os.path.join(root, ".mnt")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot create {path}: {err.strerror}") from err
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise WorkspaceError(errno.EPERM, f"{path} is not a directory of ours: remove it and run again")
    return path


@dataclass(frozen=True)
class CowSupport:
    """Whether a copy-on-write workspace works here, and why not.

    Attributes:
        ok: the overlay can be used for workspaces on this filesystem by this caller.
        reason: why not (one line, for ``Result.notes`` and ``lowlevel doctor``), else "".
        transient: the probe failed for a reason of the caller's, not of the host (a limit of
            its own: EMFILE, ENFILE, ENOMEM, EAGAIN; EINTR; the probe killed by a signal). Such
            an answer is never cached (in this process or in :mod:`lowlevel.host.hostcache`) and a
            run refuses to start on it rather than fall back (:class:`lowlevel.errors.LaunchError`).
    """

    ok: bool
    reason: str = ""
    transient: bool = False


def submounts(path: str) -> list[str]:
    """Mount points strictly below ``path`` (absolute, resolved) in our mount namespace, from
    ``/proc/self/mountinfo`` (field 5, octal escapes undone; proc(5)). Empty when unreadable."""
    prefix = path.rstrip("/") + "/"
    found: list[str] = []
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split(b" ")
                if len(fields) < 5:
                    continue
                point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
                text = os.fsdecode(point)
                if text.startswith(prefix):
                    found.append(text)
    except OSError:
        return []
    return found


_cow_cache: dict[tuple[int, int], CowSupport] = {}
_cow_lock = threading.Lock()


def cow_support(workspace: str, probe: "functools.partial[CowSupport] | None" = None) -> CowSupport:
    """Can runs on ``workspace``'s filesystem use the overlay? Cached per (st_dev, euid).

    ``LOWLEVEL_NO_OVERLAY`` (any non-empty value) turns it off: workspaces are then handed
    over to the sandbox as in lowlevel 0.1 (:func:`lowlevel.workspace.hand_over`). Decided
    by a real probe (``probe``: the launcher's trial run of the anchor with an overlay
    on this directory, which exits at once), once per filesystem and process.
    """
    if os.environ.get("LOWLEVEL_NO_OVERLAY"):
        return CowSupport(False, "copy-on-write workspace turned off (LOWLEVEL_NO_OVERLAY is set)")
    try:
        dev = os.stat(workspace).st_dev
    except OSError:
        return CowSupport(False, "workspace not reachable")
    if os.geteuid() != 0:
        # Per workspace, never cached: one directory holding a mount point must neither make
        # every workspace of its filesystem fall back, nor get the cached "yes" and fail.
        below = submounts(workspace)
        if below:
            return CowSupport(False, f"the workspace holds mount points ({', '.join(below[:3])}"
                              f"{', ...' if len(below) > 3 else ''}): overlayfs refuses a lower layer with "
                              "submounts in an unprivileged caller's user namespace (they are locked)")
    key = (dev, os.geteuid())
    with _cow_lock:
        found = _cow_cache.get(key)
    if found is not None:
        return found
    if probe is None:
        result = CowSupport(True)
    else:
        result = probe()
    if not result.transient:
        with _cow_lock:
            _cow_cache[key] = result
    return result


def forget_cow_support() -> None:
    """Drop this process's cached :func:`cow_support` answers (``lowlevel doctor`` re-checks)."""
    with _cow_lock:
        _cow_cache.clear()


__all__ = ["CowSupport", "DEFAULT_UPPER_BYTES", "ROOT_STATE_DIR", "commit_budget", "cow_support",
           "ensure_root_state_dir", "forget_cow_support", "mount_dir", "submounts", "upper_inodes"]
