"""lowlevel._dataclass: the generated methods' code cached on disk is the code dataclasses makes,
is read back by the next process, and is never taken from a file someone else could have written."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lowlevel import _dataclass

METHODS = ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "cache"
    monkeypatch.setenv("LOWLEVEL_CACHE_DIR", str(d))
    monkeypatch.delenv("LOWLEVEL_NO_CACHE", raising=False)
    _dataclass.forget_loaded()
    yield d
    _dataclass.forget_loaded()


def _make(decorator: Any) -> list[Any]:
    """The same class definitions, decorated by ``decorator`` (stdlib or cached)."""
    dc = decorator  # the decorators are called as dataclasses.dataclass is

    @dc(frozen=True)
    class Frozen:
        name: str
        size: int = 0
        tags: tuple[str, ...] = ()
        extra: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)

    @dc(frozen=True, eq=False)
    class NoEq:
        a: int
        b: str = "x"

    @dc
    class Plain:
        a: int
        b: list[int] = dataclasses.field(default_factory=list)

    @dc(frozen=True, kw_only=True, order=True)
    class KwOrder:
        a: int
        b: int = 2

    return [Frozen, NoEq, Plain, KwOrder]


def _codes(cls: type) -> dict[str, object]:
    return {m: vars(cls)[m].__code__ for m in METHODS + ("__lt__", "__le__") if callable(vars(cls).get(m))
            and hasattr(vars(cls)[m], "__code__")}


def test_the_cached_classes_are_the_ones_dataclasses_makes(cache: Path) -> None:
    plain = _make(dataclasses.dataclass)
    for first, second in ((plain, _make(_dataclass.dataclass)), (plain, _make(_dataclass.dataclass))):
        for a, b in zip(first, second, strict=True):
            assert _codes(a) == _codes(b) and _codes(a)  # same bytecode, constants, names and flags
            assert [(f.name, f.default, f.compare) for f in dataclasses.fields(a)] == \
                [(f.name, f.default, f.compare) for f in dataclasses.fields(b)]
            assert repr(a.__dataclass_params__) == repr(b.__dataclass_params__)
    frozen = _make(_dataclass.dataclass)[0]
    x = frozen("n", 1)
    assert repr(x).endswith("Frozen(name='n', size=1, tags=(), extra={})") and x == frozen("n", 1)
    assert hash(x) == hash(frozen("n", 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.size = 2
    assert "exec" not in vars(dataclasses)  # the name is put back after each class


def test_the_next_process_reads_the_code_instead_of_compiling(cache: Path) -> None:
    _make(_dataclass.dataclass)
    _dataclass.save()
    assert (cache / _dataclass.FILE).stat().st_mode & 0o777 == 0o600
    _dataclass.forget_loaded()  # a fresh process
    _make(_dataclass.dataclass)
    assert not _dataclass._new  # every text was in the file
    # Control: a class never seen is compiled (and would be saved).
    @_dataclass.dataclass(frozen=True)
    class Unseen:
        q: float = 1.5
    assert _dataclass._new and repr(Unseen()).endswith("Unseen(q=1.5)")


def _poison(cache: Path) -> dict[str, object]:
    """A cache file whose every entry is the code of ``raise RuntimeError`` (a planted file)."""
    _make(_dataclass.dataclass)
    _dataclass.save()
    _dataclass.forget_loaded()
    codes = _dataclass._load()
    bad = compile("raise RuntimeError('planted')", "<string>", "exec")
    import marshal
    (cache / _dataclass.FILE).write_bytes(marshal.dumps((_dataclass._header(), {k: bad for k in codes})))
    os.chmod(cache / _dataclass.FILE, 0o600)
    _dataclass.forget_loaded()
    return dict(codes)


def test_a_planted_file_is_run_only_when_it_is_ours_and_private(cache: Path) -> None:
    _poison(cache)
    with pytest.raises(RuntimeError, match="planted"):  # the control: a file of ours is used
        _make(_dataclass.dataclass)
    _dataclass.forget_loaded()
    os.chmod(cache / _dataclass.FILE, 0o620)  # others (the group) could have written it: ignored
    assert repr(_make(_dataclass.dataclass)[1](1)).endswith("NoEq(a=1, b='x')")
    _dataclass.forget_loaded()
    os.chmod(cache / _dataclass.FILE, 0o600)
    os.chmod(cache, 0o750)  # a directory others may read/enter is not ours alone: ignored
    _make(_dataclass.dataclass)
    os.chmod(cache, 0o700)


def test_a_file_of_another_uid_is_ignored(cache: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    _poison(cache)
    os.chown(cache / _dataclass.FILE, 65534, 65534)
    _make(_dataclass.dataclass)  # no RuntimeError: the file was not read


def test_a_broken_or_foreign_interpreter_file_is_ignored(cache: Path) -> None:
    cache.mkdir(mode=0o700)
    for data in (b"", b"\x00garbage", b"\xe3" * 100):
        (cache / _dataclass.FILE).write_bytes(data)
        _dataclass.forget_loaded()
        assert _make(_dataclass.dataclass)[2](1).b == []
    import marshal
    (cache / _dataclass.FILE).write_bytes(marshal.dumps(((0, "another python"), {})))
    _dataclass.forget_loaded()
    _make(_dataclass.dataclass)
    assert _dataclass._new  # nothing was taken from it


def test_turned_off(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWLEVEL_NO_CACHE", "1")
    _make(_dataclass.dataclass)
    _dataclass.save()
    assert not cache.exists()


def test_a_refused_class_leaves_dataclasses_as_it_was(cache: Path) -> None:
    with pytest.raises(TypeError):
        @_dataclass.dataclass
        class Bad:
            a: int = 1
            b: int  # type: ignore[misc]  # no default after one with: dataclasses refuses the class
    assert "exec" not in vars(dataclasses)


def test_a_class_without_a_docstring_gets_the_standard_doc(cache: Path) -> None:
    # dataclasses calls inspect.signature only for such a class; _dataclass gives it a stand-in
    # for inspect that forwards to the real module (the doc is the same as without lowlevel).
    def make(decorator: Any) -> Any:
        @decorator(frozen=True)
        class NoDoc:
            a: int
            b: str = "x"
        return NoDoc

    assert make(_dataclass.dataclass).__doc__ == make(dataclasses.dataclass).__doc__ == "NoDoc(a: 'int', b: 'str' = 'x')"


def test_the_inspect_stand_in_forwards_to_the_real_module() -> None:
    import inspect
    stand_in = _dataclass._LazyInspect("inspect")
    assert stand_in.signature is inspect.signature and stand_in.Parameter is inspect.Parameter
    with pytest.raises(AttributeError):
        stand_in.no_such_name  # noqa: B018

