"""Images and root filesystems: import (OCI archive, layout dir, docker save), run, defaults, ls/rm,
progress, writable root, records and replay; as root and as an unprivileged user.

The test image is built here with umoci from a busybox-static tree (no network); every store is
a temp dir.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import pty
import pwd
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import imagekit
import pytest

import lowlevel
from lowlevel.image import STORE_ENV, ImageStore
from lowlevel.rootfs.resolve import resolve
from lowlevel.record import RecordError, replay

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]

RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def archives() -> Iterator[dict[str, pathlib.Path]]:
    imagekit.need_tools()
    work = imagekit.public_tmpdir("bbimage-")
    try:
        yield imagekit.busybox_image(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[ImageStore]:
    """A temp store, the default of this process's Policies."""
    path = imagekit.public_tmpdir("imgstore-")
    monkeypatch.setenv(STORE_ENV, str(path))
    try:
        yield ImageStore(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def bb(store: ImageStore, archives: dict[str, pathlib.Path]) -> lowlevel.Policy:
    store.import_archive(archives["oci"])
    return lowlevel.Policy(image="bbtest:1")


class Who:
    """Runs the ``lowlevel`` CLI as root (in a subprocess) or as the unprivileged test user."""

    def __init__(self, identity: str, user: pwd.struct_passwd | None) -> None:
        self.identity = identity
        self.user = user
        self.store = imagekit.user_store(user)

    def cli(self, *args: str, check: bool = True, stderr_tty: int | None = None) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "lowlevel", *args]
        home = self.user.pw_dir if self.user else os.path.expanduser("~")
        if self.user is not None:
            argv = [RUNUSER, "-u", self.user.pw_name, "--", *argv]
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": home, "LANG": "C.UTF-8",
               STORE_ENV: str(self.store)}
        proc = subprocess.run(argv, capture_output=stderr_tty is None, stdout=subprocess.PIPE if stderr_tty else None,
                              stderr=stderr_tty, text=True, timeout=200, env=env, cwd="/")
        if check and proc.returncode != 0:
            raise AssertionError(f"{args} exited {proc.returncode}: {proc.stderr}")
        return proc


@pytest.fixture(params=["root", "user"] if IS_ROOT else ["self"])
def who(request: pytest.FixtureRequest) -> Iterator[Who]:
    user = request.getfixturevalue("test_user") if request.param == "user" else None
    w = Who(request.param, user)
    try:
        yield w
    finally:
        shutil.rmtree(w.store, ignore_errors=True)


# --- import and run, both identities --------------------------------------------------------------

