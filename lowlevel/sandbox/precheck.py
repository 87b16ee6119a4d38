"""Is the command there? Decide "not found" and "not executable" before paying for a sandbox.

The sandbox's filesystem is known before it starts (``/usr`` and friends, the workspace, the
binds, a few ``/etc`` entries, an empty ``/tmp``): :func:`precheck_exec` follows the command's
path (and a ``#!`` script's interpreter) as the sandbox's kernel would, on the host paths that
back it, and raises :class:`~lowlevel.sandbox.failures.ExecError` with a hint.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping, Sequence

from lowlevel.sandbox.failures import ExecError
from lowlevel.spec.policy import WORKSPACE_DEST, Policy


#: Sandbox paths that exist but are never executable (synthesized by the launcher).
_SYNTHESIZED = ("/etc/passwd", "/etc/group")
#: Mounts whose content we cannot know before the run: leave those paths to bwrap's execvp.
_OPAQUE = ("/proc", "/dev", "/sys")
def _host_path(policy: Policy, workspace: str, inside: str, etc_files: Sequence[str] = ()) -> str | None:
    """Map a sandbox path to the host path that backs it.

    Returns the host path; ``""`` when the path surely does not exist in a fresh sandbox
    (``/tmp`` is empty at start, the root holds only what the base layout puts there); or
    None when we cannot know (``/proc``, ``/dev``).
    """
    inside = os.path.normpath(inside)
    if inside == WORKSPACE_DEST or inside.startswith(WORKSPACE_DEST + "/"):
        return workspace + inside[len(WORKSPACE_DEST):]
    for bind in policy.binds:
        if inside == bind.dest or inside.startswith(bind.dest.rstrip("/") + "/"):
            return bind.source + inside[len(bind.dest):]
    if policy.rootfs is not None:
        # The system is a tree on the host: resolve inside it (its symlinks are the sandbox's).
        from lowlevel.rootfs import resolve_in_root
        dests = (WORKSPACE_DEST, "/tmp", *_OPAQUE, *(b.dest for b in policy.binds))
        return resolve_in_root(policy.rootfs, inside, lambda v: any(
            v == d or v.startswith(d.rstrip("/") + "/") for d in dests))
    for name in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        if inside == name or inside.startswith(name + "/"):
            return inside
    for entry in etc_files:
        if inside == entry or inside.startswith(entry + "/"):
            return inside
    if any(inside == p or inside.startswith(p + "/") for p in _OPAQUE):
        return None
    return ""


def _mount_ancestor(policy: Policy, inside: str, etc_files: Sequence[str]) -> bool:
    """True when ``inside`` is a directory bwrap makes to hold a mount point (``/opt`` for a
    bind at ``/opt/venv``): it exists in the sandbox though nothing backs it."""
    dests = [b.dest for b in policy.binds] + [WORKSPACE_DEST, "/etc", *etc_files]
    return inside == "/" or any(d.startswith(inside.rstrip("/") + "/") for d in dests)


def _resolve_inside(policy: Policy, workspace: str, inside: str,
                    etc_files: Sequence[str]) -> tuple[str | None, str, str | None]:
    """Follow ``inside`` the way the sandbox's kernel would, one component at a time, reading
    each symlink on the host path that backs it.

    Returns ``(host, path, link)``: ``host`` is the host path backing the resolved sandbox
    ``path``, ``""`` when that path does not exist inside (``link``: the symlink whose target
    is missing, if one was followed), or None when we cannot know (``/proc``, too many links).
    ``link`` is set only when the missing component came from that symlink's target: a missing
    ``/bin/cmd`` through ``/bin -> usr/bin`` is a missing file, not a dangling link.
    """
    todo = [p for p in inside.split("/") if p]
    cur = "/"
    hops = 0
    link: str | None = None
    rest = 0  # components of the path after the last symlink followed (the ones not from its target)
    while todo:
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            cur = os.path.dirname(cur.rstrip("/")) or "/"
            continue
        nxt = os.path.join(cur, part)
        host = _host_path(policy, workspace, nxt, etc_files)
        if host is None:
            return None, nxt, link
        if host == "":
            if todo and _mount_ancestor(policy, nxt, etc_files):
                cur = nxt
                continue
            return "", nxt, link if len(todo) >= rest else None
        try:
            st = os.lstat(host)
        except OSError:
            return "", nxt, link if len(todo) >= rest else None
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > 40:
                return None, nxt, link
            target = os.readlink(host)
            link = f"{nxt} -> {target}"
            rest = len(todo)
            if target.startswith("/"):
                cur = "/"
            todo = [p for p in target.split("/") if p] + todo
            continue
        cur = nxt
    return _host_path(policy, workspace, cur, etc_files), cur, link


def _shebang(host: str) -> str | None:
    """The absolute interpreter path of a ``#!`` script at ``host``, or None."""
    try:
        fd = os.open(host, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.read(fd, 256)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    if not words or not words[0].startswith(b"/"):
        return None
    try:
        return words[0].decode()
    except UnicodeDecodeError:
        return None


def precheck_exec(policy: Policy, workspace: str, command: Sequence[str], env: Mapping[str, str],
                  cwd: str = WORKSPACE_DEST, etc_files: Sequence[str] = ()) -> None:
    """Fail fast with ExecError when the command surely does not exist or is not executable.

    The sandbox's filesystem is known before it starts (``/usr`` and friends, the workspace,
    the binds, a few ``/etc`` entries, an empty ``/tmp``), so "not found" and "not executable"
    are decided here, in capture and in inherited-stdio mode alike, before paying for a
    sandbox. Symlinks are followed as the sandbox sees them, so a virtualenv's ``bin/python``
    pointing at an interpreter outside every bind (a pyenv build under ``/root``) is "not
    found", with a hint naming the unreachable target; a ``#!`` script's interpreter is
    checked the same way (up to 4 levels, the kernel's ``BINPRM_MAX_RECURSION``). Paths under
    ``/proc`` and ``/dev`` are left to bwrap's own execvp, whose failure is decoded after the
    run.
    """
    _precheck(policy, workspace, command[0], command, env, cwd, etc_files, depth=0)


def _precheck(policy: Policy, workspace: str, prog: str, command: Sequence[str], env: Mapping[str, str],
              cwd: str, etc_files: Sequence[str], depth: int) -> None:
    if "/" in prog:
        candidates = [prog if prog.startswith("/") else os.path.join(cwd, prog)]
    else:
        candidates = [os.path.join(d, prog) for d in env.get("PATH", "").split(":") if d.startswith("/")]
    unknown = False
    not_exec = False
    dangling: str | None = None
    for cand in candidates:
        norm = os.path.normpath(cand)
        if norm in _SYNTHESIZED:
            not_exec = True
            continue
        host, _inside, link = _resolve_inside(policy, workspace, norm, etc_files)
        if host is None:
            unknown = True
            continue
        if host == "":
            if link is not None and dangling is None:
                dangling = link
            continue
        if "/" not in prog and host.startswith(workspace):
            unknown = True  # PATH entries inside the workspace: leave it to execvp
            continue
        if os.path.isdir(host):
            not_exec = True
            continue
        if os.path.isfile(host):
            if os.stat(host).st_mode & 0o111:
                interp = _shebang(host) if depth < 4 else None
                if interp is not None:
                    try:
                        _precheck(policy, workspace, interp, command, env, cwd, etc_files, depth + 1)
                    except ExecError as err:
                        raise ExecError(f"{prog}: its interpreter (#!{interp}) cannot run in the sandbox: "
                                        f"{err}", argv=list(command), errno=err.errno) from None
                return
            not_exec = True
    if unknown or not candidates:
        return
    if not_exec:
        raise ExecError(f"{prog}: permission denied (not an executable file)", argv=list(command),
                        errno=errno.EACCES)
    if dangling is not None:
        raise ExecError(f"{prog}: not found in the sandbox: the symlink {dangling} points outside what the "
                        "sandbox sees (bind the target's directory read-only with --ro / Bind, or make the "
                        "virtualenv with --copies)", argv=list(command), errno=errno.ENOENT)
    raise ExecError(f"{prog}: command not found in the sandbox (PATH={env.get('PATH', '')})",
                    argv=list(command), errno=errno.ENOENT)


__all__ = ["precheck_exec"]
