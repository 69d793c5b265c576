"""Gradients split across ranks (DTensor shards, pipeline stages): their partial sums taken,
their global norm, and clipping by it, the same on every rank.

What the mesh strategies (``strategies/mesh_strategy.py``) run around Lightning's optimizer
step and clipping, and what the LightningModule logs as ``train/grad_norm`` on every layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from litscale.parallel.layout import MeshSizes

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision


def _summed(grad: torch.Tensor) -> torch.Tensor:
    """A partial DTensor gradient (a sum still to be taken over a mesh dimension, e.g. a
    sequence-parallel norm's) with the sum taken; any other gradient as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    return grad


def sum_partial_gradients_after(closure: Callable[[], object], module: nn.Module) -> Callable[[], object]:
    """``closure`` (Lightning's forward-backward of a stepping batch), then each partial
    gradient of ``module`` summed once, before clipping and the optimizer read it.

    NOTE: left partial, every optimizer op on such a gradient sums it again: AdamW's step
    all-reduced each sequence-parallel norm gradient 3 times (tests/test_planner_collectives.py).
    """

    def closure_then_sum() -> object:
        loss = closure()
        for param in module.parameters():
            if param.grad is not None:
                param.grad = _summed(param.grad)
        return loss

    return closure_then_sum


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
    grad = _summed(grad)
    mesh = grad.device_mesh
    copies = math.prod(mesh.size(d) for d, p in enumerate(grad.placements) if isinstance(p, Replicate))
    return grad.to_local(), copies * (ranks_per_stage // mesh.size())


def gradient_norm_across_mesh(parameters: Iterable[torch.Tensor], *, ranks_per_stage: int) -> torch.Tensor:
    """The global 2-norm of the gradients of ``parameters`` when they are split across ranks
    (DTensor shards, pipeline stages): the same number on every rank. A collective.

    NOTE: the norm is summed by hand: ``torch.nn.utils.get_total_norm`` (and so
    ``clip_grad_norm_``) raises on a mix of DTensor and plain gradients (tensor parallel leaves
    the parameters its plan does not name plain, e.g. GPT's position embedding), and sees only
    this rank's pipeline stage (``tests/test_torch_apis.py`` shows both). Here each rank sums
    its local squares, weighted by 1 / (number of ranks holding the same values), and one
    all-reduce over the world gives the total. ``ranks_per_stage``: world size / pipeline size
    (data x tensor parallel).
    """
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for grad in grads:
        values, copies = _values_and_copies(grad.detach(), ranks_per_stage)
        total += values.double().pow(2).sum() / copies
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.sqrt().float()


def clip_grad_norm_across_mesh(
    parameters: Iterable[torch.Tensor], max_norm: float, *, ranks_per_stage: int
) -> torch.Tensor:
    """Clip gradients by their global 2-norm (``gradient_norm_across_mesh``) when parameters
    are split across ranks. The scaling is torch's ``clip_grads_with_norm_``."""
    parameters = list(parameters)
    norm = gradient_norm_across_mesh(parameters, ranks_per_stage=ranks_per_stage)
    # NOTE: foreach=False: torch's foreach path cannot mix DTensor and plain gradients either.
    # One by one, a partial DTensor gradient is scaled as it is (scaling is linear).
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=False)
    return norm


def global_gradient_norm(parameters: Iterable[torch.Tensor], *, sizes: MeshSizes) -> torch.Tensor:
    """The 2-norm of the whole gradient of ``parameters`` on a mesh of ``sizes``, before any
    clipping: across the mesh where a rank holds part of it (DTensor shards, a pipeline stage),
    else this rank's own (a replicated gradient is whole on every rank: no collective)."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    if sizes.pipeline > 1 or any(isinstance(p.grad, DTensor) for p in parameters):
        return gradient_norm_across_mesh(parameters, ranks_per_stage=sizes.stage_ranks)
    # as torch's clip_grad_norm_ takes it: each gradient's norm (in float32 at least), then theirs
    norms = [torch.linalg.vector_norm(p.grad.detach(), dtype=torch.promote_types(p.grad.dtype, torch.float32))
             for p in parameters]
    return torch.linalg.vector_norm(torch.stack(norms)).float() if norms else torch.zeros(())


def clip_by_norm_across_mesh(plugin: Precision, sizes: MeshSizes) -> None:
    """Route Lightning's ``gradient_clip_val`` (by norm) through ``clip_grad_norm_across_mesh``:
    the precision plugin's own clipping calls torch's ``clip_grad_norm_``."""
    ranks_per_stage = sizes.stage_ranks

    def clip_grad_by_norm(optimizer, clip_val) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_across_mesh(parameters, float(clip_val), ranks_per_stage=ranks_per_stage)

    plugin.clip_grad_by_norm = clip_grad_by_norm
