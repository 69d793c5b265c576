"""One parallelize function, in torchtitan's order: tensor parallel -> context parallel ->
expert parallel -> (the pipeline's cut) -> activation checkpointing -> FSDP2.

The FSDP, tensor-parallel and pipeline strategies all call it, on a LightningModule (its
declarations: a tensor-parallel plan, attention that splits its sequence, expert modules,
sharding units) and one ``ParallelMesh``, so the order is written once. The pipeline hands in
its cut (``keep_stages``): the tensor-parallel plan goes on the whole model, so that its
patterns all match, then only this rank's stages are kept, and each is sharded with the stage
itself as FSDP's root (the schedule calls the stage).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from litscale.parallel.layout import CONTEXT, TENSOR, MeshAxis
from litscale.strategies.context_parallel import apply_context_parallel
from litscale.strategies.expert_parallel import apply_expert_parallel
from litscale.strategies.fully_shard import apply_fsdp, find_sharding_units, shard_stage
from litscale.strategies.tensor_plan import apply_declared_plan

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from litscale.parallel.mesh import ParallelMesh


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


def parallelize(module: nn.Module, mesh: ParallelMesh, options: ParallelOptions, *,
                keep_stages: Callable[[nn.Module], list[nn.Module]] | None = None) -> list[nn.Module]:
    """Split ``module`` in place on ``mesh``; with ``keep_stages`` (the pipeline's cut of the
    model into this rank's stages), shard each stage it keeps and return them ([] otherwise)."""
    sizes = mesh.sizes
    if sizes.tensor > 1:
        apply_declared_plan(module, mesh.get(TENSOR), options.tensor_plan,
                            sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel)
    if sizes.context > 1:
        apply_context_parallel(module, mesh.get(CONTEXT))
    if sizes.expert > 1:
        apply_expert_parallel(module, mesh.get(MeshAxis.EXPERT), mesh.get(MeshAxis.EXPERT_DATA),
                              divide_factor=sizes.expert_borrowed, reshard_after_forward=options.reshard_after_forward,
                              mp_policy=options.mp_policy)
    stages = keep_stages(module) if keep_stages is not None else []
    data_mesh = _data_mesh(mesh)
    if data_mesh.size() == 1 and not options.shard_single_rank:
        return stages
    # activation checkpointing is applied per sharding unit, inside FSDP's wrapping
    if keep_stages is not None:
        for stage in stages:
            shard_stage(stage, data_mesh, reshard_after_forward=options.reshard_after_forward,
                        mp_policy=options.mp_policy)
        return stages
    apply_fsdp(module, data_mesh, units=find_sharding_units(module, options.sharding_units),
               reshard_after_forward=options.reshard_after_forward, mp_policy=options.mp_policy,
               cpu_offload=options.cpu_offload and data_mesh.device_type == "cuda",
               activation_checkpointing=options.activation_checkpointing)
    return stages


def _data_mesh(mesh: ParallelMesh) -> DeviceMesh:
    """The mesh FSDP2 is given: the shard x context ranks, with the replicas as its outer
    dimension where there are some (HSDP)."""
    if mesh.sizes.data_replicate > 1:
        return mesh.get(MeshAxis.REPLICATE, MeshAxis.FSDP)
    return mesh.get(MeshAxis.FSDP)
