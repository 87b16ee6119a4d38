"""Real overlayfs upper directories for the overlay tests, and a runner for lowlevel.overlay.

Imported by the tests (``Lab``), and executed as a script in two roles:

- ``overlay_lab.py inner BASE OPTIONS`` (stdin: JSON ``{"sh": ..., "py": ...}``), run inside a
  fresh mount namespace (``unshare --mount --propagation private`` as root, or ``unshare --user
  --map-root-user --mount`` for the ``userxattr`` form): mounts overlayfs with
  ``lowerdir=BASE/lower,upperdir=BASE/upper,workdir=BASE/work`` on ``BASE/merged``, runs the
  shell script and/or Python code with the merged dir as cwd, and exits: the namespace and the
  mount die with it, ``BASE/upper`` stays on disk.
- ``overlay_lab.py tool`` (stdin: JSON request), run as the unprivileged test user through
  runuser: opens the upper and lower dirs and calls ``read_changes``/``commit``/``save_upper``/
  ``cleanup_commit_leftovers``, printing the result as JSON (paths keep their surrogates as
  ``\\udcXX`` escapes).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
TEST_USER = "lowlevel-test"

#: mode -> (xattr prefix, overlay options, who runs it)
MODES = {
    # real root, trusted.overlay.* xattrs, as the exec helper mounts it for root callers
    "root": ("trusted.overlay.", "redirect_dir=off,metacopy=off,index=off", "root"),
    # userxattr form, in a user namespace made by root (unshare -r)
    "userns": ("user.overlay.", "userxattr,redirect_dir=nofollow,metacopy=off,index=off", "root"),
    # userxattr form as the unprivileged test user (runuser + unshare -r); the commit runs as them too
    "user": ("user.overlay.", "userxattr,redirect_dir=nofollow,metacopy=off,index=off", "user"),
}


def _inner(base: str, options: str) -> int:
    spec = json.load(sys.stdin)
    merged = os.path.join(base, "merged")
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"{options},lowerdir={base}/lower,upperdir={base}/upper,workdir={base}/work", merged],
                   check=True)
    os.chdir(merged)
    if spec.get("sh"):
        subprocess.run(["sh", "-ec", spec["sh"]], check=True)
    if spec.get("py"):
        exec(compile(spec["py"], "<ops>", "exec"), {"__name__": "__ops__"})
    os.chdir("/")
    return 0


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return _jsonable(asdict(obj))
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def call(req: dict[str, Any]) -> dict[str, Any]:
    """Run one lowlevel.overlay call described by ``req`` in this process; a JSON-ready dict."""
    from lowlevel import overlay
    from lowlevel.errors import WorkspaceError

    upper = os.open(req["upper"], os.O_RDONLY | os.O_DIRECTORY) if req.get("upper") else -1
    lower = os.open(req["lower"], os.O_RDONLY | os.O_DIRECTORY) if req.get("lower") else -1
    try:
        op = req["op"]
        if op == "changes":
            out: Any = overlay.read_changes(upper, lower, xattr_prefix=req["prefix"])
        elif op == "commit":
            owner = tuple(req["new_owner"]) if req.get("new_owner") else None
            out = overlay.commit(upper, lower, xattr_prefix=req["prefix"], since_ns=req["since_ns"],
                                 new_owner=owner, max_bytes=req.get("max_bytes"))  # type: ignore[arg-type]
        elif op == "save":
            out = {"path": overlay.save_upper(upper, req["dest"], xattr_prefix=req["prefix"])}
        elif op == "cleanup":
            out = {"removed": overlay.cleanup_commit_leftovers(lower)}
        else:
            raise ValueError(op)
        return {"ok": _jsonable(out)}
    except (WorkspaceError, ValueError) as err:
        return {"error": type(err).__name__, "message": str(err), "errno": getattr(err, "errno", None),
                "conflicts": list(getattr(err, "conflicts", ()))}
    finally:
        for fd in (upper, lower):
            if fd >= 0:
                os.close(fd)


def _tool() -> int:
    json.dump(call(json.load(sys.stdin)), sys.stdout)
    return 0


class LabError(Exception):
    """A call through the lab returned an error (for the unprivileged runner)."""

    def __init__(self, d: dict[str, Any]) -> None:
        super().__init__(d["message"])
        self.kind = d["error"]
        self.errno = d["errno"]
        self.conflicts = tuple(d["conflicts"])


class Lab:
    """``lower/``, ``upper/``, ``work/``, ``merged/`` under a fresh temp dir, for one mode.

    For mode ``user`` the temp dir is under /tmp, owned by the test user (reachable by them);
    otherwise under ``parent``. ``remove()`` deletes it.
    """

    def __init__(self, mode: str, parent: Path | None = None) -> None:
        self.mode = mode
        self.prefix, self.options, who = MODES[mode]
        self.user = pwd.getpwnam(TEST_USER) if who == "user" else None
        self.base = Path(tempfile.mkdtemp(prefix=f"ovl-{mode}-", dir=None if self.user else parent))
        os.chmod(self.base, 0o755)
        for d in ("lower", "upper", "work", "merged"):
            (self.base / d).mkdir()
        if self.user:
            self.chown_all()

    @property
    def uid(self) -> int:
        return self.user.pw_uid if self.user else os.getuid()

    @property
    def gid(self) -> int:
        return self.user.pw_gid if self.user else os.getgid()

    @property
    def lower(self) -> Path:
        return self.base / "lower"

    @property
    def upper(self) -> Path:
        return self.base / "upper"

    def chown_all(self, path: Path | None = None) -> None:
        """Give ``path`` (default: the whole lab) to the lab's user, without following symlinks."""
        if not self.user:
            return
        top = path or self.base
        os.chown(top, self.uid, self.gid, follow_symlinks=False)
        for root, dirs, files in os.walk(top):
            for n in dirs + files:
                os.chown(os.path.join(root, n), self.uid, self.gid, follow_symlinks=False)

    def reset_upper(self) -> None:
        for d in ("upper", "work"):
            shutil.rmtree(self.base / d)
            (self.base / d).mkdir()
            if self.user:
                os.chown(self.base / d, self.uid, self.gid)

    def run(self, sh: str = "", py: str = "") -> None:
        """Mount the overlay in a private mount namespace, run the ops in the merged dir, unmount."""
        inner = [sys.executable, str(HERE), "inner", str(self.base), self.options]
        if self.mode == "root":
            argv = [UNSHARE, "--mount", "--propagation", "private", *inner]
        elif self.mode == "userns":
            argv = [UNSHARE, "--user", "--map-root-user", "--mount", *inner]
        else:
            argv = [RUNUSER, "-u", TEST_USER, "--", UNSHARE, "--user", "--map-root-user", "--mount", *inner]
        proc = subprocess.run(argv, input=json.dumps({"sh": sh, "py": py}).encode(), capture_output=True,
                              timeout=300, cwd="/")
        if proc.returncode != 0:
            raise AssertionError(f"overlay ops failed ({self.mode}): {proc.stderr.decode(errors='replace')[-3000:]}")

    def call(self, op: str, **kw: Any) -> Any:
        """``op`` (changes/commit/save/cleanup) on this lab, as the lab's identity. Returns the
        JSON-ready result; raises LabError for a WorkspaceError/ValueError."""
        req = {"op": op, "upper": str(self.upper), "lower": str(self.lower), "prefix": self.prefix, **kw}
        if self.user:
            proc = subprocess.run([RUNUSER, "-u", TEST_USER, "--", sys.executable, str(HERE), "tool"],
                                  input=json.dumps(req).encode(), capture_output=True, timeout=300, cwd="/")
            if proc.returncode != 0:
                raise AssertionError(f"overlay tool failed: {proc.stderr.decode(errors='replace')[-3000:]}")
            d = json.loads(proc.stdout)
        else:
            d = json.loads(json.dumps(call(req)))
        if "error" in d:
            raise LabError(d)
        return d["ok"]

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def tree_state(root: Path, *, times: bool = True, ctime: bool = False) -> dict[str, tuple[Any, ...]]:
    """``{relpath: (kind, mode, uid, gid, content sha256 | link target | None, mtime?, xattrs)}``
    of everything below ``root`` (names as bytes-decoded str), never following symlinks."""
    import hashlib

    out: dict[str, tuple[Any, ...]] = {}
    base = os.fsencode(root)
    for dirpath, dirs, files in os.walk(base):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            rel = os.fsdecode(os.path.relpath(p, base))
            st = os.lstat(p)
            kind = ("dir" if os.path.isdir(p) and not os.path.islink(p) else "link" if os.path.islink(p)
                    else "file" if os.path.isfile(p) else "other")
            data: Any = None
            if kind == "file":
                with open(p, "rb") as f:
                    data = hashlib.sha256(f.read()).hexdigest()
            elif kind == "link":
                data = os.fsdecode(os.readlink(p))
            try:
                xattrs = tuple(sorted((a, os.getxattr(p, a, follow_symlinks=False).hex())
                                      for a in os.listxattr(p, follow_symlinks=False)))
            except OSError:
                xattrs = ()
            entry: tuple[Any, ...] = (kind, st.st_mode, st.st_uid, st.st_gid, data, xattrs)
            if times and kind != "dir":
                entry += (st.st_mtime_ns,)
            if ctime:
                entry += (st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_nlink, st.st_size)
            out[rel] = entry
    return out


if __name__ == "__main__":
    if sys.argv[1] == "inner":
        sys.exit(_inner(sys.argv[2], sys.argv[3]))
    sys.exit(_tool())
