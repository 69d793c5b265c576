"""Fully sharded data parallel on FSDP2 (``torch.distributed.fsdp.fully_shard``), CPU and CUDA.

Lightning's ``FSDPStrategy`` wraps FSDP1 and refuses CPU; its ``ModelParallelStrategy``
drives FSDP2 and saves sharded checkpoints through ``torch.distributed.checkpoint`` (DCP)
on any backend, but leaves the sharding to the user's ``configure_model``. This strategy
subclasses the latter and does the sharding itself, from what the model declares
(``sharding_units()``) or module-name patterns. Because DCP checkpoints hold DTensor shards
with their global shapes, a run saved on N ranks resumes on M ranks.

``apply_fsdp`` is the reusable part (torchtitan style): it shards a module on a given mesh,
so a 2D/3D strategy can apply it to the data-parallel dimension of its own mesh
(``fsdp_options`` and ``shard_units`` are its steps, for a strategy that picks its own roots).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.constraints import PositiveInt
from litscale.contract import NO_SHARDED_LOSS_SCALER, Option, StrategyContract
from litscale.declarations import declared, name_matches
from litscale.layout import CONTEXT, MeshAxis
from litscale.lightning_private import materialize_distributed_module
from litscale.precision import PrecisionDtypes
from litscale.sharding import Sharding, fsdp2_sharding
from litscale.strategies.context_parallel import (
    check_context_parallel_fits,
    check_sequence_splits,
    shard_batch,
)
from litscale.strategies.expert_parallel import check_expert_parallel_fits
from litscale.strategies.mesh import (
    MeshSizes,
    ShapeAndNames,
    clip_by_norm_across_mesh,
    is_parallelized,
    sampler_kwargs,
    setup_parallel_module,
    start_mesh,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

NO_UNITS_WARNING = (
    "litscale FSDP: the model declares no sharding units, so it is sharded as one unit (all "
    "parameters are gathered at once, which saves no peak memory). Declare units with a "
    "`sharding_units(self) -> list[nn.Module]` method on the LightningModule or its `net` "
    "(e.g. returning the transformer blocks), or pass strategy.sharding_units=['net.blocks.*']"
)


def mixed_precision_policy(dtypes: PrecisionDtypes | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for the ``precision`` group: parameters are gathered in the compute
    dtype and gradients reduced in the reduce dtype; the sharded (optimizer-facing)
    parameters keep the storage dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtypes is None or (dtypes.compute == dtypes.param and dtypes.reduce == dtypes.param):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtypes.compute, reduce_dtype=dtypes.reduce)


def find_sharding_units(module: nn.Module, patterns: Sequence[str] | None = None) -> list[nn.Module]:
    """The submodules to shard one by one: from ``patterns`` if given, else what ``module``
    or its ``net`` declares as ``sharding_units``; ``[]`` (with a warning) if neither."""
    if patterns:
        units = [m for name, m in module.named_modules() if any(name_matches(name, p) for p in patterns)]
        if not units:
            raise ValueError(f"strategy.sharding_units={list(patterns)} matches no submodule of the model")
        return units
    found = declared(module, "sharding_units")
    if found is not None:
        return list(found[1])
    warnings.warn(NO_UNITS_WARNING, stacklevel=2)
    return []


def _roots(module: nn.Module) -> list[nn.Module]:
    """The modules whose forward runs each step and that own the remaining parameters: ``net``
    for litscale modules, else each direct child holding parameters (a LightningModule's own
    forward is not what Lightning calls, so it cannot be FSDP's root)."""
    net = getattr(module, "net", None)
    if isinstance(net, nn.Module) and not any(True for _ in module.parameters(recurse=False)):
        owned = {id(p) for p in net.parameters()}
        if all(id(p) in owned for p in module.parameters()):
            return [net]
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"{type(module).__name__} holds parameters directly; FSDP shards submodules, so move "
            "them into a submodule (e.g. self.net)")
    return [child for child in module.children() if any(True for _ in child.parameters())]


def fsdp_options(mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
                 cpu_offload: bool = False) -> dict[str, Any]:
    """``fully_shard`` keyword arguments shared by every FSDP group on ``mesh``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return {
        "mesh": mesh,
        "mp_policy": mp_policy or mixed_precision_policy(None),
        "offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload
        else OffloadPolicy(),
    }


def shard_units(units: Sequence[nn.Module], *, reshard_after_forward: bool,
                activation_checkpointing: bool = False, **options: Any) -> None:
    """Make each unit its own FSDP group (gathered just before its forward and, with
    ``reshard_after_forward``, freed after it: ZeRO-3; without, kept until backward: ZeRO-2).
    Activation checkpointing, applied per unit first, recomputes a unit's activations in backward."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        if activation_checkpointing:
            checkpoint(unit)  # composable: parameter names (and checkpoint keys) stay the same
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **options)


def apply_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    units: Sequence[nn.Module] = (),
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
) -> None:
    """Shard ``module`` in place with FSDP2 on ``mesh`` (1D: shard; 2D: replicate x shard).

    Each of ``units`` becomes its own FSDP group (``shard_units``); the roots (``net``, or the
    children holding parameters) take the rest.
    """
    from torch.distributed.fsdp import fully_shard

    options = fsdp_options(mesh, mp_policy=mp_policy, cpu_offload=cpu_offload)
    shard_units(units, reshard_after_forward=reshard_after_forward,
                activation_checkpointing=activation_checkpointing, **options)
    for root in _roots(module):
        # NOTE: a root is resharded after forward only when it is not the last to run; keeping
        # it gathered (False) avoids an all-gather at the start of backward, as torchtitan does.
        fully_shard(root, reshard_after_forward=False if units else reshard_after_forward, **options)


