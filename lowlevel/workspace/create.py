"""Making a fresh per-run workspace, filling it with inputs, and removing it.

:func:`create_workspace` makes a fresh directory under a base (:func:`ensure_base`: ours, not a
symlink, not a system directory) and copies the inputs in (:func:`copy_inputs`, never through a
symlink, only regular files and directories). A *disposable* workspace carries its creator's
pid and start time in its name (:func:`disposable_owner`) so ``lowlevel cleanup`` can remove it
once that process is gone. :func:`remove_workspace` deletes a tree without following symlinks,
:func:`chown_tree` gives one to another uid.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
from collections.abc import Iterable

from lowlevel.errors import WorkspaceError
from lowlevel.paths import unreachable
from lowlevel.host.procs import process_start_time
from lowlevel.host.trust import SYSTEM_DIRS, SYSTEM_TREES, inside
from lowlevel.workspace.files import _open_parent, _split_rel
from lowlevel.workspace.walk import _iter_tree, _open_root


def default_base() -> str:
    """The default parent of per-run workspaces: ``$LOWLEVEL_WORKSPACE_BASE`` or
    ``<tmpdir>/lowlevel-<uid>``."""
    return os.environ.get("LOWLEVEL_WORKSPACE_BASE") or _builtin_base()


def _builtin_base() -> str:
    return os.path.join(_tempdir(), f"lowlevel-{os.getuid()}")


#: The system trees no workspace base may lie in (the files of the system: lowlevel never creates
#: a directory there). :data:`~lowlevel.host.trust.SYSTEM_TREES` less ``/dev`` and ``/run``, which
#: hold the user's own temporary places (``TMPDIR=/dev/shm``, ``$XDG_RUNTIME_DIR`` =
#: ``/run/user/UID``): a default base there keeps working for the API (and its copy-on-write
#: mount directory, conflict saves), as before.
BASE_FORBIDDEN_TREES = tuple(t for t in SYSTEM_TREES if t not in ("/dev", "/run"))


def _forbidden_tree(real: str) -> str | None:
    """The :data:`BASE_FORBIDDEN_TREES` entry resolved path ``real`` lies in, or None."""
    return next((t for t in BASE_FORBIDDEN_TREES if inside(real, t)), None)


def _safe_suggestion() -> str:
    """A base to suggest in a refusal: the built-in default, unless it is refused too."""
    builtin = _builtin_base()
    real = os.path.realpath(builtin)
    if _forbidden_tree(real) is not None or real in SYSTEM_DIRS:
        return f"/var/tmp/lowlevel-{os.getuid()}"
    return builtin


def _tempdir() -> str:
    """:func:`tempfile.gettempdir` without importing tempfile (~1.5 ms with its dependencies) or
    writing a probe file into ``/tmp`` at each process start: ``$TMPDIR``, ``$TEMP``, ``$TMP``,
    then ``/tmp``, ``/var/tmp``, ``/usr/tmp``, the first that is a directory we may write; the
    current directory else. An application that set ``tempfile.tempdir`` gets that."""
    tf = sys.modules.get("tempfile")
    if tf is not None and getattr(tf, "tempdir", None):
        return str(tf.gettempdir())
    for d in [os.environ.get(v) for v in ("TMPDIR", "TEMP", "TMP")] + ["/tmp", "/var/tmp", "/usr/tmp"]:
        if d and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
            return os.path.abspath(d)
    return os.getcwd()


def ensure_base(base: str) -> str:
    """Create the base dir if needed and check that it is ours and not a symlink.

    Mode 0711: the sandbox's uid (``nobody`` for root callers) can traverse it to reach its
    own run dir but cannot list the other runs.

    Raises:
        WorkspaceError: base exists but is a symlink, not a directory, or owned by someone else
            (a squatted ``/tmp/lowlevel-<uid>``); or (EPERM, before anything is created) it is,
            contains or lies inside a system directory
            (:data:`lowlevel.host.trust.SYSTEM_DIRS`, :data:`BASE_FORBIDDEN_TREES`).
    """
    if not isinstance(base, str) or not base or "\0" in base:
        raise WorkspaceError(errno.EINVAL, f"invalid workspace base {base!r}")
    base = os.path.abspath(base)
    real = os.path.realpath(base)
    tree = _forbidden_tree(real)
    if tree is not None:
        # Checked before anything is created: LOWLEVEL_WORKSPACE_BASE=/etc/lowlevel made
        # /etc/lowlevel/run-*, which the workspace check then refused, and left both behind;
        # the API's fresh workspaces under /boot/lowlevel were not refused at all.
        raise WorkspaceError(errno.EPERM, f"refusing workspace base {base}: it is inside the system tree "
                             f"{tree}, where lowlevel creates nothing. Use a dedicated directory elsewhere, "
                             f"e.g. {_safe_suggestion()}")
    for sysdir in SYSTEM_DIRS:
        if inside(sysdir, real):
            # Never chmod (below) or fill a system or shared directory: `workspace_base="/tmp"` as
            # root made /tmp mode 0711.
            suggestion = os.path.join(sysdir, "lowlevel")
            if any(inside(suggestion, tree) for tree in SYSTEM_TREES):
                suggestion = _safe_suggestion()
            raise WorkspaceError(errno.EPERM, f"refusing workspace base {base}: it "
                                 f"{'is' if sysdir == real else 'contains'} the system directory "
                                 f"{sysdir}. Use a dedicated directory, e.g. {suggestion}")
    try:
        os.makedirs(base, 0o711, exist_ok=True)
        st = os.lstat(base)
    except OSError as err:
        raise WorkspaceError(err.errno, f"cannot create workspace base {base}: {err.strerror}") from err
    if not stat.S_ISDIR(st.st_mode):
        raise WorkspaceError(errno.ENOTDIR, f"workspace base {base} is not a directory (or is a symlink)")
    if st.st_uid != os.getuid():
        raise WorkspaceError(errno.EPERM, f"workspace base {base} is owned by uid {st.st_uid}, not by us "
                             f"({os.getuid()}); remove it or set LOWLEVEL_WORKSPACE_BASE")
    if st.st_mode & stat.S_ISVTX:
        raise WorkspaceError(errno.EPERM, f"refusing workspace base {base}: it is a shared sticky directory "
                             "(like /tmp); use a dedicated directory inside it")
    if stat.S_IMODE(st.st_mode) & 0o022:
        os.chmod(base, 0o711)
    return base


def _stat_input(src: str) -> os.stat_result:
    """The stat of input ``src`` (followed), once it is a regular file or a directory that
    :func:`_input_refusal` does not refuse; else the :class:`WorkspaceError` that says why."""
    try:
        st = os.stat(src)
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot copy input {src!r}: {err.strerror}") from err
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise WorkspaceError(errno.EINVAL, f"input {src!r} is a {_file_type(st.st_mode)}, not a regular file "
                             "or a directory: copy its content into a file first")
    refusal = _input_refusal(src)
    if refusal:
        raise WorkspaceError(errno.EACCES, f"input {src!r} is refused: {refusal}; to hand the sandbox such "
                             "data on purpose, copy what it needs into a file of your own and pass that")
    return st


def _input_refusal(src: str) -> str | None:
    """Why host path ``src`` (followed, as the copy follows it) must not be copied in, or None:
    what :func:`lowlevel.spec.policy.sensitive_reason` refuses as a bind source (credential
    locations, home directories themselves, ``/etc/shadow``, ``/proc``, ``/sys``, ``/dev``,
    ``/run``...). A copy hands the sandbox the same bytes a read-only bind would:
    ``--input /proc/self/environ`` was the caller's whole environment, secrets included."""
    from lowlevel.spec.policy import sensitive_reason  # as workspace/checks.py: keep this module light

    return sensitive_reason(os.path.realpath(src))


