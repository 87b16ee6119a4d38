"""Where a record's policy gives a sandbox more than the default: :func:`policy_loosening`
(Policy fields, limits, the timeout) and :func:`argv_loosening` (options a record's env would add
to bwrap's argv). :func:`lowlevel.record.replay` refuses a looser record unless trusted. One
concept: the loosening checks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lowlevel.sandbox.argv import BWRAP_ARITY, build_argv
from lowlevel.sandbox.facts import host_facts
from lowlevel.sandbox.plan import CHILD_FDS
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Policy
from lowlevel.spec.report import display
from lowlevel.spec.seccomp import DEFAULT_PROFILE


def policy_loosening(policy: Policy, timeout_s: float | None = DEFAULT_TIMEOUT_S, *,
                     profiles: Sequence[Any] = ()) -> list[str]:
    """Where ``policy`` (and the timeout) give a sandbox more than ``Policy()`` does; one line each.

    Looser: any bind (it names host paths; writable or ``allow_sensitive`` said so), the host
    network, Landlock off, no seccomp filter or a profile in log mode (denials only logged) or one that is
    neither the default nor among ``profiles``, other host ids, a limit above its default or
    removed, larger capture caps, and a timeout above :data:`DEFAULT_TIMEOUT_S` or none.
    Environment, hostname, ids inside and deterministic mode are not looser.
    """
    default = Policy()
    out: list[str] = []
    for b in policy.binds:
        flags = ["writable" if b.writable else "read-only"] + (["allow_sensitive"] if b.allow_sensitive else []) \
            + (["allow_sockets"] if b.allow_sockets else [])
        out.append(f"bind {b.source} -> {b.dest} ({', '.join(flags)}); default: no binds")
    if policy.network is True:
        out.append("network=True (the host network); default: no network")
    elif policy.network:
        out.append(f"network=Egress({policy.network.describe()}) (egress through the proxy); default: no network")
    if policy.rootfs is not None and policy.image is None:
        out.append(f"rootfs {policy.rootfs} (a host directory shown to the sandbox); default: the host's /usr")
    if policy.landlock is False:
        out.append("landlock=False (no Landlock ruleset); default: Landlock, best effort")
    if policy.seccomp is None:
        out.append("seccomp=None (no syscall filter); default: the default profile")
    elif policy.seccomp.log:
        out.append(f"seccomp profile {policy.seccomp.name!r} in log mode (denied syscalls are allowed and "
                   "logged); default: the default profile")
    elif policy.seccomp != DEFAULT_PROFILE and all(policy.seccomp != p for p in profiles):
        out.append(f"seccomp profile {policy.seccomp.name!r} instead of the default")
    if policy.compat_32bit and policy.seccomp is not None:
        out.append("compat_32bit=True (the i386 int 0x80 entry point is open); default: killed")
    for name in ("host_uid", "host_gid"):
        if getattr(policy, name) != getattr(default, name):
            out.append(f"{name}={getattr(policy, name)} (the sandbox runs as that host id); "
                       f"default: {getattr(default, name)}")
    for f in dataclasses.fields(Limits):
        mine, theirs = getattr(policy.limits, f.name), getattr(default.limits, f.name)
        if f.name == "require":
            missing = sorted(set(theirs) - set(mine))
            if missing:
                out.append(f"limits.require drops {missing}")
        elif theirs is not None and (mine is None or mine > theirs):
            out.append(f"limits.{f.name}={mine!r}; default: {theirs!r}")
    for name in ("stdout_limit_bytes", "stderr_limit_bytes"):
        if getattr(policy, name) > getattr(default, name):
            out.append(f"{name}={getattr(policy, name)}; default: {getattr(default, name)}")
    if timeout_s is None or timeout_s > DEFAULT_TIMEOUT_S:
        out.append(f"timeout_s={timeout_s!r}; default: {DEFAULT_TIMEOUT_S:g}")
    return out


def _as_bwrap_reads(argv: Sequence[str]) -> list[tuple[str, ...]]:
    """The options bwrap would read from ``argv`` written NUL-separated (without refusing a NUL,
    as :func:`lowlevel.sandbox.argv.encode_args` does), grouped with their arguments."""
    raw = b"\0".join(os.fsencode(a) if _is_encodable(a) else a.encode("utf-8", "surrogatepass") for a in argv)
    tokens = [os.fsdecode(t) for t in raw.split(b"\0")]
    out: list[tuple[str, ...]] = []
    i = 0
    while i < len(tokens):
        n = BWRAP_ARITY.get(tokens[i], 0)
        out.append(tuple(tokens[i:i + 1 + n]))
        i += 1 + n
    return out


def _is_encodable(text: str) -> bool:
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return True


def argv_loosening(policy: Policy, *, env: Mapping[str, str] | None) -> list[str]:
    """What a record's env would add to bwrap's argv beyond its policy; one line each.

    Builds the options bwrap would read (:func:`lowlevel.sandbox.argv.build_argv`, NUL-split the way
    bwrap splits ``--args``) with the record's env, and with no env, and lists every option of
    the first that the second lacks, ignoring only ``--chdir``, ``--setenv`` and ``--clearenv``
    themselves (they act inside the sandbox). The record's cwd never reaches bwrap's argv
    (bwrap gets ``--chdir /``; the guard changes directory: :func:`lowlevel.spec.validate.sandbox_cwd`) The command is
    not in ``--args`` (it follows ``--`` on the real argv, where a NUL cannot split it).
    :func:`validate_record` already refuses a NUL in these fields; this is the second line, in
    :func:`replay`'s looser-policy check, so whatever a crafted field smuggles shows up there.
    """
    facts = host_facts()

    def options(env_: Mapping[str, str] | None) -> list[tuple[str, ...]]:
        argv = build_argv(policy, facts, workspace="/.lowlevel-replay-workspace", fds=CHILD_FDS,
                          extra_env=dict(env_) if env_ else None)
        return [t for t in _as_bwrap_reads(argv) if t[0] not in ("--chdir", "--setenv", "--clearenv")]

    mine = options(env)
    ref = list(options(None))
    out = []
    for opt in mine:
        if opt in ref:
            ref.remove(opt)
        else:
            out.append(f"bwrap would read the extra option {' '.join(display(t) for t in opt)!r} from the record's "
                       "cwd or env")
    return out


__all__ = ["argv_loosening", "policy_loosening"]
