"""Host capability report for ``lowlevel doctor``.

Each check is a dict ``{"name", "ok", "required", "detail", "fix"}``; the report is
``{"ok": bool, "checks": [...]}`` where ``ok`` means the default Policy can run here.
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lowlevel.host.probe import BwrapInfo


def _check(name: str, ok: bool, detail: str, fix: str = "", required: bool = False) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "required": required, "detail": detail, "fix": fix}


_USERNS_SYSCTLS = ("/proc/sys/kernel/unprivileged_userns_clone", "/proc/sys/user/max_user_namespaces",
                   "/proc/sys/kernel/apparmor_restrict_unprivileged_userns")

#: Run in a child as an unprivileged uid: exit 0 when unshare(CLONE_NEWUSER) works, else the errno.
_USERNS_PROBE = ("import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
                 "sys.exit(0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno())")


def _sysctls() -> dict[str, str]:
    out = {}
    for path in _USERNS_SYSCTLS:
        try:
            with open(path) as f:
                out[path[len("/proc/sys/"):].replace("/", ".")] = f.read().strip()
        except OSError:
            pass
    return out


def userns_check() -> dict[str, Any]:
    """Can an *unprivileged* user create a user namespace (what a non-setuid bwrap needs)?

    As root, the probe drops to uid/gid 65534 with setpriv(1) first, since root passes the
    check whatever the sysctls say. Source: user_namespaces(7); unshare(2).
    """
    import shutil
    import subprocess
    import sys

    cmd = [sys.executable, "-I", "-c", _USERNS_PROBE]
    as_whom = f"uid {os.getuid()}"
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--", *cmd]
        as_whom = "uid 65534 (probed with setpriv as root)"
    sysctls = _sysctls()
    try:
        rc = subprocess.run(cmd, env={}, timeout=20, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    except (OSError, subprocess.TimeoutExpired) as err:
        return _check("unprivileged userns", False, f"probe could not run: {err}", "install util-linux (setpriv)")
    detail = ("unshare(CLONE_NEWUSER) works as " + as_whom if rc == 0 else
              f"unshare(CLONE_NEWUSER) failed as {as_whom}: {os.strerror(rc) if 0 < rc < 256 else rc}")
    if sysctls:
        detail += "; " + ", ".join(f"{k}={v}" for k, v in sorted(sysctls.items()))
    return _check("unprivileged userns", rc == 0, detail,
                  "sysctl -w kernel.unprivileged_userns_clone=1 (Debian < 11), user.max_user_namespaces=15000, "
                  "or kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu >= 23.10); "
                  "root callers only need it for the uid the sandbox drops to")


def cgroup_checks() -> list[dict[str, Any]]:
    """cgroup version and, per hierarchy, the controllers runs can write (cgroup_detect.detect_cgroups)."""
    from lowlevel.host import cgroup_detect

    try:
        support = cgroup_detect.detect_cgroups(sweep=False)  # doctor only looks: no sweep of stale cgroups
    except Exception as err:  # noqa: BLE001 - doctor reports, never crashes
        return [_check("cgroups", False, f"{type(err).__name__}: {err}")]
    writable = sorted(support.writable_controllers)
    checks = [_check("cgroups", bool(writable),
                     f"version {support.version}; writable controllers: {', '.join(writable) or 'none'}",
                     "run as root, or on a systemd host use a delegated cgroup v2 subtree "
                     "(systemd-run --user --scope -p Delegate=yes); without one, limits are rlimits only")]
    for h in support.hierarchies:
        checks.append(_check(f"cgroup v{h.version} {h.mount}", h.base is not None,
                             f"controllers: {', '.join(sorted(h.controllers)) or 'none'}; "
                             f"base: {h.base or 'not writable'} ({h.how})"))
    checks.append(memory_check("memory" in writable))
    return checks


def memory_check(cgroup_memory: bool) -> dict[str, Any]:
    """How the default memory limit and the tmpfs bounds relate here (issue 25): informational."""
    from lowlevel.spec import limits

    d = limits.Limits()
    mib = limits.MiB
    tmpfs = limits.tmpfs_bytes(d) or 0
    bounds = (f"workspace {limits.DEFAULT_WORKSPACE_BYTES // mib} MiB + /tmp {d.tmp_size_bytes // mib} MiB + "
              f"/dev/shm {d.tmp_size_bytes // mib} MiB = {tmpfs // mib} MiB" if d.tmp_size_bytes else "")
    if cgroup_memory:
        detail = (f"memory_bytes (default {(d.memory_bytes or 0) // mib} MiB) is the memory cgroup's limit for the "
                  f"whole run, its tmpfs files included (RAM): the default tmpfs bounds ({bounds}) leave "
                  f"{((d.memory_bytes or 0) - tmpfs) // mib} MiB for the program, so a full layer is ENOSPC; keep "
                  "memory_bytes above workspace_bytes + 2 x tmp_size_bytes for that to hold (below it a big "
                  "write ends in killed_by='memory')")
    else:
        detail = (f"no memory cgroup here: each tmpfs layer's size bounds its files (ENOSPC; {bounds}), and "
                  f"memory_bytes (default {(d.memory_bytes or 0) // mib} MiB) is RLIMIT_DATA per process")
    return _check("memory and tmpfs bounds", True, detail)


def seccomp_checks() -> list[dict[str, Any]]:
    """The CFFI extension built or not, the libseccomp version, and a default-profile compile."""
    checks = []
    try:
        import lowlevel.host._native  # noqa: F401
        checks.append(_check("native extension", True, "lowlevel.host._native (CFFI, libseccomp) is built"))
    except ImportError as err:
        checks.append(_check("native extension", False, f"lowlevel.host._native not built ({err}): "
                             "falling back to pyseccomp",
                             "apt-get install libseccomp-dev gcc python3-dev, then reinstall lowlevel"))
    try:
        from lowlevel.host import seccomp_filter
        from lowlevel.spec import seccomp
        version = seccomp_filter._backend().version()
        checks.append(_check("libseccomp", True, "version " + ".".join(map(str, version))))
        bpf = seccomp_filter.compile_bpf(seccomp.DEFAULT_PROFILE)
        arches = [seccomp.ARCH_NAMES.get(a, hex(a)) for a in seccomp_filter.filter_arches()]
        native = seccomp_filter.filter_arches()[0]
        compat = [seccomp.ARCH_NAMES.get(a, hex(a)) for a in seccomp.COMPAT_ARCHES.get(native, ())]
        checks.append(_check("seccomp", True, f"default profile compiles to {len(bpf) // 8} BPF instructions; "
                             f"syscalls admitted from {', '.join(arches)}"
                             + (f"; the 32-bit compat entry point ({', '.join(compat)}, e.g. int 0x80) kills the "
                                "process, as x32 does (Policy(compat_32bit=True) admits it)" if compat else ""),
                             required=True))
    except Exception as err:  # noqa: BLE001 - doctor reports, never crashes
        checks.append(_check("seccomp", False, f"{type(err).__name__}: {err}",
                             "apt-get install libseccomp2 (and libseccomp-dev to build the extension)",
                             required=True))
    return checks


def landlock_checks() -> list[dict[str, Any]]:
    """The run guard built or not (every fresh sandbox needs it), and the kernel's Landlock ABI
    (the version a sandbox's ruleset uses) with what it covers.

    Landlock itself is not required: ``Policy(landlock=True)`` runs without it (best effort);
    only ``landlock="require"`` needs it. Source: landlock_create_ruleset(2).
    """
    from lowlevel.host import landlock

    guard = os.access(landlock.GUARD_PATH, os.X_OK)
    abi = landlock.kernel_abi()
    return [_check("run guard", guard, f"{landlock.GUARD_PATH} " + ("is built" if guard else "is missing"),
                   "reinstall lowlevel (pip install .) with a C compiler present", required=True),
            _check("landlock", abi >= 1, landlock.describe(abi),
                   "Linux >= 5.13 with CONFIG_SECURITY_LANDLOCK=y and landlock in the lsm= boot parameter")]


def image_checks() -> list[dict[str, Any]]:
    """skopeo and umoci (``lowlevel image import`` needs both; not required to run) and the image
    store's location (:func:`lowlevel.image.doctor_checks`)."""
    try:
        from lowlevel.image import doctor_checks
        return doctor_checks()
    except Exception as err:  # noqa: BLE001 - doctor reports, never crashes
        return [_check("images", False, f"{type(err).__name__}: {err}")]


def workspace_checks(result_notes: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The workspace model a run gets here, and (root) the per-run uid range.

    Copy-on-write (an overlay the anchor mounts) or the hand-over fallback, with the reason;
    for root callers, whether the per-run uid range (``LOWLEVEL_UID_RANGE``) collides with
    accounts in /etc/passwd, groups in /etc/group or ranges in /etc/subuid and /etc/subgid (another user's container
    ids would then be handed to sandboxes).
    """
    from lowlevel.workspace import cow, uids
    from lowlevel.errors import UnsupportedError

    checks = []
    fallback = next((n for n in result_notes if n.startswith("workspace handed over")), None)
    if any(n.startswith("workspace: copy-on-write") for n in result_notes):
        checks.append(_check("workspace", True, "copy-on-write overlay (lower: your directory; upper: a "
                             f"{cow.DEFAULT_UPPER_BYTES >> 20} MiB tmpfs by default; commit or discard after the run)"))
    elif fallback:
        checks.append(_check("workspace", False, fallback + " (no total write bound; ownership handed over "
                             "during runs)", "use Linux >= 5.19 (idmapped overlay layers), or unset "
                             "LOWLEVEL_NO_OVERLAY"))
    if any(n.startswith("workspace: copy-on-write") for n in result_notes):
        from lowlevel.workspace import disk_upper
        ok, detail, fix = disk_upper.doctor_check()
        checks.append(_check("disk upper", ok, detail, fix))
    if os.geteuid() == 0:
        try:
            first, count = uids.uid_range()
        except UnsupportedError as err:
            checks.append(_check("uid range", False, str(err), err.fix or ""))
            return checks
        last = first + count - 1
        clashes = []
        try:
            import pwd
            clashes += [f"user {e.pw_name} ({e.pw_uid})" for e in pwd.getpwall() if first <= e.pw_uid <= last]
            import grp  # the lease is the sandbox's gid too
            clashes += [f"group {g.gr_name} ({g.gr_gid})" for g in grp.getgrall() if first <= g.gr_gid <= last]
        except OSError:
            pass
        for path in ("/etc/subuid", "/etc/subgid"):
            try:
                with open(path) as f:
                    for line in f:
                        parts = line.strip().split(":")
                        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                            lo, n = int(parts[1]), int(parts[2])
                            if lo <= last and first <= lo + n - 1:
                                clashes.append(f"{path} {parts[0]}:{lo}:{n}")
            except OSError:
                pass
        checks.append(_check("uid range", not clashes, f"per-run sandbox uids {first}-{last} ({count} concurrent "
                             "sandboxes)" + (": overlaps " + ", ".join(clashes[:5]) if clashes else ", free"),
                             "set LOWLEVEL_UID_RANGE=FIRST-LAST to a range no account or subordinate id uses"))
        if uids.nss_beyond_files():
            # A directory (sssd, LDAP, winbind) cannot be listed here: each candidate is asked at lease time.
            checks.append(_check("uid range (NSS)", True, f"{uids.NSSWITCH_PATH} takes users or groups from sources "
                                 "beyond files: each per-run uid is looked up (getpwuid/getgrgid) before it is "
                                 "leased and skipped when the directory names it (one lookup per run)",
                                 "prefer a LOWLEVEL_UID_RANGE your directory never hands out: sssd's default id "
                                 "mapping spans 200000-2000200000, which holds the default range"))
    return checks


def cached_cow_checks() -> list[dict[str, Any]]:
    """Every filesystem the host cache (:mod:`lowlevel.host.hostcache`) says has no copy-on-write
    overlay, probed again (:func:`lowlevel.sandbox.facts.recheck_cached_cow`): runs there fall back
    to the hand-over model (no ``--discard``, no write bound), so a stale "no" changes what
    callers get. One check per entry: ok when the overlay works there after all (the entry is
    rewritten), not ok with the fresh reason when it still does not."""
    from lowlevel.sandbox.facts import host_facts, recheck_cached_cow
    checks = []
    try:
        found = recheck_cached_cow(host_facts())
    except Exception as err:  # noqa: BLE001 - doctor reports, never crashes
        return [_check("cached workspace verdicts", False, f"{type(err).__name__}: {err}")]
    for path, old, fresh in found:
        if fresh is None:
            checks.append(_check(f"workspace on {path}", True, f"a cached 'no copy-on-write overlay' ({old.reason}) "
                                 "was dropped: the directory is gone; the next run there probes again"))
        elif fresh.ok:
            checks.append(_check(f"workspace on {path}", True, f"copy-on-write overlay works (the cache said it did "
                                 f"not: {old.reason}; corrected)"))
        else:
            checks.append(_check(f"workspace on {path}", False, "no copy-on-write overlay on this filesystem: "
                                 f"{fresh.reason}; runs there hand the workspace over (no --discard, no write "
                                 "bound)" + (" (probe failed for a reason of this process's; not cached)"
                                             if fresh.transient else ""),
                                 "use a workspace on another filesystem, or see the reason"))
    return checks


def leftovers_check() -> dict[str, Any]:
    """What interrupted runs left here (:mod:`lowlevel.cleanup`); ``lowlevel cleanup`` removes it."""
    from lowlevel.cleanup import find_leftovers

    found = find_leftovers()
    kinds: dict[str, int] = {}
    for x in found:
        kinds[x.kind] = kinds.get(x.kind, 0) + 1
    detail = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"
    return _check("leftovers", not found, f"left by interrupted runs: {detail}", "lowlevel cleanup")


def bwrap_checks(checks: list[dict[str, Any]]) -> BwrapInfo | None:
    """The bwrap checks (found, version, setuid, options), appended to ``checks``.

    Returns:
        The :class:`lowlevel.host.probe.BwrapInfo` of the bwrap :func:`lowlevel.run` will use, or
        None when there is no usable one.
    """
    import shutil

    from lowlevel.errors import LowlevelError
    from lowlevel.host import probe

    info = None
    on_path = shutil.which("bwrap")
    fallback = "/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None
    if on_path is None and fallback is None:
        checks.append(_check("bwrap", False, "bwrap not found on PATH=" + repr(os.environ.get("PATH", ""))
                             + " nor at /usr/bin/bwrap",
                             "apt-get install bubblewrap, or put its directory on PATH", required=True))
    else:
        if on_path is None:
            checks.append(_check("bwrap on PATH", False, "bwrap is not on PATH=" + repr(os.environ.get("PATH", ""))
                                 + f"; lowlevel uses the fallback {fallback}",
                                 "put /usr/bin on PATH if other tools need bwrap"))
        try:
            info = probe.bwrap_info(on_path or fallback)
            checks.append(_check("bwrap", True, f"{info.path} version {'.'.join(map(str, info.version))}"
                                 + ("" if on_path else " (fallback: not on PATH)"), required=True))
            checks.append(_check("bwrap setuid", not info.setuid,
                                 "setuid root" if info.setuid else "not setuid (user namespaces)",
                                 "prefer a non-setuid bwrap with unprivileged user namespaces"))
            checks.append(_check("--disable-userns", info.can_disable_userns,
                                 "supported" if info.can_disable_userns else "not supported (needs bwrap >= "
                                 "0.8.0, not setuid): nested user namespaces are blocked by seccomp only",
                                 "upgrade bubblewrap to >= 0.8.0"))
            for opt in ("--json-status-fd", "--block-fd", "--args", "--size", "--seccomp"):
                checks.append(_check(f"bwrap {opt}", info.has(opt), "supported" if info.has(opt) else "missing",
                                     "upgrade bubblewrap",
                                     required=opt in ("--json-status-fd", "--args", "--seccomp")))
        except LowlevelError as err:
            checks.append(_check("bwrap", False, str(err), "apt-get install bubblewrap", required=True))
    return info


def sandbox_checks() -> list[dict[str, Any]]:
    """Run a default-policy sandbox (``sh -c 'exit 7'``), then the checks that need one to have run:
    the workspace model, the cached copy-on-write probe, the leftovers of interrupted runs."""
    import shutil

    from lowlevel.errors import LowlevelError

    out: list[dict[str, Any]] = []
    try:
        from lowlevel.sandbox.drive import run
        result = run(["/bin/sh", "-c", "exit 7"], timeout=20)
        ok = result.exit_code == 7
        out.append(_check("sandbox runs", ok, "a default-policy sandbox ran and exited 7" if ok else
                          f"unexpected exit {result.exit_code}", required=True))
        out.extend(workspace_checks(result.notes))
        out.extend(cached_cow_checks())
        out.append(leftovers_check())
        if result.workspace:
            shutil.rmtree(result.workspace, ignore_errors=True)
    except LowlevelError as err:
        out.append(_check("sandbox runs", False, str(err),
                          "enable unprivileged user namespaces: sysctl -w kernel.unprivileged_userns_clone=1 "
                          "(Debian < 11) or kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu >= 23.10)",
                          required=True))
    return out


def diagnose() -> dict[str, Any]:
    """Probe the host and return the report (never raises for a missing capability).

    bwrap is found the way :func:`lowlevel.run` finds it (:func:`lowlevel.host.probe.bwrap_info`:
    ``PATH``, then ``/usr/bin/bwrap``), so the verdict is what ``run`` will do: a bwrap found
    only through the fallback passes the required check, and a separate, not required, check
    says it is not on ``PATH`` (other tools may need it there), with the fix.
    """
    from lowlevel.host import cgroup_detect, probe

    # Detect (and cache for this process) without the sweep: the sandbox run below must not
    # remove the stale cgroups the leftovers check then reports (doctor only looks).
    cgroup_detect.detect_cgroups(sweep=False)
    checks: list[dict[str, Any]] = []
    checks.append(_check("kernel", True, f"{platform.system()} {platform.release()} {platform.machine()}"))
    info = bwrap_checks(checks)
    checks.append(_check("pidfd", probe.pidfd_supported(), "pidfd_open(2) works" if probe.pidfd_supported()
                         else "pidfd_open(2) missing", "use Linux >= 5.3", required=True))
    checks.append(userns_check())
    from lowlevel.net.egress_run import RELAY_PATH
    relay_ok = os.access(RELAY_PATH, os.X_OK)
    checks.append(_check("egress relay", relay_ok, f"{RELAY_PATH} is built (Policy(network=Egress(...)), --allow-host)"
                         if relay_ok else f"{RELAY_PATH} is missing: egress allowlists cannot run",
                         "reinstall lowlevel (pip install .) with gcc present"))
    checks.extend(seccomp_checks())
    checks.extend(landlock_checks())
    checks.extend(cgroup_checks())
    if info is not None:
        checks.extend(sandbox_checks())
    else:
        checks.append(_check("sandbox runs", False, "not attempted: no usable bwrap", "fix bwrap first",
                             required=True))
    checks.extend(image_checks())
    checks.append(_check("uid", True, f"running as uid {os.getuid()}"
                         + (" (sandbox drops to an unprivileged uid)" if os.getuid() == 0 else "")))
    ok = all(c["ok"] for c in checks if c["required"])
    return {"ok": ok, "checks": checks}
