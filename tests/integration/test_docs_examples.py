"""Every ```python and ```sh block of README.md and docs/*.md runs, as written, in the suite.

Each block is one test: a python block runs as a script with the venv's Python, a sh block with
``bash -e`` (``lowlevel``, ``python``, ``pip``... are the venv's: its ``bin`` leads ``PATH``),
each from a fresh temp directory holding a copy of ``examples/`` (blocks that name
``examples/...`` find them, and nothing a block writes lands in the checkout). A block that
cannot run here carries ``<!-- not run: REASON -->`` on the line right before its fence:
:func:`test_not_run_blocks_are_few_and_justified` lists them and keeps their number small.
A block that needs an optional extra (Ray, a framework) is skipped, naming it, when that extra
is not installed. A sh block of ``pip install '.[extra]'`` lines only is checked (the extras exist),
not run: it would reinstall the environment the suite runs in. ```toml blocks that start with ``# lowlevel.toml`` are loaded with the
adapters' config parser (so their binds must exist).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->\s*$")
#: The most blocks that may be marked not run (each needs a reason a reader accepts).
MAX_NOT_RUN = 10
#: Modules a block's imports need, and the extra that provides them.
EXTRAS = {"ray": "ray", "inspect_ai": "inspect", "autogen_core": "autogen", "langchain_core": "langchain",
          "smolagents": "smolagents"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    out: list[Block] = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            start, lang = i, m.group(1)
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            marker = NOT_RUN.match(lines[start - 1]) if start > 0 else None
            out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                             marker.group(1) if marker else None))
            i = j + 1
    return out


INSTALL = re.compile(r"^pip install '\.\[([a-z,]+)\]'\s*(#.*)?$")


def _install_only(block: Block) -> bool:
    """A sh block of ``pip install '.[extra]'`` lines only (checked, not run: see below)."""
    lines = [ln for ln in block.code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return block.lang == "sh" and bool(lines) and all(INSTALL.match(ln) for ln in lines)


ALL = blocks()
INSTALLS = [b for b in ALL if _install_only(b)]
RUNNABLE = [b for b in ALL if b.lang in ("python", "sh") and b.not_run is None and b not in INSTALLS]
CONFIGS = [b for b in ALL if b.lang == "toml" and b.code.startswith("# lowlevel.toml")]


def _missing_extra(code: str) -> str | None:
    for module, extra in EXTRAS.items():
        if re.search(rf"^\s*(import|from)\s+{module}\b", code, re.M) and importlib.util.find_spec(module) is None:
            return f"needs the {extra!r} extra (pip install '.[{extra}]' in the lowlevel checkout)"
    return None


@pytest.mark.bwrap
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    why = _missing_extra(block.code)
    if why:
        pytest.skip(why)
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples")
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
           "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    if block.lang == "python":
        script = work / "example.py"
        argv = [sys.executable, str(script)]
    else:
        script = work / "example.sh"
        argv = ["bash", "-e", "-o", "pipefail", str(script)]
    script.write_text(block.code, encoding="utf-8")
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, (f"{block.name} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}"
                                  f"\n--- stderr ---\n{proc.stderr[-3000:]}")


@pytest.mark.parametrize("block", CONFIGS, ids=[b.name for b in CONFIGS])
def test_config_block_loads(block: Block, tmp_path: Path) -> None:
    from lowlevel.integrations._config import SandboxConfig

    path = tmp_path / "lowlevel.toml"
    path.write_text(block.code, encoding="utf-8")
    SandboxConfig.from_toml(path)


@pytest.mark.parametrize("block", INSTALLS, ids=[b.name for b in INSTALLS])
def test_install_block_names_a_real_extra(block: Block) -> None:
    """``pip install '.[x]'`` would install into the environment this suite runs in: each extra
    it names must exist in pyproject.toml (CI installs them all: .ci/integrations-constraints.txt)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for line in block.code.splitlines():
        m = INSTALL.match(line)
        if m:
            for extra in m.group(1).split(","):
                assert extra in extras, f"{block.name}: no extra {extra!r} in pyproject.toml"


def test_not_run_blocks_are_few_and_justified() -> None:
    skipped = [b for b in ALL if b.not_run is not None]
    listing = "\n".join(f"{b.name}: {b.not_run}" for b in skipped)
    print(f"{len(RUNNABLE)} blocks run, {len(INSTALLS)} install blocks checked, {len(skipped)} not run:\n{listing}")
    assert len(skipped) <= MAX_NOT_RUN, listing
    for b in skipped:
        assert len(b.not_run or "") >= 10, f"{b.name}: say why it cannot run here"
        assert b.lang in ("python", "sh"), f"{b.name}: a not-run marker on a {b.lang or 'plain'} block means nothing"
    assert len(RUNNABLE) >= 12 and len(INSTALLS) >= 5  # the extraction still finds the blocks
