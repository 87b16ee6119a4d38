"""Unix sockets inside bound directories: found at plan time and masked (issue 22, item 2).

:class:`lowlevel.spec.policy.Bind` refuses a socket as a bind *source*, but a bound directory may
hold sockets (``/srv/app`` with ``run/app.sock``): connecting to a pathname unix socket needs
only write permission on it, and a D-Bus, Podman, Docker or Ray socket is code execution on
the host (bubblewrap README, "Sandbox security"). Landlock refuses that connect only from ABI 9
(``LANDLOCK_ACCESS_FS_RESOLVE_UNIX``, Linux 7.1; :mod:`lowlevel.sandbox.landlock_rules` uses it there); below
(ABI 7 on 6.15 ... 7.0) nothing in the kernel does. So, for every bind that is a directory
(unless ``Bind(allow_sockets=True)``), the plan walks the source once and masks each socket
the sandbox could reach with ``--ro-bind /dev/null <its path inside>`` after the bind: a
connect there finds a character device, not a socket, and fails with ECONNREFUSED; the mask is
a mount point, so the sandbox cannot unlink or rename it away (EBUSY), nor unmount it (no
capabilities, seccomp).

The walk (:func:`scan`): fd-relative (``openat`` with ``O_NOFOLLOW`` under the parent's fd),
never follows a symlink (a symlink is resolved inside the sandbox, where only the mounts are:
its target is either in a bind, scanned in its turn, or absent), crosses submounts (bwrap binds
recursively), and for a root caller descends only into directories the sandbox's host ids may
search (a per-run uid is nobody's: the "others" bits; a pinned ``host_uid``/``host_gid``: the
owner's or group's bits where they match). It is bounded: :data:`MAX_ENTRIES` entries,
:data:`MAX_DEPTH` levels and :data:`MAX_SECONDS`; past a bound, or in a directory the caller
cannot list, it stops there and :func:`notes` says plainly that sockets beyond were not masked.
More than :data:`MAX_MASKS` sockets (a mount each) fail the run (LaunchError).

What it cannot cover: a socket created in the bind after the scan. The scan runs once per
Policy and process (cached with the Policy's static argv), so a socket made by the host after
that (while the run goes on, or before a later run of the same Policy) is reachable where the
Landlock ABI is below 9; :func:`notes` says so in ``Result.notes``. Before each run,
:func:`revalidate` checks that the masked sockets are still where the plan found them (a
sandbox with a writable bind can rename their directory), and walks again when not.

Sources: unix(7) (connect needs write permission on the socket file); bwrap(1) ``--ro-bind``;
mount(2) and unlink(2) (EBUSY on a mount point); include/uapi/linux/landlock.h and
Documentation/userspace-api/landlock.rst (``LANDLOCK_ACCESS_FS_RESOLVE_UNIX``, ABI 9).
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import time
from collections.abc import Mapping

from lowlevel._dataclass import dataclass
from lowlevel.errors import LaunchError
from lowlevel.spec.policy import WORKSPACE_DEST, Bind, Policy

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: Entries the walk reads per bind before it stops (a virtualenv holds ~5-20k).
MAX_ENTRIES = 100_000
#: Directory levels below the bind's source the walk descends (each level holds an fd).
MAX_DEPTH = 48
#: Wall-clock bound of one bind's walk, seconds.
MAX_SECONDS = 2.0
#: Sockets masked per Policy at most (each mask is a mount in the sandbox).
MAX_MASKS = 256
#: The mask's source: a character device, so connect(2) on its path fails (ECONNREFUSED).
MASK_SOURCE = "/dev/null"
#: The first Landlock ABI that can refuse connecting to pathname unix sockets.
RESOLVE_UNIX_ABI = 9


@dataclass(frozen=True)
class BindScan:
    """What the walk of one bind found.

    Attributes:
        dest: the bind's destination inside the sandbox.
        sockets: sockets' paths inside the sandbox (under ``dest``), in walk order.
        found: ``(host path, st_dev, st_ino)`` of each socket, for :func:`revalidate`.
        incomplete: why the walk stopped short ("" when it read the whole tree): a bound,
            or directories the caller could not list.
    """

    dest: str
    sockets: tuple[str, ...] = ()
    found: tuple[tuple[str, int, int], ...] = ()
    incomplete: str = ""


def _searchable(st: os.stat_result, ids: tuple[int, int] | None) -> bool:
    """May the sandbox's host ids search (traverse) a directory with this stat? ``ids`` None:
    the caller's own (the walk's own open already answered)."""
    if ids is None:
        return True
    uid, gid = ids
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _open_dir(name: str, dir_fd: int, flags: int) -> tuple[int, "os._ScandirIterator[str]"] | str:
    """Open and list the subdirectory ``name`` of ``dir_fd`` (no symlink followed): ``(fd, its
    entries)``, ``"unlisted"`` (no permission, or it cannot be listed) or ``"gone"`` (removed or
    replaced since it was listed). Other errors propagate."""
    try:
        child = os.open(name, flags, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EPERM):
            return "unlisted"
        if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return "gone"
        raise
    try:
        return child, os.scandir(child)
    except OSError:
        os.close(child)
        return "unlisted"


def scan(source: str, dest: str, ids: tuple[int, int] | None = None, *, max_entries: int = MAX_ENTRIES,
         max_depth: int = MAX_DEPTH, max_seconds: float = MAX_SECONDS) -> BindScan:
    """Find the unix sockets beneath directory ``source`` that the sandbox could reach.

    Args:
        source: the bind's host path (absolute, resolved: :class:`lowlevel.spec.policy.Bind`).
        dest: where it appears inside the sandbox; the result's paths are under it.
        ids: root callers: the sandbox's host ``(uid, gid)`` (-1 for a per-run uid, nobody's),
            whose search bits decide where the walk descends; None: the caller's own (an
            unprivileged caller's sandbox has its uid).
        max_entries, max_depth, max_seconds: the walk's bounds.
    Returns:
        A :class:`BindScan` (a source that is not a directory: nothing found).
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        top = os.open(source, flags)
    except OSError:
        return BindScan(dest)
    found: list[tuple[str, str, int, int]] = []
    unlisted: list[str] = []
    stopped = ""
    entries = 0
    deadline = time.monotonic() + max_seconds
    # A stack of (fd, path inside, iterator over the directory's entries): fds only along the
    # current path (at most max_depth + 1 of them, each with scandir's own dup).
    stack: list[tuple[int, str, "os._ScandirIterator[str]"]] = []
    try:
        stack.append((top, dest, os.scandir(top)))
        while stack and not stopped:
            fd, inside, it = stack[-1]
            entry = next(it, None)
            if entry is None:
                it.close()
                os.close(fd)
                stack.pop()
                continue
            entries += 1
            if entries > max_entries:
                stopped = f"stopped after {max_entries} entries"
                break
            if entries % 1024 == 0 and time.monotonic() > deadline:
                stopped = f"stopped after {max_seconds:g} s ({entries} entries)"
                break
            path = f"{inside.rstrip('/')}/{entry.name}"
            try:
                if entry.is_dir(follow_symlinks=False):
                    if ids is not None and not _searchable(entry.stat(follow_symlinks=False), ids):
                        continue  # the sandbox cannot get beneath it
                    if len(stack) > max_depth:
                        stopped = f"stopped at {max_depth} directory levels ({path})"
                        break
                    opened = _open_dir(entry.name, fd, flags)
                    if opened == "unlisted":
                        unlisted.append(path)
                    elif not isinstance(opened, str):
                        stack.append((opened[0], path, opened[1]))
                elif not entry.is_file(follow_symlinks=False) and not entry.is_symlink():
                    # d_type says socket, FIFO or device (or unknown): one stat to tell.
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISSOCK(st.st_mode):
                        found.append((path, os.path.join(source, path[len(dest):].lstrip("/")), st.st_dev,
                                      st.st_ino))
            except FileNotFoundError:
                continue
    except OSError as err:
        stopped = f"stopped at an error ({err.strerror})"
    finally:
        for fd, _inside, it in stack:
            it.close()
            os.close(fd)
    why = [stopped] if stopped else []
    if unlisted:
        why.append(f"could not list {len(unlisted)} director{'y' if len(unlisted) == 1 else 'ies'} "
                   f"({', '.join(unlisted[:3])}{', ...' if len(unlisted) > 3 else ''})")
    return BindScan(dest, tuple(f[0] for f in found), tuple(f[1:] for f in found), "; ".join(why))


