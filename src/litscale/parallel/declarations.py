"""What a model declares about its own parallelism, found one way by every strategy.

A model family declares, beside its code, which submodules are sharding units
(``sharding_units``, FSDP), a tensor-parallel plan (``tensor_parallel_plan``) and the ordered
blocks a pipeline may cut between (``pipeline_blocks``), the modules holding stacked expert
weights (``expert_modules``) and the sizes a tensor-parallel split divides
(``tensor_parallel_sizes``, keyed as a user sets them): each an attribute, or a method that
returns it. A LightningModule may declare them itself or leave them to its network, ``net``.
Module names in plans and patterns are dotted paths whose components may hold ``fnmatch``
wildcards, one component each.

Not a strategy's module: strategies, the planner and the memory callback all read the same
declarations, and none of them should import another's package to do so.
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


def find_expert_modules(module: nn.Module) -> list[nn.Module]:
    """The grouped-experts modules ``module`` or its ``net`` declares (``expert_modules``), []
    if none."""
    found = declared(module, "expert_modules")
    if not found:
        return []
    owner, names = found
    return [owner.get_submodule(name) for name in names]


def find_moe_layers(module: nn.Module) -> list[nn.Module]:
    """The MoE layers of ``module`` or its ``net``: each declared grouped-experts module's
    parent (router, routed and shared experts); [] without declared experts."""
    experts = find_expert_modules(module)
    names = {id(m): name for name, m in module.named_modules()}
    return [module.get_submodule(names[id(m)].rpartition(".")[0]) for m in experts]


def moe_parameter_counts(module: nn.Module) -> tuple[int, int]:
    """(parameters of the MoE layers, of their routed experts) of ``module`` or its ``net``:
    tensor parallel leaves the layers whole (``models/moe_parallel.py``), expert parallel
    splits their routed experts; (0, 0) without declared experts."""
    experts, layers = find_expert_modules(module), find_moe_layers(module)
    return (sum(p.numel() for layer in layers for p in layer.parameters()),
            sum(p.numel() for m in experts for p in m.parameters()))
