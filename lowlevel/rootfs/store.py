"""The image store, read side: find an imported image by name or digest and apply it to a run.

This is the part of :mod:`lowlevel.image` a sandbox needs to run on an image (below
:mod:`lowlevel.sandbox` in the layers): reading ``names.json`` and ``image.json``
(:class:`StoreReader`), the last-used stamp, what a ``Policy(image=...)`` takes from the image
(:func:`apply_image`, called at plan time by :func:`lowlevel.rootfs.resolve.resolve`), the
``rootfs`` part of a run record and its replay check, and ``lowlevel doctor``'s store entries.
Importing, tagging and removing images (which run sandboxes or take the store's lock) are
:mod:`lowlevel.image`.

Store (base directory :func:`default_store_dir`: ``$LOWLEVEL_IMAGE_STORE``, else
``/var/lib/lowlevel/images`` for root, else ``$XDG_DATA_HOME/lowlevel/images``, i.e.
``~/.local/share/lowlevel/images``)::

    <base>/lock                  flock(2): commits, removals and name changes
    <base>/names.json            {"name:tag": "sha256:<id>"}, replaced atomically
    <base>/images/<id>/image.json  what :class:`Image` holds
    <base>/images/<id>/rootfs/   the flattened root filesystem, read-only to every sandbox
    <base>/images/<id>/last-used its mtime is the image's last use (a run planned on it)
    <base>/tmp/import-*/         one import in progress; removed if it fails

Identity: ``id`` is ``sha256:`` + the SHA-256 of the image config, which lists the SHA-256 of
each uncompressed layer (``rootfs.diff_ids``); ``manifest_digest`` is the manifest's, as
imported (a ``docker save`` archive gets a fresh OCI manifest, so its digest differs from the
registry's); ``rootfs_sha256`` is :func:`lowlevel.rootfs.tree_sha256` of the unpacked tree.

Sources: OCI image-spec (image-layout.md, config.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import TYPE_CHECKING, Any

from lowlevel._dataclass import dataclass
from lowlevel.errors import ImageError, LowlevelError, PolicyError
from lowlevel.rootfs import tree_sha256

if TYPE_CHECKING:
    from lowlevel.spec.policy import Policy

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
HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_HEXPREFIX = re.compile(r"^[0-9a-f]{12,64}\Z")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._/:-]{0,254}\Z")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
MAX_JSON = 4 * MiB


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
        last_used: when a run was last planned on it (epoch seconds; once per Policy object), or None.
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



def _image_from(doc: Mapping[str, Any], d: str, names: Mapping[str, str], last: float | None) -> Image:
    """The :class:`Image` an ``image.json`` document describes (``d`` its directory).

    Raises:
        KeyError, TypeError, ValueError, AttributeError, IndexError: a field is missing or of the
            wrong type (the caller treats the entry as damaged).
    """
    c = doc["config"]
    user_ids = c.get("user_ids")
    config = ImageConfig(env=tuple((str(k), str(v)) for k, v in c.get("env", ())), workdir=_opt_str(c.get("workdir")),
                         user=str(c.get("user", "")),
                         user_ids=(int(user_ids[0]), int(user_ids[1])) if user_ids else None,
                         entrypoint=tuple(map(str, c.get("entrypoint") or ())),
                         cmd=tuple(map(str, c.get("cmd") or ())),
                         architecture=str(c.get("architecture", "")), os=str(c.get("os", "")))
    layers = tuple(Layer(**{k: v for k, v in layer.items() if k in Layer.__dataclass_fields__})
                   for layer in doc.get("layers", ()))
    rootfs = doc["rootfs"]
    sha = rootfs["sha256"]
    if not isinstance(sha, str):
        raise TypeError(f"rootfs.sha256 is {type(sha).__name__}, not a string")
    return Image(id=doc["id"], manifest_digest=str(doc.get("manifest_digest", "")),
                 names=tuple(sorted(n for n, i in names.items() if i == doc["id"])),
                 rootfs=os.path.join(d, "rootfs"), rootfs_sha256=sha,
                 size_bytes=int(rootfs["bytes"]), entries=int(rootfs["entries"]), layers=layers,
                 config=config, imported_at=str(doc.get("imported_at", "")), last_used=last,
                 source=dict(doc.get("source") or {}), notes=tuple(map(str, doc.get("notes", ()))))


def _opt_str(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"{value!r} is not a string")


class DamagedImageError(ImageError):
    """The reference names an image whose ``image.json`` cannot be read or has the wrong shape;
    ``image_id`` (``sha256:<hex>``) is its id, which ``lowlevel image rm`` still removes."""

    def __init__(self, message: str, image_id: str) -> None:
        super().__init__(message)
        self.image_id = image_id


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


# --- small fd-relative file helpers -------------------------------------------------------------

def read_bounded(path: str, limit: int, what: str) -> bytes:
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



def parse_json(data: bytes, what: str) -> Any:
    """``data`` (untrusted: an archive's or the store's) as JSON.

    Raises:
        ImageError: not JSON, or nested deeper than :func:`json.loads` recurses (RecursionError).
    """
    try:
        return json.loads(data)
    except ValueError as err:
        raise ImageError(f"the image's {what} is not valid JSON: {err}") from err
    except RecursionError:
        raise ImageError(f"the image's {what} is JSON nested deeper than the import reads (a hostile "
                         "archive?)") from None


# --- reading the store ------------------------------------------------------------------------------

class StoreReader:
    """The image store at ``path`` (default :func:`default_store_dir`), read only.

    Reading (:meth:`get`, :meth:`list_images`) takes no lock: an image directory appears by one
    ``rename(2)`` and disappears by another. :class:`lowlevel.image.ImageStore` adds importing,
    tagging and removal.
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

    # -- names ----------------------------------------------------------------------------------
    def _names(self) -> dict[str, str]:
        path = os.path.join(self.path, "names.json")
        if not os.path.lexists(path):
            return {}
        doc = parse_json(read_bounded(path, 16 * MiB, f"{path}"), "names.json")
        if not isinstance(doc, dict):
            raise ImageError(f"{path} is not a JSON object: remove it and re-tag the images")
        return {str(k): str(v) for k, v in doc.items() if isinstance(v, str) and v.startswith("sha256:")}

    # -- reading ----------------------------------------------------------------------------------
    def _load(self, hexid: str, names: Mapping[str, str]) -> Image | None:
        d = os.path.join(self.images_dir, hexid)
        try:
            doc = parse_json(read_bounded(os.path.join(d, "image.json"), 16 * MiB, "image.json"), "image.json")
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
        try:
            return _image_from(doc, d, names, last)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            # Valid JSON of the wrong shape (a field missing, null or of another type): a damaged
            # entry, skipped like an unreadable one, never a traceback from every reader of the store.
            log.warning("lowlevel: skipping %s in the image store: its image.json is damaged (%s: %s); remove it "
                        "with `lowlevel image rm sha256:%s`", d, type(err).__name__, err, hexid)
            return None

    def _ids(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.images_dir) if HEX64.match(n))
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
        12 hex digits (with or without ``sha256:``), a manifest digest, or ``NAME[:TAG]@sha256:<hex>``
        (pinned: the image the name points to must have that manifest digest or id; a digest is
        never dropped, so a pinned reference cannot run another image).

        Raises:
            ImageError: no such image (the message lists the fix), an ambiguous prefix, or a
            pinned reference whose image has another digest.
        """
        if not isinstance(ref, str) or not ref or "\0" in ref:
            raise ImageError(f"invalid image reference {ref!r}")
        if "@" in ref:
            return self._get_pinned(ref)
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
        if found is None and ref.startswith("sha256:") and HEX64.match(hexref):
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
            raise DamagedImageError(f"image {ref!r} in the store {self.path} is damaged: remove it (`lowlevel image "
                                    f"rm sha256:{found}`) and import it again", f"sha256:{found}")
        return img

    def _get_pinned(self, ref: str) -> Image:
        """``NAME[:TAG]@sha256:<64 hex>``: :meth:`get` of the name, checked against the digest."""
        name, _, digest = ref.partition("@")
        if not name or not digest.startswith("sha256:") or not HEX64.match(digest[7:]):
            raise ImageError(f"invalid image reference {ref!r}: a pinned reference is NAME[:TAG]@sha256:<64 hex "
                             "digits> (or give sha256:<digest> alone)")
        img = self.get(name)
        if digest not in (img.manifest_digest, img.id):
            raise ImageError(f"image {name!r} in the store {self.path} is not {digest} (its manifest digest is "
                             f"{img.manifest_digest or 'unknown'}, its id {img.id}): import the image with "
                             f"that digest, or drop @{digest} to use the one the store has")
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

# --- Policy(image=...) --------------------------------------------------------------------------

def apply_image(policy: Policy) -> Policy:
    """Resolve ``policy.image`` in the default store: the Policy that runs on the image.

    Returns a copy of ``policy`` with ``image`` = ``"sha256:<id>"``, ``rootfs`` = the image's tree,
    ``env`` = the image's ``Env`` overridden by the Policy's own, ``sandbox_uid``/``sandbox_gid``
    (those not given) from the image's ``User``, and ``workdir`` (when not given) from
    ``WorkingDir``; stamps the image's last use. Idempotent (a Policy already on the image comes
    out equal). Called when a run is planned (:func:`lowlevel.rootfs.resolve.resolve`), not when
    the Policy is built.

    Raises:
        PolicyError: no such image (the message says how to import it), a ``rootfs`` that is not
            the image's, or an image ``User`` missing from the image.
    """
    ref = policy.image
    if not isinstance(ref, str):
        raise PolicyError(f"Policy.image must be a str (name:tag or sha256:<id>), got {type(ref).__name__}")
    store = StoreReader()
    try:
        img = store.get(ref)
    except ImageError as err:
        raise PolicyError(str(err)) from err
    if policy.rootfs is not None and os.path.realpath(policy.rootfs) != os.path.realpath(img.rootfs):
        raise PolicyError("give Policy.image or Policy.rootfs, not both (an image brings its own rootfs)")
    merged = dict(img.config.env)
    merged.update(dict(policy.env))
    ids: dict[str, Any] = {}
    if policy.sandbox_uid is None or policy.sandbox_gid is None:
        if img.config.user_ids is None:
            raise PolicyError(f"image {ref!r}: its config User {img.config.user!r} is not in the image's /etc/passwd; "
                              "set Policy(sandbox_uid=..., sandbox_gid=...)")
        if policy.sandbox_uid is None:
            ids["sandbox_uid"] = img.config.user_ids[0]
        if policy.sandbox_gid is None:
            ids["sandbox_gid"] = img.config.user_ids[1]
    workdir = policy.workdir if policy.workdir is not None or not img.config.workdir else img.config.workdir
    store.touch(img)
    return dataclasses.replace(policy, image=img.id, rootfs=img.rootfs, env=tuple(sorted(merged.items())),
                               workdir=workdir, **ids)


def image_record(policy: Policy) -> dict[str, Any] | None:
    """The ``rootfs`` part of a run record: None in host mode; else ``{"path", "sha256", "image"}``
    with ``image`` = ``{"id", "manifest_digest", "names"}`` or None for a bare rootfs (hashed now)."""
    if policy.rootfs is None:
        return None
    if policy.image is not None:
        img = StoreReader().get(policy.image)
        return {"path": img.rootfs, "sha256": img.rootfs_sha256,
                "image": {"id": img.id, "manifest_digest": img.manifest_digest, "names": list(img.names)}}
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
        img = StoreReader().get(str(policy.image))
        if img.rootfs_sha256 != want:
            raise ImageError(f"the record ran on image {image.get('id')} with rootfs sha256 {want}, but that image "
                             f"here unpacks to {img.rootfs_sha256} (imported by another lowlevel version, or "
                             f"damaged): `lowlevel image rm {img.id}` and import the archive again")
        return
    if policy.rootfs is None:
        raise ImageError("refusing the record: it has a rootfs entry but its policy runs on no rootfs and no "
                         "image (a record is untrusted input: this one is inconsistent)")
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
    store = StoreReader()
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

__all__ = ["ETC_PLACEHOLDERS", "Image", "ImageConfig", "Layer", "ROOT_STORE", "SCHEMA", "STORE_ENV", "StoreReader",
           "apply_image", "check_record_rootfs", "default_store_dir", "doctor_checks", "find_tool", "image_record",
           "normalize_name", "parse_json", "read_bounded", "DamagedImageError"]