def copy_inputs(root: str, inputs: Iterable[str | os.PathLike[str] | tuple[str, str]]) -> list[str]:
    """Copy files or directories into the workspace root, each under its base name, or at
    the destination given with it.

    Args:
        root: the workspace.
        inputs: each a host path (copied under its base name), or a ``(host path, dest)``
            pair, ``dest`` relative to the workspace (``"data/a.csv"``; parents are created,
            never through a symlink), so inputs keep their relative layout.

    Symlinks inside copied directories are copied as symlinks (not followed). Only regular
    files and directories are copied: a device (``/dev/zero`` never ends), a FIFO or a socket
    is refused.

    Returns:
        The relative names created.
    Raises:
        WorkspaceError: an input is missing or not a regular file or directory, or it is (or
            resolves to) a location a bind would refuse (EACCES: credentials, ``/proc``,
            ``/etc/shadow``: :func:`lowlevel.spec.policy.sensitive_reason`), or two inputs
            share a destination, or it exists already, or ``dest`` is absolute or has ``..``
            (EINVAL), or a symlink is in its way.
    """
    created: list[str] = []
    for item in inputs:
        if isinstance(item, tuple):
            src, dest_rel = os.fspath(item[0]), item[1]
            parts = _split_rel(dest_rel)
            name = "/".join(parts)
        else:
            src = os.fspath(item)
            name = os.path.basename(os.path.normpath(src)) if isinstance(src, str) else ""
            parts = [name]
        if not isinstance(src, str) or "\0" in src:
            raise WorkspaceError(errno.EINVAL, f"invalid input path {src!r:.80}")
        missing = unreachable(src)
        if missing is not None:
            raise WorkspaceError(missing[0], f"input {src!r} {missing[1]}")
        if not name or name in ("..", "."):
            raise WorkspaceError(errno.EINVAL, f"input {src!r} has no usable base name")
        st = _stat_input(src)
        try:
            # The parent is opened component by component with O_NOFOLLOW and the copy goes
            # through its pinned fd: a symlink in the workspace cannot send it elsewhere.
            dfd = _open_parent(root, parts, create=True)
        except OSError as err:
            raise WorkspaceError(err.errno or errno.EIO, f"input {src!r}: cannot make {name!r} in the "
                                 f"workspace: {err.strerror} (a symlink or file in the way?)") from err
        try:
            dest = f"/proc/self/fd/{dfd}/{parts[-1]}"
            if os.path.lexists(dest):
                raise WorkspaceError(errno.EEXIST, f"input {src!r}: {name!r} already exists in the workspace "
                                     "(two inputs with the same name?)")
            try:
                if stat.S_ISDIR(st.st_mode) and not os.path.islink(src):
                    shutil.copytree(src, dest, symlinks=True, copy_function=_copy_regular)
                else:
                    _copy_regular(src, dest)
            except WorkspaceError:
                raise
            except OSError as err:
                sh = sys.modules.get("shutil")  # imported above when copytree ran
                if sh is not None and isinstance(err, sh.Error):
                    errs = err.args[0] if err.args and isinstance(err.args[0], list) else []
                    detail = f"{errs[0][2]}" + (f" (and {len(errs) - 1} more)" if len(errs) > 1 else "") \
                        if errs else err
                    raise WorkspaceError(errno.EIO, f"cannot copy input {src!r}: {detail}") from err
                raise WorkspaceError(err.errno or errno.EIO, f"cannot copy input {src!r}: {err}") from err
        finally:
            os.close(dfd)
        created.append(name)
    return created


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


