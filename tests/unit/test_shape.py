"""The package's shape (issue 26): no module over ~800 lines, no function over ~80 lines.

Pure: reads the sources with ``ast``; starts no process. A module or function allowed to be
longer is listed below with the reason (a state table, a list of checks); the list may only
shrink: an entry that no longer needs its exception fails the test too, so it gets removed.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "lowlevel"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80

#: "path relative to lowlevel/" -> reason.
LONG_MODULES: dict[str, str] = {}

#: "path relative to lowlevel/:qualified.name" -> reason.
LONG_FUNCTIONS: dict[str, str] = {
    "api.py:run": "the public lowlevel.run: its docstring (every argument, unit and error) is most of it",
    "sandbox/state.py:RunState._init_state": "the state table of a Run: one attribute per line, with its meaning",
}


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _functions(tree: ast.AST) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((name, (child.end_lineno or child.lineno) - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def test_the_package_is_found():
    assert (PACKAGE / "__init__.py").is_file() and len(_modules()) > 30


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_function_lengths(path: pathlib.Path):
    rel = str(path.relative_to(PACKAGE))
    text = path.read_text(encoding="utf-8")
    lines = text.count("\n")
    if rel in LONG_MODULES:
        assert lines > MAX_MODULE_LINES, f"{rel} is {lines} lines now: remove it from LONG_MODULES"
    else:
        assert lines <= MAX_MODULE_LINES, f"{rel} is {lines} lines (max {MAX_MODULE_LINES}): split it by concept"
    for name, length in _functions(ast.parse(text)):
        key = f"{rel}:{name}"
        if key in LONG_FUNCTIONS:
            assert length > MAX_FUNCTION_LINES, f"{key} is {length} lines now: remove it from LONG_FUNCTIONS"
        else:
            assert length <= MAX_FUNCTION_LINES, (f"{key} is {length} lines (max {MAX_FUNCTION_LINES}): "
                                                  "split it into named steps")
