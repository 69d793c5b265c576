"""What the FSDP, tensor-parallel and pipeline strategies share, written once: their mesh
(one ``ParallelMesh``, built when the process group starts), the sampler's arguments from it,
each batch's sequence split over the context ranks, partial gradients summed before the
optimizer reads them, and the ``setup`` body with the strategy's own split in place of the
user's ``configure_model``.

They are siblings on Lightning's ``ModelParallelStrategy``, which drives FSDP2 and DTensor and
saves sharded checkpoints through ``torch.distributed.checkpoint``; each says only how it lays
the world out (``resolve_mesh``) and how it splits a model on the mesh (``split``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from litscale.checkpoint.strategy_checkpointing import StrategyCheckpointing
from litscale.lightning_private import optimizers_to_device
from litscale.parallel.contract import StrategyContract
from litscale.parallel.gradient_norm import sum_partial_gradients_after
from litscale.parallel.layout import CONTEXT, MeshSizes
from litscale.parallel.mesh import ParallelMesh
from litscale.parallel.sharding import Sharding, fsdp2_sharding
from litscale.strategies.lifecycle import destroy_process_group_at_exit

if TYPE_CHECKING:
    import lightning.pytorch as pl


class MeshStrategy(StrategyContract, StrategyCheckpointing, ModelParallelStrategy):
    """A strategy that lays its ranks out on one device mesh; subclasses give ``resolve_mesh``
    and ``split(module, mesh)``."""

    parallel_mesh: ParallelMesh | None = None

    def split(self, module: nn.Module, mesh: ParallelMesh) -> list[nn.Module]:
        """Split ``module`` (the LightningModule) on ``mesh`` as this strategy does; return the
        modules this rank runs besides ``module`` (a pipeline's stages)."""
        raise NotImplementedError

    @property
    def mesh_sizes(self) -> MeshSizes | None:
        """The sizes of the mesh this rank runs on, once the process group has started."""
        return None if self.parallel_mesh is None else self.parallel_mesh.sizes

    @property
    def sharding(self) -> Sharding:
        """FSDP2 over the data dimension, on each rank's share: parameters, gradients and
        optimizer state all sharded (ZeRO-3's memory); without resharding after forward
        (``reshard_after_forward``, each subclass's argument), the units stay gathered until
        backward."""
        return fsdp2_sharding(reshard_after_forward=self.reshard_after_forward)

    def use_mesh(self, mesh: ParallelMesh) -> None:
        """Run on ``mesh``: what the strategy splits on, and what Lightning's ``device_mesh``
        (and the LightningModule's, e.g. in ``configure_model``) returns. NOTE: ``_device_mesh``
        is Lightning's private attribute behind ``device_mesh``."""
        self.parallel_mesh = mesh
        self._device_mesh = mesh.world
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = mesh.world

    @override
    def setup_environment(self) -> None:
        """Start the process group, then the mesh of ``resolve_mesh(world_size)``. Replaces
        ``ModelParallelStrategy.setup_environment``, which would build Lightning's own data x
        tensor mesh. NOTE: ``_setup_distributed`` (ranks, then the process group) is Lightning's
        private method."""
        self._setup_distributed()
        destroy_process_group_at_exit()
        self.use_mesh(ParallelMesh.build(self.resolve_mesh(self.world_size), self.root_device.type))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Only data-parallel ranks see distinct samples; tensor-, context- and pipeline-parallel
        ranks share a batch. From the sizes, not the mesh, so it also answers before the
        processes start."""
        sizes = self.resolve_mesh(self.world_size)
        return {"num_replicas": sizes.data, "rank": sizes.data_rank(self.global_rank)}

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        """The batch on the device, each sample's sequence cut to this rank's share where the
        context ranks split it (every context-parallel peer loads the same batch)."""
        from litscale.strategies.context_parallel import shard_batch

        batch = super().batch_to_device(batch, device, dataloader_idx)
        return shard_batch(batch, self.parallel_mesh.get(CONTEXT)) if self.mesh_sizes.context > 1 else batch

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, with each partial gradient (a sequence-parallel norm's, under tensor
        parallel) summed once before clipping and the optimizer read it."""
        if self.mesh_sizes.tensor > 1:
            closure = sum_partial_gradients_after(closure, self.model)
        return super().optimizer_step(optimizer, closure, model, **kwargs)


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
