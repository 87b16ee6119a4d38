"""Host /etc files reach the sandbox as copies in its read-only root tmpfs, not as bind mounts.

lowlevel.argv.etc_plan: small regular files (``/etc/ld.so.cache``, ``nsswitch.conf``...) are
written by bwrap into the sandbox's root tmpfs (``--file``) from an fd the launcher opens per
run, ``/etc/localtime`` (a symlink into /usr) is the same symlink, directories stay read-only
binds. What must hold: the same bytes as the host's, not writable (the root is remounted
read-only), and no host mount for them in the sandbox's mount table.
"""

from __future__ import annotations

import hashlib
import os

import pytest

import lowlevel
from lowlevel import argv as _argv
from lowlevel.errors import LaunchError, PolicyError
from lowlevel.launcher import Run, _open_etc_copy, host_facts

pytestmark = pytest.mark.bwrap


def _copied() -> tuple[str, ...]:
    return _argv.etc_copies(lowlevel.Policy(), host_facts())


def test_copied_etc_files_match_the_host_are_read_only_and_not_mounts(sandbox) -> None:
    copied = _copied()
    if not copied:
        pytest.skip("this bwrap has no --perms/--file, or the host has none of the /etc files")
    script = "; ".join(
        [f"sha256sum {p}" for p in copied]
        + ["cat /proc/self/mountinfo > /workspace/mountinfo"]
        # The attack: rewrite the dynamic loader's cache (what every later exec would read).
        + [f"(echo evil > {copied[0]}) 2>/workspace/write_err; echo write_status=$?"]
        # The control: the same shell redirection works where the sandbox may write.
        + ["(echo fine > /workspace/probe) && echo control_ok"])
    out = sandbox.run(["/bin/sh", "-c", script])
    assert out.exit_code == 0, out.stderr
    text = out.stdout.decode()
    for path in copied:
        with open(path, "rb") as f:
            want = hashlib.sha256(f.read()).hexdigest()
        assert f"{want}  {path}" in text, (path, text)
    assert "write_status=0" not in text and "write_status=" in text, text
    assert "control_ok" in text, text
    ws = out.workspace
    with open(os.path.join(ws, "write_err"), encoding="utf-8") as f:
        assert "Read-only file system" in f.read()
    with open(os.path.join(ws, "mountinfo"), encoding="utf-8") as f:
        mount_points = {line.split()[4] for line in f}
    assert not mount_points & set(copied), mount_points & set(copied)
    # Directories are still binds (/etc/alternatives, when the host has it).
    binds = [p for kind, p, _a in _argv.etc_plan(host_facts().layout.etc_files) if kind == "bind"]
    assert set(binds) <= mount_points


def test_localtime_is_the_same_zone_inside() -> None:
    if not os.path.lexists("/etc/localtime"):
        pytest.skip("no /etc/localtime on this host")
    with open("/etc/localtime", "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    r = lowlevel.run(["sha256sum", "/etc/localtime"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split()[0] == want


def test_etc_plan_kinds(tmp_path) -> None:
    small = tmp_path / "small.conf"
    small.write_bytes(b"x" * 100)
    big = tmp_path / "big.cache"
    big.write_bytes(b"\0" * (_argv.ETC_COPY_MAX_BYTES + 1))
    into_usr = tmp_path / "localtime"
    into_usr.symlink_to("/usr/bin/env")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.symlink_to(str(small))
    directory = tmp_path / "conf.d"
    directory.mkdir()
    missing = tmp_path / "missing"
    paths = tuple(str(p) for p in (small, big, into_usr, elsewhere, directory, missing))
    plan = _argv.etc_plan(paths)
    assert [kind for kind, _p, _a in plan] == ["file", "bind", "symlink", "bind", "bind", "bind"]
    assert plan[2] == ("symlink", str(into_usr), "/usr/bin/env")


def test_a_copied_file_replaced_by_a_symlink_is_refused_not_followed(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("not for the sandbox")
    link = tmp_path / "ld.so.cache"
    link.symlink_to(str(secret))
    with pytest.raises(LaunchError, match="cannot open the host's .*ld.so.cache"):
        _open_etc_copy(str(link))
    # Control: the regular file itself opens.
    os.close(_open_etc_copy(str(secret)))


def test_extra_fds_cannot_take_the_etc_copies_numbers() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(PolicyError, match="reserved"):
            Run(["/usr/bin/true"], policy=lowlevel.Policy(), extra_fds={_argv.ETC_COPY_FD: r})
        Run(["/usr/bin/true"], policy=lowlevel.Policy(), extra_fds={_argv.ETC_COPY_FD - 1: r}).close()  # control: a free number
    finally:
        os.close(r)
        os.close(w)
