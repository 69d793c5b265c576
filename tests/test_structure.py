"""The suite's own rules, read from its source:

- no test module imports another (``test_*`` or ``conftest``): what tests share is in
  ``tests/helpers/``, so a module can move, split or go without breaking the others;
- a test that starts processes (gloo ranks, ``train.py``, torchrun, any subprocess, a
  notebook kernel), itself or through a fixture or function of its module, is marked
  ``slow``, so that ``pytest -m "not slow"`` stays the one-minute loop;

and one of the library's, read from ``src/``: no size product and no mesh flattening outside
``litscale/parallel/`` (the mesh is laid out once, its derived sizes named there).
"""

from __future__ import annotations

import ast
import re
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


# --- the mesh laid out once ----------------------------------------------------------------

SRC = TESTS.parent / "src"
PARALLEL = SRC / "litscale" / "parallel"
# A mesh or layout size, or a strategy's size option, as code names it (``mesh.tensor``,
# ``sizes.data``, ``self.replicate_size``, ``world_size``, ``processes``, ...).
SIZE = (r"(?:pipeline|data|data_shard|data_replicate|context|tensor|expert|expert_data|replica_groups|groups|"
        r"world_size|world|nodes|[a-z]*_parallel_size|replicate_size|processes_per_node|processes|num_nodes|devices)")
OPERAND = rf"(?:\w+\.)*{SIZE}\b"
SIZE_PRODUCT = re.compile(rf"(?<![\w.]){OPERAND}\s*\*(?!\*)\s*\(?\s*{OPERAND}")
MESH_FLATTENING = re.compile(r"\._(?:un)?flatten\(")


def size_products_and_flattenings(path: Path) -> list[str]:
    """``file:line: code`` of each product of two sizes, and each ``DeviceMesh._flatten`` or
    ``_unflatten``, in ``path`` (comments left out)."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if SIZE_PRODUCT.search(code) or MESH_FLATTENING.search(code):
            found.append(f"{path.name}:{number}: {line.strip()}")
    return found


def test_the_size_grep_sees_a_product_and_a_flattening(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("share = 1 / (mesh.tensor * mesh.pipeline)\nbytes = 4 * params  # mesh.data * mesh.context\n"
                       "mesh[dims]._flatten()\nflat = torch._utils._flatten_dense_tensors(grads)\n"
                       "rest = world_size // (self.replicate_size * self.context_parallel_size)\n")
    assert size_products_and_flattenings(planted) == [
        "planted.py:1: share = 1 / (mesh.tensor * mesh.pipeline)", "planted.py:3: mesh[dims]._flatten()",
        "planted.py:5: rest = world_size // (self.replicate_size * self.context_parallel_size)"]


def test_no_size_product_or_mesh_flattening_outside_parallel():
    """Only ``litscale/parallel/`` multiplies mesh sizes or flattens a mesh: everyone else asks
    it for the named size or mesh (``MeshSizes.fsdp``, ``ParallelMesh.get(FSDP)``, ...)."""
    found = [f"{path.parent.relative_to(SRC)}/{line}" for path in sorted(SRC.rglob("*.py"))
             if PARALLEL not in path.parents for line in size_products_and_flattenings(path)]
    assert found == []
