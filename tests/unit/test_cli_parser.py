"""lowlevel.cli.parser: the parser of one subcommand is the one the whole tree has, and building
the tree imports none of the machinery of the commands (issue 27: the CLI imports what it needs)."""

from __future__ import annotations

import argparse

import pytest

from lowlevel.cli.args import UsageError
from lowlevel.cli.parser import COMMANDS, IMAGE_STORE_ENV, build_parser
from lowlevel.rootfs.store import STORE_ENV


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    out = {}
    for name, sub in _subparsers(parser).items():
        out[name] = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                out.update({f"{name} {n}": p.format_help() for n, p in action.choices.items()})
    return out


def test_each_subcommand_alone_has_the_help_of_the_whole_tree() -> None:
    whole = _helps(build_parser())
    assert set(n.split()[0] for n in whole) == set(COMMANDS)
    for name in COMMANDS:
        alone = _helps(build_parser(name))
        assert alone and all(whole[k] == v for k, v in alone.items()), name
        assert set(alone) == {k for k in whole if k.split()[0] == name}


def test_the_image_store_variable_is_the_stores() -> None:
    assert IMAGE_STORE_ENV == STORE_ENV
    assert f"${STORE_ENV}" in _helps(build_parser("image"))["image ls"].replace("\n", " ")


@pytest.mark.parametrize("argv, where", [
    (["run", "--bogus", "--", "true"], "run"), (["cleanup", "--bogus"], "cleanup"), (["doctor", "--bogus"], "doctor"),
    (["replay", "FILE", "--bogus"], "replay"), (["mcp", "--bogus"], "mcp"), (["image", "ls", "--bogus"], "image ls"),
    (["image", "import", "FILE", "--bogus"], "image import")])
@pytest.mark.parametrize("tree", ["alone", "whole"])
def test_an_unknown_option_names_its_subcommands_help(argv: list[str], where: str, tree: str) -> None:
    """The hint of an unknown option is the subcommand's help (``lowlevel run --help``), not
    the top level's (argparse reports a subcommand's extra arguments from the top parser)."""
    parser = build_parser(argv[0] if tree == "alone" else None)
    with pytest.raises(UsageError) as err:
        parser.parse_args(argv)
    message = str(err.value)
    assert message.startswith(f"{where}: unrecognized arguments: --bogus"), message
    assert message.endswith(f"(see `lowlevel {where} --help`)"), message


def test_an_unknown_option_of_run_suggests_a_run_option() -> None:
    with pytest.raises(UsageError, match=r"did you mean --timeout\?"):
        build_parser("run").parse_args(["run", "--timout", "5", "--", "true"])
