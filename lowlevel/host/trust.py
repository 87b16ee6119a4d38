"""Which host directories another local user could change under lowlevel, and the system dirs.

Whatever lowlevel reaches by path again after a check (a workspace given back after the run,
an image store, a ``Policy.rootfs`` tree bound into the sandbox) is only as safe as the
directories above it: a user who owns or may write to one of them can swap it for a symlink
between the check and the use. :func:`first_untrusted_dir` finds such a directory,
:func:`check_trusted_ancestors` refuses a workspace below one. :data:`SYSTEM_DIRS` and
:data:`SYSTEM_TREES` name the host's system directories, which lowlevel never hands out or fills.
"""

from __future__ import annotations

import errno
import os
import stat

from lowlevel.errors import WorkspaceError


#: Directories that are never a workspace themselves (the workspace is bound read-write and,
#: for root callers, handed to the sandbox's uid for the run), nor a workspace base or image
#: store that lowlevel would chmod or fill. ``/lib`` and ``/bin`` resolve into
#: ``/usr`` on usr-merged hosts; both spellings are here for the others.
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
               "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr",
               "/var", "/var/cache", "/var/lib", "/var/log", "/var/mail", "/var/spool", "/var/tmp")
#: Trees no workspace may lie inside (system files, devices, kernel interfaces, sockets).
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run",
                "/sbin", "/sys", "/usr")


def inside(path: str, parent: str) -> bool:
    """Whether ``path`` is ``parent`` or below it (both absolute and normalised; by name only)."""
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def check_trusted_ancestors(path: str) -> None:
    """Refuse a workspace whose parent directories someone else could rename or replace.

    Everything lowlevel does to a workspace after the run (giving ownership back, copying a
    sized workspace back) reaches it by path again. If another local user owns, or may write
    to, any directory above it, they can swap that directory for a symlink during the run and
    redirect root's chown/rmtree/rename to ``/etc`` (a confirmed attack). So each ancestor
    must be owned by root or by the caller, and not group/other-writable unless sticky
    (``/tmp``: others cannot rename entries they do not own). The workspace itself may
    belong to anyone: its last component is opened with O_NOFOLLOW.

    Args:
        path: absolute and resolved (``os.path.realpath``).
    Raises:
        WorkspaceError: (EPERM) names the ancestor, its owner and mode, and the fix.
    """
    try:
        found = first_untrusted_dir(path)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot check {err.filename} above workspace {path}: {err.strerror}") from err
    if found is not None:
        cur, st = found
        raise WorkspaceError(errno.EPERM, f"refusing workspace {path}: {cur} (owner uid {st.st_uid}, mode "
                             f"{stat.S_IMODE(st.st_mode):04o}) could be renamed or replaced by another user during "
                             "the run, redirecting what lowlevel does to the workspace afterwards. Use a "
                             "workspace below directories owned by root or by you and not writable by others"
                             + (" (or run lowlevel as that user)" if os.geteuid() == 0 else ""))


def first_untrusted_dir(path: str, *, include_self: bool = False) -> tuple[str, os.stat_result] | None:
    """The first directory another user could rename, replace or fill, from ``path``'s parent
    (``path`` itself first with ``include_self``) up to ``/``, with its lstat; None if none.

    Untrusted: not a directory, owned by neither root nor the caller, or writable by group or
    others, which a sticky bit excuses on an ancestor (``/tmp``: others cannot rename entries
    they do not own) but not on ``path`` itself (anyone could still add or swap its entries).

    Raises:
        OSError: an lstat failed (``filename`` names the directory).
    """
    trusted = {0, os.geteuid()}
    path = path.rstrip("/") or "/"
    cur = path if include_self else os.path.dirname(path) or "/"
    while True:
        st = os.lstat(cur)
        mode = st.st_mode
        itself = include_self and cur == path
        others_write = mode & (stat.S_IWGRP | stat.S_IWOTH) and (itself or not mode & stat.S_ISVTX)
        if st.st_uid not in trusted or not stat.S_ISDIR(mode) or others_write:
            return cur, st
        if cur == "/":
            return None
        cur = os.path.dirname(cur)


__all__ = ["SYSTEM_DIRS", "SYSTEM_TREES", "check_trusted_ancestors", "first_untrusted_dir", "inside"]
