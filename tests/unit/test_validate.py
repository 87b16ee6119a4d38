"""The policy edge (issue 10 item 1): every string bound for bwrap's argv is checked, and every
bad value is a PolicyError naming the field, never a TypeError or a silently accepted value."""

from __future__ import annotations

import os

import pytest

import lowlevel
from lowlevel.spec import validate
from lowlevel.errors import LaunchError, PolicyError
from lowlevel.sandbox.argv import encode_args


@pytest.mark.parametrize("kwargs", [
    {"binds": 3}, {"binds": "/x"}, {"hostname": 5}, {"hostname": "sandbox\n"}, {"hostname": "a\0b"},
    {"env": 5}, {"env": [("A",)]}, {"env": {"A=B": "1"}}, {"env": {"": "1"}}, {"env": {"A\n": "1"}},
    {"env": {"A": "1\0--share-net"}}, {"env": {"A": 1}}, {"env": {"A": "\ud800"}},
])
def test_policy_refuses(kwargs: dict) -> None:
    with pytest.raises(PolicyError):
        lowlevel.Policy(**kwargs)


@pytest.mark.parametrize("source, dest", [("/usr\0x", ""), ("/usr", "/opt/a\0--share-net"), ("/usr", 5),
                                          ("/usr", "relative"), (b"/usr", "")])
def test_bind_refuses(source: object, dest: object) -> None:
    with pytest.raises(PolicyError):
        lowlevel.Bind(source, dest)  # type: ignore[arg-type]


@pytest.mark.parametrize("field, value", [("cwd", "/workspace\0--bind"), ("cwd", "relative"), ("cwd", 5),
                                          ("cwd", "/" + "a" * 5000), ("env", {"A": "x\0y"}), ("env", ["A=1"]),
                                          ("workspace", "/tmp/x\0y"), ("workspace_base", ""),
                                          ("inputs", "main.py"), ("inputs", ["a\0b"])])
def test_run_refuses_before_anything_runs(field: str, value: object) -> None:
    with pytest.raises(PolicyError):
        lowlevel.run(["true"], **{field: value})  # type: ignore[arg-type]


def test_surrogateescape_bytes_pass_lone_surrogates_do_not() -> None:
    raw = os.fsdecode(b"\xff")  # what the OS gives Python for a non-UTF-8 name
    assert validate.text(raw, "x") == raw
    with pytest.raises(PolicyError, match="cannot be encoded"):
        validate.text("\ud800", "x")
    assert encode_args([raw]) == b"\xff\0"
    with pytest.raises(LaunchError):
        encode_args(["\ud800"])


def test_env_name_rules() -> None:
    for ok in ("A", "_a1", "PATH"):
        assert validate.env_name(ok) == ok
    for bad in ("", "1A", "A=B", "A B", "A\0", "A\n", 5):
        with pytest.raises(PolicyError):
            validate.env_name(bad)