def test_import_then_run_with_image_defaults(who: Who, archives: dict[str, pathlib.Path]) -> None:
    proc = who.cli("image", "import", str(archives["oci"]))
    assert "imported bbtest:1 sha256:" in proc.stdout
    assert "\r" not in proc.stderr and "unpacking" not in proc.stderr  # not a terminal: no progress
    listing = who.cli("image", "ls").stdout.splitlines()
    assert listing[0].split() == ["NAME", "ID", "DIGEST", "LAYERS", "SIZE", "LAST", "USED", "IMPORTED"]
    assert listing[1].startswith("bbtest:1 ")
    # No command: the image's Cmd (cat /app/hello.txt), in its WorkingDir, with its Env.
    proc = who.cli("run", "--rm", "--image", "bbtest:1")
    assert proc.stdout == "hello from the image\n"
    proc = who.cli("run", "--rm", "--image", "bbtest:1", "--env", "SHADOWED=cli", "--",
                   "/bin/sh", "-c", "echo $GREETING $SHADOWED $(pwd) $(id -u):$(id -g); ls /usr 2>&1; "
                   "touch /bin/x 2>&1; test -e /usr/bin/python3 || echo no-host-python")
    lines = proc.stdout.splitlines()
    assert lines[0] == "from-image cli /app 0:0"  # image Env; explicit env wins; WorkingDir; User "" = root
    assert "No such file" in lines[1]              # no host /usr: the image has none
    assert "Read-only file system" in lines[2]
    assert lines[3] == "no-host-python"
    # --writable-root: the whole tree takes writes (the anchor's overlay, /bin included, files the
    # image's root owns too), for this run only; the store's tree is untouched.
    proc = who.cli("run", "--rm", "--image", "bbtest:1", "--writable-root", "--", "/bin/sh", "-c",
                   "echo scratch > /var/tmp/a && cat /var/tmp/a; touch /bin/b && echo rw; "
                   "echo changed >> /app/hello.txt && tail -1 /app/hello.txt")
    assert proc.stdout.split() == ["scratch", "rw", "changed"], proc.stderr
    proc = who.cli("run", "--rm", "--image", "bbtest:1", "--writable-root", "--", "/bin/sh", "-c",
                   "ls /bin/b 2>/dev/null || echo gone; cat /app/hello.txt")
    assert proc.stdout == "gone\nhello from the image\n", proc.stderr
    # The store's tree: owned by the caller, no group/other write anywhere.
    image = json.loads(who.cli("image", "inspect", "bbtest:1").stdout)
    rootfs = pathlib.Path(image["rootfs"])
    uid = who.user.pw_uid if who.user else os.getuid()
    for p in [rootfs, *rootfs.rglob("*")]:
        st = p.lstat()
        assert st.st_uid == uid, p
        if not p.is_symlink():
            assert not st.st_mode & 0o022, p
    # rm: the name, then the image and its tree.
    assert who.cli("image", "rm", "bbtest:1").stdout.split() == ["untagged:", "bbtest:1", "deleted:", image["id"]]
    assert not rootfs.exists()
    assert who.cli("image", "ls").stdout.splitlines()[1:] == []
    assert who.cli("run", "--image", "bbtest:1", "--", "/bin/true", check=False).returncode == 125


def test_run_image_without_command_fails_in_one_line(who: Who) -> None:
    """``run --image REF`` with no COMMAND takes the image's Entrypoint+Cmd: a missing image is
    one line and exit 125 (the same as with a command), never a traceback; --json gives the error object."""
    for json_flag in ((), ("--json",)):
        proc = who.cli("run", *json_flag, "--rm", "--image", "nosuch:1", check=False)
        assert proc.returncode == 125, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr.splitlines() == [proc.stderr.strip()] and "no image 'nosuch:1'" in proc.stderr
        if json_flag:
            err = json.loads(proc.stdout)
            assert (err["error"], err["exit_status"]) == ("ImageError", 125)


def test_short_id_prefix_is_refused_with_the_rule(bb: lowlevel.Policy, store: ImageStore) -> None:
    """``image rm``/``inspect``/``Policy(image=)`` take an id prefix of 12+ hex digits (what ``image ls``
    shows); a shorter one says so instead of only "no image"."""
    short_id = store.get("bbtest:1").id[7:19]
    assert store.get(short_id).id.startswith("sha256:" + short_id)
    with pytest.raises(lowlevel.ImageError, match="at least 12 hex digits"):
        store.get(short_id[:4])
    with pytest.raises(lowlevel.ImageError) as err:
        store.get("nosuch:1")
    assert "hex digits" not in str(err.value)


def test_a_pinned_reference_must_match_its_digest(bb: lowlevel.Policy, store: ImageStore) -> None:
    """``NAME@sha256:DIGEST`` ran whatever NAME pointed to and ``image rm NAME@sha256:WRONG``
    removed NAME (the digest was dropped: found by a fresh-user trial). Now the digest is
    checked: the manifest digest or the id pins it; another digest is refused by ``get``,
    ``Policy(image=)`` (a PolicyError, as every bad image reference there) and ``image rm`` (which then keeps the name); a malformed one too."""
    img = store.get("bbtest:1")
    assert store.get(f"bbtest:1@{img.manifest_digest}").id == img.id
    assert store.get(f"bbtest:1@{img.id}").id == img.id
    wrong = "sha256:" + "0" * 64
    with pytest.raises(lowlevel.ImageError, match="is not sha256:0+ .*import the image with that digest"):
        store.get(f"bbtest:1@{wrong}")
    for bad in ("bbtest:1@sha256:1234", "bbtest:1@md5:" + "0" * 32, f"@{wrong}"):
        with pytest.raises(lowlevel.ImageError, match="pinned reference is NAME"):
            store.get(bad)
    with pytest.raises(lowlevel.PolicyError, match="is not sha256:0+"):
        lowlevel.run(["true"], policy=lowlevel.Policy(image=f"bbtest:1@{wrong}"))
    assert lowlevel.run(["true"], policy=lowlevel.Policy(image=f"bbtest:1@{img.manifest_digest}")).exit_code == 0
    with pytest.raises(lowlevel.ImageError, match="is not sha256:0+"):
        store.remove(f"bbtest:1@{wrong}")
    assert store.get("bbtest:1").id == img.id, "a refused rm removed the name"


