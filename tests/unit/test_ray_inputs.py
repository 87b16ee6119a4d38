"""lowlevel.ray's input archive and output collection, on real files (no cluster needed).

Inputs come from the driver and outputs from an untrusted workspace: names with ``..`` or
absolute paths, links, devices, a symlink planted to redirect a later member, setuid bits and
oversized files are each tried and refused (or left out and reported).
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from lowlevel.errors import PolicyError, WorkspaceError  # noqa: E402
from lowlevel.ray import collect_outputs, pack_inputs, unpack_inputs  # noqa: E402

ALL_BYTES = bytes(range(256))


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = linkname
    return info


def test_mapping_round_trip_byte_exact_with_non_utf8_names(tmp_path: Path):
    inputs = {b"caf\xe9/\xff\xfe.bin": ALL_BYTES, "dir/sub/a.txt": b"a\n", "empty": b"", "text": "h\u00e9"}
    data = pack_inputs(inputs)
    created = unpack_inputs(data, str(tmp_path))
    assert os.fsencode(created[0]) == b"caf\xe9/\xff\xfe.bin"
    assert (tmp_path / os.fsdecode(b"caf\xe9/\xff\xfe.bin")).read_bytes() == ALL_BYTES
    assert (tmp_path / "dir/sub/a.txt").read_bytes() == b"a\n"
    assert (tmp_path / "empty").read_bytes() == b""
    assert (tmp_path / "text").read_bytes() == "h\u00e9".encode()
    assert b"caf\xe9" in os.listdir(os.fsencode(tmp_path))


def test_host_paths_pack_under_base_names_with_modes_and_symlinks(tmp_path: Path):
    src = tmp_path / "proj"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (src / "bin" / "run.sh").chmod(0o755)
    (src / "link").symlink_to("bin/run.sh")
    os.utime(src / "bin" / "run.sh", (1_000_000_000, 1_000_000_000))
    single = tmp_path / "one.txt"
    single.write_bytes(b"1")
    out = tmp_path / "out"
    out.mkdir()
    unpack_inputs(pack_inputs([src, single]), str(out))
    assert (out / "proj/bin/run.sh").read_bytes() == b"#!/bin/sh\necho hi\n"
    assert stat.S_IMODE((out / "proj/bin/run.sh").stat().st_mode) == 0o755
    assert (out / "proj/bin/run.sh").stat().st_mtime == 1_000_000_000
    assert os.readlink(out / "proj/link") == "bin/run.sh"
    assert (out / "one.txt").read_bytes() == b"1"


def test_pack_refuses_bad_names_sizes_and_types(tmp_path: Path):
    for name in ("/etc/passwd", "../x", "a/../../x", "", "a\0b"):
        with pytest.raises(PolicyError):
            pack_inputs({name: b"x"})
    with pytest.raises(PolicyError, match="max_input_bytes"):
        pack_inputs({"big": b"x" * 2048}, max_bytes=1024)
    with pytest.raises(PolicyError, match="must be bytes"):
        pack_inputs({"n": 3})
    with pytest.raises(PolicyError, match="wrap a single path"):
        pack_inputs(str(tmp_path))
    with pytest.raises(WorkspaceError, match="does not exist"):
        pack_inputs([tmp_path / "missing"])


@pytest.mark.parametrize("member, why", [
    ((_info("../escape"), b"x"), "relative path"),
    ((_info("/abs"), b"x"), "relative path"),
    ((_info("hard", tarfile.LNKTYPE, linkname="x"), None), "hard link"),
    ((_info("dev", tarfile.CHRTYPE), None), "device or fifo"),
    ((_info("fifo", tarfile.FIFOTYPE), None), "device or fifo"),
])
def test_unpack_refuses_dangerous_members(tmp_path: Path, member, why):
    with pytest.raises(WorkspaceError, match=why):
        unpack_inputs(_tar(member), str(tmp_path))


def test_unpack_never_writes_through_a_planted_symlink(tmp_path: Path):
    target = tmp_path / "outside"
    target.mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    data = _tar((_info("d", tarfile.SYMTYPE, linkname=str(target)), None), (_info("d/pwned"), b"x"))
    with pytest.raises(WorkspaceError, match="symlink is in the way"):
        unpack_inputs(data, str(ws))
    assert list(target.iterdir()) == []  # control: the symlink itself was made, and points there
    assert os.readlink(ws / "d") == str(target)


def test_unpack_strips_setid_bits_and_refuses_duplicates(tmp_path: Path):
    unpack_inputs(_tar((_info("s", mode=0o6755), b"x"), (_info("dd", tarfile.DIRTYPE, mode=0o1777), None)),
                  str(tmp_path))
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "dd").stat().st_mode) == 0o777
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(WorkspaceError, match="exists"):
        unpack_inputs(_tar((_info("a"), b"1"), (_info("a"), b"2")), str(other))


def test_unpack_refuses_garbage(tmp_path: Path):
    with pytest.raises(WorkspaceError, match="tar"):
        unpack_inputs(b"\x00garbage" * 100, str(tmp_path))


def test_collect_outputs_budget_kinds_and_untrusted_links(tmp_path: Path):
    (tmp_path / "a").write_bytes(b"1" * 10)
    (tmp_path / "b").write_bytes(b"2" * 100)
    (tmp_path / "c").write_bytes(b"3" * 10)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "e").write_bytes(b"e")
    (tmp_path / "ln").symlink_to("/etc/passwd")
    (tmp_path / "hl").write_bytes(b"h")
    os.link(tmp_path / "hl", tmp_path / "hl2")
    (tmp_path / "via").symlink_to(tmp_path / "d")
    files, dropped, omitted = collect_outputs(
        str(tmp_path), ["a", "b", "c", "d", "d/e", "ln", "hl", "gone", "via/e"], max_bytes=25)
    assert files == {"a": b"1" * 10, "c": b"3" * 10, "d/e": b"e"}  # b (100 bytes) does not fit
    assert dropped == 100
    assert omitted == ["b", "gone", "hl", "ln", "via/e"]


def test_errors_and_results_survive_pickling():
    import pickle

    from lowlevel.ray import ClusterError, RemoteResult
    err = pickle.loads(pickle.dumps(ClusterError("gone", "node_lost")))
    assert isinstance(err, ClusterError) and err.reason == "node_lost" and str(err) == "gone"
    r = RemoteResult(exit_code=0, node_id="n1", attempts=2, lost_nodes=("n0",), files={"a": b"\xff"},
                     files_omitted=("l",), files_truncated=True)
    r2 = pickle.loads(pickle.dumps(r))
    assert r2 == r and r2.retried and r2.file("a") == b"\xff" and r2.file(b"a") == b"\xff"
    d = r.to_json()
    assert d["files"] == {"a": 1} and d["lost_nodes"] == ["n0"] and d["retried"] is True
