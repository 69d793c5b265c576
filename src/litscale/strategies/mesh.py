"""The device mesh of a strategy: its sizes, their validation, and what every mesh strategy
shares (starting the mesh, the ``setup`` body, sampler arguments, clipping across the mesh).

One place decides how ``world_size`` ranks split into pipeline x data x tensor parallel
(torchtitan's ``ParallelDims``), the data dimension itself into replicas x shards, and checks
that the model fits the split. Every check raises ``ValueError`` with one line naming the
``strategy.<key>``, so the pre-flight check (``validate_setup``) reports it before any process
group exists. Every strategy answers ``resolve_mesh(world_size) -> MeshSizes`` without one.

The FSDP, tensor-parallel and pipeline strategies are siblings on Lightning's
``ModelParallelStrategy``; the helpers below are the parts they have in common.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from litscale.lightning_private import optimizers_to_device
from litscale.parallel.declarations import declared
from litscale.parallel.layout import CONTEXT, DATA, PIPELINE, TENSOR, MeshSizes
from litscale.strategies.lifecycle import destroy_process_group_at_exit

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ModelParallelStrategy

# The sizes and the dimension names live with the run layout (litscale.parallel.layout), which the app
# computes before any strategy runs; the strategies share them from there.
__all__ = ["CONTEXT", "DATA", "PIPELINE", "TENSOR", "MeshSizes"]

ShapeAndNames = tuple[tuple[int, ...], tuple[str, ...]]


def resolve_mesh_sizes(
    world_size: int, *, pipeline: int | None = 1, data: int | None = None, tensor: int | None = 1,
    context: int = 1,
) -> MeshSizes:
    """Fill in the one size left ``None`` (at most one) and check the product is ``world_size``."""
    given = {"pipeline_parallel_size": pipeline, "data_parallel_size": data,
             **({"context_parallel_size": context} if context > 1 else {}), "tensor_parallel_size": tensor}
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
    return MeshSizes(pipeline=given["pipeline_parallel_size"], data_shard=given["data_parallel_size"],
                     tensor=given["tensor_parallel_size"], context=context)


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


# --- what the mesh strategies share ------------------------------------------------------------

def start_mesh(strategy: ModelParallelStrategy,
               shape_and_names: Callable[[MeshSizes], ShapeAndNames] = MeshSizes.shape_and_names) -> MeshSizes:
    """Start the process group, then build the strategy's device mesh from its
    ``resolve_mesh(world_size)`` (laid out by ``shape_and_names``); returns the sizes.

    Replaces ``ModelParallelStrategy.setup_environment``, which would build Lightning's own
    data x tensor mesh. NOTE: ``_setup_distributed`` (ranks, then the process group) and
    ``_device_mesh`` (what ``device_mesh`` returns) are Lightning's private method and attribute.
    """
    from torch.distributed.device_mesh import init_device_mesh

    strategy._setup_distributed()
    destroy_process_group_at_exit()
    sizes = strategy.resolve_mesh(strategy.world_size)
    shape, names = shape_and_names(sizes)
    strategy._device_mesh = init_device_mesh(strategy.root_device.type, shape, mesh_dim_names=names)
    # As with Lightning's strategy, the LightningModule reaches the mesh (e.g. in configure_model).
    strategy.lightning_module._device_mesh = strategy._device_mesh
    return sizes


def sampler_kwargs(sizes: MeshSizes, global_rank: int) -> dict[str, int]:
    """``DistributedSampler`` arguments: only data-parallel ranks see distinct samples; tensor-,
    context- and pipeline-parallel ranks share a batch. From the sizes, not the mesh, so it also
    answers before the processes start; every mesh lays ranks out row-major over (pipeline,
    data, context, tensor)."""
    return {"num_replicas": sizes.data, "rank": (global_rank // (sizes.context * sizes.tensor)) % sizes.data}


def is_parallelized(module: nn.Module) -> bool:
    """Whether tensor parallel or FSDP has already split ``module``'s parameters."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def setup_parallel_module(strategy: ModelParallelStrategy, trainer: pl.Trainer,
                          parallelize: Callable[[nn.Module], None], *, parallelized: bool,
                          offloads: bool = False) -> None:
    """``ModelParallelStrategy.setup`` with the strategy's ``parallelize`` in place of the user's
    ``configure_model``. ``parallelized``: ``setup`` runs again for each trainer call (fit, then
    validate or test), and the model is converted and split only the first time. ``offloads``:
    the parameters (and optimizer state) live on the CPU, as FSDP2's CPU offload requires;
    buffers and metrics still go to the device."""
    strategy.accelerator.setup(trainer)
    if not parallelized:
        # bf16-true converts parameters before sharding, so shards are stored in bf16.
        strategy.model = strategy.precision_plugin.convert_module(strategy.model)
        strategy.model.to("cpu" if offloads else strategy.root_device)
        parallelize(strategy.model)
    if offloads:
        move_all_but_parameters(strategy.model, strategy.root_device)
    else:
        strategy.model.to(strategy.root_device)  # buffers and metrics that parallelizing did not move
    strategy.barrier()
    fitting = trainer.state.fn == TrainerFn.FITTING
    if fitting:
        strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    if fitting and not offloads:
        optimizers_to_device(strategy.optimizers, strategy.root_device)


def move_all_but_parameters(module: nn.Module, device: torch.device) -> None:
    """Buffers and torchmetrics states of ``module`` to ``device``, parameters left in place."""
    from torchmetrics import Metric

    for sub in module.modules():
        if isinstance(sub, Metric):
            sub.to(device)
        sub._buffers.update({k: b.to(device) for k, b in sub._buffers.items() if b is not None})


# --- gradient clipping across the mesh ---------------------------------------------------------

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
        return gradient_norm_across_mesh(parameters, ranks_per_stage=sizes.world_size // sizes.pipeline)
    # as torch's clip_grad_norm_ takes it: each gradient's norm (in float32 at least), then theirs
    norms = [torch.linalg.vector_norm(p.grad.detach(), dtype=torch.promote_types(p.grad.dtype, torch.float32))
             for p in parameters]
    return torch.linalg.vector_norm(torch.stack(norms)).float() if norms else torch.zeros(())


def clip_by_norm_across_mesh(plugin: Precision, sizes: MeshSizes) -> None:
    """Route Lightning's ``gradient_clip_val`` (by norm) through ``clip_grad_norm_across_mesh``:
    the precision plugin's own clipping calls torch's ``clip_grad_norm_``."""
    ranks_per_stage = sizes.world_size // sizes.pipeline

    def clip_grad_by_norm(optimizer, clip_val) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_across_mesh(parameters, float(clip_val), ranks_per_stage=ranks_per_stage)

    plugin.clip_grad_by_norm = clip_grad_by_norm
