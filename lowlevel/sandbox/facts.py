"""What the sandbox layer learns about the host once: :func:`host_facts`, the anchor executable
(:func:`_exec_helper`), and whether the anchor's copy-on-write overlay works on a filesystem
(:func:`_probe_cow`, cached in :mod:`lowlevel.host.hostcache`; :func:`recheck_cached_cow` for
``lowlevel doctor``).
"""

from __future__ import annotations

import errno
import functools
import os
import shutil

from lowlevel.errors import LowlevelError, PolicyError, UnsupportedError
from lowlevel.host.probe import bwrap_info, host_layout, require_pidfd
from lowlevel.paths import native
from lowlevel.sandbox.argv import NETWORK_ETC, HostFacts, anchor_argv
from lowlevel.sandbox.argv import AnchorOverlay as _AnchorOverlay
from lowlevel.spec.policy import Policy
from lowlevel.workspace import cow as _cow


@functools.lru_cache(maxsize=None)
def host_facts(bwrap: str | None = None) -> HostFacts:
    """Probe the host once per process: bwrap, usr-merge layout, root or not, network /etc."""
    info = bwrap_info(bwrap)
    require_pidfd()
    net: list[tuple[str, str]] = []
    for path in NETWORK_ETC:
        if os.path.exists(path):
            net.append((os.path.realpath(path), path))
    return HostFacts(bwrap=info, layout=host_layout(), caller_is_root=os.geteuid() == 0,
                     network_etc=tuple(net), cap_sys_resource=_has_cap(24))


def planned_policy(policy: object) -> Policy:
    """The Policy a run or session is planned with: ``policy`` checked to be a :class:`Policy`,
    and what its ``image``/``rootfs`` name on this host resolved
    (:func:`lowlevel.rootfs.resolve.resolve`; imported only when there is something to resolve,
    so ``import lowlevel`` loads no rootfs machinery).

    Raises:
        PolicyError: not a Policy; as :func:`~lowlevel.rootfs.resolve.resolve`.
    """
    if not isinstance(policy, Policy):
        raise PolicyError(f"policy must be a lowlevel.Policy, got {type(policy).__name__}")
    if policy.image is None and policy.rootfs is None:
        return policy
    from lowlevel.rootfs.resolve import resolve
    return resolve(policy)


