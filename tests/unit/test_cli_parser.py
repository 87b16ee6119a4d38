"""lowlevel.cli.parser: the parser of one subcommand is the one the whole tree has, and building
the tree imports none of the machinery of the commands (issue 27: the CLI imports what it needs)."""

from __future__ import annotations

import argparse

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
