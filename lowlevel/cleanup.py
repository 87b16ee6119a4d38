"""Find and remove what interrupted runs can leave behind (``lowlevel cleanup``, ``doctor``).

A run killed at any instant leaves no process (the anchor's PID namespace) and no mount in the
host's mount namespace (the overlay and its tmpfs live in the anchor's own). What can remain:

- ``cgroup``: a per-run cgroup directory of a caller that died (``run-<pid>-...``), wherever it
  was: under this process's own base, or where the run's record (:mod:`lowlevel.host.run_records`,
  written before the cgroup was made) says, e.g. under the cgroup of a service or container the
  caller ran in. The next :func:`lowlevel.host.cgroup_detect.detect_cgroups` of a caller in the same cgroup
  also removes the empty ones of dead pids. A run cgroup whose record is gone too (a private
  record directory deleted, ``/run`` wiped) is found by walking every cgroup hierarchy (v1
  ``memory``/``pids``/``cpu``/``cpuacct``/``freezer`` and v2, from ``/proc/self/mountinfo``; or
  only the directories ``$LOWLEVEL_CGROUP_ROOTS`` names, ``:``-separated, empty: no walk) for
  ``<cgroup>/lowlevel/[run-]<pid>-*`` whose ``<pid>`` no longer exists, when ``<cgroup>`` (the
  caller's, less its ``lowlevel``) holds no process of another PID namespace (a caller there, a
  container's, could be alive with a pid we do not see); what is still inside is killed first;
- ``commit``: temporaries of a commit killed mid-way (``.lowlevel-commit-<pid>-<n>`` and its
  journal) in a workspace; the next commit into that workspace removes them
  (:func:`lowlevel.workspace.overlay.cleanup_commit_leftovers`), or ``lowlevel cleanup`` (the workspaces
  of dead callers' run records, and ``--workspace DIR``);
- ``egress``: the unix-socket directory of an egress-mode run (``lowlevel-egress-*`` in
  ``/dev/shm`` or ``/tmp``) whose proxy is gone;
- ``handover``: the journal of a root caller that died mid-run in the hand-over fallback (no
  overlay): its workspace is still owned by the sandbox's per-run uid. The next hand-over of that
  workspace, or ``lowlevel cleanup``, gives it back (:mod:`lowlevel.workspace.handover_journal`);
- ``import``: the staging directory of a ``lowlevel image import`` whose process died
  (``<store>/tmp/import-<pid>-<start time>-*`` of the default store, ``$LOWLEVEL_IMAGE_STORE``);
  the next import into that store removes it too;
- ``mount``: a mount of lowlevel's in the host namespace (only the hand-over model of lowlevel
  0.1's sized workspaces made one: ``.sized-*``): listed; root can unmount it;
- ``workspace``: a fresh workspace its caller was to remove after the run (the CLI's ``--rm``,
  ``keep_workspace=False``: named ``rm-<pid>-<start time>-*`` under the workspace base) when
  that caller is gone (its PID no longer runs the process that started then): removed. The
  caller is assumed to have run in this PID namespace, like every PID check here.

Other fresh workspaces (``run-*`` under the workspace base) and saved conflict directories hold
the user's data: they are never removed here.

:func:`find_leftovers` (``lowlevel doctor``, ``lowlevel cleanup --dry-run``) changes nothing: it
detects the cgroup bases without the sweep (``detect_cgroups(sweep=False)``).
"""

from __future__ import annotations

import os
import re
import socket
import stat
import time

from lowlevel._dataclass import dataclass
from lowlevel.host import cgroup_detect as _cgroup_detect
from lowlevel.host import cgroupfs as _cgroupfs
from lowlevel.host import run_records as _records
from lowlevel.errors import LowlevelError

_EGRESS_PREFIX = "lowlevel-egress-"
#: ``:``-separated cgroup directories cleanup's walk starts from instead of every cgroup mount
#: (each must be inside one); empty: no walk (the records and this process's bases only).
CGROUP_ROOTS_ENV = "LOWLEVEL_CGROUP_ROOTS"


@dataclass(frozen=True)
class Leftover:
    """One thing an interrupted run left.

    Attributes:
        kind: ``"cgroup"``, ``"commit"``, ``"egress"``, ``"handover"``, ``"import"``, ``"mount"``,
            ``"record"`` (an empty run record of a dead caller) or ``"workspace"``.
        path: where it is.
        detail: why it counts as left over (one line).
    """

    kind: str
    path: str
    detail: str


