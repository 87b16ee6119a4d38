"""The record of a hand-over (:class:`Handover`) and its on-disk journal, so a root caller's
death never leaves the workspace given away.

The hand-over fallback (no copy-on-write overlay: ``LOWLEVEL_NO_OVERLAY=1``, or a kernel or
filesystem without idmapped/user-namespace overlays) gives a root caller's workspace entries to
the sandbox's per-run uid for the run and back after it, from an in-memory record
(:class:`Handover`). A caller SIGKILLed in between left every entry owned by
a uid that a later, unrelated sandbox is leased again, and the root 0770 with its group.

Now :func:`lowlevel.workspace.hand_over` writes the record here as it goes: one line per entry
*before* that entry is chowned (a ``write(2)`` each, unbuffered: a killed process loses
nothing it wrote), so the journal always covers every entry changed.
:func:`lowlevel.workspace.handover.recover` (run by ``lowlevel cleanup`` and by the next
hand-over of the same workspace) rebuilds the record of each journal whose caller is gone
(:func:`pending`, :func:`load`) and whose recorded anchor and bwrap are gone too
(:func:`sandbox_alive`), gives the workspace back with :func:`lowlevel.workspace.give_back`
(same rules as after a normal run: owners, modes, setuid/setgid bits, ACLs), and removes the
journal.

Where: ``/run/lowlevel/handover/<pid>-<serial>`` (root's, 0700; a tmpfs on most systems, so a
reboot forgets journals, but a reboot also ends every sandbox, and the workspace then keeps the
per-run uid: ``lowlevel cleanup`` cannot know it either; documented). Only root callers change
owners, so only they journal.

Format (text, one record per line, fields separated by one space; paths as hex of their bytes):
``H 1 <caller pid> <root hex> <root uid> <root gid> <root mode> <sandbox uid> <new uid> <new gid>``
first, then ``E <dev> <ino> <uid> <gid> <st_mode>``, ``A <dev> <ino> <xattr name> <value hex>``
``S <dev> <ino> <size> <mtime_ns> <ctime_ns>`` and ``P caller|anchor|bwrap <pid> <starttime>`` (as
soon as each exists; the caller's right after the header, so a reused caller pid is recognised)
lines.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
from dataclasses import field

from lowlevel._dataclass import dataclass
from lowlevel.host.procs import process_start_time, uid_runs_a_process
from lowlevel.workspace import cow as _cow
from lowlevel.workspace.changes import Snapshot

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: Where journals live (root callers only).
JOURNAL_DIR = os.path.join(_cow.ROOT_STATE_DIR, "handover")
_serial = itertools.count(1)


@dataclass
class Handover:
    """What :func:`hand_over` changed and saw, for :func:`give_back` after the run.

    Attributes:
        root: the workspace's host path.
        before: the snapshot before the run (``(Snapshot, complete)``, as :func:`snapshot`).
        root_ids: ``(uid, gid, mode)`` of the root directory before the run (mode with its
            special bits).
        owners: ``{(st_dev, st_ino): (uid, gid, st_mode)}`` of every entry below the root
            before the run (the inodes that existed before it).
        pins: ``{(st_dev, st_ino): fd}``: O_PATH fds holding pre-existing setuid/setgid
            non-directories alive while the sandbox (as the caller's own uid) could delete
            them: an inode that cannot be freed cannot have its number reused by a file the
            sandbox makes, so a matching number after the run is the same file.
        sandbox_uid: the host uid the sandbox ran as when it differs from the caller's (root
            callers), else None.
        new_owner: ``(uid, gid)`` given to inodes the run created (the root's owner and group).
        acls: ``{(st_dev, st_ino): {xattr: value}}``: the POSIX ACLs (:data:`ACL_XATTRS`) of
            entries handed to the sandbox's uid that had any before the run (root callers).
        stamps: ``{(st_dev, st_ino): (size, mtime_ns, ctime_ns)}`` of pre-existing
            setuid/setgid non-directories: one whose stamp changed was written (a write
            through a ``MAP_SHARED`` mapping keeps the bits) and loses them.
        notes: what :func:`give_back` could not do exactly (for ``Result.notes``).
        done: True once :func:`give_back` ran.
        journal: root callers: the on-disk record of this hand-over
            (:class:`lowlevel.workspace.handover_journal.Journal`), removed once given back.
        lock_fd: root callers: a ``flock(LOCK_EX)`` on the root directory, held until given
            back (closed with the pins): a second hand-over of the same workspace meanwhile
            would record the first sandbox's owners as the originals and give them back.
    """

    root: str
    before: tuple[Snapshot, bool]
    root_ids: tuple[int, int, int]
    owners: dict[tuple[int, int], tuple[int, int, int]]
    pins: dict[tuple[int, int], int]
    sandbox_uid: int | None
    new_owner: tuple[int, int]
    acls: dict[tuple[int, int], dict[str, bytes]] = field(default_factory=dict)
    stamps: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    done: bool = False
    journal: Any = None
    lock_fd: int = -1


class Journal:
    """An open journal file; every ``record_*`` call is one ``write(2)``."""

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def create(cls, h: Handover, root_key: tuple[int, int] | None = None) -> Journal:
        """Start the journal of ``h`` (its header written; ``root_key``: the workspace root's
        ``(st_dev, st_ino)``, checked before a recovery touches the path). Raises OSError (then
        nothing was made)."""
        _cow.ensure_root_state_dir()
        try:
            os.mkdir(JOURNAL_DIR, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(JOURNAL_DIR)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
            raise OSError(errno.EPERM, f"{JOURNAL_DIR} must be a directory of root's, mode 0700: remove it")
        path = os.path.join(JOURNAL_DIR, f"{os.getpid()}-{next(_serial)}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        j = cls(fd, path)
        try:
            uid, gid, mode = h.root_ids
            j._write(f"H 1 {os.getpid()} {os.fsencode(h.root).hex()} {uid} {gid} {mode} {h.sandbox_uid} "
                     f"{h.new_owner[0]} {h.new_owner[1]}")
            j.record_process("caller", os.getpid())  # a reused pid is then told from us
            if root_key is not None:
                j._write(f"R {root_key[0]} {root_key[1]}")
        except BaseException:
            j.remove()
            raise
        return j

    def _write(self, line: str) -> None:
        data = (line + "\n").encode()
        if os.write(self.fd, data) != len(data):
            raise OSError(errno.ENOSPC, f"short write to {self.path}")

    def record_entry(self, key: tuple[int, int], uid: int, gid: int, mode: int) -> None:
        self._write(f"E {key[0]} {key[1]} {uid} {gid} {mode}")

    def record_acls(self, key: tuple[int, int], acls: dict[str, bytes]) -> None:
        for name, value in acls.items():
            self._write(f"A {key[0]} {key[1]} {name} {value.hex()}")

    def record_stamp(self, key: tuple[int, int], stamp: tuple[int, int, int]) -> None:
        self._write(f"S {key[0]} {key[1]} {stamp[0]} {stamp[1]} {stamp[2]}")

    def record_process(self, kind: str, pid: int) -> None:
        """Record a process whose life means the sandbox may still run: ``kind`` is
        ``"anchor"`` (after the spawn) or ``"bwrap"`` (after READY)."""
        start = process_start_time(pid)
        if start is not None:
            self._write(f"P {kind} {pid} {start}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def remove(self) -> None:
        """Close and delete (the workspace was given back). Idempotent."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass
class Entry:
    """A journal read back by :func:`load`.

    Attributes:
        caller_pid: the process that handed the workspace over.
        handover: the record :func:`lowlevel.workspace.give_back` needs (no pins).
        processes: ``(kind, pid, starttime)`` of the caller, the anchor and bwrap, as recorded.
        root_key: ``(st_dev, st_ino)`` of the workspace root when handed over (None: not recorded).
    """

    caller_pid: int
    handover: Handover
    processes: list[tuple[str, int, int]] = field(default_factory=list)
    root_key: tuple[int, int] | None = None


def load(path: str) -> Entry:
    """Read a journal back. Raises ValueError if it is malformed."""
    with open(path, "rb") as f:
        lines = f.read().decode("ascii").splitlines()
    if not lines or not lines[0].startswith("H 1 "):
        raise ValueError(f"{path}: not a lowlevel hand-over journal")
    _h, _v, pid, root_hex, ruid, rgid, rmode, suid, nuid, ngid = lines[0].split(" ")
    h = Handover(root=os.fsdecode(bytes.fromhex(root_hex)), before=({}, True),
                 root_ids=(int(ruid), int(rgid), int(rmode)), owners={}, pins={},
                 sandbox_uid=None if suid == "None" else int(suid), new_owner=(int(nuid), int(ngid)))
    entry = Entry(int(pid), h)
    for line in lines[1:]:
        rec = line.split(" ")
        if rec[0] == "P":
            entry.processes.append((rec[1], int(rec[2]), int(rec[3])))
            continue
        if rec[0] == "R":
            entry.root_key = (int(rec[1]), int(rec[2]))
            continue
        key = (int(rec[1]), int(rec[2]))
        if rec[0] == "E":
            h.owners[key] = (int(rec[3]), int(rec[4]), int(rec[5]))
        elif rec[0] == "A":
            h.acls.setdefault(key, {})[rec[3]] = bytes.fromhex(rec[4])
        elif rec[0] == "S":
            h.stamps[key] = (int(rec[3]), int(rec[4]), int(rec[5]))
        else:
            raise ValueError(f"{path}: unknown record {rec[0]!r}")
    return entry


def sandbox_alive(entry: Entry) -> str | None:
    """What says the run's sandbox may still run, else None.

    bwrap is PID 1 of the run's PID namespace: its exit completes only once every process of
    the namespace is gone (pid_namespaces(7)), so a dead bwrap (or a zombie) means a dead
    sandbox. Without bwrap's record (the caller died between the anchor's READY and recording
    it) but with a dead anchor, bwrap was SIGKILLed by its parent-death signal and may take a
    moment: any process of the sandbox's uid counts as alive then."""
    for kind, pid, start in entry.processes:
        if process_start_time(pid) == start:
            return f"its {kind} (pid {pid}) still runs"
    uid = entry.handover.sandbox_uid
    if all(kind != "bwrap" for kind, _pid, _start in entry.processes) and uid is not None \
            and uid_runs_a_process(uid):
        return f"a process of its uid {uid} still runs"
    return None


def pending(root: str | None = None) -> list[str]:
    """Journals of dead callers (of workspace ``root`` only, if given), oldest first."""
    try:
        listed = os.listdir(JOURNAL_DIR)
    except OSError:
        return []
    stamped = []
    for name in listed:
        try:
            stamped.append((os.stat(os.path.join(JOURNAL_DIR, name)).st_mtime_ns, name))
        except OSError:
            continue  # removed meanwhile (its run gave the workspace back)
    out = []
    for _mtime, name in sorted(stamped):
        pid = name.split("-", 1)[0]
        path = os.path.join(JOURNAL_DIR, name)
        if not pid.isdigit() or int(pid) == os.getpid() or (os.path.exists(f"/proc/{pid}")
                                                              and not _caller_pid_reused(path, int(pid))):
            continue
        if root is not None:
            try:
                with open(path, "rb") as f:
                    head = f.readline().decode("ascii").split(" ")
                if len(head) < 4 or os.fsdecode(bytes.fromhex(head[3])) != root:
                    continue
            except (OSError, ValueError):
                continue
        out.append(path)
    return out


def journaled_uids() -> frozenset[int]:
    """The sandbox uids named by the journals here (live runs' and dead callers' not yet given
    back). :class:`lowlevel.workspace.uids.UidLease` never leases them: a dead caller's workspace is still
    owned by its uid until recovered, and another sandbox running as that uid would own (and
    could reach) its files meanwhile, and keep its recovery waiting."""
    try:
        names = os.listdir(JOURNAL_DIR)
    except OSError:
        return frozenset()
    uids = set()
    for name in names:
        try:
            with open(os.path.join(JOURNAL_DIR, name), "rb") as f:
                head = f.readline().split(b" ")
        except OSError:
            continue
        if len(head) > 7 and head[:2] == [b"H", b"1"] and head[7].isdigit():
            uids.add(int(head[7]))
    return frozenset(uids)


def _caller_pid_reused(path: str, pid: int) -> bool:
    """Whether the live process ``pid`` is not the journal's caller (its ``P caller`` start time
    differs): the caller died and its pid went to another process, which must not keep the
    workspace handed over (the next hand-over would record the sandbox's owners as the originals)."""
    try:
        with open(path, "rb") as f:
            f.readline()
            rec = f.readline().decode("ascii").split()
    except (OSError, UnicodeDecodeError):
        return False
    if len(rec) != 4 or rec[:3] != ["P", "caller", str(pid)] or not rec[3].isdigit():
        return False  # a journal of an older version, or the caller died before writing it
    start = process_start_time(pid)
    return start is not None and start != int(rec[3])


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # another cleanup took it meanwhile (giving back twice is harmless: same record)


__all__ = ["JOURNAL_DIR", "Entry", "Handover", "Journal", "journaled_uids", "load", "pending"]
