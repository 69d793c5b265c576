"""Tensor parallel (Megatron-style, on DTensor) with FSDP2 over the remaining ranks (2D).

The split is not written in model code: the model declares a plan, module-name pattern ->
style name (``GPT.tensor_parallel_plan``, see ``litscale/models/gpt_parallel.py``), or the
user passes one (``strategy.plan``), and ``apply_tensor_parallel`` turns each style name
into a ``torch.distributed.tensor.parallel`` style on the tensor-parallel mesh (torchtitan's
``parallelize_llama``, with the plan as data). Ranks beyond the tensor-parallel size form a
data-parallel dimension sharded with FSDP2 (``litscale.strategies.fully_shard.apply_fsdp``).
Checkpoints are DCP directories (Lightning's ``ModelParallelStrategy``), which reshard on
load: a run saved at TP=2 loads at TP=1 or into the plain network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from torch import nn
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.constraints import PositiveInt
from litscale.parallel.contract import NO_SHARDED_LOSS_SCALER, Option
from litscale.parallel.gradient_norm import clip_by_norm_across_mesh
from litscale.parallel.layout import MeshSizes, resolve_mesh_sizes
from litscale.precision import PrecisionDtypes
from litscale.strategies.context_parallel import check_context_parallel_fits, check_sequence_splits
from litscale.strategies.expert_parallel import check_expert_parallel_fits
from litscale.strategies.fully_shard import mixed_precision_policy
from litscale.strategies.mesh_strategy import MeshStrategy, is_parallelized, setup_parallel_module
from litscale.strategies.parallelize import ParallelOptions, parallelize
from litscale.strategies.tensor_plan import StyleName, check_plan, check_tensor_parallel_setup

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from litscale.parallel.mesh import ParallelMesh


class TensorParallelStrategy(MeshStrategy):
    """Tensor parallel x FSDP2 (2D) as a Lightning strategy; the plan comes from the model.

    ``Trainer(strategy=TensorParallelStrategy(tensor_parallel_size=2), accelerator="cpu",
    devices=2)`` or ``Trainer(strategy="litscale_tensor_parallel")`` (TP over all devices).
    ``plan``: module-name pattern (relative to the LightningModule, e.g. ``net.blocks.*.mlp.up``)
    -> style (``STYLES``), instead of the model's ``tensor_parallel_plan``.
    """

    refuses = {Option.FP16_MIXED: NO_SHARDED_LOSS_SCALER,
               Option.LAYOUT_INVARIANT: "tensor and pipeline parallel change the reductions inside a matmul"}
    phase_collectives = {"forward": "tensor-parallel collectives", "backward": "tensor-parallel collectives / gradient reduce-scatter"}

    @checked_arguments("strategy")
    def __init__(
        self,
        *,
        tensor_parallel_size: PositiveInt | None = None,
        data_parallel_size: PositiveInt | None = None,
        context_parallel_size: PositiveInt = 1,
        expert_parallel_size: PositiveInt = 1,
        sequence_parallel: bool = True,
        loss_parallel: bool = False,
        plan: dict[str, StyleName] | None = None,
        precision_dtypes: PrecisionDtypes | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: PositiveInt = 1800,
    ) -> None:
        if plan:
            check_plan(plan)
        if tensor_parallel_size is None and data_parallel_size is None:
            data_parallel_size = 1  # all ranks tensor parallel
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timedelta(seconds=timeout_s))
        self.tensor_parallel_size, self.data_parallel_size = tensor_parallel_size, data_parallel_size
        self.context_parallel_size = context_parallel_size
        self.expert_parallel_size = expert_parallel_size
        self.sequence_parallel, self.loss_parallel = sequence_parallel, loss_parallel
        self.plan, self.precision_dtypes = plan, precision_dtypes
        self.reshard_after_forward = reshard_after_forward

    @classmethod
    def candidate_meshes(cls, *, world_size: int, nodes: int, devices_per_node: int,
                         context_sizes: Sequence[int]) -> list[tuple[dict[str, Any], MeshSizes]]:
        """Each tensor-parallel size above 1 that divides the world, each sequence split of
        ``context_sizes`` that divides the rest, and data parallel over what remains (the
        planner's layouts)."""
        return [({"tensor_parallel_size": tensor, "data_parallel_size": mesh.data_shard, "context_parallel_size": context},
                 mesh)
                for tensor in range(2, world_size + 1) if world_size % tensor == 0
                for context in context_sizes if (mesh := MeshSizes.with_data_rest(world_size, tensor=tensor, context=context))]

    def resolve_mesh(self, world_size: int) -> MeshSizes:
        sizes = resolve_mesh_sizes(world_size, pipeline=1, data=self.data_parallel_size,
                                   tensor=self.tensor_parallel_size, context=self.context_parallel_size)
        return dataclasses.replace(sizes, expert=self.expert_parallel_size)

    def validate_setup(self, *, world_size: int, net: nn.Module, seq_len: int | None = None,
                       micro_batch: int | None = None) -> None:
        """Pre-flight: the mesh tiles the world, the model splits by the TP size, the plan
        exists, the experts split over the expert-parallel ranks."""
        check_tensor_parallel_setup(net, self.resolve_mesh(world_size).tensor, self.plan)
        check_context_parallel_fits(net, self.context_parallel_size)
        check_sequence_splits(seq_len, self.context_parallel_size)
        check_expert_parallel_fits(net, self.expert_parallel_size, self.context_parallel_size)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        setup_parallel_module(self, trainer, lambda module: self.split(module, self.parallel_mesh),
                              parallelized=is_parallelized(self.model))
        clip_by_norm_across_mesh(self.precision_plugin, self.mesh_sizes)

    def split(self, module: nn.Module, mesh: ParallelMesh) -> list[nn.Module]:
        """TP on the tensor dimension of ``mesh``, the sequence split on its context dimension,
        then FSDP2 on its data (x context) ranks (torchtitan's order). Returns the modules this
        rank runs besides ``module``: none."""
        return parallelize(module, mesh, ParallelOptions(
            tensor_plan=self.plan, sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel,
            reshard_after_forward=self.reshard_after_forward, mp_policy=mixed_precision_policy(self.precision_dtypes)))

    @contextmanager
    def _loss_context(self):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel() if self.loss_parallel and self.mesh_sizes.tensor > 1 else nullcontext():
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        with self._loss_context():
            return _to_local(super().training_step(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        with self._loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        with self._loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)


def _to_local(output):
    """A loss-parallel loss is a replicated DTensor; Lightning logs and accumulates plain tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(output, DTensor):
        return output.to_local()
    return output
