"""The planted-defect catalog (``tests/mutants``) against the code and the table it writes: every
row replaces a function that exists (a rename in ``src`` would otherwise leave a row that plants
nothing and, its tests passing, reads as survived or never reached), and ``tests/README.md``'s
table lists exactly the catalog's rows. Nothing is planted here."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # a dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


CATALOG = _load("litscale_mutant_catalog_under_test", TESTS / "mutants" / "catalog.py")
RUNNER = _load("litscale_mutant_runner_under_test", TESTS / "mutants" / "run.py")


def _target_of(mutant) -> object:
    """What the row's target names, as its class or module holds it (a staticmethod unwrapped
    by the caller)."""
    module_name, qualname = mutant.target.split(":")
    holder = importlib.import_module(module_name)
    *owners, attribute = qualname.split(".")
    for owner in owners:
        holder = getattr(holder, owner)
    return inspect.getattr_static(holder, attribute)


@pytest.mark.parametrize("mutant", CATALOG.MUTANTS.values(), ids=lambda mutant: mutant.name)
def test_each_row_replaces_a_function_that_exists(mutant):
    found = _target_of(mutant)
    function = found.__func__ if isinstance(found, staticmethod | classmethod) else found
    assert inspect.isfunction(function), f"{mutant.target} is a {type(found).__name__}, not a function"
    assert callable(mutant.wrap(function))


def test_each_row_names_its_tests_by_node_id_and_has_a_name_of_its_own():
    assert len(CATALOG.MUTANTS) == len(CATALOG._ROWS) >= 24
    for mutant in CATALOG.MUTANTS.values():
        assert mutant.tests, mutant.name
        for test in mutant.tests:
            path, _, name = test.partition("::")
            assert (TESTS.parent / path).is_file() and re.fullmatch(r"test_\w+(\[[^\]]+\])?", name), test


def test_the_readme_table_lists_exactly_the_catalogs_rows():
    text = (TESTS / "README.md").read_text()
    block = text[text.index(RUNNER.BEGIN) + len(RUNNER.BEGIN):text.index(RUNNER.END)]
    listed = re.findall(r"^\| \*\*([\w-]+)\*\*: ", block, re.M)
    assert listed == list(CATALOG.MUTANTS)
    targets = re.findall(r"^\| \*\*[\w-]+\*\*: .*? \| `([^`]+)` \|", block, re.M)
    assert targets == [mutant.target for mutant in CATALOG.MUTANTS.values()]


def _arguments_of(function) -> tuple[list[object], dict[str, object]]:
    """One call's arguments as ``function``'s callers pass them: its positional parameters by
    position, its keyword-only ones by name (each a placeholder; nothing is called)."""
    positional, keywords = [], {}
    for parameter in inspect.signature(function, follow_wrapped=False).parameters.values():
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            positional.append(object())
        elif parameter.kind is parameter.KEYWORD_ONLY:
            keywords[parameter.name] = object()
    return positional, keywords


@pytest.mark.parametrize("mutant", CATALOG.MUTANTS.values(), ids=lambda mutant: mutant.name)
def test_each_row_replaces_its_function_with_one_its_callers_can_call(mutant):
    """The replacement takes the arguments the function does: a signature that drifted (a
    parameter added or dropped in ``src``) raises TypeError where the defect should act, which
    fails the row's tests for the wrong reason and reads as caught."""
    found = _target_of(mutant)
    original = found.__func__ if isinstance(found, staticmethod | classmethod) else found
    positional, keywords = _arguments_of(original)
    try:
        inspect.signature(mutant.wrap(original), follow_wrapped=False).bind(*positional, **keywords)
    except TypeError as error:
        raise AssertionError(f"{mutant.name}: {mutant.target}'s replacement cannot be called as it is: {error}") from None
