"""The package's layering: the library imports without Hydra, no import cycle anywhere in
``src/``, and every module imports on its own (in a fresh interpreter)."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
APP = "litscale.app"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions, as absolute names
    (``from pkg import name`` counts ``pkg.name`` too, which may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@functools.cache  # every module parsed once per session: the tests below share the graph
def _graph() -> dict[str, set[str]]:
    return {name: {m for m in _imports(name, path) if m in MODULES and m != name}
            for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_sees_a_cycle_through_function_level_imports():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_src():
    assert _cycles(_graph()) == []


def test_only_the_app_imports_hydra_or_omegaconf():
    outside = {name: sorted(m for m in _imports(name, path) if m.split(".")[0] in ("hydra", "omegaconf"))
               for name, path in MODULES.items()
               if name.startswith("litscale") and not (name == APP or name.startswith(APP + "."))}
    assert {name: found for name, found in outside.items() if found} == {}


def test_the_library_does_not_import_the_app():
    library = [name for name in MODULES if name.startswith("litscale") and not name.startswith(APP)]
    assert {name: sorted(m for m in _graph()[name] if m.startswith(APP)) for name in library
            if any(m.startswith(APP) for m in _graph()[name])} == {}


def _import_alone(module: str) -> tuple[str, int, str]:
    process = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                             text=True, timeout=120)
    return module, process.returncode, process.stderr.strip().splitlines()[-1:]


@pytest.mark.slow
@pytest.mark.full  # one interpreter per module: minutes on 2 busy cores
@pytest.mark.timeout(600)
def test_every_module_imports_on_its_own():
    """A fresh interpreter per module: an import that works only after another module was
    imported first (a hidden cycle, a missing import) fails here."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_import_alone, sorted(MODULES)))
    assert [(module, error) for module, code, error in results if code != 0] == []


@pytest.mark.slow
def test_the_library_imports_without_hydra():
    """Importing the library (strategies, compression, callbacks, models, data, layout) must
    not load Hydra or OmegaConf: a plain Lightning script never pays for them."""
    code = ("import sys, litscale.strategies, litscale.compression, litscale.callbacks, "
            "litscale.models, litscale.data, litscale.layout, litscale.lr_scaling, litscale.modules; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')))")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == "[]"
