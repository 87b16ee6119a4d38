"""Per-run host uids for root callers' sandboxes: the range, the accounts it skips, the lease.

Each live sandbox of a root caller runs as a host uid (and gid of the same number) of its own,
from a range (:data:`DEFAULT_UID_RANGE`, ``LOWLEVEL_UID_RANGE``) minus the ids an account or a
group has (:func:`account_uids`, :func:`nss_knows_id`) and the ids hand-over journals still name
(:func:`lowlevel.workspace.handover_journal.journaled_uids`), held by an open-file-description
lock for as long as the anchor lives (:class:`UidLease`).

Sources: fcntl(2) "Open file description locks" (F_OFD_SETLK: 3.15); systemd's UIDS-GIDS.md
for the range; nsswitch.conf(5).
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import struct
from collections.abc import Callable

from lowlevel.errors import UnsupportedError
from lowlevel.workspace.cow import ensure_root_state_dir
from lowlevel.workspace.handover_journal import journaled_uids

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any, TypeVar

#: Per-run host uids of root callers: ``(first, count)``. 0x70000000 starts just above the
#: range systemd hands to containers (524288-1879048191) and below 2^31; override with
#: ``LOWLEVEL_UID_RANGE=FIRST-LAST`` (inclusive). `lowlevel doctor` checks it against
#: ``/etc/passwd`` and ``/etc/subuid``/``/etc/subgid``. Source: systemd UIDS-GIDS.md.
DEFAULT_UID_RANGE = (0x70000000, 65536)

_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


def uid_range() -> tuple[int, int]:
    """``(first, count)`` of the per-run uid range (``LOWLEVEL_UID_RANGE`` or the default).

    Raises:
        UnsupportedError: the variable is malformed or names ids 0 or past 2^32-2.
    """
    spec = os.environ.get("LOWLEVEL_UID_RANGE")
    if not spec:
        return DEFAULT_UID_RANGE
    try:
        first_s, last_s = spec.split("-")
        first, last = int(first_s), int(last_s)
    except ValueError:
        first = last = -1
    if not 0 < first <= last < 2**32 - 1:
        raise UnsupportedError("uid-range", f"LOWLEVEL_UID_RANGE={spec!r} is not FIRST-LAST with "
                               "0 < FIRST <= LAST < 4294967295", "e.g. LOWLEVEL_UID_RANGE=1879048192-1879113727")
    return first, last - first + 1


if TYPE_CHECKING:
    _T = TypeVar("_T")
_parsed_cache: dict[tuple[str, Callable[[bytes], Any]], tuple[tuple[int, int], Any]] = {}


def _parsed_file(path: str, parse: Callable[[bytes], _T], missing: _T) -> _T:
    """``parse(content of path)``, cached per path and parser until the file's mtime or size
    changes; ``missing`` when the file cannot be read (not cached: read again next time)."""
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
        cached = _parsed_cache.get((path, parse))
        if cached is not None and cached[0] == stamp:
            value: _T = cached[1]
            return value
        with open(path, "rb") as f:
            value = parse(f.read())
    except OSError:
        return missing
    _parsed_cache[(path, parse)] = (stamp, value)
    return value


def _third_fields(data: bytes) -> frozenset[int]:
    """The numeric third fields of a passwd/group file: its uids or gids."""
    return frozenset(int(parts[2]) for parts in (line.split(b":") for line in data.splitlines())
                     if len(parts) > 2 and parts[2].isdigit())


def _ids_in(path: str) -> frozenset[int]:
    """The ids (third field) of ``/etc/passwd`` or ``/etc/group`` (cached per mtime and size)."""
    return _parsed_file(path, _third_fields, frozenset())


def account_uids(first: int, count: int) -> frozenset[int]:
    """The ids of ``first .. first+count-1`` that /etc/passwd gives an account or /etc/group a
    group: never leased, so a sandbox never runs as a real user's uid, nor (the lease is its
    gid too) with a real group's gid (``utmp``, ``shadow``... would grant their files)."""
    return frozenset(u for u in _ids_in("/etc/passwd") | _ids_in("/etc/group") if first <= u < first + count)


