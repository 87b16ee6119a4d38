"""Root filesystem trees: argv (golden), path resolution inside the tree, the tree hash, names."""

from __future__ import annotations

import os
import pathlib
import tempfile
from collections.abc import Iterator

import pytest

import lowlevel
from lowlevel.sandbox.argv import Fds, HostFacts, build_argv
from lowlevel.image import ImageError, normalize_name
from lowlevel.host.probe import BwrapInfo, HostLayout
from lowlevel.rootfs import resolve_in_root, rootfs_layout, tree_sha256
from lowlevel.rootfs.resolve import resolve

INFO = BwrapInfo(path="/usr/bin/bwrap", version=(0, 8, 0), setuid=False,
                 options=frozenset({"--disable-userns", "--size", "--json-status-fd", "--block-fd", "--args"}))
INFO_09 = BwrapInfo(path="/usr/bin/bwrap", version=(0, 9, 0), setuid=False,
                    options=INFO.options | {"--overlay-src", "--tmp-overlay", "--ro-overlay", "--overlay"})
LAYOUT = HostLayout(symlinks=(("usr/bin", "/bin"),), ro_dirs=(), etc_files=("/etc/ld.so.cache",))


def facts(info: BwrapInfo = INFO) -> HostFacts:
    return HostFacts(bwrap=info, layout=LAYOUT, caller_is_root=False,
                     network_etc=(("/run/resolv.conf", "/etc/resolv.conf"), ("/etc/hosts", "/etc/hosts"),
                                  ("/etc/ssl", "/etc/ssl")))


