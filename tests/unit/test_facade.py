"""The root package's lazy public names (PEP 562 ``__getattr__``): each is the object its module
defines, ``from lowlevel import X`` works, and an unknown name is an AttributeError."""

from __future__ import annotations

import importlib

import pytest

import lowlevel


def test_every_public_name_is_its_modules_object() -> None:
    for name in lowlevel.__all__:
        module = importlib.import_module(f"lowlevel.{lowlevel._LAZY[name]}")
        assert getattr(lowlevel, name) is getattr(module, name), name
    assert set(lowlevel.__all__) == set(lowlevel._LAZY)
    assert set(lowlevel.__all__) <= set(dir(lowlevel))


def test_from_import_and_subpackages() -> None:
    from lowlevel import Policy, run
    assert Policy is importlib.import_module("lowlevel.spec.policy").Policy
    assert run is importlib.import_module("lowlevel.api").run
    assert lowlevel.sandbox is importlib.import_module("lowlevel.sandbox")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lowlevel.nope  # noqa: B018
    with pytest.raises(AttributeError):
        lowlevel._private  # noqa: B018
    assert getattr(lowlevel, "_startup_sigint", None) is None or callable(lowlevel._startup_sigint)
