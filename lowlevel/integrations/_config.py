"""A lowlevel Policy from a mapping or a TOML file: the config format the adapters share.

Format (every key optional; sizes are byte counts or strings with a K/M/G/T suffix, powers
of 1024)::

    network = false                  # Policy.network: false (own loopback only) or true (the host's
                                     # whole network); for an allowlist use [egress] instead
    landlock = true                  # Policy.landlock: true, false or "require"; false lifts the
                                     # second wall (e.g. a test suite that binds 127.0.0.1:
                                     # Landlock refuses every TCP bind with EACCES)
    image = "python:3.12"            # Policy.image: an imported image (lowlevel image import)
    rootfs = "/srv/rootfs/bookworm"  # Policy.rootfs: a root filesystem tree (instead of image)
    rootfs_writable = false          # Policy.rootfs_writable: a discarded writable layer over it
    workdir = "/workspace"           # Policy.workdir: default working directory inside
    deterministic = false            # Policy.deterministic
    hostname = "sandbox"             # Policy.hostname
    stdout_limit_bytes = "16M"       # Policy.stdout_limit_bytes / stderr_limit_bytes
    workspace_base = "/srv/ll-ws"    # parent of the per-sandbox workspaces (adapter setting)
    default_timeout_s = 600          # adapter setting: timeout of a command given none

    [env]                            # Policy.env, on top of lowlevel.spec.policy.BASE_ENV
    PYTHONUNBUFFERED = "1"

    [limits]                         # lowlevel.Limits fields
    memory_bytes = "512M"
    cpu_s = 30
    pids = 128
    require = ["memory"]

    [[binds]]                        # lowlevel.Bind fields
    source = "/opt/venv"
    writable = false

    [egress]                         # network by allowlist (lowlevel.Egress, parsed by
    allow = ["pypi.org", "files.pythonhosted.org"]   # lowlevel.spec.egress.egress_from_mapping,
    allow_ports = [443]              # as for ``lowlevel mcp``); not with network = true
    extra_ca_file = "/etc/company-ca.pem"            # optional: CA certificates trusted inside

Unknown keys are errors (a typo must not silently drop a limit).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from lowlevel.spec.egress import egress_from_mapping
from lowlevel.errors import LowlevelError, PolicyError
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Bind, Policy

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_SIZE_FIELDS = {"memory_bytes", "address_space_bytes", "fsize_bytes", "core_bytes", "tmp_size_bytes",
                "workspace_bytes", "stdout_limit_bytes", "stderr_limit_bytes"}
_POLICY_KEYS = {"network", "deterministic", "hostname", "stdout_limit_bytes", "stderr_limit_bytes", "env",
                "limits", "binds", "host_uid", "host_gid", "sandbox_uid", "sandbox_gid", "landlock", "image",
                "rootfs", "rootfs_writable", "workdir", "compat_32bit"}
#: Keys turned into a Policy field of another name: ``[egress]`` becomes ``Policy.network``.
_EGRESS_KEY = "egress"
_ADAPTER_KEYS = {"workspace_base", "default_timeout_s"}


def parse_size(value: object, name: str) -> int | None:
    """A byte count from an int or a string such as ``"512M"`` (K/M/G/T: powers of 1024).

    Raises:
        PolicyError: not a size (the message names ``name``).
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and (m.group(2) or "." not in m.group(1)):
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise PolicyError(f"{name}: invalid size {value!r}: use a number of bytes or a string with a K, M or G "
                      "suffix, e.g. \"256M\"")


