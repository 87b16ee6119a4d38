"""A real distribution: a minimal Debian made with mmdebstrap, as an image and as a bare rootfs.

Slow (mmdebstrap downloads about 40 MB of packages from the host's apt mirror: about a minute)
and root-only (mmdebstrap's root mode). Everything lives in one temp dir, removed at the end:
nothing is cached.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import imagekit
import pytest

import lowlevel
from lowlevel.image import ImageStore

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.bwrap, pytest.mark.timeout(900),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
              pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="needs mmdebstrap: apt-get install "
                                 "mmdebstrap")]

SUITE = "bookworm"
PYTHON = "import sys, ssl; print(sys.version_info[0], sys.executable, sys.prefix, ssl.OPENSSL_VERSION[:7])"


def test_debian_minimal_as_image_and_as_rootfs(monkeypatch: pytest.MonkeyPatch) -> None:
    imagekit.need_tools()
    work = imagekit.public_tmpdir("debian-")
    try:
        tarball = work / "debian.tar"
        env = {**os.environ, "TMPDIR": str(work)}
        proc = subprocess.run(["mmdebstrap", "--quiet", "--variant=essential", "--include=python3-minimal",
                               SUITE, str(tarball)], capture_output=True, text=True, timeout=700, env=env)
        if proc.returncode != 0 and ("Could not resolve" in proc.stderr or "Failed to fetch" in proc.stderr):
            pytest.skip(f"the apt mirror is not reachable: {proc.stderr[-300:]}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        # An OCI image of it, made with umoci (one layer: the tarball as mmdebstrap wrote it, /dev nodes,
        # setuid su/mount/passwd and hard links included).
        layout = work / "layout"
        imagekit.run(["umoci", "init", "--layout", str(layout)])
        imagekit.run(["umoci", "new", "--image", f"{layout}:{SUITE}"])
        imagekit.run(["umoci", "raw", "add-layer", "--image", f"{layout}:{SUITE}", str(tarball)])
        imagekit.run(["umoci", "config", "--image", f"{layout}:{SUITE}", "--config.env",
                      "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "--config.cmd", "bash"])
        for p in [layout, *layout.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        store_dir = imagekit.public_tmpdir("imgstore-")
        monkeypatch.setenv("LOWLEVEL_IMAGE_STORE", str(store_dir))
        try:
            img = ImageStore(store_dir).import_archive(layout, name=f"debian:{SUITE}")
            assert any("device nodes in the layers: dropped" in n for n in img.notes)
            assert any("setuid/setgid files in the layers: bits cleared" in n for n in img.notes)
            policy = lowlevel.Policy(image=f"debian:{SUITE}")
            r = lowlevel.run(["python3", "-c", PYTHON], policy=policy, timeout=60)
            assert r.exit_code == 0, r.stderr
            assert r.stdout.decode().split() == ["3", "/usr/bin/python3", "/usr", "OpenSSL"]
            r = lowlevel.run(["/bin/sh", "-c", "id -u; stat -c %a /usr/bin/su; ls /dev/null; "
                              "cat /etc/os-release | grep VERSION_CODENAME"], policy=policy)
            assert r.stdout.decode().split() == ["0", "755", "/dev/null", f"VERSION_CODENAME={SUITE}"], r.stderr
            # The same tree as a bare rootfs (no image): python3 runs there too.
            r = lowlevel.run(["python3", "-c", PYTHON], policy=lowlevel.Policy(rootfs=img.rootfs))
            assert r.exit_code == 0 and r.stdout.startswith(b"3 /usr/bin/python3")
            # With a writable root, system paths take writes for the run (what apt/pip do: a new
            # module under /usr/lib/python3 imports), discarded after it.
            script = ("echo hi > /var/tmp/x && cat /var/tmp/x; mkdir -p /usr/lib/python3/dist-packages && "
                      "echo 'v = 42' > /usr/lib/python3/dist-packages/llmod.py && python3 -c 'import llmod; print(llmod.v)'")
            policy = lowlevel.Policy(image=f"debian:{SUITE}", rootfs_writable=True)
            r = lowlevel.run(["/bin/sh", "-c", script], policy=policy)
            assert r.stdout == b"hi\n42\n", r
            r = lowlevel.run(["/bin/sh", "-c", "ls /usr/lib/python3/dist-packages/llmod.py 2>&1"], policy=policy)
            assert b"No such file" in r.stdout
        finally:
            shutil.rmtree(store_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

