"""Issue 10 items 1 and 4: a record is untrusted input to ``lowlevel replay``.

- A crafted record reached bwrap's argv through its ``cwd`` (NUL injection) without
  ``--trust-record-policy``: every field is now checked before use, and the looser-policy check
  also looks at what the record's cwd and env would add to bwrap's argv.
- 21 of 53 malformed records gave tracebacks with exit 1 ("outputs differ"): a fuzzer mutates an
  honest record (keys dropped, values of every JSON type put anywhere, the file cut short) and
  every outcome is exit 0/1 with no traceback, or exit 125 with a ``lowlevel:`` line.
- A record naming one 1 MiB blob 300 times wrote 300 MiB: the bytes and entries a replay writes
  are bounded before anything is written.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowlevel
from lowlevel import cli
from lowlevel.record import RecordError, replay

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def honest() -> Iterator[tuple[Path, dict[str, Any]]]:
    """An honest record with an input store, made once: (base dir, record document)."""
    base = Path(tempfile.mkdtemp(prefix="lowlevel-replay-validation-"))
    os.chmod(base, 0o711)
    inputs = base / "in"
    inputs.mkdir(mode=0o755)
    (inputs / "data.txt").write_text("hello\n")
    rec = base / "run.json"
    r = lowlevel.run(["sh", "-c", "cat in/data.txt > out.txt; echo done"], inputs=[inputs], record=str(rec),
                     workspace_base=str(base / "ws"))
    assert r.exit_code == 0, r.stderr
    shutil.rmtree(r.workspace)
    yield base, json.loads(rec.read_text())
    shutil.rmtree(base, ignore_errors=True)


def _cli_replay(path: Path, *extra: str) -> tuple[int, str]:
    err = io.StringIO()
    out = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = cli.main(["replay", *extra, str(path)])
    return rc, err.getvalue()


def _write(base: Path, name: str, doc: Any) -> Path:
    path = base / name
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def target() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lowlevel-replay-target-"))
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --- the NUL escape through a record ----------------------------------------------------------------

@pytest.mark.parametrize("field", ["cwd", "env", "command", "link"])
def test_crafted_record_cannot_inject_options(field: str, honest: tuple[Path, dict[str, Any]], target: Path) -> None:
    base, doc = honest
    crafted = copy.deepcopy(doc)
    inj = f"\0--bind\0{target}\0/tmp/host\0--share-net"
    crafted["command"] = ["sh", "-c", "touch /tmp/host/ESCAPED"]
    if field == "cwd":
        crafted["cwd"] = "/workspace" + inj
    elif field == "env":
        crafted["env"] = {"A": "1" + inj}
    elif field == "command":
        crafted["command"].append("x" + inj)
    else:
        crafted["workspace"]["before"].append({"path": "l", "kind": "symlink", "mode": 0o777, "size": 1,
                                               "sha256": None, "link": "x" + inj, "stored": False, "skipped": None})
    path = _write(base, f"crafted-{field}.json", crafted)
    for extra in ((), ("--trust-record-policy",)):  # no trust makes a NUL acceptable
        rc, err = _cli_replay(path, *extra)
        assert rc == 125, err
        assert err.count("\n") == 1 and err.startswith("lowlevel: refusing the record"), err
        assert "NUL" in err
    assert not (target / "ESCAPED").exists()


def test_argv_check_lists_what_env_would_add() -> None:
    """The second line in the looser-policy check: options a NUL would smuggle into --args.
    (A record's cwd never reaches --args any more: bwrap gets ``--chdir /`` and the guard
    changes directory, issue 22 item 1; a NUL in it is refused by validate_record.)"""
    from lowlevel.record import argv_loosening
    policy = lowlevel.Policy()
    assert argv_loosening(policy, env={"A": "1"}) == []
    assert argv_loosening(policy, env=None) == []
    lines = argv_loosening(policy, env={"A": "x\0--bind\0/\0/host"})
    assert any("--bind / /host" in ln for ln in lines), lines
    det = lowlevel.Policy(deterministic=True)  # --clearenv and sorted --setenv: nothing extra
    assert argv_loosening(det, env={"B": "2", "A": "1"}) == []


# --- malformed records: one line, exit 125, never a traceback --------------------------------------

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=20) | st.just("a\0b") | st.just("/workspace\0--share-net"),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=3), max_leaves=8)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:4]):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(doc: Any, path: tuple[Any, ...], op: str, value: Any) -> Any:
    doc = copy.deepcopy(doc)
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if op == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(data=st.data())
def test_malformed_records_never_traceback(honest: tuple[Path, dict[str, Any]], data: st.DataObject) -> None:
    base, doc = honest
    paths = _paths(doc)
    path = data.draw(st.sampled_from(paths[1:]), label="path")
    op = data.draw(st.sampled_from(["delete", "replace"]), label="op")
    value = data.draw(_JSON, label="value") if op == "replace" else None
    mutated = _mutate(doc, path, op, value)
    rec = _write(base, "fuzz.json", mutated)
    rc, err = _cli_replay(rec)
    assert "Traceback" not in err
    assert rc in (0, 1, 125), (rc, err)
    if rc == 125:
        assert err.startswith("lowlevel: "), err
        if "looser than the default" not in err:  # that refusal lists each difference on its own line
            assert err.count("\n") == 1, err


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 4000), junk=st.binary(max_size=8))
def test_truncated_or_garbled_record_files(honest: tuple[Path, dict[str, Any]], cut: int, junk: bytes) -> None:
    base, doc = honest
    text = json.dumps(doc).encode()
    rec = base / "cut.json"
    rec.write_bytes(text[:cut] + junk)
    rc, err = _cli_replay(rec)
    assert rc == 125 and err.count("\n") == 1 and err.startswith("lowlevel: "), (rc, err)


def test_deeply_nested_and_huge_values(honest: tuple[Path, dict[str, Any]]) -> None:
    base, doc = honest
    rec = base / "deep.json"
    rec.write_text('{"schema": "lowlevel-run-record/1", "command": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rc, err = _cli_replay(rec)
    assert rc == 125 and err.count("\n") == 1, err
    for field, value in (("timeout_s", 1e308), ("timeout_s", -1), ("command", ["x" * 200_000]),
                         ("cwd", "/" + "a/" * 3000), ("env", {"A=B": "1"}), ("env", {"": "1"})):
        crafted = copy.deepcopy(doc)
        crafted[field] = value
        rc, err = _cli_replay(_write(base, "huge.json", crafted))
        assert rc == 125 and err.count("\n") == 1 and field in err, (field, err)


# --- bounded replay writes ---------------------------------------------------------------------------

def test_one_blob_named_300_times_is_refused_before_writing(honest: tuple[Path, dict[str, Any]]) -> None:
    base, doc = honest
    blob = os.urandom(1 << 20)
    import hashlib
    digest = hashlib.sha256(blob).hexdigest()
    store = base / "run.json.inputs"
    (store / digest).write_bytes(blob)
    crafted = copy.deepcopy(doc)
    crafted["workspace"]["before"] = [
        {"path": f"copy{i}", "kind": "file", "mode": 0o644, "size": 1 << 20, "sha256": digest, "link": None,
         "stored": True, "skipped": None} for i in range(300)]
    rec = _write(base, "amplify.json", crafted)
    ws_base = base / "amplify-ws"
    with pytest.raises(RecordError, match="more than"):
        replay(rec, workspace_base=str(ws_base))
    from lowlevel.record import MAX_REPLAY_BYTES
    assert 300 << 20 > MAX_REPLAY_BYTES
    assert list(ws_base.iterdir()) == [], "the replay workspace was left"
    with pytest.raises(RecordError, match="entries"):
        replay(rec, workspace_base=str(ws_base), max_entries=100, max_bytes=1 << 40)
    rc, err = _cli_replay(rec, "--max-bytes", "64M")
    assert rc == 125 and "more than 67108864 bytes" in err, err


def test_honest_record_still_replays(honest: tuple[Path, dict[str, Any]]) -> None:
    base, doc = honest
    rec = _write(base, "again.json", doc)
    report = replay(rec, workspace_base=str(base / "ws"))
    assert report.matched, report.differences