#: Where NSS is configured (nsswitch.conf(5)); a module attribute so tests can point it elsewhere.
NSSWITCH_PATH = "/etc/nsswitch.conf"
#: NSS sources whose ids :func:`account_uids` already knows (``files``: /etc/passwd and
#: /etc/group) or that keep below the per-run range (``systemd``: dynamic users 61184-65519 and
#: container ids up to 1879048191, systemd UIDS-GIDS.md). Any other source (``sss``, ``ldap``,
#: ``winbind``, ``nis``, ``compat``...) can name an account anywhere, in the per-run range too:
#: sssd's default id mapping hands out 200000-2000200000 (sssd-ldap(5) ``ldap_idmap_range_*``).
LOCAL_NSS_SOURCES = frozenset({"files", "systemd"})

def nss_beyond_files(path: str | None = None) -> bool:
    """Whether NSS takes users or groups from a source other than :data:`LOCAL_NSS_SOURCES`.

    Reads the ``passwd:`` and ``group:`` lines of ``nsswitch.conf`` (cached per mtime and
    size; ``[STATUS=action]`` items are not sources). No file: glibc's default (``files``),
    so False. When True, :class:`UidLease` asks NSS about each uid before leasing it.
    """
    return _parsed_file(path or NSSWITCH_PATH, _nss_beyond_files, False)


def _nss_beyond_files(data: bytes) -> bool:
    for line in data.decode("utf-8", "replace").splitlines():
        key, sep, rest = line.split("#", 1)[0].partition(":")
        if sep and key.strip() in ("passwd", "group"):
            sources = {w for w in rest.split() if not w.startswith("[")}  # "[NOTFOUND=return]": an action
            if sources - LOCAL_NSS_SOURCES:
                return True
    return False


