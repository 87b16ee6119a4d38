"""One image import, step by step, every step on untrusted input run in a lowlevel sandbox.

:class:`ImportJob` is what :meth:`lowlevel.image.ImageStore.import_archive` runs in a staging
directory of the store: inspect the source (this package's ``_image_helper.py``), copy it to an
OCI layout (skopeo), read that layout back bounded and digest-checked, scan every layer
(``_image_helper.py scan``), unpack (umoci), then on the host make the tree safe
(:mod:`lowlevel.image.tree`), hash it and commit it to the store by one ``rename(2)``.
:class:`ImportLimits` bounds it; :class:`ImportProgress` reports it.

Sources: OCI image-spec (image-layout.md, manifest.md, config.md, layer.md); skopeo(1),
containers-transports(5); umoci-raw-unpack(1); CVE-2019-14271 (docker cp) and CVE-2018-15664
(symlink-exchange races) for why extraction runs confined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lowlevel._dataclass import dataclass
from lowlevel.errors import ImageError, PolicyError
from lowlevel.image.tree import (atomic_write, check_space, ensure_placeholders, fs_used, make_workdir, neutralize,
                                 readable_by_others, rmtree, tree_bytes, user_ids)
from lowlevel.paths import PACKAGE_DIR
from lowlevel.rootfs import tree_sha256
from lowlevel.rootfs.store import (HEX64, MAX_JSON, SCHEMA, GiB, Image, ImageConfig, Layer, MiB, normalize_name,
                                   parse_json, read_bounded)
from lowlevel.spec import validate as _validate

if TYPE_CHECKING:
    from lowlevel.image import ImageStore
    from lowlevel.sandbox.result import Result
    from lowlevel.spec.policy import Policy

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
#: uname -m -> the OCI/Go architecture name.
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "i686": "386", "i386": "386", "armv7l": "arm",
           "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}
_LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
                "application/vnd.oci.image.layer.nondistributable.v1.tar",
                "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
                "application/vnd.docker.image.rootfs.diff.tar.gzip")


@dataclass(frozen=True)
class ImportLimits:
    """Bounds of one import; a bigger image is refused with the bound named.

    Attributes:
        max_bytes: total size of the files in all layers (tar header sizes, so a sparse file
            counts at its full length), bytes. Default 8 GiB.
        max_entries: entries in all layers (whiteouts included). Default 1,000,000.
        max_layers: layers. Default 256.
        timeout_s: wall-clock limit of each tool run (copy, scan, unpack), seconds.
        memory_bytes: memory of each tool run (cgroup, or RLIMIT_DATA), bytes.
    """

    max_bytes: int = 8 * GiB
    max_entries: int = 1_000_000
    max_layers: int = 256
    timeout_s: float = 3600.0
    memory_bytes: int = 2 * GiB

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_entries", "max_layers", "memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise PolicyError(f"ImportLimits.{name} must be a positive int, got {value!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise PolicyError(f"ImportLimits.timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")



@dataclass(frozen=True)
class ImportProgress:
    """One progress report of an import.

    Attributes:
        phase: ``"copy"`` (skopeo), ``"scan"`` (checking layers), ``"unpack"`` (umoci),
            ``"verify"`` (neutralising and hashing the tree), ``"done"``.
        layer: 1-based layer being scanned (0 outside ``scan``).
        layers: layer count (0 until known).
        done_bytes, total_bytes: progress of the phase (``total_bytes`` 0 when unknown; the
            ``copy`` and ``unpack`` figures are estimates).
    """

    phase: str
    layer: int = 0
    layers: int = 0
    done_bytes: int = 0
    total_bytes: int = 0


ProgressFn = Callable[[ImportProgress], None]


def _sandbox_python() -> str:
    """The host's python3 under /usr, which every default sandbox sees."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(cand, os.X_OK):
            return cand
    raise ImageError("no /usr/bin/python3 on this host: the import checks layers with it inside a sandbox")


