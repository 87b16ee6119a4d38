"""Policy settings from a TOML/JSON-shaped mapping: the one parser of lowlevel's config files.

``lowlevel mcp --config FILE.toml`` (:class:`lowlevel.mcp_server.ServerConfig`) and the
integrations' TOML (:class:`lowlevel.integrations._config.SandboxConfig`) read their
``[limits]``, ``[[binds]]``, ``[egress]``, ``[env]`` and the Policy's own keys here, with one
syntax and one error model:

* a size is a byte count or a string with a K/M/G/T suffix (``"512M"``; :func:`lowlevel.units.size_bytes`),
  for every key ending in ``_bytes``;
* a duration is seconds or a string with an s/m/h/d suffix (``"2m"``; :func:`lowlevel.units.duration_seconds`),
  for ``[limits] cpu_s`` and the callers' ``*_s`` keys;
* a key no field has is an error (a typo must not silently drop a limit), and so is a value of
  the wrong shape (a table where a list belongs);
* every error is one :class:`~lowlevel.errors.PolicyError` line that names the key path
  (:class:`KeyPath`): ``"lowlevel.toml: limits.memory_bytes: invalid size 'lots': ..."``, or in
  the MCP server's table style ``"mcp config [limits] memory_bytes: invalid size '128Q': ..."``.

Pure but for two reads the values ask for: ``[egress] extra_ca_file`` (a PEM file read here)
and the checks the objects make when built (a :class:`~lowlevel.spec.policy.Bind` source must
exist, a Policy's ``rootfs``/``image`` is resolved). Reading the TOML file itself is the caller's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lowlevel.errors import LowlevelError, PolicyError
from lowlevel.spec.egress import Egress, egress_from_mapping
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Bind, Policy
from lowlevel.units import duration_seconds, size_bytes

#: ``[limits]`` keys that take a size (``"512M"``), and the one that takes a duration (``"2m"``).
LIMIT_SIZES = frozenset(f.name for f in dataclasses.fields(Limits) if f.name.endswith("_bytes"))
LIMIT_DURATIONS = frozenset({"cpu_s"})

#: The Policy fields a config may set (not ``seccomp``, ``unsafe_no_seccomp``, ``landlock_omit``:
#: code-only choices), plus ``egress``: an ``[egress]`` table that becomes ``Policy.network``.
POLICY_KEYS = frozenset({"network", "deterministic", "hostname", "stdout_limit_bytes", "stderr_limit_bytes",
                         "env", "limits", "binds", "host_uid", "host_gid", "sandbox_uid", "sandbox_gid",
                         "landlock", "image", "rootfs", "rootfs_writable", "workdir", "compat_32bit"})
EGRESS_KEY = "egress"
#: The keys that are TOML tables: ``[limits]`` in the table style of :class:`KeyPath`.
_TABLES = frozenset({"limits", EGRESS_KEY, "env"})


@dataclass(frozen=True)
class KeyPath:
    """Where a value sits in a config, for the error message: ``where`` (the file, or
    ``"mcp config"``) and the keys down to it.

    Attributes:
        where: names the config (a file path, ``"mcp config"``); ``""`` for none.
        keys: the keys from the top (str) and list indexes (int).
        style: ``"dotted"`` renders ``where: limits.memory_bytes`` and ``binds[1]``; ``"table"``
            renders ``where [limits] memory_bytes`` (the TOML table header, as docs/mcp.md shows).
    """

    where: str = ""
    keys: tuple[str | int, ...] = ()
    style: str = "dotted"

    def __truediv__(self, key: str | int) -> KeyPath:
        return dataclasses.replace(self, keys=(*self.keys, key))

    def __str__(self) -> str:
        path = ""
        for i, key in enumerate(self.keys):
            if isinstance(key, int):
                path += f"[{key}]"
            elif self.style == "table":
                path += f"[{key}]" if i == 0 and key in _TABLES else (" " if path else "") + key
            else:
                path += ("." if path else "") + key
        if not self.where or not path:
            return self.where or path
        return f"{self.where} {path}" if self.style == "table" else f"{self.where}: {path}"

    def error(self, problem: str) -> PolicyError:
        """``PolicyError("<path>: <problem>")`` (just the problem at an empty path)."""
        return PolicyError(f"{self}: {problem}" if str(self) else problem)

    def must(self, requirement: str) -> PolicyError:
        """``PolicyError("<path> must be ...")``: ``requirement`` starts with ``must``."""
        return PolicyError(f"{self} {requirement}" if str(self) else requirement)


def check_keys(data: Mapping[str, Any], known: Iterable[str], path: KeyPath, label: str = "") -> None:
    """Refuse a key not in ``known``: ``"<path>: unknown [limits] keys ['memory']; known: [...]"``.

    Args:
        label: the table as the message names it (``"[limits] "``, ``"[[binds]] "``; ``""`` for the top).
    Raises:
        PolicyError: an unknown key.
    """
    known = set(known)
    unknown = set(data) - known
    if unknown:
        raise path.error(f"unknown {label}keys {sorted(unknown, key=str)}; known: {sorted(known)}")


def table(value: object, path: KeyPath, what: str) -> Mapping[str, Any]:
    """``value`` when it is a mapping (a TOML table). Raises PolicyError ``"<path> must be <what>"``."""
    if not isinstance(value, Mapping):
        raise path.must(f"must be {what}, got {type(value).__name__}")
    return value


def size(value: object, path: KeyPath, *, optional: bool = False) -> int | None:
    """A byte count (``65536`` or ``"64K"``), or None when ``optional``. Raises PolicyError naming ``path``."""
    if value is None and optional:
        return None
    return size_bytes(value, str(path))


def seconds(value: object, path: KeyPath, *, optional: bool = False, positive: bool = False) -> float | None:
    """Seconds (``30`` or ``"30s"``, ``"2m"``), or None when ``optional``; ``positive``: > 0.

    Raises:
        PolicyError: not a duration (``"<path>: invalid duration ..."``), or not > 0
            (``"<path> must be a number of seconds > 0, got 0"``).
    """
    if value is None and optional:
        return None
    result = duration_seconds(value, str(path))
    if positive and not result > 0:
        raise path.must(f"must be a number of seconds > 0, got {value!r}")
    return result


def limits_from_mapping(value: object, path: KeyPath = KeyPath(keys=("limits",)),
                        base: Limits | None = None) -> Limits:
    """A ``[limits]`` table (``memory_bytes = "512M"``, ``cpu_s = "2m"``, ``pids = 128``,
    ``require = ["memory"]``) as :class:`~lowlevel.spec.limits.Limits`; a Limits is returned as is.

    Args:
        path: where the table is (its last key names it).
        base: the Limits the table's keys replace fields of (default: ``Limits()``).
    Raises:
        PolicyError: not a table, an unknown key, a bad size/duration, or a value Limits refuses
            (its message after the path).
    """
    if isinstance(value, Limits):
        return value
    data = table(value, path, "a table")
    check_keys(data, (f.name for f in dataclasses.fields(Limits)), dataclasses.replace(path, keys=path.keys[:-1]),
               "[limits] ")
    kwargs: dict[str, Any] = {}
    for key, raw in data.items():
        kwargs[key] = (size(raw, path / key, optional=True) if key in LIMIT_SIZES
                       else seconds(raw, path / key, optional=True) if key in LIMIT_DURATIONS
                       else tuple(raw) if isinstance(raw, list) else raw)
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else Limits(**kwargs)
    except PolicyError as err:
        raise path.error(str(err)) from None


def bind_from_mapping(value: object, path: KeyPath) -> Bind:
    """A ``[[binds]]`` entry (``source``, ``dest``, ``writable``, ``allow_sensitive``,
    ``allow_sockets``; a bare string is a ``source``) as a :class:`~lowlevel.spec.policy.Bind`.

    Raises:
        PolicyError: not a table, an unknown key, or a bind the Bind refuses (a missing source,
            a sensitive one): one line naming the entry.
    """
    if isinstance(value, Bind):
        return value
    if isinstance(value, str):
        value = {"source": value}
    if not isinstance(value, Mapping):
        raise path.error("each [[binds]] entry must be a table with source (and dest, writable)")
    check_keys(value, (f.name for f in dataclasses.fields(Bind)), path, "[[binds]] ")
    try:
        return Bind(**value)
    except PolicyError as err:
        # One line naming the file and the entry (a missing source otherwise reached the
        # framework as a bare "Bind source ... does not exist" deep in its sample setup).
        raise path.error(f"{err}; fix or remove this [[binds]] entry") from None
    except TypeError as err:  # a required field missing (source)
        raise path.error(str(err)) from None


def binds_from_list(value: object, path: KeyPath) -> tuple[Bind, ...]:
    """``[[binds]]`` (a list of entries, see :func:`bind_from_mapping`) as a tuple of Binds.

    Raises:
        PolicyError: not a list, or a bad entry (``binds[i]`` in the message).
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise path.must(f"must be a list of [[binds]] tables, got {type(value).__name__}")
    return tuple(bind_from_mapping(entry, path / i) for i, entry in enumerate(value))


