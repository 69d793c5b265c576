"""Tensor parallel (Megatron-style, on DTensor) with FSDP2 over the remaining ranks (2D).

The split is not written in model code: the model declares a plan, module-name pattern ->
style name (``GPT.tensor_parallel_plan``, see ``litscale/models/gpt_parallel.py``), or the
user passes one (``strategy.plan``), and ``apply_tensor_parallel`` turns each style name
into a ``torch.distributed.tensor.parallel`` style on the tensor-parallel mesh (torchtitan's
``parallelize_llama``, with the plan as data). Ranks beyond the tensor-parallel size form a
data-parallel dimension sharded with FSDP2 (``litscale.strategies.fsdp.apply_fsdp``).
Checkpoints are DCP directories (Lightning's ``ModelParallelStrategy``), which reshard on
load: a run saved at TP=2 loads at TP=1 or into the plain network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.constraints import PositiveInt
from litscale.contract import NO_SHARDED_LOSS_SCALER, Option, StrategyContract
from litscale.declarations import declared, name_matches
from litscale.precision import PrecisionDtypes
from litscale.sharding import Sharding, fsdp2_sharding
from litscale.strategies.context_parallel import (
    check_context_parallel_fits,
    check_sequence_splits,
    shard_batch,
)
from litscale.strategies.expert_parallel import check_expert_parallel_fits
from litscale.strategies.fsdp import mixed_precision_policy
from litscale.strategies.mesh import (
    CONTEXT,
    DATA,
    MeshSizes,
    check_tensor_parallel_fits,
    clip_by_norm_across_mesh,
    is_parallelized,
    resolve_mesh_sizes,
    sampler_kwargs,
    setup_parallel_module,
    start_mesh,
    sum_partial_gradients_after,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
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


class TensorParallelStrategy(StrategyContract, ModelParallelStrategy):
    """Tensor parallel x FSDP2 (2D) as a Lightning strategy; the plan comes from the model.

    ``Trainer(strategy=TensorParallelStrategy(tensor_parallel_size=2), accelerator="cpu",
    devices=2)`` or ``Trainer(strategy="litscale_tensor_parallel")`` (TP over all devices).
    ``plan``: module-name pattern (relative to the LightningModule, e.g. ``net.blocks.*.mlp.up``)
    -> style (``STYLES``), instead of the model's ``tensor_parallel_plan``.
    """

    refuses = {Option.FP16_MIXED: NO_SHARDED_LOSS_SCALER,
               Option.LAYOUT_INVARIANT: "tensor and pipeline parallel change the reductions inside a matmul"}
    phase_collectives = {"forward": "tensor-parallel collectives", "backward": "tensor-parallel collectives / gradient reduce-scatter"}
    mesh_layout = staticmethod(MeshSizes.shape_and_names)  # pipeline x data x tensor, sizes of 1 kept

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
        self.mesh_sizes: MeshSizes | None = None

    @property
    def sharding(self) -> Sharding:
        """FSDP2 over the data dimension (litscale.sharding.LaidOut), on each rank's share."""
        return fsdp2_sharding(reshard_after_forward=self.reshard_after_forward)

    @classmethod
    def candidate_meshes(cls, *, world_size: int, nodes: int, devices_per_node: int,
                         context_sizes: Sequence[int]) -> list[tuple[dict[str, Any], MeshSizes]]:
        """Each tensor-parallel size above 1 that divides the world, each sequence split of
        ``context_sizes`` that divides the rest, and data parallel over what remains (the
        planner's layouts)."""
        return [({"tensor_parallel_size": tensor, "data_parallel_size": world_size // (tensor * context),
                  "context_parallel_size": context},
                 MeshSizes(data_shard=world_size // (tensor * context), tensor=tensor, context=context))
                for tensor in range(2, world_size + 1) if world_size % tensor == 0
                for context in context_sizes if (world_size // tensor) % context == 0]

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
    def setup_environment(self) -> None:
        self.mesh_sizes = start_mesh(self, self.mesh_layout)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return sampler_kwargs(self.resolve_mesh(self.world_size), self.global_rank)

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return shard_batch(batch, self.device_mesh[CONTEXT]) if self.context_parallel_size > 1 else batch

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return super().optimizer_step(optimizer, sum_partial_gradients_after(closure, self.model), model, **kwargs)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        setup_parallel_module(self, trainer, lambda module: self.split(module, self.device_mesh),
                              parallelized=is_parallelized(self.model))
        clip_by_norm_across_mesh(self.precision_plugin, self.mesh_sizes)

    def split(self, module: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
        """TP on the tensor dimension of ``mesh`` (laid out by ``mesh_layout``), the sequence
        split on its context dimension, then FSDP2 on its data (x context) dimension
        (torchtitan's order). Returns the modules this rank runs besides ``module``: none."""
        from litscale.strategies.parallelize import ParallelOptions, parallelize

        parallelize(module, mesh, self.resolve_mesh(mesh.size()), (DATA,), ParallelOptions(
            tensor_plan=self.plan, sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel,
            reshard_after_forward=self.reshard_after_forward, mp_policy=mixed_precision_policy(self.precision_dtypes)))
        return []

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
