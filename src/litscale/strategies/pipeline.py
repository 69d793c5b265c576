"""Pipeline parallel (``torch.distributed.pipelining``) inside Lightning's fit loop, composable
with tensor parallel and FSDP2 data parallel on one ``pipeline x data x tensor`` mesh (3D).

Lightning has no pipeline strategy (Lightning #17180). Here the model declares the ordered
units a pipeline may cut between (``GPT.pipeline_blocks``); ``stages.py`` cuts them into
stages (balanced by parameter count, or at ``split_points``) and keeps on each rank only what
its stages own; this module runs a torch schedule (GPipe, 1F1B, interleaved, zero-bubble) per
step. Tensor parallel and FSDP2 come from the one parallelize function the sibling strategies
call (``parallelize.py``: the plan on the whole model, then this rank's stages kept, then FSDP2
per stage).

In the fit loop: ``training_step`` runs ``schedule.step`` (forward and backward of every
micro-batch), broadcasts the last stage's mean loss to the pipeline group, and lets the
LightningModule log it through its own ``training_step``; ``backward`` only hands the
gradients back (see ``_take_gradients``); Lightning's optimizer step, LR schedulers and
gradient clipping (a norm across stages, ``parallel.gradient_norm``) run as usual.
Validation runs forward-only through the stages (``schedule.eval``). Checkpoints are DCP
directories in which each stage writes its own parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.constraints import PositiveInt
from litscale.data.token_batch import IGNORE_INDEX, TokenBatch, model_inputs
from litscale.parallel.contract import NO_SHARDED_LOSS_SCALER, Option
from litscale.parallel.gradient_norm import clip_by_norm_across_mesh
from litscale.parallel.layout import PIPELINE, MeshSizes, resolve_mesh_sizes
from litscale.precision import PrecisionDtypes
from litscale.strategies.fully_shard import mixed_precision_policy
from litscale.strategies.mesh_strategy import MeshStrategy, setup_parallel_module
from litscale.strategies.parallelize import ParallelOptions, parallelize
from litscale.strategies.stages import (
    Units,
    check_enough_blocks,
    find_blocks,
    keep_stages,
    plan_stages,
)
from litscale.strategies.tensor_plan import StyleName, check_tensor_parallel_setup

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from litscale.parallel.mesh import ParallelMesh

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                       "zbv_zero_bubble", "dualpipev"]
# name -> (torch class, stage placement). "loop": stage s on rank s % p; "v": rank r holds
# stages r and 2p-1-r (the V shape that ZBV and DualPipeV need); "single": one stage per rank.
SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


def default_virtual_stages(schedule: str) -> int:
    """Stages per rank when ``strategy.virtual_stages`` is null: 1 for a single-stage schedule,
    2 for the looped and V-shaped ones."""
    return 1 if SCHEDULES[schedule][1] == "single" else 2


# NOTE: the schedule calls ``loss_fn`` on the last stage's output only, so a loss the network
# adds beside its output (a mixture of experts' load-balancing loss) would silently vanish.
AUXILIARY_LOSS_DROPPED = ("the schedule computes the loss from the last stage's output only, so a mixture of "
                          "experts trains only without its load-balancing loss (model.net.aux_loss_coef=0; "
                          "the bias update, model.net.bias_update_rate, still balances the experts)")
# What a mixture of experts needs under a pipeline (a footnote of docs/compatibility.md), as
# ``check_no_auxiliary_loss`` checks it.
WITHOUT_AUXILIARY_LOSS = ("a mixture of experts trains without its load-balancing loss only: the schedule computes the "
                          "loss from the last stage's output only (model.net.aux_loss_coef=0; any other value is "
                          "refused in one line; the bias update, model.net.bias_update_rate, still balances the "
                          "experts)")


def check_no_auxiliary_loss(net: nn.Module) -> None:
    coefficient = getattr(getattr(net, "config", None), "aux_loss_coef", 0.0) or 0.0
    if coefficient > 0:
        raise ValueError(f"model.net.aux_loss_coef={coefficient} is not supported with strategy=pipeline: "
                         f"{AUXILIARY_LOSS_DROPPED}; allowed: model.net.aux_loss_coef=0")


def check_microbatches(microbatches: int, micro_batch: int | None) -> None:
    """Each data-parallel rank's micro batch splits into ``microbatches`` equal parts."""
    if micro_batch is not None and micro_batch % microbatches:
        divisors = [d for d in range(1, micro_batch + 1) if micro_batch % d == 0]
        raise ValueError(
            f"strategy.microbatches={microbatches} does not divide the micro batch of {micro_batch} "
            f"samples per data-parallel rank (data.batch_size); allowed: "
            f"{', '.join(map(str, divisors))} (or a data.batch_size that is a multiple of {microbatches})")


