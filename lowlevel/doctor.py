"""Host capability report for ``lowlevel doctor``.

Each check is a dict ``{"name", "ok", "required", "detail", "fix"}``; the report is
``{"ok": bool, "checks": [...]}`` where ``ok`` means the default Policy can run here.
"""

from __future__ import annotations

import os
import platform
from typing import Any


def _check(name: str, ok: bool, detail: str, fix: str = "", required: bool = False) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "required": required, "detail": detail, "fix": fix}


def diagnose() -> dict[str, Any]:
    """Probe the host and return the report (never raises for a missing capability)."""
    from . import limits, probe
    from .errors import LowlevelError

    checks: list[dict[str, Any]] = []
    checks.append(_check("kernel", True, f"{platform.system()} {platform.release()} {platform.machine()}"))
    info = None
    try:
        info = probe.bwrap_info()
        checks.append(_check("bwrap", True, f"{info.path} version {'.'.join(map(str, info.version))}",
                             required=True))
        checks.append(_check("bwrap setuid", not info.setuid,
                             "setuid root" if info.setuid else "not setuid (user namespaces)",
                             "prefer a non-setuid bwrap with unprivileged user namespaces"))
        checks.append(_check("--disable-userns", info.can_disable_userns,
                             "supported" if info.can_disable_userns else "not supported (needs bwrap >= 0.8.0, "
                             "not setuid): nested user namespaces are blocked by seccomp only",
                             "upgrade bubblewrap to >= 0.8.0"))
        for opt in ("--json-status-fd", "--block-fd", "--args", "--size", "--seccomp"):
            checks.append(_check(f"bwrap {opt}", info.has(opt), "supported" if info.has(opt) else "missing",
                                 "upgrade bubblewrap", required=opt in ("--json-status-fd", "--args", "--seccomp")))
    except LowlevelError as err:
        checks.append(_check("bwrap", False, str(err), "apt-get install bubblewrap", required=True))
    checks.append(_check("pidfd", probe.pidfd_supported(), "pidfd_open(2) works" if probe.pidfd_supported()
                         else "pidfd_open(2) missing", "use Linux >= 5.3", required=True))
    try:
        from . import seccomp
        native = getattr(seccomp, "native_available", lambda: None)()
        checks.append(_check("seccomp native helper", bool(native),
                             "CFFI extension lowlevel._native built" if native else
                             "not built: falling back to pyseccomp",
                             "apt-get install libseccomp-dev, then reinstall lowlevel"))
        version = getattr(seccomp, "libseccomp_version", lambda: None)()
        if version:
            checks.append(_check("libseccomp", True, "version " + ".".join(map(str, version))))
    except Exception as err:  # noqa: BLE001 - doctor reports, never crashes
        checks.append(_check("seccomp", False, f"{type(err).__name__}: {err}", "apt-get install libseccomp2",
                             required=True))
    try:
        support = limits.detect_cgroups()
        writable = sorted(support.writable_controllers) if hasattr(support, "writable_controllers") else []
        checks.append(_check("cgroups", bool(writable),
                             f"version {getattr(support, 'version', None)}; writable controllers: "
                             f"{', '.join(writable) or 'none'}",
                             "run as root, or on a systemd host use a delegated cgroup v2 subtree "
                             "(systemd-run --user --scope -p Delegate=yes); without one, limits are rlimits only"))
    except Exception as err:  # noqa: BLE001
        checks.append(_check("cgroups", False, f"{type(err).__name__}: {err}"))
    if info is not None:
        try:
            from .launcher import run
            result = run(["/bin/sh", "-c", "exit 7"], timeout=20)
            ok = result.exit_code == 7
            checks.append(_check("sandbox runs", ok, "a default-policy sandbox ran and exited 7" if ok else
                                 f"unexpected exit {result.exit_code}", required=True))
        except LowlevelError as err:
            checks.append(_check("sandbox runs", False, str(err),
                                 "enable unprivileged user namespaces: sysctl -w kernel.unprivileged_userns_clone=1 "
                                 "(Debian < 11) or kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu >= 23.10)",
                                 required=True))
    checks.append(_check("uid", True, f"running as uid {os.getuid()}"
                         + (" (sandbox drops to an unprivileged uid)" if os.getuid() == 0 else "")))
    ok = all(c["ok"] for c in checks if c["required"])
    return {"ok": ok, "checks": checks}
