"""lowlevel.spec.config: one parser for the MCP server's and the integrations' config (issue 26).

Both front ends read the same keys with the same syntax, and every error is one PolicyError line
that names the key path: dotted for the integrations (``lowlevel.toml: limits.memory_bytes``), in
TOML-table style for ``lowlevel mcp`` (``mcp config [limits] memory_bytes``, as docs/mcp.md shows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lowlevel.errors import PolicyError
from lowlevel.integrations._config import SandboxConfig
from lowlevel.mcp_server.config import ServerConfig
from lowlevel.spec import config
from lowlevel.spec.config import KeyPath
from lowlevel.spec.egress import Egress
from lowlevel.spec.limits import Limits


def test_key_path_renders_both_styles() -> None:
    dotted = KeyPath("lowlevel.toml")
    table = KeyPath("mcp config", style="table")
    assert str(dotted / "limits" / "memory_bytes") == "lowlevel.toml: limits.memory_bytes"
    assert str(dotted / "binds" / 1) == "lowlevel.toml: binds[1]"
    assert str(table / "limits" / "memory_bytes") == "mcp config [limits] memory_bytes"
    assert str(table / "max_output_bytes") == "mcp config max_output_bytes"
    assert str(KeyPath() / "limits" / "memory_bytes") == "limits.memory_bytes"
    assert str((KeyPath() / "limits").error("must be a table")) == "limits: must be a table"


def test_limits_syntax_is_one_for_both_front_ends(tmp_path: Path) -> None:
    limits = {"memory_bytes": "128M", "cpu_s": "2m", "net_bytes": "1M", "pids": 64, "require": ["memory"]}
    want = Limits(memory_bytes=128 << 20, cpu_s=120.0, net_bytes=1 << 20, pids=64, require=("memory",))
    inspect = SandboxConfig.from_mapping({"limits": limits, "egress": {"allow": ["pypi.org"]}}).policy.limits
    mcp = ServerConfig.from_mapping({"workspace_base": str(tmp_path / "ws"), "limits": limits}).limits
    assert inspect == mcp == config.limits_from_mapping(limits) == want


@pytest.mark.parametrize(("data", "inspect_says", "mcp_says"), [
    ({"limits": {"memory_bytes": "lots"}}, "where: limits.memory_bytes: invalid size 'lots'",
     "mcp config [limits] memory_bytes: invalid size 'lots'"),
    ({"limits": {"cpu_s": "10x"}}, "where: limits.cpu_s: invalid duration '10x'",
     "mcp config [limits] cpu_s: invalid duration '10x'"),
    ({"limits": {"memory": 5}}, "where: unknown [limits] keys ['memory']", "mcp config: unknown [limits] keys ['memory']"),
    ({"limits": {"pids": 1}}, "where: limits: Limits.pids must be between 2", "mcp config [limits]: Limits.pids must be"),
    ({"limits": [1]}, "where: limits must be a table, got list", "mcp config [limits] must be a table, got list"),
    ({"binds": [{"source": "/usr/share", "ro": True}]}, "where: binds[0]: unknown [[binds]] keys ['ro']",
     "mcp config binds[0]: unknown [[binds]] keys ['ro']"),
    ({"binds": [{"source": "/nonexistent/lowlevel/z"}]}, "where: binds[0]: Bind source",
     "mcp config binds[0]: Bind source"),
    ({"binds": {"source": "/usr"}}, "where: binds must be a list of [[binds]] tables",
     "mcp config binds must be a list of [[binds]] tables"),
    ({"egress": {"alow": ["x"]}}, "where: egress: unknown egress keys ['alow']",
     "mcp config [egress]: unknown egress keys ['alow']"),
    ({"egress": {"allow": ["x"], "extra_ca_file": "/nonexistent/ca.pem"}},
     "where: egress.extra_ca_file: '/nonexistent/ca.pem'", "mcp config [egress] extra_ca_file: '/nonexistent/ca.pem'"),
    ({"network": "yes"}, "where: network must be true or false", "mcp config network must be true or false"),
])
def test_the_same_mistake_is_one_line_naming_the_key_in_both(tmp_path: Path, data: dict[str, Any],
                                                             inspect_says: str, mcp_says: str) -> None:
    with pytest.raises(PolicyError) as inspect:
        SandboxConfig.from_mapping(data, where="where")
    with pytest.raises(PolicyError) as mcp:
        ServerConfig.from_mapping({"workspace_base": str(tmp_path / "ws"), **data})
    for info, says in ((inspect, inspect_says), (mcp, mcp_says)):
        message = str(info.value)
        assert says in message and "\n" not in message, message
        assert info.value.__cause__ is None  # one line, no chained traceback


def test_egress_value_and_ca_file(tmp_path: Path) -> None:
    import trustme

    ca = tmp_path / "ca.pem"
    ca.write_bytes(trustme.CA().cert_pem.bytes())
    got = config.egress_from_config({"allow": ["pypi.org"], "allow_ports": [443], "extra_ca_file": str(ca)},
                                    KeyPath() / "egress")
    assert got.allow == ("pypi.org",) and got.allow_ports == (443,) and "BEGIN CERTIFICATE" in got.extra_ca_pem
    same = Egress(allow=("x.org",))
    assert config.egress_from_config(same, KeyPath()) is same
    tls = config.egress_from_config({"allow": ["x.org"], "tls_ports": [8443, 443]}, KeyPath() / "egress")
    assert tls.tls_ports == (443, 8443) and got.tls_ports == (443,)
    with pytest.raises(PolicyError, match="egress: Egress.tls_ports: 0 is not a TCP port"):
        config.egress_from_config({"allow": ["x.org"], "tls_ports": [0]}, KeyPath() / "egress")


def test_policy_keys_and_contradictions() -> None:
    policy = config.policy_from_mapping({"env": {"A": 1}, "stdout_limit_bytes": "1M", "landlock": "require",
                                         "binds": ["/usr/share"]})
    assert dict(policy.env)["A"] == "1" and policy.stdout_limit_bytes == 1 << 20 and policy.landlock == "require"
    assert policy.binds[0].source == "/usr/share"
    with pytest.raises(PolicyError, match="contradict each other"):
        config.policy_from_mapping({"network": True, "egress": {"allow": ["x.org"]}})
    with pytest.raises(PolicyError, match=r"^unknown keys \['seccomp'\]"):  # code-only fields stay code-only
        config.policy_from_mapping({"seccomp": None})
    with pytest.raises(PolicyError, match=r"^x\.toml: Policy\.landlock must be"):
        config.policy_from_mapping({"landlock": "maybe"}, KeyPath("x.toml"))


def test_seconds_and_sizes() -> None:
    assert config.seconds("2m", KeyPath() / "t") == 120.0 and config.seconds(None, KeyPath(), optional=True) is None
    with pytest.raises(PolicyError, match=r"^w: default_timeout_s must be a number of seconds > 0, got 0$"):
        config.seconds(0, KeyPath("w") / "default_timeout_s", positive=True)
    assert config.size("64K", KeyPath()) == 65536 and config.size(None, KeyPath(), optional=True) is None
    with pytest.raises(PolicyError, match=r"^x: invalid size"):
        config.size(None, KeyPath() / "x")


def test_mcp_flags_merge_into_the_file_tables(tmp_path: Path) -> None:
    """``lowlevel mcp --memory 256M --config f.toml``: the flag replaces that key of [limits] only."""
    toml = tmp_path / "mcp.toml"
    toml.write_text('[limits]\nmemory_bytes = "512M"\npids = 32\n')
    cfg = ServerConfig.from_toml(str(toml), workspace_base=str(tmp_path / "ws"), limits={"memory_bytes": 256 << 20})
    assert cfg.limits.memory_bytes == 256 << 20 and cfg.limits.pids == 32
    with pytest.raises(PolicyError, match=r"mcp config allowed_binds must be a list of host paths"):
        ServerConfig.from_mapping({"allowed_binds": "/opt/data"})
    # As the integrations' default_timeout_s: a timeout is > 0 (a TTL may be 0: no keeping).
    with pytest.raises(PolicyError, match=r"^mcp config max_timeout_s must be a number of seconds > 0, got '0s'$"):
        ServerConfig.from_mapping({"max_timeout_s": "0s"})
    assert ServerConfig.from_mapping({"run_workspace_ttl_s": 0}).run_workspace_ttl_s == 0
