"""The canonical policy: a Policy as a JSON object, its SHA-256, and the Policy rebuilt from it.

:func:`canonical_policy` writes every field by its own name (the seccomp profile as its name,
default action, log flag and the SHA-256 of its rule table: :func:`seccomp_rules_sha256`);
:func:`policy_sha256` hashes its compact key-sorted UTF-8 JSON; :func:`policy_from_canonical`
is the record's parser of that object back into a Policy (a record is untrusted input: unknown
fields and unknown seccomp profiles are refused). One concept: the Policy's record form.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from lowlevel.record.schema import RecordError
from lowlevel.spec import seccomp as _seccomp
from lowlevel.spec.egress import RECORD_OMIT_DEFAULT, egress_from_mapping
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Bind, Policy
from lowlevel.spec.report import json_safe, name_from_json


def canonical_value(value: Any) -> Any:
    """JSON-ready form of a policy value: dataclasses by their comparable fields, tuples as lists.

    A field marked :data:`lowlevel.spec.egress.RECORD_OMIT_DEFAULT` is left out while it has its
    default: a field added after records were written keeps their ``policy_sha256`` (and a
    policy that never sets it hashes as before); a set one is written, and an older lowlevel
    refuses the record as naming a field it does not know."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: canonical_value(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.compare and not _omitted(f, getattr(value, f.name))}
    if isinstance(value, Mapping):
        return {str(k): canonical_value(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [canonical_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _omitted(f: dataclasses.Field[Any], value: Any) -> bool:
    return f.metadata.get("record") == RECORD_OMIT_DEFAULT["record"] and value == f.default


def _dumps(value: Any) -> bytes:
    return json.dumps(json_safe(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seccomp_rules_sha256(profile: Any) -> str:
    """SHA-256 of a SeccompProfile's rule table: rows (syscall, action, args), default action, log.

    Prose (``reason``, ``source``) does not count, as it does not for equality. Host-independent,
    unlike the BPF bytes (which depend on the arch and the libseccomp version).
    """
    canon = canonical_value(profile)
    canon.pop("name", None)
    return hashlib.sha256(_dumps(canon)).hexdigest()


def canonical_policy(policy: Policy) -> dict[str, Any]:
    """The Policy as a JSON object (see the module glossary). Pure."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if f.name == "seccomp":
            out[f.name] = None if value is None else {
                "name": value.name, "default_action": value.default_action, "log": value.log,
                "rules_sha256": seccomp_rules_sha256(value)}
        elif f.name == "rootfs" and policy.image is not None:
            out[f.name] = None  # the image's tree: a path in this host's store; the image id pins it
        elif f.name == "binds":
            # allow_sockets (issue 22) only when set: records made before it hash as they did.
            out[f.name] = [{k: v for k, v in canonical_value(b).items() if not (k == "allow_sockets" and v is False)}
                           for b in value]
        elif f.name == "limits":
            # upper (issue 27) only when not the default: records made before it hash as they did.
            out[f.name] = {k: v for k, v in canonical_value(value).items() if not (k == "upper" and v == "tmpfs")}
        else:
            out[f.name] = canonical_value(value)
    return out


def policy_sha256(policy: Policy) -> str:
    """SHA-256 (hex) of :func:`canonical_policy`'s compact, key-sorted UTF-8 JSON."""
    return hashlib.sha256(_dumps(canonical_policy(policy))).hexdigest()


def _known_profiles(extra: Sequence[Any]) -> dict[str, Any]:
    profiles = [_seccomp.DEFAULT_PROFILE, _seccomp.DEFAULT_PROFILE.with_log(), *extra]
    return {seccomp_rules_sha256(p): p for p in profiles}


def policy_from_canonical(canon: Mapping[str, Any], *, profiles: Sequence[Any] = ()) -> Policy:
    """Rebuild a Policy from :func:`canonical_policy` output.

    Args:
        canon: the ``policy`` object of a record.
        profiles: SeccompProfiles to look the record's profile up in (by rules hash), besides
            the default profile and its log-mode copy.
    Raises:
        RecordError: an unknown field, or a seccomp profile not among ``profiles``.
        PolicyError: the rebuilt Policy is invalid here (a bind source missing on this host).
    """
    canon = decode_names(canon)
    if not isinstance(canon, Mapping):
        raise RecordError("the record's policy is not an object")
    names = {f.name for f in dataclasses.fields(Policy)}
    unknown = set(canon) - names
    if unknown:
        raise RecordError(f"record policy has fields this lowlevel does not know: {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in canon.items():
        if name == "binds":
            kwargs[name] = tuple(Bind(**b) for b in value)
        elif name == "limits":
            limit_kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
            kwargs[name] = Limits(**limit_kwargs)
        elif name == "env":
            kwargs[name] = tuple((k, v) for k, v in value)
        elif name == "network" and isinstance(value, Mapping):
            kwargs[name] = egress_from_mapping(value)
        elif name == "seccomp":
            if value is None:
                kwargs[name] = None
            else:
                found = _known_profiles(profiles).get(value["rules_sha256"])
                if found is None:
                    raise RecordError(f"the record's seccomp profile {value['name']!r} (rules sha256 "
                                      f"{value['rules_sha256']}) is not known here: pass it to replay(profiles=...)")
                kwargs[name] = found
        else:
            kwargs[name] = tuple(value) if isinstance(value, list) else value
    return Policy(**kwargs)


def decode_names(value: Any) -> Any:
    """Turn every ``{"b64", "text"}`` name object (:mod:`lowlevel.spec.report`) in a JSON value back
    into the str it stands for."""
    if isinstance(value, Mapping):
        if set(value) == {"b64", "text"}:
            return name_from_json(value)
        return {k: decode_names(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_names(v) for v in value]
    return value


__all__ = ["canonical_policy", "canonical_value", "decode_names", "policy_from_canonical", "policy_sha256",
           "seccomp_rules_sha256"]
