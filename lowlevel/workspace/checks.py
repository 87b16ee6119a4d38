"""Which host directories may be a workspace: refusals before anything touches one.

A workspace is bound read-write into the sandbox and, for a root caller, handed to the
sandbox's uid for the run: :func:`check_workspace_path` refuses system and sensitive
directories (:func:`workspace_refusal`), a read-only file system (:func:`check_writable_fs`)
and ancestors another user could swap (:func:`lowlevel.host.trust.check_trusted_ancestors`);
:func:`check_traversable` that the sandbox's uid can reach it.
"""

from __future__ import annotations

import errno
import os
import stat

from lowlevel.errors import WorkspaceError
from lowlevel.paths import configured_cache_dir
from lowlevel.host.trust import SYSTEM_DIRS, SYSTEM_TREES, check_trusted_ancestors, inside


def workspace_refusal(path: str) -> str | None:
    """Say why host directory ``path`` must not be a workspace, or None.

    Refused: ``/`` and the system directories (:data:`SYSTEM_DIRS`), anything inside a system
    tree (:data:`SYSTEM_TREES`), a directory containing any of those, and whatever
    :func:`lowlevel.spec.policy.sensitive_reason` flags (home directories and anything containing
    one, credential locations, ``/run``, sockets). Behind this: ``lowlevel run --workspace /root``
    as root handed all of ``/root`` to uid 65534 for the run.

    Args:
        path: absolute and resolved (``os.path.realpath``).
    """
    from lowlevel.spec.policy import sensitive_reason  # policy imports seccomp and limits: keep this module light

    reason = sensitive_reason(path)
    if reason:
        return reason
    for sysdir in SYSTEM_DIRS:
        if inside(sysdir, path):
            what = "is" if sysdir == path else "contains"
            return f"it {what} the system directory {sysdir}"
    for tree in SYSTEM_TREES:
        if inside(path, tree):
            return f"it is inside the system tree {tree}"
    return None


def check_workspace_path(path: str, *, allow_sensitive: bool = False, check_ancestors: bool = True,
                         writable: bool = True) -> None:
    """Refuse a workspace :func:`workspace_refusal` flags, before anything touches it.

    Args:
        path: absolute and resolved (``os.path.realpath``).
        allow_sensitive: skip the check (API ``allow_sensitive_workspace=True``, CLI
            ``--allow-sensitive``).
        check_ancestors: also :func:`check_trusted_ancestors` (whenever the workspace will be
            reached by path again; a copy-on-write run opens it once, by fd).
        writable: also :func:`check_writable_fs` and :func:`check_cache_outside` (whenever the
            run's changes will be written into it: a read-only workspace is fine for a
            copy-on-write run that commits nothing).
    Raises:
        WorkspaceError: (EPERM) the message says why and how to override.
    """
    if check_ancestors:
        check_trusted_ancestors(path)
    if writable:
        check_writable_fs(path)
    reason = None if allow_sensitive else workspace_refusal(path)
    if reason:
        raise WorkspaceError(errno.EPERM, f"refusing workspace {path}: {reason}. The workspace is bound "
                             "read-write into the sandbox (and, for a root caller, handed to the sandbox's "
                             "uid for the run): use a dedicated project directory, or pass "
                             "allow_sensitive_workspace=True (CLI: --allow-sensitive) if you really mean it")
    if writable and not allow_sensitive:
        check_cache_outside(path)


def check_cache_outside(path: str) -> None:
    """Refuse a workspace the run may write into that contains lowlevel's cache directory
    (:func:`lowlevel.paths.configured_cache_dir`, existing or not); ``allow_sensitive`` skips it,
    as it skips the home-directory refusal (a workspace holding ``~/.bashrc`` is as much).

    lowlevel loads what is cached there as its own code and data (the dataclasses' code objects,
    :mod:`lowlevel._dataclass`, run with ``marshal``; compiled seccomp filters,
    :mod:`lowlevel.host.hostcache`), trusting any file of the caller's uid in a 0700 directory of
    theirs. A commit writes the program's files into the workspace as exactly that: a program
    that wrote ``.cache/dataclass-code.marshal`` (and the 0700 directory) into a workspace holding
    ``LOWLEVEL_CACHE_DIR`` had its code run by the caller's next ``import lowlevel``, outside the
    sandbox (found by the red team, as lowlevel-test).

    Raises:
        WorkspaceError: EPERM, naming the cache directory and how to move it.
    """
    cache = configured_cache_dir()
    if cache is None:
        return
    real = os.path.realpath(os.path.abspath(cache))
    if inside(real, path):
        raise WorkspaceError(errno.EPERM, f"refusing workspace {path}: it contains lowlevel's cache directory "
                             f"{cache}, whose files lowlevel loads as its own code (the run's commit could plant "
                             "them): set LOWLEVEL_CACHE_DIR to a directory outside the workspace (or "
                             "LOWLEVEL_NO_CACHE=1), or pass allow_sensitive_workspace=True (CLI: --allow-sensitive) "
                             "if you really mean it")


def check_writable_fs(path: str) -> None:
    """Refuse a workspace on a read-only file system, before anything runs.

    The workspace is bound read-write and, for root callers, handed to the sandbox's uid and
    back (chown), which a read-only mount refuses with EROFS; the program's writes would fail
    too. Source: statvfs(3) ``ST_RDONLY``.

    Raises:
        WorkspaceError: (EROFS) the message names the mount's state and what to do.
    """
    try:
        readonly = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot check workspace {path}: {err.strerror}") from err
    if readonly:
        raise WorkspaceError(errno.EROFS, f"workspace {path} is on a read-only file system: the sandbox needs a "
                             "writable workspace. Copy the files in with --input (inputs=[...]), or bind the "
                             "directory read-only with --ro (Bind(...)) and keep a fresh workspace")


def check_traversable(path: str, uid: int, gid: int) -> None:
    """Check that uid:gid can reach ``path`` (execute permission on each ancestor).

    bwrap resolves bind sources as the user it runs as, so a root caller's workspace under a
    0700 directory (``/root/...``) is unreachable for ``nobody``.

    Raises:
        WorkspaceError: an ancestor blocks traversal; the message names it and the fix.
    """
    cur = os.path.dirname(os.path.abspath(path))
    while True:
        st = os.stat(cur)
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            raise WorkspaceError(errno.EACCES, f"workspace {path} is not reachable by the sandbox's uid {uid}: "
                                 f"{cur} is mode {stat.S_IMODE(st.st_mode):04o}. Put the workspace under a "
                                 f"world-traversable directory or run `chmod o+x {cur}`")
        if cur == "/":
            return
        cur = os.path.dirname(cur)
