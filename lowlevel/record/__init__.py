"""Run records: one JSON document per run, to audit it and to replay it.

A record (schema ``docs/record-schema.json``, prose in ``docs/records.md``) holds the full
bwrap argv, the Policy in a canonical form and its SHA-256, the seccomp profile hash, the
versions of bwrap, libseccomp, the kernel, Python and lowlevel, the environment inside the
sandbox, the limits requested and enforced, timings, rusage and cgroup figures, the exit
status, ``killed_by``, and the SHA-256 of every workspace file before and after the run.

Glossary:
    canonical policy: :func:`canonical_policy`: the Policy as a JSON object with sorted keys,
        every field by its own name; the seccomp profile appears as its name, default action,
        log flag and the SHA-256 of its rule table (see :func:`seccomp_rules_sha256`). Its
        SHA-256 (``policy_sha256``) is the hash of ``json.dumps(canonical, sort_keys=True,
        separators=(",", ":"), ensure_ascii=False)`` encoded as UTF-8.
    input store: the sibling directory ``<record>.inputs/`` holding a copy of every regular
        file that was in the workspace before the run (and stdin, if any), each named by its
        SHA-256 (content-addressed, so a file used twice is stored once). Replay needs the

The package, one module per concept: :mod:`~lowlevel.record.schema` (what a record file is:
``schema``, :class:`RecordError`, the bounds), :mod:`~lowlevel.record.canonical` (the Policy's
record form and hash), :mod:`~lowlevel.record.hashing` (workspace hashes within a
:class:`HashBudget`, the input store), :mod:`~lowlevel.record.writing` (:func:`execute_recorded`,
:func:`record_run`), :mod:`~lowlevel.record.validation` (:func:`load_record`,
:func:`validate_record`: a record is untrusted input), :mod:`~lowlevel.record.loosening`
(:func:`policy_loosening`, :func:`argv_loosening`) and :mod:`~lowlevel.record.replay`
(:func:`replay`, :func:`compare`). Every name ``docs/records.md`` shows is here.

Workspace content is untrusted: it is walked without following a symlink and each file is
opened relative to directory fds with ``O_NOFOLLOW`` (special files and multiply-linked files
refused). Each walk is bounded (:class:`HashBudget`: total bytes and seconds); files larger
than :data:`MAX_HASH_BYTES`, sparse files, and files past the budget are listed with
``sha256: null`` and a ``skipped`` reason, and the record's notes count them.

A record is untrusted input to :func:`replay`: :func:`validate_record` checks every field it
uses first. Names that are not valid UTF-8 are written as ``{"b64", "text"}`` objects
(:mod:`lowlevel.spec.report`), so a record is always strict UTF-8 JSON and loses nothing.
"""

from __future__ import annotations

from lowlevel.record.canonical import canonical_policy, policy_from_canonical, policy_sha256, seccomp_rules_sha256
from lowlevel.record.hashing import (HASH_BUDGET_BYTES, HASH_BUDGET_S, MAX_HASH_BYTES, MAX_HOLE_BYTES,
                                     MAX_STORE_BYTES, HashBudget, hash_workspace)
from lowlevel.record.loosening import argv_loosening, policy_loosening
from lowlevel.record.replay import ReplayReport, compare, replay
from lowlevel.record.schema import (MAX_RECORD_BYTES, MAX_REPLAY_BYTES, MAX_REPLAY_ENTRIES, SCHEMA_ID, STORE_SUFFIX,
                                    RecordError, store_dir_for)
from lowlevel.record.validation import ParsedRecord, load_record, validate_record
from lowlevel.record.writing import check_record_path, execute_recorded, record_run
from lowlevel.spec.report import RECORD_NOT_WRITTEN

__all__ = ["HASH_BUDGET_BYTES", "HASH_BUDGET_S", "MAX_HASH_BYTES", "MAX_HOLE_BYTES", "MAX_RECORD_BYTES",
           "MAX_REPLAY_BYTES", "MAX_REPLAY_ENTRIES", "MAX_STORE_BYTES", "RECORD_NOT_WRITTEN", "STORE_SUFFIX",
           "HashBudget", "ParsedRecord", "RecordError", "ReplayReport", "SCHEMA_ID", "argv_loosening",
           "canonical_policy", "check_record_path", "compare", "execute_recorded", "hash_workspace", "load_record",
           "policy_from_canonical", "policy_loosening", "policy_sha256", "record_run", "replay",
           "seccomp_rules_sha256", "store_dir_for", "validate_record"]
