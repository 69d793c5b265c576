"""Pipeline stages: which blocks each stage owns and which rank runs it, and the module
surgery that leaves each rank only its stages.

The model declares the ordered units a pipeline may cut between (``pipeline_blocks``, each
unit a list of submodule names). A plan is the start unit of each stage (balanced by
parameter count, or at ``split_points``) and the pipeline rank of each stage (one stage per
rank, looped, or V-shaped). A rank keeps the units of its stages and sets the others to
``None`` (``GPT.forward`` skips them), so checkpoint keys stay stable (torchtitan's approach).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from litscale.parallel.declarations import declared

Units = list[list[str]]


def _as_units(blocks: Sequence[str | Sequence[str]]) -> Units:
    return [[name] if isinstance(name, str) else list(name) for name in blocks]


def find_blocks(module: nn.Module, blocks: Units | None = None) -> tuple[nn.Module, Units]:
    """(the module the block names are relative to, the units in forward order): ``blocks`` if
    given (relative to ``module``), else what ``module`` or its ``net`` declares as
    ``pipeline_blocks`` (a list, or a method returning one)."""
    if blocks:
        return module, _as_units(blocks)
    found = declared(module, "pipeline_blocks")
    if found and found[1]:
        return found[0], _as_units(found[1])
    raise ValueError(
        f"{type(module).__name__} declares no pipeline blocks; declare `pipeline_blocks` (the "
        "ordered submodule names a pipeline may cut between) on the LightningModule or its `net`, "
        "or pass blocks= to the strategy")


def check_enough_blocks(num_blocks: int, num_stages: int, *, pipeline_parallel_size: int) -> None:
    if num_blocks < num_stages:
        raise ValueError(
            f"strategy.pipeline_parallel_size={pipeline_parallel_size} needs {num_stages} pipeline "
            f"stages but the model declares only {num_blocks} blocks to cut between; allowed: "
            f"at most {num_blocks} stages (pipeline_parallel_size x virtual_stages)")


def _unit_sizes(owner: nn.Module, units: Units) -> list[int]:
    return [sum(p.numel() for name in unit for p in owner.get_submodule(name).parameters())
            for unit in units]


def balanced_cuts(sizes: Sequence[int], num_stages: int) -> list[int]:
    """Start index of each stage: contiguous runs of ``sizes`` minimising the largest stage
    (exact dynamic programme; the unit count is small)."""
    n, prefix = len(sizes), [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    best = {(0, 0): (0, [])}  # (units used, stages made) -> (largest stage, starts)
    for stages in range(1, num_stages + 1):
        for end in range(stages, n - (num_stages - stages) + 1):
            options = [(max(best[(start, stages - 1)][0], prefix[end] - prefix[start]),
                        best[(start, stages - 1)][1] + [start])
                       for start in range(stages - 1, end) if (start, stages - 1) in best]
            best[(end, stages)] = min(options)
    return best[(n, num_stages)][1]


def stage_cuts(owner: nn.Module, units: Units, num_stages: int, split_points: Sequence[str] | None) -> list[int]:
    """Start unit of each stage, from ``split_points`` (the first module name of each stage
    after the first) or balanced by parameter count."""
    if not split_points:
        return balanced_cuts(_unit_sizes(owner, units), num_stages)
    first_names = {unit[0]: index for index, unit in enumerate(units)}
    if len(split_points) != num_stages - 1:
        raise ValueError(f"strategy.split_points={list(split_points)} gives {len(split_points) + 1} "
                         f"stages but the pipeline has {num_stages}; allowed: {num_stages - 1} names")
    unknown = [name for name in split_points if name not in first_names or first_names[name] == 0]
    if unknown:
        raise ValueError(f"strategy.split_points={list(split_points)}: {unknown[0]!r} is not a block to "
                         f"cut before; allowed: {', '.join(list(first_names)[1:])}")
    cuts = [0] + [first_names[name] for name in split_points]
    if cuts != sorted(set(cuts)):
        raise ValueError(f"strategy.split_points={list(split_points)} must be in forward order, no repeats")
    return cuts


def stage_ranks(num_stages: int, pipeline_size: int, placement: str) -> list[int]:
    """The pipeline rank that runs each stage. ``placement``: "single" (one stage per rank),
    "loop" (stage s on rank s % p) or "v" (rank r holds stages r and 2p-1-r)."""
    if placement == "v":
        return [s if s < pipeline_size else 2 * pipeline_size - 1 - s for s in range(num_stages)]
    return [s % pipeline_size for s in range(num_stages)]


def _stage_names(units: Units, cuts: list[int]) -> list[list[str]]:
    """The submodule names each stage owns."""
    ends = cuts[1:] + [len(units)]
    return [[name for unit in units[start:end] for name in unit] for start, end in zip(cuts, ends, strict=True)]


def check_ties(owner: nn.Module, units: Units, cuts: list[int], pipeline_parallel_size: int) -> None:
    """No parameter is shared by two stages (a tied embedding and head must stay on one)."""
    stage_of = {}
    for stage, names in enumerate(_stage_names(units, cuts)):
        for name in names:
            for param_name, param in owner.get_submodule(name).named_parameters():
                other = stage_of.setdefault(id(param), (stage, f"{name}.{param_name}"))
                if other[0] != stage:
                    raise ValueError(
                        f"strategy.pipeline_parallel_size={pipeline_parallel_size} cuts between tied parameters ({other[1]} "
                        f"and {name}.{param_name} are one tensor on stages {other[0]} and {stage}); "
                        "untie them (model.net.tie_embeddings=false) or keep them on one stage")


def plan_stages(owner: nn.Module, units: Units, *, num_stages: int, pipeline_size: int, placement: str,
                split_points: Sequence[str] | None) -> tuple[list[int], list[int]]:
    """(start unit of each stage, pipeline rank of each stage); split points and ties checked.
    Call ``check_enough_blocks`` first."""
    cuts = stage_cuts(owner, units, num_stages, split_points)
    check_ties(owner, units, cuts, pipeline_size)
    return cuts, stage_ranks(num_stages, pipeline_size, placement)


def _shallow(module: nn.Module) -> nn.Module:
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def without(root: nn.Module, names: Sequence[str], *, in_place: bool) -> nn.Module:
    """``root`` with the submodules ``names`` removed (``None``, or deleted from a container).
    Not ``in_place``: a view that shares every remaining module with ``root``."""
    view = root if in_place else _shallow(root)
    copied = {id(view)}
    for name in names:
        *path, leaf = name.split(".")
        parent = view
        for part in path:
            child = parent._modules[part]
            if not in_place and id(child) not in copied:
                child = _shallow(child)
                parent._modules[part] = child
                copied.add(id(child))
            parent = child
        if isinstance(parent, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
            del parent._modules[leaf]
        else:
            parent._modules[leaf] = None
    return view


def keep_stages(owner: nn.Module, units: Units, cuts: list[int], ranks: list[int],
                pipeline_rank: int) -> dict[int, nn.Module]:
    """Remove from ``owner`` (in place) every unit that no stage of ``pipeline_rank`` owns, and
    return a view of ``owner`` per stage of that rank (stage index -> module that runs it)."""
    names_of = _stage_names(units, cuts)
    mine = [stage for stage, rank in enumerate(ranks) if rank == pipeline_rank]
    owned = {name for stage in mine for name in names_of[stage]}
    every = [name for unit in units for name in unit]
    without(owner, [name for name in every if name not in owned], in_place=True)
    return {stage: without(owner, [n for n in every if n in owned and n not in names_of[stage]], in_place=False)
            for stage in mine}
