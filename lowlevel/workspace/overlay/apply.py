"""The commit walk over an upper directory: entries, directories, and the report.

:class:`Applier` runs twice over the same upper: a dry pass (checks, conflicts, byte budget,
decisions; changes nothing) then the apply pass, which follows the dry pass's decisions
(:func:`lowlevel.workspace.overlay.commits.commit`); or once, into a fresh tree
(:func:`lowlevel.workspace.overlay.save.save_upper`).
"""

from __future__ import annotations

import errno
import os
import stat

from lowlevel._dataclass import dataclass
from lowlevel.workspace.changes import Changes
from lowlevel.workspace.handover import SETID_BITS
from lowlevel.workspace.overlay.apply_files import FileApplier
from lowlevel.workspace.overlay.fdops import _DIR_FLAGS, LEFTOVER_PREFIX, _join, _lstat, _open_dir_here
from lowlevel.workspace.overlay.state import _MOUNT_POINT, _UNREADABLE, STOP_ERRNOS, _ChangedOnHostError, _Frame, _stop
from lowlevel.workspace.overlay.upper import _dir_flags, _is_whiteout
from lowlevel.workspace.walk import MAX_DEPTH


#: How the note listing the upper entries a commit did not apply begins (then the count, and
#: paths relative to the workspace only: the MCP server passes it on to its clients).
COMMIT_SKIPPED_NOTE = "commit: not applied: "


@dataclass(frozen=True)
class CommitReport:
    """What :func:`commit` did to the user's directory.

    Attributes:
        changes: the entries applied (added / modified / deleted relative paths, sorted; a
            deleted directory is listed alone, its contents implied). ``bytes_written`` is the
            upper's allocated bytes (``st_blocks * 512``) of the entries applied.
        bytes_copied: file content copied into the user's directory (bytes).
        skipped: ``(relative path, reason)`` for each upper entry not applied: fifos, sockets
            and devices, reserved names, entries too deep, entries a non-root caller cannot
            write without changing their owner, mount points. (Entries the host changed
            during the commit are not skipped quietly: :func:`commit` raises
            :class:`CommitConflictError` for them after its apply pass.)
        notes: one-line remarks for ``Result.notes`` (what was approximated and why).
    """

    changes: Changes
    bytes_copied: int = 0
    skipped: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()


