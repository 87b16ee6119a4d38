"""Container images as sandbox roots: import once into a content-addressed store, run many.

``lowlevel image import FILE`` (:meth:`ImageStore.import_archive`) takes an OCI archive
(``skopeo copy ... oci-archive:FILE``, ``podman save --format oci-archive``), an OCI image
layout directory, or a ``docker save`` archive (plain or gzip-compressed). No registry is
contacted; on a host that reaches one, fetch first with
``skopeo copy docker://docker.io/library/python:3.12-slim oci-archive:python.tar:python:3.12-slim``.
``Policy(image="python:3.12-slim")`` then runs on it (:func:`apply_image`).

Store (base directory :func:`default_store_dir`: ``$LOWLEVEL_IMAGE_STORE``, else
``/var/lib/lowlevel/images`` for root, else ``$XDG_DATA_HOME/lowlevel/images``, i.e.
``~/.local/share/lowlevel/images``)::

    <base>/lock                  flock(2): commits, removals and name changes
    <base>/names.json            {"name:tag": "sha256:<id>"}, replaced atomically
    <base>/images/<id>/image.json  what :class:`Image` holds
    <base>/images/<id>/rootfs/   the flattened root filesystem, read-only to every sandbox
    <base>/images/<id>/last-used its mtime is the image's last use (a Policy built on it)
    <base>/tmp/import-*/         one import in progress; removed if it fails

One flattened rootfs per image, not layers stacked as overlay lower layers: bwrap 0.8
(Debian 12) has no overlay options and an unprivileged overlay needs the exec helper's private
mount namespace, while a flattened tree costs one bind per top-level directory per run whatever
the layer count. The price is disk: images that share base layers do not share their unpacked
files. The id (the image config's SHA-256, Docker's "IMAGE ID") names content: importing the
same image twice unpacks it once.

Identity: ``id`` is ``sha256:`` + the SHA-256 of the image config, which lists the SHA-256 of
each uncompressed layer (``rootfs.diff_ids``); ``manifest_digest`` is the manifest's, as
imported (a ``docker save`` archive gets a fresh OCI manifest, so its digest differs from the
registry's); ``rootfs_sha256`` is :func:`lowlevel.rootfs.tree_sha256` of the unpacked tree.

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
import dataclasses
import datetime
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lowlevel.spec import validate as _validate
from lowlevel.errors import ImageError, LowlevelError, PolicyError

if TYPE_CHECKING:
    from lowlevel.spec.policy import Policy
    from lowlevel.sandbox.result import Result

log = logging.getLogger("lowlevel")

#: ``schema`` of image.json files.
SCHEMA = "lowlevel-image/1"
#: Environment variable naming the store directory.
STORE_ENV = "LOWLEVEL_IMAGE_STORE"
#: Default store of root callers.
ROOT_STORE = "/var/lib/lowlevel/images"
#: Files the import creates empty in ``/etc`` when the image lacks them: bwrap mounts the
#: synthesized passwd/group (and, with ``network=True``, the host's resolv.conf and hosts) over
#: them, and cannot create a mount point in a read-only tree.
ETC_PLACEHOLDERS = ("etc/passwd", "etc/group", "etc/resolv.conf", "etc/hosts")

GiB = 1024 ** 3
MiB = 1024 ** 2
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEXPREFIX = re.compile(r"^[0-9a-f]{12,64}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._/:-]{0,254}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: uname -m -> the OCI/Go architecture name.
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "i686": "386", "i386": "386", "armv7l": "arm",
           "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}
_MAX_JSON = 4 * MiB
_LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
                "application/vnd.oci.image.layer.nondistributable.v1.tar",
                "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
                "application/vnd.docker.image.rootfs.diff.tar.gzip")


def default_store_dir() -> str:
    """The store directory: ``$LOWLEVEL_IMAGE_STORE``; else ``/var/lib/lowlevel/images`` for
    root; else ``$XDG_DATA_HOME/lowlevel/images`` (``~/.local/share/lowlevel/images``)."""
    env = os.environ.get(STORE_ENV)
    if env:
        return os.path.abspath(env)
    if os.geteuid() == 0:
        return ROOT_STORE
    data = os.environ.get("XDG_DATA_HOME")
    if not data or not os.path.isabs(data):
        data = os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(data, "lowlevel", "images")


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
class Layer:
    """One layer as imported: ``digest`` (compressed blob, ``sha256:...``), ``diff_id``
    (uncompressed), ``size`` (blob bytes), ``media_type``, ``entries`` and ``bytes`` (content)."""

    digest: str
    diff_id: str
    size: int
    media_type: str
    entries: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class ImageConfig:
    """The run defaults an image's config gives (OCI config.md ``config``).

    Attributes:
        env: ``Env`` as ``(name, value)`` pairs, in order (invalid names dropped at import).
        workdir: ``WorkingDir`` (absolute) or None.
        user: ``User`` as written (``""`` means root, as in Docker).
        user_ids: ``(uid, gid)`` that ``user`` names, looked up in the image's ``/etc/passwd`` and
            ``/etc/group`` at import; None when it names an account the image lacks.
        entrypoint, cmd: ``Entrypoint`` and ``Cmd``.
        architecture, os: the platform the image was built for (``amd64``, ``linux``).
    """

    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None
    user: str = ""
    user_ids: tuple[int, int] | None = (0, 0)
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    architecture: str = ""
    os: str = ""


@dataclass(frozen=True)
class Image:
    """An image in the store.

    Attributes:
        id: ``sha256:<hex>`` of the image config (the store key).
        manifest_digest: ``sha256:<hex>`` of the manifest as imported.
        names: ``name:tag`` references pointing at it.
        rootfs: host path of its unpacked tree (read-only; pass ``image=`` to a Policy instead).
        rootfs_sha256: :func:`lowlevel.rootfs.tree_sha256` of the tree.
        size_bytes: bytes of file content in the tree.
        entries: entries in the tree.
        layers: the layers, bottom first.
        config: run defaults.
        imported_at: ISO 8601 UTC time of the import.
        last_used: when a Policy was last built on it (epoch seconds), or None.
        source: ``{"kind", "path", "ref"}`` of the archive it came from.
        notes: what the import changed (device nodes dropped, setid bits cleared...).
    """

    id: str
    manifest_digest: str
    names: tuple[str, ...]
    rootfs: str
    rootfs_sha256: str
    size_bytes: int
    entries: int
    layers: tuple[Layer, ...]
    config: ImageConfig
    imported_at: str
    last_used: float | None = None
    source: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def short_id(self) -> str:
        """The first 12 hex digits of the id (as ``docker images`` shows)."""
        return self.id[7:19]

    def command(self, args: Sequence[str] | None = None) -> list[str]:
        """The image's default command: ``Entrypoint`` + (``args`` or ``Cmd``), as Docker runs it.

        Raises:
            ImageError: the result is empty (the image has neither and no args were given).
        """
        argv = [*self.config.entrypoint, *(args if args else self.config.cmd)]
        if not argv:
            raise ImageError(f"image {self.names[0] if self.names else self.short_id} has no Entrypoint or "
                             "Cmd: give a command")
        return argv

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (what ``lowlevel image ls --json`` prints per image)."""
        doc = dataclasses.asdict(self)
        doc["source"] = dict(self.source)
        return doc


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


