"""Per-run records of where a run made its cgroups, so cleanup finds them after its caller dies.

A run's cgroups live under a base derived from its caller's own cgroup (``<caller's
cgroup>/lowlevel/run-...``: :func:`lowlevel.host.cgroup_detect.detect_cgroups`). A caller that a service
manager or a container runtime put in a cgroup of its own makes them where ``lowlevel cleanup``,
run from elsewhere (a shell, a timer), never looks. So :class:`lowlevel.host.cgroups.RunCgroup` writes
a record here *before* it makes its first directory and removes it *after* the last one is gone;
a caller killed in between (SIGKILL, the OOM killer, a lost SIGINT) leaves the record, and
:mod:`lowlevel.cleanup` reads it: when the recorded process no longer runs (its PID with the
start time of ``/proc/PID/stat``, so a reused PID counts as gone), it lists and removes the
recorded cgroups wherever they are, and lists commit temporaries in the recorded workspace.

Where: root ``/run/lowlevel/cgroups`` (root's, 0700; tmpfs: a reboot forgets records, and the
cgroups with them); others ``$XDG_RUNTIME_DIR/lowlevel/cgroups`` when that directory is theirs,
else ``~/.cache/lowlevel/cgroups``; ``LOWLEVEL_RECORD_DIR`` overrides (tests). No record is
written when there is no such directory we trust (the run goes on: the next
:func:`~lowlevel.host.cgroup_detect.detect_cgroups` of a caller in the same cgroup still sweeps them).

Format: one file ``<pid>-<start time>-<name>``, written with one ``write(2)``; lines ``C <pid>
<start time>``, then ``P <hex of a cgroup directory>`` per directory and at most one ``W <hex of
the workspace>``. Cost per run: one create + write + close and one unlink (tens of µs).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import field

from lowlevel._dataclass import dataclass
from lowlevel.host.procs import process_start_time

#: Root's record directory.
ROOT_RECORD_DIR = "/run/lowlevel/cgroups"

_own_start: tuple[int, int | None] | None = None  # (pid, start time): cached per process


def own_start_time() -> int | None:
    """This process's start time (clock ticks since boot), read once per process (fork-safe)."""
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:
        _own_start = (pid, process_start_time(pid))
    return _own_start[1]


def _ours(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o077


def record_dir(create: bool = True) -> str | None:
    """The record directory of this euid (see the module docstring), made 0700 when ``create``;
    None when there is none we trust (not ours, or group/other may write it)."""
    path = os.environ.get("LOWLEVEL_RECORD_DIR")
    if not path:
        if os.geteuid() == 0:
            path = ROOT_RECORD_DIR
            if create:
                try:
                    os.mkdir(os.path.dirname(path), 0o711)
                except FileExistsError:
                    pass
                except OSError:
                    return None
        else:
            runtime = os.environ.get("XDG_RUNTIME_DIR")
            if runtime and _ours(runtime):
                path = os.path.join(runtime, "lowlevel", "cgroups")
            elif os.environ.get("HOME"):
                path = os.path.join(os.environ["HOME"], ".cache", "lowlevel", "cgroups")
            else:
                return None
    if create:
        try:
            os.makedirs(path, 0o700, exist_ok=True)
        except OSError:
            return None
    return path if _ours(path) else None


def write(name: str, paths: list[str], workspace: str | None = None) -> str | None:
    """Record the cgroup directories ``paths`` of the run ``name`` (before any is made).

    Returns:
        The record's path, or None when no record could be written (no trusted directory, a
        full disk): never raises, the run goes on without one.
    """
    d = record_dir()
    start = own_start_time()
    if d is None or start is None:
        return None
    pid = os.getpid()
    lines = [f"C {pid} {start}", *(f"P {os.fsencode(p).hex()}" for p in paths)]
    if workspace is not None:
        lines.append(f"W {os.fsencode(workspace).hex()}")
    data = ("\n".join(lines) + "\n").encode()
    path = os.path.join(d, f"{pid}-{start}-{name}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, "short write")
    except OSError:
        os.close(fd)
        remove(path)
        return None
    os.close(fd)
    return path


def remove(path: str | None) -> None:
    """Delete a record (its cgroups are gone). Idempotent; never raises."""
    if path is None:
        return
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass
class Record:
    """A record read back by :func:`load`.

    Attributes:
        path: the record file.
        pid, start_time: the caller that wrote it (``/proc/PID/stat`` field 22).
        cgroups: the run's cgroup directories, as recorded.
        workspace: the run's workspace, or None.
    """

    path: str
    pid: int
    start_time: int
    cgroups: list[str] = field(default_factory=list)
    workspace: str | None = None

    def caller_alive(self) -> bool:
        """Whether the recorded caller still runs (same PID and start time; this PID namespace)."""
        return process_start_time(self.pid) == self.start_time


def load(path: str) -> Record:
    """Read one record. Raises ValueError (malformed) or OSError."""
    with open(path, "rb") as f:
        lines = f.read().decode("ascii").splitlines()
    if not lines or not lines[0].startswith("C "):
        raise ValueError(f"{path}: not a run record")
    _c, pid, start = lines[0].split()
    rec = Record(path, int(pid), int(start))
    for line in lines[1:]:
        kind, _, value = line.partition(" ")
        if kind == "P":
            rec.cgroups.append(os.fsdecode(bytes.fromhex(value)))
        elif kind == "W":
            rec.workspace = os.fsdecode(bytes.fromhex(value))
    return rec


def _entries(d: str | None) -> list[tuple[str, str]]:
    """``(name, path)`` of the record directory's entries, by name; [] when there is none or it
    cannot be read."""
    if d is None:
        return []
    try:
        return [(name, os.path.join(d, name)) for name in sorted(os.listdir(d))]
    except OSError:
        return []


def empty_dead() -> list[str]:
    """Records of nothing: empty files (``<pid>-<start time>-<name>``, 0 bytes) whose writer is
    gone. A caller killed between the record's create and its one ``write(2)`` leaves one; it
    recorded no cgroup (the record is written before the first directory), :func:`load` refuses
    it, so no other sweep ever removed it (bench/kill_campaign.py). A live writer's record is
    never listed: the name's pid and start time must not run any more."""
    d = record_dir(create=False)
    out = []
    for name, path in _entries(d):
        pid, _, rest = name.partition("-")
        start, _, _ = rest.partition("-")
        if not (pid.isascii() and pid.isdigit() and start.isascii() and start.isdigit()):
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size == 0 and process_start_time(int(pid)) != int(start):
            out.append(path)
    return out


def records() -> list[Record]:
    """Every readable record of this euid's directory (malformed ones skipped), oldest first."""
    d = record_dir(create=False)
    out = []
    for _name, path in _entries(d):
        try:
            out.append(load(path))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
    return out


__all__ = ["ROOT_RECORD_DIR", "Record", "empty_dead", "load", "own_start_time", "record_dir", "records", "remove",
           "write"]
