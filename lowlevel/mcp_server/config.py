"""The operator's configuration of ``lowlevel mcp``: :class:`ServerConfig`, from TOML and flags.

It comes from the operator only (TOML file and CLI flags), never from a request:
a client can narrow the policy (shorter timeout, smaller limits) but never widen it.

TOML keys (all optional)::

    workspace_base = "/var/lib/lowlevel-mcp"   # where named and per-run workspaces live (relative:
                                               # to the config file's directory)
    network = false           # may a client ask for the host's whole network? (off by default)
    deterministic = false     # Policy(deterministic=True) for every run
    default_timeout_s = 30.0  # when the client gives none
    max_timeout_s = 120.0     # ceiling for timeout_s
    max_output_bytes = "64K"  # per stream, in tool results
    max_file_bytes = "1M"     # read_file / write_file cap
    max_sessions = 8          # named sessions alive at once
    max_concurrent_runs = 8   # run/run_in_session calls executing at once (more wait their turn)
    session_idle_ttl_s = 1800.0   # a session idle this long is closed, freeing its slot
    run_workspace_ttl_s = 3600.0  # unnamed run workspaces kept this long after use (0: not kept)
    allowed_binds = ["/opt/data"]  # host paths a client may ask to bind read-only
    [limits]                  # ceilings (and defaults) for memory_bytes, cpu_s, pids, ...
    memory_bytes = "512M"     # sizes: bytes, or "64K", "128M", "2G" (as the CLI and the Inspect config)
    cpu_s = "2m"              # seconds, or "30s", "2m", "1h" (as timeout(1); also the *_s keys above)
    [[binds]]                 # always bound (the operator's own policy)
    source = "/opt/venv"
    dest = "/opt/venv"
    writable = false
    [egress]                  # network by allowlist for every run (lowlevel.Egress); a client
    allow = ["pypi.org", "files.pythonhosted.org"]   # may narrow it (allow_hosts), never widen it
    deny = []
    allow_cidrs = []
    allow_ports = [80, 443]
    tls_ports = [443]         # tunnels there must start with a TLS ClientHello (the default)
    extra_ca_file = "/etc/company-ca.pem"            # optional: CA certificates trusted inside

With ``[egress]``, every run and session gets the allowlist unless the client narrows it;
``[limits] net_bytes`` caps the bytes each run moves through the proxy. ``lowlevel mcp
--allow-host PATTERN`` (repeatable) sets ``[egress] allow`` from the command line.

Sizes and durations take the syntax of the CLI and the integrations' config, and every key is
read by :mod:`lowlevel.spec.config` (one error model: ``mcp config [limits] memory_bytes: ...``).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import tomllib
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from lowlevel import workspace as _ws
from lowlevel._dataclass import dataclass
from lowlevel.errors import PolicyError, WorkspaceError
from lowlevel.spec import config as _config
from lowlevel.spec import validate as _validate
from lowlevel.spec.egress import Egress
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import Bind

#: Keys that take a size (``65536`` or ``"64K"``), seconds (``30``, ``"30s"``, ``"2m"``), a bool.
_SIZES = {"max_output_bytes", "max_file_bytes"}
_DURATIONS = {"default_timeout_s", "max_timeout_s", "session_idle_ttl_s", "run_workspace_ttl_s"}
_FLAGS = {"network", "deterministic"}


@dataclass(frozen=True)
class ServerConfig:
    """The operator's configuration of ``lowlevel mcp``; requests can only narrow it.

    Attributes:
        workspace_base: host directory holding the workspaces (one subdirectory per name).
        network: clients may request the host's whole network (``--share-net``); off by default.
        egress: the allowlist every run gets (:class:`lowlevel.Egress`), or None (no network
            unless ``network`` allows the host's); a client may narrow it, never widen it.
        deterministic: every run uses ``Policy(deterministic=True)``.
        limits: the ceiling and the default for each limit.
        binds: binds every run gets.
        allowed_binds: host paths (resolved) a client may ask to bind read-only.
        default_timeout_s, max_timeout_s: timeout when the client gives none; ceiling.
        max_output_bytes: per stream, in results (bytes).
        max_file_bytes: cap for read_file/write_file (bytes).
        max_sessions: named sessions alive at once.
        max_concurrent_runs: ``run`` and ``run_in_session`` calls executing at once (1-1024);
            more wait their turn. Bounds what one client can start at once (each sandbox up to
            the memory ceiling), and keeps the transport's own threads free (a flood of 40
            calls took every worker thread and a ``ping`` waited 20 s: a fresh-user trial).
        session_idle_ttl_s: seconds without a command after which a session is closed and
            its ``max_sessions`` slot freed (> 0; the session's init enforces it too).
        run_workspace_ttl_s: seconds an unnamed run's workspace is kept after its last use
            (>= 0; 0 removes it right after the call).
    """

    workspace_base: str = field(default_factory=lambda: os.path.abspath(os.path.join(_ws.default_base(), "mcp")))
    network: bool = False
    egress: Egress | None = None
    deterministic: bool = False
    limits: Limits = field(default_factory=Limits)
    binds: tuple[Bind, ...] = ()
    allowed_binds: tuple[str, ...] = ()
    default_timeout_s: float = 30.0
    max_timeout_s: float = 120.0
    max_output_bytes: int = 64 * 1024
    max_file_bytes: int = 1024 * 1024
    max_sessions: int = 8
    max_concurrent_runs: int = 8
    session_idle_ttl_s: float = 1800.0
    run_workspace_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_concurrent_runs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1024:
                raise PolicyError(f"mcp config {name} must be a whole number from 1 to 1024, got {value!r}")
        if not isinstance(self.workspace_base, str) or not os.path.isabs(self.workspace_base):
            raise PolicyError(f"mcp config workspace_base must be an absolute path, got {self.workspace_base!r} "
                              "(in a config file, a relative one is taken from the file's directory)")
        for name, minimum in (("session_idle_ttl_s", 0.0), ("run_workspace_ttl_s", -1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum < value < 1e9:
                raise PolicyError(f"mcp config {name} must be a number of seconds "
                                  f"{'> 0' if minimum == 0 else '>= 0'}, got {value!r}")

    @classmethod
    def from_toml(cls, path: str, **overrides: Any) -> ServerConfig:
        """Read a TOML config; ``overrides`` (CLI flags that were given) win: a key's value is
        replaced, the keys of an ``egress`` or ``limits`` override replace those of the file's table.

        Raises:
            PolicyError: unknown key or a bad value (the message names it).
            OSError: the file cannot be read. ValueError (tomllib.TOMLDecodeError): not TOML.
        """
        with open(path, "rb") as f:
            data = tomllib.load(f)
        base = data.get("workspace_base")
        if isinstance(base, str) and base and not os.path.isabs(base):
            # Relative to the file, not to wherever the client started the server (a GUI client's
            # working directory: root made /rel/base at the host's root, a fresh-user trial).
            data["workspace_base"] = os.path.join(os.path.dirname(os.path.abspath(path)), base)
        for name in ("egress", "limits"):
            if isinstance(data.get(name), Mapping) and isinstance(overrides.get(name), Mapping):
                overrides = {**overrides, name: {**data[name], **overrides[name]}}
        return cls.from_mapping({**data, **overrides})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ServerConfig:
        """Build from a parsed mapping (the TOML keys of the module docstring), through
        :mod:`lowlevel.spec.config` (the syntax and errors of the integrations' config).

        Raises:
            PolicyError: an unknown key or a bad value, one line naming it
                (``mcp config [limits] memory_bytes: invalid size '128Q': ...``).
        """
        path = _config.KeyPath("mcp config", style="table")
        data = _config.table(data, path, "a table of settings")
        _config.check_keys(data, (f.name for f in dataclasses.fields(cls)), path)
        kwargs: dict[str, Any] = dict(data)
        for key in _SIZES & set(kwargs):
            kwargs[key] = _config.size(kwargs[key], path / key)
        for key in _DURATIONS & set(kwargs):  # a TTL may be 0 (checked in __post_init__), a timeout not
            kwargs[key] = _config.seconds(kwargs[key], path / key, positive=key.endswith("timeout_s"))
        for key in _FLAGS & set(kwargs):
            if not isinstance(kwargs[key], bool):
                raise (path / key).must(f"must be true or false, got {kwargs[key]!r}")
        if "limits" in kwargs:
            kwargs["limits"] = _config.limits_from_mapping(kwargs["limits"], path / "limits")
        if "binds" in kwargs:
            kwargs["binds"] = _config.binds_from_list(kwargs["binds"], path / "binds")
        if "allowed_binds" in kwargs:
            paths = kwargs["allowed_binds"]
            if isinstance(paths, (str, bytes)) or not isinstance(paths, (list, tuple)) or \
                    not all(isinstance(p, str) and p for p in paths):
                raise (path / "allowed_binds").must(f"must be a list of host paths, got {paths!r:.80}")
            kwargs["allowed_binds"] = tuple(os.path.realpath(p) for p in paths)
        if kwargs.get("egress") is not None:
            kwargs["egress"] = _config.egress_from_config(kwargs["egress"], path / "egress")
        if "workspace_base" in kwargs and not isinstance(kwargs["workspace_base"], str):
            raise (path / "workspace_base").must(f"must be a path, got {kwargs['workspace_base']!r}")
        return cls(**kwargs)


def check_base(base: str) -> str:
    """The operator's workspace base, refused by the rules for workspaces
    (:func:`lowlevel.workspace.check_workspace_path`: not a system or home directory, nothing
    inside ``/etc``, ``/usr``..., only trusted ancestors), then created (0711) if missing.
    Every named workspace is a directory of it, so ``--workspace-base /etc`` would have made
    ``read_file``/``list_files`` reach ``/etc/ssl``.

    Raises:
        PolicyError: a bad path. WorkspaceError: a refused one.
    """
    real = os.path.realpath(_validate.host_path(base, "workspace_base"))
    reason = _ws.workspace_refusal(real)
    if reason:
        raise WorkspaceError(errno.EPERM, f"refusing workspace base {real}: {reason}")
    if not os.path.lexists(real):
        # The ancestors' trust before a directory is made there (the check after the mkdir left
        # the refused base behind: a fresh-user trial).
        from lowlevel.host.trust import first_untrusted_dir
        existing = real
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing)
        try:
            found = first_untrusted_dir(os.path.join(existing, "."))  # ``existing`` and above, as ancestors
        except OSError as err:
            raise WorkspaceError(err.errno, f"cannot check {err.filename} above workspace base {real}: "
                                 f"{err.strerror}") from err
        if found is not None:
            cur, st = found
            raise WorkspaceError(errno.EPERM, f"refusing workspace base {real}: {cur} (owner uid {st.st_uid}, mode "
                                 f"{st.st_mode & 0o7777:04o}) could be renamed or replaced by another user; use a "
                                 "base below directories owned by root or by you and not writable by others")
    made = _ws.ensure_base(real)  # refuses a system or sticky directory before changing anything
    _ws.check_workspace_path(made)  # trusted ancestors, a writable file system
    return made


__all__ = ["ServerConfig", "check_base"]
