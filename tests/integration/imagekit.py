"""Build OCI images for the image tests, locally and without network.

- :func:`layer` makes a layer tar with Python's tarfile from entry specs (hostile ones included);
- :func:`write_layout` writes an OCI image layout (blobs, config with diff_ids, manifest, index);
- :func:`oci_archive` tars a layout into an OCI archive (what ``skopeo copy ... oci-archive:`` makes);
- :func:`busybox_image` builds a real image with umoci from a busybox-static tree and converts it
  with skopeo into an OCI archive and a ``docker save`` archive.

Everything is written under directories the caller made (temp dirs); nothing is cached.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pathlib
import pwd
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from typing import Any

import pytest

BUSYBOX = shutil.which("busybox") or "/bin/busybox"
TOOLS = ("skopeo", "umoci")
APPLETS = ("sh", "true", "false", "echo", "cat", "ls", "id", "env", "pwd", "stat", "touch", "mkdir", "rm", "sleep",
           "find", "wc", "head", "grep", "test", "printf", "sha256sum", "mknod", "chmod", "whoami", "df")


def need_tools() -> None:
    """Skip unless skopeo, umoci and a static busybox are installed (.ci/setup installs them)."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: apt-get install {' '.join(missing)}")
    if not os.path.exists(BUSYBOX) or not _static(BUSYBOX):
        pytest.skip("needs a static busybox: apt-get install busybox-static")


def _static(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    return b"/lib64/ld-linux" not in head and b"/lib/ld-linux" not in head


def public_tmpdir(prefix: str) -> pathlib.Path:
    """A fresh directory under /tmp that every user can traverse and read (mode 0755)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


def user_store(user: pwd.struct_passwd | None, prefix: str = "imgstore-") -> pathlib.Path:
    """A store directory owned by ``user`` (or by us)."""
    path = public_tmpdir(prefix)
    if user is not None:
        os.chown(path, user.pw_uid, user.pw_gid)
    return path


# --- layers and layouts --------------------------------------------------------------------------

def layer(entries: Sequence[dict[str, Any]]) -> bytes:
    """A layer tar. Entry keys: ``name``, ``type`` (file, dir, symlink, hardlink, char, block, fifo,
    sparse), ``data`` (bytes), ``mode``, ``target`` (links), ``size`` (sparse: real size)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            ti = tarfile.TarInfo(e["name"])
            ti.mode = e.get("mode", 0o644)
            ti.uid = ti.gid = 0
            ti.mtime = 0
            kind = e.get("type", "file")
            data: bytes | None = None
            if kind == "file":
                data = e.get("data", b"")
                ti.size = len(data)
            elif kind == "dir":
                ti.type = tarfile.DIRTYPE
                ti.mode = e.get("mode", 0o755)
            elif kind == "symlink":
                ti.type = tarfile.SYMTYPE
                ti.linkname = e["target"]
            elif kind == "hardlink":
                ti.type = tarfile.LNKTYPE
                ti.linkname = e["target"]
            elif kind in ("char", "block"):
                ti.type = tarfile.CHRTYPE if kind == "char" else tarfile.BLKTYPE
                ti.devmajor, ti.devminor = e.get("dev", (1, 3))
            elif kind == "fifo":
                ti.type = tarfile.FIFOTYPE
            elif kind == "sparse":
                # GNU sparse format 1.0 in PAX headers: the data starts with the map (one 512-byte
                # block: 1 region of 512 bytes at the end of the file), then the region's bytes.
                real = int(e["size"])
                smap = f"1\n{real - 512}\n512\n".encode()
                data = smap + b"\0" * (512 - len(smap)) + b"x" * 512
                ti.size = len(data)
                ti.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": e["name"],
                                  "GNU.sparse.realsize": str(real)}
            else:
                raise ValueError(kind)
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def many_empty_files(directory: str, count: int) -> bytes:
    """A layer of ``count`` empty files in ``directory``, fast: one ustar header is patched per
    entry (name and checksum) instead of going through tarfile for each."""
    out = bytearray()
    d = tarfile.TarInfo(directory)
    d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, 0
    out += d.tobuf(tarfile.USTAR_FORMAT)
    template = bytearray(tarfile.TarInfo("x").tobuf(tarfile.USTAR_FORMAT))
    template[148:156] = b" " * 8
    for i in range(count):
        h = bytearray(template)
        name = f"{directory}/f{i}".encode()
        h[0:100] = name + b"\0" * (100 - len(name))
        h[148:156] = b"%06o\0 " % sum(h)
        out += h
    out += b"\0" * 1024
    return bytes(out)


