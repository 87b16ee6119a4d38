"""A root filesystem tree as the sandbox's system: its layout, paths inside it, its hash.

``Policy(rootfs=PATH)`` (or ``Policy(image=...)``, whose rootfs lives in the image store)
replaces the host's ``/usr``, ``/bin``, ``/lib*`` and ``/etc`` with the top-level entries of
PATH: each directory is bound read-only at the same name (``--ro-bind PATH/usr /usr``), each
top-level symlink recreated (``--symlink usr/bin /bin``), each top-level regular file bound
read-only. ``/proc``, ``/dev``, ``/tmp``, ``/dev/shm`` and ``/workspace`` stay the sandbox's own
(:data:`RESERVED_TOP` entries of the tree are ignored); the sandbox root is bwrap's tmpfs,
remounted read-only, as in host mode. A fresh bind per top-level entry rather than one
``--ro-bind PATH /`` because bwrap must create the mount points ``/workspace`` (and any bind
destination) and cannot in a read-only tree.

Writable root (``Policy(rootfs_writable=True)``): a per-run writable layer, discarded after the
run, by the first of:

1. the anchor's overlay (wherever the copy-on-write workspace works: ``native/lowlevel_exec.c``
   ``--root-lower-fd``): one overlay of the whole tree at ``<mnt>/root`` in the anchor's private
   mount namespace, its upper layer on the run's tmpfs (bounded by ``Limits.workspace_bytes``
   together with the workspace's writes), for root callers over an idmapped clone of the tree
   mapping its owner to the sandbox's host ids (so an image's root-owned ``/usr`` is the
   sandbox's to write: ``pip install`` into system paths works); each top-level directory is
   bound read-write from it (``--bind <mnt>/root/usr /usr``).
2. bwrap >= 0.9.0 (``--overlay-src``/``--tmp-overlay`` in ``bwrap --help``): each top-level
   directory becomes an overlay whose upper layer is a tmpfs bwrap makes and drops.
   Feature-detected; Debian 12 ships bwrap 0.8.0.
3. otherwise (no overlay at all: ``LOWLEVEL_NO_OVERLAY=1``, old kernels): a sized tmpfs
   (``--size`` = ``Limits.tmp_size_bytes``) over each *empty* scratch directory of the tree
   (:data:`SCRATCH_DIRS`: ``/var/tmp``, ``/run``, ``/home``...); writing to ``/usr`` or ``/etc``
   fails with EROFS.

Submodules: :mod:`lowlevel.rootfs.store` reads the image store (the tree an ``image=`` names);
:mod:`lowlevel.rootfs.resolve` applies both to a Policy when a run is planned (the checks of
:func:`check_rootfs` and friends run there, not when the Policy is built).

Source: bwrap(1) (``--ro-bind``, ``--symlink``, ``--tmpfs``, ``--size``; ``--overlay-src``,
``--tmp-overlay`` since bubblewrap 0.9.0, NEWS); overlayfs.rst in the kernel docs.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from collections.abc import Callable, Iterator, Sequence

from lowlevel._dataclass import dataclass
from lowlevel.errors import PolicyError
from lowlevel.spec.validate import resolve_host

#: Top-level names the sandbox always provides itself; a rootfs entry with that name is ignored.
RESERVED_TOP = ("dev", "proc", "sys", "tmp", "workspace")
#: ``/etc`` files that ``network=True`` binds from the host over the tree's own (name resolution),
#: when the tree has them as regular files (bwrap cannot create a mount point in a read-only tree).
NETWORK_ETC = ("etc/resolv.conf", "etc/hosts")
#: Files the launcher mounts over (synthesized ``/etc/passwd`` and ``/etc/group``): they must
#: exist in the tree as regular files.
REQUIRED_FILES = ("etc/passwd", "etc/group")
#: Directories the ``rootfs_writable`` fallback makes writable (a fresh sized tmpfs each) when the
#: tree has them empty: nothing of the image is hidden.
SCRATCH_DIRS = ("home", "media", "mnt", "opt", "root", "run", "srv", "var/cache", "var/lib/apt/lists",
                "var/log", "var/mail", "var/spool", "var/tmp", "usr/local/bin", "usr/local/lib",
                "usr/local/share")
#: Symlinks followed while resolving one path inside the tree before giving up (Linux's limit).
MAX_SYMLINKS = 40
#: Bytes hashed per read in :func:`tree_sha256`.
_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class RootfsLayout:
    """The top level of a root filesystem tree, as the argv needs it.

    Attributes:
        path: absolute, resolved host path of the tree.
        dirs: top-level directory names (``"usr"``, ``"etc"``...), bound read-only.
        files: top-level regular file names, bound read-only.
        symlinks: ``(target, "/name")`` pairs recreated with ``--symlink``.
        network_etc: the :data:`NETWORK_ETC` entries present as regular files (``"etc/hosts"``).
        scratch_dirs: :data:`SCRATCH_DIRS` entries that are empty real directories in the tree.
    """

    path: str
    dirs: tuple[str, ...]
    files: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...]
    network_etc: tuple[str, ...]
    scratch_dirs: tuple[str, ...]


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_empty_dir(path: str) -> bool:
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        with os.scandir(path) as it:
            return next(it, None) is None
    except OSError:
        return False


def symlink_on_the_way(layout: RootfsLayout, dest: str, *, parent_only: bool = False) -> str | None:
    """The first component of sandbox path ``dest`` that is a symlink of the tree, or None.

    bwrap creates and mounts on its setup paths (:func:`lowlevel.sandbox.argv.setup_paths`) before it
    pivots into the sandbox: a symlink of the tree on the way is resolved against bwrap's
    intermediate root, where ``/oldroot`` is the host's ``/`` and ``/newroot/proc/self/fd/3`` an
    fd of the host's ``/proc``. An image whose ``/run`` (or ``/etc/ssl``, or a directory under a
    bind's destination) is a symlink to ``/oldroot/home/you`` made bwrap create mount points on
    the host's tree, as the sandbox's uid (issue 22 item 1, the CVE-2024-21626 class). Paths
    whose first component is not in the tree (``/workspace``, ``/tmp``...) are bwrap's own
    mount points: None.

    Args:
        layout: the tree's top level (:func:`rootfs_layout`).
        dest: absolute path inside the sandbox.
        parent_only: check only the components above the last (``--symlink``, which creates
            the last one itself).
    Returns:
        The sandbox path of the symlink (``"/etc/ssl"``), or None. Walks with ``O_NOFOLLOW``
        fds relative to the tree; a missing or non-directory component ends the walk (bwrap
        then fails, or creates inside the read-only tree: neither leaves it).
    """
    parts = [p for p in dest.split("/") if p and p != "."]
    if parent_only:
        parts = parts[:-1]
    if not parts:
        return None
    if "/" + parts[0] in {name for _target, name in layout.symlinks}:
        return "/" + parts[0]
    if parts[0] not in layout.dirs:
        return None
    try:
        fd = os.open(os.path.join(layout.path, parts[0]), _DIR_FLAGS)
    except OSError:
        return None
    try:
        for i, name in enumerate(parts[1:], start=2):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                return None
            if stat.S_ISLNK(st.st_mode):
                return "/" + "/".join(parts[:i])
            if not stat.S_ISDIR(st.st_mode):
                return None
            nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    return None


def check_setup_paths(layout: RootfsLayout, paths: Sequence[tuple[str, str]]) -> None:
    """Refuse bwrap setup paths (``(option, path)``, :func:`lowlevel.sandbox.argv.setup_paths`) that go
    through a symlink of the tree (:func:`symlink_on_the_way`). The tree's own layout passes:
    its top-level entries are single components.

    Raises:
        PolicyError: naming the option, the path and the symlink.
    """
    for opt, dest in paths:
        link = symlink_on_the_way(layout, dest, parent_only=opt == "--symlink")
        if link is not None:
            raise PolicyError(f"bwrap would set up {dest} ({opt}) through the symlink {link} of the root filesystem "
                              f"{layout.path}: bwrap resolves it on the host's tree while it sets up (the "
                              "CVE-2024-21626 class); make it a real directory in the tree, or bind elsewhere")


def _inside(root: str, rel: str) -> str:
    """Host path of ``rel`` resolved inside the tree (its symlinks are the sandbox's), ``""`` if
    missing or provided by the sandbox itself."""
    return resolve_in_root(root, "/" + rel, lambda v: v.split("/")[1] in RESERVED_TOP) or ""


def check_rootfs(path: str) -> str:
    """Validate a ``Policy(rootfs=...)`` value; return its absolute, resolved path.

    Raises:
        PolicyError: not a str, relative, missing, not a directory, the host's ``/`` or a sensitive
            location (:func:`lowlevel.spec.policy.sensitive_reason`), or without a regular ``etc/passwd``
            and ``etc/group`` (the launcher mounts synthesized ones over them, and bwrap cannot create
            a file in a read-only tree: create empty ones).
    """
    from lowlevel.spec.policy import sensitive_reason

    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise PolicyError(f"Policy.rootfs must be a directory path, got {path!r}")
    raw = os.fspath(path)
    if "\0" in raw or not os.path.isabs(raw):
        raise PolicyError(f"Policy.rootfs must be an absolute host path, got {raw!r}")
    real, st = resolve_host(raw, "Policy.rootfs")
    if not stat.S_ISDIR(st.st_mode):
        raise PolicyError(f"Policy.rootfs {raw!r} is not a directory on the host")
    reason = sensitive_reason(real)
    if reason:
        raise PolicyError(f"refusing Policy.rootfs {raw!r}: {reason}")
    _check_trusted_tree(raw, real)
    missing = [rel for rel in REQUIRED_FILES if not _is_regular(_inside(real, rel))]
    if missing:  # all of them in one message: the fix is one command
        files = " and ".join(missing)
        raise PolicyError(f"Policy.rootfs {raw!r} has no regular file {files}: lowlevel mounts a synthesized "
                          f"/{' and /'.join(missing)} over {'it' if len(missing) == 1 else 'them'} and bwrap "
                          f"cannot create {'it' if len(missing) == 1 else 'them'} in a read-only tree. Create "
                          f"empty ones (touch {' '.join(os.path.join(real, rel) for rel in missing)})")
    return real


def _check_trusted_tree(raw: str, real: str) -> None:
    """Refuse a tree another user could change under a starting sandbox.

    Its top-level entries are bound by path (``--ro-bind TREE/usr /usr``; a writable root binds
    them from the anchor's overlay of the tree): whoever may write the tree's directory could
    swap ``usr`` for a symlink to a host directory between lowlevel's check of the layout
    (:func:`layout_holds`) and bwrap's mount, and the sandbox would see (or, with a writable
    root, write) that directory. So the tree must be owned by root or the caller and writable
    by no one else, and so must each ancestor (sticky ones, like ``/tmp``, excepted).
    """
    from lowlevel.host.trust import first_untrusted_dir
    try:
        found = first_untrusted_dir(real, include_self=True)
    except OSError as err:
        raise PolicyError(f"cannot check {err.filename} of Policy.rootfs {raw!r}: {err.strerror}") from err
    if found is not None:
        cur, st = found
        raise PolicyError(f"refusing Policy.rootfs {raw!r}: {cur} (owner uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):04o}) could be changed by another user while a sandbox starts "
                          "(a top-level directory swapped for a symlink to a host directory). Keep the tree in "
                          "directories owned by root or by you and not writable by others (chmod go-w)")


@functools.lru_cache(maxsize=64)
def rootfs_layout(path: str) -> RootfsLayout:
    """Read the top level of the tree at ``path`` (absolute, resolved; once per process and path).

    Entries named in :data:`RESERVED_TOP`, and entries that are neither a directory, a regular
    file nor a symlink, are left out.

    Raises:
        PolicyError: the tree cannot be listed.
    """
    dirs: list[str] = []
    files: list[str] = []
    links: list[tuple[str, str]] = []
    try:
        names = sorted(os.listdir(path))
    except OSError as err:
        raise PolicyError(f"cannot list Policy.rootfs {path!r}: {err.strerror}") from err
    for name in names:
        if name in RESERVED_TOP:
            continue
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            links.append((os.readlink(full), "/" + name))
        elif stat.S_ISDIR(st.st_mode):
            dirs.append(name)
        elif stat.S_ISREG(st.st_mode):
            files.append(name)
    network = tuple(rel for rel in NETWORK_ETC if _is_regular(_inside(path, rel)))
    # Only real directories (no symlink on the way): a tmpfs goes exactly where the tree has it.
    scratch = tuple(rel for rel in SCRATCH_DIRS if rel.split("/")[0] in dirs
                    and _inside(path, rel) == os.path.join(path, rel) and _is_empty_dir(os.path.join(path, rel)))
    return RootfsLayout(path=path, dirs=tuple(dirs), files=tuple(files), symlinks=tuple(links),
                        network_etc=network, scratch_dirs=scratch)


def layout_holds(layout: RootfsLayout, dir_fd: int | None = None) -> bool:
    """Whether the tree still has the shape ``layout`` recorded (checked once per run).

    :func:`rootfs_layout` is cached per process, and bwrap follows symlinks in a bind source:
    a top-level directory of the layout replaced since by a symlink (``home -> /srv``) would
    bind that host directory into the sandbox (read-write with ``rootfs_writable``). Each
    directory, file (bind sources), symlink and scratch directory of the layout is checked with ``lstat``,
    relative to ``dir_fd`` (the O_PATH fd the anchor overlays) when given, else to the path.

    Returns:
        False if any entry is missing or of another type (or a symlink with another target).
    """
    def kind(rel: str) -> int | None:
        try:
            if dir_fd is not None:
                return os.stat(rel, dir_fd=dir_fd, follow_symlinks=False).st_mode
            return os.lstat(os.path.join(layout.path, rel)).st_mode
        except OSError:
            return None

    def is_dir(rel: str) -> bool:
        mode = kind(rel)
        return mode is not None and stat.S_ISDIR(mode)

    if not all(is_dir(name) for name in layout.dirs):
        return False
    for name in layout.files:  # (network_etc are destinations, resolved inside the tree by bwrap)
        mode = kind(name)
        if mode is None or not stat.S_ISREG(mode):
            return False
    for rel in layout.scratch_dirs:
        parts = rel.split("/")
        if not all(is_dir("/".join(parts[:i + 1])) for i in range(len(parts))):
            return False
    for target, dest in layout.symlinks:
        try:
            if dir_fd is not None:
                now = os.readlink(dest.lstrip("/"), dir_fd=dir_fd)
            else:
                now = os.readlink(os.path.join(layout.path, dest.lstrip("/")))
        except OSError:
            return False
        if now != target:
            return False
    return True


def base_args(layout: RootfsLayout, *, writable: bool, bwrap_options: frozenset[str], network: bool,
              network_sources: Sequence[tuple[str, str]], tmp_size: int | None,
              anchor_overlay: str | None = None) -> list[str]:
    """bwrap options mounting the tree as the sandbox's system (see the module docstring).

    Args:
        layout: from :func:`rootfs_layout`.
        writable: ``Policy.rootfs_writable``.
        bwrap_options: the installed bwrap's long options (:attr:`lowlevel.host.probe.BwrapInfo.options`).
        network: ``Policy.network``: bind the host's ``resolv.conf``/``hosts`` over the tree's.
        network_sources: ``(host source, sandbox dest)`` pairs of the host's network /etc files.
        tmp_size: ``--size`` of each fallback scratch tmpfs, bytes (None: unsized).
        anchor_overlay: with ``writable``, the merged directory of the anchor's overlay of the
            tree (``<mnt>/root``, see ``native/lowlevel_exec.c``): each top-level directory is
            bound read-write from it, in place of bwrap's ``--tmp-overlay`` or the fallback.
    Returns:
        The options, in mount order.
    """
    a: list[str] = []
    anchor = writable and anchor_overlay is not None
    overlay = writable and not anchor and "--tmp-overlay" in bwrap_options and "--overlay-src" in bwrap_options
    for name in layout.dirs:
        src = os.path.join(layout.path, name)
        if anchor:
            a += ["--bind", f"{anchor_overlay}/{name}", "/" + name]
        elif overlay:
            a += ["--overlay-src", src, "--tmp-overlay", "/" + name]
        else:
            a += ["--ro-bind", src, "/" + name]
    for name in layout.files:
        a += ["--ro-bind", os.path.join(layout.path, name), "/" + name]
    for target, name in layout.symlinks:
        a += ["--symlink", target, name]
    if writable and not overlay and not anchor:
        for rel in layout.scratch_dirs:
            if tmp_size is not None and "--size" in bwrap_options:
                a += ["--size", str(tmp_size)]
            a += ["--tmpfs", "/" + rel]
    if network:
        wanted = {"/" + rel for rel in layout.network_etc}
        for source, dest in network_sources:
            if dest in wanted:
                a += ["--ro-bind", source, dest]
    return a


# --- paths inside the tree -------------------------------------------------------------------

def resolve_in_root(root: str, inside: str, elsewhere: Callable[[str], bool]) -> str | None:
    """Resolve sandbox path ``inside`` against the tree at ``root`` as the sandbox would see it.

    Symlinks are followed *inside* the tree (an absolute target restarts at ``root``, ``..``
    stops at it), at most :data:`MAX_SYMLINKS` of them.

    Args:
        root: host path of the tree.
        inside: absolute path inside the sandbox.
        elsewhere: True for a sandbox path that another mount provides (``/proc``, a bind,
            ``/workspace``...): resolution stops there as unknown.
    Returns:
        The host path of the entry; ``""`` when it surely does not exist; None when unknown (it
        lies under ``elsewhere``, or too many symlinks).
    """
    todo = [p for p in inside.split("/") if p and p != "."]
    done: list[str] = []
    links = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        done.append(part)
        virtual = "/" + "/".join(done)
        if elsewhere(virtual):
            return None
        host = os.path.join(root, *done)
        try:
            st = os.lstat(host)
        except OSError:
            return ""
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_SYMLINKS:
                return None
            try:
                target = os.readlink(host)
            except OSError:
                return ""
            done.pop()
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p and p != "."] + todo
        elif todo and not stat.S_ISDIR(st.st_mode):
            return ""
    return os.path.join(root, *done) if done else root


# --- hashing ---------------------------------------------------------------------------------

def walk(rootfd: int, onerror: Callable[[str, OSError], None] | None = None
         ) -> Iterator[tuple[str, str, int, os.stat_result]]:
    """Pre-order walk of the tree under directory fd ``rootfd``, names in byte order.

    Never follows a symlink (every directory is opened ``O_NOFOLLOW`` relative to its parent's
    fd); iterative, so depth is bounded only by the fds it holds (one per level).

    Yields:
        ``(relpath, name, parent_dirfd, lstat)`` for every entry below the root; ``parent_dirfd``
        is valid only until the next step.
    """
    stack: list[tuple[int, str, list[str]]] = []

    def push(fd: int, rel: str) -> None:
        try:
            names = sorted(os.listdir(fd), key=os.fsencode, reverse=True)
        except OSError as err:
            if onerror is None:
                raise
            onerror(rel, err)
            names = []
        stack.append((fd, rel, names))

    push(os.dup(rootfd), "")
    try:
        while stack:
            fd, rel, names = stack[-1]
            if not names:
                stack.pop()
                os.close(fd)
                continue
            name = names.pop()
            path = f"{rel}/{name}" if rel else name
            try:
                st = os.lstat(name, dir_fd=fd)
            except FileNotFoundError:
                continue
            yield path, name, fd, st
            if stat.S_ISDIR(st.st_mode):
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as err:
                    if onerror is None:
                        raise
                    onerror(path, err)
                    continue
                push(sub, path)
    finally:
        for fd, _rel, _names in stack:
            os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


@dataclass(frozen=True)
class TreeDigest:
    """What :func:`tree_sha256` found.

    Attributes:
        sha256: hex digest (definition in :func:`tree_sha256`).
        entries: entries below the root.
        bytes: sum of regular file sizes.
    """

    sha256: str
    entries: int
    bytes: int


def tree_sha256(root: str, progress: Callable[[int], None] | None = None) -> TreeDigest:
    """Content hash of a root filesystem tree, for run records and replay.

    SHA-256 over one line per entry, in pre-order with names in byte order:
    ``relpath NUL kind NUL octal-permission-bits NUL payload LF`` where payload is the SHA-256 of
    a regular file's content (hex), a symlink's target, and empty otherwise; a symlink target
    holding an LF is given as NUL and the hex SHA-256 of the target instead. Every line then
    parses one way (a path and a target hold no NUL; a path ends at its NUL, a payload at the
    first LF): two trees hash alike only if they are alike. Without that rule, a target
    ``x LF b`` then a directory ``c`` hashed as a target ``x`` then a directory ``b LF c`` (found
    by a fresh-user trial); trees without such a target hash as before. Owners, times and inode
    numbers are left out (they differ between a root and an unprivileged unpack of the same image).

    Args:
        root: host path of the tree (read without following any symlink).
        progress: called with the bytes hashed so far, now and then.
    Raises:
        OSError: the tree cannot be read.
    """
    h = hashlib.sha256()
    entries = 0
    total = 0
    rootfd = os.open(root, _DIR_FLAGS)
    try:
        for rel, name, dirfd, st in walk(rootfd):
            entries += 1
            kind = _kind(st.st_mode)
            payload = b""
            if kind == "file":
                fh = hashlib.sha256()
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
                try:
                    while True:
                        chunk = os.read(fd, _CHUNK)
                        if not chunk:
                            break
                        fh.update(chunk)
                        total += len(chunk)
                        if progress is not None and len(chunk) == _CHUNK:
                            progress(total)
                finally:
                    os.close(fd)
                payload = fh.hexdigest().encode()
            elif kind == "symlink":
                payload = os.fsencode(os.readlink(name, dir_fd=dirfd))
                if b"\n" in payload:
                    payload = b"\0" + hashlib.sha256(payload).hexdigest().encode()
            h.update(os.fsencode(rel) + b"\0" + kind.encode() + b"\0"
                     + f"{stat.S_IMODE(st.st_mode):o}".encode() + b"\0" + payload + b"\n")
    finally:
        os.close(rootfd)
    if progress is not None:
        progress(total)
    return TreeDigest(sha256=h.hexdigest(), entries=entries, bytes=total)


def rootfs_unreachable(path: str, uid: int, gid: int) -> str | None:
    """Say why ``uid:gid`` cannot traverse to ``path`` (bwrap binds as that user), or None."""
    cur = path
    while True:
        try:
            st = os.stat(cur)
        except OSError as err:
            return f"{cur}: {err.strerror}"
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return f"{cur} is mode {stat.S_IMODE(st.st_mode):04o}"
        if cur == "/":
            return None
        cur = os.path.dirname(cur)


__all__ = ["MAX_SYMLINKS", "NETWORK_ETC", "REQUIRED_FILES", "RESERVED_TOP", "RootfsLayout",
           "SCRATCH_DIRS", "TreeDigest", "base_args", "check_rootfs", "check_setup_paths", "layout_holds",
           "resolve_in_root", "rootfs_layout", "rootfs_unreachable", "symlink_on_the_way", "tree_sha256", "walk"]