def _has_cap(bit: int) -> bool:
    """True when the caller's effective capability set has capability number ``bit``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return False


#: The anchor (``native/lowlevel_exec.c``), built next to this module by setup.py.
EXEC_HELPER_PATH = native("_lowlevel_exec")
@functools.lru_cache(maxsize=None)
def _exec_helper() -> str:
    """Path of the built ``_lowlevel_exec`` anchor every sandbox starts under.

    Raises:
        UnsupportedError: it is missing (a broken install: ``pip install`` builds it).
    """
    path = EXEC_HELPER_PATH
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise UnsupportedError("exec-helper", f"{path} is missing or not executable: lowlevel's anchor "
                               "process is built at install time",
                               "reinstall lowlevel (pip install . from its checkout)")
    return path


#: errnos that say the overlay probe failed for a reason of the caller's (a limit of its own,
#: an interruption), not of the host: such a verdict is never cached (see _probe_cow_now).
_TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOBUFS})
#: The same, as the anchor or bwrap print them (strerror(3) of the errnos above). Not ENOSPC:
#: clone(CLONE_NEWUSER) says that at user.max_user_namespaces, which may be the host's 0.
_TRANSIENT_TEXT = tuple(os.strerror(e) for e in sorted(_TRANSIENT_ERRNOS))
def _probe_cow(facts: HostFacts, workspace: str, base: str | None) -> _cow.CowSupport:
    """:func:`_probe_cow_now`, or its answer for this filesystem from :mod:`lowlevel.host.hostcache`
    (keyed by the filesystem's ``st_dev``, the euid, the mount directory and the anchor file).

    A transient failure (:attr:`lowlevel.workspace.cow.CowSupport.transient`: the caller's fd, memory or
    process limit, an interruption) is never stored: one fd-starved run must not turn the
    overlay off for every later run on the filesystem. A negative answer is stored with the
    workspace's path, so ``lowlevel doctor`` can probe that filesystem again
    (:func:`recheck_cached_cow`)."""
    from lowlevel.host import hostcache
    try:
        dev = os.stat(workspace).st_dev
        mnt = _cow.mount_dir(base)
    except (OSError, LowlevelError):
        return _probe_cow_now(facts, workspace, base)
    key = [dev, os.geteuid(), mnt, hostcache.file_key(EXEC_HELPER_PATH)]
    got = hostcache.get("host", f"cow:{dev}:{mnt}", key)
    if isinstance(got, dict) and isinstance(got.get("ok"), bool) and not got.get("transient"):
        return _cow.CowSupport(got["ok"], str(got.get("reason", "")))
    support = _probe_cow_now(facts, workspace, base)
    if not support.transient:
        hostcache.put("host", f"cow:{dev}:{mnt}", key, {"ok": support.ok, "reason": support.reason,
                                                         "path": workspace, "base": base})
    return support


def recheck_cached_cow(facts: HostFacts) -> list[tuple[str, _cow.CowSupport, _cow.CowSupport | None]]:
    """Probe again every filesystem :mod:`lowlevel.host.hostcache` says has no copy-on-write overlay
    (``lowlevel doctor``). Each entry is probed on the workspace path it was stored with, when
    that still exists on the same filesystem, and rewritten with the fresh answer (or dropped
    on a transient failure); an entry whose path is gone is dropped (the next run there probes).

    Returns:
        ``[(path, cached answer, fresh answer or None when dropped unprobed), ...]``.
    """
    from lowlevel.host import hostcache
    out: list[tuple[str, _cow.CowSupport, _cow.CowSupport | None]] = []
    for entry, item in hostcache.entries("host"):
        if not entry.startswith("cow:") or not isinstance(item, dict):
            continue
        value, key = item.get("value"), item.get("key")
        if not isinstance(value, dict) or value.get("ok") is not False:
            continue
        old = _cow.CowSupport(False, str(value.get("reason", "")))
        path, base = value.get("path"), value.get("base")
        fresh: _cow.CowSupport | None = None
        if isinstance(path, str) and (base is None or isinstance(base, str)) and isinstance(key, list) and key:
            try:
                same = os.stat(path).st_dev == key[0]
            except OSError:
                same = False
            if same:
                fresh = _probe_cow_now(facts, path, base)
        hostcache.drop("host", entry)
        if fresh is not None and not fresh.transient:
            hostcache.put("host", entry, key, {"ok": fresh.ok, "reason": fresh.reason, "path": path, "base": base})
        out.append((str(path), old, fresh))
    _cow.forget_cow_support()
    return out


def _transient(text: str) -> bool:
    return any(t in text for t in _TRANSIENT_TEXT)


def _probe_cow_now(facts: HostFacts, workspace: str, base: str | None) -> _cow.CowSupport:
    """Try the anchor's overlay on ``workspace`` once (it then execs /bin/true): does it work?

    A failure of the caller's own (an errno of :data:`_TRANSIENT_ERRNOS`, or its strerror text
    in the anchor's message; the probe killed by a signal or timed out) comes back with
    ``transient=True``: it says nothing about the host."""
    import subprocess
    root = facts.caller_is_root
    try:
        fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        return _cow.CowSupport(False, f"cannot open the workspace: {err.strerror}",
                               transient=err.errno in _TRANSIENT_ERRNOS)
    try:
        st = os.fstat(fd)
        mnt = _cow.mount_dir(base)
        true = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"
        ov = _AnchorOverlay(mnt=mnt, lower_fd=fd, upper_bytes=1 << 20, upper_inodes=1024,
                            lower_path=None if root else workspace,
                            idmap=(st.st_uid, st.st_gid) if root else None)
        argv = anchor_argv(facts, _exec_helper(), parent=os.getpid(), report_fd=None, cgroup_fds=(), rlimits=(),
                           ids=(65534, 65534) if root else None, overlay=ov, keep_fds=(), pass_fds=(),
                           args_fd=None, command=[true])
        proc = subprocess.run(argv, pass_fds=(fd,), stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                              env={})
    except subprocess.TimeoutExpired as err:
        return _cow.CowSupport(False, f"the overlay probe did not finish: {err}", transient=True)
    except (OSError, LowlevelError, subprocess.SubprocessError) as err:
        code = getattr(err, "errno", None)
        return _cow.CowSupport(False, str(err), transient=code in _TRANSIENT_ERRNOS or _transient(str(err)))
    finally:
        os.close(fd)
    if proc.returncode == 0:
        return _cow.CowSupport(True)
    text = proc.stderr.decode("utf-8", "replace").strip()
    why = text.splitlines()
    reason = (why[-1] if why else f"the overlay probe exited {proc.returncode}")[:300]
    return _cow.CowSupport(False, reason, transient=proc.returncode < 0 or _transient(text))


__all__ = ["EXEC_HELPER_PATH", "host_facts", "planned_policy", "recheck_cached_cow"]
