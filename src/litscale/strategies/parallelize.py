"""One parallelize function, in torchtitan's order: tensor parallel -> context parallel ->
expert parallel -> activation checkpointing -> FSDP2.

The FSDP and tensor-parallel strategies both call it on a LightningModule (its declarations:
a tensor-parallel plan, attention that splits its sequence, expert modules, sharding units),
so the order is written once. The pipeline strategy applies the same tensor-parallel plan to
the whole model before it keeps its stages, then shards each stage with the stage itself as
FSDP's root (``PipelineParallelStrategy._shard_stage``): its roots differ, not its order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from litscale.parallel.layout import CONTEXT, TENSOR, MeshSizes
from litscale.strategies.context_parallel import apply_context_parallel, data_context_mesh
from litscale.strategies.expert_parallel import apply_expert_parallel
from litscale.strategies.fully_shard import apply_fsdp, find_sharding_units
from litscale.strategies.tensor_plan import apply_declared_plan

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass(frozen=True)
class ParallelOptions:
    """What a strategy's options decide about the split, beside the mesh sizes."""

    tensor_plan: dict[str, str] | None = None  # None: the model's own declared plan
    sequence_parallel: bool = True
    loss_parallel: bool = False
    sharding_units: list[str] | None = None  # None: the model's own declared units
    reshard_after_forward: bool = True
    mp_policy: MixedPrecisionPolicy | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    # FSDP2 even on one data rank (the FSDP strategy: DTensor parameters and sharded
    # checkpoints at any world size); otherwise only where there are data ranks to shard over.
    shard_single_rank: bool = False


def parallelize(module: nn.Module, mesh: DeviceMesh, sizes: MeshSizes, data_dims: tuple[str, ...],
                options: ParallelOptions) -> None:
    """Split ``module`` in place on ``mesh`` (``sizes``' mesh; ``data_dims`` its data
    dimensions, outermost first: ``(replicate, shard)`` for HSDP)."""
    if sizes.tensor > 1:
        apply_declared_plan(module, mesh[TENSOR], options.tensor_plan,
                            sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel)
    data_mesh = mesh[data_dims]
    if sizes.context > 1:
        apply_context_parallel(module, mesh[CONTEXT])
        data_mesh = data_context_mesh(mesh, data_dims, CONTEXT)
    apply_expert_parallel(module, data_mesh, expert_parallel_size=sizes.expert,
                          borrowed_dims=tuple(data_mesh.mesh_dim_names),
                          reshard_after_forward=options.reshard_after_forward, mp_policy=options.mp_policy)
    if data_mesh.size() > 1 or options.shard_single_rank:
        # activation checkpointing is applied per sharding unit, inside FSDP's wrapping
        apply_fsdp(module, data_mesh, units=find_sharding_units(module, options.sharding_units),
                   reshard_after_forward=options.reshard_after_forward, mp_policy=options.mp_policy,
                   cpu_offload=options.cpu_offload and data_mesh.device_type == "cuda",
                   activation_checkpointing=options.activation_checkpointing)
