"""Hostile image archives: each attack fails with one clear error (or is neutralised), nothing is
written outside the store, and a refused import leaves no partial image.

Archives are built here with Python's tarfile in temp dirs. Controls show that the same entries
do what the attack wants when a naive extractor (``tarfile.extractall`` without a filter, as root)
unpacks them, so the refusal is what stops them.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import tarfile
from collections.abc import Iterator

import imagekit
import pytest

import lowlevel
from lowlevel.image import ImageStore, ImportLimits

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]


@pytest.fixture
def work() -> Iterator[pathlib.Path]:
    imagekit.need_tools()
    path = imagekit.public_tmpdir("hostile-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[ImageStore]:
    path = imagekit.public_tmpdir("imgstore-")
    monkeypatch.setenv("LOWLEVEL_IMAGE_STORE", str(path))
    try:
        yield ImageStore(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _empty(store: ImageStore) -> None:
    """Nothing left behind: no image, no staging directory, no name."""
    assert os.listdir(store.images_dir) == []
    assert os.listdir(store.tmp_dir) == []
    assert store.list_images() == []


def _refused(store: ImageStore, archive: pathlib.Path, pattern: str, **kw: object) -> str:
    with pytest.raises(lowlevel.LowlevelError, match=pattern) as err:
        store.import_archive(archive, **kw)  # type: ignore[arg-type]
    _empty(store)
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)
    return str(err.value)


def _naive_extract(archive_layer: bytes, dest: pathlib.Path) -> None:
    """The control: what an unfiltered extractor does with a layer."""
    import io
    with tarfile.open(fileobj=io.BytesIO(archive_layer)) as tar:
        if hasattr(tarfile, "fully_trusted_filter"):  # Python >= 3.11.4 filters; this is the old default
            tar.extractall(dest, filter="fully_trusted")
        else:
            tar.extractall(dest)


def test_path_traversal(store: ImageStore, work: pathlib.Path) -> None:
    target = work / "escaped-by-dotdot"
    depth = "../" * 12
    entries = [{"name": f"{depth}{target.relative_to('/')}", "data": b"pwned"}]
    # Control: a naive extractor writes the file outside its destination.
    (work / "naive").mkdir()
    _naive_extract(imagekit.layer(entries), work / "naive")
    assert target.read_bytes() == b"pwned"
    target.unlink()
    msg = _refused(store, imagekit.hostile_archive(work, "dotdot", entries), r"has a '\.\.' component")
    assert "refusing dotdot.tar" in msg and not target.exists()
    absolute = [{"name": str(work / "escaped-absolute"), "data": b"pwned"}]
    _refused(store, imagekit.hostile_archive(work, "abs", absolute), "is an absolute path")
    assert not (work / "escaped-absolute").exists()


def test_absolute_symlink_parent_then_a_file_through_it(store: ImageStore, work: pathlib.Path) -> None:
    outside = work / "outside"
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)  # even the sandbox's uid could write here, were it visible
    entries = [{"name": "escape", "type": "symlink", "target": str(outside)},
               {"name": "escape/pwned", "data": b"pwned"}]
    (work / "naive").mkdir()
    _naive_extract(imagekit.layer(entries), work / "naive")
    assert (outside / "pwned").read_bytes() == b"pwned"  # control: the attack works naively
    (outside / "pwned").unlink()
    img = store.import_archive(imagekit.hostile_archive(work, "symparent", entries))
    assert list(outside.iterdir()) == []
    # umoci resolved the link inside the tree (filepath-securejoin): the file stayed in the image.
    inside = pathlib.Path(img.rootfs) / str(outside).lstrip("/") / "pwned"
    assert inside.read_bytes() == b"pwned"
    assert os.readlink(pathlib.Path(img.rootfs) / "escape") == str(outside)
    # The same link as a parent in a later layer: same result.
    later = [{"name": "escape2", "type": "symlink", "target": str(outside)}]
    layout = imagekit.write_layout(work / "two-layout", [imagekit.layer(later),
                                                         imagekit.layer([{"name": "escape2/pwned2", "data": b"x"}])],
                                   ref="two:1")
    try:
        store.import_archive(imagekit.oci_archive(layout, work / "two.tar"))
    except lowlevel.LowlevelError as err:
        assert "umoci" in str(err)
    assert list(outside.iterdir()) == []


def test_hard_link_to_etc_shadow(store: ImageStore, work: pathlib.Path) -> None:
    for name, target in (("abs", "/etc/shadow"), ("dotdot", "../../../../../../etc/shadow")):
        entries = [{"name": "shadow", "type": "hardlink", "target": target}]
        msg = _refused(store, imagekit.hostile_archive(work, f"link-{name}", entries), "hard link 'shadow'")
        assert "absolute path" in msg or "'..' component" in msg
    # A relative target the image lacks: umoci refuses it inside its sandbox, where the host's
    # /etc/shadow is not even visible.
    entries = [{"name": "shadow", "type": "hardlink", "target": "etc/shadow"}]
    _refused(store, imagekit.hostile_archive(work, "link-missing", entries), "umoci unpacking .* failed")
    shadow = os.stat("/etc/shadow")
    assert shadow.st_nlink == 1


def test_device_nodes_are_dropped(store: ImageStore, work: pathlib.Path) -> None:
    entries = [{"name": "dev", "type": "dir"},
               {"name": "dev/mem", "type": "char", "dev": (1, 1), "mode": 0o666},
               {"name": "dev/sda", "type": "block", "dev": (8, 0), "mode": 0o666},
               {"name": "kmsg", "type": "char", "dev": (1, 11), "mode": 0o666},
               {"name": "fifo", "type": "fifo", "mode": 0o666}]
    img = store.import_archive(imagekit.hostile_archive(work, "devices", entries))
    root = pathlib.Path(img.rootfs)
    assert not (root / "dev" / "mem").exists() and not (root / "dev" / "sda").exists()
    assert not (root / "kmsg").exists()
    for p in root.rglob("*"):
        mode = p.lstat().st_mode
        assert not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)), p
    assert stat.S_ISFIFO((root / "fifo").lstat().st_mode) and not (root / "fifo").lstat().st_mode & 0o022
    assert any("3 device nodes in the layers: dropped" in n for n in img.notes)


def test_setuid_and_world_writable_bits_are_cleared(store: ImageStore, work: pathlib.Path) -> None:
    entries = [{"name": "bin", "type": "dir"},
               {"name": "bin/su", "data": b"#!/bin/sh\n", "mode": 0o4755},
               {"name": "bin/wall", "data": b"#!/bin/sh\n", "mode": 0o2755},
               {"name": "bin/both", "data": b"#!/bin/sh\n", "mode": 0o6777},
               {"name": "shared", "type": "dir", "mode": 0o1777}]
    img = store.import_archive(imagekit.hostile_archive(work, "setid", entries))
    root = pathlib.Path(img.rootfs)
    assert stat.S_IMODE((root / "bin" / "su").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "bin" / "wall").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "bin" / "both").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "shared").stat().st_mode) == 0o1755
    assert any("3 setuid/setgid files in the layers: bits cleared" in n for n in img.notes)


@pytest.mark.slow
def test_entry_count_bound(store: ImageStore, work: pathlib.Path) -> None:
    tar = imagekit.many_empty_files("many", 100_000)
    archive = imagekit.hostile_archive(work, "many", tar)
    msg = _refused(store, archive, "more than 50000 entries", limits=ImportLimits(max_entries=50_000))
    assert "raise the import's entry bound" in msg


def test_sparse_10_gib_file_is_over_the_byte_bound(store: ImageStore, work: pathlib.Path) -> None:
    entries = [{"name": "disk.img", "type": "sparse", "size": 10 * 1024 ** 3}]
    archive = imagekit.hostile_archive(work, "sparse", entries)
    assert archive.stat().st_size < 1024 * 1024  # tiny on disk, 10 GiB unpacked
    _refused(store, archive, "add up to more than 8589934592 bytes .*'disk.img' is 10737418240 bytes")


def test_truncated_archives(store: ImageStore, work: pathlib.Path) -> None:
    entries = [{"name": "data.bin", "data": os.urandom(256 * 1024)}]
    archive = imagekit.hostile_archive(work, "whole", entries)
    data = archive.read_bytes()
    cut = work / "cut.tar"
    cut.write_bytes(data[: len(data) // 2])
    cut.chmod(0o644)
    _refused(store, cut, "refusing cut.tar: it is not a readable tar archive")
    # A layer truncated *before* it was hashed: the digests agree, the gzip stream ends early.
    import gzip
    payload = imagekit.layer(entries)
    blob = gzip.compress(payload, mtime=0)
    layout = imagekit.write_layout(work / "trunc-layout", [payload], blobs=[blob[: len(blob) // 2]])
    _refused(store, imagekit.oci_archive(layout, work / "trunc.tar"), "layer 1 .* is truncated or corrupt")
    # A layer whose content is not what the config's diff_id says.
    layout = imagekit.write_layout(work / "diff-layout", [payload], diff_ids=["sha256:" + "0" * 64])
    _refused(store, imagekit.oci_archive(layout, work / "diff.tar"), "not to the config's diff_id")


def test_json_nested_deeper_than_the_parser_recurses(store: ImageStore, work: pathlib.Path) -> None:
    """``"[" * 200000`` is valid JSON that Python's parser cannot read (RecursionError): the
    import said "failed (exit 1)" with a piece of the helper's traceback (a fresh-user trial).
    Now one line, for a docker-save ``manifest.json`` (read in the sandboxed helper) and an OCI
    layout's ``index.json`` (read by the caller)."""
    import io
    deep = b"[" * 200000 + b"]" * 200000
    archive = work / "deep.tar"
    with tarfile.open(archive, "w") as tar:
        ti = tarfile.TarInfo("manifest.json")
        ti.size = len(deep)
        tar.addfile(ti, io.BytesIO(deep))
    archive.chmod(0o644)
    msg = _refused(store, archive, "nested deeper than the import reads")
    assert "RecursionError" not in msg and "exit 1" not in msg, msg
    layout = imagekit.write_layout(work / "deep-layout", [imagekit.layer([{"name": "f", "data": b"x"}])])
    (layout / "index.json").write_bytes(deep)
    msg = _refused(store, layout, "nested deeper than the import reads")
    assert "RecursionError" not in msg, msg


