"""Python processes as if litscale were installed without its optional extras (nor the dev
tools: pytest): ``environment()`` gives the variables that make every interpreter a command
starts (its ranks too) begin with ``block()``, through ``site_without_extras/sitecustomize.py``.

A second virtual environment would be the real thing, and takes minutes to build; this hides
the packages of this one instead, as an uninstalled package is absent: every import finder
answers "not found" for them (``importlib.util.find_spec`` gives None, an import raises
``ModuleNotFoundError``), ``pkgutil`` does not list them (Hydra finds its plugins that way)
and ``importlib.metadata`` has no distribution of them (Lightning asks it). ``raising`` instead
puts one finder first that raises ``ModuleNotFoundError`` for them, as a stricter caller might.

Loaded by path by the sitecustomize, before anything else: it imports the standard library only.
"""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
import sys
from pathlib import Path

# The modules of pyproject.toml's optional extras, and pytest: what a plain `pip install -e .`
# lacks. hydra_plugins.hydra_submitit_launcher shares its namespace with litscale's own plugins.
# tensorboardX is in no extra, but this environment has it, and Lightning's TensorBoard logger
# writes with it where tensorboard is missing.
OPTIONAL_MODULES = (
    "deepspeed", "wandb", "tensorboard", "tensorboardX", "sklearn", "matplotlib", "submitit",
    "hydra_plugins.hydra_submitit_launcher", "datasets", "transformers", "safetensors", "ray",
    "optuna", "kubernetes", "jsonschema", "sky", "torchao", "torchft", "pytest", "_pytest",
)
# The same packages as importlib.metadata names their distributions.
DISTRIBUTIONS = {
    "deepspeed": "deepspeed", "wandb": "wandb", "tensorboard": "tensorboard", "sklearn": "scikit-learn",
    "matplotlib": "matplotlib", "submitit": "submitit",
    "hydra_plugins.hydra_submitit_launcher": "hydra-submitit-launcher", "datasets": "datasets",
    "transformers": "transformers", "safetensors": "safetensors", "ray": "ray", "optuna": "optuna",
    "kubernetes": "kubernetes", "jsonschema": "jsonschema", "sky": "skypilot", "torchao": "torchao",
    "torchft": "torchft", "tensorboardX": "tensorboardx", "pytest": "pytest", "_pytest": "pytest",
}


def is_blocked(name: str, blocked: tuple[str, ...]) -> bool:
    return any(name == module or name.startswith(module + ".") for module in blocked)


class HidingFinder:
    """One of the interpreter's finders, blind to the blocked modules."""

    def __init__(self, finder, blocked: tuple[str, ...]) -> None:
        self.finder, self.blocked = finder, blocked

    def find_spec(self, name, path=None, target=None):
        if is_blocked(name, self.blocked):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attribute):  # invalidate_caches, find_distributions, ...
        return getattr(self.finder, attribute)


class RaisingFinder:
    """First on ``sys.meta_path``: refuses the blocked modules outright."""

    def __init__(self, blocked: tuple[str, ...]) -> None:
        self.blocked = blocked

    def find_spec(self, name, path=None, target=None):
        if is_blocked(name, self.blocked):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def block(blocked: tuple[str, ...] = OPTIONAL_MODULES, *, raising: bool = False) -> None:
    """From now on, this interpreter behaves as if ``blocked`` were not installed."""
    if raising:
        sys.meta_path.insert(0, RaisingFinder(blocked))
    else:
        sys.meta_path[:] = [HidingFinder(finder, blocked) for finder in sys.meta_path]
    iter_modules = pkgutil.iter_modules

    def listed(path=None, prefix=""):
        return (info for info in iter_modules(path, prefix) if not is_blocked(info.name, blocked))

    pkgutil.iter_modules = listed
    absent = {DISTRIBUTIONS.get(module, module) for module in blocked}
    from_name = importlib.metadata.Distribution.from_name.__func__

    def distribution(cls, name: str):
        if name.replace("_", "-").lower() in absent:
            raise importlib.metadata.PackageNotFoundError(name)
        return from_name(cls, name)

    importlib.metadata.Distribution.from_name = classmethod(distribution)


# How a test asks for it: this module's directory of a sitecustomize on PYTHONPATH, and which
# modules to hide in the environment, so that every process of the run (ranks, a planner's
# trial runs) starts without them too.
SITE_DIR = Path(__file__).parent / "site_without_extras"
HIDDEN_ENV = "LITSCALE_TEST_HIDDEN_MODULES"
RAISING_ENV = "LITSCALE_TEST_HIDE_BY_RAISING"


def environment(blocked: tuple[str, ...] = OPTIONAL_MODULES, *, raising: bool = False) -> dict[str, str]:
    """The variables that start a Python process of this repo as if ``blocked`` were not installed."""
    path = os.pathsep.join(filter(None, [str(SITE_DIR), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, HIDDEN_ENV: ",".join(blocked), RAISING_ENV: "1" if raising else ""}


def block_from_environment() -> None:
    """What the sitecustomize runs at each start of an interpreter."""
    if os.environ.get(HIDDEN_ENV):
        block(tuple(os.environ[HIDDEN_ENV].split(",")), raising=bool(os.environ.get(RAISING_ENV)))
