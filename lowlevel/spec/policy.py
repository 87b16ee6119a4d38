"""The sandbox description: immutable, its form validated on construction.

A :class:`Policy` says what the sandbox sees and may do; it never changes after it is built,
so one Policy can serve thousands of runs (its static bwrap argv is cached per Policy).

Defaults are the hardened recipe: read-only ``/usr`` (and the usr-merge symlinks or
read-only ``/bin``, ``/lib*`` dirs), a fresh ``/proc``, ``/dev`` and sized ``/tmp``, one
writable workspace at ``/workspace``, every namespace unshared, no network, a cleared
environment, no capabilities, no nested user namespaces, the default seccomp profile and
resource limits.

A Policy's ``image`` and ``rootfs`` are names: the image store and the tree are read when a run
is planned (:func:`lowlevel.rootfs.resolve.resolve`), not here.

Sources: bwrap(1); bubblewrap README "Sandbox security" (anything bound in can be used to
escalate; a bound D-Bus socket lets the sandbox run commands through systemd).
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import stat
from collections.abc import Mapping
from dataclasses import field
from types import MappingProxyType

from lowlevel._dataclass import dataclass
from lowlevel.spec.egress import Egress
from lowlevel.spec import validate as _validate
from lowlevel.errors import LaunchError, PolicyError
from lowlevel.spec.limits import Limits
from lowlevel.spec.seccomp import DEFAULT_PROFILE, SeccompProfile

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any

#: Where the workspace appears inside the sandbox; also the cwd and HOME.
WORKSPACE_DEST = "/workspace"

#: The deliberate minimum environment after ``--clearenv``. A missing HOME sends pip and npm
#: looking in surprising places; a missing LANG breaks UTF-8 I/O in Python < 3.15.
BASE_ENV: Mapping[str, str] = MappingProxyType({
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKSPACE_DEST,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
})

#: Paths under a home directory that hold credentials. Binding them (or a parent of them)
#: hands the sandbox the user's keys. Sources: OpenSSH, AWS CLI, gcloud, kubectl, Docker,
#: GnuPG, git-credential-store, npm, pip/twine, GitHub CLI documentation.
SENSITIVE_HOME_ENTRIES = (
    ".ssh", ".aws", ".azure", ".config/gcloud", ".kube", ".docker", ".gnupg", ".netrc",
    ".git-credentials", ".npmrc", ".pypirc", ".config/gh", ".password-store",
    ".local/share/keyrings", ".config/hub", ".terraform.d", ".vault-token", ".config/op",
)

#: Host paths never bound without an override. /run and /var/run hold the D-Bus system bus,
#: the Docker and containerd sockets, systemd's private socket and user runtime dirs
#: (bubblewrap README: a D-Bus socket is enough to execute commands via systemd);
#: /tmp/.X11-unix gives keystroke injection into the X server; /proc, /sys and /dev
#: are the host's (the sandbox gets fresh ones).
SENSITIVE_PATHS = (
    "/run", "/var/run", "/tmp/.X11-unix", "/tmp/.ICE-unix", "/proc", "/sys", "/dev",
    "/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh",
    "/var/lib/docker", "/boot",
)

#: Destinations the base layout owns; a user bind may not replace them.
RESERVED_DESTS = ("/", "/usr", "/proc", "/dev", "/tmp", "/etc", WORKSPACE_DEST,
                  "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")

#: Deterministic mode (``Policy(deterministic=True)``): variables set on top of BASE_ENV (the
#: Policy's own ``env`` and per-run ``env`` still win, so a caller can pin a different
#: SOURCE_DATE_EPOCH). 315532800 is 1980-01-01T00:00:00Z, the earliest time a zip file can hold
#: (what reproducible-builds.org tools clamp to). Source: reproducible-builds.org
#: "SOURCE_DATE_EPOCH" specification; Python docs for PYTHONHASHSEED; tzset(3) for TZ.
DETERMINISTIC_ENV: Mapping[str, str] = MappingProxyType({
    "TZ": "UTC",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "SOURCE_DATE_EPOCH": "315532800",
    "PYTHONHASHSEED": "0",
    # With fixed ids inside, the workspace root belongs to an id the sandbox does not map, and
    # git's "dubious ownership" check (CVE-2022-24765, for shared multi-user hosts) refuses a
    # repository at /workspace; inside a one-user sandbox that check protects nothing.
    "GIT_CONFIG_COUNT": "1",
    "GIT_CONFIG_KEY_0": "safe.directory",
    "GIT_CONFIG_VALUE_0": WORKSPACE_DEST,
})

#: Deterministic mode: the uid/gid seen inside when ``sandbox_uid``/``sandbox_gid`` are None.
DETERMINISTIC_UID = 1000
DETERMINISTIC_GID = 1000


def _home_dirs() -> set[str]:
    homes = {"/root"}
    env_home = os.environ.get("HOME")
    if env_home and os.path.isabs(env_home):
        homes.add(os.path.realpath(env_home))
    try:
        homes.add(os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir))
    except KeyError:
        pass
    try:
        for entry in pwd.getpwall():
            if entry.pw_dir.startswith("/home/") and entry.pw_uid >= 1000:
                homes.add(os.path.realpath(entry.pw_dir))
    except OSError:
        pass
    homes.discard("/")
    return homes


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def sensitive_reason(source: str) -> str | None:
    """Say why binding host path ``source`` would leak secrets or escalate, or None.

    ``source`` must be absolute and already resolved (``os.path.realpath``). A path is
    sensitive when it is, contains, or lies inside a credential location, a home directory
    itself (``~``: binding it exposes every dotfile), ``/run``/``/var/run``, a socket, or
    a device/proc/sys tree.
    """
    if source == "/":
        return "it is the host's root directory, which contains every secret on the host"
    for home in _home_dirs():
        if _within(home, source):
            return (f"it is or contains the home directory {home} (SSH keys, tokens, shell history); "
                    "bind only the project subdirectory you need")
        for entry in SENSITIVE_HOME_ENTRIES:
            secret = os.path.join(home, entry)
            if _within(source, secret):
                return f"it is inside the credential location {secret}"
    for path in SENSITIVE_PATHS:
        if _within(source, path) or _within(path, source):
            return (f"it overlaps {path}, which holds host sockets, devices or secrets "
                    "(a bound D-Bus or Docker socket is a way out of the sandbox)")
    try:
        st = os.stat(source)
    except OSError:
        return None
    if stat.S_ISSOCK(st.st_mode):
        return "it is a Unix socket (D-Bus, X11, Docker and the like are ways out of the sandbox)"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return "it is a device node"
    return None


@dataclass(frozen=True)
class Bind:
    """One extra bind mount of a host path into the sandbox.

    Attributes:
        source: host path (absolute, or relative to the cwd); resolved with realpath on
            construction, so a symlink cannot smuggle in a refused location.
        dest: absolute path inside the sandbox; defaults to ``source``.
        writable: ``--bind`` when True, ``--ro-bind`` when False (the default).
        allow_sensitive: bind even a location :func:`sensitive_reason` refuses, or a writable
            one holding lowlevel's cache directory (code it loads:
            :func:`lowlevel.workspace.checks.check_cache_outside`). Use only when you mean to
            hand that location to untrusted code.
        allow_sockets: keep the unix sockets inside a bound directory reachable. False
            (default): the sockets found in it when the Policy is first planned are masked
            (:mod:`lowlevel.sandbox.bind_sockets`: connecting fails), and where Landlock has ABI >= 9
            connecting to any pathname socket beneath it made outside the sandbox is refused
            (a D-Bus, Podman, Docker or Ray socket is code execution on the host). True: neither;
            ``Result.notes`` says the bind keeps its sockets.

    Raises:
        PolicyError: the source does not exist, the destination is relative, reserved
            (``/usr``, ``/proc``, ``/workspace``...) or contains ``..``, or the source is
            sensitive and ``allow_sensitive`` is False.
    """

    source: str
    dest: str = ""
    writable: bool = False
    allow_sensitive: bool = False
    allow_sockets: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.source, (str, os.PathLike)) or not str(self.source):
            raise PolicyError(f"Bind source must be a non-empty path, got {self.source!r}")
        raw = _validate.host_path(self.source, "Bind source")
        real, st = _validate.resolve_host(raw, "Bind source")
        if not isinstance(self.dest, str):
            raise PolicyError(f"Bind dest must be a str (an absolute path inside the sandbox), got {self.dest!r}")
        dest = self.dest or real
        _validate.text(dest, "Bind dest", max_bytes=_validate.MAX_PATH_BYTES - 1)
        if not os.path.isabs(dest):
            raise PolicyError(f"Bind dest {dest!r} must be an absolute path inside the sandbox")
        if any(part == ".." for part in dest.split("/")):
            raise PolicyError(f"Bind dest {dest!r} must not contain '..'")
        dest = _validate.normalize_abs(dest)  # '//usr' is '/usr' (validate.normalize_abs)
        if _within(dest, WORKSPACE_DEST) and dest != WORKSPACE_DEST:
            raise PolicyError(f"Bind dest {dest!r} is inside /workspace, which the workspace bind "
                              "mounts over: copy it in as an input, or bind it elsewhere (e.g. /opt/NAME)")
        if dest in RESERVED_DESTS or any(_within(dest, r) for r in ("/proc", "/dev")):
            raise PolicyError(f"Bind dest {dest!r} is reserved by the base layout; choose another path "
                              "(e.g. /opt/NAME)")
        if not isinstance(self.allow_sockets, bool):
            raise PolicyError(f"Bind allow_sockets must be a bool, got {self.allow_sockets!r}")
        if not self.allow_sensitive:
            reason = sensitive_reason(real)
            if reason:
                raise PolicyError(f"refusing to bind {raw!r} into the sandbox: {reason}. "
                                  "Pass allow_sensitive=True (CLI: --allow-sensitive) only if you "
                                  "really mean to expose it")
        if self.writable and not self.allow_sensitive:
            from lowlevel.paths import configured_cache_dir
            cache = configured_cache_dir()
            if cache is not None and _within(os.path.realpath(os.path.abspath(cache)), real):
                # The caller's own code and filters are cached there: a program writing into the
                # bind could plant them (lowlevel.workspace.checks.check_cache_outside).
                raise PolicyError(f"refusing a writable bind of {raw!r}: it contains lowlevel's cache directory "
                                  f"{cache}, whose files lowlevel loads as its own code: bind it read-only, set "
                                  "LOWLEVEL_CACHE_DIR to a directory outside it (or LOWLEVEL_NO_CACHE=1), or pass "
                                  "allow_sensitive=True if you really mean it")
        object.__setattr__(self, "source", real)
        object.__setattr__(self, "dest", dest)
        object.__setattr__(self, "_ident", (st.st_dev, st.st_ino))

    def __getstate__(self) -> dict[str, Any]:
        # The source's identity is this host's: a Bind sent elsewhere (a Ray node) takes the
        # identity its source has there at its first run (check_unchanged).
        return {k: v for k, v in self.__dict__.items() if k != "_ident"}

    def check_unchanged(self) -> None:
        """Before each run: the source is still the directory or file this Bind was made with.

        The source is resolved (realpath) and checked once, when the Bind is made; bwrap mounts
        it by path later, following a symlink there. Without this check, a sandbox given a
        writable bind over another bind's source could swap that source for a symlink to any
        host path (``~/.ssh``) that the next run of the same Policy then mounted, past the
        sensitive-path check (found by the red-team pass, issue 22). A small window between this
        check and bwrap's mount remains (a writer racing the launch); binding by fd closes it.

        Raises:
            LaunchError: the source is gone, or is now a symlink or another inode.
        """
        try:
            st = os.lstat(self.source)
        except OSError as err:
            raise LaunchError(f"Bind source {self.source} is gone since the Policy was made: {err.strerror}",
                              errno=err.errno) from None
        ident = self.__dict__.get("_ident")
        if ident is None:  # unpickled on another host: the first run there fixes it
            object.__setattr__(self, "_ident", (st.st_dev, st.st_ino))
            ident = (st.st_dev, st.st_ino)
        if stat.S_ISLNK(st.st_mode) or (st.st_dev, st.st_ino) != ident:
            what = "a symlink" if stat.S_ISLNK(st.st_mode) else "another file or directory"
            raise LaunchError(f"Bind source {self.source} was replaced by {what} since the Policy was made (bwrap "
                              "would mount what it names now); keep bind sources unchanged while a Policy is in "
                              "use (a writable bind over one lets a sandbox swap it), or make a new Policy",
                              errno=errno.ESTALE)


def _freeze_env(env: Mapping[str, str] | tuple[tuple[str, str], ...] | None) -> tuple[tuple[str, str], ...]:
    """Validated, sorted ``(name, value)`` pairs (:mod:`lowlevel.spec.validate`: names without ``=`` or NUL,
    values without NUL). Raises PolicyError."""
    if env is not None and not isinstance(env, (Mapping, tuple, list)):
        raise PolicyError(f"env must be a mapping of str to str, got {type(env).__name__}")
    items = list(env.items()) if isinstance(env, Mapping) else list(env or ())
    if len(items) > _validate.MAX_ENV:
        raise PolicyError(f"env has {len(items)} variables; the limit is {_validate.MAX_ENV}")
    out: dict[str, str] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise PolicyError(f"env items must be (name, value) pairs, got {item!r:.80}")
        key, value = item
        _validate.env_name(key)
        _validate.text(value, f"environment variable {key}")
        out[key] = value
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Policy:
    """What a sandbox sees and may do. Immutable and hashable; validated on construction.

    Attributes:
        network: False (default) unshares the network namespace: the sandbox has only its own
            loopback. An :class:`lowlevel.spec.egress.Egress` keeps that namespace and adds one way
            out, an allowlisting HTTP proxy on the host (``HTTP_PROXY`` and friends set inside,
            ``/etc/ssl/certs`` and ``openssl.cnf`` bound, never ``/etc/ssl/private``; no DNS inside): see
            :mod:`lowlevel.spec.egress`. True keeps the host's whole network (``--share-net``: its
            ``127.0.0.1`` services and abstract unix sockets included) and binds
            ``/etc/resolv.conf``, ``/etc/hosts``, ``/etc/ssl/certs``, ``/etc/ssl/openssl.cnf`` and
            ``/etc/ca-certificates`` read-only.
        binds: extra :class:`Bind` mounts (a virtualenv, node_modules, a toolchain...).
        env: variables set on top of :data:`BASE_ENV` (mapping or sorted pairs).
        limits: resource limits (:class:`lowlevel.spec.limits.Limits`).
        seccomp: the seccomp profile loaded with ``--seccomp``; None requires
            ``unsafe_no_seccomp=True``.
        unsafe_no_seccomp: allow ``seccomp=None``. Never set this for untrusted code.
        hostname: the sandbox's hostname (``--hostname``, needs the UTS namespace).
        host_uid, host_gid: when the caller is root, the unprivileged host ids the sandbox
            runs as. None (default): each live sandbox gets a uid (and the gid of the same
            number) of its own from a range (:data:`lowlevel.workspace.uids.DEFAULT_UID_RANGE`,
            ``LOWLEVEL_UID_RANGE``), so per-uid kernel budgets (inotify and fanotify
            instances, RLIMIT_NPROC, keyrings) are per run. An int pins it (``host_gid``
            defaults to the same number). With bwrap 0.8.0 a sandbox whose uid maps to host
            uid 0 can write sysctls under ``/proc/sys`` such as ``kernel.core_pattern``, which
            is host root; so root callers never keep uid 0. Ignored for non-root callers
            (bwrap maps the caller's own uid).
        sandbox_uid, sandbox_gid: the ids seen inside (``--uid``/``--gid``); None keeps
            the host ids.
        stdout_limit_bytes, stderr_limit_bytes: capture caps; the rest is dropped with head
            and tail kept and ``truncated`` set. Default 16 MiB each.
        deterministic: benchmark-reproduction mode: adds :data:`DETERMINISTIC_ENV` (``TZ=UTC``,
            ``LANG``/``LC_ALL=C.UTF-8``, ``SOURCE_DATE_EPOCH``, ``PYTHONHASHSEED=0``), fixes the
            ids inside to :data:`DETERMINISTIC_UID`/``GID`` unless ``sandbox_uid``/``gid`` are
            set, and passes the whole environment in sorted order. The hostname is
            ``hostname`` as always. It cannot fix wall-clock time, randomness
            (``/dev/urandom``, ``getrandom(2)``), ASLR, CPU speed or core count, scheduling
            order of threads and processes, inode numbers and mtimes, or the kernel and
            library versions of the host; see docs/records.md.
        compat_32bit: admit the 32-bit compat syscall entry point (i386 ``int 0x80`` on
            x86_64) with the same seccomp rules, for 32-bit binaries. False (default): a
            process making a compat syscall is killed (SIGSYS, ``killed_by="signal"``), as for
            x32; see :mod:`lowlevel.spec.seccomp`. Ignored with ``seccomp=None``.
        rootfs: host directory tree (an unpacked image, an mmdebstrap/debootstrap output) that
            replaces the host's ``/usr``, ``/bin``, ``/lib*`` and ``/etc`` as the sandbox's
            read-only system; ``/proc``, ``/dev``, ``/tmp`` and ``/workspace`` stay the sandbox's
            own. It must hold regular files ``etc/passwd`` and ``etc/group`` (synthesized ones are
            mounted over them). None (default): the host's system. See :mod:`lowlevel.rootfs`.
            Only its form (an absolute path, normalized) is checked here; the tree itself when a run
            is planned (:func:`lowlevel.rootfs.resolve.resolve`: resolved with realpath, the checks
            of :func:`lowlevel.rootfs.check_rootfs`, reachable by the sandbox's host uid, no bind
            destination through one of its symlinks), raising the same PolicyError then.
        rootfs_writable: a per-run writable layer over ``rootfs``, discarded after the run: the
            anchor's overlay of the whole tree wherever the copy-on-write workspace works (its
            writes count in ``Limits.workspace_bytes``; a Session's ``reset()`` resets only the
            workspace), else bwrap >= 0.9's tmpfs overlays, else sized tmpfs over the tree's
            empty scratch directories only; see :mod:`lowlevel.rootfs`.
        image: an imported image (``"name:tag"``, ``"sha256:<id>"`` or a unique id prefix of at
            least 12 hex digits) from the image store (:mod:`lowlevel.image`,
            ``$LOWLEVEL_IMAGE_STORE``). Resolved when the first run on this Policy object is planned
            (:func:`lowlevel.rootfs.resolve.resolve`; building a Policy reads nothing): the run's
            Policy has ``image`` ``"sha256:<id>"`` (a Policy pins the image at that first run,
            re-tagging later does not change it), ``rootfs`` its tree, and the image config's
            ``Env`` (under ``env``), ``User`` (unless ``sandbox_uid``/``sandbox_gid`` are set; an
            empty ``User`` is uid 0, as in Docker) and ``WorkingDir`` (unless ``workdir`` is set)
            become the run's defaults.
        workdir: default working directory inside for :func:`lowlevel.run` when its ``cwd`` is
            not given; None: ``/workspace``.
        landlock: the second wall (:mod:`lowlevel.host.landlock`): True (default) applies a Landlock
            ruleset to the program inside the sandbox, best effort (the kernel's ABI, down to
            1; none when the kernel lacks Landlock: ``Result.landlock_abi`` says which);
            ``"require"`` fails with UnsupportedError when the kernel lacks it; False applies
            none. Reads and execs only beneath the read-only mounts, writes only beneath
            ``/workspace``, ``/tmp``, ``/dev/shm`` and writable binds, no TCP bind, TCP connect
            only as ``network`` needs (any port with True, the proxy's port with an Egress,
            none without), no host abstract unix sockets, no signals out (ABI >= 6).
        landlock_omit: testing aid: bind destinations left out of the Landlock rules (so a
            test can show Landlock holds where a mount is wrong). It only takes access away.

    Raises:
        PolicyError: an invalid value (the message names the field). What ``image`` and ``rootfs``
            name on the host is checked at the first run (:func:`lowlevel.rootfs.resolve.resolve`).
    """

    network: bool | Egress = False
    binds: tuple[Bind, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    limits: Limits = field(default_factory=Limits)
    seccomp: SeccompProfile | None = DEFAULT_PROFILE
    unsafe_no_seccomp: bool = False
    hostname: str = "sandbox"
    host_uid: int | None = None
    host_gid: int | None = None
    sandbox_uid: int | None = None
    sandbox_gid: int | None = None
    stdout_limit_bytes: int = 16 * 1024 * 1024
    stderr_limit_bytes: int = 16 * 1024 * 1024
    deterministic: bool = False
    compat_32bit: bool = False
    rootfs: str | None = None
    rootfs_writable: bool = False
    image: str | None = None
    workdir: str | None = None
    landlock: bool | str = True
    landlock_omit: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.network, (bool, Egress)):
            raise PolicyError(f"Policy.network must be False, True (the host network) or a lowlevel.Egress "
                              f"allowlist, got {self.network!r}")
        object.__setattr__(self, "env", _freeze_env(self.env))
        if isinstance(self.binds, (str, bytes, Bind)) or not hasattr(self.binds, "__iter__"):
            raise PolicyError("Policy.binds must be a tuple of Bind objects")
        binds = tuple(self.binds)
        for b in binds:
            if not isinstance(b, Bind):
                raise PolicyError(f"Policy.binds must hold Bind objects, got {type(b).__name__}")
        dests = [b.dest for b in binds]
        if len(set(dests)) != len(dests):
            raise PolicyError(f"two binds share a destination: {sorted(dests)}")
        for outer in binds:
            for inner in binds:
                if inner is not outer and _within(inner.dest, outer.dest):
                    # bwrap would resolve the inner dest through the outer bind's host directory
                    # while it sets up, following any symlink there (one a sandbox left in a
                    # writable bind included) onto the host's tree: issue 22 item 1.
                    raise PolicyError(f"Bind dest {inner.dest!r} is inside another bind's dest {outer.dest!r}: "
                                      f"bwrap would set it up through the host directory {outer.source}, following "
                                      "its symlinks onto the host's tree; bind each to its own destination")
        object.__setattr__(self, "binds", binds)
        if not isinstance(self.limits, Limits):
            raise PolicyError("Policy.limits must be a lowlevel.Limits")
        if self.network is True and self.limits.net_bytes is not None:
            raise PolicyError("Limits.net_bytes is enforced by the egress proxy, which network=True (the host "
                              "network) bypasses: use network=Egress(allow=...) or drop net_bytes")
        if self.seccomp is None and not self.unsafe_no_seccomp:
            raise PolicyError("seccomp=None turns off the syscall filter; pass unsafe_no_seccomp=True "
                              "to confirm (never for untrusted code)")
        if self.seccomp is not None and not isinstance(self.seccomp, SeccompProfile):
            raise PolicyError("Policy.seccomp must be a SeccompProfile or None")
        if not isinstance(self.hostname, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}", self.hostname):
            raise PolicyError(f"hostname {self.hostname!r} is not a valid host name (letters, digits, -)")
        for name in ("host_uid", "host_gid"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 < value < 2**32 - 1):
                raise PolicyError(f"Policy.{name} must be None (a per-run uid) or a non-zero uid/gid, got "
                                  f"{value!r}: the sandbox never runs as host root")
        if self.host_gid is not None and self.host_uid is None:
            raise PolicyError("Policy.host_gid needs host_uid: pin both, or neither (per-run ids)")
        if self.host_uid is not None and self.host_gid is None:
            object.__setattr__(self, "host_gid", self.host_uid)
        for name in ("sandbox_uid", "sandbox_gid"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value < 2**32 - 1):
                raise PolicyError(f"Policy.{name} must be None or a uid/gid, got {value!r}")
        for name in ("stdout_limit_bytes", "stderr_limit_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PolicyError(f"Policy.{name} must be a byte count >= 0, got {value!r}")
        if not (self.landlock is True or self.landlock is False or self.landlock == "require"):
            raise PolicyError(f"Policy.landlock must be True, False or 'require', got {self.landlock!r}")
        omit = self.landlock_omit
        if not isinstance(omit, (tuple, list)) or not all(
                isinstance(p, str) and p.startswith("/") and "\0" not in p for p in omit):
            raise PolicyError(f"Policy.landlock_omit must be a tuple of absolute sandbox paths, got {omit!r}")
        object.__setattr__(self, "landlock_omit", tuple(_validate.normalize_abs(p) for p in omit))
        self._check_rootfs()
        if not isinstance(self.deterministic, bool):
            raise PolicyError(f"Policy.deterministic must be a bool, got {self.deterministic!r}")
        if not isinstance(self.compat_32bit, bool):
            raise PolicyError(f"Policy.compat_32bit must be a bool, got {self.compat_32bit!r}")
        if self.deterministic:
            if self.sandbox_uid is None:
                object.__setattr__(self, "sandbox_uid", DETERMINISTIC_UID)
            if self.sandbox_gid is None:
                object.__setattr__(self, "sandbox_gid", DETERMINISTIC_GID)

    def _check_rootfs(self) -> None:
        """Check the form of ``image``, ``rootfs``, ``rootfs_writable`` and ``workdir`` (no I/O).

        What ``image`` and ``rootfs`` name on this host (the image store, the tree's checks) is
        read when a run is planned: :func:`lowlevel.rootfs.resolve.resolve`.
        """
        if self.image is not None and not isinstance(self.image, str):
            raise PolicyError(f"Policy.image must be a str (name:tag or sha256:<id>), got {type(self.image).__name__}")
        if self.rootfs is not None:
            raw = os.fspath(self.rootfs) if isinstance(self.rootfs, os.PathLike) else self.rootfs
            if not isinstance(raw, str) or not raw:
                raise PolicyError(f"Policy.rootfs must be a directory path, got {self.rootfs!r}")
            if "\0" in raw or not os.path.isabs(raw):
                raise PolicyError(f"Policy.rootfs must be an absolute host path, got {raw!r}")
            object.__setattr__(self, "rootfs", _validate.normalize_abs(raw))
        if not isinstance(self.rootfs_writable, bool):
            raise PolicyError(f"Policy.rootfs_writable must be a bool, got {self.rootfs_writable!r}")
        if self.rootfs_writable and self.rootfs is None and self.image is None:
            raise PolicyError("Policy.rootfs_writable=True needs a rootfs or an image")
        if self.workdir is not None:
            # An image's WorkingDir lands here too: the same rules as a run's cwd (CVE-2024-21626 class).
            object.__setattr__(self, "workdir", _validate.sandbox_cwd(self.workdir, "Policy.workdir"))

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Return the sandbox's environment: BASE_ENV, then (deterministic mode)
        DETERMINISTIC_ENV, then (egress mode) the proxy variables of
        :meth:`lowlevel.spec.egress.Egress.environment`, then ``env``, then ``extra``.

        Raises:
            PolicyError: an invalid name or value in ``extra``.
        """
        out = dict(BASE_ENV)
        if self.deterministic:
            out.update(DETERMINISTIC_ENV)
        if isinstance(self.network, Egress):
            out.update(self.network.environment())
        out.update(self.env)
        if extra:
            out.update(_freeze_env(extra))
        return out


__all__ = ["BASE_ENV", "Bind", "DETERMINISTIC_ENV", "DETERMINISTIC_GID", "DETERMINISTIC_UID", "Policy",
           "SENSITIVE_HOME_ENTRIES", "SENSITIVE_PATHS", "WORKSPACE_DEST",
           "sensitive_reason"]