# --- names ------------------------------------------------------------------------------------

def normalize_name(name: str) -> str:
    """``busybox`` -> ``busybox:latest``; ``docker.io/library/x:1`` -> ``x:1``.

    Raises:
        ImageError: not a valid ``[host[:port]/]path[:tag]`` reference (lower-case path).
    """
    if not isinstance(name, str) or not name:
        raise ImageError(f"invalid image name {name!r}")
    ref = name.split("@", 1)[0]
    for prefix in ("docker.io/library/", "index.docker.io/library/", "docker.io/", "index.docker.io/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix):]
            break
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        repo, tag = ref.rsplit(":", 1)
    else:
        repo, tag = ref, "latest"
    if not _NAME.match(repo) or ".." in repo or repo.endswith("/") or "//" in repo or not _TAG.match(tag) \
            or repo.startswith("sha256"):
        raise ImageError(f"invalid image name {name!r}: use NAME[:TAG] with a lower-case name (e.g. python:3.12)")
    return f"{repo}:{tag}"


# --- tools --------------------------------------------------------------------------------------

def find_tool(name: str) -> str | None:
    """Absolute path of ``skopeo``/``umoci`` on PATH (or /usr/bin, /usr/sbin), or None."""
    found = shutil.which(name) or next((p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}")
                                        if os.access(p, os.X_OK)), None)
    return os.path.realpath(found) if found else None


