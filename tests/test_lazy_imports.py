"""Every ``from litscale... import name`` names something its module has, the imports inside
functions included: a module's own import (``test_layering.py``) runs only its top level, and a
name moved to another module but still imported lazily from the old one fails only when that
function first runs (a DeepSpeed resume did, in CI, after ``is_deepspeed_checkpoint`` moved)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "experiments").rglob("*.py"),
           ROOT / "train.py"]
OURS = ("litscale", "hydra_plugins.litscale_plugins")


def imports_of_ours(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` for each name a ``from <ours> import`` in ``path`` takes."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(OURS):
            found += [(node.lineno, node.module, alias.name) for alias in node.names if alias.name != "*"]
    return found


def missing(module: str, name: str) -> str | None:
    """Why ``from module import name`` would fail, or None."""
    try:
        holder = importlib.import_module(module)
    except ImportError as error:
        return f"no module {module} ({error})"
    if hasattr(holder, name):
        return None
    try:  # a submodule of a package is imported by name
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return f"{module} has no {name}"
    return None


def test_the_finder_sees_a_name_imported_inside_a_function(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from litscale.errors import NoSuchName\n")
    assert [missing(module, name) for _, module, name in imports_of_ours(source)] == [
        "litscale.errors has no NoSuchName"]


@pytest.mark.slow  # imports every module of the package
def test_every_name_imported_from_litscale_exists():
    problems = [f"{path.relative_to(ROOT)}:{line}: {why}"
                for path in SOURCES for line, module, name in imports_of_ours(path)
                if (why := missing(module, name)) is not None]
    assert problems == []
