"""lowlevel.spec.validate.normalize_abs: one lexical form for every absolute path lowlevel compares."""
from __future__ import annotations

import pytest

from lowlevel.spec.validate import normalize_abs


@pytest.mark.parametrize(("raw", "norm"), [
    ("//usr", "/usr"), ("///usr", "/usr"), ("//usr//bin/", "/usr/bin"), ("//opt/a/./sub", "/opt/a/sub"),
    ("/", "/"), ("//", "/"), ("/a/../b", "/b"), ("/opt/a", "/opt/a"),
])
def test_normalize_abs(raw: str, norm: str) -> None:
    assert normalize_abs(raw) == norm


def test_normpath_alone_keeps_two_leading_slashes() -> None:
    """The reason for normalize_abs (POSIX.1-2017 XBD 4.13): a check on normpath's form misses '//usr'."""
    import os.path
    assert os.path.normpath("//usr") == "//usr" and normalize_abs("//usr") == "/usr"