def _helper_source() -> str:
    with open(os.path.join(PACKAGE_DIR, "_image_helper.py"), encoding="utf-8") as f:
        return f.read()


def _in_event_loop() -> bool:
    import asyncio
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True



def _blob(layout: str, digest: Any, what: str, limit: int = MAX_JSON) -> bytes:
    if not isinstance(digest, str) or not digest.startswith("sha256:") or not HEX64.match(digest[7:]):
        raise ImageError(f"the image's {what} has a malformed digest {digest!r}")
    data = read_bounded(os.path.join(layout, "blobs", "sha256", digest[7:]), limit, f"the image's {what}")
    if hashlib.sha256(data).hexdigest() != digest[7:]:
        raise ImageError(f"the image's {what} does not match its digest {digest}")
    return data


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _version() -> str:
    from lowlevel.version import __version__
    return __version__


class ImportJob:
    """One import in its staging directory (see :meth:`ImageStore.import_archive`)."""

    def __init__(self, store: ImageStore, src: str, staging: str, name: str | None, ref: str | None,
                 limits: ImportLimits, progress: ProgressFn | None, tools: Mapping[str, str | None]) -> None:
        self.store = store
        self.src = src
        self.staging = staging
        self.name = name
        self.ref = ref
        self.limits = limits
        self.progress = progress
        self.tools = tools
        self.notes: list[str] = []
        self.label = os.path.basename(src.rstrip("/")) or src
        # The tools write only into ``out`` (bound read-write at /out: a plain bind, so a multi-GB
        # unpack goes to disk, not to the copy-on-write workspace's memory-backed upper layer);
        # their workspace is an empty directory nothing is written to.
        self.out = os.path.join(staging, "out")
        self.ws = os.path.join(staging, "ws")
        self.lease: Any = None
        os.mkdir(self.ws, 0o700)
        os.mkdir(self.out, 0o700)
        for sub in ("in", "tmp", "home"):
            os.mkdir(os.path.join(self.out, sub), 0o700)
        if os.geteuid() == 0:
            # A root caller's tools run as a host uid leased for the whole import (no other sandbox
            # gets it meanwhile), which owns ``out``; the import's directory is traversable
            # (0711) but not listable, under the store's unlistable tmp/.
            from lowlevel.workspace.uids import UidLease
            self.lease = UidLease.acquire()
            for p in (self.out, *(os.path.join(self.out, sub) for sub in ("in", "tmp", "home"))):
                os.chown(p, self.lease.uid, self.lease.uid)
            os.chmod(staging, 0o711)

    def close(self) -> None:
        """Release the leased uid (root callers)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    # -- sandboxed tools -------------------------------------------------------------------------
    def _policy(self, binds: Sequence[Any] = (), *, setid: bool = False) -> Policy:
        from lowlevel.spec.limits import Limits
        from lowlevel.spec.policy import Policy
        from lowlevel.spec.seccomp import DEFAULT_PROFILE
        from lowlevel.spec.policy import Bind
        ids: dict[str, Any] = {"host_uid": self.lease.uid, "host_gid": self.lease.uid} if self.lease else {}
        return Policy(binds=(Bind(self.out, "/out", writable=True, allow_sensitive=True), *binds), **ids,
                      seccomp=_unpack_profile() if setid else DEFAULT_PROFILE, limits=Limits(
            cpu_s=None, memory_bytes=self.limits.memory_bytes, pids=512, nofile=4096, tmp_size_bytes=64 * MiB,
            fsize_bytes=max(self.limits.max_bytes, 64 * MiB)))

    def _sandboxed(self, argv: Sequence[str], what: str, *, binds: Sequence[Any] = (), stdin: bytes | None = None,
                   tick: Callable[[], None] | None = None, setid: bool = False) -> Result:
        from lowlevel.sandbox.drive import run
        policy = self._policy(binds, setid=setid)
        env = {"TMPDIR": "/out/tmp", "HOME": "/out/home"}
        if tick is None or _in_event_loop():
            result = run(argv, policy=policy, workspace=self.ws, timeout=self.limits.timeout_s, env=env,
                         stdin=stdin)
        else:
            import asyncio

            from lowlevel.sandbox.aio import arun

            async def main() -> Result:
                task = asyncio.ensure_future(arun(argv, policy=policy, workspace=self.ws,
                                                  timeout=self.limits.timeout_s, env=env, stdin=stdin))
                while True:
                    done, _ = await asyncio.wait({task}, timeout=0.2)
                    if done:
                        return task.result()
                    tick()

            result = asyncio.run(main())
        if result.timed_out:
            raise ImageError(f"{what} took longer than {self.limits.timeout_s:g} s (ImportLimits.timeout_s)")
        if result.killed_by == "memory" or (result.killed_by and result.killed_by != "signal"):
            raise ImageError(f"{what} was stopped by the import's {result.killed_by} limit (a hostile archive, or "
                             "raise ImportLimits)")
        return result

    def _helper(self, request: dict[str, Any], what: str, *, binds: Sequence[Any] = (),
                tick: Callable[[], None] | None = None) -> dict[str, Any]:
        result = self._sandboxed([_sandbox_python(), "-I", "-S", "-B", "-c", _helper_source()], what, binds=binds,
                                 stdin=json.dumps(request).encode(), tick=tick)
        try:
            doc = json.loads(result.stdout)
        except ValueError:
            tail = result.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
            raise ImageError(f"{what} failed (exit {result.exit_code}): {' '.join(tail) or 'no output'}") from None
        if not isinstance(doc, dict) or not doc.get("ok"):
            raise ImageError(f"refusing {self.label}: {doc.get('error') if isinstance(doc, dict) else doc}")
        return doc

    def _tool(self, argv: Sequence[str], what: str, *, binds: Sequence[Any] = (),
              tick: Callable[[], None] | None = None, setid: bool = False) -> Result:
        result = self._sandboxed(argv, what, binds=binds, tick=tick, setid=setid)
        if result.exit_code != 0:
            text = result.stderr.decode("utf-8", "replace").strip()
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()][-3:]
            raise ImageError(f"{what} failed (exit {result.exit_code}): {' | '.join(lines) or 'no message'}")
        return result

    def _report(self, phase: str, done: int = 0, total: int = 0, layer: int = 0, layers: int = 0) -> None:
        if self.progress is not None:
            self.progress(ImportProgress(phase=phase, layer=layer, layers=layers, done_bytes=done, total_bytes=total))

    # -- the source --------------------------------------------------------------------------------
    def _stage_input(self) -> tuple[list[Any], str]:
        """Bind the source read-only at /in/..., or copy it in when the sandbox's uid could not read
        it (a root caller's file under /root). Returns (binds, path inside)."""
        from lowlevel.spec.policy import Bind
        isdir = os.path.isdir(self.src)
        inside = "/in/layout" if isdir else "/in/archive"
        if os.geteuid() == 0 and not readable_by_others(self.src):
            dest = os.path.join(self.out, "in", os.path.basename(inside))
            try:
                if isdir:
                    shutil.copytree(self.src, dest, symlinks=True)
                else:
                    shutil.copyfile(self.src, dest)
            except OSError as err:
                raise ImageError(f"cannot copy {self.src} for the import: {err}") from err
            if self.lease is not None:
                for p in [dest, *(os.path.join(d, f) for d, ds, fs in os.walk(dest) for f in ds + fs)]:
                    os.lchown(p, self.lease.uid, self.lease.uid)
            return [], "/out" + inside
        try:
            return [Bind(self.src, inside, allow_sensitive=True)], inside
        except PolicyError as err:
            raise ImageError(f"cannot use {self.src}: {err}") from err

    def _choose(self, doc: Mapping[str, Any]) -> tuple[str | None, list[str]]:
        """From the inspected source: (skopeo reference suffix, names recorded in the archive)."""
        kind = doc["kind"]
        if kind in ("oci", "oci-archive"):
            index = doc.get("index")
            manifests = index.get("manifests") if isinstance(index, dict) else None
            if not isinstance(manifests, list) or not manifests:
                raise ImageError(f"refusing {self.label}: its index.json lists no image")
            entries = [m for m in manifests if isinstance(m, dict)]
            def refs(m: Mapping[str, Any]) -> list[str]:
                ann = m.get("annotations") if isinstance(m.get("annotations"), dict) else {}
                assert isinstance(ann, dict)
                return [str(ann[k]) for k in ("org.opencontainers.image.ref.name", "io.containerd.image.name")
                        if isinstance(ann.get(k), str)]
            if len(entries) > 1 or self.ref is not None:
                if self.ref is None:
                    listed = ", ".join(r[0] for r in map(refs, entries) if r) or "none named"
                    raise ImageError(f"{self.label} holds {len(entries)} images ({listed}): pick one with --ref")
                chosen = [m for m in entries if self.ref in refs(m)]
                if not chosen:
                    raise ImageError(f"{self.label} has no image with ref {self.ref!r}")
                ann = chosen[0].get("annotations") or {}
                suffix = ann.get("org.opencontainers.image.ref.name")
                if not isinstance(suffix, str):
                    raise ImageError(f"{self.label}: image {self.ref!r} has no org.opencontainers.image.ref.name "
                                     "annotation, which skopeo needs to pick it")
                entry = chosen[0]
            else:
                entry, suffix = entries[0], None
            ann = entry.get("annotations") if isinstance(entry.get("annotations"), dict) else {}
            assert isinstance(ann, dict)
            recorded = []
            full = ann.get("io.containerd.image.name")
            short = ann.get("org.opencontainers.image.ref.name")
            for cand in (full, short):
                if isinstance(cand, str) and (":" in cand or "/" in cand):
                    with contextlib.suppress(ImageError):
                        recorded.append(normalize_name(cand))
                    break
            return suffix, recorded
        manifest = doc.get("manifest")
        if not isinstance(manifest, list) or not manifest:
            raise ImageError(f"refusing {self.label}: its manifest.json lists no image")
        items = [m for m in manifest if isinstance(m, dict)]
        def tags(m: Mapping[str, Any]) -> list[str]:
            return [str(t) for t in (m.get("RepoTags") or []) if isinstance(t, str)]
        if len(items) > 1 or self.ref is not None:
            if self.ref is None:
                listed = ", ".join(t for m in items for t in tags(m)) or "untagged"
                raise ImageError(f"{self.label} holds {len(items)} images ({listed}): pick one with --ref NAME:TAG")
            chosen = [m for m in items if self.ref in tags(m)]
            if not chosen:
                raise ImageError(f"{self.label} has no image tagged {self.ref!r}")
            item, suffix = chosen[0], self.ref
        else:
            item, suffix = items[0], None
        recorded = []
        for t in tags(item):
            with contextlib.suppress(ImageError):
                recorded.append(normalize_name(t))
        return suffix, recorded

    # -- the steps -----------------------------------------------------------------------------------
    def run(self) -> Image:
        """Import the source into the store; return the image (see :meth:`ImageStore.import_archive`).

        Raises:
            ImageError: a step refused the source, failed or went over a bound.
        """
        layout, kind, recorded = self._copy()
        manifest_digest, config, layers = self._read_layout(layout)
        image_id = "sha256:" + hashlib.sha256(config["raw"]).hexdigest()
        names = [self.name] if self.name else recorded
        if os.path.isdir(self.store.image_dir(image_id)):
            self._report("done", 1, 1, layers=len(layers))
            return self._commit_names(image_id, names)
        if len(layers) > self.limits.max_layers:
            raise ImageError(f"refusing {self.label}: {len(layers)} layers, more than {self.limits.max_layers} "
                             "(ImportLimits.max_layers)")
        layers, summary = self._scan(layers)
        want_bytes = int(summary["bytes"])
        rootfs = self._unpack(layout, want_bytes, len(layers))
        cfg = self._config(config, rootfs)
        self._report("verify", 0, want_bytes, layers=len(layers))
        cfg, digest = self._make_safe(rootfs, cfg, summary, want_bytes, len(layers))
        meta = {"schema": SCHEMA, "id": image_id, "manifest_digest": manifest_digest, "imported_at": _now(),
                "source": {"kind": kind, "path": self.src, "ref": self.ref},
                "layers": [dataclasses.asdict(layer) for layer in layers],
                "config": {"env": [list(p) for p in cfg.env], "workdir": cfg.workdir, "user": cfg.user,
                           "user_ids": list(cfg.user_ids) if cfg.user_ids else None,
                           "entrypoint": list(cfg.entrypoint), "cmd": list(cfg.cmd),
                           "architecture": cfg.architecture, "os": cfg.os},
                "rootfs": {"sha256": digest.sha256, "entries": digest.entries, "bytes": digest.bytes},
                "notes": self.notes, "lowlevel": _version()}
        self._commit(image_id, meta, names)
        self._report("done", want_bytes, want_bytes, layers=len(layers))
        return self.store.get(image_id)

    def _copy(self) -> tuple[str, str, list[str]]:
        """Inspect the source and copy it with skopeo to an OCI layout in ``out``.

        Returns ``(layout directory, source kind, names the archive records)``."""
        binds, inside = self._stage_input()
        source_bytes = tree_bytes(self.src)
        doc = self._helper({"mode": "inspect", "path": inside}, f"reading {self.label}", binds=binds)
        kind = str(doc["kind"])
        suffix, recorded = self._choose(doc)
        transport = {"oci": "oci", "oci-archive": "oci-archive", "docker-archive": "docker-archive"}[kind]
        copy_binds = binds
        if kind == "docker-archive" and doc.get("gzip"):
            # skopeo reads docker-archive uncompressed only.
            self._helper({"mode": "gunzip", "path": inside, "dest": "/out/in/archive.tar",
                          "max_bytes": self.limits.max_bytes + 64 * MiB}, f"decompressing {self.label}", binds=binds)
            inside, copy_binds = "/out/in/archive.tar", []
        spec = f"{transport}:{inside}" + (f":{suffix}" if suffix else "")
        self._report("copy", 0, source_bytes)
        factor = 2 if kind == "oci-archive" else 1  # skopeo extracts an oci-archive, then copies its blobs
        self._tool([str(self.tools["skopeo"]), "--insecure-policy", "--tmpdir", "/out/tmp", "copy", "--quiet",
                    spec, "oci:/out/layout:import"], f"skopeo copying {self.label}", binds=copy_binds,
                   tick=lambda: self._report("copy", min(source_bytes, tree_bytes(self.out) // factor),
                                             source_bytes))
        rmtree(os.path.join(self.out, "in"))
        return os.path.join(self.out, "layout"), kind, recorded

    def _scan(self, layers: tuple[Layer, ...]) -> tuple[tuple[Layer, ...], dict[str, Any]]:
        """Check every layer in the helper's sandbox before anything is unpacked, and the space the
        unpack needs. Returns the layers with their entry and byte counts, and the helper's summary."""
        total_blob = sum(layer.size for layer in layers)
        progress_file = os.path.join(self.out, "tmp", "scan.progress")

        def scan_tick() -> None:
            try:
                text = read_bounded(progress_file, 64, "progress").decode()
                index, done = (int(x) for x in text.split())
            except (ImageError, ValueError, UnicodeDecodeError):
                return
            before = sum(layer.size for layer in layers[:index])
            self._report("scan", min(before + done, total_blob), total_blob, layer=index + 1, layers=len(layers))

        self._report("scan", 0, total_blob, layer=1, layers=len(layers))
        summary = self._helper({"mode": "scan", "layout": "/out/layout", "max_bytes": self.limits.max_bytes,
                                "max_entries": self.limits.max_entries, "progress": "/out/tmp/scan.progress",
                                "layers": [{"digest": layer.digest, "media_type": layer.media_type,
                                            "size": layer.size, "diff_id": layer.diff_id} for layer in layers]},
                               f"checking the layers of {self.label}", tick=scan_tick)
        self._report("scan", total_blob, total_blob, layer=len(layers), layers=len(layers))
        layers = tuple(dataclasses.replace(layer, entries=int(s["entries"]), bytes=int(s["bytes"]))
                       for layer, s in zip(layers, summary["layers"], strict=True))
        check_space(self.out, int(summary["bytes"]), int(summary["entries"]))
        for key, what in (("setid", "setuid/setgid file"), ("caps", "file with capabilities (security.capability)"),
                          ("devices", "device node")):
            count = sum(int(s[key]) for s in summary["layers"])
            if count:
                self.notes.append(f"{count} {what}{'s' if count != 1 else ''} in the layers: "
                                  + {"setid": "bits cleared", "caps": "attribute removed",
                                     "devices": "dropped"}[key])
        return layers, summary

    def _unpack(self, layout: str, want_bytes: int, layer_count: int) -> str:
        """umoci unpacks the layout in its sandbox; returns the tree's host path (the layout is removed)."""
        base_used = fs_used(self.out)
        self._report("unpack", 0, want_bytes, layers=layer_count)
        self._tool([str(self.tools["umoci"]), "--log=error", "raw", "unpack", "--rootless", "--image",
                    "/out/layout:import", "/out/rootfs"], f"umoci unpacking {self.label}", setid=True,
                   tick=lambda: self._report("unpack", max(0, min(want_bytes, fs_used(self.out) - base_used)),
                                             want_bytes, layers=layer_count))
        self._report("unpack", want_bytes, want_bytes, layers=layer_count)
        rmtree(layout)
        return os.path.join(self.out, "rootfs")

    def _make_safe(self, rootfs: str, cfg: ImageConfig, summary: Mapping[str, Any], want_bytes: int,
                   layer_count: int) -> tuple[ImageConfig, Any]:
        """On the host: neutralise the tree, add its mount points, look its User up, hash it, and move
        it to ``<staging>/rootfs`` (``out`` and the tools' workspace are removed). Returns the config
        with ``user_ids`` and the tree's :class:`lowlevel.rootfs.TreeDigest`."""
        self.notes.extend(neutralize(rootfs, summary["devices"], fix_caps=any(s["caps"] for s in summary["layers"])))
        self.notes.extend(ensure_placeholders(rootfs))
        made = make_workdir(rootfs, cfg.workdir) if cfg.workdir else "exists"
        if made == "made":
            self.notes.append(f"created the config's WorkingDir {cfg.workdir} (missing from the layers; Docker "
                              "creates it too)")
        elif made == "blocked":
            self.notes.append(f"the config's WorkingDir {cfg.workdir} is missing and a symlink or file on its way "
                              "kept it from being made (never created through a link): runs need --cwd / cwd=")
        cfg = dataclasses.replace(cfg, user_ids=user_ids(rootfs, cfg.user, self.notes))
        try:
            digest = tree_sha256(rootfs, lambda done: self._report("verify", min(done, want_bytes), want_bytes,
                                                                   layers=layer_count))
        except OSError as err:
            raise ImageError(f"cannot hash the unpacked tree of {self.label}: {err}") from err
        os.rename(rootfs, os.path.join(self.staging, "rootfs"))
        rmtree(self.out)
        rmtree(self.ws)
        return cfg, digest

    def _commit(self, image_id: str, meta: Mapping[str, Any], names: Sequence[str]) -> None:
        """Write image.json and the last-used stamp, then move the staging directory into the store
        (one ``rename(2)`` under the lock; an image another import committed first wins) and point
        ``names`` at it in the same locked step: a kill between the two left a complete image
        without its name (``<none>``: a fresh-user trial), now only within two renames."""
        store = self.store
        atomic_write(os.path.join(self.staging, "image.json"), json.dumps(meta, indent=1).encode() + b"\n")
        os.close(os.open(os.path.join(self.staging, "last-used"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        mode = 0o755 if os.geteuid() == 0 else 0o700
        os.chmod(os.path.join(self.staging, "rootfs"), 0o755)
        os.chmod(self.staging, mode)
        with store._locked():
            final = store.image_dir(image_id)
            if not os.path.isdir(final):
                os.rename(self.staging, final)
                os.mkdir(self.staging, 0o700)  # the caller's cleanup removes this empty stand-in
            self._point_names(image_id, names)

    def _commit_names(self, image_id: str, names: Sequence[str]) -> Image:
        if names:
            with self.store._locked():
                self._point_names(image_id, names)
        return self.store.get(image_id)

    def _point_names(self, image_id: str, names: Sequence[str]) -> None:
        """Point ``names`` at ``image_id`` (the store's lock held)."""
        if names:
            current = self.store._names()
            for n in names:
                current[n] = image_id
            self.store._write_names(current)

    def _read_layout(self, layout: str) -> tuple[str, dict[str, Any], tuple[Layer, ...]]:
        """Read what skopeo wrote (bounded, digest-checked): (manifest digest, config, layers).

        skopeo ran on hostile input with write access to the layout: its directories are checked
        to be real directories (no symlink to elsewhere on the host), every file is opened
        ``O_NOFOLLOW``, bounded, and blobs must match their digest.
        """
        for sub in (layout, os.path.join(layout, "blobs"), os.path.join(layout, "blobs", "sha256")):
            try:
                real = stat.S_ISDIR(os.lstat(sub).st_mode)
            except OSError:
                real = False
            if not real:
                raise ImageError(f"refusing {self.label}: skopeo left no OCI layout ({sub} is not a directory)")
        index = parse_json(read_bounded(os.path.join(layout, "index.json"), MAX_JSON, "index.json"), "index.json")
        manifests = index.get("manifests") if isinstance(index, dict) else None
        if not isinstance(manifests, list) or len(manifests) != 1 or not isinstance(manifests[0], dict):
            raise ImageError(f"refusing {self.label}: skopeo's index.json does not hold exactly one image")
        desc = manifests[0]
        if desc.get("mediaType") not in (None, "application/vnd.oci.image.manifest.v1+json"):
            raise ImageError(f"refusing {self.label}: unexpected manifest type {desc.get('mediaType')!r}")
        manifest_digest = str(desc.get("digest"))
        manifest = parse_json(_blob(layout, manifest_digest, "manifest"), "manifest")
        if not isinstance(manifest, dict) or manifest.get("schemaVersion") != 2:
            raise ImageError(f"refusing {self.label}: the manifest is not an OCI schemaVersion 2 manifest")
        cdesc = manifest.get("config")
        if not isinstance(cdesc, dict):
            raise ImageError(f"refusing {self.label}: the manifest has no config")
        raw = _blob(layout, cdesc.get("digest"), "config")
        config = parse_json(raw, "config")
        if not isinstance(config, dict):
            raise ImageError(f"refusing {self.label}: the image config is not a JSON object")
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") if isinstance(config.get("rootfs"), dict) else None
        ldescs = manifest.get("layers")
        if not isinstance(ldescs, list) or not isinstance(diff_ids, list) or len(ldescs) != len(diff_ids):
            raise ImageError(f"refusing {self.label}: its manifest lists {len(ldescs or [])} layers but its config "
                             f"{len(diff_ids or [])} diff_ids")
        layers = []
        for i, (d, diff_id) in enumerate(zip(ldescs, diff_ids, strict=True)):
            if not isinstance(d, dict) or d.get("mediaType") not in _LAYER_TYPES:
                mt = d.get("mediaType") if isinstance(d, dict) else d
                hint = (" (zstd: convert with `skopeo copy --dest-compress-format gzip ...` first)"
                        if isinstance(mt, str) and "zstd" in mt else "")
                raise ImageError(f"refusing {self.label}: layer {i + 1} has media type {mt!r}{hint}")
            digest, size = d.get("digest"), d.get("size")
            if not isinstance(digest, str) or not digest.startswith("sha256:") or not HEX64.match(digest[7:]) \
                    or not isinstance(size, int) or not isinstance(diff_id, str):
                raise ImageError(f"refusing {self.label}: layer {i + 1} has a malformed descriptor")
            layers.append(Layer(digest=digest, diff_id=diff_id, size=size, media_type=d["mediaType"]))
        config["raw"] = raw
        return manifest_digest, config, tuple(layers)

    def _config(self, config: Mapping[str, Any], rootfs: str) -> ImageConfig:
        c = config.get("config") if isinstance(config.get("config"), dict) else {}
        assert isinstance(c, dict)
        env: list[tuple[str, str]] = []
        for item in c.get("Env") or ():
            if isinstance(item, str) and "=" in item and "\0" not in item:
                k, v = item.split("=", 1)
                if _ENV_NAME.match(k):
                    env.append((k, v))
                    continue
            self.notes.append(f"config Env entry {str(item)[:80]!r} ignored (not NAME=VALUE)")
        workdir = c.get("WorkingDir") or None
        if workdir is not None:
            try:  # the rules of a run's cwd: never under /proc, /sys or /dev (CVE-2024-21626 class)
                workdir = _validate.sandbox_cwd(workdir, "config WorkingDir")
            except PolicyError as err:
                self.notes.append(f"config WorkingDir ignored: {err}")
                workdir = None

        def argv(key: str) -> tuple[str, ...]:
            value = c.get(key)
            if value is None:
                return ()
            if isinstance(value, list) and all(isinstance(a, str) and "\0" not in a for a in value):
                return tuple(value)
            self.notes.append(f"config {key} ignored (not a list of strings)")
            return ()

        arch = str(config.get("architecture", ""))
        host = _GOARCH.get(platform.machine(), platform.machine())
        if arch and arch != host:
            self.notes.append(f"the image is built for {arch}, this host is {host}: its programs will fail with "
                              "'Exec format error' (unless binfmt_misc emulation is set up)")
        user = c.get("User") or ""
        if not isinstance(user, str) or "\0" in user:
            self.notes.append("config User ignored (not a string)")
            user = ""
        return ImageConfig(env=tuple(env), workdir=os.path.normpath(workdir) if workdir else None, user=user,
                           entrypoint=argv("Entrypoint"), cmd=argv("Cmd"),
                           architecture=str(config.get("architecture", "")), os=str(config.get("os", "")))


@functools.lru_cache(maxsize=1)
def _unpack_profile() -> Any:
    """The default seccomp profile without its setuid/setgid rules, for umoci only.

    umoci restores each file's mode as the layer has it, and a base image has setuid files
    (``su``, ``passwd``, ``mount``): under the default profile its chmod fails with EPERM. The
    bits it sets cannot help anyone: the output directory is bound ``nosuid`` into umoci's
    sandbox; on the host it is mode 0700, owned by the caller (unprivileged) or by the uid leased
    to this import alone (root), inside an unlistable directory of the store; and the bits are
    cleared on the host right after the unpack, before any sandbox sees the tree.
    """
    from dataclasses import replace

    from lowlevel.spec.seccomp import DEFAULT_PROFILE, _setid_rules
    setid = {r for r in _setid_rules() if r.syscall != "openat2"}
    return replace(DEFAULT_PROFILE, name="default-unpack",
                   rules=tuple(r for r in DEFAULT_PROFILE.rules if r not in setid))



__all__ = ["ImportJob", "ImportLimits", "ImportProgress", "ProgressFn"]
