"""What a model declares about its own parallelism, found one way by every strategy.

A model family declares, beside its code, which submodules are sharding units
(``sharding_units``, FSDP), a tensor-parallel plan (``tensor_parallel_plan``) and the ordered
blocks a pipeline may cut between (``pipeline_blocks``): each an attribute, or a method that
returns it. A LightningModule may declare them itself or leave them to its network, ``net``.
Module names in plans and patterns are dotted paths whose components may hold ``fnmatch``
wildcards, one component each.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn


def declared(module: nn.Module, attribute: str) -> tuple[nn.Module, Any] | None:
    """``(owner, value)`` for the first of ``module`` and its ``net`` that declares
    ``attribute`` (not ``None``; a method is called), else ``None``. Names inside the value
    are relative to ``owner``."""
    for owner in (module, getattr(module, "net", None)):
        value = getattr(owner, attribute, None)
        if callable(value):
            value = value()
        if value is not None:
            return owner, value
    return None


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch`` per dotted component, so ``net.blocks.*`` matches the blocks, not their
    children (the component counts must be equal)."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(map(fnmatch.fnmatchcase, parts, wanted))