DAMAGES = {
    "no config": lambda d: d.pop("config"),
    "rootfs null": lambda d: d.update(rootfs=None),
    "user_ids strings": lambda d: d["config"].update(user_ids=["a", "b"]),
    "a layer of another shape": lambda d: d.update(layers=[{"nope": 1}]),
    "sha256 a number": lambda d: d["rootfs"].update(sha256=1),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_image_json_is_skipped_and_removable(bb: lowlevel.Policy, store: ImageStore, damage: str) -> None:
    """An ``image.json`` that is valid JSON of the wrong shape made ``image ls``, ``inspect``, a
    run and even ``image rm`` end in a KeyError/TypeError traceback, for the whole store (a
    fresh-user trial). Now the entry is skipped with one warning naming the fix, a run of it is
    one PolicyError, and ``image rm NAME`` removes it. Control: the same store lists it before."""
    img = store.get("bbtest:1")
    assert [i.id for i in store.list_images()] == [img.id]
    path = pathlib.Path(store.image_dir(img.id)) / "image.json"
    doc = json.loads(path.read_text())
    DAMAGES[damage](doc)
    path.write_text(json.dumps(doc))
    assert store.list_images() == []
    with pytest.raises(lowlevel.ImageError, match="is damaged: remove it"):
        store.get("bbtest:1")
    with pytest.raises(lowlevel.PolicyError, match="is damaged"):
        lowlevel.run(["true"], policy=bb)
    env = {**os.environ, STORE_ENV: str(store.path)}
    ls = subprocess.run([sys.executable, "-m", "lowlevel", "image", "ls"], capture_output=True, text=True, env=env,
                        timeout=60)
    assert ls.returncode == 0 and "Traceback" not in ls.stderr and "image.json is damaged" in ls.stderr, ls.stderr
    rm = subprocess.run([sys.executable, "-m", "lowlevel", "image", "rm", "bbtest:1"], capture_output=True, text=True,
                        env=env, timeout=60)
    assert rm.returncode == 0 and f"deleted: {img.id} (damaged)" in rm.stdout, rm.stdout + rm.stderr
    assert not pathlib.Path(store.image_dir(img.id)).exists()


def test_a_policy_whose_image_was_removed_says_so(bb: lowlevel.Policy, store: ImageStore,
                                                  archives: dict[str, pathlib.Path]) -> None:
    """A Policy resolved once (cached) kept running on its image's tree after ``image rm``: the
    next run said "true: command not found" (a fresh-user trial). Now its next run looks the
    name up again: the store's "no image" error while it is gone, the new image once the name
    is imported again. Control: the first run works."""
    assert lowlevel.run(["true"], policy=bb).exit_code == 0
    store.remove("bbtest:1")
    with pytest.raises(lowlevel.PolicyError, match="no image 'bbtest:1' in the store .*import it"):
        lowlevel.run(["true"], policy=bb)
    store.import_archive(archives["oci"])
    assert lowlevel.run(["true"], policy=bb).exit_code == 0


def test_a_session_whose_image_was_removed_says_so(bb: lowlevel.Policy, store: ImageStore) -> None:
    """``image rm`` of the image a live Session runs on: its next command failed with "the
    working directory resolves outside the sandbox (CVE-2024-21626 class)" (a fresh-user trial),
    an alarm about the wrong thing. Now the error says the image was removed. Control: a command
    before the removal runs."""
    with lowlevel.Session(policy=bb) as s:
        assert s.run(["true"]).exit_code == 0
        store.remove("bbtest:1")
        with pytest.raises(lowlevel.LowlevelError) as err:
            r = s.run(["true"])
            raise AssertionError(f"ran on a removed image: {r}")
    assert "image" in str(err.value) and "removed" in str(err.value), err.value
    assert "CVE" not in str(err.value), err.value


def test_prune_removes_the_images_no_name_points_to(bb: lowlevel.Policy, store: ImageStore,
                                                    tmp_path: pathlib.Path) -> None:
    """An import under a name another image had leaves that one ``<none>``, and there was no
    way to remove such images but by id (a fresh-user trial). ``image prune`` removes exactly
    them; control: the named image stays and runs."""
    old = store.get("bbtest:1")
    work = imagekit.public_tmpdir("prune-")
    try:
        layout = imagekit.write_layout(work / "layout", [imagekit.layer([{"name": "f", "data": b"new"}])])
        new = store.import_archive(layout, name="bbtest:1")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert new.id != old.id and {i.id: i.names for i in store.list_images()} == {new.id: ("bbtest:1",), old.id: ()}
    env = {**os.environ, STORE_ENV: str(store.path)}
    out = subprocess.run([sys.executable, "-m", "lowlevel", "image", "prune"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["deleted:", old.id], out.stdout + out.stderr
    assert [i.id for i in store.list_images()] == [new.id]
    assert store.prune() == []


def test_all_formats_import_and_the_same_image_unpacks_once(store: ImageStore,
                                                             archives: dict[str, pathlib.Path]) -> None:
    a = store.import_archive(archives["oci"])
    b = store.import_archive(archives["layout"], name="from-layout")
    assert b.id == a.id and set(b.names) == {"bbtest:1", "from-layout:latest"}
    d1 = store.import_archive(archives["docker"])
    d2 = store.import_archive(archives["docker_gz"], name="gz:1")
    # docker save holds no manifest blob: skopeo writes a fresh one, and a docker config (other id).
    assert d1.id == d2.id and d1.rootfs_sha256 == a.rootfs_sha256
    ino = os.stat(a.rootfs).st_ino
    again = store.import_archive(archives["oci"])
    assert again.id == a.id and os.stat(again.rootfs).st_ino == ino and again.imported_at == a.imported_at
    assert os.listdir(store.tmp_dir) == []
    assert sorted(i.id for i in store.list_images()) == sorted({a.id, d1.id})


def test_image_user_and_explicit_ids(store: ImageStore) -> None:
    imagekit.need_tools()
    work = imagekit.public_tmpdir("bbuser-")
    try:
        arch = imagekit.busybox_image(work, name="bbuser", user="app")
        store.import_archive(arch["oci"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = lowlevel.run(["/bin/sh", "-c", "id -u; id -g"], policy=lowlevel.Policy(image="bbuser:1"))
    assert r.stdout == b"1234\n2345\n"
    r = lowlevel.run(["/bin/sh", "-c", "id -u; id -g"],
                     policy=lowlevel.Policy(image="bbuser:1", sandbox_uid=7, sandbox_gid=8))
    assert r.stdout == b"7\n8\n"


def test_policy_pins_the_image_and_replace_is_stable(bb: lowlevel.Policy, store: ImageStore) -> None:
    """A Policy names the image; the run's plan (resolve) pins it. Building one reads no store."""
    import dataclasses
    img = store.get("bbtest:1")
    assert bb.image == "bbtest:1" and bb.rootfs is None  # data: nothing read yet
    stamp = os.path.join(store.image_dir(img.id), "last-used")
    os.utime(stamp, (0, 0))
    lowlevel.Policy(image="bbtest:1")
    assert os.stat(stamp).st_mtime == 0  # building a Policy does not stamp the image's last use
    planned = resolve(bb)
    assert os.stat(stamp).st_mtime > 0  # planning a run on it does
    assert planned.image == img.id and planned.rootfs == img.rootfs and planned.workdir == "/app"
    assert resolve(bb) is planned and resolve(planned) is planned  # once per Policy object
    assert dataclasses.replace(planned, network=True).rootfs == img.rootfs
    assert resolve(dataclasses.replace(planned, network=True)) == dataclasses.replace(planned, network=True)
    assert resolve(lowlevel.Policy(image=img.id[:19])) == planned == resolve(lowlevel.Policy(image=img.short_id))
    missing = lowlevel.Policy(image="nothere:1")  # the errors come when a run is planned
    with pytest.raises(lowlevel.PolicyError, match="no image 'nothere:1' in the store .*lowlevel image import"):
        lowlevel.run(["/bin/true"], policy=missing)
    with pytest.raises(lowlevel.PolicyError, match="not both"):
        lowlevel.run(["/bin/true"], policy=lowlevel.Policy(image="bbtest:1", rootfs="/tmp"))


def test_exec_precheck_resolves_inside_the_image(bb: lowlevel.Policy, store: ImageStore) -> None:
    with pytest.raises(lowlevel.ExecError) as err:
        lowlevel.run(["python3", "-c", "pass"], policy=bb)  # the host has python3, the image does not
    assert err.value.errno == errno.ENOENT
    with pytest.raises(lowlevel.ExecError) as err:
        lowlevel.run(["/app/hello.txt"], policy=bb)
    assert err.value.errno == errno.EACCES
    # /bin/sh -> busybox is a symlink resolved inside the tree, not on the host.
    assert lowlevel.run(["sh", "-c", "exit 3"], policy=bb).exit_code == 3


def test_session_on_an_image(bb: lowlevel.Policy) -> None:
    with lowlevel.Session(policy=bb) as s:
        assert s.run(["cat", "hello.txt"]).stdout == b"hello from the image\n"
        assert s.run(["pwd"], cwd="/workspace").stdout == b"/workspace\n"


def test_rootfs_directory_without_an_image(tmp_path: pathlib.Path) -> None:
    imagekit.need_tools()
    tree = imagekit.busybox_tree(imagekit.public_tmpdir("bbtree-") / "root")
    tree.parent.chmod(0o755)
    try:
        r = lowlevel.run(["/bin/sh", "-c", "cat /app/hello.txt; ls /"], policy=lowlevel.Policy(rootfs=str(tree)))
        assert r.exit_code == 0 and r.stdout.startswith(b"hello from the image\n")
        assert b"workspace" in r.stdout and b"usr" not in r.stdout.split()
        os.unlink(tree / "etc" / "group")
        with pytest.raises(lowlevel.PolicyError, match="no regular file etc/group.*touch"):
            lowlevel.run(["/bin/true"], policy=lowlevel.Policy(rootfs=str(tree)))  # checked at plan time
        os.unlink(tree / "etc" / "passwd")  # both missing: one message names both, one touch fixes them
        with pytest.raises(lowlevel.PolicyError, match="no regular file etc/passwd and etc/group.*touch "
                           f"{tree}/etc/passwd {tree}/etc/group"):
            lowlevel.run(["/bin/true"], policy=lowlevel.Policy(rootfs=str(tree)))
    finally:
        shutil.rmtree(tree.parent, ignore_errors=True)
    with pytest.raises(lowlevel.PolicyError, match="host's root directory"):
        lowlevel.run(["/bin/true"], policy=lowlevel.Policy(rootfs="/"))
    with pytest.raises(lowlevel.PolicyError, match="needs a rootfs or an image"):
        lowlevel.Policy(rootfs_writable=True)


def test_writable_root_is_per_run(bb: lowlevel.Policy) -> None:
    """rootfs_writable: the anchor overlays the whole tree (system paths included), the run's
    writes are discarded after it, and the image's own tree never changes."""
    import dataclasses
    policy = resolve(dataclasses.replace(bb, rootfs_writable=True))
    assert policy.rootfs is not None
    before = sorted(os.listdir(os.path.join(policy.rootfs, "bin")))
    script = ("echo x > /var/tmp/a && echo y > /home/b && cat /var/tmp/a /home/b; touch /bin/c && echo made c; "
              "cp /bin/busybox /etc/x && echo copied")
    r = lowlevel.run(["/bin/sh", "-c", script], policy=policy)
    assert r.stdout.splitlines() == [b"x", b"y", b"made c", b"copied"], r
    assert any("root filesystem: copy-on-write overlay" in n for n in r.notes)
    r = lowlevel.run(["/bin/sh", "-c", "ls -A /var/tmp /home /etc; ls /bin"], policy=policy)
    out = r.stdout.split()
    assert b"a" not in out and b"b" not in out and b"x" not in out and b"c" not in out  # discarded
    assert sorted(os.listdir(os.path.join(policy.rootfs, "bin"))) == before  # the image is untouched
    assert not os.path.exists(os.path.join(policy.rootfs, "etc", "x"))
    r = lowlevel.run(["/bin/sh", "-c", "echo x > /var/tmp/a"], policy=bb)
    assert r.exit_code != 0  # without it, read-only
    # A Session keeps its root's writes for its life (Landlock included), like its workspace's.
    with lowlevel.Session(policy=policy) as s:
        assert s.run(["/bin/sh", "-c", "touch /bin/s && echo ok"]).stdout == b"ok\n"
        assert s.run(["/bin/sh", "-c", "ls /bin/s"]).exit_code == 0
    assert not os.path.exists(os.path.join(policy.rootfs, "bin", "s"))


def test_rootfs_dir_swapped_for_symlink_binds_no_host_dir(bb: lowlevel.Policy) -> None:
    """A top-level directory of the tree replaced by a symlink to a host directory after a run
    (the layout is cached per process) is not bound from the host: writable or not, the sandbox
    sees the symlink, never the host directory behind it (was bound read-write with a writable
    root: the sandbox wrote into the host directory)."""
    image_tree = resolve(bb).rootfs
    assert image_tree is not None
    base = imagekit.public_tmpdir("swaptree-")
    try:
        tree, host = base / "tree", base / "hostdir"
        shutil.copytree(image_tree, tree, symlinks=True)
        host.mkdir()
        host.chmod(0o777)  # the sandbox's uid could write there if it were bound
        for writable in (False, True):  # caches the layout with home/ a directory
            r = lowlevel.run(["/bin/sh", "-c", "ls -d /home"], policy=lowlevel.Policy(rootfs=str(tree),
                                                                                   rootfs_writable=writable))
            assert r.exit_code == 0, r
        shutil.rmtree(tree / "home")
        (tree / "home").symlink_to(host)
        for writable in (False, True):
            policy = lowlevel.Policy(rootfs=str(tree), rootfs_writable=writable)
            r = lowlevel.run(["/bin/sh", "-c", f"echo x > /home/probe{int(writable)}; echo rc=$?"], policy=policy)
            assert b"rc=0" not in r.stdout, r
        assert list(host.iterdir()) == []
        (host / "control").write_text("x")  # control: the directory itself takes writes
        assert (host / "control").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_writable_root_is_bounded_by_workspace_bytes(bb: lowlevel.Policy) -> None:
    import dataclasses
    policy = dataclasses.replace(bb, rootfs_writable=True, limits=lowlevel.Limits(workspace_bytes=1 << 20))
    r = lowlevel.run(["/bin/sh", "-c", "dd if=/dev/zero of=/bin/big bs=64k count=64 2>&1; echo rc=$?"],
                     policy=policy)
    assert b"No space left" in r.stdout and b"rc=0" not in r.stdout, r.stdout


def test_writable_root_fallback_without_overlay(bb: lowlevel.Policy, monkeypatch: pytest.MonkeyPatch) -> None:
    """No overlay (LOWLEVEL_NO_OVERLAY=1): the empty scratch dirs are tmpfs, /bin stays read-only."""
    import dataclasses
    monkeypatch.setenv("LOWLEVEL_NO_OVERLAY", "1")
    policy = dataclasses.replace(bb, rootfs_writable=True)
    script = "echo x > /var/tmp/a && echo y > /home/b && cat /var/tmp/a /home/b; touch /bin/c 2>&1"
    r = lowlevel.run(["/bin/sh", "-c", script], policy=policy)
    assert r.stdout.splitlines()[:2] == [b"x", b"y"] and b"Read-only" in r.stdout
    assert "--tmpfs" in r.argv and "/var/tmp" in r.argv


# --- progress -----------------------------------------------------------------------------------

def _on_a_tty(who: Who, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the CLI with stderr on a pseudo-terminal; return the process and what the terminal got."""
    master, slave = pty.openpty()
    shown = b""
    try:
        if who.user is not None:
            os.chown(os.ttyname(slave), who.user.pw_uid, -1)
        proc = who.cli(*args, stderr_tty=slave)
        while select.select([master], [], [], 0.2)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(slave)
        os.close(master)
    return proc, shown.decode()


def test_progress_on_a_terminal(who: Who, archives: dict[str, pathlib.Path]) -> None:
    """A progress line on a terminal; none with --quiet (none off a terminal: the test above)."""
    proc, text = _on_a_tty(who, "image", "import", str(archives["oci"]))
    assert "checking [" in text and "layer 1/1" in text and "unpacking [" in text and "MiB" in text, text
    assert proc.stdout.startswith("imported bbtest:1")
    proc, text = _on_a_tty(who, "image", "import", "--quiet", str(archives["oci"]))
    assert proc.stdout.startswith("sha256:") and text == ""


# --- records and replay ---------------------------------------------------------------------------

def test_record_names_the_image_and_replay_checks_it(bb: lowlevel.Policy, store: ImageStore,
                                                     tmp_path: pathlib.Path) -> None:
    rec = tmp_path / "run.json"
    ws = imagekit.public_tmpdir("ws-")
    try:
        r = lowlevel.run(["/bin/sh", "-c", "cat /app/hello.txt > out.txt"], policy=bb, workspace=ws, cwd="/workspace",
                         record=rec)
        assert r.exit_code == 0
    finally:
        shutil.rmtree(ws, ignore_errors=True)
    doc = json.loads(rec.read_text())
    img = store.get("bbtest:1")
    assert doc["rootfs"] == {"path": img.rootfs, "sha256": img.rootfs_sha256,
                             "image": {"id": img.id, "manifest_digest": img.manifest_digest, "names": ["bbtest:1"]}}
    assert doc["policy"]["image"] == img.id and doc["policy"]["rootfs"] is None
    assert replay(rec).matched
    # The tree changed since the record (another lowlevel, or damage): refused, with the fix.
    meta = pathlib.Path(store.image_dir(img.id)) / "image.json"
    saved = meta.read_text()
    meta.write_text(saved.replace(img.rootfs_sha256, "0" * 64))
    with pytest.raises(RecordError, match=f"unpacks to {'0' * 64}.*lowlevel image rm {img.id}"):
        replay(rec)
    meta.write_text(saved)
    # The image is gone: refused, naming it and how to get it back.
    store.remove(img.id)
    with pytest.raises(RecordError, match=f"ran on image {img.id} \\(bbtest:1.*not in the image store.*image import"):
        replay(rec)


def test_record_of_a_bare_rootfs_checks_its_hash(tmp_path: pathlib.Path) -> None:
    imagekit.need_tools()
    base = imagekit.public_tmpdir("bbtree-")
    tree = imagekit.busybox_tree(base / "root")
    rec = tmp_path / "run.json"
    try:
        lowlevel.run(["/bin/true"], policy=lowlevel.Policy(rootfs=str(tree)), record=rec)
        doc = json.loads(rec.read_text())
        assert doc["rootfs"]["image"] is None and len(doc["rootfs"]["sha256"]) == 64
        with pytest.raises(RecordError, match="(?s)looser than the default.*rootfs /tmp"):
            replay(rec)  # a record naming a host directory is untrusted
        assert replay(rec, trust_policy=True).matched
        (tree / "app" / "hello.txt").write_text("changed\n")
        with pytest.raises(RecordError, match="now hashes to"):
            replay(rec, trust_policy=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- store and doctor --------------------------------------------------------------------------

def test_store_refuses_unsafe_locations_and_bad_names(tmp_path: pathlib.Path, archives: dict[str, Any]) -> None:
    shared = imagekit.public_tmpdir("shared-")
    try:
        shared.chmod(0o777)
        with pytest.raises(lowlevel.LowlevelError, match="not writable by others"):
            ImageStore(shared).import_archive(archives["oci"])
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    st = ImageStore(imagekit.public_tmpdir("imgstore-"))
    try:
        with pytest.raises(lowlevel.LowlevelError, match="invalid image name"):
            st.import_archive(archives["oci"], name="Bad Name")
        with pytest.raises(lowlevel.LowlevelError, match="no such file"):
            st.import_archive(tmp_path / "missing.tar")
        (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
        with pytest.raises(lowlevel.LowlevelError, match="refusing junk.tar: it is not a readable tar"):
            st.import_archive(tmp_path / "junk.tar")
        assert os.listdir(st.images_dir) == [] and os.listdir(st.tmp_dir) == []
    finally:
        shutil.rmtree(st.path, ignore_errors=True)


def test_doctor_reports_tools_and_store(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    from lowlevel.image import doctor_checks
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    checks = {c["name"]: c for c in doctor_checks()}
    assert checks["skopeo"]["ok"] == (shutil.which("skopeo") is not None)
    assert checks["umoci"]["ok"] == (shutil.which("umoci") is not None)
    assert str(tmp_path / "store") in checks["image store"]["detail"]


def test_layer_without_end_blocks_imports_like_go_tar_reads_it(store: ImageStore, tmp_path: pathlib.Path) -> None:
    """``umoci insert`` writes layers without the end-of-archive blocks or the last file's padding;
    Go's archive/tar (umoci, containerd) reads them, and so must the import."""
    imagekit.need_tools()
    work = imagekit.public_tmpdir("short-")
    try:
        tar = imagekit.layer([{"name": "etc", "type": "dir"}, {"name": "etc/passwd", "data": b"root:x:0:0::/:/x\n"},
                              {"name": "etc/group", "data": b"root:x:0:\n"}, {"name": "last.txt", "data": b"15 bytes here\n"}])
        end = len(tar.rstrip(b"\0"))
        short = tar[:end]
        assert len(short) % 512 != 0
        layout = imagekit.write_layout(work / "layout", [short])
        img = store.import_archive(imagekit.oci_archive(layout, work / "short.tar"))
        assert (pathlib.Path(img.rootfs) / "last.txt").read_bytes() == b"15 bytes here\n"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_benchmark_task_example_runs() -> None:
    imagekit.need_tools()
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "examples" / "benchmark_task.py")], capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS tab" in proc.stdout and "4. replay: outputs match" in proc.stdout
    assert "without the image, replay refuses" in proc.stdout


def test_setid_bits_and_devices_neutralised_for_both_callers(who: Who) -> None:
    imagekit.need_tools()
    work = imagekit.public_tmpdir("hostile-")
    try:
        archive = imagekit.hostile_archive(work, "mixed", [
            {"name": "bin", "type": "dir"}, {"name": "bin/su", "data": b"#!/bin/sh\n", "mode": 0o4755},
            {"name": "dev", "type": "dir"}, {"name": "dev/mem", "type": "char", "dev": (1, 1), "mode": 0o666},
            {"name": "wide", "data": b"x", "mode": 0o666}])
        proc = who.cli("image", "import", "--name", "mixed:1", str(archive))
        assert "1 device node in the layers: dropped" in proc.stderr
        img = json.loads(who.cli("image", "inspect", "mixed:1").stdout)
        root = pathlib.Path(img["rootfs"])
        assert oct((root / "bin" / "su").stat().st_mode & 0o7777) == oct(0o755)
        assert oct((root / "wide").stat().st_mode & 0o7777) == oct(0o644)
        assert not (root / "dev" / "mem").exists()
        bad = who.cli("image", "import", str(imagekit.hostile_archive(work, "bad", [
            {"name": "../../escape", "data": b"x"}])), check=False)
        assert bad.returncode == 125 and bad.stderr.count("\n") == 1 and "'..' component" in bad.stderr
        assert who.cli("image", "ls").stdout.count("\n") == 2  # header + mixed:1: nothing partial
    finally:
        shutil.rmtree(work, ignore_errors=True)
