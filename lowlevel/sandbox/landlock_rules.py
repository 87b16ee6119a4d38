"""The Landlock ruleset of a sandbox's program, derived from its Policy: the ``--ll...`` options the
run guard and the session init pass to ``native/lowlevel_landlock.h``, which builds the ruleset
inside the sandbox (sandbox paths).

One concept: which rights the second wall grants where. It sits above :mod:`lowlevel.rootfs`
because a ``Policy.rootfs`` run's rules follow that tree's top level (:func:`lowlevel.rootfs.rootfs_layout`);
the kernel's ABI and the guard are :mod:`lowlevel.host.landlock`.

The rules (sandbox paths; built inside the sandbox by ``native/lowlevel_landlock.h``):

- read files and execute beneath the read-only mounts: ``/usr``, the host's read-only
  top-level dirs (``/lib64``... when not usr-merged), ``/etc``, read-only binds; with a
  ``Policy.rootfs`` (or image), its top-level directories and files instead (every right in
  the ones ``rootfs_writable`` makes writable);
- every filesystem right beneath ``/workspace``, ``/tmp``, ``/dev/shm`` and writable binds;
- read, write and ioctl existing files beneath ``/dev`` and ``/proc`` (both mounted so that
  nothing can be created there; ``/proc/sys`` is read-only);
- list directories anywhere in the sandbox's tree (so ``ls /`` works), nothing else there;
- the standard streams when they are files or terminals (so ``/dev/stdout`` reopens);
- TCP (ABI >= 4): no bind; connect to any port with ``Policy(network=True)``, to the egress
  relay's port (``127.0.0.1:3128``) only with ``network=Egress(...)``, to none without network;
- scopes (ABI >= 6): no connecting to abstract unix sockets made outside the sandbox's
  domain (the host's, with a shared network), no signals to processes outside it;
- pathname unix sockets (ABI >= 9, ``LANDLOCK_ACCESS_FS_RESOLVE_UNIX``): connecting to one made
  outside the program's domain only beneath ``/tmp``, ``/dev/shm``, ``/workspace`` and binds
  with ``allow_sockets`` (or a socket bound itself with ``allow_sensitive``); below ABI 9 the
  sockets found in bound directories are masked instead (:mod:`lowlevel.sandbox.bind_sockets`).

Everything else is denied, whatever the mounts allow: a writable host directory reached by
any other path cannot be written, read or executed (only listed, when it is mounted in the
sandbox's tree). Rights the kernel lacks are dropped (best effort down to ABI 1; with
ABI 1, renames and links across directories fail with EXDEV, which ``mv``, ``shutil.move``
and npm answer with a copy). UDP is not covered by Landlock (ABI 7).

Sources: Documentation/userspace-api/landlock.rst (kernel); landlock(7), landlock_add_rule(2).
"""

from __future__ import annotations

import functools
import os
import stat

from lowlevel.host import landlock as _landlock
from lowlevel.spec.policy import WORKSPACE_DEST, Policy


def ruleset_args(policy: Policy, ro_dirs: tuple[str, ...],
                 bwrap_options: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The ``--ll...`` options of the guard and the init for ``policy`` (cached per Policy).

    Args:
        policy: the sandbox description (``landlock``, ``binds``, ``network``, ``landlock_omit``,
            ``rootfs``/``rootfs_writable``).
        ro_dirs: the host's read-only top-level dirs the base layout binds
            (:attr:`lowlevel.host.probe.HostLayout.ro_dirs`); unused with a ``rootfs``.
        bwrap_options: the installed bwrap's options (a writable rootfs is an overlay per
            top-level directory where bwrap has ``--tmp-overlay``: those are then writable).
    Returns:
        options for ``native/lowlevel_landlock.h``; ``("--ll=off",)`` when Landlock is off.
    """
    return _ruleset_args(policy, ro_dirs, bwrap_options, _landlock.abi_cap())


def _system_rules(policy: Policy, ro_dirs: tuple[str, ...], bwrap_options: frozenset[str]) -> list[str]:
    """Read/exec rules for the sandbox's system: the host's ``/usr`` (+ read-only top-level dirs
    and ``/etc``), or the top level of ``Policy.rootfs`` as :func:`lowlevel.rootfs.base_args`
    mounts it (writable where ``rootfs_writable`` makes it so)."""
    if policy.rootfs is None:
        return ["--ll-rx=/usr", *(f"--ll-rx={d}" for d in ro_dirs), "--ll-rx=/etc"]
    from lowlevel.rootfs import rootfs_layout
    layout = rootfs_layout(policy.rootfs)
    # A writable root is an overlay of each top-level directory where the anchor's overlay
    # works (or bwrap >= 0.9's --tmp-overlay), else tmpfs scratch dirs: the mounts decide what
    # is writable (an rw rule on a read-only mount grants nothing), so both are rw here.
    writable = policy.rootfs_writable
    out = [f"--ll-{'rw' if writable else 'rx'}=/{name}" for name in layout.dirs]
    out += [f"--ll-rx=/{name}" for name in layout.files]
    if writable:
        out += [f"--ll-rw=/{rel}" for rel in layout.scratch_dirs]
    return out


@functools.lru_cache(maxsize=256)
def _ruleset_args(policy: Policy, ro_dirs: tuple[str, ...], bwrap_options: frozenset[str],
                  abi_max: int | None) -> tuple[str, ...]:
    if policy.landlock is False:
        return ("--ll=off",)
    omit = set(policy.landlock_omit)
    a = ["--ll=require" if policy.landlock == "require" else "--ll=on", "--ll-ls=/"]
    a += _system_rules(policy, ro_dirs, bwrap_options)
    a += ["--ll-proc=/proc", "--ll-dev=/dev", "--ll-rw=/dev/shm", "--ll-rw=/tmp", f"--ll-rw={WORKSPACE_DEST}"]
    # Connecting to pathname unix sockets made outside the program's domain (ABI >= 9; the guard
    # drops the rule below; --ll-rw does not grant it): the sandbox's own places (a Session's
    # commands are sibling domains, and one may serve another over a socket there), and binds
    # that keep their sockets (allow_sockets, or a socket bound on purpose with allow_sensitive).
    # Nowhere else: a bound directory's host daemon socket (D-Bus, Docker, Podman, Ray) is
    # refused (issue 22, item 2).
    a += ["--ll-unix=/tmp", "--ll-unix=/dev/shm", f"--ll-unix={WORKSPACE_DEST}"]
    for bind in policy.binds:
        if bind.dest not in omit:
            a.append(f"--ll-{'rw' if bind.writable else 'rx'}={bind.dest}")
            if bind.allow_sockets or _is_socket(bind.source):
                a.append(f"--ll-unix={bind.dest}")
    from lowlevel.spec.egress import PROXY_PORT, Egress
    if isinstance(policy.network, Egress):
        a.append(f"--ll-net=port:{PROXY_PORT}")  # the relay's port; the relay itself runs outside
    else:
        a.append("--ll-net=connect" if policy.network else "--ll-net=none")
    if abi_max is not None:
        a.append(f"--ll-abi-max={abi_max}")
    return tuple(a)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


__all__ = ["ruleset_args"]