def _sandbox_python() -> str:
    """The host's python3 under /usr, which every default sandbox sees."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(cand, os.X_OK):
            return cand
    raise ImageError("no /usr/bin/python3 on this host: the import checks layers with it inside a sandbox")


def _helper_source() -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_image_helper.py"), encoding="utf-8") as f:
        return f.read()


def _in_event_loop() -> bool:
    import asyncio
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# --- small fd-relative file helpers -------------------------------------------------------------

def _read_bounded(path: str, limit: int, what: str) -> bytes:
    """Read a regular file (no symlink followed at the last component) of at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise ImageError(f"cannot read {what}: {err.strerror}") from err
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ImageError(f"{what} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ImageError(f"{what} is larger than {limit} bytes")
    return data


def _blob(layout: str, digest: Any, what: str, limit: int = _MAX_JSON) -> bytes:
    if not isinstance(digest, str) or not digest.startswith("sha256:") or not _HEX64.match(digest[7:]):
        raise ImageError(f"the image's {what} has a malformed digest {digest!r}")
    data = _read_bounded(os.path.join(layout, "blobs", "sha256", digest[7:]), limit, f"the image's {what}")
    if hashlib.sha256(data).hexdigest() != digest[7:]:
        raise ImageError(f"the image's {what} does not match its digest {digest}")
    return data


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as err:
        raise ImageError(f"the image's {what} is not valid JSON: {err}") from err


def _make_writable_dirs(path: str) -> None:
    """Give u+rwx to every directory below ``path`` (no symlink followed), so a tree holding
    read-only directories (an image's 0555 ``/proc``) can be removed by an unprivileged owner."""
    from lowlevel.rootfs import walk
    try:
        rootfd = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    try:
        os.fchmod(rootfd, 0o700)
        for _rel, name, dirfd, st in walk(rootfd, onerror=lambda _r, _e: None):
            if stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
                with contextlib.suppress(OSError):
                    os.chmod(name, stat.S_IMODE(st.st_mode) | 0o700, dir_fd=dirfd, follow_symlinks=False)
    finally:
        os.close(rootfd)


def _rmtree(path: str) -> None:
    """Remove a tree this module made (fd-based, never following a symlink)."""
    if not os.path.lexists(path):
        return
    if os.geteuid() != 0:
        _make_writable_dirs(path)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        log.warning("lowlevel: could not remove %s completely", path)


def _atomic_write(path: str, data: bytes, mode: int = 0o644) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# --- the store ------------------------------------------------------------------------------------

class ImageStore:
    """The image store at ``path`` (default :func:`default_store_dir`).

    Thread- and process-safe for imports, removals and name changes (``flock`` on
    ``<path>/lock``). Reading (:meth:`get`, :meth:`list_images`) takes no lock: an image directory
    appears by one ``rename(2)`` and disappears by another.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path)) if path is not None else default_store_dir()

    # -- layout ---------------------------------------------------------------------------------
    @property
    def images_dir(self) -> str:
        return os.path.join(self.path, "images")

    @property
    def tmp_dir(self) -> str:
        return os.path.join(self.path, "tmp")

    def image_dir(self, image_id: str) -> str:
        """Directory of image ``sha256:<hex>``."""
        return os.path.join(self.images_dir, image_id.split(":", 1)[-1])

    def ensure(self) -> None:
        """Create the store's directories (root: mode 0755, so sandboxes' per-run uids can reach
        the trees; others: 0700) and check their owner and parents.

        Raises:
            ImageError: the store or a parent belongs to someone else, or is writable by others.
        """
        from lowlevel.workspace import check_trusted_ancestors
        from lowlevel.errors import WorkspaceError

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

    # -- names ----------------------------------------------------------------------------------
    def _names(self) -> dict[str, str]:
        path = os.path.join(self.path, "names.json")
        if not os.path.lexists(path):
            return {}
        doc = _json(_read_bounded(path, 16 * MiB, f"{path}"), "names.json")
        if not isinstance(doc, dict):
            raise ImageError(f"{path} is not a JSON object: remove it and re-tag the images")
        return {str(k): str(v) for k, v in doc.items() if isinstance(v, str) and v.startswith("sha256:")}

    def _write_names(self, names: Mapping[str, str]) -> None:
        _atomic_write(os.path.join(self.path, "names.json"),
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

    # -- reading ----------------------------------------------------------------------------------
    def _load(self, hexid: str, names: Mapping[str, str]) -> Image | None:
        d = os.path.join(self.images_dir, hexid)
        try:
            doc = _json(_read_bounded(os.path.join(d, "image.json"), 16 * MiB, "image.json"), "image.json")
        except ImageError as err:
            log.warning("lowlevel: skipping %s in the image store: %s", d, err)
            return None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("id") != f"sha256:{hexid}":
            log.warning("lowlevel: skipping %s in the image store: not a %s image.json", d, SCHEMA)
            return None
        try:
            last: float | None = os.stat(os.path.join(d, "last-used")).st_mtime
        except OSError:
            last = None
        c = doc["config"]
        user_ids = c.get("user_ids")
        config = ImageConfig(env=tuple((str(k), str(v)) for k, v in c.get("env", ())), workdir=c.get("workdir"),
                             user=str(c.get("user", "")),
                             user_ids=(int(user_ids[0]), int(user_ids[1])) if user_ids else None,
                             entrypoint=tuple(map(str, c.get("entrypoint") or ())),
                             cmd=tuple(map(str, c.get("cmd") or ())),
                             architecture=str(c.get("architecture", "")), os=str(c.get("os", "")))
        layers = tuple(Layer(**{k: v for k, v in layer.items() if k in Layer.__dataclass_fields__})
                       for layer in doc.get("layers", ()))
        return Image(id=doc["id"], manifest_digest=doc.get("manifest_digest", ""),
                     names=tuple(sorted(n for n, i in names.items() if i == doc["id"])),
                     rootfs=os.path.join(d, "rootfs"), rootfs_sha256=doc["rootfs"]["sha256"],
                     size_bytes=int(doc["rootfs"]["bytes"]), entries=int(doc["rootfs"]["entries"]), layers=layers,
                     config=config, imported_at=doc.get("imported_at", ""), last_used=last,
                     source=doc.get("source") or {}, notes=tuple(doc.get("notes", ())))

    def _ids(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.images_dir) if _HEX64.match(n))
        except FileNotFoundError:
            return []
        except OSError as err:
            raise ImageError(f"cannot list the image store {self.images_dir}: {err.strerror}") from err

    def list_images(self) -> list[Image]:
        """Every image in the store, most recently imported first."""
        names = self._names()
        out = [img for img in (self._load(h, names) for h in self._ids()) if img is not None]
        return sorted(out, key=lambda i: i.imported_at, reverse=True)

    def get(self, ref: str) -> Image:
        """The image ``ref`` names: ``NAME[:TAG]``, ``sha256:<id>``, a unique id prefix of at least
        12 hex digits (with or without ``sha256:``), or a manifest digest.

        Raises:
            ImageError: no such image (the message lists the fix), or an ambiguous prefix.
        """
        if not isinstance(ref, str) or not ref or "\0" in ref:
            raise ImageError(f"invalid image reference {ref!r}")
        names = self._names()
        ids = self._ids()
        hexref = ref[7:] if ref.startswith("sha256:") else ref
        found: str | None = None
        if not ref.startswith("sha256:"):
            with contextlib.suppress(ImageError):
                target = names.get(normalize_name(ref))
                if target is not None and target[7:] in ids:
                    found = target[7:]
        if found is None and _HEXPREFIX.match(hexref):
            matches = [h for h in ids if h.startswith(hexref)]
            if len(matches) > 1:
                raise ImageError(f"image id prefix {ref!r} is ambiguous ({len(matches)} images): give more digits")
            if matches:
                found = matches[0]
        if found is None and ref.startswith("sha256:") and _HEX64.match(hexref):
            for h in ids:
                img = self._load(h, names)
                if img is not None and img.manifest_digest == ref:
                    found = h
                    break
        if found is None:
            short = " (an id prefix needs at least 12 hex digits)" if re.fullmatch(r"[0-9a-f]{1,11}", hexref) else ""
            raise ImageError(f"no image {ref!r} in the store {self.path}{short}: import it with `lowlevel image "
                             f"import ARCHIVE` (see `lowlevel image ls`; another store? set ${STORE_ENV})")
        img = self._load(found, names)
        if img is None:
            raise ImageError(f"image {ref!r} in the store {self.path} is damaged: remove it (`lowlevel image rm "
                             f"sha256:{found}`) and import it again")
        return img

    def touch(self, image: Image) -> None:
        """Record a use of ``image`` (mtime of its ``last-used`` file); silent when read-only."""
        path = os.path.join(self.image_dir(image.id), "last-used")
        try:
            os.utime(path)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
        except OSError:
            pass

    # -- removal -----------------------------------------------------------------------------------
    def remove(self, ref: str) -> tuple[list[str], Image | None]:
        """Remove a name or an image.

        ``ref`` a name: the name goes; the image too when no other name points at it. ``ref`` an
        id (or prefix): the image and all its names go. A sandbox running on the image when its
        tree is deleted sees its files vanish: remove images no run uses.

        Returns:
            ``(names removed, the image deleted or None)``.
        Raises:
            ImageError: no such image.
        """
        self.ensure()
        with self._locked():
            names = self._names()
            image = self.get(ref)
            by_name = None
            with contextlib.suppress(ImageError):
                by_name = normalize_name(ref) if not ref.startswith("sha256:") else None
            if by_name is not None and names.get(by_name) == image.id:
                del names[by_name]
                removed = [by_name]
                delete = image.id not in names.values()
            else:
                removed = sorted(n for n, i in names.items() if i == image.id)
                for n in removed:
                    del names[n]
                delete = True
            self._write_names(names)
            if not delete:
                return removed, None
            trash = tempfile.mkdtemp(prefix="rm-", dir=self.tmp_dir)
            os.rename(self.image_dir(image.id), os.path.join(trash, "image"))
        _rmtree(trash)
        return removed, image

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
            _rmtree(path)

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
            job = _Import(self, src, staging, wanted, ref, limits, progress, tools)
            return job.run()
        finally:
            if job is not None:
                job.close()
            _rmtree(staging)


class _Import:
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
            from lowlevel.workspace.cow import UidLease
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
        if os.geteuid() == 0 and not _readable_by_others(self.src):
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
        store = self.store
        binds, inside = self._stage_input()
        source_bytes = _tree_bytes(self.src)
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
        layout = os.path.join(self.out, "layout")
        self._report("copy", 0, source_bytes)
        factor = 2 if kind == "oci-archive" else 1  # skopeo extracts an oci-archive, then copies its blobs
        self._tool([str(self.tools["skopeo"]), "--insecure-policy", "--tmpdir", "/out/tmp", "copy", "--quiet",
                    spec, "oci:/out/layout:import"], f"skopeo copying {self.label}", binds=copy_binds,
                   tick=lambda: self._report("copy", min(source_bytes, _tree_bytes(self.out) // factor),
                                             source_bytes))
        _rmtree(os.path.join(self.out, "in"))
        manifest_digest, config, layers = self._read_layout(layout)
        image_id = "sha256:" + hashlib.sha256(config["raw"]).hexdigest()
        names = [self.name] if self.name else recorded
        if os.path.isdir(store.image_dir(image_id)):
            self._report("done", 1, 1, layers=len(layers))
            return self._commit_names(image_id, names)
        if len(layers) > self.limits.max_layers:
            raise ImageError(f"refusing {self.label}: {len(layers)} layers, more than {self.limits.max_layers} "
                             "(ImportLimits.max_layers)")
        total_blob = sum(layer.size for layer in layers)
        progress_file = os.path.join(self.out, "tmp", "scan.progress")

        def scan_tick() -> None:
            try:
                text = _read_bounded(progress_file, 64, "progress").decode()
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
        want_bytes, want_entries = int(summary["bytes"]), int(summary["entries"])
        _check_space(self.out, want_bytes, want_entries)
        for key, what in (("setid", "setuid/setgid file"), ("caps", "file with capabilities (security.capability)"),
                          ("devices", "device node")):
            count = sum(int(s[key]) for s in summary["layers"])
            if count:
                self.notes.append(f"{count} {what}{'s' if count != 1 else ''} in the layers: "
                                  + {"setid": "bits cleared", "caps": "attribute removed",
                                     "devices": "dropped"}[key])
        rootfs = os.path.join(self.out, "rootfs")
        base_used = _fs_used(self.out)
        self._report("unpack", 0, want_bytes, layers=len(layers))
        self._tool([str(self.tools["umoci"]), "--log=error", "raw", "unpack", "--rootless", "--image",
                    "/out/layout:import", "/out/rootfs"], f"umoci unpacking {self.label}", setid=True,
                   tick=lambda: self._report("unpack", max(0, min(want_bytes, _fs_used(self.out) - base_used)),
                                             want_bytes, layers=len(layers)))
        self._report("unpack", want_bytes, want_bytes, layers=len(layers))
        _rmtree(layout)
        cfg = self._config(config, rootfs)
        self._report("verify", 0, want_bytes, layers=len(layers))
        self.notes.extend(_neutralize(rootfs, summary["devices"], fix_caps=any(s["caps"] for s in summary["layers"])))
        self.notes.extend(_ensure_placeholders(rootfs))
        if cfg.workdir and _make_workdir(rootfs, cfg.workdir):
            self.notes.append(f"created the config's WorkingDir {cfg.workdir} (missing from the layers; Docker "
                              "creates it too)")
        cfg = dataclasses.replace(cfg, user_ids=_user_ids(rootfs, cfg.user, self.notes))
        from lowlevel.rootfs import tree_sha256
        try:
            digest = tree_sha256(rootfs, lambda done: self._report("verify", min(done, want_bytes), want_bytes,
                                                                   layers=len(layers)))
        except OSError as err:
            raise ImageError(f"cannot hash the unpacked tree of {self.label}: {err}") from err
        os.rename(rootfs, os.path.join(self.staging, "rootfs"))
        rootfs = os.path.join(self.staging, "rootfs")
        _rmtree(self.out)
        _rmtree(self.ws)
        from lowlevel import __version__
        meta = {"schema": SCHEMA, "id": image_id, "manifest_digest": manifest_digest, "imported_at": _now(),
                "source": {"kind": kind, "path": self.src, "ref": self.ref},
                "layers": [dataclasses.asdict(layer) for layer in layers],
                "config": {"env": [list(p) for p in cfg.env], "workdir": cfg.workdir, "user": cfg.user,
                           "user_ids": list(cfg.user_ids) if cfg.user_ids else None,
                           "entrypoint": list(cfg.entrypoint), "cmd": list(cfg.cmd),
                           "architecture": cfg.architecture, "os": cfg.os},
                "rootfs": {"sha256": digest.sha256, "entries": digest.entries, "bytes": digest.bytes},
                "notes": self.notes, "lowlevel": __version__}
        _atomic_write(os.path.join(self.staging, "image.json"), json.dumps(meta, indent=1).encode() + b"\n")
        os.close(os.open(os.path.join(self.staging, "last-used"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        mode = 0o755 if os.geteuid() == 0 else 0o700
        os.chmod(rootfs, 0o755)
        os.chmod(self.staging, mode)
        with store._locked():
            final = store.image_dir(image_id)
            if not os.path.isdir(final):
                os.rename(self.staging, final)
                os.mkdir(self.staging, 0o700)  # the caller's cleanup removes this empty stand-in
        self._report("done", want_bytes, want_bytes, layers=len(layers))
        return self._commit_names(image_id, names)

    def _commit_names(self, image_id: str, names: Sequence[str]) -> Image:
        store = self.store
        if names:
            with store._locked():
                current = store._names()
                for n in names:
                    current[n] = image_id
                store._write_names(current)
        return store.get(image_id)

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
        index = _json(_read_bounded(os.path.join(layout, "index.json"), _MAX_JSON, "index.json"), "index.json")
        manifests = index.get("manifests") if isinstance(index, dict) else None
        if not isinstance(manifests, list) or len(manifests) != 1 or not isinstance(manifests[0], dict):
            raise ImageError(f"refusing {self.label}: skopeo's index.json does not hold exactly one image")
        desc = manifests[0]
        if desc.get("mediaType") not in (None, "application/vnd.oci.image.manifest.v1+json"):
            raise ImageError(f"refusing {self.label}: unexpected manifest type {desc.get('mediaType')!r}")
        manifest_digest = str(desc.get("digest"))
        manifest = _json(_blob(layout, manifest_digest, "manifest"), "manifest")
        if not isinstance(manifest, dict) or manifest.get("schemaVersion") != 2:
            raise ImageError(f"refusing {self.label}: the manifest is not an OCI schemaVersion 2 manifest")
        cdesc = manifest.get("config")
        if not isinstance(cdesc, dict):
            raise ImageError(f"refusing {self.label}: the manifest has no config")
        raw = _blob(layout, cdesc.get("digest"), "config")
        config = _json(raw, "config")
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
            if not isinstance(digest, str) or not digest.startswith("sha256:") or not _HEX64.match(digest[7:]) \
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


def _readable_by_others(path: str) -> bool:
    """True when a root caller's sandbox (a per-run uid: "others") can read ``path`` (file or tree)."""
    from lowlevel.rootfs import rootfs_unreachable
    if rootfs_unreachable(os.path.dirname(path), -1, -1):
        return False
    if os.path.isfile(path):
        return bool(os.stat(path).st_mode & stat.S_IROTH)
    for dirpath, dirnames, filenames in os.walk(path):
        if not os.stat(dirpath).st_mode & (stat.S_IROTH | stat.S_IXOTH) == stat.S_IROTH | stat.S_IXOTH:
            return False
        for f in filenames:
            try:
                if not os.lstat(os.path.join(dirpath, f)).st_mode & stat.S_IROTH:
                    return False
            except OSError:
                return False
        del dirnames[10_000:]
    return True


