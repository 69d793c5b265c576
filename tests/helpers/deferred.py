"""A name imported at its first use instead of with its test module.

Every pytest worker imports every test module to collect it; a heavy library imported at the
top of one module (transformers' models pull in scikit-learn and pandas: about 1.5 s) is then
paid by each worker, also by those that never run that module's tests."""

from __future__ import annotations

import importlib
from typing import Any


class Deferred:
    """Stands for ``from <module> import <name>``: calls and attributes go to the real object,
    imported the first time one is used."""

    def __init__(self, module: str, name: str) -> None:
        self._module, self._name = module, name

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self._module), self._name)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):  # pytest's collector probing the module's names
            raise AttributeError(attribute)
        return getattr(self.resolve(), attribute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)