def sandbox_ids(policy: Policy, caller_is_root: bool) -> tuple[int, int] | None:
    if not caller_is_root:
        return None
    if policy.host_uid is None:
        return (-1, -1)  # a per-run uid and gid: nobody's
    return (policy.host_uid, policy.host_gid if policy.host_gid is not None else policy.host_uid)


def _scanned(bind: Bind) -> bool:
    return not bind.allow_sockets and os.path.isdir(bind.source)


@functools.lru_cache(maxsize=1024)
def plan(policy: Policy, caller_is_root: bool) -> tuple[BindScan, ...]:
    """One :class:`BindScan` per directory bind of ``policy`` without ``allow_sockets`` (cached
    per Policy and caller kind, like the static argv that carries the masks: its cache holds
    fewer Policies, so the argv never outlives the scan it was built from).

    Raises:
        LaunchError: more than :data:`MAX_MASKS` sockets to mask.
    """
    ids = sandbox_ids(policy, caller_is_root)
    out = tuple(scan(b.source, b.dest, ids, max_entries=MAX_ENTRIES, max_depth=MAX_DEPTH, max_seconds=MAX_SECONDS)
                for b in policy.binds if _scanned(b))
    total = sum(len(s.sockets) for s in out)
    if total > MAX_MASKS:
        worst = max(out, key=lambda s: len(s.sockets))
        raise LaunchError(f"the binds hold {total} unix sockets ({len(worst.sockets)} under {worst.dest}), more than "
                          f"the {MAX_MASKS} lowlevel masks (one mount each): bind a narrower directory, or pass "
                          "Bind(allow_sockets=True) if the sandbox may connect to them")
    return out


