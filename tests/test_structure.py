"""The suite's own rules, read from its source:

- no test module imports another (``test_*`` or ``conftest``): what tests share is in
  ``tests/helpers/``, so a module can move, split or go without breaking the others;
- a test that starts processes (gloo ranks, ``train.py``, torchrun, any subprocess, a
  notebook kernel), itself or through a fixture or function of its module, is marked
  ``slow``, so that ``pytest -m "not slow"`` stays the one-minute loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TEST_MODULES = sorted(TESTS.glob("test_*.py"))
HELPERS = sorted((TESTS / "helpers").glob("*.py"))

# Names whose use starts a process: the helpers that do, and the modules that can.
STARTS_PROCESSES = {"run_distributed", "run_train", "train_on_pool", "run_in_own_group", "subprocess",
                    "multiprocessing", "start_processes", "nbclient"}


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported_modules(tree: ast.Module) -> set[str]:
    """The top-level name of every module ``tree`` imports, at any depth of the file."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", TEST_MODULES + HELPERS, ids=lambda path: path.name)
def test_no_test_module_imports_another(path):
    imported = imported_modules(_parse(path))
    assert {name for name in imported if name.startswith("test_") or name == "conftest"} == set()


def _names_used(function: ast.FunctionDef) -> set[str]:
    """Names a function's body uses (``subprocess.run`` counts as ``subprocess`` and ``run``),
    and the fixtures it asks for by its parameters."""
    used = {arg.arg for arg in function.args.args}
    for node in ast.walk(function):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
    return used


def _is_slow(decorators: list[ast.expr]) -> bool:
    return any("slow" in ast.unparse(decorator) for decorator in decorators)


def unmarked_process_tests(tree: ast.Module) -> list[str]:
    """Tests that start processes, directly or through this module's functions and fixtures,
    without a ``slow`` mark (on the test, or ``pytestmark`` on the module)."""
    marks = [node.value for node in tree.body if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)]
    if _is_slow(marks):
        return []
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    uses = {name: _names_used(function) for name, function in functions.items()}
    starting = set()
    while True:  # a function starts processes if it uses one that does, to any depth
        found = {name for name, used in uses.items()
                 if used & (STARTS_PROCESSES | starting) and name not in starting}
        if not found:
            break
        starting |= found
    return sorted(name for name in starting
                  if name.startswith("test_") and not _is_slow(functions[name].decorator_list))


@pytest.mark.parametrize("path", TEST_MODULES, ids=lambda path: path.name)
def test_tests_that_start_processes_are_marked_slow(path):
    assert unmarked_process_tests(_parse(path)) == []


def test_the_process_check_sees_fixtures_and_helpers():
    source = '''
import subprocess
def launch(): subprocess.run(["true"])
@pytest.fixture
def launched(): return launch()
def test_direct(): launch()
def test_by_fixture(launched): pass
@pytest.mark.slow
def test_marked(launched): pass
def test_pure(): pass
'''
    assert unmarked_process_tests(ast.parse(source)) == ["test_by_fixture", "test_direct"]
