"""Let the suite's unprivileged half reach a checkout other users cannot, without a chmod.

Run as root, the suite also runs lowlevel as the test user (``runuser``, ``setpriv``): that user
executes this checkout's venv and imports its package and helpers. From a clone in a directory
other users cannot traverse (``~/lowlevel`` under root's 0700 home) that fails. Instead of
changing the modes of the user's directories, :func:`reach_for_other_users` moves the test
process into a mount namespace of its own (``unshare(CLONE_NEWNS)``, every mount a slave of the
host's: nothing done here propagates back; mount_namespaces(7)) where each blocking ancestor
``D`` of the checkout and of the venv is covered by a tmpfs with ``D``'s owner and mode plus the
others' search bit (``o+x``: pass through, not list; ``o+rx`` for the checkout itself), holding a recursive bind mount of each of
``D``'s entries (symlinks copied). Every path stays what it was, for root and for the test
user, with the same contents and modes, so the editable install, ``sys.executable`` and every
path the tests hand over keep working; only there, and only for this process and its children,
can other users pass through ``D`` to entries whose own modes let them in. Entries created in
``D`` itself during the run land in the tmpfs and are gone afterwards (say a ``~/.ssh`` that a
test plants and removes).

Must run while the process has a single thread (a mount namespace is per thread, inherited by
the threads and children made after): tests/conftest.py calls it at import.
"""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
from collections.abc import Iterable

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_SLAVE = 0x2, 0x4, 0x1000, 0x4000, 0x80000
NOBODY = 65534  # an "other" user for the probe: no group of the checkout's owner
SETPRIV = "/usr/bin/setpriv"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source and os.fsencode(source), os.fsencode(target), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), f"mount {source} on {target}")


def blocking_dir(paths: Iterable[str]) -> tuple[str, int] | None:
    """The outermost directory on the way to one of ``paths`` that others cannot pass, with the
    mode bits they lack: ``o+x`` on an ancestor, ``o+rx`` on the path itself (ACLs not read);
    None when others can reach them all."""
    for path in paths:
        parts = os.path.abspath(path).split("/")[1:]
        for i in range(len(parts) + 1):
            d = "/" + "/".join(parts[:i])
            try:
                st = os.stat(d)
            except OSError:
                break
            need = stat.S_IXOTH | (stat.S_IROTH if i == len(parts) else 0)
            if stat.S_ISDIR(st.st_mode) and st.st_mode & need != need:
                return d, need
    return None


def _cover(d: str, bits: int) -> None:
    """Cover directory ``d`` (in this mount namespace) with a tmpfs of the same owner and mode
    plus ``bits`` holding bind mounts of ``d``'s entries (see the module docstring)."""
    st = os.stat(d)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = os.listdir(fd)
        mode = stat.S_IMODE(st.st_mode) | bits
        _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode:o},uid={st.st_uid},gid={st.st_gid},size=64m")
        for name in names:
            # /proc/self/fd/N/name: the entry beneath the tmpfs just mounted on d.
            src = f"/proc/self/fd/{fd}/{name}"
            dst = os.path.join(d, name)
            est = os.lstat(src)
            if stat.S_ISLNK(est.st_mode):
                os.symlink(os.readlink(src), dst)
                os.lchown(dst, est.st_uid, est.st_gid)
                continue
            if stat.S_ISDIR(est.st_mode):
                os.mkdir(dst, 0o700)
            else:
                os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            _mount(src, dst, None, MS_BIND | MS_REC)
    finally:
        os.close(fd)


def others_can_import(expected: str | None, files: Iterable[str] = (), cwd: str = "/") -> str | None:
    """None when an unprivileged other user (uid/gid 65534, no groups) can run this interpreter,
    import ``lowlevel`` from ``expected`` (its ``__init__.py``: not another install found further
    down ``sys.path``) and read ``files``, as the suite's unprivileged half does; else why not.
    None too without setpriv (util-linux): the test_user fixture's own probe then decides."""
    if not os.access(SETPRIV, os.X_OK):
        return None
    code = ("import sys, lowlevel\n"
            "for f in sys.argv[1:]: open(f, 'rb').close()\n"
            "print(lowlevel.__file__)\n")
    try:
        proc = subprocess.run([SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                               sys.executable, "-c", code, *files], capture_output=True, cwd=cwd, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit status {proc.returncode}"
    got = proc.stdout.decode(errors="replace").strip()
    if expected is not None and os.path.realpath(got) != os.path.realpath(expected):
        return f"they import {got}, not {expected} (whose files they cannot read)"
    return None


def reach_for_other_users(paths: Iterable[str], expected: str | None,
                          files: Iterable[str] = ()) -> tuple[list[str], str | None]:
    """Make ``paths`` reachable by other users in a mount namespace of this process's own when
    an ancestor blocks them (see the module docstring); return ``(covered dirs, reason)``:
    ``reason`` is None when other users can now import lowlevel from ``expected`` and read
    ``files`` (:func:`others_can_import`), else one line saying why not and what to do.

    Never changes a mode on disk. Needs root (CAP_SYS_ADMIN) and a single-threaded process.
    """
    paths = [os.path.abspath(p) for p in paths]
    covered: list[str] = []
    if blocking_dir(paths) is not None and os.geteuid() == 0:
        if len(os.listdir("/proc/self/task")) != 1:
            reason = "the test process already runs several threads (a mount namespace is per thread)"
        else:
            try:
                _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
                _mount(None, "/", None, MS_REC | MS_SLAVE)
                while (found := blocking_dir(paths)) is not None and len(covered) < 64:
                    _cover(*found)
                    covered.append(found[0])
                reason = None
            except OSError as err:
                reason = str(err)
            try:
                os.chdir(os.getcwd())  # through the new mounts
            except OSError:
                pass
        if reason is not None:
            return covered, (f"other users cannot reach {' and '.join(sorted(set(paths)))} ({reason}); "
                             "run the suite from a checkout they can read (or make its parents o+x and the "
                             "checkout o+rX, as .ci/run's old recipe did)")
    why = others_can_import(expected, files)
    if why is None:
        return covered, None
    where = f" (mount namespace covering {', '.join(covered)})" if covered else ""
    return covered, (f"other users cannot import lowlevel from {sys.executable}{where}: {why}; the checkout's files "
                     "must be readable by them (chmod -R o+rX CHECKOUT, or clone with umask 022)")