class Applier(FileApplier):
    """The commit walk. Runs twice over the same upper: a dry pass (``dry=True``: checks,
    conflicts, byte budget, decisions; changes nothing) then the apply pass, which follows
    the dry pass's decisions."""


    # -- the walk

    def run(self, dry: bool) -> None:
        self.dry = dry
        self.reset()
        ufd = os.open(".", _DIR_FLAGS, dir_fd=self.upper_fd)
        try:
            tfd = os.open(".", _DIR_FLAGS, dir_fd=self.target_fd)
        except BaseException:
            os.close(ufd)
            raise
        self.stack.append(_Frame(ufd, tfd, "", opaque=False, fresh=self.save))
        try:
            self.stack[0].xwhiteouts = _dir_flags(ufd, ".", self.prefix)[1]
            self.stack[0].names = sorted(os.listdir(ufd), reverse=True)
            while self.stack:
                frame = self.stack[-1]
                if frame.gone:
                    self.delete_lower(frame, frame.gone.pop(), None)
                elif frame.names:
                    self.entry(frame, frame.names.pop())
                else:
                    try:
                        self.leave(frame)
                    finally:
                        self.pop()
        except OSError as err:
            if not dry and err.errno in STOP_ERRNOS:
                # Stopped: the new directories still being built (under temporary names, which
                # finish() removes) hold nothing that was applied.
                heads = tuple(f"{f.rel}/" for f in self.stack if f.fresh and f.temp is not None)
                if heads:
                    for done in (self.added, self.modified, self.deleted):
                        done[:] = [p for p in done if not p.startswith(heads)]
            raise
        finally:
            while self.stack:
                self.pop()
            for fd in self.links.values():
                os.close(fd)
            self.links.clear()

    def pop(self) -> None:
        frame = self.stack.pop()
        os.close(frame.ufd)
        if frame.tfd is not None:
            if any(p[0] == frame.tfd for p in self.pending):
                self.held.append(frame.tfd)  # finish() removes its temporaries, then closes it
            else:
                os.close(frame.tfd)

    def finish(self, rootfd: int) -> None:
        """After the apply pass, however it ended: remove the temporaries still registered
        (all of them when it was interrupted), close what is held, remove the journal unless
        something could not be removed. Retried until done if interrupted (KeyboardInterrupt, or
        SystemExit from a SIGTERM handler: it left the journal in the workspace, which plain
        ``lowlevel cleanup`` does not look in once the run's record is gone); the first interrupt
        is raised once it is done (a ^C here was swallowed before)."""
        interrupt: BaseException | None = None
        while True:
            try:
                self.abort_cleanup()
                while self.held:
                    fd = self.held.pop()
                    os.close(fd)
                if self.journal_fd is not None:
                    fd, self.journal_fd = self.journal_fd, None
                    os.close(fd)
                if self.journal_name and not self.left_behind:
                    try:
                        os.unlink(self.journal_name, dir_fd=rootfd)
                    except FileNotFoundError:
                        pass
                    except OSError as err:
                        # A read-only file system (why the pass stopped, as a rule; unlink(2)
                        # says EROFS even for a name that does not exist): raising here would
                        # hide what was applied. A journal that was made stays for
                        # cleanup_commit_leftovers().
                        if err.errno != errno.EROFS:
                            raise
                        if _lstat(rootfd, self.journal_name) is not None:
                            self.left_behind = True
                            self.note_once("journal", "commit: its journal could not be removed (read-only file "
                                           "system): cleanup_commit_leftovers() removes it once it is writable")
                    self.journal_name = ""
                if interrupt is not None:
                    raise interrupt
                return
            except (KeyboardInterrupt, SystemExit) as err:
                if err is interrupt:
                    raise
                interrupt = interrupt or err
                continue

    def push(self, frame: _Frame, lower_names: list[str] | None) -> None:
        """Put ``frame`` (owning its fds from now on) on the stack and list its upper dir."""
        self.stack.append(frame)
        frame.names = sorted(os.listdir(frame.ufd), reverse=True)
        if lower_names is not None:
            present = set(frame.names)
            frame.gone = sorted((n for n in lower_names if n not in present), reverse=True)

    def entry(self, frame: _Frame, name: str) -> None:
        rel = _join(frame.rel, name)
        if self.decided(rel):
            return
        ust = _lstat(frame.ufd, name)
        if ust is None:
            return
        if name.startswith(LEFTOVER_PREFIX):
            self.skip(rel, f"reserved name (lowlevel's commit temporaries start with {LEFTOVER_PREFIX!r})")
            return
        lst = _lstat(frame.tfd, name) if not frame.fresh and frame.tfd is not None else None
        mode = ust.st_mode
        if _is_whiteout(ust, frame.ufd, name, self.prefix, frame.xwhiteouts):
            if self.save:
                self.whiteouts.append(rel)
            elif lst is not None:
                self.delete_lower(frame, name, lst)
            return
        if stat.S_ISDIR(mode):
            self.directory(frame, name, rel, ust, lst)
        elif stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            self.leaf(frame, name, rel, ust, lst)
        else:
            what = ("fifo" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else
                    "character device" if stat.S_ISCHR(mode) else "block device")
            self.skip(rel, f"{what}: special files are never committed")


    # -- directories

    def directory(self, frame: _Frame, name: str, rel: str, ust: os.stat_result, lst: os.stat_result | None) -> None:
        if len(self.stack) > MAX_DEPTH:
            self.skip(rel, f"more than {MAX_DEPTH} levels deep: not committed")
            return
        try:
            cfd = os.open(name, _DIR_FLAGS, dir_fd=frame.ufd)
        except PermissionError:
            # Made unreadable by the run itself (chmod 000, a 0300 directory): an unprivileged
            # caller owns it but has no CAP_DAC_OVERRIDE to list it. Its content cannot be
            # known, so the directory is not committed (a root caller's commit copies it).
            self.skip(rel, _UNREADABLE.format(stat.S_IMODE(ust.st_mode)))
            return
        try:
            opaque_here, xwhiteouts = _dir_flags(cfd, rel, self.prefix)
        except BaseException:
            os.close(cfd)
            raise
        if self.save and opaque_here:
            self.opaque_dirs.append(rel)
        if lst is not None and stat.S_ISDIR(lst.st_mode):
            self.existing_dir(frame, name, rel, cfd, ust, lst, frame.opaque or opaque_here)
        else:
            self.new_dir(frame, name, rel, cfd, ust, lst)
        if self.stack[-1].ufd == cfd:
            self.stack[-1].xwhiteouts = xwhiteouts

    def existing_dir(self, frame: _Frame, name: str, rel: str, cfd: int, ust: os.stat_result,
                     lst: os.stat_result, opaque: bool) -> None:
        """A directory in both layers: updated in place (mode; entries below)."""
        assert frame.tfd is not None
        want = stat.S_IMODE(ust.st_mode) & ~SETID_BITS
        if not lst.st_mode & stat.S_IWOTH:
            want &= ~stat.S_IWOTH
        want |= stat.S_IMODE(lst.st_mode) & stat.S_ISGID
        chmod = want != stat.S_IMODE(lst.st_mode)
        mode_key = rel + "\0mode"
        if chmod:
            if self.dry:
                if not self.touch(rel, lst, (frame.ufd, frame.tfd, name)):
                    chmod = False
                elif not self.root and lst.st_uid != self.euid:
                    self.decisions[mode_key] = f"owned by uid {lst.st_uid}: its mode cannot be changed"
                    chmod = False
                else:
                    self.modified.append(rel)
            elif mode_key in self.decisions:
                self.skipped.append((rel, self.decisions[mode_key]))
                chmod = False
            elif not self.touch(rel, lst):
                chmod = False
        try:
            tfd = _open_dir_here(frame.tfd, name)
        except OSError as err:
            os.close(cfd)
            if self.dry and err.errno in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):
                self.conflicts.append(rel)  # swapped on the host since the stat
            elif err.errno == errno.EXDEV:
                self.skip(rel, _MOUNT_POINT)
            else:
                self.skip(rel, f"cannot open it: {err.strerror}")
            return
        self.dir_modes[(lst.st_dev, lst.st_ino)] = (lst.st_mode, lst.st_uid, lst.st_gid)
        child = _Frame(cfd, tfd, rel, opaque=opaque, fresh=False, lst=lst, ust=ust, mode=want if chmod else None)
        self.push(child, os.listdir(tfd) if opaque else None)
        if chmod and not self.dry and want & 0o300 == 0o300:
            # The new mode lets its owner write: set it first, so a directory the run made
            # writable (chmod u+w) takes its new entries even for a caller that is not root.
            self.set_dir_mode(child)

    def set_dir_mode(self, frame: _Frame) -> None:
        assert frame.tfd is not None and frame.mode is not None and frame.ust is not None
        os.fchmod(frame.tfd, frame.mode)
        frame.mode = None
        self.dir_left(frame.tfd, mode_set=True)
        self.mine(frame.lst)
        self.count(frame.ust)
        self.modified.append(frame.rel)

    def new_dir(self, frame: _Frame, name: str, rel: str, cfd: int, ust: os.stat_result,
                lst: os.stat_result | None) -> None:
        """A directory only the upper has (or replacing a lower non-directory): built
        completely, under a temporary name unless its parent is new too, then placed."""
        if self.dry:
            owner = self.owner_for(lst)
            if (lst is not None and not self.touch(rel, lst)) or not self.can_own(rel, owner):
                os.close(cfd)
                return
            (self.modified if lst is not None else self.added).append(rel)
            self.push(_Frame(cfd, None, rel, opaque=True, fresh=True, lst=lst, ust=ust, name=name), None)
            return
        assert frame.tfd is not None
        if lst is not None and not self.touch(rel, lst):
            os.close(cfd)
            return
        target = name if frame.fresh else self.temp_in(frame)
        try:
            os.mkdir(target, 0o700, dir_fd=frame.tfd)
            tfd = os.open(target, _DIR_FLAGS, dir_fd=frame.tfd)
        except OSError as err:
            os.close(cfd)
            if not frame.fresh:
                self.remove_temp(frame.tfd, target)
            if err.errno in STOP_ERRNOS:
                raise _stop(err, rel) from err
            self.skipped.append((rel, f"cannot create it: {err.strerror}"))
            return
        self.push(_Frame(cfd, tfd, rel, opaque=True, fresh=True, lst=lst, ust=ust, parent_tfd=frame.tfd,
                         temp=None if frame.fresh else target, name=name), None)

    def leave(self, frame: _Frame) -> None:
        """A directory's entries are done: an existing one gets its mode; a new one its
        metadata, and is moved into place."""
        if self.dry or frame.tfd is None or frame.ust is None:
            return
        if not frame.fresh:
            if frame.mode is not None:
                try:
                    self.set_dir_mode(frame)
                except OSError as err:
                    self.skipped.append((frame.rel, f"cannot change its mode: {err.strerror}"))
            return
        rel, ust, lst, tfd = frame.rel, frame.ust, frame.lst, frame.tfd
        try:
            self.copy_xattrs(frame.ufd, tfd)
            owner = self.owner_for(lst)
            if owner is not None:
                cur = os.fstat(tfd)
                if (cur.st_uid, cur.st_gid) != owner:
                    os.fchown(tfd, owner[0] if self.root else -1, owner[1])
            # setgid on a directory only makes new entries inherit its group: keep what mkdir
            # inherited from the parent; never take it (or setuid, or o+w) from the upper.
            want = stat.S_IMODE(ust.st_mode) & ~SETID_BITS
            if lst is None or not lst.st_mode & stat.S_IWOTH:
                want &= ~stat.S_IWOTH
            want |= stat.S_IMODE(os.fstat(tfd).st_mode) & stat.S_ISGID
            os.fchmod(tfd, want)
            os.utime(tfd, ns=(ust.st_atime_ns, ust.st_mtime_ns))
            assert frame.parent_tfd is not None
            if frame.temp is not None:
                self.place(frame.parent_tfd, frame.temp, frame.name, lst)
                self.dir_left(frame.parent_tfd)
            else:
                self.left_so(frame.parent_tfd, frame.name)
        except OSError as err:
            if frame.temp is not None and frame.parent_tfd is not None:
                self.remove_temp(frame.parent_tfd, frame.temp)
            head = rel + "/"  # what was recorded inside it was not applied after all
            for done in (self.added, self.modified, self.deleted):
                done[:] = [p for p in done if not p.startswith(head)]
            if isinstance(err, _ChangedOnHostError):
                self.late.append(rel)
                return
            if err.errno in STOP_ERRNOS:
                raise _stop(err, rel) from err
            self.skipped.append((rel, f"cannot finish it: {err.strerror}"))
            return
        self.count(ust)
        (self.modified if lst is not None else self.added).append(rel)

    def report(self) -> CommitReport:
        changes = Changes(tuple(sorted(self.added)), tuple(sorted(self.modified)), tuple(sorted(self.deleted)),
                          True, self.allocated)
        skipped = tuple(sorted(self.skipped))
        notes = list(self.notes)
        if skipped:
            # The change report (read_changes) lists what the run did; say what did not land.
            shown = "; ".join(f"{(p if len(p) <= 120 else p[:60] + '...' + p[-57:])!r}: {why}"
                              for p, why in skipped[:5])
            more = f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
            notes.append(f"{COMMIT_SKIPPED_NOTE}{len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} of the "
                         f"run ({shown}{more})")
        return CommitReport(changes, self.copied, skipped, tuple(notes))
