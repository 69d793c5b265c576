"""A tensor-parallel plan (module-name pattern -> style) and applying it with DTensor's
parallel styles: what the tensor-parallel strategy, the pipeline (on its whole model) and the
one parallelize function share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from torch import nn

from litscale.parallel.declarations import declared, name_matches

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

StyleName = Literal["colwise", "rowwise", "embedding", "head", "head_norm", "norm", "sequence_input",
                    "sequence_start"]
STYLES: dict[str, str] = {
    "colwise": "split the output features (weight rows); input replicated, output sharded",
    "rowwise": "split the input features; partial outputs all-reduced (reduce-scattered "
               "over the sequence with sequence parallelism)",
    "embedding": "split the vocabulary rows of an embedding; output all-reduced",
    "head": "column-wise output layer; logits gathered, or kept vocabulary-sharded with loss parallel",
    "head_norm": "a norm over each head's features (QK-norm) on this rank's heads; its gain's "
                 "gradient summed over the ranks",
    "norm": "sequence parallel only: the module runs on this rank's slice of the sequence",
    "sequence_input": "sequence parallel only: gather the sequence before a tensor-parallel sub-layer",
    "sequence_start": "sequence parallel only: slice the sequence where the residual stream begins",
}


def parallel_style(name: str, *, sequence_parallel: bool, loss_parallel: bool):
    """The ``torch.distributed.tensor.parallel`` style for a style name, or None (no-op)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sequence = Shard(1)  # activations are [batch, sequence, features]
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel(output_layouts=sequence if sequence_parallel else Replicate())
    if name == "embedding":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "head":
        return ColwiseParallel(input_layouts=sequence if sequence_parallel else Replicate(),
                               output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
    if name == "head_norm":  # on [batch, sequence, heads, head_dim], the heads split
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sequence_parallel:
        return None
    if name == "norm":
        return SequenceParallel()
    if name == "sequence_input":
        # NOTE: the gathered input stays a DTensor (use_local_output=False, as torchtitan), so
        # the gradients of the projections that read it (q, k, v; up, gate) are summed as one
        # partial tensor and reduce-scattered once, in the gather's backward (Megatron's
        # pattern); handed on as a plain tensor, each projection all-reduced its own.
        return PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),),
                                  use_local_output=False)
    if name == "sequence_start":
        return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(sequence,),
                                  use_local_output=True)
    raise ValueError(f"tensor-parallel style {name!r} is not known; allowed: {', '.join(STYLES)}")


def check_plan(plan: dict[str, str], key: str = "strategy.plan") -> None:
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"{key}.{pattern}={style!r} is not a tensor-parallel style; "
                             f"allowed: {', '.join(STYLES)}")


def find_plan(module: nn.Module, plan: dict[str, str] | None = None) -> tuple[nn.Module, dict[str, str]]:
    """(the module the plan's names are relative to, the plan): ``plan`` if given (relative to
    ``module``), else what ``module`` or its ``net`` declares as ``tensor_parallel_plan``."""
    if plan:
        return module, dict(plan)
    found = declared(module, "tensor_parallel_plan")
    if found and found[1]:
        return found[0], dict(found[1])
    raise ValueError(
        f"{type(module).__name__} declares no tensor-parallel plan; declare "
        "`tensor_parallel_plan = {'pattern': 'colwise', ...}` on the LightningModule or its `net`, "
        "or pass strategy.plan (module-name pattern -> style)")


def tensor_parallel_sizes(net: nn.Module) -> dict[str, int]:
    """The sizes a tensor-parallel split divides, each under the key a user sets it by: what the
    model declares (``tensor_parallel_sizes``: a transformers model names its config's fields),
    else the zoo's config fields (heads, key/value heads, width, and the vocabulary, which the
    embedding splits)."""
    found = declared(net, "tensor_parallel_sizes")
    if found is not None:
        return dict(found[1])
    config = getattr(net, "config", None)
    return {f"model.net.{field}": value for field in ("n_head", "n_kv_heads", "n_embd", "vocab_size")
            if isinstance(value := getattr(config, field, None), int)}


def check_tensor_parallel_fits(net: nn.Module, tensor_parallel_size: int) -> None:
    """Every size the split divides (``tensor_parallel_sizes``) divides by the TP size."""
    if tensor_parallel_size == 1:
        return
    for key, value in tensor_parallel_sizes(net).items():
        if value % tensor_parallel_size:
            raise ValueError(
                f"strategy.tensor_parallel_size={tensor_parallel_size} does not divide "
                f"{key}={value}; allowed: a divisor of {value}")


def check_tensor_parallel_setup(net: nn.Module, tensor_parallel_size: int, plan: dict[str, str] | None) -> None:
    """Pre-flight: the model splits by the TP size and a plan exists (``plan``'s names are
    relative to the LightningModule, whose network is ``net``)."""
    check_tensor_parallel_fits(net, tensor_parallel_size)
    find_plan(net, plan and {k.removeprefix("net."): v for k, v in plan.items()})


def _tied_parameters(root: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold one shared Parameter (tied embeddings)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for attribute, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attribute))
    return [group for group in owners.values() if len(group) > 1]


def _tie_again(tied: list[list[tuple[nn.Module, str]]]) -> None:
    for group in tied:
        first_module, first_attribute = group[0]
        shared = getattr(first_module, first_attribute)
        for module, attribute in group[1:]:
            if getattr(module, attribute).placements != shared.placements:
                raise ValueError(f"tied parameter {attribute} is split two different ways by the "
                                 "tensor-parallel plan; untie it or give both the same split")
            setattr(module, attribute, shared)


def apply_tensor_parallel(
    root: nn.Module, mesh: DeviceMesh, plan: dict[str, str], *, sequence_parallel: bool = True,
    loss_parallel: bool = False, strict: bool = True,
) -> None:
    """Split ``root``'s submodules in place on the 1D ``mesh`` following ``plan``.

    ``strict``: every pattern must match a module. Sequence parallelism applies only if the
    plan marks where the sequence-sharded region starts (a ``sequence_start`` entry). Tied
    parameters (an embedding shared with the head, both split by vocabulary rows) are tied
    again after the split.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    check_plan(plan)
    # Sequence parallelism needs to know where the sequence-sharded residual stream begins; a
    # plan that does not say (e.g. a user's MLP plan) runs plain tensor parallel.
    sequence_parallel = sequence_parallel and "sequence_start" in plan.values()
    names = [name for name, _ in root.named_modules() if name]
    unmatched = [pattern for pattern in plan if not any(name_matches(name, pattern) for name in names)]
    if strict and unmatched:
        raise ValueError(f"strategy.plan pattern {unmatched[0]!r} matches no submodule of {type(root).__name__}")
    styles = {pattern: parallel_style(style, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
              for pattern, style in plan.items() if pattern not in unmatched}
    tied = _tied_parameters(root)
    # torch matches the wildcards itself, as name_matches does (fnmatch per dotted component),
    # and applies the entries in order. NOTE: it only warns for a pattern that matches nothing,
    # hence the check above (and unmatched patterns are left out, so strict=False stays quiet).
    parallelize_module(root, mesh, {pattern: style for pattern, style in styles.items() if style is not None})
    _tie_again(tied)


def apply_declared_plan(module: nn.Module, mesh: DeviceMesh, plan: dict[str, str] | None = None, *,
                        sequence_parallel: bool = True, loss_parallel: bool = False) -> None:
    """Tensor parallel on ``mesh`` from ``plan`` (relative to ``module``) or the declared plan."""
    root, found = find_plan(module, plan)
    apply_tensor_parallel(root, mesh, found, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