def egress_from_config(value: object, path: KeyPath) -> Egress:
    """An ``[egress]`` table (``allow``, ``deny``, ``allow_cidrs``, ``allow_ports``, ``tls_ports``,
    ``extra_ca_pem``, or ``extra_ca_file``: a PEM file read here) as an
    :class:`~lowlevel.spec.egress.Egress`; an Egress is returned as is.

    Raises:
        PolicyError: not a table, an unknown key, an unreadable CA file, or a value Egress refuses.
    """
    if isinstance(value, Egress):
        return value
    spec = dict(table(value, path, "a table (allow = [...], deny, allow_cidrs, allow_ports, tls_ports)"))
    ca_file = spec.pop("extra_ca_file", None)
    if ca_file is not None:
        try:
            with open(ca_file, encoding="ascii") as f:
                spec["extra_ca_pem"] = f.read()
        except (OSError, UnicodeDecodeError, TypeError) as err:
            raise (path / "extra_ca_file").error(f"{ca_file!r}: {err}") from None
    try:
        return egress_from_mapping(spec)
    except (LowlevelError, TypeError) as err:
        raise path.error(str(err)) from None


def env_from_mapping(value: object, path: KeyPath) -> dict[str, str]:
    """An ``[env]`` table (``NAME = "value"``) as a dict; values are turned into strings.

    Raises:
        PolicyError: not a table (``"<path> must be a table of NAME = \\"value\\""``).
    """
    if not isinstance(value, Mapping):
        raise path.must('must be a table of NAME = "value"')
    return {str(k): str(v) for k, v in value.items()}