@pytest.mark.parametrize("name", [".wh...", "etc/.wh...", "etc/.wh..", "etc/.wh."])
def test_a_whiteout_of_the_parent_or_of_its_own_directory_is_refused(store: ImageStore, work: pathlib.Path,
                                                                    name: str) -> None:
    """``.wh...`` whites out ``..``: umoci acted on the tree's parent and the import failed with
    umoci's raw error (a fresh-user trial; still inside the sandbox). The scan now refuses it
    in one line; control: a whiteout of an entry (one the layers below do not have) imports."""
    _refused(store, imagekit.hostile_archive(work, "wh", [{"name": name}]), "is a whiteout of")
    img = store.import_archive(imagekit.hostile_archive(work, "whok", [{"name": "etc/.wh.nothing"}]))
    assert os.path.isfile(os.path.join(img.rootfs, "etc", "passwd"))


def test_unknown_member_type(store: ImageStore, work: pathlib.Path) -> None:
    import io
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        ti = tarfile.TarInfo("volume")
        ti.type = b"V"  # a GNU volume header: no layer holds one
        tar.addfile(ti)
    layout = imagekit.write_layout(work / "v-layout", [buf.getvalue()])
    _refused(store, imagekit.oci_archive(layout, work / "v.tar"), "tar type b'V'")


def test_image_working_dir_that_escapes_is_dropped_with_a_note(store: ImageStore, work: pathlib.Path) -> None:
    """Issue 22 item 1: an image's ``WorkingDir`` is a cwd from a hostile file: under /proc (bwrap's
    fd of the host's /proc, CVE-2024-21626 class) it is dropped with a note; control: /app is kept."""
    bad = store.import_archive(imagekit.hostile_archive(work, "wdproc", [{"name": "app", "type": "dir"}],
                                                        config={"WorkingDir": "/proc/self/fd/3"}))
    assert bad.config.workdir is None
    assert any("WorkingDir ignored" in n and "CVE-2024-21626" in n for n in bad.notes), bad.notes
    good = store.import_archive(imagekit.hostile_archive(work, "wdapp", [{"name": "app", "type": "dir"}],
                                                         config={"WorkingDir": "/app"}), name="wdapp:1")
    assert good.config.workdir == "/app"
