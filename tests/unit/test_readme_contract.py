"""The README stays true to the CLI and the MCP config (issue 12 item 10): every option of
``lowlevel run`` is in its usage block, every MCP config key in its TOML example, and the
exit-status paragraph names the statuses :mod:`lowlevel.cli` uses."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from lowlevel import cli
from lowlevel.cli import output
from lowlevel.mcp_server import ServerConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_run_option_is_in_the_usage_block() -> None:
    usage = README[README.index("lowlevel run [--workspace"):README.index("lowlevel replay FILE")]
    parser = cli.build_parser()
    run = next(a for a in parser._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
               if a.prog.endswith(" run"))
    options = {s for a in run._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    missing = sorted(o for o in options if not re.search(re.escape(o) + r"\b", usage))
    assert missing == []


def test_every_subcommand_option_is_in_the_usage_block() -> None:
    """``replay``, ``image *``, ``doctor``, ``cleanup`` and ``mcp``: each option in the block
    under "## Command line" (it missed ``cleanup`` and ``image import --max-bytes``)."""
    block = README[README.index("## Command line"):]
    block = block[block.index("```"):]
    block = block[:block.index("```", 3)]
    top = cli.build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    missing = []
    for name, sub in top.items():
        subs = [(name, sub)]
        if name == "image":
            subs = [(f"image {n}", p) for n, p in
                    sub._subparsers._group_actions[0].choices.items()]  # type: ignore[union-attr]
        for label, parser in subs:
            if f"lowlevel {label}" not in block and f"| {label.split()[-1]} " not in block:
                missing.append(f"lowlevel {label}")
            if name == "run":
                continue  # test_every_run_option_is_in_the_usage_block
            options = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
            missing += [f"lowlevel {label} {o}" for o in sorted(options) if not re.search(re.escape(o) + r"\b", block)]
    assert missing == []


def test_every_mcp_config_key_is_documented() -> None:
    toml = README[README.index("```toml"):]
    toml = toml[:toml.index("```", 3)]
    missing = [f.name for f in dataclasses.fields(ServerConfig) if f.name + " =" not in toml
               and f"[{f.name}]" not in toml and f"[[{f.name}]]" not in toml]
    assert missing == []


def test_exit_status_paragraph() -> None:
    para = README[README.index("Exit status, as `timeout(1)`"):]
    para = " ".join(para[:para.index("\n\n")].split())
    for code in (output.EXIT_TIMEOUT, output.EXIT_FAILED, output.EXIT_NOEXEC, output.EXIT_NOTFOUND):
        assert f"**{code}**" in para
    assert "usage error" in para and "one JSON object" in para