def _cgroup_hierarchies() -> list[tuple[int, str, frozenset[str]]]:
    """``(version, mount, controllers)`` of each cgroup hierarchy lowlevel uses, mounted here."""
    out: list[tuple[int, str, frozenset[str]]] = []
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = _cgroup_detect.parse_mountinfo(f.read())
    except OSError:
        return out
    seen: set[frozenset[str]] = set()
    for _root, mount, fs, opts in mounts:
        used = frozenset(opts.split(",")) & _cgroup_detect._V1_USED if fs == "cgroup" else frozenset()
        key = frozenset({"v2"}) if fs == "cgroup2" else used
        if key and key not in seen:  # one mount per hierarchy
            seen.add(key)
            out.append((2 if fs == "cgroup2" else 1, mount, used))
    return out


def _cgroup_mounts() -> list[str]:
    return [mount for _v, mount, _c in _cgroup_hierarchies()]


def _walk_roots() -> list[tuple[int, str, frozenset[str]]]:
    """Where the orphan walk starts: every hierarchy, or ``$LOWLEVEL_CGROUP_ROOTS`` (inside one)."""
    hierarchies = _cgroup_hierarchies()
    given = os.environ.get(CGROUP_ROOTS_ENV)
    if given is None:
        return hierarchies
    out = []
    for d in filter(None, given.split(":")):
        real = os.path.realpath(d)
        out += [(v, real, c) for v, m, c in hierarchies if real == m or real.startswith(m.rstrip("/") + "/")][:1]
    return out


def _foreign_procs(cgroup: str) -> bool:
    """True when ``cgroup`` or a descendant (but its ``lowlevel``) holds a process of another PID
    namespace than ours, or one we cannot check: a caller there may live with a pid we do not see."""
    try:
        ours = os.readlink("/proc/self/ns/pid")
    except OSError:
        return True
    for parent, dirs, _files in os.walk(cgroup):
        if parent == cgroup and _cgroup_detect.BASE_NAME in dirs:
            dirs.remove(_cgroup_detect.BASE_NAME)
        for pid in _cgroupfs.read_ints(os.path.join(parent, "cgroup.procs")):
            try:
                if pid <= 0 or os.readlink(f"/proc/{pid}/ns/pid") != ours:
                    return True
            except FileNotFoundError:
                continue  # exited since
            except OSError:
                return True  # EACCES: not ours to judge
    return False


def _removable(path: str) -> bool:
    """True when this caller may rmdir(2) the cgroup ``path``: root, or write and search permission
    on its parent (access(2)). Another user's run cgroup (root's, seen by an unprivileged caller in
    the same cgroup) is not this caller's leftover: it is neither listed nor a problem here."""
    return os.geteuid() == 0 or os.access(os.path.dirname(path), os.W_OK | os.X_OK)


def _dead_owner(name: str) -> str | None:
    m = _cgroup_detect.RUN_NAME.match(name)
    if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
        return m.group(1)
    return None


def _orphan_cgroups() -> dict[str, list[tuple[int, str, frozenset[str]]]]:
    """Run cgroups of dead callers found by walking the hierarchies (see the module docstring):
    ``{run name: [(version, path, controllers), ...]}``."""
    found: dict[str, list[tuple[int, str, frozenset[str]]]] = {}
    for version, top, controllers in _walk_roots():
        for parent, dirs, _files in os.walk(top):
            if os.path.basename(parent) != _cgroup_detect.BASE_NAME:
                continue
            runs = [d for d in dirs if _dead_owner(d) and _removable(os.path.join(parent, d))]
            dirs[:] = [d for d in dirs if not _cgroup_detect.RUN_NAME.match(d)]  # never below a run's
            if runs and not _foreign_procs(os.path.dirname(parent)):
                for d in runs:
                    found.setdefault(d, []).append((version, os.path.join(parent, d), controllers))
    return found


def _recorded_path_ok(path: str, record: str, mounts: list[str]) -> bool:
    """A recorded cgroup directory is one cleanup may rmdir: strictly below a cgroup mount, no
    symlink on the way, and named as the record says (``<pid>-<start>-<name>``)."""
    real = os.path.realpath(path)
    return (real == os.path.normpath(path) and os.path.isabs(path)
            and any(real.startswith(m.rstrip("/") + "/") for m in mounts)
            and os.path.basename(record).endswith("-" + os.path.basename(real)))


