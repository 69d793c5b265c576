"""The model-parallel device mesh: its sizes, their validation, and sums across it.

One place decides how ``world_size`` ranks split into pipeline x data x tensor parallel
(torchtitan's ``ParallelDims``), and checks that the model fits the split: heads and hidden
sizes divisible by the tensor-parallel size, enough pipeline blocks for the stages. Every
check raises ``ValueError`` with one line naming the ``strategy.<key>``, so the pre-flight
check (``validate_setup``) reports it before any process group exists.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

# Mesh dimension names, outermost first. "data_parallel" is the name Lightning's
# ModelParallelStrategy reads for its sampler arguments.
PIPELINE, DATA, TENSOR = "pipeline_parallel", "data_parallel", "tensor_parallel"


@dataclass(frozen=True)
class MeshSizes:
    """How many ranks each dimension spans; the product is the world size."""

    pipeline: int = 1
    data: int = 1
    tensor: int = 1

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data * self.tensor

    def shape_and_names(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        return (self.pipeline, self.data, self.tensor), (PIPELINE, DATA, TENSOR)

    def describe(self) -> str:
        return f"pipeline {self.pipeline} x data {self.data} x tensor {self.tensor}"


def resolve_mesh_sizes(
    world_size: int, *, pipeline: int | None = 1, data: int | None = None, tensor: int | None = 1
) -> MeshSizes:
    """Fill in the one size left ``None`` (at most one) and check the product is ``world_size``."""
    given = {"pipeline_parallel_size": pipeline, "data_parallel_size": data,
             "tensor_parallel_size": tensor}
    missing = [key for key, size in given.items() if size is None]
    if len(missing) > 1:
        raise ValueError(f"strategy.{missing[0]} and strategy.{missing[1]} are both null; "
                         "set all but one mesh size")
    known = math.prod(size for size in given.values() if size is not None)
    shown = " x ".join(f"strategy.{key}={size}" for key, size in given.items() if size is not None)
    if missing:
        if world_size % known:
            raise ValueError(f"{shown} = {known} does not divide the world size ({world_size}); "
                             f"allowed: sizes whose product divides {world_size}")
        given[missing[0]] = world_size // known
    elif known != world_size:
        raise ValueError(f"{shown} = {known} but the world size is {world_size} "
                         "(trainer.devices x trainer.num_nodes); the product must equal it")
    return MeshSizes(pipeline=given["pipeline_parallel_size"], data=given["data_parallel_size"],
                     tensor=given["tensor_parallel_size"])


def check_tensor_parallel_fits(net: nn.Module, tensor_parallel_size: int) -> None:
    """Heads, hidden sizes (and the vocabulary, which the embedding splits) divide by the TP size."""
    if tensor_parallel_size == 1:
        return
    config = getattr(net, "config", None)
    for field in ("n_head", "n_embd", "vocab_size"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tensor_parallel_size:
            raise ValueError(
                f"strategy.tensor_parallel_size={tensor_parallel_size} does not divide "
                f"model.net.{field}={value}; allowed: a divisor of {value}")


def check_enough_blocks(num_blocks: int, num_stages: int, *, pipeline_parallel_size: int) -> None:
    if num_blocks < num_stages:
        raise ValueError(
            f"strategy.pipeline_parallel_size={pipeline_parallel_size} needs {num_stages} pipeline "
            f"stages but the model declares only {num_blocks} blocks to cut between; allowed: "
            f"at most {num_blocks} stages (pipeline_parallel_size x virtual_stages)")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _values_and_copies(grad: torch.Tensor, ranks_per_stage: int) -> tuple[torch.Tensor, int]:
    """This rank's gradient values and on how many ranks of the world the same values live:
    the replicated dimensions of its mesh, times the ranks of this pipeline stage that its
    mesh leaves out (e.g. FSDP shards a parameter that TP left plain on the data dimension
    only: the tensor-parallel ranks hold copies). A plain tensor lives on every stage rank.

    A DTensor gradient may be partial (a sum still to be taken over a mesh dimension, e.g. a
    sequence-parallel norm's): it is reduced first, as the norm of a sum is not a sum of norms.
    """
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(grad, DTensor):
        return grad, ranks_per_stage
    if any(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    mesh = grad.device_mesh
    copies = math.prod(mesh.size(d) for d, p in enumerate(grad.placements) if isinstance(p, Replicate))
    return grad.to_local(), copies * (ranks_per_stage // mesh.size())


def clip_grad_norm_across_mesh(
    parameters: Iterable[torch.Tensor], max_norm: float, *, ranks_per_stage: int
) -> torch.Tensor:
    """Clip gradients by their global 2-norm when parameters are split across ranks.

    Written by hand because ``torch.nn.utils.clip_grad_norm_`` sees only this rank's
    parameters: with pipeline stages each rank holds different layers, and it cannot mix
    DTensor with plain tensors. Each rank sums its local squares, weighted by 1 / (number of
    ranks holding the same values), and one all-reduce over the world gives the total.
    ``ranks_per_stage``: world size / pipeline size (data x tensor parallel).
    """
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    device = _local(grads[0]).device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        values, copies = _values_and_copies(grad.detach(), ranks_per_stage)
        total += values.double().pow(2).sum() / copies
    if dist.is_initialized():
        dist.all_reduce(total)
    norm = total.sqrt().float()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:  # scaling is linear, so a partial gradient is scaled as it is
        _local(grad).detach().mul_(scale.to(grad.dtype))
    return norm