def revalidate(policy: Policy, caller_is_root: bool) -> bool:
    """Check, before each run, that every socket the cached plan masks is still the same socket at
    the same host path (one ``lstat`` each); if one is not, drop the cached plans so this run
    walks the binds again. Returns True when it did: the caller then drops the cached static
    argv that carries the masks too (:func:`lowlevel.sandbox.argv.static_args`; argv imports
    this module, not the other way round).

    Why: the plan is cached per Policy, and a sandbox given a writable bind can rename the
    directory holding a masked socket (the mask moves with it in that run; the socket, on the
    host, now sits at a path the cached plan does not mask): without this, the next run of the
    same Policy would leave it reachable (and bwrap would create the stale mask's path in the
    bind). A socket created later elsewhere in the bind is not seen by this check (module doc).
    """
    for s in plan(policy, caller_is_root):
        for host, dev, ino in s.found:
            try:
                st = os.lstat(host)
            except OSError:
                st = None
            if st is None or not stat.S_ISSOCK(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
                plan.cache_clear()
                return True
    return False


def workspace_masks(workspace: str, snap: Mapping[str, tuple[Any, ...]], dest: str = WORKSPACE_DEST) -> list[str]:
    """bwrap options masking the unix sockets of a handed-over workspace (the fallback without the
    copy-on-write overlay: ``workspace`` is bound as it is, so a host daemon's socket in it is
    reachable; through the overlay, a lower layer's socket is not: connect finds the overlay's
    inode, which no socket is bound to). ``snap``: the hand-over's snapshot (relative path ->
    ``(kind, ...)``, :data:`lowlevel.workspace.Snapshot`), whose ``"other"`` entries (sockets,
    FIFOs, devices) get one ``lstat`` each: no second walk."""
    out: list[str] = []
    for rel, entry in snap.items():
        if entry[0] != "other":
            continue
        try:
            if not stat.S_ISSOCK(os.lstat(os.path.join(workspace, rel)).st_mode):
                continue
        except OSError:
            continue
        out += ["--ro-bind", MASK_SOURCE, f"{dest}/{rel}"]
    return out


@functools.lru_cache(maxsize=64)
def tree_masks(root: str, dirs: tuple[str, ...],
               ids: tuple[int, int] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Masks for the unix sockets of a root filesystem tree (``Policy(rootfs=DIR)``; its
    top-level ``dirs`` are bound by path, so a live service's socket in it, a chroot's
    ``/run/dbus/system_bus_socket``, is as reachable as one in a bind: found by the red-team
    pass). The same walk and bounds as a bind's (:func:`scan`), cached per tree and ids.

    Returns:
        ``(bwrap options, notes)``: ``--ro-bind /dev/null PATH`` per socket; a note listing
        them and one per walk that stopped short.
    """
    args: list[str] = []
    notes_: list[str] = []
    masked: list[str] = []
    for name in dirs:
        found = scan(os.path.join(root, name), "/" + name, ids, max_entries=MAX_ENTRIES, max_depth=MAX_DEPTH,
                     max_seconds=MAX_SECONDS)
        masked += found.sockets
        args += [arg for path in found.sockets for arg in ("--ro-bind", MASK_SOURCE, path)]
        if found.incomplete:
            notes_.append(f"rootfs: the socket scan of {found.dest} is incomplete ({found.incomplete}): a unix socket "
                          "beyond it is not masked")
    if len(masked) > MAX_MASKS:
        raise LaunchError(f"Policy.rootfs {root} holds {len(masked)} unix sockets, more than the {MAX_MASKS} lowlevel "
                          "masks (one mount each): remove them from the tree")
    if masked:
        notes_.append(f"rootfs: masked {len(masked)} unix socket(s) of the tree (connecting fails): "
                      f"{', '.join(masked[:8])}{', ...' if len(masked) > 8 else ''}")
    return tuple(args), tuple(notes_)


def mask_args(bind: Bind, scans: tuple[BindScan, ...]) -> list[str]:
    """bwrap options masking the sockets found under ``bind`` (placed right after its bind, so a
    later bind mounted inside it is mounted over them, not under them)."""
    for s in scans:
        if s.dest == bind.dest:
            return [arg for path in s.sockets for arg in ("--ro-bind", MASK_SOURCE, path)]
    return []


def notes(policy: Policy, caller_is_root: bool, landlock_abi: int) -> list[str]:
    """``Result.notes`` lines: the sockets masked, walks that stopped short, binds that keep
    their sockets (``allow_sockets``), and, where Landlock cannot refuse connecting to pathname
    sockets (ABI < 9, or ``Policy(landlock=False)``), that one created after the scan is not
    covered. Empty for a Policy without directory binds."""
    out: list[str] = []
    landlock_covers = policy.landlock is not False and landlock_abi >= RESOLVE_UNIX_ABI
    scans = plan(policy, caller_is_root)
    masked = [p for s in scans for p in s.sockets]
    if masked:
        out.append(f"binds: masked {len(masked)} unix socket(s) found in bound directories when this Policy was "
                   f"planned (connecting fails): {', '.join(masked[:8])}{', ...' if len(masked) > 8 else ''}")
    for s in scans:
        if s.incomplete:
            out.append(f"binds: the socket scan of {s.dest} is incomplete ({s.incomplete}): a unix socket beyond "
                       "it is not masked" + ("" if landlock_covers else " and the sandbox can connect to it")
                       + "; bind a narrower directory")
    if scans and not landlock_covers and (masked or any(s.incomplete for s in scans)):
        out.append("binds: a unix socket created in a bound directory after the scan (while the run goes on, or "
                   "before a later run of the same Policy) is not masked, and Landlock "
                   + (f"ABI {landlock_abi}" if policy.landlock is not False else "(off)")
                   + f" cannot refuse connecting to it (needs ABI {RESOLVE_UNIX_ABI}, Linux 7.1)")
    kept = [b.dest for b in policy.binds if b.allow_sockets and os.path.isdir(b.source)]
    if kept:
        out.append(f"binds: unix sockets in {', '.join(kept)} stay reachable (allow_sockets=True)")
    return out


__all__ = ["BindScan", "MASK_SOURCE", "MAX_ENTRIES", "MAX_MASKS", "RESOLVE_UNIX_ABI", "mask_args", "notes", "plan",
           "revalidate", "sandbox_ids", "scan", "tree_masks", "workspace_masks"]