def _empty_records() -> list[Leftover]:
    return [Leftover("record", p, "an empty run record (its caller died before writing it: it records nothing)")
            for p in _records.empty_dead()]


def _dead_records() -> list[_records.Record]:
    return [r for r in _records.records() if not r.caller_alive()]


def _stale_cgroups(orphans: dict[str, list[tuple[int, str, frozenset[str]]]] | None = None) -> list[Leftover]:
    """The stale per-run cgroups; ``orphans``: :func:`_orphan_cgroups`'s walk when the caller made
    it already (:func:`_clean_cgroups` kills what they hold: one walk, one view)."""
    out: list[Leftover] = []
    seen: set[str] = set()
    try:
        support = _cgroup_detect.detect_cgroups(sweep=False)  # look only: the sweep would remove them
    except OSError:
        support = _cgroup_detect.CgroupSupport()
    for h in support.hierarchies:
        if not h.base or not os.path.isdir(h.base):
            continue
        for name in os.listdir(h.base):
            owner = _dead_owner(name)
            path = os.path.join(h.base, name)
            if owner is not None and _removable(path):
                seen.add(path)
                out.append(Leftover("cgroup", path, f"its creator (pid {owner}) is gone"))
    mounts = _cgroup_mounts()
    for rec in _dead_records():
        for path in rec.cgroups:
            if path not in seen and _recorded_path_ok(path, rec.path, mounts) and os.path.isdir(path) \
                    and _removable(path):
                seen.add(path)
                out.append(Leftover("cgroup", path, f"its caller (pid {rec.pid}) is gone (from its run record "
                                    f"{rec.path})"))
    for name, dirs in (_orphan_cgroups() if orphans is None else orphans).items():
        for _v, path, _c in dirs:
            if path not in seen:
                seen.add(path)
                out.append(Leftover("cgroup", path, f"its creator (pid {_dead_owner(name)}) is gone, no record names "
                                    f"it, and no process of another PID namespace is in its caller's cgroup"))
    return out


def _stale_egress_dirs() -> list[Leftover]:
    out: list[Leftover] = []
    for base in ("/dev/shm", "/tmp"):
        try:
            names = [n for n in os.listdir(base) if n.startswith(_EGRESS_PREFIX)]
        except OSError:
            continue
        for name in names:
            d = os.path.join(base, name)
            try:
                st = os.lstat(d)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            socks = []
            try:
                socks = [os.path.join(d, n) for n in os.listdir(d)]
            except OSError:
                continue
            alive = False
            for path in socks:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.settimeout(0.2)
                    s.connect(path)
                    alive = True
                except OSError:
                    pass
                finally:
                    s.close()
            if not alive:
                out.append(Leftover("egress", d, "no proxy listens on its socket"))
    return out


_IMPORT_NAME = re.compile(r"^import-(\d+)-(?:(\d+)-)?")


def _stale_imports(stores: tuple[str, ...] = ()) -> list[Leftover]:
    """Staging directories of image imports whose process is gone: in the default store
    (``$LOWLEVEL_IMAGE_STORE`` or its default) and in each of ``stores``."""
    out: list[Leftover] = []
    for store in (None, *stores):
        out += [item for item in _stale_imports_in(store) if item not in out]
    return out


def _stale_imports_in(store: str | None) -> list[Leftover]:
    from lowlevel.image import ImageStore
    from lowlevel.host.procs import process_start_time
    try:
        tmp = ImageStore(store).tmp_dir
        names = os.listdir(tmp)
    except (OSError, LowlevelError):
        return []
    out = []
    for name in names:
        m = _IMPORT_NAME.match(name)
        if not m:
            continue
        pid, start = int(m.group(1)), m.group(2)
        now = process_start_time(pid)
        if now is not None and (start is None or int(start) in (0, now)):
            continue  # its importer still runs (a name without a start time: any process of that pid)
        out.append(Leftover("import", os.path.join(tmp, name), f"staging directory of an image import whose "
                            f"process (pid {pid}) is gone"))
    return out