def _put(layout: pathlib.Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return "sha256:" + digest


def write_layout(dest: pathlib.Path, layers: Sequence[bytes], *, config: dict[str, Any] | None = None,
                 compress: bool = True, ref: str | None = "test:1", diff_ids: Sequence[str] | None = None,
                 blobs: Sequence[bytes] | None = None) -> pathlib.Path:
    """An OCI image layout at ``dest`` (created). ``blobs`` replaces the layer blobs as stored
    (e.g. a truncated gzip) while the config keeps the ``diff_ids`` of ``layers``."""
    (dest / "blobs" / "sha256").mkdir(parents=True)
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    stored = (list(blobs) if blobs is not None else
              [gzip.compress(x, compresslevel=1, mtime=0) if compress else x for x in layers])
    descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else ""),
              "digest": _put(dest, b), "size": len(b)} for b in stored]
    cfg = {"architecture": "amd64", "os": "linux", "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": list(diff_ids) if diff_ids is not None else
                      ["sha256:" + hashlib.sha256(x).hexdigest() for x in layers]}}
    raw_cfg = json.dumps(cfg).encode()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _put(dest, raw_cfg),
                           "size": len(raw_cfg)}, "layers": descs}
    raw_manifest = json.dumps(manifest).encode()
    entry: dict[str, Any] = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                             "digest": _put(dest, raw_manifest), "size": len(raw_manifest)}
    if ref:
        entry["annotations"] = {"org.opencontainers.image.ref.name": ref}
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    for p in [dest, *dest.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dest


def oci_archive(layout: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    """Tar an OCI layout into an OCI archive (members relative to the layout's root)."""
    with tarfile.open(path, "w") as tar:
        for name in ("oci-layout", "index.json", "blobs"):
            tar.add(layout / name, arcname=name)
    path.chmod(0o644)
    return path


def hostile_archive(work: pathlib.Path, name: str, entries: Sequence[dict[str, Any]] | bytes,
                    **kw: Any) -> pathlib.Path:
    """An OCI archive whose top layer holds ``entries`` (or is that tar), with a base layer giving /etc/passwd."""
    base = layer([{"name": "etc", "type": "dir"}, {"name": "etc/passwd", "data": b"root:x:0:0::/root:/bin/sh\n"},
                  {"name": "etc/group", "data": b"root:x:0:\n"}])
    top = entries if isinstance(entries, bytes) else layer(entries)
    layout = write_layout(work / f"{name}-layout", [base, top], **kw)
    return oci_archive(layout, work / f"{name}.tar")


# --- a real image, built with umoci --------------------------------------------------------------

def busybox_tree(dest: pathlib.Path) -> pathlib.Path:
    """A minimal root tree: static busybox in /bin with applet links, /etc/passwd and /etc/group."""
    (dest / "bin").mkdir(parents=True)
    shutil.copy(BUSYBOX, dest / "bin" / "busybox")
    for applet in APPLETS:
        os.symlink("busybox", dest / "bin" / applet)
    (dest / "etc").mkdir()
    (dest / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\napp:x:1234:2345:app:/home/app:/bin/sh\n"
                                         "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    (dest / "etc" / "group").write_text("root:x:0:\napp:x:2345:\nnogroup:x:65534:\n")
    (dest / "app").mkdir()
    (dest / "app" / "hello.txt").write_text("hello from the image\n")
    for sub in ("tmp", "var/tmp", "home", "root"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    return dest


def run(argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run(list(argv), capture_output=True, timeout=120, **kw)
    if proc.returncode != 0:
        raise AssertionError(f"{argv} failed: {proc.stderr.decode()[-2000:]}")
    return proc


def busybox_image(work: pathlib.Path, *, name: str = "bbtest", tag: str = "1", user: str | None = None,
                  extra: Sequence[str] = ()) -> dict[str, pathlib.Path]:
    """Build the busybox image with umoci (config: Env, WorkingDir /app, Cmd) and export it with
    skopeo. Returns ``{"layout", "oci", "docker", "docker_gz"}`` paths (all world-readable)."""
    tree = busybox_tree(work / "tree")
    layout = work / "layout"
    run(["umoci", "init", "--layout", str(layout)])
    run(["umoci", "new", "--image", f"{layout}:{tag}"])
    run(["umoci", "insert", "--image", f"{layout}:{tag}", str(tree), "/"])
    cfg = ["--config.env", "PATH=/bin:/usr/bin", "--config.env", "GREETING=from-image", "--config.env",
           "SHADOWED=image", "--config.workingdir", "/app", "--config.cmd", "/bin/cat",
           "--config.cmd", "/app/hello.txt", *extra]
    if user:
        cfg += ["--config.user", user]
    run(["umoci", "config", "--image", f"{layout}:{tag}", *cfg])
    out = {"layout": layout, "oci": work / "image-oci.tar", "docker": work / "image-docker.tar"}
    run(["skopeo", "--insecure-policy", "copy", "--quiet", f"oci:{layout}:{tag}", f"oci-archive:{out['oci']}:{name}:{tag}"])
    run(["skopeo", "--insecure-policy", "copy", "--quiet", f"oci:{layout}:{tag}",
         f"docker-archive:{out['docker']}:{name}:{tag}"])
    gz = work / "image-docker.tar.gz"
    with open(out["docker"], "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    out["docker_gz"] = gz
    for p in [work, *work.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    return out
