"""Policy (+ host facts + fd numbers) -> bwrap argv. Pure: no I/O, golden-list testable.

The argv is split in two: the *static* part depends only on the Policy and the host
(cached per Policy, so thousands of runs build it once) and the *dynamic* part carries the
per-run workspace, fd numbers, extra environment and command.

Mount order matters (bwrap applies filesystem options in order): the read-only base
first, then ``/proc``, ``/dev``, ``/tmp``, the user's binds, the workspace, and last
``--remount-ro /`` so the sandbox root (a tmpfs bwrap creates) is not a second writable
place. Source: bwrap(1), "--remount-ro" and the ordering note.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Mapping, Sequence

from lowlevel._dataclass import dataclass
from lowlevel.sandbox import bind_sockets as _bind_sockets
from lowlevel.spec.egress import EGRESS_ETC, Egress
from lowlevel.errors import LaunchError
from lowlevel.spec.policy import WORKSPACE_DEST, Policy
from lowlevel.host.probe import BwrapInfo, HostLayout

#: /etc entries bound only with ``network=True``: name resolution and TLS trust (egress mode
#: binds only the TLS ones, :data:`lowlevel.spec.egress.EGRESS_ETC`). Of ``/etc/ssl`` only the
#: certificates and OpenSSL's configuration: ``/etc/ssl/private`` holds the host's TLS keys
#: (mode 0710, group ``ssl-cert``: a caller in that group could read them by name).
NETWORK_ETC = ("/etc/resolv.conf", "/etc/hosts", "/etc/ssl/certs", "/etc/ssl/openssl.cnf", "/etc/ca-certificates",
               "/etc/gai.conf", "/etc/host.conf")


@dataclass(frozen=True)
class HostFacts:
    """Host facts the argv depends on (all from :mod:`lowlevel.host.probe`).

    Attributes:
        bwrap: the installed bwrap's version and options.
        layout: usr-merge symlinks, read-only top-level dirs, /etc entries present.
        caller_is_root: the caller's uid is 0 (then the sandbox runs as ``policy.host_uid``).
        network_etc: ``(source, dest)`` pairs of network /etc entries that exist, resolved
            (``/etc/resolv.conf`` is often a symlink into ``/run``).
        cap_sys_resource: the caller holds CAP_SYS_RESOURCE. A root caller without it (some
            container and VM hosts drop it) cannot prlimit(2) a process of another uid, so
            its rlimits are set before bwrap's exec instead, by the anchor (:func:`anchor_argv`).
    """

    bwrap: BwrapInfo
    layout: HostLayout
    caller_is_root: bool
    network_etc: tuple[tuple[str, str], ...] = ()
    cap_sys_resource: bool = True


@dataclass(frozen=True)
class Fds:
    """Fd numbers as bwrap will see them (the launcher dup2s its fds onto these).

    Attributes:
        json_status: ``--json-status-fd`` (child-pid first, exit-code when the program ran).
            No ``--block-fd``: the limits are in force before bwrap starts (the anchor,
            ``native/lowlevel_exec.c``), and bwrap reads EOF on a block fd as "go".
        seccomp: ``--seccomp`` BPF memfd, or None for no filter.
        passwd, group: ``--ro-bind-data`` sources for /etc/passwd and /etc/group, or None.
    """

    json_status: int = 4
    seccomp: int | None = 6
    passwd: int | None = 7
    group: int | None = 8


#: The first fd of the host ``/etc`` files copied into the sandbox (see :func:`etc_plan`): the
#: n-th copied file is read from ``ETC_COPY_FD + n``, n < ``len(probe.ETC_ENTRIES)``: above the
#: Session's (9, 10) and the egress relay's (20, 21) fds; ``Run(extra_fds=...)`` refuses them.
ETC_COPY_FD = 24
#: Larger ``/etc`` files stay read-only binds: a copy is made per run.
ETC_COPY_MAX_BYTES = 1 << 20


@functools.lru_cache(maxsize=16)
def etc_plan(etc_files: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    """How each host ``/etc`` entry reaches the sandbox: ``(kind, path, arg)`` per entry.

    - ``("file", path, "")``: a regular file of at most :data:`ETC_COPY_MAX_BYTES` that
      every user may read (``S_IROTH``), copied into the sandbox's root tmpfs (``--perms 0644
      --file FD path``; the launcher opens the host file for each run, so the copy is the file
      as it is at the start of the run). A file others cannot read stays a bind: the copy is
      read by the caller (root: any file) and is 0644 inside, so it would hand the sandbox's
      uid what the host's permissions refuse it (and an unprivileged caller could not open
      it at all, failing every run where the bind gave an unreadable file);
    - ``("symlink", path, target)``: a symlink (``/etc/localtime``) whose target, read as the
      sandbox reads it, walks only ``/usr`` (which the sandbox has read-only, the host's):
      an absolute target, or a relative one that only climbs out of the link's directory
      (``../usr/share/zoneinfo/...``, as systemd writes it) before entering ``/usr``, and that
      resolves where the host's link does. The same symlink (``--symlink``). A target that
      passes through another host path (``zoneinfo/UTC`` via a host ``/etc/zoneinfo``
      symlink) would dangle inside: it stays a bind;
    - ``("bind", path, path)``: anything else (directories such as ``/etc/alternatives``),
      a read-only bind as before.

    Why: every bind mount costs bwrap a mount (and its read-only remount) in the new mount
    namespace: about 0.1 ms each on the development VM, against ~0.03 ms to write a copy of
    these small files into the root tmpfs (bench/README.md, "What changed, second pass"). The root tmpfs
    is remounted read-only at the end (``--remount-ro /``), so a copy is exactly as read-only
    as the bind, and the sandbox sees five host mounts fewer. The kind of each entry is read
    once per process (cached); a file that became something else (a symlink, directory, FIFO,
    device, a file over the size bound or no longer readable by others) is refused at the next
    run by the launcher (:func:`etc_copy_refusal` on what it opened), never silently bound.

    Args:
        etc_files: :attr:`lowlevel.host.probe.HostLayout.etc_files`, absolute paths.
    Returns:
        One triple per entry, in the given order.
    Source: bwrap(1) ``--file``, ``--perms``, ``--symlink``, ``--remount-ro``.
    """
    plan = []
    for path in etc_files:
        try:
            st = os.lstat(path)
        except OSError:
            plan.append(("bind", path, path))
            continue
        if etc_copy_refusal(st) is None:
            plan.append(("file", path, ""))
        elif stat.S_ISLNK(st.st_mode) and (target := _usr_link_target(path)) is not None:
            plan.append(("symlink", path, target))
        else:
            plan.append(("bind", path, path))
    return tuple(plan)


def etc_copy_refusal(st: os.stat_result) -> str | None:
    """Why a host ``/etc`` entry with this ``stat`` cannot be copied into the sandbox, or None.

    A copy (:func:`etc_plan`) must be a regular file (not a FIFO or device bwrap would read
    from, nor a directory), of at most :data:`ETC_COPY_MAX_BYTES` (the copy lives in the
    sandbox's root tmpfs, in memory, once per run), readable by every user (``S_IROTH``: the
    copy is 0644 inside, readable by the sandbox's uid, whatever the host file allowed).
    """
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size > ETC_COPY_MAX_BYTES:
        return f"larger than {ETC_COPY_MAX_BYTES} bytes"
    if not st.st_mode & stat.S_IROTH:
        return f"not readable by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _usr_link_target(path: str) -> str | None:
    """The target of the symlink ``path`` when the sandbox, which has the host's ``/usr`` and
    bwrap's own directories above ``path``, resolves it to the same file inside ``/usr``."""
    target = os.readlink(path)
    parts = [p for p in target.split("/") if p not in ("", ".")]
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    # Only leading "..": they climb bwrap's directories (the link's parents), which exist
    # inside; a ".." later, or a first component other than "usr", would walk host paths.
    if ".." in parts[ups:]:
        return None
    lexical = os.path.normpath(os.path.join("/" if target.startswith("/") else os.path.dirname(path), target))
    if not lexical.startswith("/usr/"):
        return None
    real = os.path.realpath(path)
    if not real.startswith("/usr/") or os.path.realpath(lexical) != real:
        return None
    return target


def etc_copies(policy: Policy, facts: HostFacts) -> tuple[str, ...]:
    """The host ``/etc`` files the run's bwrap copies, in fd order (``ETC_COPY_FD + i``).

    Empty with ``Policy.rootfs`` (the tree has its own /etc) or a bwrap without ``--perms``
    and ``--file`` (every entry is then a bind)."""
    if not _etc_as_files(policy, facts):
        return ()
    return tuple(path for kind, path, _arg in etc_plan(facts.layout.etc_files) if kind == "file")


def _etc_as_files(policy: Policy, facts: HostFacts) -> bool:
    return policy.rootfs is None and facts.bwrap.has("--perms") and facts.bwrap.has("--file")


def _host_base_args(policy: Policy, facts: HostFacts) -> list[str]:
    """The host's system, read-only: ``/usr``, the usr-merge symlinks or read-only top-level
    dirs, the ``/etc`` entries (copied, linked or bound: :func:`etc_plan`), and the network
    ``/etc`` entries the Policy's network needs."""
    a: list[str] = []
    # Read-only base: /usr, then the usr-merge symlinks or read-only top-level dirs.
    a += ["--ro-bind", "/usr", "/usr"]
    for target, name in facts.layout.symlinks:
        a += ["--symlink", target, name]
    for path in facts.layout.ro_dirs:
        a += ["--ro-bind", path, path]
    # Without bwrap's --perms/--file every entry is a bind.
    plan = (etc_plan(facts.layout.etc_files) if _etc_as_files(policy, facts)
            else tuple(("bind", path, path) for path in facts.layout.etc_files))
    copied = 0
    for kind, path, arg in plan:
        if kind == "file":
            a += ["--perms", "0644", "--file", str(ETC_COPY_FD + copied), path]
            copied += 1
        elif kind == "symlink":
            a += ["--symlink", arg, path]
        else:
            a += ["--ro-bind", path, path]
    if policy.network is True:
        for source, dest in facts.network_etc:
            a += ["--ro-bind", source, dest]
    elif isinstance(policy.network, Egress):
        # Egress: TLS trust only; no resolv.conf or hosts (there is no DNS inside).
        for source, dest in facts.network_etc:
            if dest in EGRESS_ETC:
                a += ["--ro-bind", source, dest]
    return a


@functools.lru_cache(maxsize=256)
def static_args(policy: Policy, facts: HostFacts, rootfs_overlay: str | None = None) -> tuple[str, ...]:
    """The per-Policy part of bwrap's argv (cached; treat the tuple as read-only).

    Args:
        policy: the sandbox description.
        facts: host facts from the probes.
        rootfs_overlay: ``rootfs_writable`` with the anchor's overlay of the tree: its merged
            directory (``<mnt>/root``), whose top-level directories are bound read-write.
    Returns:
        bwrap options, without the program name, fds, workspace or command.
    """
    a: list[str] = []
    a += ["--unshare-all"]
    if policy.network is True:
        a += ["--share-net"]
    # --unshare-user explicitly: --unshare-all only *tries* it, and --disable-userns needs it.
    a += ["--unshare-user"]
    if facts.bwrap.can_disable_userns:
        a += ["--disable-userns"]
    a += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    env = policy.environment()
    for key in sorted(env):
        a += ["--setenv", key, env[key]]
    a += ["--hostname", policy.hostname]
    if policy.sandbox_uid is not None:
        a += ["--uid", str(policy.sandbox_uid)]
    if policy.sandbox_gid is not None:
        a += ["--gid", str(policy.sandbox_gid)]
    if policy.rootfs is not None:
        # A root filesystem tree instead of the host's system (lowlevel.rootfs; its layout is read
        # once per process and tree: the only I/O here). Egress mode binds no host network /etc
        # over the tree's (there is no DNS inside; the tree has its own TLS trust store).
        from lowlevel.rootfs import base_args, rootfs_layout
        a += base_args(rootfs_layout(policy.rootfs), writable=policy.rootfs_writable,
                       bwrap_options=facts.bwrap.options, network=policy.network is True,
                       network_sources=facts.network_etc, tmp_size=policy.limits.tmp_size_bytes,
                       anchor_overlay=rootfs_overlay)
    else:
        a += _host_base_args(policy, facts)
    a += ["--proc", "/proc", "--dev", "/dev"]
    tmp_size = policy.limits.tmp_size_bytes
    if tmp_size is not None and facts.bwrap.has("--size"):
        a += ["--size", str(tmp_size)]
    a += ["--tmpfs", "/tmp"]
    # /dev/shm (POSIX semaphores, multiprocessing) on its own sized tmpfs, like /tmp.
    if tmp_size is not None and facts.bwrap.has("--size"):
        a += ["--size", str(tmp_size)]
    a += ["--tmpfs", "/dev/shm"]
    # bwrap's /dev is an unsized tmpfs: left writable, it is a second, unbounded place to write
    # (memory outside every limit when no cgroup applies). /dev/shm, /dev/pts and the device
    # nodes are separate mounts or inodes and keep working.
    a += ["--remount-ro", "/dev"]
    # Each bind, then masks over the unix sockets found in it (lowlevel.sandbox.bind_sockets: a walk of
    # each directory bind, once per Policy; the only other I/O here).
    scans = _bind_sockets.plan(policy, facts.caller_is_root) if policy.binds else ()
    for bind in policy.binds:
        a += ["--bind" if bind.writable else "--ro-bind", bind.source, bind.dest]
        a += _bind_sockets.mask_args(bind, scans)
    return tuple(a)


def dynamic_args(
    *,
    workspace: str,
    fds: Fds,
    extra_env: Mapping[str, str] | None = None,
    clearenv: bool = False,
    extra_mounts: Sequence[str] = (),
    passwd_as_file: bool = False,
) -> list[str]:
    """The per-run part of bwrap's argv.

    Args:
        workspace: host path of the run's workspace, bound read-write at ``/workspace``.
        fds: fd numbers bwrap will see.
        extra_mounts: bwrap mount options placed before ``--remount-ro /`` (the egress
            proxy's socket and CA bundle: :class:`lowlevel.net.egress_run.EgressRun`).
        extra_env: variables set on top of the Policy's environment.
        clearenv: emit ``--clearenv`` before ``extra_env`` (bwrap applies it where it stands),
            so ``extra_env`` is then the whole environment, set in sorted order.
        passwd_as_file: write /etc/passwd and /etc/group as files of the sandbox's root tmpfs
            (``--perms 0644 --file FD``), made read-only with the whole root by ``--remount-ro /``
            below, instead of a read-only bind mount each (``--ro-bind-data``: a tmpfs file, a
            bind, and a re-read of the mount table to remount it: ~0.3 ms of CPU per sandbox,
            bench/bwrap_parts.py). Only where the root is that tmpfs (the host layout).
    """
    a = ["--bind", workspace, WORKSPACE_DEST]
    for fd, dest in ((fds.passwd, "/etc/passwd"), (fds.group, "/etc/group")):
        if fd is None:
            continue
        a += ["--perms", "0644", "--file", str(fd), dest] if passwd_as_file else ["--ro-bind-data", str(fd), dest]
    a += extra_mounts
    # ``--chdir /``, never the run's cwd: bwrap 0.8.0 changes directory while it still holds an
    # O_PATH fd of the host's /proc, so a cwd through /proc/self/fd/N started the program in the
    # host's tree (CVE-2024-21626 class). The guard or the session init changes to the cwd once
    # bwrap has closed its fds, and checks it with getcwd(2) (lowlevel.spec.validate.sandbox_cwd).
    a += ["--remount-ro", "/", "--chdir", "/"]
    if clearenv:
        a += ["--clearenv"]
    if extra_env:
        for key in sorted(extra_env):
            a += ["--setenv", key, extra_env[key]]
    a += ["--json-status-fd", str(fds.json_status)]
    if fds.seccomp is not None:
        a += ["--seccomp", str(fds.seccomp)]
    return a


def build_argv(policy: Policy, facts: HostFacts, *, workspace: str, fds: Fds,
               extra_env: Mapping[str, str] | None = None,
               extra_mounts: Sequence[str] = (), rootfs_overlay: str | None = None) -> list[str]:
    """bwrap's options (without ``bwrap`` itself or the command), static then dynamic part.

    ``rootfs_overlay``: see :func:`static_args`.

    Returns:
        ``list[str]``; the launcher passes it through ``--args FD`` so no policy is too long
        for the kernel's argv limit (E2BIG). bwrap takes only options from ``--args``: the
        command follows on the real argv (see :func:`anchor_argv`).

        Deterministic mode with ``extra_env``: the per-run part clears the environment and sets
        all of it again in sorted order, so ``environ`` inside is sorted (bwrap's setenv appends
        new names at the end of ``environ``, after the static part's).
    """
    # The host layout's root is bwrap's tmpfs, remounted read-only at the end: /etc/passwd and
    # /etc/group can be plain files of it (bwrap >= 0.5 has --perms).
    as_file = _etc_as_files(policy, facts)
    if policy.deterministic and extra_env:
        return [*static_args(policy, facts, rootfs_overlay),
                *dynamic_args(workspace=workspace, fds=fds, extra_env=policy.environment(extra_env),
                              clearenv=True, extra_mounts=extra_mounts, passwd_as_file=as_file)]
    return [*static_args(policy, facts, rootfs_overlay),
            *dynamic_args(workspace=workspace, fds=fds, extra_env=extra_env, extra_mounts=extra_mounts,
                          passwd_as_file=as_file)]


#: The arguments each bwrap option takes (bwrap(1), 0.8.0 and later: ``--overlay-src``,
#: ``--tmp-overlay``); an option not listed takes none.
BWRAP_ARITY = {"--args": 1, "--userns": 1, "--userns2": 1, "--pidns": 1, "--uid": 1, "--gid": 1, "--hostname": 1,
               "--chdir": 1, "--setenv": 2, "--unsetenv": 1, "--lock-file": 1, "--sync-fd": 1,
               "--bind": 2, "--bind-try": 2, "--dev-bind": 2, "--dev-bind-try": 2, "--ro-bind": 2,
               "--ro-bind-try": 2, "--bind-fd": 2, "--ro-bind-fd": 2, "--remount-ro": 1, "--exec-label": 1,
               "--file-label": 1, "--proc": 1, "--dev": 1, "--tmpfs": 1, "--mqueue": 1, "--dir": 1, "--file": 2,
               "--bind-data": 2, "--ro-bind-data": 2, "--symlink": 2, "--seccomp": 1, "--add-seccomp-fd": 1,
               "--block-fd": 1, "--userns-block-fd": 1, "--info-fd": 1, "--json-status-fd": 1, "--cap-add": 1,
               "--cap-drop": 1, "--perms": 1, "--size": 1, "--chmod": 2, "--overlay-src": 1, "--tmp-overlay": 1,
               "--ro-overlay": 1, "--overlay": 3}

#: Options whose last argument is a path in the new root that bwrap creates, mounts on or
#: changes while it sets up (before it drops its fds of the host).
_DEST_OPTIONS = frozenset({"--bind", "--bind-try", "--dev-bind", "--dev-bind-try", "--ro-bind", "--ro-bind-try",
                           "--bind-fd", "--ro-bind-fd", "--remount-ro", "--proc", "--dev", "--tmpfs", "--mqueue",
                           "--dir", "--file", "--bind-data", "--ro-bind-data", "--symlink", "--chmod",
                           "--tmp-overlay", "--ro-overlay", "--overlay", "--lock-file"})


def setup_paths(argv: Sequence[str]) -> list[tuple[str, str]]:
    """``(option, path inside)`` for each option of bwrap's ``argv`` (options only, as
    :func:`build_argv` returns them) that makes bwrap create, mount on or change a path of the new
    root during setup. bwrap resolves those paths before ``pivot_root`` into the sandbox, while
    the host's tree is its ``/oldroot`` and it holds an fd of the host's ``/proc``: a path through
    a symlink there reaches the host (issue 22 item 1; :func:`lowlevel.rootfs.symlink_on_the_way`)."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        opt = argv[i]
        n = BWRAP_ARITY.get(opt, 0)
        if opt in _DEST_OPTIONS and i + n < len(argv):
            out.append((opt, argv[i + n]))
        i += 1 + n
    return out


def encode_args(argv: Sequence[str]) -> bytes:
    """bwrap's ``--args`` memfd content: each element, then a NUL byte.

    The last line against option injection (issue 10, item 1): every value was validated at
    the policy edge (:mod:`lowlevel.spec.validate`), and this refuses once more, right before the
    bytes are written, any element that is not a str, holds a NUL (which would make bwrap read
    two options where we meant one) or cannot be encoded. Fails closed: nothing is spawned.

    Args:
        argv: the options, as :func:`build_argv` returns them.
    Returns:
        ``b"opt\\0value\\0..."`` (strings encoded with :func:`os.fsencode`).
    Raises:
        LaunchError: an element would not arrive in bwrap as exactly one argument.
    Source: bwrap(1) ``--args FD``.
    """
    if argv and all(type(arg) is str and "\0" not in arg for arg in argv):
        # The common case in one encode (the same bytes as the loop below, which names the
        # element at fault when this one cannot be encoded).
        try:
            return os.fsencode("\0".join(argv)) + b"\0"
        except UnicodeEncodeError:
            pass
    out = bytearray()
    for i, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise LaunchError(f"refusing to launch: argument {i} is a {type(arg).__name__}, not a str",
                              argv=[a for a in argv if isinstance(a, str)])
        try:
            data = os.fsencode(arg)
        except UnicodeEncodeError:
            raise LaunchError(f"refusing to launch: argument {i} {arg!r:.80} cannot be encoded",
                              argv=redact_env_values(argv)) from None
        if b"\0" in data:
            raise LaunchError(f"refusing to launch: argument {i} {arg!r:.80} contains a NUL byte, which "
                              "would split it into separate arguments", argv=redact_env_values(argv))
        out += data
        out += b"\0"
    return bytes(out)


def redact_env_values(argv: Sequence[str]) -> list[str]:
    """Copy of ``argv`` with the value after each ``--setenv NAME`` replaced by ``"***"``.

    For logs: environment values a caller passes into the sandbox may be secrets (tokens);
    their names are kept.
    """
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--setenv" and i + 2 < len(out):
            out[i + 2] = "***"
    return out


def _rlimit_value(value: int) -> str:
    """An rlimit value as ``_lowlevel_exec`` spells it (``resource.RLIM_INFINITY`` is -1)."""
    return "unlimited" if value < 0 else str(value)


@dataclass(frozen=True)
class AnchorOverlay:
    """The copy-on-write workspace the anchor mounts (see ``native/lowlevel_exec.c``).

    Attributes:
        mnt: host directory the run's tmpfs is mounted on, in the anchor's mount namespace;
            bwrap binds ``<mnt>/ws`` at /workspace.
        lower_fd: the workspace (an O_DIRECTORY fd number as the anchor sees it).
        upper_bytes, upper_inodes: size bound of the upper tmpfs (bytes) and its inode bound.
        lower_path: unprivileged callers: the workspace path, opened again by the anchor in
            its mount namespace and checked to be ``lower_fd``'s directory; None for root.
        idmap: root callers: ``(uid, gid)`` owning the workspace, mapped to the sandbox's ids
            through an idmapped mount of the lower layer; None otherwise.
        root_lower_fd: ``Policy.rootfs_writable``: the root filesystem tree (an O_PATH
            directory fd as the anchor sees it), overlaid at ``<mnt>/root``; None otherwise.
        root_lower_path: unprivileged callers: the tree's path, opened again by the anchor in
            its mount namespace and checked to be ``root_lower_fd``'s directory.
        empty_lower: the workspace is one the launcher just created, empty, for a one-shot
            run: the anchor's lower layer is an empty directory of the run's tmpfs instead of
            the workspace (no idmapped clone: ~0.35 ms of CPU less per run); ``lower_fd`` is
            still the workspace (the merged root's owner and mode; the commit's target).
            Never for a Session (its RESET needs the real lower).
        upper_dev_fd: ``Limits.upper="disk"`` (root callers): the loop device holding the
            run's fresh ext4 (an fd number as the anchor sees it), mounted instead of the
            tmpfs (:mod:`lowlevel.workspace.disk_upper`); None: the tmpfs.
    """

    mnt: str
    lower_fd: int
    upper_bytes: int
    upper_inodes: int
    lower_path: str | None = None
    idmap: tuple[int, int] | None = None
    root_lower_fd: int | None = None
    root_lower_path: str | None = None
    empty_lower: bool = False
    upper_dev_fd: int | None = None


def anchor_argv(facts: HostFacts, helper: str, *, parent: int, report_fd: int | None, cgroup_fds: Sequence[int],
                rlimits: Sequence[tuple[str, int, int]], ids: tuple[int, int] | None,
                overlay: AnchorOverlay | None, keep_fds: Sequence[int], pass_fds: Sequence[int],
                args_fd: int | None, command: Sequence[str], cgroup_dir_fd: int | None = None,
                deadline_ns: int | None = None) -> list[str]:
    """The argv exec'd for every sandbox: ``_lowlevel_exec OPTIONS -- bwrap --args FD -- COMMAND...``.

    The anchor (``native/lowlevel_exec.c``) dies with the caller (PR_SET_PDEATHSIG, checked),
    joins the run's cgroups, mounts the copy-on-write workspace, makes bwrap PID 1 of a new
    PID namespace (so everything of the sandbox dies with it), sets the rlimits and, for a root
    caller, drops to ``ids`` before exec'ing bwrap: bwrap then maps the sandbox to that
    unprivileged uid, never to host uid 0 (with bwrap 0.8.0, host uid 0 inside can write
    /proc/sys). Unprivileged callers get ``--userns`` (a user namespace of their own ids, which
    the PID and mount namespaces need). Pure: golden-list testable.

    Args:
        facts: host facts (``caller_is_root``, bwrap's path).
        helper: the anchor's path.
        parent: the caller's PID (the anchor refuses to start when its parent is not it).
        report_fd: the anchor's end of the SEQPACKET report socket, or None (probe).
        cgroup_fds: cgroup v1 ``tasks`` fds the anchor joins (writes ``"0"``).
        cgroup_dir_fd: the run's cgroup v2 directory: bwrap is created in it
            (``clone3(CLONE_INTO_CGROUP)``), or None.
        rlimits: ``(name, soft, hard)`` triples (``RLIMIT_*`` names, -1 for none).
        ids: root callers: the sandbox's host ``(uid, gid)``; None for unprivileged callers.
        overlay: the copy-on-write workspace, or None (the workspace is bound as it is).
        keep_fds: fds the anchor holds and never passes on (the uid lease).
        pass_fds: fd numbers bwrap must get; the anchor closes every other inherited fd.
        args_fd: bwrap's ``--args`` fd, or None to exec ``command`` itself (probe).
        command: the program and its arguments inside.
        deadline_ns: absolute ``CLOCK_MONOTONIC`` time (ns, ``time.monotonic_ns()``'s clock) at
            which the anchor SIGKILLs the sandbox itself, running caller or not; None: never.

    Source: prctl(2) PR_SET_PDEATHSIG; pid_namespaces(7); setrlimit(2); setresuid(2);
    user_namespaces(7); bwrap(1) --args.
    """
    a = [helper, f"--parent={parent}"]
    if report_fd is not None:
        a.append(f"--report-fd={report_fd}")
    a += [f"--cgroup-fd={fd}" for fd in cgroup_fds]
    if cgroup_dir_fd is not None:
        a.append(f"--cgroup-dir-fd={cgroup_dir_fd}")
    a += [f"--rlimit={name}={_rlimit_value(soft)}:{_rlimit_value(hard)}" for name, soft, hard in rlimits]
    if ids is not None:
        a += [f"--uid={ids[0]}", f"--gid={ids[1]}"]
    elif not facts.caller_is_root:
        a.append("--userns")
    if overlay is not None:
        a += [f"--mnt={overlay.mnt}", f"--lower-fd={overlay.lower_fd}", f"--upper-bytes={overlay.upper_bytes}",
              f"--upper-inodes={overlay.upper_inodes}"]
        if overlay.lower_path is not None:
            a.append(f"--lower-path={overlay.lower_path}")
        if overlay.idmap is not None:
            a.append(f"--idmap={overlay.idmap[0]}:{overlay.idmap[1]}")
        if overlay.empty_lower:
            a.append("--empty-lower")
        if overlay.upper_dev_fd is not None:
            a.append(f"--upper-dev-fd={overlay.upper_dev_fd}")
        if overlay.root_lower_fd is not None:
            a.append(f"--root-lower-fd={overlay.root_lower_fd}")
            if overlay.root_lower_path is not None:
                a.append(f"--root-lower-path={overlay.root_lower_path}")
    a += [f"--keep-fd={fd}" for fd in keep_fds]
    if deadline_ns is not None:
        a.append(f"--deadline-ns={deadline_ns}")
    a.append("--pass-fds=" + ",".join(str(fd) for fd in pass_fds))
    if args_fd is None:
        return [*a, "--", *command]
    return [*a, "--", facts.bwrap.path, "--args", str(args_fd), "--", *command]


__all__ = ["BWRAP_ARITY", "AnchorOverlay", "Fds", "HostFacts", "NETWORK_ETC", "anchor_argv", "build_argv",
           "dynamic_args", "encode_args", "redact_env_values", "setup_paths", "static_args"]
