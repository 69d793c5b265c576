"""The package's layering: the library imports without Hydra, no import cycle anywhere in
``src/``, every module imports on its own (in a process that has imported no other), and the
order of floors: an import goes only down (``FLOORS``), and nothing of litscale imports or
names the plugins."""

from __future__ import annotations

import ast
import functools
import json
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


def _run_on_import(tree: ast.Module):
    """The statements a module runs when imported: all but its functions' bodies and its
    ``if TYPE_CHECKING:`` blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            stack.extend(child for child in ast.iter_child_nodes(node)
                         if isinstance(child, ast.stmt | ast.excepthandler))


def _imports(name: str, path: Path, *, on_import_only: bool = False) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions (at module level
    only, with ``on_import_only``), as absolute names (``from pkg import name`` counts
    ``pkg.name`` too, which may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in _run_on_import(tree) if on_import_only else ast.walk(tree):
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


@pytest.mark.slow
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


# The floors of the house, lowest first: a module imports its own package (or, at the root, the
# root's small modules) and lower floors only. Packages that share a floor import none of each
# other. ``litscale`` (the root) is its small modules; ``litscale.modules`` and
# ``litscale.doctor`` stand alone on their floors.
FLOORS = (
    ("litscale",),
    ("litscale.measure", "litscale.health"),
    ("litscale.parallel", "litscale.models", "litscale.compression"),
    ("litscale.data", "litscale.optim"),
    ("litscale.reliability", "litscale.checkpoint"),
    ("litscale.strategies", "litscale.callbacks", "litscale.modules"),
    ("litscale.planner",),
    ("litscale.app", "litscale.doctor"),
    ("hydra_plugins",),
)
ROOT = "litscale"


def _room(module: str) -> str:
    """The package (or root module) a module belongs to: its floor's unit."""
    parts = module.split(".")
    if parts[0] == "hydra_plugins":
        return "hydra_plugins"
    if len(parts) == 1:
        return ROOT
    second = ".".join(parts[:2])
    return second if second in FLOOR_OF else ROOT


FLOOR_OF = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes to another room on the same floor or a higher one, as
    ``module -> imported``."""
    found = []
    for module, imported in sorted(graph.items()):
        here = _room(module)
        for target in sorted(imported):
            there = _room(target)
            if there != here and FLOOR_OF[there] >= FLOOR_OF[here]:
                found.append(f"{module} -> {target}")
    return found


def test_the_floor_finder_sees_an_import_that_runs_up_or_across():
    graph = {"litscale.errors": set(), "litscale.parallel.layout": {"litscale.errors"},
             "litscale.models.gpt": {"litscale.parallel.layout"},
             "litscale.checkpoint.moves": {"litscale.strategies.fsdp"}, "litscale.strategies.fsdp": set()}
    assert _upward_imports(graph) == ["litscale.checkpoint.moves -> litscale.strategies.fsdp",
                                      "litscale.models.gpt -> litscale.parallel.layout"]


def test_every_package_is_on_a_floor():
    """A new package of litscale gets its floor here before anything imports it."""
    packages = {f"litscale.{path.parent.name}" for path in (SRC / "litscale").glob("*/__init__.py")}
    assert packages - set(FLOOR_OF) == set()


def test_every_import_goes_down_a_floor():
    """The order of floors (foundation -> measure, health -> parallel, models, compression ->
    data, optim -> reliability, checkpoint -> strategies, callbacks, modules -> planner -> app
    -> plugins): an import that runs up or across a floor names itself here."""
    assert _upward_imports(_graph()) == []


def test_nothing_of_litscale_imports_the_plugins():
    assert {name: sorted(m for m in found if m.startswith("hydra_plugins")) for name, found in _graph().items()
            if name.startswith("litscale") and any(m.startswith("hydra_plugins") for m in found)} == {}


def _code_strings(tree: ast.Module) -> list[ast.Constant]:
    """The string constants of a module's code: docstrings left out (they may say who reads what)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


@pytest.mark.slow  # over half a second alone
def test_nothing_of_litscale_names_a_plugin():
    """The app asks the launcher a config names (``hydra.launcher._target_``) rather than keeping
    a table of litscale's launchers: no string in litscale's code names a module of its plugins."""
    named = {name: [node.value for node in _code_strings(ast.parse(path.read_text(encoding="utf-8")))
                    if "litscale_plugins" in node.value]
             for name, path in MODULES.items() if name.startswith("litscale")}
    assert {name: found for name, found in named.items() if found} == {}


# Libraries every import of which loads the same modules, so a process may import them before
# it forks the one that imports a module of ours: 4-7 s of imports paid once, not per module.
PRELOADABLE = ("torch", "lightning")