def policy_from_mapping(data: Mapping[str, Any], path: KeyPath = KeyPath()) -> Policy:
    """A :class:`~lowlevel.spec.policy.Policy` from the keys :data:`POLICY_KEYS` and ``egress``.

    ``network`` is true or false (the host's whole network, or none); an ``[egress]`` table is an
    allowlist (``Policy.network = Egress(...)``); the two together are refused.

    Raises:
        PolicyError: an unknown key or a bad value; one line, naming the key path (a value the
            Policy itself refuses gets ``path``'s ``where`` in front).
    """
    data = table(data, path, "a table of settings")
    check_keys(data, POLICY_KEYS | {EGRESS_KEY}, path)
    kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in POLICY_KEYS}
    if "network" in kwargs and not isinstance(kwargs["network"], bool):
        raise (path / "network").must(f"must be true or false (the host's whole network), got "
                                      f"{kwargs['network']!r}; for an allowlist use an [egress] table")
    if EGRESS_KEY in data:
        if kwargs.get("network") is True:
            raise path.error("network = true (the host's whole network) and [egress] (an allowlist) contradict "
                             "each other: keep one")
        kwargs["network"] = egress_from_config(data[EGRESS_KEY], path / EGRESS_KEY)
    for name in ("stdout_limit_bytes", "stderr_limit_bytes"):
        if name in kwargs:
            kwargs[name] = size(kwargs[name], path / name)
    if "env" in kwargs:
        kwargs["env"] = env_from_mapping(kwargs["env"], path / "env")
    if "limits" in kwargs:
        kwargs["limits"] = limits_from_mapping(kwargs["limits"], path / "limits")
    if "binds" in kwargs:
        kwargs["binds"] = binds_from_list(kwargs["binds"], path / "binds")
    try:
        return Policy(**kwargs)
    except PolicyError as err:  # name the file: the form of image/rootfs/landlock values (store, tree: rootfs.resolve)
        raise KeyPath(path.where).error(str(err)) from None


__all__ = ["EGRESS_KEY", "LIMIT_DURATIONS", "LIMIT_SIZES", "POLICY_KEYS", "KeyPath", "bind_from_mapping",
           "binds_from_list", "check_keys", "egress_from_config", "env_from_mapping", "limits_from_mapping",
           "policy_from_mapping", "seconds", "size", "table"]
