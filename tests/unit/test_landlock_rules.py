"""Landlock rules derived from the Policy, the guard's report format, and the Policy knobs."""

from __future__ import annotations

import os
import struct

import pytest

import lowlevel
from lowlevel.host import landlock
from lowlevel.sandbox import landlock_rules
from lowlevel.errors import PolicyError
from lowlevel.record import canonical_policy, policy_from_canonical, policy_loosening
from lowlevel.spec.seccomp import DEFAULT_PROFILE

BASE = ("--ll=on", "--ll-ls=/", "--ll-rx=/usr", "--ll-rx=/etc", "--ll-proc=/proc", "--ll-dev=/dev",
        "--ll-rw=/dev/shm", "--ll-rw=/tmp", "--ll-rw=/workspace",
        "--ll-unix=/tmp", "--ll-unix=/dev/shm", "--ll-unix=/workspace")


def test_default_rules() -> None:
    assert landlock_rules.ruleset_args(lowlevel.Policy(), ()) == (*BASE, "--ll-net=none")


def test_read_only_dirs_binds_network_and_omit(tmp_path) -> None:
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    p = lowlevel.Policy(network=True, binds=(lowlevel.Bind(str(ro), "/opt/ro"),
                                             lowlevel.Bind(str(rw), "/opt/rw", writable=True)))
    args = landlock_rules.ruleset_args(p, ("/lib64",))
    assert args == (BASE[0], BASE[1], BASE[2], "--ll-rx=/lib64", *BASE[3:], "--ll-rx=/opt/ro", "--ll-rw=/opt/rw",
                    "--ll-net=connect")
    omitted = landlock_rules.ruleset_args(lowlevel.Policy(binds=p.binds, landlock_omit=("/opt/rw/",)), ())
    assert "--ll-rw=/opt/rw" not in omitted and "--ll-rx=/opt/ro" in omitted


def test_off_require_and_abi_cap(monkeypatch) -> None:
    assert landlock_rules.ruleset_args(lowlevel.Policy(landlock=False), ()) == ("--ll=off",)
    assert landlock_rules.ruleset_args(lowlevel.Policy(landlock="require"), ())[0] == "--ll=require"
    monkeypatch.setattr(landlock, "_ABI_MAX", 2)
    assert landlock_rules.ruleset_args(lowlevel.Policy(), ())[-1] == "--ll-abi-max=2"  # not a stale cache entry
    monkeypatch.setattr(landlock, "_ABI_MAX", None)
    assert landlock_rules.ruleset_args(lowlevel.Policy(), ())[-1] == "--ll-net=none"


@pytest.mark.parametrize("kwargs", [{"landlock": "yes"}, {"landlock": 1}, {"landlock": None},
                                    {"landlock_omit": "/opt/x"}, {"landlock_omit": ("opt/x",)},
                                    {"landlock_omit": ("/opt/\0x",)}])
def test_policy_rejects_bad_landlock_values(kwargs) -> None:
    with pytest.raises(PolicyError, match="landlock"):
        lowlevel.Policy(**kwargs)


def test_policy_landlock_round_trips_through_records() -> None:
    p = lowlevel.Policy(landlock="require", landlock_omit=["/opt/a"])
    assert p.landlock_omit == ("/opt/a",)
    assert policy_from_canonical(canonical_policy(p)) == p
    assert any("landlock=False" in line for line in policy_loosening(lowlevel.Policy(landlock=False)))
    assert policy_loosening(lowlevel.Policy(landlock="require", landlock_omit=("/opt/a",))) == []


def test_guard_report_parsing() -> None:
    rec = struct.Struct("=IIII")
    rep = landlock.parse_report(rec.pack(landlock.REC_START, 7, 0, 0) + rec.pack(landlock.REC_EXIT, 152 << 8, 0, 0)
                                + b"\x01\x02")  # a torn trailing record is ignored
    assert (rep.started, rep.abi, rep.wait_status, rep.fail_stage) == (True, 7, 152 << 8, None)
    assert os.WEXITSTATUS(rep.wait_status) == 152 and not os.WIFSIGNALED(rep.wait_status)
    fail = landlock.parse_report(rec.pack(landlock.REC_START, 0, 0, 0)
                                 + rec.pack(landlock.REC_FAIL, 2, landlock.STAGE_EXEC, 0))
    assert (fail.fail_errno, fail.fail_stage) == (2, landlock.STAGE_EXEC)
    assert landlock.parse_report(b"") == landlock.GuardReport()


def test_guard_argv() -> None:
    assert landlock.guard_argv(9, 10, ("--ll=off",), cwd="/workspace") == [
        "/proc/self/fd/9", "--fd=9", "--status=10", "--cwd=/workspace", "--ll=off", "--"]


def test_seccomp_profile_leaves_landlock_syscalls_alone() -> None:
    # The guard and the init need them, and a program may stack its own ruleset.
    names = {rule.syscall for rule in DEFAULT_PROFILE.rules}
    assert not names & {"landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self"}


def test_describe() -> None:
    assert "not available" in landlock.describe(0)
    assert "EXDEV" in landlock.describe(1)
    assert "abstract unix socket" in landlock.describe(6)


def test_cli_landlock_flag() -> None:
    from lowlevel import cli
    from lowlevel.cli import run_cmd
    parser = cli.build_parser()
    for flag, want in (("on", True), ("off", False), ("require", "require")):
        args = parser.parse_args(["run", "--landlock", flag, "--", "true"])
        assert run_cmd.policy_from_args(args).landlock == want


def test_rootfs_rules() -> None:
    import shutil
    import tempfile
    from pathlib import Path
    base = Path(tempfile.mkdtemp(prefix="ll-rootfs-", dir="/tmp"))  # world-traversable, as a rootfs must be
    try:
        _check_rootfs_rules(base)
    finally:
        shutil.rmtree(base)


def _check_rootfs_rules(tmp_path) -> None:
    root = tmp_path / "tree"
    for d in ("usr/bin", "etc", "opt", "var/tmp", "lib"):
        (root / d).mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0::/:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    (root / "bin").symlink_to("usr/bin")
    os.chmod(tmp_path, 0o755)
    p = lowlevel.Policy(rootfs=str(root))
    args = landlock_rules.ruleset_args(p, ("/lib64",))
    assert {"--ll-rx=/usr", "--ll-rx=/etc", "--ll-rx=/opt", "--ll-rx=/var", "--ll-rx=/lib"} <= set(args)
    assert "--ll-rx=/lib64" not in args  # the host's layout does not apply
    # Writable root: the anchor's overlay of each top-level directory, or the fallback's
    # scratch tmpfs dirs; the mounts decide, Landlock allows writes to both.
    w = landlock_rules.ruleset_args(lowlevel.Policy(rootfs=str(root), rootfs_writable=True), ())
    assert {"--ll-rw=/opt", "--ll-rw=/var/tmp", "--ll-rw=/usr"} <= set(w) and "--ll-rx=/usr" not in w
    # bwrap >= 0.9: every top-level directory is an overlay with a tmpfs upper.
    o = landlock_rules.ruleset_args(lowlevel.Policy(rootfs=str(root), rootfs_writable=True), (),
                              frozenset({"--tmp-overlay", "--overlay-src"}))
    assert "--ll-rw=/usr" in o and "--ll-rx=/usr" not in o