class _NoAutocast(MixedPrecision):
    """Lightning's mixed precision without autocast: FSDP's policy already runs the forward in
    the compute dtype, and autocast on top would re-cast every op's inputs (twice the casts,
    and fp32 weights gathered for nothing on CPU). The gradient scaler (fp16) stays."""

    @override
    def forward_context(self):
        return nullcontext()


def fsdp_mesh_layout(sizes: MeshSizes) -> ShapeAndNames:
    """FSDP's mesh: ``shard``, or ``replicate x shard`` (HSDP) with replicas; ``x context``
    where the sequence is split."""
    shape, names = (sizes.data_shard,), (MeshAxis.SHARD,)
    if sizes.data_replicate > 1:
        shape, names = (sizes.data_replicate, *shape), (MeshAxis.REPLICATE, *names)
    if sizes.context > 1:
        shape, names = (*shape, sizes.context), (*names, CONTEXT)
    return shape, names


class FSDPStrategy(StrategyContract, ModelParallelStrategy):
    """FSDP2 as a Lightning strategy: sharding units from the model, mixed precision from the
    ``precision`` group, DCP sharded checkpoints that resume at any world size.

    Works in any Lightning script: ``Trainer(strategy=FSDPStrategy(), accelerator="cpu",
    devices=2)`` or ``Trainer(strategy="litscale_fsdp")``.
    """

    refuses = {Option.FP16_MIXED: NO_SHARDED_LOSS_SCALER}
    phase_collectives = {"forward": "parameter all-gather", "backward": "all-gather / gradient reduce-scatter"}
    mesh_layout = staticmethod(fsdp_mesh_layout)

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
        found = [({"context_parallel_size": size}, MeshSizes(data_shard=world_size // size, context=size))
                 for size in context_sizes if world_size % size == 0]
        if nodes > 1:
            found.append(({"replicate_size": nodes}, MeshSizes(data_replicate=nodes, data_shard=world_size // nodes)))
        return found

    def resolve_mesh(self, world_size: int) -> MeshSizes:
        """``replicate_size`` replicas of ``world_size / (replicate_size x context_parallel_size)``
        shards, each sample's sequence split over ``context_parallel_size`` ranks."""
        for key, size in (("replicate_size", self.replicate_size),
                          ("context_parallel_size", self.context_parallel_size),
                          ("replicate_size x context_parallel_size", self.replicate_size * self.context_parallel_size)):
            if world_size % size:
                raise ValueError(f"strategy.{key}={size} must divide the world size ({world_size}); "
                                 f"allowed: a divisor of {world_size}")
        return MeshSizes(data_replicate=self.replicate_size, context=self.context_parallel_size,
                         data_shard=world_size // (self.replicate_size * self.context_parallel_size),
                         expert=self.expert_parallel_size)

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

    @property
    def sharding(self) -> Sharding:
        """Parameters, gradients and optimizer state are all sharded (ZeRO-3's memory); without
        resharding after forward, the units stay gathered until backward."""
        return fsdp2_sharding(reshard_after_forward=self.reshard_after_forward)

    @override
    def setup_environment(self) -> None:
        start_mesh(self, self.mesh_layout)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return sampler_kwargs(self.resolve_mesh(self.world_size), self.global_rank)

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return shard_batch(batch, self.device_mesh[CONTEXT]) if self.context_parallel_size > 1 else batch

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
            clip_by_norm_across_mesh(self.precision_plugin, self.resolve_mesh(self.world_size))

    def split(self, module: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
        """Shard ``module`` (the LightningModule) on ``mesh`` (laid out by ``mesh_layout``) as
        this strategy does; its parameters stay where they are (the meta device, in a dry run).
        Returns the modules this rank runs besides ``module``: none."""
        # NOTE: imported here: the parallelize function builds on this module's apply_fsdp.
        from litscale.strategies.parallelize import ParallelOptions, parallelize

        data = (MeshAxis.REPLICATE, MeshAxis.SHARD) if self.replicate_size > 1 else (MeshAxis.SHARD,)
        parallelize(module, mesh, self.resolve_mesh(mesh.size()), data, ParallelOptions(
            sharding_units=self.sharding_unit_patterns, reshard_after_forward=self.reshard_after_forward,
            mp_policy=mixed_precision_policy(self.precision_dtypes), cpu_offload=self.cpu_offload,
            activation_checkpointing=self.activation_checkpointing, shard_single_rank=True))
        return []

    @property
    def offloads(self) -> bool:
        """Parameters and optimizer state on the CPU (``cpu_offload``, CUDA runs only)."""
        return self.cpu_offload and self.root_device.type == "cuda"

    def _shard(self, module: nn.Module) -> None:
        self.split(module, self.device_mesh)
        # after meta-device init; an offloaded shard lives on the CPU
        materialize_distributed_module(module, torch.device("cpu") if self.offloads else self.root_device)
