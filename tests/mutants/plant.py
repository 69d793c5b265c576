"""Plants one defect of the catalog (``catalog.py``) in this interpreter, at run time: the
function it names is replaced, right after its module is first imported, by the catalog's
wrapper of it. No source file changes.

``site/sitecustomize.py`` calls ``plant_from_environment()`` at the start of every interpreter
that ``make mutants`` starts (pytest, its workers, the rank pool's ranks, ``train.py`` and the
ranks it launches), through ``PYTHONPATH``: a defect in a rank is planted in that rank. Each
interpreter appends a line to ``LITSCALE_MUTANT_LOG`` when the wrapper first runs, so that the
runner can tell a defect the tests caught from one they never reached.

Standard library only: it is loaded before anything else.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

MUTANT_ENV, LOG_ENV = "LITSCALE_MUTANT", "LITSCALE_MUTANT_LOG"
HERE = Path(__file__).resolve().parent


def load_catalog():
    """``catalog.py`` by path (the tests dir is not a package, and nothing else is imported)."""
    spec = importlib.util.spec_from_file_location("litscale_mutant_catalog", HERE / "catalog.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def plant_from_environment() -> None:
    name = os.environ.get(MUTANT_ENV)
    if not name:
        return
    mutant = load_catalog().MUTANTS[name]
    module_name, qualname = mutant.target.split(":")
    sys.meta_path.insert(0, _AfterImport(module_name, lambda module: _replace(module, qualname, mutant)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after ``module_name`` is executed, before anyone imports a
    name from it (so that ``from x import f`` takes the replacement too)."""

    def __init__(self, module_name: str, then) -> None:
        self.module_name, self.then = module_name, then

    def find_spec(self, name, path, target=None):
        if name != self.module_name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        execute, then = spec.loader.exec_module, self.then

        def exec_module(module):
            execute(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


def _replace(module, qualname: str, mutant) -> None:
    owner, _, attribute = qualname.rpartition(".")
    holder = module
    for part in filter(None, owner.split(".")):
        holder = getattr(holder, part)
    own = vars(holder).get(attribute) if isinstance(holder, type) else None
    static = isinstance(own, staticmethod)
    original = own.__func__ if static else getattr(holder, attribute)
    replacement = mutant.wrap(original)
    reported = []

    def planted(*args, **kwargs):
        if not reported:
            reported.append(True)
            _report(mutant.name)
        return replacement(*args, **kwargs)

    wrapped = staticmethod(planted) if static else planted
    setattr(holder, attribute, wrapped)


def _report(name: str) -> None:
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a") as handle:
            handle.write(f"{name} ran in pid {os.getpid()}\n")