# Imports the libraries it is given, then forks a child per module (two at a time) that imports
# that module alone: ``{"module": ..., "code": ..., "error": ...}`` per line.
FORKING_IMPORTER = """
import importlib, json, os, sys, traceback
preload, modules = sys.argv[1].split(","), sys.argv[2:]
for library in filter(None, preload):
    importlib.import_module(library)
assert not [m for m in sys.modules if m.split(".")[0] == "litscale"], "a module of ours preloaded"
running = {}

def reap():
    pid, status = os.wait()
    module, pipe = running.pop(pid)
    with os.fdopen(pipe) as reader:
        error = reader.read()
    print(json.dumps({"module": module, "code": os.waitstatus_to_exitcode(status), "error": error}),
          flush=True)

for module in modules:
    if len(running) == 2:
        reap()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
        except BaseException:
            os.write(write, traceback.format_exc().strip().splitlines()[-1].encode())
            os._exit(1)
        os._exit(0)
    os.close(write)
    running[pid] = module, read
while running:
    reap()
"""


@functools.cache
def _libraries_on_import(module: str) -> frozenset[str]:
    """The top-level packages that importing ``module`` imports, as far as the source tells:
    its own module-level imports, its parent packages' and those of every module of ours they
    import in turn."""
    seen, pending, libraries = set(), [module], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        pending.extend(".".join(parts[:end]) for end in range(1, len(parts)) if ".".join(parts[:end]) in MODULES)
        for imported in _imports(name, MODULES[name], on_import_only=True):
            if imported in MODULES:
                pending.append(imported)
            elif imported.split(".")[0] != "litscale":
                libraries.add(imported.split(".")[0])
    return frozenset(libraries)


def _preload(module: str) -> tuple[str, ...]:
    """What the process that forks ``module``'s may import first: only libraries the module
    imports itself on import, so nothing it forgot to import can be there by our doing."""
    libraries = _libraries_on_import(module)
    if "lightning" in libraries:
        libraries |= {"torch"}  # Lightning imports it first
    return tuple(library for library in PRELOADABLE if library in libraries)


def _import_each_alone(preload: tuple[str, ...], modules: list[str]) -> list[dict]:
    process = subprocess.run([sys.executable, "-c", FORKING_IMPORTER, ",".join(preload), *modules],
                             capture_output=True, text=True, timeout=500)
    assert process.returncode == 0, process.stderr
    return [json.loads(line) for line in process.stdout.splitlines()]


@pytest.mark.slow
def test_a_module_that_needs_another_imported_first_fails_alone(tmp_path):
    package = tmp_path / "layered"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("VALUE = 1\n")
    (package / "second.py").write_text("import layered\nVALUE = layered.first.VALUE\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); " + FORKING_IMPORTER
    process = subprocess.run([sys.executable, "-c", code, "", "layered.first", "layered.second"],
                             capture_output=True, text=True, timeout=60)
    assert process.returncode == 0, process.stderr
    results = sorted((r["module"], r["code"], r["error"]) for r in map(json.loads, process.stdout.splitlines()))
    assert results == [("layered.first", 0, ""), ("layered.second", 1, "AttributeError: module 'layered' "
                                                                        "has no attribute 'first'")]


def test_modules_that_import_torch_or_lightning_are_forked_after_them():
    assert _preload("litscale.strategies.mesh_strategy") == ("torch", "lightning")
    assert "torch" in _libraries_on_import("litscale.models.gpt")
    assert _preload("litscale.arguments") == ()


@pytest.mark.slow
@pytest.mark.soak  # one process per module: a minute on 2 busy cores
@pytest.mark.timeout(600)
def test_every_module_imports_on_its_own():
    """A new process per module, none of ours imported before it: an import that works only
    after another module was imported first (a hidden cycle, a missing import) fails here. The
    process is forked from one that has imported only the libraries (of ``PRELOADABLE``) the
    module's source imports on import anyway."""
    by_preload: dict[tuple[str, ...], list[str]] = {}
    for module in sorted(MODULES):
        by_preload.setdefault(_preload(module), []).append(module)
    with ThreadPoolExecutor(max_workers=len(by_preload)) as pool:
        results = [result for batch in pool.map(lambda item: _import_each_alone(*item), by_preload.items())
                   for result in batch]
    assert sorted(result["module"] for result in results) == sorted(MODULES)
    assert [(r["module"], r["error"]) for r in results if r["code"] != 0] == []


@pytest.mark.full
@pytest.mark.slow
def test_the_library_imports_without_hydra():
    """Importing the library (strategies, compression, callbacks, models, data, layout) must
    not load Hydra or OmegaConf: a plain Lightning script never pays for them."""
    code = ("import sys, litscale.strategies, litscale.compression, litscale.callbacks, "
            "litscale.models, litscale.data, litscale.parallel.layout, litscale.optim.lr_scaling, litscale.modules; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')))")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == "[]"