@pytest.fixture
def tree() -> Iterator[pathlib.Path]:
    """A merged-usr tree: usr/{bin,lib}, bin -> usr/bin, etc with passwd/group/hosts, empty var/tmp
    and home, a file at the top, and entries the sandbox provides itself (proc, tmp, workspace)."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="rootfs-", dir="/tmp"))
    base.chmod(0o755)
    root = base / "root"
    for d in ("usr/bin", "usr/lib", "etc", "var/tmp", "home", "opt/tool", "proc", "tmp", "workspace"):
        (root / d).mkdir(parents=True)
    os.symlink("usr/bin", root / "bin")
    os.symlink("/usr/lib", root / "lib")
    for f in ("etc/passwd", "etc/group", "etc/hosts"):
        (root / f).write_text("")
    (root / "usr/bin/tool").write_text("#!/bin/sh\n")
    (root / "usr/bin/tool").chmod(0o755)
    os.symlink("/usr/bin/tool", root / "usr/bin/alias")
    os.symlink("../../etc/passwd", root / "usr/lib/up")
    os.symlink("/proc/self/exe", root / "usr/bin/viaproc")
    (root / ".dockerenv").write_text("")
    try:
        yield root
    finally:
        import shutil
        shutil.rmtree(base)


def test_layout_skips_what_the_sandbox_provides(tree: pathlib.Path) -> None:
    layout = rootfs_layout(str(tree))
    assert layout.dirs == ("etc", "home", "opt", "usr", "var")
    assert layout.files == (".dockerenv",)
    assert layout.symlinks == (("usr/bin", "/bin"), ("/usr/lib", "/lib"))
    assert layout.network_etc == ("etc/hosts",)  # no etc/resolv.conf in the tree: nothing to mount over
    assert layout.scratch_dirs == ("home", "var/tmp")


def test_golden_rootfs_argv(tree: pathlib.Path) -> None:
    p = lowlevel.Policy(rootfs=str(tree), network=True, limits=lowlevel.Limits(tmp_size_bytes=4096))
    argv = build_argv(p, facts(), workspace="/srv/ws", fds=Fds())
    start = argv.index("--hostname") + 2
    end = argv.index("--proc")
    r = str(tree)
    assert argv[start:end] == [
        "--ro-bind", f"{r}/etc", "/etc", "--ro-bind", f"{r}/home", "/home", "--ro-bind", f"{r}/opt", "/opt",
        "--ro-bind", f"{r}/usr", "/usr", "--ro-bind", f"{r}/var", "/var",
        "--ro-bind", f"{r}/.dockerenv", "/.dockerenv",
        "--symlink", "usr/bin", "/bin", "--symlink", "/usr/lib", "/lib",
        "--ro-bind", "/etc/hosts", "/etc/hosts",  # host resolution over the tree's own (network=True)
    ]
    assert "/etc/ld.so.cache" not in argv and "/etc/ssl" not in argv  # nothing of the host's system
    assert argv[argv.index("--proc"):argv.index("--proc") + 4] == ["--proc", "/proc", "--dev", "/dev"]
    assert ["--bind", "/srv/ws", "/workspace"] == argv[argv.index("/srv/ws") - 1:argv.index("/srv/ws") + 2]


def test_writable_root_fallback_and_overlay(tree: pathlib.Path) -> None:
    p = lowlevel.Policy(rootfs=str(tree), rootfs_writable=True, limits=lowlevel.Limits(tmp_size_bytes=8192))
    old = build_argv(p, facts(), workspace="/w", fds=Fds())
    assert "--tmp-overlay" not in old
    i, j = old.index("--symlink"), old.index("--proc")
    assert old[i + 6:j] == ["--size", "8192", "--tmpfs", "/home", "--size", "8192", "--tmpfs", "/var/tmp"]
    new = build_argv(p, facts(INFO_09), workspace="/w", fds=Fds())
    r = str(tree)
    assert ["--overlay-src", f"{r}/usr", "--tmp-overlay", "/usr"] == new[new.index(f"{r}/usr") - 1:
                                                                         new.index(f"{r}/usr") + 3]
    assert "--tmpfs" not in new[:new.index("--proc")]
    # The anchor's overlay (wherever the copy-on-write workspace works) comes first: each
    # top-level directory bound read-write from the merged tree.
    anchored = build_argv(p, facts(INFO_09), workspace="/w", fds=Fds(), rootfs_overlay="/run/lowlevel/mnt/root")
    assert ["--bind", "/run/lowlevel/mnt/root/usr", "/usr"] == anchored[anchored.index("/run/lowlevel/mnt/root/usr") - 1:
                                                                          anchored.index("/run/lowlevel/mnt/root/usr") + 2]
    assert "--tmp-overlay" not in anchored and "--tmpfs" not in anchored[:anchored.index("--proc")]


def test_resolve_in_root(tree: pathlib.Path) -> None:
    r = str(tree)
    never = lambda v: False  # noqa: E731
    assert resolve_in_root(r, "/bin/tool", never) == f"{r}/usr/bin/tool"
    assert resolve_in_root(r, "/usr/bin/alias", never) == f"{r}/usr/bin/tool"  # absolute link, inside the tree
    assert resolve_in_root(r, "/lib/up", never) == f"{r}/etc/passwd"
    assert resolve_in_root(r, "/../../../etc/passwd", never) == f"{r}/etc/passwd"  # '..' stops at the root
    assert resolve_in_root(r, "/usr/bin/missing", never) == ""
    assert resolve_in_root(r, "/etc/passwd/x", never) == ""
    assert resolve_in_root(r, "/usr/bin/viaproc", lambda v: v.startswith("/proc")) is None
    os.symlink("loop", tree / "loop")
    assert resolve_in_root(r, "/loop", never) is None


def test_policy_rootfs_validation(tree: pathlib.Path) -> None:
    p = lowlevel.Policy(rootfs=str(tree) + "/")
    assert p.rootfs == str(tree)
    with pytest.raises(lowlevel.PolicyError, match="absolute host path"):
        lowlevel.Policy(rootfs="relative/dir")
    with pytest.raises(lowlevel.PolicyError, match="not a directory"):  # the tree is read at plan time
        resolve(lowlevel.Policy(rootfs=str(tree / "etc" / "passwd")))
    with pytest.raises(lowlevel.PolicyError, match="workdir must be an absolute path"):
        lowlevel.Policy(workdir="app")
    assert lowlevel.Policy(workdir="/app/").workdir == "/app"


def test_a_policy_is_built_without_reading_the_host(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: building a Policy reads neither the image store nor the tree (a Policy is data);
    the run's plan (resolve) does, with the errors Policy(...) used to raise."""
    monkeypatch.setenv("LOWLEVEL_IMAGE_STORE", str(tmp_path / "no-store"))
    on_image = lowlevel.Policy(image="nosuch:1", rootfs_writable=True)
    on_tree = lowlevel.Policy(rootfs=str(tmp_path / "missing"))
    assert on_image.rootfs is None and on_tree.rootfs == str(tmp_path / "missing")
    with pytest.raises(lowlevel.PolicyError, match="no image 'nosuch:1' in the store"):
        resolve(on_image)
    with pytest.raises(lowlevel.PolicyError, match="does not exist on the host"):
        resolve(on_tree)
    assert not (tmp_path / "no-store").exists()  # looking an image up creates no store
    plain = lowlevel.Policy()
    assert resolve(plain) is plain  # no image, no rootfs: nothing to read


def test_tree_hash_covers_content_modes_and_links(tree: pathlib.Path) -> None:
    a = tree_sha256(str(tree))
    assert a.entries > 10 and a == tree_sha256(str(tree))
    (tree / "usr/bin/tool").write_text("#!/bin/sh\necho\n")
    b = tree_sha256(str(tree))
    assert b.sha256 != a.sha256
    (tree / "usr/bin/tool").chmod(0o700)
    c = tree_sha256(str(tree))
    assert c.sha256 != b.sha256
    os.unlink(tree / "usr/bin/alias")
    os.symlink("/elsewhere", tree / "usr/bin/alias")
    assert tree_sha256(str(tree)).sha256 != c.sha256
    os.utime(tree / "usr/bin/tool", (0, 0))  # times do not count
    d = tree_sha256(str(tree))
    os.utime(tree / "usr/bin/tool", (1e9, 1e9))
    assert tree_sha256(str(tree)) == d


