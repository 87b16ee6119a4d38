"""Plan time for a Policy's system: resolve ``image``, check ``rootfs`` on the host (one concept).

A :class:`lowlevel.spec.policy.Policy` is data: building one reads nothing on the host (issue 26).
What its ``image`` and ``rootfs`` mean on this host is read when a run is planned, by
:func:`resolve`, which :class:`lowlevel.sandbox.launcher.Run`, :class:`lowlevel.session.Session`,
:class:`lowlevel.session.Pool` and :func:`lowlevel.record.execute_recorded` call on the Policy they
are given:

- ``image``: looked up in the store (:func:`lowlevel.rootfs.store.apply_image`): pinned to
  ``sha256:<id>``, ``rootfs`` its tree, the config's ``Env``/``User``/``WorkingDir`` as defaults;
  the image's last-used stamp is written.
- ``rootfs``: resolved (realpath) and checked (:func:`lowlevel.rootfs.check_rootfs`: a directory,
  not ``/`` or a sensitive location, ``etc/passwd`` and ``etc/group`` regular files, no ancestor
  another user could change); for a root caller, reachable by the sandbox's host uid
  (:func:`lowlevel.rootfs.rootfs_unreachable`); no bind destination going through one of the
  tree's symlinks (:func:`lowlevel.rootfs.symlink_on_the_way`, the CVE-2024-21626 class).

The result is cached per Policy object (not per value: a Policy equal to another but built after
a re-tag resolves again), so a Policy reused for thousands of runs reads the store and checks the
tree once, at its first run, as it did when these checks ran at construction.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

from lowlevel.errors import PolicyError
from lowlevel.rootfs import check_rootfs, rootfs_layout, rootfs_unreachable, symlink_on_the_way
from lowlevel.rootfs.store import apply_image
from lowlevel.spec.policy import Policy

# id(Policy) -> (a weak reference to it, its resolution; None when it is itself resolved). No lock:
# each operation is one dict operation (atomic under the GIL), and a lock taken in the weakref
# callback would deadlock when the garbage collector runs it in a thread that holds the lock.
_RESOLVED: dict[int, tuple[weakref.ref[Policy], Policy | None]] = {}


def _remember(policy: Policy, resolved: Policy | None) -> None:
    key = id(policy)

    def forget(ref: weakref.ref[Policy]) -> None:
        # Runs while the Policy is freed, before its id can be reused: only its own entry goes.
        entry = _RESOLVED.get(key)
        if entry is not None and entry[0] is ref:
            _RESOLVED.pop(key, None)

    _RESOLVED[key] = (weakref.ref(policy, forget), resolved)


def resolve(policy: Policy) -> Policy:
    """The Policy a run on this host is planned with: ``image`` and ``rootfs`` resolved and checked.

    Args:
        policy: any Policy; one without ``image`` and ``rootfs`` comes back as it is (no I/O).
    Returns:
        A Policy equal to ``policy`` but for ``image`` (``"sha256:<id>"``), ``rootfs`` (the
        resolved tree), ``env``, ``sandbox_uid``/``sandbox_gid`` and ``workdir`` (the image's
        defaults under the Policy's own). Idempotent: resolving a resolved Policy returns it.
    Raises:
        PolicyError: no such image, ``image`` and another ``rootfs``, an image ``User`` missing
            from the image, a ``rootfs`` that fails :func:`lowlevel.rootfs.check_rootfs`, is not
            reachable by the sandbox's host uid (root callers), or a bind destination through a
            symlink of the tree. The messages are the ones ``Policy(...)`` raised when it did
            these checks itself.
    """
    if policy.image is None and policy.rootfs is None:
        return policy
    hit = _RESOLVED.get(id(policy))
    if hit is not None and hit[0]() is policy:
        resolved = policy if hit[1] is None else hit[1]
        if resolved.image is None or os.path.isdir(resolved.rootfs or ""):
            return resolved
        # The image was removed from the store since (`image rm`): resolve again, so the name's
        # current image is used, or the store's "no image" error is raised, never a run on a
        # vanished tree ("true: command not found": a fresh-user trial).
        _RESOLVED.pop(id(policy), None)
    out = apply_image(policy) if policy.image is not None else policy
    assert out.rootfs is not None
    real = check_rootfs(out.rootfs)
    if real != out.rootfs:
        out = dataclasses.replace(out, rootfs=real)
    _check_reachable(real, out)
    _check_bind_dests(real, out)
    if out is not policy:
        _remember(policy, out)
    _remember(out, None)
    return out


def _check_reachable(rootfs: str, policy: Policy) -> None:
    """A root caller's sandbox runs as an unprivileged host uid, and bwrap mounts the tree as it."""
    if os.geteuid() != 0:
        return
    # Per-run uids (host_uid None) are nobody's: they reach what "others" may.
    uid = policy.host_uid if policy.host_uid is not None else -1
    gid = policy.host_gid if policy.host_gid is not None else -1
    why = rootfs_unreachable(rootfs, uid, gid)
    if why:
        who = f"host uid {uid}" if uid >= 0 else "per-run host uids"
        raise PolicyError(f"Policy.rootfs {rootfs} is not reachable by the sandbox's {who} "
                          f"(bwrap mounts it as that user): {why}. Put it under world-traversable "
                          "directories (chmod o+x)")


def _check_bind_dests(rootfs: str, policy: Policy) -> None:
    """bwrap sets a bind up by path inside the new root: through a tree's symlink it would follow
    the host's copy (issue 22 item 1; the CVE-2024-21626 class)."""
    layout = rootfs_layout(rootfs)
    for bind in policy.binds:
        link = symlink_on_the_way(layout, bind.dest)
        if link is not None:
            raise PolicyError(f"Bind dest {bind.dest!r} goes through the symlink {link} of Policy.rootfs "
                              f"{rootfs}: bwrap would resolve it on the host's tree while it sets up "
                              "(the CVE-2024-21626 class); bind to a real directory of the tree")


__all__ = ["resolve"]
