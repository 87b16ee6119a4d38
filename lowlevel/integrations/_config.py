"""A lowlevel Policy from a mapping or a TOML file: the config format the adapters share.

Format (every key optional; sizes are byte counts or strings with a K/M/G/T suffix, powers
of 1024; seconds are numbers or strings with an s/m/h/d suffix; parsed by
:mod:`lowlevel.spec.config`, as for ``lowlevel mcp``)::

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

Unknown keys are errors (a typo must not silently drop a limit); every error is one line
naming the file and the key (``lowlevel.toml: limits.memory_bytes: invalid size 'lots': ...``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from lowlevel._dataclass import dataclass
from lowlevel.errors import PolicyError
from lowlevel.spec import config as _config
from lowlevel.spec.policy import Policy

#: Keys of the adapters themselves, besides the Policy's (:data:`lowlevel.spec.config.POLICY_KEYS`).
_ADAPTER_KEYS = {"workspace_base", "default_timeout_s"}


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
        """Build from a parsed mapping in the format of the module docstring
        (:func:`lowlevel.spec.config.policy_from_mapping` reads the Policy's keys).

        Raises:
            PolicyError: an unknown key or a bad value; the message names it and ``where``.
        """
        path = _config.KeyPath(where)
        if not isinstance(data, Mapping):
            raise PolicyError(f"{where}: expected a table of settings, got {type(data).__name__}")
        _config.check_keys(data, _config.POLICY_KEYS | _ADAPTER_KEYS | {_config.EGRESS_KEY}, path)
        policy = _config.policy_from_mapping({k: v for k, v in data.items() if k not in _ADAPTER_KEYS}, path)
        if policy.image is not None or policy.rootfs is not None:
            from lowlevel.rootfs.resolve import resolve  # the store and the tree, while the file can be named
            try:
                resolve(policy)  # cached for this Policy's runs
            except PolicyError as err:
                raise PolicyError(f"{where}: {err}") from None
        base = data.get("workspace_base")
        if base is not None and (not isinstance(base, str) or not os.path.isabs(base)):
            raise (path / "workspace_base").must(f"must be an absolute path, got {base!r}")
        timeout = _config.seconds(data.get("default_timeout_s"), path / "default_timeout_s", optional=True,
                                  positive=True)
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
