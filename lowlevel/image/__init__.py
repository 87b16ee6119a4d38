"""Container images as sandbox roots: import once into a content-addressed store, run many.

``lowlevel image import FILE`` (:meth:`ImageStore.import_archive`) takes an OCI archive
(``skopeo copy ... oci-archive:FILE``, ``podman save --format oci-archive``), an OCI image
layout directory, or a ``docker save`` archive (plain or gzip-compressed). No registry is
contacted; on a host that reaches one, fetch first with
``skopeo copy docker://docker.io/library/python:3.12-slim oci-archive:python.tar:python:3.12-slim``.
``Policy(image="python:3.12-slim")`` then runs on it (:func:`apply_image`).

The store's layout, :class:`Image` and the lookups are :mod:`lowlevel.rootfs.store` (the read
side, which a sandbox run needs: below :mod:`lowlevel.sandbox`); this package adds what writes
the store: :class:`ImageStore` (import, tag, remove, under the store's lock), the import job
(:mod:`lowlevel.image.importer`, which runs sandboxes) and the host-side work on an unpacked
tree (:mod:`lowlevel.image.tree`). Every name of :mod:`lowlevel.rootfs.store` that
``docs/images.md`` shows is re-exported here (``lowlevel.image.Image``...).

One flattened rootfs per image, not layers stacked as overlay lower layers: bwrap 0.8
(Debian 12) has no overlay options and an unprivileged overlay needs the exec helper's private
mount namespace, while a flattened tree costs one bind per top-level directory per run whatever
the layer count. The price is disk: images that share base layers do not share their unpacked
files. The id (the image config's SHA-256, Docker's "IMAGE ID") names content: importing the
same image twice unpacks it once.

Images are untrusted input. The import runs every tool that reads the archive in a lowlevel
sandbox (default Policy: no network, seccomp, limits; the caller's uid, or for a root caller a
per-run host uid leased for the whole import): skopeo (to an OCI layout, checking every blob's digest), this package's
``_image_helper.py`` (refuses absolute and ``..`` member names, hard links leaving the tree,
unknown member types, more than ``max_entries`` entries or ``max_bytes`` of content, layers that
do not match their ``diff_id``; finds device nodes) and ``umoci raw unpack --rootless``
(whiteouts, hard links, and paths resolved inside the tree with filepath-securejoin; it writes
an empty file where a layer has a device node). Nothing but the import's own directory is
writable to them. Then, on the host, a walk that follows no symlink drops device nodes (and
umoci's empty stand-ins), sockets, setuid/setgid bits, group/other write bits and
``security.capability`` attributes, gives every file ``u+r`` and directory ``u+rx``, makes
everything owned by the store's owner, and hashes the tree. Any failure removes the import's
directory: the store never holds a partial image.

Sources: OCI image-spec (image-layout.md, manifest.md, config.md, layer.md); skopeo(1),
containers-transports(5); umoci-raw-unpack(1); CVE-2019-14271 (docker cp) and CVE-2018-15664
(symlink-exchange races) for why extraction runs confined.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterator, Mapping

from lowlevel.errors import ImageError, WorkspaceError
from lowlevel.image.importer import ImportJob, ImportLimits, ImportProgress, ProgressFn
from lowlevel.image.tree import atomic_write, rmtree
from lowlevel.rootfs.store import (ETC_PLACEHOLDERS, ROOT_STORE, SCHEMA, STORE_ENV, DamagedImageError, Image,
                                   ImageConfig, Layer, StoreReader, apply_image, check_record_rootfs, default_store_dir,
                                   doctor_checks, find_tool, image_record, normalize_name)


class ImageStore(StoreReader):
    """The image store at ``path`` (default :func:`default_store_dir`), read and written.

    Thread- and process-safe for imports, removals and name changes (``flock`` on
    ``<path>/lock``). Reading (:meth:`get`, :meth:`list_images`, from
    :class:`lowlevel.rootfs.store.StoreReader`) takes no lock: an image directory appears by one
    ``rename(2)`` and disappears by another.
    """

    def ensure(self) -> None:
        """Create the store's directories (root: mode 0755, so sandboxes' per-run uids can reach
        the trees; others: 0700) and check their owner and parents.

        Raises:
            ImageError: the store or a parent belongs to someone else, or is writable by others.
        """
        from lowlevel.host.trust import check_trusted_ancestors

        mode = 0o755 if os.geteuid() == 0 else 0o700
        try:
            os.makedirs(self.path, mode, exist_ok=True)
            for sub, sub_mode in ((self.images_dir, mode), (self.tmp_dir, 0o711 if os.geteuid() == 0 else 0o700)):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(sub, sub_mode)
        except OSError as err:
            raise ImageError(f"cannot create the image store {self.path}: {err.strerror}. Choose another "
                             f"directory with ${STORE_ENV} or --store") from err
        for p in (self.path, self.images_dir, self.tmp_dir):
            st = os.lstat(p)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise ImageError(f"the image store directory {p} must be a directory owned by uid {os.geteuid()} "
                                 f"and not writable by others (it is uid {st.st_uid}, mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}): fix it or choose another store")
        try:
            check_trusted_ancestors(os.path.join(self.path, "x"))
        except WorkspaceError as err:
            raise ImageError(f"unsafe image store location: {err}") from err

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write_names(self, names: Mapping[str, str]) -> None:
        atomic_write(os.path.join(self.path, "names.json"),
                      json.dumps(dict(sorted(names.items())), indent=1).encode() + b"\n")

    def tag(self, ref: str, name: str) -> Image:
        """Point ``name`` (``NAME[:TAG]``) at the image ``ref`` names; return it.

        Raises:
            ImageError: no such image, or an invalid name.
        """
        self.ensure()
        new = normalize_name(name)
        with self._locked():
            image = self.get(ref)
            names = self._names()
            names[new] = image.id
            self._write_names(names)
        return self.get(image.id)

    # -- removal -----------------------------------------------------------------------------------
    def remove(self, ref: str) -> tuple[list[str], Image | str | None]:
        """Remove a name or an image.

        ``ref`` a name: the name goes; the image too when no other name points at it. ``ref`` an
        id (or prefix): the image and all its names go. A damaged image (its ``image.json``
        unreadable or of the wrong shape) is removed whole, by name or id. A sandbox running on
        the image when its tree is deleted sees its files vanish: remove images no run uses.

        Returns:
            ``(names removed, the image deleted or None)``; for a damaged image deleted, its id
            (``sha256:<hex>``) instead of the Image.
        Raises:
            ImageError: no such image.
        """
        self.ensure()
        with self._locked():
            names = self._names()
            image: Image | None
            try:
                image = self.get(ref)
                image_id = image.id
            except DamagedImageError as err:
                image, image_id = None, err.image_id
            by_name = None
            with contextlib.suppress(ImageError):
                by_name = normalize_name(ref) if not ref.startswith("sha256:") else None
            if image is not None and by_name is not None and names.get(by_name) == image_id:
                del names[by_name]
                removed = [by_name]
                delete = image_id not in names.values()
            else:
                removed = sorted(n for n, i in names.items() if i == image_id)
                for n in removed:
                    del names[n]
                delete = True
            self._write_names(names)
            if not delete:
                return removed, None
            trash = tempfile.mkdtemp(prefix="rm-", dir=self.tmp_dir)
            os.rename(self.image_dir(image_id), os.path.join(trash, "image"))
        rmtree(trash)
        return removed, image if image is not None else image_id

    def prune(self) -> list[str]:
        """Remove every image no name points to: what an import under a name another image had
        leaves (the old one, ``<none>`` in ``image ls``), or an import killed between its commit
        and its name; an image imported without a name is one too. A sandbox running on such an
        image sees its files vanish, as with :meth:`remove`.

        Returns:
            The ids (``sha256:<hex>``) removed, damaged entries included.
        """
        self.ensure()
        with self._locked():
            named = set(self._names().values())
            gone = [f"sha256:{h}" for h in self._ids() if f"sha256:{h}" not in named]
            if not gone:
                return []
            trash = tempfile.mkdtemp(prefix="rm-", dir=self.tmp_dir)
            for i, image_id in enumerate(gone):
                os.rename(self.image_dir(image_id), os.path.join(trash, str(i)))
        rmtree(trash)
        return gone

    def _clean_stale(self) -> None:
        """Remove imports left by dead processes (``tmp/import-<pid>-*``) and old removals."""
        try:
            entries = os.listdir(self.tmp_dir)
        except OSError:
            return
        for name in entries:
            m = re.match(r"^import-(\d+)-", name)
            path = os.path.join(self.tmp_dir, name)
            if m:
                pid = int(m.group(1))
                try:
                    os.kill(pid, 0)
                    alive = True
                except ProcessLookupError:
                    alive = False
                except PermissionError:
                    alive = True
                if alive:
                    continue
            elif not name.startswith("rm-"):
                continue
            rmtree(path)

    # -- import ------------------------------------------------------------------------------------
    def import_archive(self, source: str | os.PathLike[str], *, name: str | None = None, ref: str | None = None,
                       limits: ImportLimits | None = None, progress: ProgressFn | None = None) -> Image:
        """Import an OCI archive, OCI layout directory or ``docker save`` archive.

        Args:
            source: the archive file or layout directory.
            name: ``NAME[:TAG]`` to give it (default: the name the archive records, if any).
            ref: which image of an archive holding several (its ``org.opencontainers.image.ref.name``
                or, for ``docker save``, a ``RepoTags`` entry).
            limits: bounds (:class:`ImportLimits`); default 8 GiB, 1,000,000 entries, 256 layers.
            progress: called with :class:`ImportProgress` reports as the import goes.
        Returns:
            The :class:`Image` (an image already in the store is not unpacked again; the names are
            added).
        Raises:
            ImageError: the archive is unreadable, hostile or over a bound, a tool is missing, or
                the store is unusable. Nothing is left in the store.
        """
        limits = limits or ImportLimits()
        src = os.path.abspath(os.fspath(source))
        if not os.path.exists(src):
            raise ImageError(f"{os.fspath(source)}: no such file or directory")
        if not (os.path.isfile(src) or os.path.isdir(src)):
            raise ImageError(f"{os.fspath(source)} is neither an archive file nor an OCI layout directory")
        wanted = normalize_name(name) if name is not None else None
        tools = {t: find_tool(t) for t in ("skopeo", "umoci")}
        for tool, path in tools.items():
            if path is None:
                raise ImageError(f"{tool} is not installed: the import needs it (apt-get install {tool})")
        self.ensure()
        self._clean_stale()
        # import-<pid>-<start time>-*: lowlevel cleanup tells a dead importer from a reused pid.
        from lowlevel.host.run_records import own_start_time
        staging = tempfile.mkdtemp(prefix=f"import-{os.getpid()}-{own_start_time() or 0}-", dir=self.tmp_dir)
        job = None
        try:
            job = ImportJob(self, src, staging, wanted, ref, limits, progress, tools)
            return job.run()
        finally:
            if job is not None:
                job.close()
            rmtree(staging)



__all__ = ["ETC_PLACEHOLDERS", "Image", "ImageConfig", "ImageError", "ImageStore", "ImportLimits", "ImportProgress",
           "Layer", "ProgressFn", "ROOT_STORE", "SCHEMA", "STORE_ENV", "apply_image", "check_record_rootfs",
           "default_store_dir", "doctor_checks", "find_tool", "image_record", "normalize_name"]