def _tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (or of the file)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def _fs_used(path: str) -> int:
    """Bytes in use on the filesystem of ``path`` (for the unpack estimate)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _check_space(path: str, want_bytes: int, want_entries: int) -> None:
    """Refuse an unpack that cannot fit (content plus a block per entry, and the inodes)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return
    need = want_bytes + want_entries * 4096
    have = st.f_bavail * st.f_frsize
    if need > have:
        raise ImageError(f"not enough space for the image under {path}: it needs about {need // MiB} MiB, "
                         f"{have // MiB} MiB are free. Free space or choose another store (${STORE_ENV})")
    if st.f_files and want_entries > st.f_favail:
        raise ImageError(f"not enough inodes under {path}: the image has {want_entries} entries, "
                         f"{st.f_favail} inodes are free")


def _open_parent(rootfd: int, rel: str) -> tuple[int, str] | None:
    """Fd of the directory holding ``rel`` (no symlink followed) and the leaf name, or None."""
    parts = rel.split("/")
    fd = os.dup(rootfd)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except OSError:
        os.close(fd)
        return None
    return fd, parts[-1]


def _neutralize(rootfs: str, devices: Sequence[str], *, fix_caps: bool) -> list[str]:
    """Make the unpacked tree safe to share (see the module docstring); return notes."""
    from lowlevel.rootfs import walk

    notes: list[str] = []
    uid, gid = os.geteuid(), os.getegid()
    rootfd = os.open(rootfs, _DIR_FLAGS)
    try:
        if uid == 0:
            os.fchown(rootfd, uid, gid)  # made by the tools' leased uid
        for rel in devices:
            opened = _open_parent(rootfd, rel)
            if opened is None:
                continue
            fd, leaf = opened
            try:
                st = os.lstat(leaf, dir_fd=fd)
                if (stat.S_ISREG(st.st_mode) and st.st_size == 0) or stat.S_ISCHR(st.st_mode) \
                        or stat.S_ISBLK(st.st_mode):
                    os.unlink(leaf, dir_fd=fd)
            except OSError:
                pass
            finally:
                os.close(fd)
        special = 0
        foreign = 0
        for _rel, name, dirfd, st in walk(rootfd):
            mode = st.st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
                os.unlink(name, dir_fd=dirfd)
                special += 1
                continue
            if (st.st_uid, st.st_gid) != (uid, gid):
                if uid != 0:
                    foreign += 1
                else:
                    os.chown(name, uid, gid, dir_fd=dirfd, follow_symlinks=False)
            if stat.S_ISLNK(mode):
                continue
            cur = stat.S_IMODE(mode)
            want = cur & ~(stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH)
            want |= stat.S_IRUSR | (stat.S_IXUSR if stat.S_ISDIR(mode) else 0)
            if want != cur or (uid == 0 and (st.st_uid, st.st_gid) != (uid, gid)):
                os.chmod(name, want, dir_fd=dirfd, follow_symlinks=False)
            if fix_caps and stat.S_ISREG(mode):
                with contextlib.suppress(OSError):
                    os.removexattr(f"/proc/self/fd/{dirfd}/{name}", "security.capability", follow_symlinks=False)
        if special:
            notes.append(f"{special} device nodes or sockets removed from the tree")
        if foreign:
            raise ImageError(f"{foreign} entries of the unpacked tree belong to another user: cannot make it safe")
    except OSError as err:
        raise ImageError(f"cannot neutralise the unpacked tree {rootfs}: {err}") from err
    finally:
        os.close(rootfd)
    return notes


