#!/usr/bin/env python3
"""A benchmark-style task: this image, this repository, this test command; recorded, then replayed.

What a SWE-bench-style harness does for one task instance, with lowlevel:

1. the task's environment is an image (``lowlevel image import`` once; any OCI archive,
   OCI layout directory or ``docker save`` archive). On a host that reaches a registry::

       skopeo copy docker://docker.io/library/busybox:1.36 oci-archive:busybox.tar:busybox:1.36

   Without one (this example's default), a small image is built here with umoci from the
   host's static busybox (``apt-get install busybox-static umoci skopeo``);
2. the repository (``examples/task_repo``) is copied into a fresh workspace;
3. the test command runs on the image, in deterministic mode, with ``--record``;
4. ``replay`` reruns it from the record alone and says whether the outcome is the same. It
   refuses a record whose image is missing from the store (or unpacks differently).

The same with the CLI::

    lowlevel image import busybox.tar
    lowlevel run --image busybox:1.36 --deterministic --input examples/task_repo --record run.json \\
        -- sh -c 'cd task_repo && sh run_tests.sh'
    lowlevel replay run.json

Usage: ``python3 examples/benchmark_task.py [--archive FILE --image NAME:TAG] [--keep]``
(run as root or as any user; everything goes to a temp dir, removed unless ``--keep``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import lowlevel  # noqa: E402
from lowlevel.image import STORE_ENV, ImageStore  # noqa: E402
from lowlevel.record import replay  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def build_busybox_archive(work: str) -> str:
    """An OCI archive of a busybox image, made with umoci and skopeo (no network)."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    tree = os.path.join(work, "tree")
    os.makedirs(os.path.join(tree, "bin"))
    os.makedirs(os.path.join(tree, "etc"))
    shutil.copy(busybox, os.path.join(tree, "bin", "busybox"))
    for applet in ("sh", "cat", "echo", "printf", "uname", "ls", "test", "["):
        os.symlink("busybox", os.path.join(tree, "bin", applet))
    with open(os.path.join(tree, "etc", "passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\n")
    with open(os.path.join(tree, "etc", "group"), "w") as f:
        f.write("root:x:0:\n")
    with open(os.path.join(tree, "etc", "task-image"), "w") as f:
        f.write("busybox-task:1\n")
    layout = os.path.join(work, "layout")
    for argv in (["umoci", "init", "--layout", layout], ["umoci", "new", "--image", f"{layout}:1"],
                 ["umoci", "insert", "--image", f"{layout}:1", tree, "/"],
                 ["umoci", "config", "--image", f"{layout}:1", "--config.env", "PATH=/bin",
                  "--config.workingdir", "/workspace"],
                 ["skopeo", "--insecure-policy", "copy", "--quiet", f"oci:{layout}:1",
                  f"oci-archive:{work}/busybox-task.tar:busybox-task:1"]):
        subprocess.run(argv, check=True, capture_output=True)
    return os.path.join(work, "busybox-task.tar")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archive", help="image archive to import (default: build a busybox one)")
    ap.add_argument("--image", default="busybox-task:1", help="the image's name (default busybox-task:1)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (store, record, workspace)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="lowlevel-task-", dir="/tmp")
    os.chmod(work, 0o755)  # a root caller's sandbox runs as nobody: it must reach the store
    try:
        store_dir = os.path.join(work, "store")
        os.environ[STORE_ENV] = store_dir
        archive = args.archive or build_busybox_archive(work)
        image = ImageStore(store_dir).import_archive(archive, name=args.image)
        print(f"1. image {args.image}: {image.id[:19]}, {len(image.layers)} layer(s), rootfs sha256 "
              f"{image.rootfs_sha256[:12]}")
        policy = lowlevel.Policy(image=args.image, deterministic=True)
        record = os.path.join(work, "run.json")
        result = lowlevel.run(["sh", "-c", "cd task_repo && sh run_tests.sh"], policy=policy,
                              inputs=[os.path.join(HERE, "task_repo")], cwd="/workspace", record=record,
                              workspace_base=os.path.join(work, "ws"))
        print(f"2-3. tests exited {result.exit_code}:\n{result.stdout.decode()}", end="")
        report = replay(record, workspace_base=os.path.join(work, "ws"))
        print(f"4. replay: {'outputs match' if report.matched else 'DIFFER: ' + '; '.join(report.differences)}")
        ImageStore(store_dir).remove(args.image)
        try:
            replay(record, workspace_base=os.path.join(work, "ws"))
        except lowlevel.LowlevelError as err:
            print(f"   without the image, replay refuses: {str(err)[:110]}...")
        return 0 if result.exit_code == 0 and report.matched else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
