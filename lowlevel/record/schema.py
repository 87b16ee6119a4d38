"""What a run record file is: its ``schema`` value, its error type, the input store's name and
the bounds a record (untrusted input) is held to. One concept: the format's identity.

See :mod:`lowlevel.record` (the glossary) and ``docs/record-schema.json``.
"""

from __future__ import annotations

import os

from lowlevel import workspace as _ws
from lowlevel.errors import LowlevelError

#: The ``schema`` value of records this module writes and reads.
SCHEMA_ID = "lowlevel-run-record/1"
#: Suffix of the input store directory next to the record file.
STORE_SUFFIX = ".inputs"


class RecordError(LowlevelError):
    """A record cannot be written, read or replayed (bad schema, missing input, policy drift)."""


#: The top-level keys a record may have (``docs/record-schema.json``'s ``properties``, which has
#: ``additionalProperties: false``; tests/unit/test_record_schema_keys.py keeps the two the same).
TOP_LEVEL_KEYS = frozenset({
    "schema", "created_at", "command", "cwd", "env", "environment", "stdin", "timeout_s", "policy", "policy_sha256",
    "seccomp", "bwrap_argv", "versions", "host", "limits", "timings", "usage", "exit", "output", "workspace",
    "inputs", "notes", "network", "rootfs"})

#: Largest record file :func:`load_record` reads (bytes).
MAX_RECORD_BYTES = 256 * 1024 * 1024
#: Default cap on the bytes a replay writes into its workspace (every copy of a file counts).
MAX_REPLAY_BYTES = 256 * 1024 * 1024
#: Default cap on the entries a replay creates (files, directories, symlinks).
MAX_REPLAY_ENTRIES = _ws.MAX_SNAPSHOT_ENTRIES


def store_dir_for(record_path: str) -> str:
    """The input store directory of the record at ``record_path``: ``<record_path>.inputs``."""
    return os.path.abspath(record_path) + STORE_SUFFIX


__all__ = ["MAX_RECORD_BYTES", "MAX_REPLAY_BYTES", "MAX_REPLAY_ENTRIES", "RecordError", "SCHEMA_ID", "STORE_SUFFIX",
           "TOP_LEVEL_KEYS", "store_dir_for"]