def test_tree_hash_lines_parse_one_way(tmp_path: pathlib.Path) -> None:
    """A symlink target with an LF ended its line early: a target ``x LF b`` then a directory
    ``c`` hashed as a target ``x`` then a directory ``b LF c`` (a fresh-user trial). Both trees
    now hash apart; a tree without such a target hashes as before (the v1 lines, computed here)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir(mode=0o755)
    os.symlink("x\nb", a / "a")
    (a / "c").mkdir(mode=0o755)
    os.symlink("x", b / "a")
    (b / "b\nc").mkdir(mode=0o755)
    os.chmod(a / "c", 0o755)
    os.chmod(b / "b\nc", 0o755)
    assert tree_sha256(str(a)).sha256 != tree_sha256(str(b)).sha256
    import hashlib
    v1 = hashlib.sha256(b"a\x00symlink\x00777\x00x\n" + b"b\nc\x00dir\x00755\x00\n").hexdigest()
    assert tree_sha256(str(b)).sha256 == v1, "a tree without an LF in a target hashed differently than before"


@pytest.mark.parametrize("name,want", [
    ("busybox", "busybox:latest"), ("docker.io/library/python:3.12", "python:3.12"),
    ("ghcr.io/org/tool:v1", "ghcr.io/org/tool:v1"), ("localhost:5000/x", "localhost:5000/x:latest"),
    ("x:1@sha256:" + "a" * 64, "x:1"),
])
def test_normalize_name(name: str, want: str) -> None:
    assert normalize_name(name) == want


@pytest.mark.parametrize("name", ["", "Upper", "a b", "../x", "x:", "sha256:abc", "x:" + "t" * 200,
                                  "x\n:1\n", "x:1\n", "x\n"])  # a trailing newline: `$` matched before it
def test_bad_names(name: str) -> None:
    with pytest.raises(ImageError):
        normalize_name(name)


def test_a_tree_another_user_could_change_is_refused(tree: pathlib.Path) -> None:
    """Whoever may write the tree (or a non-sticky ancestor) could swap its ``usr`` for a symlink
    to a host directory between lowlevel's layout check and bwrap's bind: refused."""
    resolve(lowlevel.Policy(rootfs=str(tree)))  # control: owned by us, 0755 all the way up
    for victim, mode in ((tree, 0o777), (tree, 0o775), (tree.parent, 0o777)):
        old = victim.stat().st_mode & 0o7777
        victim.chmod(mode)
        try:
            with pytest.raises(lowlevel.PolicyError, match="could be changed by another user"):
                resolve(lowlevel.Policy(rootfs=str(tree)))  # checked when a run is planned
        finally:
            victim.chmod(old)
    tree.parent.chmod(0o1777)  # a sticky ancestor (like /tmp) is fine
    resolve(lowlevel.Policy(rootfs=str(tree)))
    tree.parent.chmod(0o755)


def test_a_dangling_etc_passwd_symlink_in_an_image_is_one_image_error(tmp_path: pathlib.Path) -> None:
    """An image whose /etc/passwd is a symlink to nothing (absolute, so resolved in the tree)
    made the import fail with FileExistsError out of the placeholder's O_EXCL create: a
    traceback. Now an ImageError naming it; nothing is created through the link. Control: the
    same tree without the link gets its empty placeholders."""
    from lowlevel.image.tree import ensure_placeholders
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    os.symlink("/nonexistent-lowlevel/passwd", root / "etc" / "passwd")
    with pytest.raises(ImageError, match="/etc/passwd is a dangling symlink"):
        ensure_placeholders(str(root))
    assert not os.path.exists("/nonexistent-lowlevel")
    os.unlink(root / "etc" / "passwd")
    notes = ensure_placeholders(str(root))
    assert (root / "etc" / "passwd").is_file() and any("/etc/passwd" in n for n in notes), notes


def test_a_record_with_a_rootfs_entry_but_no_rootfs_in_its_policy_is_refused_in_words() -> None:
    """Replay of such a hand-edited record ended in a bare ``AssertionError:`` (rc 125)."""
    from lowlevel.rootfs.store import check_record_rootfs
    with pytest.raises(ImageError, match="runs on no rootfs and no image"):
        check_record_rootfs({"path": "/", "sha256": "0" * 64}, lowlevel.Policy())
    check_record_rootfs(None, lowlevel.Policy())  # control: no entry, nothing to check


def test_a_workdir_behind_a_symlink_is_not_made_and_says_blocked(tmp_path: pathlib.Path) -> None:
    """An image's WorkingDir under an absolute symlink (``/w/app``, ``w -> /tmp/x``) was silently
    not created; now make_workdir says "blocked" (the import notes it) and creates nothing
    through the link. Control: a plain missing WorkingDir is made."""
    from lowlevel.image.tree import make_workdir
    root = tmp_path / "rootfs"
    root.mkdir()
    outside = tmp_path / "outside"
    os.symlink(str(outside), root / "w")  # absolute: resolved in the tree, under its /tmp
    assert make_workdir(str(root), "/w/app") == "blocked"
    (root / "opt").mkdir()
    (root / "opt" / "f").write_text("")
    assert make_workdir(str(root), "/opt/f/app") == "blocked"  # a file on the way
    assert not outside.exists()
    assert make_workdir(str(root), "/srv/app") == "made" and (root / "srv" / "app").is_dir()
    assert make_workdir(str(root), "/srv/app") == "exists"