def _host_mounts() -> list[Leftover]:
    out: list[Leftover] = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                target = fields[4] if len(fields) > 4 else ""
                if "lowlevel-upper" in line or "/.sized-" in target:
                    out.append(Leftover("mount", target, "a lowlevel mount in the host's mount namespace"))
    except OSError:
        pass
    return out


def _handovers() -> list[Leftover]:
    from lowlevel.workspace import handover_journal as _journal
    out = []
    for path in _journal.pending():
        try:
            h = _journal.load(path).handover
            what = f"workspace {h.root} still handed to the sandbox's uid {h.sandbox_uid} (its caller died)"
        except (OSError, ValueError, UnicodeDecodeError):
            what = "an unreadable hand-over journal"
        out.append(Leftover("handover", path, what))
    return out


def _commit_leftovers(workspace: str) -> list[Leftover]:
    from lowlevel.workspace.overlay import LEFTOVER_PREFIX
    try:
        names = os.listdir(workspace)
    except OSError:
        return []
    return [Leftover("commit", os.path.join(workspace, n), "temporary of an interrupted commit")
            for n in names if n.startswith(LEFTOVER_PREFIX)]


def _fresh_workspaces(base: str | None) -> list[str]:
    from lowlevel.workspace.create import DISPOSABLE_PREFIX, default_base
    root = base or default_base()
    try:
        return [os.path.join(root, n) for n in os.listdir(root) if n.startswith(("run-", DISPOSABLE_PREFIX))]
    except OSError:
        return []


def _disposable_workspaces(base: str | None) -> list[Leftover]:
    """Disposable workspaces (``--rm``, ``keep_workspace=False``) whose creator is gone."""
    from lowlevel.host.procs import process_alive
    from lowlevel.workspace.create import disposable_owner
    out = []
    for path in _fresh_workspaces(base):
        owner = disposable_owner(os.path.basename(path))
        if owner is not None and not process_alive(*owner):
            out.append(Leftover("workspace", path, f"a fresh workspace to be removed after its run (--rm, "
                                f"keep_workspace=False) whose caller (pid {owner[0]}) is gone"))
    return out


def _workspaces(given: tuple[str, ...], base: str | None) -> list[str]:
    """Where to look for commit temporaries: ``given``, the fresh workspaces under ``base`` and
    the workspaces of dead callers' run records (a caller killed mid-commit), each once."""
    out: list[str] = []
    for ws in (*given, *_fresh_workspaces(base), *(r.workspace for r in _dead_records() if r.workspace)):
        if ws not in out:
            out.append(ws)
    return out


def find_leftovers(workspaces: tuple[str, ...] = (), base: str | None = None,
                   stores: tuple[str, ...] = ()) -> list[Leftover]:
    """Everything interrupted runs left that this caller can see (see the module docstring).

    Args:
        workspaces: directories to check for commit temporaries, on top of the fresh
            workspaces under ``base`` (default: ``$LOWLEVEL_WORKSPACE_BASE`` or
            ``/tmp/lowlevel-<uid>``).
        stores: image stores to check for interrupted imports, on top of the default one.
    Returns:
        The leftovers, cgroups first. Never raises for an unreadable place (skipped).
    """
    found = _stale_cgroups() + _stale_egress_dirs() + _stale_imports(stores) + _host_mounts() + _handovers() \
        + _empty_records()
    disposable = _disposable_workspaces(base)
    gone = {item.path for item in disposable}
    for ws in _workspaces(workspaces, base):
        if ws not in gone:  # removed whole, temporaries included
            found += _commit_leftovers(ws)
    return found + disposable


