"""Fully sharded data parallel on FSDP2 (``torch.distributed.fsdp.fully_shard``), CPU and CUDA.

Lightning's ``FSDPStrategy`` wraps FSDP1 and refuses CPU; its ``ModelParallelStrategy``
drives FSDP2 and saves sharded checkpoints through ``torch.distributed.checkpoint`` (DCP)
on any backend, but leaves the sharding to the user's ``configure_model``. This strategy
subclasses the latter and does the sharding itself, from what the model declares
(``sharding_units()``) or module-name patterns. Because DCP checkpoints hold DTensor shards
with their global shapes, a run saved on N ranks resumes on M ranks.

The reusable part (torchtitan style) is ``fully_shard.apply_fsdp``, which shards a module on
a given mesh, and the one parallelize function (``parallelize.py``) that orders it after
tensor, context and expert parallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.constraints import PositiveInt
from litscale.lightning_private import materialize_distributed_module
from litscale.parallel.contract import NO_SHARDED_LOSS_SCALER, Option
from litscale.parallel.gradient_norm import clip_by_norm_across_mesh
from litscale.parallel.layout import MeshSizes, data_shards_left
from litscale.precision import PrecisionDtypes
from litscale.strategies.context_parallel import check_context_parallel_fits, check_sequence_splits
from litscale.strategies.expert_parallel import check_expert_parallel_fits
from litscale.strategies.fully_shard import find_sharding_units, mixed_precision_policy
from litscale.strategies.mesh_strategy import MeshStrategy, is_parallelized, setup_parallel_module
from litscale.strategies.parallelize import ParallelOptions, parallelize

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from litscale.parallel.mesh import ParallelMesh


class _NoAutocast(MixedPrecision):
    """Lightning's mixed precision without autocast: FSDP's policy already runs the forward in
    the compute dtype, and autocast on top would re-cast every op's inputs (twice the casts,
    and fp32 weights gathered for nothing on CPU). The gradient scaler (fp16) stays."""

    @override
    def forward_context(self):
        return nullcontext()


class FSDPStrategy(MeshStrategy):
    """FSDP2 as a Lightning strategy: sharding units from the model, mixed precision from the
    ``precision`` group, DCP sharded checkpoints that resume at any world size.

    Works in any Lightning script: ``Trainer(strategy=FSDPStrategy(), accelerator="cpu",
    devices=2)`` or ``Trainer(strategy="litscale_fsdp")``.
    """

    refuses = {Option.FP16_MIXED: NO_SHARDED_LOSS_SCALER}
    # Replica groups of FSDP (or HSDP) form an outer replicate axis: each rank's gradient shards,
    # reduced within its group, are averaged with the same rank's in the other groups.
    averages_across_replica_groups = True
    phase_collectives = {"forward": "parameter all-gather", "backward": "all-gather / gradient reduce-scatter"}

    @checked_arguments("strategy")
    def __init__(
        self,
        *,
        precision_dtypes: PrecisionDtypes | None = None,
        sharding_units: list[str] | None = None,
        reshard_after_forward: bool = True,
        replicate_size: PositiveInt = 1,
        context_parallel_size: PositiveInt = 1,
        expert_parallel_size: PositiveInt = 1,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: PositiveInt = 1800,
    ) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timedelta(seconds=timeout_s))
        self.precision_dtypes = precision_dtypes
        self.sharding_unit_patterns = sharding_units
        self.reshard_after_forward = reshard_after_forward
        self.replicate_size = replicate_size
        self.context_parallel_size = context_parallel_size
        self.expert_parallel_size = expert_parallel_size
        self.cpu_offload = cpu_offload
        self.activation_checkpointing = activation_checkpointing

    @classmethod
    def candidate_meshes(cls, *, world_size: int, nodes: int, devices_per_node: int,
                         context_sizes: Sequence[int]) -> list[tuple[dict[str, Any], MeshSizes]]:
        """Every rank a shard, each sequence split over each of ``context_sizes`` that divides
        the world; across nodes, also HSDP: a replica per node, sharded within it (the planner's
        layouts)."""
        found = [({"context_parallel_size": size}, mesh) for size in context_sizes
                 if (mesh := MeshSizes.with_data_rest(world_size, context=size))]
        if nodes > 1:
            found.append(({"replicate_size": nodes}, MeshSizes.with_data_rest(world_size, data_replicate=nodes)))
        return found

    def resolve_mesh(self, world_size: int) -> MeshSizes:
        """``replicate_size`` replicas of ``world_size / (replicate_size x context_parallel_size)``
        shards, each sample's sequence split over ``context_parallel_size`` ranks."""
        shards = data_shards_left(world_size, replicate_size=self.replicate_size,
                                  context_parallel_size=self.context_parallel_size)
        return MeshSizes(data_replicate=self.replicate_size, context=self.context_parallel_size,
                         data_shard=shards, expert=self.expert_parallel_size)

    def validate_setup(self, *, world_size: int, net: nn.Module, seq_len: int | None = None,
                       micro_batch: int | None = None) -> None:
        """Pre-flight: the replicate x shard mesh must tile the world, the experts split over the
        expert-parallel ranks, and unit patterns must match modules of the LightningModule
        (whose network is ``net``)."""
        self.resolve_mesh(world_size)
        check_context_parallel_fits(net, self.context_parallel_size)
        check_sequence_splits(seq_len, self.context_parallel_size)
        check_expert_parallel_fits(net, self.expert_parallel_size, self.context_parallel_size)
        if self.sharding_unit_patterns:
            find_sharding_units(nn.ModuleDict({"net": net}), self.sharding_unit_patterns)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if type(self.precision_plugin) is MixedPrecision:
            plugin = self.precision_plugin
            self.precision_plugin = _NoAutocast(plugin.precision, plugin.device, plugin.scaler)
        setup_parallel_module(self, trainer, self._shard, parallelized=is_parallelized(self.model),
                              offloads=self.offloads)
        if self.expert_parallel_size > 1:
            # The experts' gradients live on the expert mesh, the others on FSDP's: torch's
            # clip_grad_norm_ cannot stack norms of two meshes.
            clip_by_norm_across_mesh(self.precision_plugin, self.mesh_sizes)

    def split(self, module: nn.Module, mesh: ParallelMesh) -> list[nn.Module]:
        """Shard ``module`` (the LightningModule) on ``mesh`` as this strategy does; its
        parameters stay where they are (the meta device, in a dry run). Returns the modules this
        rank runs besides ``module``: none."""
        return parallelize(module, mesh, ParallelOptions(
            sharding_units=self.sharding_unit_patterns, reshard_after_forward=self.reshard_after_forward,
            mp_policy=mixed_precision_policy(self.precision_dtypes), cpu_offload=self.cpu_offload,
            activation_checkpointing=self.activation_checkpointing, shard_single_rank=True))

    @property
    def offloads(self) -> bool:
        """Parameters and optimizer state on the CPU (``cpu_offload``, CUDA runs only)."""
        return self.cpu_offload and self.root_device.type == "cuda"

    def _shard(self, module: nn.Module) -> None:
        self.split(module, self.parallel_mesh)
        # after meta-device init; an offloaded shard lives on the CPU
        materialize_distributed_module(module, torch.device("cpu") if self.offloads else self.root_device)
