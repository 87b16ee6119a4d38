"""A record is untrusted input: ``load_record`` refuses a key given twice in one object (readers
disagree on which one counts: Python's json kept the last, so a reviewer reading the first saw
another command than the one replayed) and a top-level field the schema does not have
(``additionalProperties: false``), each in one line; a replay of a record whose image names are
not strings is one line naming the field (it was a TypeError's text). Found by a fresh-user trial."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowlevel.record.replay import _check_image_present
from lowlevel.record.schema import SCHEMA_ID, TOP_LEVEL_KEYS, RecordError
from lowlevel.record.validation import load_record

REPO = Path(__file__).resolve().parents[2]


def test_top_level_keys_are_the_schema_s() -> None:
    schema = json.loads((REPO / "docs" / "record-schema.json").read_text())
    assert schema["additionalProperties"] is False
    assert TOP_LEVEL_KEYS == set(schema["properties"])


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(f'{{"schema": "{SCHEMA_ID}", "command": ["echo", "shown"], "command": ["echo", "run"]}}')
    with pytest.raises(RecordError, match="the key 'command' appears twice in one object"):
        load_record(path)
    path.write_text(f'{{"schema": "{SCHEMA_ID}", "env": {{"A": "1", "A": "2"}}}}')  # nested objects too
    with pytest.raises(RecordError, match="the key 'A' appears twice"):
        load_record(path)
    path.write_text(f'{{"schema": "{SCHEMA_ID}", "command": ["echo"], "env": {{"A": "1", "B": "2"}}}}')
    assert load_record(path)["env"] == {"A": "1", "B": "2"}  # control


def test_an_unknown_top_level_field_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"schema": SCHEMA_ID, "command": ["true"], "evil": 1}))
    with pytest.raises(RecordError, match="unknown field 'evil'"):
        load_record(path)


@pytest.mark.parametrize("image", [{"id": "x", "names": 5}, {"id": 5, "names": []}, {"id": "x", "names": [1]}])
def test_image_fields_of_the_wrong_type_name_the_field(image: dict[str, object]) -> None:
    with pytest.raises(RecordError, match="rootfs.image.id must be a string and rootfs.image.names a list"):
        _check_image_present({"rootfs": {"image": image}})