def _copy_regular(src: str, dst: str) -> str:
    """Copy one regular file (content, mode, times) following a symlink at ``src``, refusing
    anything else: a device (``/dev/zero`` never ends), a FIFO (blocks forever), a socket.
    Opened ``O_NONBLOCK`` and checked with fstat, so a file swapped for a FIFO cannot hang us."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot copy input {src!r}: {err.strerror}") from err
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise WorkspaceError(errno.EINVAL, f"input {src!r} is a {_file_type(st.st_mode)}, not a regular file: "
                                 "refusing to copy it")
        os.set_blocking(f.fileno(), True)
        with open(dst, "xb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
    shutil.copystat(src, dst)
    return dst


#: Name prefix of a fresh workspace its creator removes after the run (the CLI's ``--rm``,
#: ``keep_workspace=False``): ``rm-<pid>-<start time>-``, so that ``lowlevel cleanup`` can
#: remove the ones whose creator died before it could (:func:`disposable_owner`).
DISPOSABLE_PREFIX = "rm-"


def disposable_owner(name: str) -> tuple[int, int] | None:
    """``(pid, start time)`` of the process that made the disposable workspace ``name``
    (a base name starting with :data:`DISPOSABLE_PREFIX`), or None for any other name."""
    parts = name[len(DISPOSABLE_PREFIX):].split("-") if name.startswith(DISPOSABLE_PREFIX) else []
    if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[0]), int(parts[1])


def create_workspace(inputs: Iterable[str | os.PathLike[str] | tuple[str, str]] = (),
                     base: str | None = None, *, disposable: bool = False) -> str:
    """Make a fresh per-run workspace under ``base`` and copy ``inputs`` into it.

    All or nothing: if a copy fails, the half-made workspace is removed.

    Args:
        inputs: host files or directories, each copied under its base name, or
            ``(path, dest)`` pairs (see :func:`copy_inputs`).
        base: parent directory; default :func:`default_base`.
        disposable: the caller removes it after the run (``--rm``, ``keep_workspace=False``):
            named ``rm-<pid>-<start time>-...`` (:data:`DISPOSABLE_PREFIX`) instead of
            ``run-...``, so that ``lowlevel cleanup`` removes it if the caller dies first.
    Returns:
        The workspace's absolute host path (mode 0700).
    Raises:
        WorkspaceError: see :func:`ensure_base` and :func:`copy_inputs`.
    """
    parent = ensure_base(base or default_base())
    prefix = "run-"
    if disposable:
        started = process_start_time(os.getpid())
        prefix = f"{DISPOSABLE_PREFIX}{os.getpid()}-{started}-" if started is not None else prefix
    try:
        path = _mkdtemp(parent, prefix)
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot create a workspace in {parent}: "
                             f"{err.strerror or err}") from err
    try:
        copy_inputs(path, inputs)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def _mkdtemp(parent: str, prefix: str) -> str:
    """:func:`tempfile.mkdtemp` (mode 0700, a fresh random name, never an existing entry)
    without importing tempfile."""
    for _ in range(100):
        path = os.path.join(parent, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return os.path.abspath(path)
    raise FileExistsError(errno.EEXIST, "no usable temporary directory name found", parent)


def remove_workspace(root: str) -> None:
    """Delete a workspace tree after its run, never following a symlink (``shutil.rmtree``'s
    fd-based walk). A missing tree is fine.

    A run as the caller's own uid can leave directories without ``u+w`` (``chmod 0500 d``)
    that rmtree could not empty: ours get ``u+rwx`` first. Root needs no such help.
    ``shutil.rmtree`` recurses (1,000 nested directories raise RecursionError): directories
    more than MAX_DEPTH levels deep are first moved up to the root, until none is left.

    Raises:
        WorkspaceError: the tree could not be removed entirely.
    """
    try:
        rootfd = _open_root(root)
    except WorkspaceError as err:
        if err.errno == errno.ENOENT:
            return
        raise
    try:
        me = os.getuid()
        if os.geteuid() != 0 and os.fstat(rootfd).st_uid == me:
            os.fchmod(rootfd, stat.S_IMODE(os.fstat(rootfd).st_mode) | stat.S_IRWXU)
        moved = 1
        serial = 0
        while moved:
            moved = 0

            def lift(_rel: str, name: str, dirfd: int) -> None:
                nonlocal moved, serial
                for _ in range(100):
                    serial += 1
                    try:
                        os.rename(name, f".lowlevel-deep-{serial}", src_dir_fd=dirfd, dst_dir_fd=rootfd)
                        moved += 1
                        return
                    except OSError as err:
                        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                            return

            for _rel, name, dirfd, st in _iter_tree(rootfd, too_deep=lift):
                if os.geteuid() != 0 and stat.S_ISDIR(st.st_mode) and st.st_uid == me \
                        and st.st_mode & 0o700 != 0o700:
                    try:
                        os.chmod(name, stat.S_IMODE(st.st_mode) | stat.S_IRWXU, dir_fd=dirfd, follow_symlinks=False)
                    except (OSError, NotImplementedError, ValueError):
                        continue
    except OSError:
        pass  # rmtree below reports what is left
    finally:
        os.close(rootfd)
    try:
        shutil.rmtree(root)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise WorkspaceError(err.errno or errno.EIO, f"cannot remove workspace {root}: {err}") from err


def chown_tree(root: str, uid: int, gid: int, *, only_from: int | None = None) -> None:
    """Give the tree to uid:gid without following symlinks (lchown).

    Regular files with several hard links are skipped: changing their owner would change the
    owner of the other names too, which may lie outside the workspace. Iterative; directories
    more than MAX_DEPTH levels deep are given too but not entered.

    Args:
        only_from: when set, change only entries currently owned by this uid.
    """
    def fix(name: str, dir_fd: int | None, st: os.stat_result) -> None:
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            return
        if only_from is not None and st.st_uid != only_from:
            return
        if st.st_uid != uid or st.st_gid != gid:
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)

    st = os.lstat(root)
    fix(root, None, st)
    if not stat.S_ISDIR(st.st_mode):
        return
    rootfd = _open_root(root)
    try:
        for _rel, name, dirfd, st in _iter_tree(rootfd):
            try:
                fix(name, dirfd, st)
            except FileNotFoundError:
                pass
    finally:
        os.close(rootfd)
