"""Limits.upper (issue 27, "large outputs on disk"): validation, the RAM sum of the tmpfs bounds,
record hashes, and the CLI option. Pure: nothing is spawned (the behaviour is in
tests/integration/test_disk_upper.py)."""

import dataclasses

import pytest

from lowlevel.errors import PolicyError
from lowlevel.record.canonical import canonical_policy, policy_from_canonical
from lowlevel.spec.limits import MIN_DISK_UPPER_BYTES, UPPERS, Limits, MiB, tmpfs_bytes
from lowlevel.spec.policy import Policy


def test_upper_default_is_tmpfs_and_values_are_checked() -> None:
    assert Limits().upper == "tmpfs" and UPPERS == ("tmpfs", "disk")
    assert Limits(upper="disk").upper == "disk"
    for bad in ("Disk", "", None, 1, "ext4"):
        with pytest.raises(PolicyError, match="Limits.upper must be one of"):
            Limits(upper=bad)  # type: ignore[arg-type]


def test_disk_upper_needs_room_for_ext4_metadata() -> None:
    Limits(upper="disk", workspace_bytes=MIN_DISK_UPPER_BYTES)
    with pytest.raises(PolicyError, match="at least 8388608 with upper='disk'"):
        Limits(upper="disk", workspace_bytes=MIN_DISK_UPPER_BYTES - 4096)
    Limits(upper="tmpfs", workspace_bytes=64 * 1024)  # the tmpfs minimum is unchanged


def test_disk_upper_takes_the_workspace_out_of_the_ram_sum() -> None:
    tmp = Limits().tmp_size_bytes
    assert tmp is not None
    assert tmpfs_bytes(Limits(upper="disk")) == 2 * tmp
    assert tmpfs_bytes(Limits()) == (1 << 30) + 2 * tmp


def test_record_hash_of_a_default_policy_has_no_upper_key() -> None:
    """Records made before Limits.upper hash as they did; a disk upper is recorded and replays."""
    assert "upper" not in canonical_policy(Policy())["limits"]
    disk = Policy(limits=dataclasses.replace(Limits(), upper="disk", workspace_bytes=64 * MiB))
    canon = canonical_policy(disk)
    assert canon["limits"]["upper"] == "disk"
    assert policy_from_canonical(canon).limits.upper == "disk"


def test_cli_upper_option() -> None:
    from lowlevel.cli.parser import build_parser
    from lowlevel.cli.run_cmd import policy_from_args
    parser = build_parser()
    args = parser.parse_args(["run", "--upper", "disk", "--", "true"])
    assert policy_from_args(args).limits.upper == "disk"
    assert policy_from_args(parser.parse_args(["run", "--", "true"])).limits.upper == "tmpfs"
    from lowlevel.cli.args import UsageError
    with pytest.raises(UsageError, match="invalid choice: 'ram'"):
        parser.parse_args(["run", "--upper", "ram", "--", "true"])


@pytest.mark.parametrize("fstype", ["fuse", "fuse.sshfs", "fuseblk", "tmpfs", "devtmpfs"])
def test_disk_upper_dir_on_fuse_or_ram_is_refused(fstype: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FUSE directory (its daemon, maybe another user's, would serve the blocks of the ext4 root
    mounts) and RAM filesystems are refused by type (read from mountinfo; set here: no FUSE
    daemon on the test host). Control: the real type of tmp_path's filesystem passes."""
    from lowlevel.errors import WorkspaceError
    from lowlevel.workspace import disk_upper
    monkeypatch.setenv("LOWLEVEL_UPPER_DIR", str(tmp_path))
    real = disk_upper._fstype(tmp_path.stat().st_dev)
    if real not in disk_upper._FS_MEMORY:
        assert disk_upper.upper_dir() == str(tmp_path)
    monkeypatch.setattr(disk_upper, "_fstype", lambda dev: fstype)
    with pytest.raises(WorkspaceError, match="LOWLEVEL_UPPER_DIR"):
        disk_upper.upper_dir()