class PipelineParallelStrategy(MeshStrategy):
    """Pipeline x data x tensor parallel as a Lightning strategy; stages from the model's blocks.

    ``Trainer(strategy=PipelineParallelStrategy(schedule="1f1b", microbatches=4),
    accelerator="cpu", devices=2)`` or ``Trainer(strategy="litscale_pipeline")``. The
    LightningModule provides ``loss_fn(outputs, targets)`` (or pass ``loss_fn=``) and batches
    are ``(inputs, targets)``; if it has a ``loss(batch)`` method its own ``training_step`` /
    ``validation_step`` run with the pipeline's loss in its place (so it logs as usual).
    """

    splits_layers_over_ranks = True
    refuses = {Option.FP16_MIXED: NO_SHARDED_LOSS_SCALER,
               Option.LAYOUT_INVARIANT: "tensor and pipeline parallel change the reductions inside a matmul"}
    conditions = {Option.MIXTURE_OF_EXPERTS: WITHOUT_AUXILIARY_LOSS}
    untraced = "its stages' send/recv pairs are not traced"
    phase_collectives = {"forward": "pipeline send/recv", "optimizer": "gradient reduction"}

    @checked_arguments("strategy")
    def __init__(
        self,
        *,
        pipeline_parallel_size: PositiveInt | None = None,
        data_parallel_size: PositiveInt | None = 1,
        tensor_parallel_size: PositiveInt | None = 1,
        schedule: ScheduleName = "1f1b",
        microbatches: PositiveInt = 4,
        virtual_stages: PositiveInt | None = None,
        split_points: list[str] | None = None,
        blocks: list[list[str]] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        sequence_parallel: bool = True,
        plan: dict[str, StyleName] | None = None,
        precision_dtypes: PrecisionDtypes | None = None,
        reshard_after_forward: bool = False,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: PositiveInt = 1800,
    ) -> None:
        placement = SCHEDULES[schedule][1]
        virtual_stages = virtual_stages or default_virtual_stages(schedule)
        if placement == "single" and virtual_stages != 1:
            raise ValueError(f"strategy.virtual_stages={virtual_stages} needs a multi-stage schedule; "
                             f"strategy.schedule={schedule} runs 1 stage per rank (try interleaved_1f1b)")
        if placement == "v" and virtual_stages != 2:
            raise ValueError(f"strategy.virtual_stages={virtual_stages} is not valid for "
                             f"strategy.schedule={schedule}: its V shape holds exactly 2 stages per rank")
        # NOTE: always sharded (DCP): a single-file checkpoint is gathered on rank 0, which holds
        # only the first stage.
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=timedelta(seconds=timeout_s))
        self.pipeline_parallel_size, self.schedule_name = pipeline_parallel_size, schedule
        self.data_parallel_size, self.tensor_parallel_size = data_parallel_size, tensor_parallel_size
        self.microbatches, self.virtual_stages = microbatches, virtual_stages
        self.split_points, self.blocks, self.loss_fn = split_points, blocks, loss_fn
        self.sequence_parallel, self.plan = sequence_parallel, plan
        self.precision_dtypes, self.reshard_after_forward = precision_dtypes, reshard_after_forward
        self._schedules: dict[tuple[int, bool], Any] = {}
        self._stage_modules: dict[int, nn.Module] = {}

    @classmethod
    def candidate_meshes(cls, *, world_size: int, nodes: int, devices_per_node: int,
                         context_sizes: Sequence[int]) -> list[tuple[dict[str, Any], MeshSizes]]:
        """Each pipeline size above 1 that divides the world, each tensor-parallel size that
        divides the rest, and data parallel over what remains (the planner's layouts)."""
        return [({"pipeline_parallel_size": pipeline, "data_parallel_size": mesh.data_shard, "tensor_parallel_size": tensor},
                 mesh)
                for pipeline in range(2, world_size + 1) if world_size % pipeline == 0
                for tensor in range(1, world_size + 1)
                if (mesh := MeshSizes.with_data_rest(world_size, pipeline=pipeline, tensor=tensor))]

    def resolve_mesh(self, world_size: int) -> MeshSizes:
        return resolve_mesh_sizes(world_size, pipeline=self.pipeline_parallel_size,
                                  data=self.data_parallel_size, tensor=self.tensor_parallel_size)

    def _layout(self, owner: nn.Module, units: Units, sizes: MeshSizes) -> tuple[list[int], list[int]]:
        """(start unit of each stage, pipeline rank of each stage), validated."""
        num_stages = sizes.pipeline * self.virtual_stages
        check_enough_blocks(len(units), num_stages, pipeline_parallel_size=sizes.pipeline)
        if self.schedule_name != "gpipe" and self.microbatches < sizes.pipeline:
            raise ValueError(f"strategy.microbatches={self.microbatches} is fewer than the "
                             f"{sizes.pipeline} pipeline ranks, which strategy.schedule="
                             f"{self.schedule_name} needs; allowed: >= {sizes.pipeline} (or schedule=gpipe)")
        return plan_stages(owner, units, num_stages=num_stages, pipeline_size=sizes.pipeline,
                           placement=SCHEDULES[self.schedule_name][1], split_points=self.split_points)

    def validate_setup(self, *, world_size: int, net: nn.Module, seq_len: int | None = None,
                       micro_batch: int | None = None) -> None:
        """Pre-flight: mesh sizes, TP divisibility, enough blocks, split points, ties, and the
        micro batch split into ``microbatches``."""
        check_microbatches(self.microbatches, micro_batch)
        sizes = self.resolve_mesh(world_size)
        check_no_auxiliary_loss(net)
        if sizes.tensor > 1:
            check_tensor_parallel_setup(net, sizes.tensor, self.plan)
        self._layout(*find_blocks(net, self.blocks), sizes)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        setup_parallel_module(self, trainer, self._cut_into_stages, parallelized=bool(self._stage_modules))
        clip_by_norm_across_mesh(self.precision_plugin, self.mesh_sizes)

    def _cut_into_stages(self, module: nn.Module) -> None:
        self._stage_modules, self._stage_rank = self._split(module, self.parallel_mesh)
        self._num_stages = len(self._stage_rank)

    def split(self, module: nn.Module, mesh: ParallelMesh) -> list[nn.Module]:
        """Cut ``module`` (the LightningModule) into stages on ``mesh`` as this strategy does;
        return the stages this rank runs."""
        return list(self._split(module, mesh)[0].values())

    def _split(self, module: nn.Module, mesh: ParallelMesh) -> tuple[dict[int, nn.Module], list[int]]:
        """The one parallelize function with this rank's cut: tensor parallel on the whole
        model, then this rank's stages kept, then FSDP2 per stage; returns (this rank's stages by
        index, the pipeline rank of every stage)."""
        owner, units = find_blocks(module, self.blocks)
        cuts, ranks = self._layout(owner, units, mesh.sizes)
        stages: dict[int, nn.Module] = {}

        def keep(whole: nn.Module) -> list[nn.Module]:
            stages.update(keep_stages(owner, units, cuts, ranks, mesh.get(PIPELINE).get_local_rank()))
            return list(stages.values())

        parallelize(module, mesh, ParallelOptions(
            tensor_plan=self.plan, sequence_parallel=self.sequence_parallel,
            reshard_after_forward=self.reshard_after_forward, mp_policy=mixed_precision_policy(self.precision_dtypes)),
            keep_stages=keep)
        return stages, ranks

    def _schedule(self, batch_size: int, training: bool, with_positions: bool = False):
        """The torch schedule for this micro-batch shape (stages infer shapes once, so a
        different batch size, e.g. a short last validation batch, gets its own); with the
        positions of packed rows, each stage takes them and hands them on (``CarryingPositions``)."""
        key = (batch_size, training, with_positions)
        if key not in self._schedules:
            import torch.distributed.pipelining as pipelining

            group = self.parallel_mesh.get(PIPELINE).get_group()
            views = {stage: CarryingPositions(view, last=stage == self._num_stages - 1) if with_positions else view
                     for stage, view in self._stage_modules.items()}
            stages = [pipelining.PipelineStage(view, stage, self._num_stages, self.root_device, group=group)
                      for stage, view in sorted(views.items())]
            cls = getattr(pipelining, SCHEDULES[self.schedule_name][0])
            stage_arg = stages[0] if SCHEDULES[self.schedule_name][1] == "single" else stages
            self._schedules[key] = cls(stage_arg, n_microbatches=self.microbatches, loss_fn=self._loss_fn())
        return self._schedules[key]

    def _loss_fn(self) -> Callable:
        loss_fn = self.loss_fn or getattr(self.lightning_module, "loss_fn", None)
        if loss_fn is None:
            raise ValueError(f"{type(self.lightning_module).__name__} has no loss_fn(outputs, targets) "
                             "for the last pipeline stage; define one or pass loss_fn= to the strategy")
        return loss_fn

    def _run_pipeline(self, batch: Any, *, training: bool) -> torch.Tensor:
        """Mean loss over the micro-batches of ``batch``, the same on every pipeline rank. A
        ``TokenBatch``'s positions travel with each micro batch through the stages, and each
        micro batch's loss counts its tokens as ``litscale.data.token_batch`` says (in
        validation, as a share of the batch's own counted tokens: the mean is then over them)."""
        inputs, targets = batch[0], batch[1]
        if len(inputs) % self.microbatches:
            raise ValueError(f"strategy.microbatches={self.microbatches} does not divide the micro "
                             f"batch of {len(inputs)} samples per data-parallel rank (data.batch_size)")
        inputs, loss_kwargs = pipeline_inputs(self._network(), batch, training=training)
        has_first, has_last = 0 in self._stage_modules, self._num_stages - 1 in self._stage_modules
        args, losses = inputs if has_first else (), []
        if training or SCHEDULES[self.schedule_name][1] != "v":
            schedule = self._schedule(len(batch[0]), training, with_positions=len(inputs) > 1)
            run = schedule.step if training else schedule.eval
            run(*args, target=targets if has_last else None, losses=losses, loss_kwargs=loss_kwargs)
        else:
            losses = self._forward_in_order(inputs, targets, loss_kwargs)
        # float32 on every rank: the last stage's loss comes out of the loss function in its own
        # dtype, and under bf16_true the others' zeros would be bfloat16 (Lightning's default
        # dtype inside the step): gloo aborted the job on the sizes' mismatch (4 vs 2 bytes).
        loss = (torch.stack(losses).mean().detach().float() if has_last
                else torch.zeros((), dtype=torch.float32, device=self.root_device))
        group = self.parallel_mesh.get(PIPELINE).get_group()
        dist.broadcast(loss, src=dist.get_global_rank(group, self._stage_rank[-1]), group=group)
        return loss

    def _network(self) -> nn.Module:
        module = self.lightning_module
        return getattr(module, "net", module)

    @torch.no_grad()
    def _forward_in_order(self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor,
                          loss_kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Forward-only pass through the stages one after the other, whole batch at once.

        Written by hand for the V-shaped schedules only: torch's ``schedule.eval`` fails for them
        (their lowered actions read backward inputs even when backward is off, torch 2.13).
        """
        group = self.parallel_mesh.get(PIPELINE).get_group()
        peer = functools.partial(dist.get_global_rank, group)
        here = self.parallel_mesh.get(PIPELINE).get_local_rank()
        x, *positions = inputs  # every rank loads the batch: the positions need no sending
        for stage, rank in enumerate(self._stage_rank):
            previous = self._stage_rank[stage - 1] if stage else rank
            if rank == here:
                if previous != here:
                    x = _receive(peer(previous), group, self.root_device)
                x = self._stage_modules[stage](x, *positions)
            elif previous == here:
                _send(x, peer(rank), group)
        return [self._loss_fn()(x, targets, **loss_kwargs)] if self._num_stages - 1 in self._stage_modules else []

    @contextmanager
    def _module_loss(self, loss: torch.Tensor):
        """Let the LightningModule's own step run (and log) with the pipeline's loss."""
        module = self.lightning_module
        module.loss = lambda batch: loss
        try:
            yield
        finally:
            del module.loss

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        batch = args[0] if args else kwargs["batch"]
        held = self._take_gradients()  # the previous step's, until Lightning zeroes them
        with self.precision_plugin.train_step_context():
            loss = self._run_pipeline(batch, training=True)
        self._stashed = self._take_gradients()
        for param, grad in held:
            param.grad = grad
        if not hasattr(self.lightning_module, "loss"):
            self.lightning_module.log("train/loss", loss, prog_bar=True)
            return loss
        with self._module_loss(loss):
            return self.lightning_module.training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        batch = args[0] if args else kwargs["batch"]
        with self.precision_plugin.val_step_context():
            loss = self._run_pipeline(batch, training=False)
        if not hasattr(self.lightning_module, "loss"):
            self.lightning_module.log("val/loss", loss, prog_bar=True, sync_dist=True)
            return loss
        with self._module_loss(loss):
            return self.lightning_module.validation_step(*args, **kwargs)

    def _take_gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Remove and return the parameters' gradients. NOTE: the schedule runs backward inside
        ``training_step``, but Lightning zeroes gradients *after* ``training_step`` and before
        ``backward``: so the schedule's gradients are set aside there and ``backward`` adds
        them back, and the schedule starts from no gradients (it accumulates into ``.grad``)."""
        taken = [(p, p.grad) for p in self.lightning_module.parameters() if p.grad is not None]
        for param, _ in taken:
            param.grad = None
        return taken

    @override
    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        # Lightning divides the loss by accumulate_grad_batches before backward; do the same.
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        for param, grad in getattr(self, "_stashed", []):
            grad = grad * scale if scale != 1.0 else grad
            param.grad = grad if param.grad is None else param.grad + grad
        self._stashed = []
        return closure_loss


def pipeline_inputs(net: nn.Module, batch: Any, *, training: bool) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """(the first stage's arguments, the loss function's keywords) for ``batch``: the tokens,
    and for a ``TokenBatch`` the positions of a net that attends within documents and the
    counted fraction each micro batch's loss divides by (in validation, the batch's own share
    of counted targets: the mean of the micro batches' losses is then over its counted tokens)."""
    if not isinstance(batch, TokenBatch):
        return (batch[0],), {}
    fraction = batch.counted_fraction
    if not training:
        counted = (batch.targets != IGNORE_INDEX).sum().clamp(min=1)
        fraction = (counted.to(torch.float64) / batch.targets.numel()).reshape(1)
    return model_inputs(net, batch), {"counted_fraction": fraction}


class CarryingPositions(nn.Module):
    """A stage of a net that attends within documents: runs on (tokens or hidden states,
    positions), and hands the positions on beside its output to the next stage (the last
    stage's output alone goes to the loss). Positions are a tensor the schedule sends like any."""

    def __init__(self, stage: nn.Module, *, last: bool) -> None:
        super().__init__()
        self.stage, self.last = stage, last

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        out = self.stage(x, positions)
        return out if self.last else (out, positions)


_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.long)


def _send(tensor: torch.Tensor, destination: int, group) -> None:
    """Point-to-point send with a header (dtype, shape), so the receiver needs to know neither."""
    header = torch.tensor([_WIRE_DTYPES.index(tensor.dtype), *tensor.shape], dtype=torch.long,
                          device=tensor.device)
    dist.send(torch.tensor([header.numel()], device=tensor.device), destination, group=group)
    dist.send(header, destination, group=group)
    dist.send(tensor.contiguous(), destination, group=group)


def _receive(source: int, group, device: torch.device) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.long, device=device)
    dist.recv(size, source, group=group)
    header = torch.zeros(int(size), dtype=torch.long, device=device)
    dist.recv(header, source, group=group)
    tensor = torch.empty(header[1:].tolist(), dtype=_WIRE_DTYPES[int(header[0])], device=device)
    dist.recv(tensor, source, group=group)
    return tensor