def _elsewhere(virtual: str) -> bool:
    from lowlevel.rootfs import RESERVED_TOP
    return virtual.split("/")[1] in RESERVED_TOP


def _ensure_placeholders(rootfs: str) -> list[str]:
    """Create the empty :data:`ETC_PLACEHOLDERS` the image lacks; return notes."""
    from lowlevel.rootfs import resolve_in_root

    notes = []
    for rel in ETC_PLACEHOLDERS:
        host = resolve_in_root(rootfs, "/" + rel, _elsewhere)
        if host is None:
            raise ImageError(f"the image's /{rel} resolves into a directory the sandbox provides itself "
                             "(/proc, /dev, /sys, /tmp, /workspace): cannot run it")
        if host:
            if not stat.S_ISREG(os.lstat(host).st_mode):
                raise ImageError(f"the image's /{rel} is not a regular file: cannot mount over it")
            continue
        parent = resolve_in_root(rootfs, "/" + os.path.dirname(rel), _elsewhere)
        if parent is None:
            raise ImageError(f"the image's /{os.path.dirname(rel)} resolves outside its tree: cannot run it")
        if parent == "":
            # No /etc at all: make it (resolve again: the path may go through a dangling symlink).
            parent = os.path.join(rootfs, os.path.dirname(rel))
            if os.path.lexists(parent):
                raise ImageError(f"the image's /{os.path.dirname(rel)} is a dangling symlink: cannot run it")
            os.mkdir(parent, 0o755)
        elif not os.path.isdir(parent) or os.path.islink(parent):
            raise ImageError(f"the image's /{os.path.dirname(rel)} is not a directory: cannot run it")
        fd = os.open(os.path.join(parent, os.path.basename(rel)),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        os.close(fd)
        notes.append(f"created an empty /{rel} (the sandbox mounts its own over it)")
    return notes


def _make_workdir(rootfs: str, workdir: str) -> bool:
    """Create ``workdir`` inside the tree when missing (never through a symlink); True if made."""
    from lowlevel.rootfs import resolve_in_root
    if resolve_in_root(rootfs, workdir, _elsewhere) != "":
        return False
    rootfd = os.open(rootfs, _DIR_FLAGS)
    fd = os.dup(rootfd)
    try:
        for part in [p for p in workdir.split("/") if p and p != "."]:
            if part == "..":
                return False
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                return False  # a symlink or a file on the way: leave it as the image has it
            os.close(fd)
            fd = nfd
        return True
    finally:
        os.close(fd)
        os.close(rootfd)


def _parse_db(rootfs: str, rel: str) -> list[list[str]]:
    from lowlevel.rootfs import resolve_in_root
    host = resolve_in_root(rootfs, "/" + rel, _elsewhere)
    if not host:
        return []
    try:
        text = _read_bounded(host, 16 * MiB, f"/{rel}").decode("utf-8", "replace")
    except ImageError:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _user_ids(rootfs: str, user: str, notes: list[str]) -> tuple[int, int] | None:
    """The ``(uid, gid)`` Docker would run ``User`` as, looked up in the image (None: unknown)."""
    def idnum(text: str) -> int | None:
        if text.isdigit() and int(text) < 2**32 - 1:
            return int(text)
        return None

    if not user:
        return (0, 0)
    name, _, group = user.partition(":")
    passwd = _parse_db(rootfs, "etc/passwd")
    uid = idnum(name)
    gid: int | None = None
    entry = next((p for p in passwd if len(p) >= 4 and (p[0] == name or (uid is not None and p[2] == name))), None)
    if uid is None:
        if entry is None or idnum(entry[2]) is None:
            notes.append(f"config User {user!r}: no such user in the image's /etc/passwd")
            return None
        uid = idnum(entry[2])
    if group:
        gid = idnum(group)
        if gid is None:
            g = next((p for p in _parse_db(rootfs, "etc/group") if len(p) >= 3 and p[0] == group), None)
            gid = idnum(g[2]) if g else None
            if gid is None:
                notes.append(f"config User {user!r}: no such group in the image's /etc/group")
                return None
    else:
        gid = idnum(entry[3]) if entry is not None else 0
        if gid is None:
            gid = 0
    assert uid is not None
    return (uid, gid)


# --- Policy(image=...) --------------------------------------------------------------------------

def apply_image(policy: Policy) -> None:
    """Resolve ``policy.image`` in the default store and apply the image (for ``Policy.__post_init__``).

    Sets ``image`` to ``"sha256:<id>"``, ``rootfs`` to the image's tree, ``env`` to the image's
    ``Env`` overridden by the Policy's own, ``sandbox_uid``/``sandbox_gid`` (those not given) from
    the image's ``User``, and ``workdir`` (when not given) from ``WorkingDir``. Idempotent, so
    ``dataclasses.replace`` and record replay rebuild the same Policy.

    Raises:
        PolicyError: no such image (the message says how to import it), a ``rootfs`` that is not
            the image's, or an image ``User`` missing from the image.
    """
    ref = policy.image
    if not isinstance(ref, str):
        raise PolicyError(f"Policy.image must be a str (name:tag or sha256:<id>), got {type(ref).__name__}")
    store = ImageStore()
    try:
        img = store.get(ref)
    except ImageError as err:
        raise PolicyError(str(err)) from err
    if policy.rootfs is not None and os.path.realpath(policy.rootfs) != os.path.realpath(img.rootfs):
        raise PolicyError("give Policy.image or Policy.rootfs, not both (an image brings its own rootfs)")
    object.__setattr__(policy, "image", img.id)
    object.__setattr__(policy, "rootfs", img.rootfs)
    merged = dict(img.config.env)
    merged.update(dict(policy.env))
    object.__setattr__(policy, "env", tuple(sorted(merged.items())))
    if policy.sandbox_uid is None or policy.sandbox_gid is None:
        if img.config.user_ids is None:
            raise PolicyError(f"image {ref!r}: its config User {img.config.user!r} is not in the image's /etc/passwd; "
                              "set Policy(sandbox_uid=..., sandbox_gid=...)")
        if policy.sandbox_uid is None:
            object.__setattr__(policy, "sandbox_uid", img.config.user_ids[0])
        if policy.sandbox_gid is None:
            object.__setattr__(policy, "sandbox_gid", img.config.user_ids[1])
    if policy.workdir is None and img.config.workdir:
        object.__setattr__(policy, "workdir", img.config.workdir)
    store.touch(img)


def image_record(policy: Policy) -> dict[str, Any] | None:
    """The ``rootfs`` part of a run record: None in host mode; else ``{"path", "sha256", "image"}``
    with ``image`` = ``{"id", "manifest_digest", "names"}`` or None for a bare rootfs (hashed now)."""
    if policy.rootfs is None:
        return None
    if policy.image is not None:
        img = ImageStore().get(policy.image)
        return {"path": img.rootfs, "sha256": img.rootfs_sha256,
                "image": {"id": img.id, "manifest_digest": img.manifest_digest, "names": list(img.names)}}
    from lowlevel.rootfs import tree_sha256
    return {"path": policy.rootfs, "sha256": tree_sha256(policy.rootfs).sha256, "image": None}


def check_record_rootfs(recorded: Any, policy: Policy) -> None:
    """Refuse to replay when the record's rootfs or image is not what ``policy`` would run on.

    Raises:
        LowlevelError (a RecordError from the caller's view): the image is missing, or the tree's
            hash differs; the message says how to fix it.
    """
    if recorded is None:
        return
    if not isinstance(recorded, Mapping) or not isinstance(recorded.get("sha256"), str):
        raise ImageError(f"refusing the record: its rootfs entry is malformed: {recorded!r}")
    want = recorded["sha256"]
    image = recorded.get("image")
    if isinstance(image, Mapping):
        img = ImageStore().get(str(policy.image))
        if img.rootfs_sha256 != want:
            raise ImageError(f"the record ran on image {image.get('id')} with rootfs sha256 {want}, but that image "
                             f"here unpacks to {img.rootfs_sha256} (imported by another lowlevel version, or "
                             f"damaged): `lowlevel image rm {img.id}` and import the archive again")
        return
    from lowlevel.rootfs import tree_sha256
    assert policy.rootfs is not None
    have = tree_sha256(policy.rootfs).sha256
    if have != want:
        raise ImageError(f"the record ran on the rootfs {policy.rootfs} with sha256 {want}, but it now hashes to "
                         f"{have}: restore that tree (or import it as an image and record again)")


# --- doctor -------------------------------------------------------------------------------------

def doctor_checks() -> list[dict[str, Any]]:
    """``lowlevel doctor`` entries: skopeo and umoci (path, version), the store location."""
    import subprocess
    out: list[dict[str, Any]] = []
    for tool, pkg in (("skopeo", "skopeo"), ("umoci", "umoci")):
        path = find_tool(tool)
        if path is None:
            out.append({"name": tool, "ok": False, "required": False,
                        "detail": "not installed: `lowlevel image import` needs it",
                        "fix": f"apt-get install {pkg}"})
            continue
        try:
            text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, env={}).stdout
        except (OSError, subprocess.TimeoutExpired) as err:
            text = f"(--version failed: {err})"
        out.append({"name": tool, "ok": True, "required": False, "detail": f"{path}: {text.strip()}", "fix": ""})
    store = ImageStore()
    try:
        count = len(store._ids())
        detail = f"{store.path} ({count} image{'s' if count != 1 else ''}; ${STORE_ENV} overrides)"
        ok = True
    except LowlevelError as err:
        detail, ok = f"{store.path}: {err}", False
    exists = os.path.isdir(store.path)
    out.append({"name": "image store", "ok": ok, "required": False,
                "detail": detail if exists else f"{store.path} (not created yet; ${STORE_ENV} overrides)",
                "fix": f"set ${STORE_ENV} to a directory you own"})
    return out


__all__ = ["ETC_PLACEHOLDERS", "Image", "ImageConfig", "ImageError", "ImageStore", "ImportLimits", "ImportProgress",
           "Layer", "ROOT_STORE", "SCHEMA", "STORE_ENV", "apply_image", "check_record_rootfs", "default_store_dir",
           "doctor_checks", "find_tool", "image_record", "normalize_name"]

