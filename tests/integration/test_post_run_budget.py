"""Issue 12 item 5: post-run work is bounded.

With ``--record``, a program that made 200 sparse 64 MiB files (no blocks) in 20 ms made the host
spend 30-46 s hashing holes after the run, outside every limit. Now sparse files are found by
their allocated blocks and SEEK_DATA/SEEK_HOLE and not hashed, each walk has a total byte and
time budget, and the record says what was skipped. (How long it takes is measured in
``bench/post_run.py``; these tests check what is hashed and reported.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import lowlevel
from lowlevel import record as _record
from helpers.identities import tmpdir_fixture

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]


base = tmpdir_fixture("lowlevel-post-run-")


def test_200_sparse_64mib_files_are_not_hashed(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's program, in the workspace model where its files land in the workspace as
    made (LOWLEVEL_NO_OVERLAY: bound as it is, no copy-on-write commit that could fill holes)."""
    import json
    monkeypatch.setenv("LOWLEVEL_NO_OVERLAY", "1")
    rec = base / "run.json"
    r = lowlevel.run(["sh", "-c", "i=0; while [ $i -lt 200 ]; do truncate -s 64M sparse$i; i=$((i+1)); done; "
                      "head -c 4096 /dev/urandom > dense"], record=str(rec), workspace_base=str(base / "ws"),
                     timeout=120)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(rec.read_text())
    after = {e["path"]: e for e in doc["workspace"]["after"]}
    sparse = [e for p, e in after.items() if p.startswith("sparse")]
    assert len(sparse) == 200
    assert all(e["sha256"] is None and e["size"] == 64 << 20 and "sparse file" in e["skipped"] for e in sparse)
    assert after["dense"]["sha256"] is not None  # a dense file is still hashed
    assert any("200 sparse file(s) not hashed" in n for n in doc["notes"]), doc["notes"]
    assert any("200 sparse file(s) not hashed" in n for n in r.notes)


def test_sparse_files_in_the_default_model_are_hashed_within_the_budget_or_skipped(base: Path) -> None:
    """Whatever the workspace model does with holes (a copy-on-write commit may write them out),
    each sparse file is either hashed correctly or listed as skipped, within the budget."""
    import hashlib
    r, doc = _record.execute_recorded(["sh", "-c", "truncate -s 8M a; truncate -s 8M b; truncate -s 8M c"],
                                      workspace_base=str(base / "ws"), hash_budget=(16 << 20, 60.0))
    assert r.exit_code == 0, r.stderr
    zeros = hashlib.sha256(bytes(8 << 20)).hexdigest()
    files = [e for e in doc["workspace"]["after"] if e["kind"] == "file"]
    assert sorted(e["path"] for e in files) == ["a", "b", "c"]
    for e in files:
        assert e["sha256"] == zeros or (e["sha256"] is None and e["skipped"]), e
    assert sum(e["size"] for e in files if e["sha256"]) <= 16 << 20


def test_a_walk_over_200_sparse_64mib_files_reads_nothing(base: Path) -> None:
    ws = base / "w"
    ws.mkdir()
    for i in range(200):
        with open(ws / f"s{i}", "wb") as f:
            f.truncate(64 << 20)
    budget = _record.HashBudget()
    entries, complete = _record.hash_workspace(str(ws), budget=budget)
    assert complete and len(entries) == 200
    assert all(e["sha256"] is None and "sparse file" in e["skipped"] for e in entries)
    assert budget.used_bytes == 0 and budget.skipped_sparse == 200


def test_dense_files_beyond_the_byte_budget_are_listed_as_skipped(base: Path) -> None:
    r, doc = _record.execute_recorded(
        ["sh", "-c", "for i in 1 2 3 4 5 6; do head -c 524288 /dev/urandom > f$i; done"],
        workspace_base=str(base / "ws"), hash_budget=(1 << 20, 60.0))
    assert r.exit_code == 0, r.stderr
    files = [e for e in doc["workspace"]["after"] if e["kind"] == "file"]
    hashed = [e for e in files if e["sha256"] is not None]
    skipped = [e for e in files if e["sha256"] is None]
    assert len(hashed) == 2 and len(skipped) == 4
    assert all("hash budget" in e["skipped"] for e in skipped)
    assert any("4 file(s) not hashed: the hash budget of 1048576 bytes" in n for n in doc["notes"]), doc["notes"]


def test_time_budget_stops_the_walk(base: Path) -> None:
    ws = base / "w"
    ws.mkdir()
    for i in range(20):
        (ws / f"f{i}").write_bytes(b"x" * 100_000)
    budget = _record.HashBudget(max_bytes=1 << 40, max_seconds=0.0)
    entries, complete = _record.hash_workspace(str(ws), budget=budget)
    assert complete
    assert sum(e["sha256"] is None for e in entries) >= 19
    assert budget.skipped_budget >= 19 and "hash budget" in (budget.note("after") or "")


def test_a_file_with_few_blocks_but_no_holes_is_hashed(base: Path) -> None:
    """st_blocks alone is not proof of holes (compressed file systems report few blocks):
    SEEK_DATA/SEEK_HOLE decide. A preallocated file with data everywhere is dense."""
    ws = base / "w"
    ws.mkdir()
    (ws / "dense").write_bytes(os.urandom(3 << 20))
    with open(ws / "holey", "wb") as f:
        f.write(b"head")
        f.seek(8 << 20)
        f.write(b"tail")
    entries, _ = _record.hash_workspace(str(ws))
    by = {e["path"]: e for e in entries}
    assert by["dense"]["sha256"] is not None
    assert by["holey"]["sha256"] is None and "sparse file" in by["holey"]["skipped"]
