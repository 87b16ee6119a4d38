"""A run's preparation: everything that can fail or allocate before the spawn (the host ids,
the workspace model, the cgroup and rlimits, the data fds, bwrap's argv, the stdio and the fd
table of the spawn: :mod:`lowlevel.sandbox.plan`), and the anchor's argv.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import itertools
import os
import socket
import stat

from lowlevel.errors import LaunchError, LowlevelError, UnsupportedError
from lowlevel.host import cgroups as _cgroups
from lowlevel.host import fd_limit as _fd_limit
from lowlevel.host import landlock as _landlock
from lowlevel.host import seccomp_audit as _seccomp_audit
from lowlevel.host import seccomp_filter as _seccomp_filter
from lowlevel.sandbox import landlock_rules as _landlock_rules
from lowlevel.sandbox import bind_sockets as _bind_sockets
from lowlevel.sandbox import facts as _facts
from lowlevel.sandbox import teardown as _teardown
from lowlevel.sandbox._interrupts import deferred_interrupts
from lowlevel.sandbox.argv import AnchorOverlay as _AnchorOverlay
from lowlevel.sandbox.argv import Fds, anchor_argv, build_argv, encode_args, etc_copies, setup_paths, static_args
from lowlevel.sandbox.plan import (
    ARGS_FD,
    CHILD_FDS,
    ETC_COPY_FD,
    clamp_to_own_hard_limits,
    guard_numbers,
    lay_out,
    memfd,
    open_etc_copy,
    passwd_group,
)
from lowlevel.sandbox.precheck import precheck_exec
from lowlevel.sandbox.run_workspace import RunWorkspace
from lowlevel.spec import limits as _limits
from lowlevel.spec.egress import Egress
from lowlevel.spec.report import WARNING_PREFIX
from lowlevel.workspace import cow as _cow
from lowlevel.workspace import uids as _uids

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: Serial numbers of this process's run cgroups (``run-<pid>-<hex serial>``).
_CGROUP_SERIAL = itertools.count(1)

#: Seconds past a run's deadline at which the anchor kills the sandbox itself (``--deadline-ns``)
#: when the caller has not: a caller stopped (SIGSTOP), stuck or starved of CPU at its deadline.
#: The caller's own kill at the deadline comes first whenever it runs.
ANCHOR_GRACE_S = 0.2


class RunPrepare(RunWorkspace):
    """The preparation of a run (see the module docstring)."""

    def prepare(self) -> None:
        """Workspace, ids, cgroup, seccomp and fds; everything that can fail before the spawn.

        Raises:
            LaunchError: a system call failed (fd exhaustion, memfd, pipe...): ``.errno`` says
                which; every fd made so far is owned and closed by :meth:`close`.
            and the errors of :func:`run`.
        """
        try:
            self._resolve_workspace()  # may copy inputs: interruptible
            # The rest makes fds, a uid lease, a cgroup: each recorded as it is made
            # (lowlevel.sandbox._interrupts); ~1 ms.
            with deferred_interrupts():
                self._prepare()
        except LowlevelError:
            raise
        except OSError as err:
            held = "a run holds up to about 45 while it starts; each live Session about 11"
            hint = f": {_fd_limit.open_files_hint(err.errno, held)}" if err.errno in _fd_limit.FD_EXHAUSTED else ""
            raise LaunchError(f"cannot prepare the sandbox: {err.strerror or err}"
                              + (f" ({err.filename})" if err.filename else "") + hint, errno=err.errno) from err

    def _prepare(self) -> None:
        """The steps of :meth:`prepare` after the workspace is resolved, in order; each records
        what it makes (fds, the lease, the cgroup) as it makes it."""
        self._prepare_ids()
        self._note_unwritable_binds()
        support = self._workspace_model()
        precheck_exec(self.policy, self.workspace, self.command, self.environment, self.cwd,
                      self.facts.layout.etc_files)
        _landlock.require_supported(self.policy)
        bind_source, rootfs_overlay = self._prepare_workspace_mount(support)
        self._prepare_limits()
        fds, data_fds = self._prepare_data_fds()
        if isinstance(self.policy.network, Egress):
            # The host-side proxy and the relay that runs first inside (lowlevel/net/).
            from lowlevel.net.egress_run import EgressRun
            self.egress = EgressRun.open(self.policy.network, self.policy.limits.net_bytes,
                                         caller_is_root=self.facts.caller_is_root, host_gid=self.host_ids[1])
            self.extra_fds.update(self.egress.child_fds)
            for fd in self.egress.owned_fds:
                self._own(fd)  # closed after the spawn, like ours
        args_fd = self._own(memfd("lowlevel-args", encode_args(self._build_argv(bind_source, fds, rootfs_overlay))))
        self._lay_out_fds(args_fd, fds, data_fds)

    def _prepare_ids(self) -> None:
        """The sandbox's host ids: a per-run uid for root callers (unless pinned), our own otherwise."""
        policy = self.policy
        if self.facts.caller_is_root:
            if policy.host_uid is None:
                try:
                    self.lease = _uids.UidLease.acquire()
                except UnsupportedError:
                    # Every uid of the range is leased: some may be held by anchors of finished
                    # runs still exiting (lowlevel.sandbox.teardown reaps them off the result
                    # path; the lease is the anchor's lock until it exits). Wait for those, then
                    # ask once more: a range as small as the runs in flight keeps working.
                    if not _teardown.pending():
                        raise
                    _teardown.drain()
                    self.lease = _uids.UidLease.acquire()
                self.host_ids = (self.lease.uid, self.lease.uid)
            else:
                self.host_ids = (policy.host_uid, policy.host_gid if policy.host_gid is not None
                                 else policy.host_uid)
        else:
            self.host_ids = (os.getuid(), os.getgid())

    def _note_unwritable_binds(self) -> None:
        """A "warning:" note per Bind the sandbox's uid cannot use as bound: a root caller's
        sandbox runs as a per-run uid with no groups, so a root-owned 0755 directory bound with
        ``writable=True`` (``--rw``, ``-v``) refused every write with EACCES, and a 0700 source
        (read-only or not) every read, silently. bwrap itself binds such a source (the mount
        needs only its path); what the program then may do is the source's own permission bits
        for that uid (the owner's, the group's or the others' class: the first that matches, as
        the kernel decides; an ACL may grant more, so the note says "may")."""
        if not self.facts.caller_is_root:
            return
        uid, gid = self.host_ids
        for bind in self.policy.binds:
            try:
                st = os.stat(bind.source)
            except OSError:
                continue  # bwrap says it (the source vanished, or a parent is out of reach)
            shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
            bits = (st.st_mode >> shift) & 7
            is_dir = stat.S_ISDIR(st.st_mode)
            read = 4 | (1 if is_dir else 0)  # a directory is listed and entered: r and x
            owner = f"the source is uid {st.st_uid}'s, mode {stat.S_IMODE(st.st_mode):04o}"
            if bits & read != read:
                self.notes.append(f"{WARNING_PREFIX}the bind of {bind.source} at {bind.dest} may not be readable by "
                                  f"the sandbox: it runs as the per-run uid {uid}, and {owner}; make it readable for "
                                  f"others (chmod o+r{'x' if is_dir else ''}), or give it to that uid for the run")
            elif bind.writable and not bits & 2:
                self.notes.append(f"{WARNING_PREFIX}the writable bind of {bind.source} at {bind.dest} cannot be "
                                  f"written by the sandbox: it runs as the per-run uid {uid}, and {owner}; make "
                                  "it writable for others (or give it to that uid for the run), or bind it read-only")

    def _workspace_model(self) -> _cow.CowSupport:
        """Copy-on-write overlay (``self.cow``) or hand-over; refuses what the hand-over cannot do."""
        support = _cow.cow_support(self.workspace, functools.partial(_facts._probe_cow, self.facts, self.workspace,
                                                                      self.workspace_base))
        if support.transient:
            # Not a fact of the host (and not cached): falling back would change what the
            # caller gets (no discard, no write bound) because of its own limit.
            raise LaunchError(f"cannot check whether the copy-on-write workspace works here: {support.reason}. "
                              "That is a limit of the calling process (open files: `ulimit -n`; memory; "
                              "processes) or an interruption, not of the host: raise the limit and run again",
                              errno=errno.EMFILE if "open files" in support.reason else None)
        self.cow = support.ok
        if not self.cow and self.commit is not True and not self.owns_workspace:
            # The hand-over model writes straight into the caller's directory: there is nothing
            # to discard afterwards. Refused before anything is touched.
            how = "commit=False (--discard)" if self.commit is False else "commit='on_success' (--commit-on-success)"
            raise UnsupportedError("overlay", f"{how} needs the copy-on-write workspace, which is unavailable for "
                                   f"{self.workspace} ({support.reason}): the program would write the directory "
                                   "itself, so its changes could not be discarded; nothing was run",
                                   "run without --discard on a copy of the directory, or see `lowlevel doctor`")
        return support

    def _prepare_workspace_mount(self, support: _cow.CowSupport) -> tuple[str, str | None]:
        """``(the workspace's bind source, the writable root's overlay dir or None)``."""
        policy = self.policy
        rootfs_overlay: str | None = None
        if self.cow:
            self._open_lower()
            self.upper_bytes = policy.limits.workspace_bytes or _cow.DEFAULT_UPPER_BYTES
            self.mnt = _cow.mount_dir(self.workspace_base)
            bind_source = f"{self.mnt}/ws"
            if policy.limits.upper == "disk":
                self._open_disk_upper()
            else:
                self.notes.append(f"workspace: copy-on-write overlay; the run's writes are bounded to "
                                  f"{self.upper_bytes} bytes")
            if policy.rootfs is not None and policy.rootfs_writable:
                # The anchor overlays the whole tree too (lowlevel.rootfs, "Writable root").
                self.root_fd = self._own(os.open(policy.rootfs, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW
                                                 | os.O_CLOEXEC))
                rootfs_overlay = f"{self.mnt}/root"
                self.notes.append("root filesystem: copy-on-write overlay, discarded after the run (its writes "
                                  "count in the same bound)")
        else:
            if policy.limits.upper == "disk":
                raise UnsupportedError("disk-upper", "Limits.upper='disk' places the copy-on-write overlay's upper "
                                       f"layer on disk, and the overlay is unavailable here ({support.reason})",
                                       "leave upper='tmpfs', or see `lowlevel doctor`")
            bind_source = self._prepare_handover(support.reason)
        return bind_source, rootfs_overlay

    def _open_disk_upper(self) -> None:
        """``Limits.upper="disk"``: the run's loop device (:mod:`lowlevel.workspace.disk_upper`)."""
        from lowlevel.workspace import disk_upper as _disk_upper
        _disk_upper.check_caller(self.facts.caller_is_root)
        upper = _disk_upper.open_disk_upper(self.upper_bytes)
        self.upper_dev_fd = self._own(upper.fd)  # the anchor mounts its copy; ours closes with the others
        # No device name (/dev/loopN varies): the note is the same for every run of a Policy.
        self.notes.append(f"workspace: copy-on-write overlay, its upper layer on disk (ext4 on a loop device, an "
                          f"unnamed sparse file in {upper.directory}); the run's writes are bounded to "
                          f"{self.upper_bytes} bytes")

    def _prepare_limits(self) -> None:
        """The run's cgroup (and the fds the anchor joins it by) and its rlimits."""
        policy = self.policy
        root = self.facts.caller_is_root
        # A serial, not id(self): a cgroup an interrupted run left behind must not collide with a
        # later Run object that CPython put at the same address (EEXIST, LaunchError).
        self.cgroup = _cgroups.RunCgroup.create(policy.limits, f"run-{os.getpid()}-{next(_CGROUP_SERIAL):x}",
                                               workspace=self.workspace)  # recorded: lowlevel.host.run_records
        if self.cgroup is None:
            self.notes.append("no writable cgroup hierarchy: memory, pids and CPU bounded by rlimits only")
        else:
            tasks, v2_dir = self.cgroup.join_targets()
            for path in tasks:
                self.cgroup_fds.append(self._own(os.open(path, os.O_WRONLY | os.O_CLOEXEC)))
            if v2_dir is not None:
                self.cgroup_dir_fd = self._own(os.open(v2_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        triples = _limits.rlimits(policy.limits, self.cgroup)
        triples, lowered = clamp_to_own_hard_limits(triples, may_raise=root and self.facts.cap_sys_resource)
        self.notes.extend(lowered)
        self.pre_exec_rlimits = triples
        self.rlimits_applied = tuple(name for name, _s, _h in triples)
        self.notes.extend(_limits.fallback_notes(policy.limits, self.cgroup))

    def _prepare_data_fds(self) -> tuple[Fds, list[tuple[int, int]]]:
        """The memfds and files bwrap reads (seccomp BPF, /etc/passwd and /etc/group, the /etc
        copies): ``(bwrap's fd numbers, [(fd here, fd in the child), ...])``."""
        policy = self.policy
        if policy.seccomp is not None and policy.seccomp.log:
            # Audit mode: the kernel logs what the profile would deny; read back at the end.
            try:
                self.audit = _seccomp_audit.DenialAudit()
            except UnsupportedError as err:
                self.notes.append(f"seccomp audit unavailable: {err}")
        bpf = _seccomp_filter.compile_bpf(policy.seccomp, compat_32bit=policy.compat_32bit) \
            if policy.seccomp is not None else None
        fds = CHILD_FDS
        seccomp_fd = None
        if bpf:
            seccomp_fd = self._own(_seccomp_filter.bpf_memfd(bpf))
            self.seccomp_loaded = True
        else:
            fds = Fds(json_status=fds.json_status, seccomp=None, passwd=fds.passwd, group=fds.group)
        uid = policy.sandbox_uid if policy.sandbox_uid is not None else self.host_ids[0]
        gid = policy.sandbox_gid if policy.sandbox_gid is not None else self.host_ids[1]
        passwd, group = passwd_group(uid, gid)
        passwd_fd = self._own(memfd("lowlevel-passwd", passwd))
        group_fd = self._own(memfd("lowlevel-group", group))
        etc_fds = [self._own(open_etc_copy(path)) for path in etc_copies(policy, self.facts)]
        data = [(passwd_fd, fds.passwd or 0), (group_fd, fds.group or 0)]
        data += [(fd, ETC_COPY_FD + i) for i, fd in enumerate(etc_fds)]
        if seccomp_fd is not None:
            data.append((seccomp_fd, fds.seccomp or 0))
        return fds, data

    def _build_argv(self, bind_source: str, fds: Fds, rootfs_overlay: str | None) -> list[str]:
        """bwrap's options (``self.argv``), with the checks that the cached parts still hold."""
        policy = self.policy
        tree = None
        if policy.rootfs is not None:
            from lowlevel.rootfs import check_setup_paths, rootfs_layout
            self._check_rootfs_layout(policy.rootfs)
            tree = rootfs_layout(policy.rootfs)
        for bind in policy.binds:  # each source still the one the Policy checked (not swapped since)
            bind.check_unchanged()
        if policy.binds:  # the cached socket masks still cover what they did (lowlevel.sandbox.bind_sockets)
            if _bind_sockets.revalidate(policy, self.facts.caller_is_root):
                static_args.cache_clear()  # it carries the stale masks
        tree_masks: tuple[str, ...] = ()
        if tree is not None and not policy.rootfs_writable:
            # A read-only tree is bound by path: its unix sockets (a live chroot's services) are
            # masked as a bind's are. (A writable root is an overlay, which passes no socket.)
            tree_masks, tree_notes = _bind_sockets.tree_masks(
                tree.path, tree.dirs, _bind_sockets.sandbox_ids(policy, self.facts.caller_is_root))
            self.notes.extend(tree_notes)
        self.argv = build_argv(policy, self.facts, workspace=bind_source, fds=fds,
                               extra_env=self.env_extra or None,
                               extra_mounts=(*(self.egress.mounts if self.egress is not None else ()),
                                             *self.workspace_masks, *tree_masks),
                               rootfs_overlay=rootfs_overlay)
        if tree is not None:
            # No setup path through a symlink of the tree: bwrap would resolve it on the host's
            # tree (/oldroot) while it still holds the host's fds (issue 22 item 1).
            check_setup_paths(tree, setup_paths(self.argv))
        if policy.binds:  # the unix sockets masked in bound directories, and what that leaves open
            self.notes.extend(_bind_sockets.notes(policy, self.facts.caller_is_root, _landlock.planned_abi()))
        # Last line of defence: the --args memfd is NUL-separated, so a NUL inside a value would
        # split it into extra bwrap options. The policy edge refuses them already; encode_args
        # refuses again (LaunchError) right before the bytes are written.
        if self.guard and self.egress is None and self.facts.bwrap.has("--as-pid-1"):
            # The guard is the PID 1 of the sandbox's PID namespace in place of bwrap's reaper
            # (it reaps orphans itself): one process less per run, and the kernel keeps the
            # program from signalling its PID 1 at all. (Egress: the relay comes first.)
            self.argv = [*self.argv, "--as-pid-1"]
        return self.argv

    def _prepare_stdio(self) -> tuple[list[tuple[int, int]], bool]:
        """The program's stdio: ``([(fd here, 0/1/2), ...], stdin from /dev/null)``."""
        stdio: list[tuple[int, int]] = []
        devnull_stdin = False
        if self.stdin is not None:
            in_r, in_w = self._pipe()
            self.stdin_w = in_w
            os.set_blocking(in_w, False)
            self.stdin_view = memoryview(self.stdin)
            stdio.append((in_r, 0))
        elif self.stdio_fds[0] is not None:
            stdio.append((self.stdio_fds[0], 0))
        elif self.capture:
            devnull_stdin = True
        if self.capture:
            out_r, out_w = self._pipe()
            err_r, err_w = self._pipe()
            self.out_r, self.err_r = out_r, err_r
            stdio += [(out_w, 1), (err_w, 2)]
        else:
            stdio += [(fd, i) for i, fd in enumerate(self.stdio_fds) if i and fd is not None]
        return stdio, devnull_stdin

    def _lay_out_fds(self, args_fd: int, fds: Fds, data_fds: list[tuple[int, int]]) -> None:
        """THE fd table of the spawn (:mod:`lowlevel.sandbox.plan`): the json-status pipe, the report
        socket and the stdio, then every fd onto its child number (``self.actions``: posix_spawn's
        dup2s), ``self.pass_fds`` (what the anchor passes on to bwrap) and ``self.anchor_fds``.
        """
        json_r, json_w = self._pipe()
        self.json_r = json_r
        report, report_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.report = report
        self.report_child = report_child
        report.setblocking(False)
        stdio, devnull_stdin = self._prepare_stdio()
        mapping = stdio + [(args_fd, ARGS_FD), (json_w, fds.json_status), *data_fds]
        mapping += [(parent_fd, child_fd) for child_fd, parent_fd in sorted(self.extra_fds.items())]
        if self.guard:
            # The guard's executable and its report pipe, on the first numbers above the others.
            exe_child, _status_child = guard_numbers(mapping)
            status_r, status_w = self._pipe()
            self.status_r = status_r
            mapping += [(_landlock.guard_fd(), exe_child), (status_w, exe_child + 1)]
            rules = _landlock_rules.ruleset_args(self.policy, self.facts.layout.ro_dirs, self.facts.bwrap.options)
            self.guard_prefix = _landlock.guard_argv(exe_child, exe_child + 1, rules, cwd=self.cwd)
        # The anchor's own fds (never passed on to bwrap) go right above bwrap's.
        own = (("report", report_child.fileno()), ("lower", self.lower_fd), ("root", self.root_fd),
               ("lease", self.lease.fd if self.lease is not None else None), ("upper_dev", self.upper_dev_fd))
        layout = lay_out(mapping, own, self.cgroup_fds, self.cgroup_dir_fd)
        self.pass_fds = layout.pass_fds
        self.anchor_fds = layout.anchor_fds
        # Move every source above all targets first, so no dup2 clobbers a later source, and
        # no dup2 has src == dst (which would leave FD_CLOEXEC set). Every other fd of ours is
        # O_CLOEXEC (PEP 446), and the anchor closes whatever else it inherited.
        actions: list[tuple[Any, ...]] = []
        if devnull_stdin:
            actions.append((os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0))
        for src, dst in layout.mapping:
            if src < layout.threshold:
                try:
                    src = self._own(fcntl.fcntl(src, fcntl.F_DUPFD_CLOEXEC, layout.threshold))
                except OSError as err:
                    # fcntl(2): EINVAL when the threshold is at or past RLIMIT_NOFILE: the fd limit.
                    code = errno.EMFILE if err.errno == errno.EINVAL else (err.errno or errno.EMFILE)
                    raise OSError(code, os.strerror(code)) from err
            actions.append((os.POSIX_SPAWN_DUP2, src, dst))
        self.actions = actions
        self.json_w = json_w

    # -- 2. spawn ------------------------------------------------------------------------
    def anchor_argv(self) -> list[str]:
        """The argv exec'd: ``_lowlevel_exec OPTIONS -- bwrap --args 3 -- COMMAND...``."""
        ov: _AnchorOverlay | None = None
        if self.cow:
            assert self.lower_stat is not None
            ov = _AnchorOverlay(mnt=self.mnt, lower_fd=self.anchor_fds["lower"], upper_bytes=self.upper_bytes,
                                upper_inodes=_cow.upper_inodes(self.upper_bytes),
                                lower_path=None if self.facts.caller_is_root else self.workspace,
                                idmap=(self.lower_stat.st_uid, self.lower_stat.st_gid)
                                if self.facts.caller_is_root else None,
                                root_lower_fd=self.anchor_fds.get("root"),
                                root_lower_path=None if self.facts.caller_is_root or self.root_fd is None
                                else self.policy.rootfs,
                                # A workspace we made a moment ago, nothing copied in: empty.
                                empty_lower=self.one_shot and self.owns_workspace and not self.inputs,
                                upper_dev_fd=self.anchor_fds.get("upper_dev"))
        return anchor_argv(self.facts, _facts._exec_helper(), parent=os.getpid(), report_fd=self.anchor_fds["report"],
                           cgroup_fds=self.anchor_fds["cgroups"], cgroup_dir_fd=self.anchor_fds.get("cgroup_dir"),
                           rlimits=self.pre_exec_rlimits,
                           ids=self.host_ids if self.facts.caller_is_root else None, overlay=ov,
                           keep_fds=(self.anchor_fds["lease"],) if "lease" in self.anchor_fds else (),
                           pass_fds=self.pass_fds, args_fd=ARGS_FD, command=self._inner_command(),
                           # The anchor enforces the deadline too (a stopped caller cannot extend a run).
                           deadline_ns=None if self.deadline is None
                           else round((self.deadline + self.kill_after + ANCHOR_GRACE_S) * 1e9))

    def _inner_command(self) -> list[str]:
        """What bwrap runs: the egress relay (outside Landlock: it listens on the proxy port),
        then the guard, then the command."""
        command = [*self.guard_prefix, *self.command]
        return self.egress.wrap(command) if self.egress is not None else command


__all__ = ["ANCHOR_GRACE_S", "RunPrepare"]