@dataclass(frozen=True)
class SandboxConfig:
    """What an adapter needs: the Policy of every sandbox, and where workspaces go.

    Attributes:
        policy: the operator's :class:`lowlevel.Policy` (fixed; models cannot widen it).
        workspace_base: parent directory of the per-sandbox workspaces; None: lowlevel's default
            (``/tmp/lowlevel-<uid>/`` or ``$LOWLEVEL_WORKSPACE_BASE``).
        default_timeout_s: wall-clock seconds for a command whose caller gives no timeout;
            None: no timeout (the framework's own contract decides).
    """

    policy: Policy = field(default_factory=Policy)
    workspace_base: str | None = None
    default_timeout_s: float | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, where: str = "config") -> SandboxConfig:
        """Build from a parsed mapping in the format of the module docstring.

        Raises:
            PolicyError: an unknown key or a bad value; the message names it and ``where``.
        """
        if not isinstance(data, Mapping):
            raise PolicyError(f"{where}: expected a table of settings, got {type(data).__name__}")
        unknown = set(data) - _POLICY_KEYS - _ADAPTER_KEYS - {_EGRESS_KEY}
        if unknown:
            known = sorted(_POLICY_KEYS | _ADAPTER_KEYS | {_EGRESS_KEY})
            raise PolicyError(f"{where}: unknown keys {sorted(unknown)}; known: {known}")
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in _POLICY_KEYS}
        if "network" in kwargs and not isinstance(kwargs["network"], bool):
            raise PolicyError(f"{where}: network must be true or false (the host's whole network), got "
                              f"{kwargs['network']!r}; for an allowlist use an [egress] table")
        if _EGRESS_KEY in data:
            if kwargs.get("network") is True:
                raise PolicyError(f"{where}: network = true (the host's whole network) and [egress] (an "
                                  "allowlist) contradict each other: keep one")
            kwargs["network"] = _egress(data[_EGRESS_KEY], where)
        try:
            for name in ("stdout_limit_bytes", "stderr_limit_bytes"):
                if name in kwargs:
                    kwargs[name] = parse_size(kwargs[name], f"{where}: {name}")
            if "env" in kwargs:
                env = kwargs["env"]
                if not isinstance(env, Mapping):
                    raise PolicyError(f"{where}: env must be a table of NAME = \"value\"")
                kwargs["env"] = {str(k): str(v) for k, v in env.items()}
            if "limits" in kwargs:
                kwargs["limits"] = _limits(kwargs["limits"], where)
            if "binds" in kwargs:
                kwargs["binds"] = tuple(_bind(b, f"{where}: binds[{i}]") for i, b in enumerate(kwargs["binds"]))
        except TypeError as err:
            raise PolicyError(f"{where}: {err}") from err
        try:
            policy = Policy(**kwargs)
            if policy.image is not None or policy.rootfs is not None:
                from lowlevel.rootfs.resolve import resolve  # the store and the tree, while the file can be named
                resolve(policy)  # cached for this Policy's runs
        except TypeError as err:
            raise PolicyError(f"{where}: {err}") from err
        except PolicyError as err:  # name the file: an image/rootfs/landlock value is checked here
            raise PolicyError(f"{where}: {err}") from None
        base = data.get("workspace_base")
        if base is not None and (not isinstance(base, str) or not os.path.isabs(base)):
            raise PolicyError(f"{where}: workspace_base must be an absolute path, got {base!r}")
        timeout = data.get("default_timeout_s")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise PolicyError(f"{where}: default_timeout_s must be a number of seconds > 0, got {timeout!r}")
        return cls(policy=policy, workspace_base=base, default_timeout_s=timeout)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> SandboxConfig:
        """Read a TOML file in the format of the module docstring.

        Raises:
            PolicyError: the file is missing, unreadable, not TOML, or has a bad key or value.
        """
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as err:
            raise PolicyError(f"cannot read lowlevel config {path}: {err.strerror}") from err
        except tomllib.TOMLDecodeError as err:
            raise PolicyError(f"lowlevel config {path} is not valid TOML: {err}") from err
        return cls.from_mapping(data, where=path)


def _egress(value: object, where: str) -> Any:
    """``[egress]`` as a :class:`lowlevel.Egress` (the parser ``lowlevel mcp`` uses, plus
    ``extra_ca_file``: a PEM file read here)."""
    if not isinstance(value, Mapping):
        raise PolicyError(f"{where}: [egress] must be a table (allow = [...], deny, allow_cidrs, allow_ports)")
    spec = dict(value)
    ca_file = spec.pop("extra_ca_file", None)
    if ca_file is not None:
        try:
            with open(ca_file, encoding="ascii") as f:
                spec["extra_ca_pem"] = f.read()
        except (OSError, UnicodeDecodeError, TypeError) as err:
            raise PolicyError(f"{where}: [egress] extra_ca_file {ca_file!r}: {err}") from None
    try:
        return egress_from_mapping(spec)
    except (LowlevelError, TypeError) as err:
        raise PolicyError(f"{where}: [egress]: {err}") from None


def _limits(value: object, where: str) -> Limits:
    if isinstance(value, Limits):
        return value
    if not isinstance(value, Mapping):
        raise PolicyError(f"{where}: [limits] must be a table")
    known = {f.name for f in fields(Limits)}
    unknown = set(value) - known
    if unknown:
        raise PolicyError(f"{where}: unknown [limits] keys {sorted(unknown)}; known: {sorted(known)}")
    kwargs: dict[str, Any] = {k: parse_size(v, f"{where}: limits.{k}") if k in _SIZE_FIELDS else v
                              for k, v in value.items()}
    if isinstance(kwargs.get("require"), list):
        kwargs["require"] = tuple(kwargs["require"])
    return Limits(**kwargs)


def _bind(value: object, where: str) -> Bind:
    if isinstance(value, Bind):
        return value
    if isinstance(value, str):
        value = {"source": value}
    if not isinstance(value, Mapping):
        raise PolicyError(f"{where}: each [[binds]] entry must be a table with source (and dest, writable)")
    known = {f.name for f in fields(Bind)}
    unknown = set(value) - known
    if unknown:
        raise PolicyError(f"{where}: unknown [[binds]] keys {sorted(unknown)}; known: {sorted(known)}")
    try:
        return Bind(**value)
    except PolicyError as err:
        # One line naming the file and the entry (a missing source otherwise reached the
        # framework as a bare "Bind source ... does not exist" deep in its sample setup).
        raise PolicyError(f"{where}: {err}; fix or remove this [[binds]] entry") from None
    except TypeError as err:
        raise PolicyError(f"{where}: {err}") from None