def clean(workspaces: tuple[str, ...] = (), base: str | None = None,
          stores: tuple[str, ...] = ()) -> tuple[list[Leftover], list[str]]:
    """Remove what :func:`find_leftovers` finds, where it is safe (same arguments).

    Returns:
        ``(removed, problems)``: what went, and one line for each thing that stayed (a
        populated cgroup, a mount without the privilege to unmount it...).
    """
    removed: list[Leftover] = []
    problems: list[str] = []
    _clean_cgroups(removed, problems)
    _clean_egress_dirs(removed, problems)
    _clean_imports(removed, problems, stores)
    _clean_mounts(removed, problems)
    # Workspaces a dead root caller left handed over (the fallback without overlay).
    from lowlevel.workspace.handover import recover
    before_handovers = _handovers()
    _restored, handover_problems = recover()
    problems += handover_problems
    removed += [item for item in before_handovers if not os.path.exists(item.path)]
    from lowlevel.workspace.create import remove_workspace
    for item in _disposable_workspaces(base):
        try:
            remove_workspace(item.path)
            removed.append(item)
        except LowlevelError as err:
            problems.append(f"{item.path}: {err}")
    dead = _dead_records()
    for ws in _workspaces(workspaces, base):
        _clean_commits(ws, removed, problems)
    for item in _empty_records():
        _records.remove(item.path)
        if not os.path.lexists(item.path):
            removed.append(item)
    # A dead caller's record goes once nothing it lists is left (else the next cleanup retries).
    mounts = _cgroup_mounts()
    for rec in dead:
        if not any(_recorded_path_ok(p, rec.path, mounts) and os.path.isdir(p) for p in rec.cgroups) \
                and not (rec.workspace and _commit_leftovers(rec.workspace)):
            _records.remove(rec.path)
    return removed, problems


def _clean_cgroups(removed: list[Leftover], problems: list[str]) -> None:
    """Remove the stale per-run cgroups (:func:`clean`'s first step), appending to the two lists."""
    orphans = _orphan_cgroups()
    stale = _stale_cgroups(orphans)
    # The walk's orphans (no record, no live caller that could own them) are killed first.
    from lowlevel.host.cgroups import RunCgroup
    paths = {item.path for item in stale}
    for name, dirs in orphans.items():
        mine = [d for d in dirs if d[1] in paths]
        if mine:
            RunCgroup.adopt(name, mine).kill_all()
    # Else rmdir(2) only: a cgroup still holding a task stays. A caller killed a moment ago may still
    # have its sandbox exiting (it dies with its anchor): retry for up to 2 s, as RunCgroup.remove.
    deadline = time.monotonic() + 2.0
    pending = list(stale)
    while True:
        for item in pending:
            _cgroup_detect.rmtree_empty(item.path)
        pending = [item for item in pending if os.path.exists(item.path)]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for item in stale:
        if item in pending:
            problems.append(f"{item.path}: still there (processes left in it?)")
        else:
            removed.append(item)


def _clean_egress_dirs(removed: list[Leftover], problems: list[str]) -> None:
    """Remove the egress socket directories whose proxy is gone."""
    for item in _stale_egress_dirs():
        try:
            for name in os.listdir(item.path):
                os.unlink(os.path.join(item.path, name))
            os.rmdir(item.path)
            removed.append(item)
        except OSError as err:
            problems.append(f"{item.path}: {err.strerror}")


def _clean_imports(removed: list[Leftover], problems: list[str], stores: tuple[str, ...]) -> None:
    """Remove the staging directories of interrupted image imports."""
    for item in _stale_imports(stores):
        from lowlevel.image.tree import rmtree as _rmtree_import
        _rmtree_import(item.path)
        if os.path.lexists(item.path):
            problems.append(f"{item.path}: could not be removed")
        else:
            removed.append(item)


def _clean_mounts(removed: list[Leftover], problems: list[str]) -> None:
    """Detach the host mounts dead runs left (root only: umount2(2) with MNT_DETACH)."""
    for item in _host_mounts():
        if os.geteuid() != 0:
            problems.append(f"{item.path}: mounted; unmount it as root (umount -l)")
            continue
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(item.path.encode(), 2) == 0:  # MNT_DETACH
            removed.append(item)
        else:
            problems.append(f"{item.path}: umount failed: {os.strerror(ctypes.get_errno())}")


def _clean_commits(ws: str, removed: list[Leftover], problems: list[str]) -> None:
    """Remove the temporaries of the commits killed mid-way in the workspace ``ws``."""
    from lowlevel.workspace.overlay import cleanup_commit_leftovers
    left = _commit_leftovers(ws)
    if not left:
        return
    try:
        fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        problems.append(f"{ws}: {err.strerror}")
        return
    try:
        gone = set(cleanup_commit_leftovers(fd))
    except LowlevelError as err:
        problems.append(f"{ws}: {err}")
        gone = set()
    finally:
        os.close(fd)
    for item in left:
        if os.path.basename(item.path) in gone or not os.path.lexists(item.path):
            removed.append(item)
        else:
            problems.append(f"{item.path}: its commit is still running (or its pid was reused)")

__all__ = ["Leftover", "clean", "find_leftovers"]
