"""torchmetrics without the backends litscale never uses: about 3 s less per process.

Lightning imports torchmetrics, and torchmetrics' ``__init__`` imports, when they are
installed, ``transformers`` (for BERTScore and InfoLM: ``from transformers import AutoModel``,
which pulls in transformers' generation utilities, scikit-learn and pandas) and
``scipy.signal`` (a compatibility patch). The dev and ``hf`` extras install both, and every
process that imports Lightning then pays for them: ``import lightning.pytorch`` took 7.5 s of
CPU against 4.8 s without them on a 2-core machine (``python -X importtime`` names
``torchmetrics.functional.text.bert`` and ``scipy.signal`` as the two largest subtrees). litscale
computes one torchmetrics metric, ``MeanMetric``, which needs neither.

torchmetrics asks two questions, both answered by documented Python machinery:

- is the module importable: ``importlib.util.find_spec(name)``, which returns None where
  ``sys.modules[name]`` is None (the import system's "not importable" marker; ``import name``
  then raises ModuleNotFoundError);
- which version is installed: ``importlib.metadata.version(name)``, which asks each finder
  on ``sys.meta_path`` for the distribution (``find_distributions``) and takes the first answer.

``skip_torchmetrics_backends()`` answers both with "not installed" while torchmetrics' own
``__init__`` runs, and only then: the markers and the finder go before torchmetrics' import
returns, so a later ``import transformers`` (``model=hf``, the Hugging Face export) or
``import sklearn`` (``data=digits``) works as it always does. What such a process loses is
torchmetrics' BERTScore, InfoLM, CLIPScore and its scipy-based metrics, which torchmetrics then
reports as not installed. ``train.py`` turns it on for itself and its ranks
(``LITSCALE_SKIP_TORCHMETRICS_BACKENDS=1``, inherited by every process it starts); set the
variable to 0 to keep them (a LightningModule of your own that computes BERTScore). Importing
litscale as a library changes nothing unless the variable is 1.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SKIP_ENV = "LITSCALE_SKIP_TORCHMETRICS_BACKENDS"
# Module name -> distribution name, as torchmetrics 1.9 checks them (RequirementCache and
# package_available in torchmetrics/__init__.py, utilities/imports.py, functional/text/bert.py).
BACKENDS = {"transformers": "transformers", "scipy": "scipy"}


def skip_torchmetrics_backends() -> None:
    """Have the next ``import torchmetrics`` in this process skip ``BACKENDS`` (see the module
    docstring); nothing if torchmetrics is imported already or the hook is in place."""
    if "torchmetrics" in sys.modules or any(
        isinstance(f, _TorchmetricsFinder) for f in sys.meta_path
    ):
        return
    sys.meta_path.insert(0, _TorchmetricsFinder())


class _TorchmetricsFinder(importlib.abc.MetaPathFinder):
    """Finds torchmetrics as the other finders do, with a loader that hides ``BACKENDS``
    while the package's ``__init__`` runs; removes itself at its first use."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchmetrics":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = (
                finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            )
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _HidingLoader(spec.loader)
                return spec
        return None


class _HidingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # torchmetrics' own loader from here on (resources, reloads, tracebacks)
        module.__loader__ = module.__spec__.loader = self.loader
        with backends_not_installed(BACKENDS):
            self.loader.exec_module(module)


@contextmanager
def backends_not_installed(backends: dict[str, str]) -> Iterator[None]:
    """Within: each of ``backends`` (module -> distribution) that is not imported yet reads
    as not installed to ``find_spec``, ``import`` and ``importlib.metadata``."""
    hidden = {module: dist for module, dist in backends.items() if module not in sys.modules}
    finder = _NotInstalled(set(hidden.values()))
    sys.modules.update(dict.fromkeys(hidden))
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for module in hidden:
            if module in sys.modules and sys.modules[module] is None:
                del sys.modules[module]
        _forget_cached_answers()


def _forget_cached_answers() -> None:
    """lightning_utilities caches ``package_available`` and ``module_available`` (the checks
    torchmetrics and Lightning share) with ``functools.lru_cache``: what they learnt inside
    would outlive it."""
    imports = sys.modules.get("lightning_utilities.core.imports")
    for check in ("package_available", "module_available"):
        cache_clear = getattr(getattr(imports, check, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


class _NotInstalled(importlib.metadata.DistributionFinder):
    """``importlib.metadata`` answers "not installed" (PackageNotFoundError, as for a package
    that is absent) for these distributions, ahead of the finders that would find them."""

    def __init__(self, distributions: set[str]) -> None:
        self.distributions = {_normalized(name) for name in distributions}

    def find_spec(self, fullname, path, target=None):
        return None  # modules: sys.modules holds the markers

    def find_distributions(self, context=None):
        if (
            context is not None
            and context.name is not None
            and _normalized(context.name) in self.distributions
        ):
            raise importlib.metadata.PackageNotFoundError(context.name)
        return iter(())


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")
