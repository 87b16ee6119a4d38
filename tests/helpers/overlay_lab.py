"""Real overlayfs upper directories for the overlay tests, and a runner for lowlevel.workspace.overlay.

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

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from collections.abc import Iterator
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
    os.environ["LAB_BASE"] = base
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


@contextlib.contextmanager
def interrupt_after(n: int | None, exc: type[BaseException] = KeyboardInterrupt) -> Iterator[list[int]]:
    """With ``n``: ``exc`` (KeyboardInterrupt, or SystemExit(143) as a SIGTERM handler raises it)
    raised right after the commit's ``n``-th renameat2(2) returns (an entry placed, swapped or
    moved out of sight, its bookkeeping not yet done: where an interrupt hurts most); the yielded
    list is non-empty once it was raised. Restored afterwards."""
    from lowlevel.workspace.overlay import apply_files  # every placement and deletion renames through it
    hit: list[int] = []
    if n is None:
        yield hit
        return
    real, count = apply_files._renameat2, [0]

    def renameat2(*args: Any) -> None:
        real(*args)
        count[0] += 1
        if count[0] == n and not hit:
            hit.append(n)
            raise exc(143) if exc is SystemExit else exc()

    apply_files._renameat2 = renameat2  # type: ignore[assignment]
    try:
        yield hit
    finally:
        apply_files._renameat2 = real  # type: ignore[assignment]


def call(req: dict[str, Any]) -> dict[str, Any]:
    """Run one lowlevel.workspace.overlay call described by ``req`` in this process; a JSON-ready dict."""
    from lowlevel.workspace import overlay
    from lowlevel.errors import WorkspaceError

    upper = os.open(req["upper"], os.O_RDONLY | os.O_DIRECTORY) if req.get("upper") else -1
    lower = os.open(req["lower"], os.O_RDONLY | os.O_DIRECTORY) if req.get("lower") else -1
    try:
        op = req["op"]
        if op == "changes":
            out: Any = overlay.read_changes(upper, lower, xattr_prefix=req["prefix"])
        elif op == "commit":
            owner = tuple(req["new_owner"]) if req.get("new_owner") else None
            with interrupt_after(req.get("interrupt_after")) as hit:
                try:
                    out = overlay.commit(upper, lower, xattr_prefix=req["prefix"], since_ns=req["since_ns"],
                                         new_owner=owner, max_bytes=req.get("max_bytes"),  # type: ignore[arg-type]
                                         accept_seen_host_changes=req.get("accept_seen", False))
                except KeyboardInterrupt:
                    if not hit:
                        raise
                    out = {"interrupted": True}
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

    def run(self, sh: str = "", py: str = "", *, capture: bool = False) -> dict[str, Any] | None:
        """Mount the overlay in a private mount namespace, run the ops in the merged dir, unmount.

        ``capture``: also return :func:`tree_state` of the merged dir as the run left it (owners
        as seen inside the namespace), the oracle for what a commit must produce.
        """
        if capture:
            py += ("\nimport json, os\nfrom overlay_lab import tree_state\n"
                   "json.dump(tree_state(os.getcwd()), open(os.path.join(os.environ['LAB_BASE'], 'merged.json'), 'w'))\n")
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
        if not capture:
            return None
        with open(self.base / "merged.json") as f:
            state: dict[str, Any] = json.load(f)
        os.unlink(self.base / "merged.json")
        return state

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


def make_scenario_lower(lower: Path) -> None:
    """The lower tree :data:`SCENARIO_OPS` works on."""
    files = {"a.txt": "a\n", "b.txt": "b\n", "c.txt": "c\n", "chmod.txt": "m", "setuid.bin": "#!/bin/sh\n",
             "x.txt": "x", "dir1/x": "1", "dir1/y": "2", "tree/sub/deep/f": "f", "tree/g": "g",
             "mvdir/p": "p", "mvdir/q/r": "r", "opq/o1": "o1", "opq/o2": "o2", "opq/od/x": "x", "f2d": "f",
             "d2f/z": "z", "keep/k": "k"}
    for rel, text in files.items():
        (lower / rel).parent.mkdir(parents=True, exist_ok=True)
        (lower / rel).write_text(text)
    (lower / "dmode").mkdir()
    os.chmod(lower / "setuid.bin", 0o755)
    os.symlink("a.txt", lower / "link")


#: What a run does in the merged dir (sh -e): every kind of change an overlay upper can hold.
SCENARIO_OPS = """
echo more >> a.txt
rm b.txt
mv c.txt c2.txt
chmod 600 chmod.txt
chmod u+s setuid.bin
rm dir1/x
rm -rf tree
mv mvdir mvdir2
rm -rf opq; mkdir opq; echo new-o1 > opq/o1; mkdir opq/od
rm f2d; mkdir f2d; echo in > f2d/in
rm -rf d2f; echo now-a-file > d2f
rm link; ln -s b-gone link
ln -s /etc/passwd newlink
echo h > h1; ln h1 h2
ln a.txt a.hard
mkfifo fifo
chmod 700 dmode
echo n > new.txt; mkdir newdir; echo nn > newdir/n
chmod o+w new.txt
"""
SCENARIO_PY = "import os\nos.setxattr('x.txt', 'user.k', b'v')\nos.setxattr('new.txt', 'user.n', b'1')\n"
#: read_changes() of the scenario.
SCENARIO_CHANGES = {
    "added": ["a.hard", "c2.txt", "f2d/in", "fifo", "h1", "h2", "mvdir2", "mvdir2/p", "mvdir2/q", "mvdir2/q/r",
              "new.txt", "newdir", "newdir/n", "newlink"],
    "modified": ["a.txt", "chmod.txt", "d2f", "dmode", "f2d", "link", "opq/o1", "setuid.bin", "x.txt"],
    "deleted": ["b.txt", "c.txt", "dir1/x", "mvdir", "opq/o2", "opq/od/x", "tree"],
}


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
