"""``lowlevel image import|ls|rm|prune|inspect|tag``: the command line of :mod:`lowlevel.image`.

``lowlevel image import FILE [--name NAME[:TAG]] [--ref REF] [--quiet]`` imports an OCI archive,
an OCI layout directory or a ``docker save`` archive, with a progress bar on a terminal
(stderr; none when stderr is not a terminal, or with ``--quiet``). ``lowlevel image ls`` lists
name, id, manifest digest, layers, size and last use. ``lowlevel image rm REF...`` removes
names or images, ``lowlevel image prune`` the images without a name. Every subcommand takes
``--store DIR`` (default ``$LOWLEVEL_IMAGE_STORE`` or :func:`lowlevel.image.default_store_dir`).
Exit status: 0, or 125 with one ``lowlevel: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TextIO

from lowlevel.cli.output import EXIT_FAILED, report_error
from lowlevel.errors import LowlevelError
from lowlevel.image import STORE_ENV, ImageStore, ImportLimits, ImportProgress


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    s = max(0.0, now - t)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= size:
            k = int(s // size)
            return f"{k} {unit}{'s' if k != 1 else ''} ago"
    return "just now"


class ProgressBar:
    """Renders :class:`ImportProgress` reports as one redrawn line on a terminal.

    ``enabled`` False (not a terminal, ``--quiet``) makes every call a no-op.
    """

    PHASES = {"copy": "copying", "scan": "checking", "unpack": "unpacking", "verify": "verifying", "done": "done"}

    def __init__(self, stream: TextIO, enabled: bool, width: int = 28) -> None:
        self.stream = stream
        self.enabled = enabled
        self.width = width
        self.last = 0.0
        self.drawn = False

    def __call__(self, p: ImportProgress) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if p.phase not in ("done",) and now - self.last < 0.1 and p.done_bytes < p.total_bytes:
            return
        self.last = now
        frac = min(1.0, p.done_bytes / p.total_bytes) if p.total_bytes else 0.0
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        layers = (f"layer {p.layer}/{p.layers}" if p.layer else f"{p.layers} layer{'s' if p.layers != 1 else ''}"
                  ) if p.layers else "archive"
        sizes = f"{human_bytes(p.done_bytes)} / {human_bytes(p.total_bytes)}" if p.total_bytes else ""
        line = f"{self.PHASES.get(p.phase, p.phase):>9} [{bar}] {layers:<13} {sizes}"
        self.stream.write("\r\x1b[2K" + line)
        self.stream.flush()
        self.drawn = True

    def finish(self) -> None:
        if self.enabled and self.drawn:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()


def _store(args: argparse.Namespace) -> ImageStore:
    return ImageStore(args.store) if args.store else ImageStore()


def cmd_image(args: argparse.Namespace) -> int:
    """``lowlevel image ...``: returns the exit status: 0, or 125 (:data:`EXIT_FAILED`, as for a
    refused option) when lowlevel refused or failed (one line on stderr; with ``--json`` the
    error object on stdout too)."""
    try:
        return _cmd_image(args)
    except LowlevelError as err:
        return report_error(args, err, EXIT_FAILED)


def _cmd_image(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.image_cmd == "import":
        limits = ImportLimits(**{k: v for k, v in (("max_bytes", args.max_bytes), ("max_entries", args.max_entries))
                                 if v is not None})
        bar = ProgressBar(sys.stderr, enabled=not args.quiet and sys.stderr.isatty())
        t0 = time.monotonic()
        try:
            img = store.import_archive(args.file, name=args.name, ref=args.ref, limits=limits, progress=bar)
        finally:
            bar.finish()
        if args.json:
            json.dump(img.to_json(), sys.stdout, indent=2, sort_keys=True)
            sys.stdout.write("\n")
        elif args.quiet:
            print(img.id)
        else:
            print(f"imported {', '.join(img.names) or '<no name>'} {img.id}: {len(img.layers)} layer"
                  f"{'s' if len(img.layers) != 1 else ''}, {human_bytes(img.size_bytes)}, {img.entries} entries "
                  f"({time.monotonic() - t0:.1f} s)")
            for note in img.notes:
                print(f"lowlevel: note: {note}", file=sys.stderr)
        return 0
    if args.image_cmd == "ls":
        images = store.list_images()
        if args.json:
            json.dump([i.to_json() for i in images], sys.stdout, indent=2, sort_keys=True)
            sys.stdout.write("\n")
            return 0
        rows = [("NAME", "ID", "DIGEST", "LAYERS", "SIZE", "LAST USED", "IMPORTED")]
        now = time.time()
        for i in images:
            for name in i.names or ("<none>",):
                rows.append((name, i.short_id, i.manifest_digest[:19], str(len(i.layers)), human_bytes(i.size_bytes),
                             _ago(i.last_used, now), i.imported_at.replace("T", " ")[:16]))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        for r in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
        return 0
    if args.image_cmd == "rm":
        status = 0
        for ref in args.refs:
            try:
                names, gone = store.remove(ref)
            except LowlevelError as err:
                status = report_error(None, err, EXIT_FAILED)
                continue
            for n in names:
                print(f"untagged: {n}")
            if isinstance(gone, str):
                print(f"deleted: {gone} (damaged)")
            elif gone is not None:
                print(f"deleted: {gone.id}")
        return status
    if args.image_cmd == "prune":
        for image_id in store.prune():
            print(f"deleted: {image_id}")
        return 0
    if args.image_cmd == "inspect":
        json.dump(store.get(args.ref).to_json(), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    if args.image_cmd == "tag":
        img = store.tag(args.ref, args.name)
        print(f"{img.id}: {', '.join(img.names)}")
        return 0
    raise AssertionError(args.image_cmd)


def use_store(path: str | None) -> None:
    """``--image-store DIR`` of ``run``/``replay``: the store every Policy of this process reads."""
    if path:
        os.environ[STORE_ENV] = os.path.abspath(path)


__all__ = ["ProgressBar", "cmd_image", "human_bytes", "use_store"]