def nss_knows_id(uid: int) -> bool:
    """Whether NSS (``getpwuid(3)``, ``getgrgid(3)``: LDAP, sssd, winbind...) names ``uid`` as a
    user's uid or a group's gid. An NSS error other than "not found" counts as known (fail
    safe: that id is skipped, not handed to a sandbox)."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
        except KeyError:
            continue
        except OSError:
            return True
        return True
    return False


#: The lease file (None: ``/run/lowlevel/uids.lock``); a module attribute so tests can give a
#: lease a file of their own (the rotation's cursor lives in it, see :class:`UidLease`).
UID_LOCK_PATH: str | None = None
#: The cursor: the next uid to try, 8 bytes (native order) at this offset of the lease file. No
#: uid is 0, so the per-uid lock bytes never overlap it.
_CURSOR = struct.Struct("=Q")


def _read_cursor(fd: int, first: int, count: int) -> int:
    """The rotation cursor of the lease file ``fd`` as an index into the range (0 when absent
    or outside the range: a new file, another ``LOWLEVEL_UID_RANGE``)."""
    raw = os.pread(fd, _CURSOR.size, 0)
    cursor: int = _CURSOR.unpack(raw)[0] if len(raw) == _CURSOR.size else 0
    return cursor - first if first <= cursor < first + count else 0


class UidLease:
    """One host uid (and the gid of the same number) leased to one live sandbox.

    Held by an open-file-description lock (``F_OFD_SETLK``) on byte ``uid`` of
    ``/run/lowlevel/uids.lock``; the fd is handed to the anchor (``--keep-fd``), so the lease
    lasts exactly as long as the anchor and therefore the sandbox, whoever dies first. A uid is
    never given to two live sandboxes at once, nor at all when /etc/passwd gives it an account
    or /etc/group a group (:func:`account_uids`), nor, where NSS has other sources (LDAP,
    sssd...: :func:`nss_beyond_files`), when NSS names it (:func:`nss_knows_id`, asked for each
    candidate: a directory's users have no list to read).

    Reuse is least recently used first, across processes: the lease file holds a cursor (the
    uid after the last one handed out, first 8 bytes), read and advanced under ``flock(2)`` on
    the same file (held for that only, not for the search), and each lease starts its search
    there, wrapping around the range. A
    released uid therefore comes back only after every other free uid of the range has been
    handed out once (65536 runs with the default range), not to the next run: what a sandbox
    leaves behind owned by its uid (a file made through a *writable bind*, kept with its mode)
    is not the next sandbox's, which may be another task's or tenant's (issue 22, item 6).
    Past the whole range it is reused: pin ``Policy(host_uid=...)`` per tenant to keep
    tenants apart for good. A cursor outside the range (another ``LOWLEVEL_UID_RANGE``, a new
    file) starts at the range's first uid.

    Attributes:
        uid: the leased id (used as uid and gid).
        fd: the locked fd (O_CLOEXEC; the launcher dup2s it into the anchor).

    Raises:
        UnsupportedError: every uid of the range is leased (too many concurrent sandboxes: widen
            ``LOWLEVEL_UID_RANGE``).
        OSError: the lock file cannot be opened.
    """

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self.fd = fd

    @classmethod
    def acquire(cls) -> "UidLease":
        first, count = uid_range()
        path = UID_LOCK_PATH or os.path.join(ensure_root_state_dir(), "uids.lock")
        # An OSError here (EMFILE...) propagates: the launcher reports it as a LaunchError.
        accounts_taken = account_uids(first, count)
        taken = accounts_taken | journaled_uids()
        ask_nss = nss_beyond_files()
        nss_known = 0
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            # The cursor is read and advanced by one under flock(2) (a lock of another kind than
            # the OFD byte locks: neither sees the other; each acquire has its own open file
            # description, so threads are serialized too), then the lock is dropped: the scan
            # (NSS lookups included, which may be slow) runs without it, the OFD locks decide
            # who gets a uid, and concurrent leasers start at successive uids.
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                start = _read_cursor(fd, first, count)
                reserved = first + (start + 1) % count
                os.pwrite(fd, _CURSOR.pack(reserved), 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            for k in range(count):
                i = (start + k) % count
                if first + i in taken:
                    continue  # an account's uid or group's gid, or a hand-over journal's sandbox uid
                if ask_nss and nss_knows_id(first + i):
                    nss_known += 1
                    continue  # a directory user's uid or group's gid (sssd, LDAP...)
                # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks). The
                # byte is the uid itself, so ranges configured differently never collide.
                lock = struct.pack("hh4xqqi4x", fcntl.F_WRLCK, os.SEEK_SET, first + i, 1, 0)
                try:
                    fcntl.fcntl(fd, _F_OFD_SETLK, lock)
                except OSError as err:
                    if err.errno in (errno.EAGAIN, errno.EACCES):
                        continue
                    raise
                if k:
                    # Skipped some (live, accounts): move the cursor past this uid too, unless
                    # another leaser moved it meanwhile (then its value is as good).
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    try:
                        if _read_cursor(fd, first, count) == reserved - first:
                            os.pwrite(fd, _CURSOR.pack(first + (i + 1) % count), 0)
                    finally:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                return cls(first + i, fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        accounts = (f" ({len(accounts_taken)} of them accounts in /etc/passwd or groups in /etc/group, never used)"
                    if accounts_taken else "")
        if nss_known:
            accounts += f" ({nss_known} of them ids NSS names, never used)"
        span = f"{first}-{first + count - 1}"
        if len(accounts_taken) + nss_known >= count:  # nothing leasable at all: no sandbox holds one
            raise UnsupportedError("uid-range", f"none of the {count} ids of {span} can be a per-run uid: each is "
                                   "an account's uid or a group's gid (/etc/passwd, /etc/group or NSS), which a "
                                   "sandbox never runs as",
                                   "set LOWLEVEL_UID_RANGE to ids no account uses, or pin Policy(host_uid=...)")
        raise UnsupportedError("uid-range", f"all {count} per-run uids of {span} are "
                               f"leased to live sandboxes{accounts}",
                               "widen LOWLEVEL_UID_RANGE (to ids no account uses), or pin Policy(host_uid=...)")

    def release(self) -> None:
        """Close our fd (the anchor's copy keeps the lock until it exits). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


__all__ = ["DEFAULT_UID_RANGE", "LOCAL_NSS_SOURCES", "NSSWITCH_PATH", "UID_LOCK_PATH", "UidLease", "account_uids",
           "nss_beyond_files", "nss_knows_id", "uid_range"]
