"""``determinism=layout_invariant``: data-parallel layouts that train bit-identically.

A normal data-parallel step sums gradients in an order that depends on the layout: each
rank's backward sums over its micro batch inside the matmuls, accumulation adds micro
batches one after another, and the all-reduce adds ranks in whatever order its algorithm
takes. Floating-point addition is not associative, so 1 and 8 ranks drift apart in the last
bits, then further. In this mode the order is fixed instead:

- every global batch is cut into ``chunks`` equal chunks of consecutive samples; a chunk's
  loss and gradient are computed on their own (a forward and backward of that chunk alone,
  so each matmul sees the same shapes on any layout), with the random generators seeded from
  the step and the chunk's index in the global batch (dropout draws the same masks);
- chunk gradients are summed in one fixed pairwise tree over the chunk indices: a rank sums
  the subtree of the chunks it holds (its contiguous share of the global batch, in micro
  batches of whole chunks), the ranks all-gather their subtree sums, and every rank finishes
  the tree in the same order, then divides by ``chunks`` (a power of two: exact);
- the forward and backward run on a plain, unsharded copy of the network whose weights are
  the strategy's (gathered from shards where the strategy shards them): the strategy's own
  gradient reduction never runs, and each rank hands its optimizer its slice of the one global
  gradient, which is the same on every rank, so every layout steps the same weights;
- running statistics (batch norm's) move once per optimizer step: every chunk's forward starts
  from the step's statistics, and the network takes the mean over the chunks of what each
  chunk's forward left, summed in the gradients' tree. That is one momentum update towards
  the mean of the chunks' batch statistics, not the per-batch statistics of a normal step (a
  chunk's variance is taken within the chunk), and the same on every layout;
- an optimizer that scales each tensor's step by the tensor's norms (LARS, LAMB) takes them of
  the whole tensor (gathered from the shards under FSDP) by one kernel, as one process does
  (``take_optimizer``); elementwise optimizers (SGD, AdamW) need nothing, and Muon
  orthogonalises whole matrices already;
- the replica's forward runs under the autocast of the trainer's mixed precision (FSDP's
  precision plugin drops autocast for its own casts of the sharded weights, which the replica
  is not), and on CUDA with torch's deterministic algorithms (``use_device``).

With the same global batch, 1, 2, 4 or 8 ranks, DDP or FSDP, with or without gradient
accumulation, give ``torch.equal`` losses and weights at every step. It costs a full copy of
the network and its gradient on every rank, a forward per chunk, and an all-gather of
gradients (world x the all-reduce's volume): for debugging, reproducibility audits and
comparing layouts, not for speed (``experiments/determinism``). Tensor and pipeline parallel
change the reductions inside a matmul and are refused, as are context parallel, fp16 loss
scaling and mixtures of experts (``litscale.reliability.determinism_checks``).
"""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from litscale.constraints import PositiveInt
from litscale.data.token_batch import rows_of
from litscale.optim.parameter_steps import whole_tensor
from litscale.reliability.determinism_checks import is_power_of_two


def chunk_seed(seed: int, step: int, chunk: int) -> int:
    """The random generators' seed for one chunk: from the run's seed, the step and the
    chunk's index in the global batch, so a chunk draws the same numbers on any rank."""
    return (seed * 1_000_003 + step) * 65_537 + chunk


def tree_sum(values: list[Tensor]) -> Tensor:
    """The pairwise sum of ``values`` (a power of two of them): neighbours first, then the
    sums of neighbours, to the root."""
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


@dataclass
class _Subtree:
    """A rank's partial sums: complete subtrees over consecutive chunks, merged as soon as a
    sibling completes (a binary counter), so it holds at most log2(chunks) of them."""

    nodes: list[tuple[int, list[Tensor]]] = field(default_factory=list)  # (leaves, tensors)

    def add(self, tensors: list[Tensor]) -> None:
        leaves = 1
        while self.nodes and self.nodes[-1][0] == leaves:
            _, left = self.nodes.pop()
            tensors = [a + b for a, b in zip(left, tensors, strict=True)]
            leaves *= 2
        self.nodes.append((leaves, tensors))

    def total(self) -> list[Tensor]:
        if len(self.nodes) != 1:
            raise RuntimeError(
                f"layout_invariant: a rank's chunks do not form one subtree: "
                f"{[n for n, _ in self.nodes]} leaves"
            )
        return self.nodes[0][1]


class LayoutInvariance:
    """The layout-invariant step: see the module's docstring.

    Args:
        chunks: Chunks of each global batch (a power of two, a multiple of data-parallel ranks
            x accumulation, and a divisor of the global batch). Runs compare bit-for-bit only
            with the same ``chunks``.
        seed: Seed of the per-chunk random generators (the run's ``seed``).
        threads: Intra-op CPU threads of every rank. NOTE: a CPU kernel may split a reduction
            (a matmul's, a norm's weight gradient) over its threads, so the thread count is part
            of the arithmetic: one rank on 2 cores and two ranks on one core each differed in
            the 7th digit until both used one thread.
    """

    def __init__(self, *, chunks: PositiveInt = 8, seed: int = 0, threads: PositiveInt = 1) -> None:
        if not is_power_of_two(int(chunks)):
            raise ValueError(f"determinism.chunks must be a power of two, got {chunks}")
        self.chunks, self.seed, self.threads = int(chunks), int(seed), int(threads)
        self.losses: list[Tensor] = []  # the global batch's loss at each step
        self.gradient_norm: Tensor | None = None  # the last step's, before clipping
        self._replica: nn.Module | None = None
        self._subtree = _Subtree()
        self._chunk_losses: list[Tensor] = []
        self._statistics: dict[str, Tensor] = {}  # the replica's running statistics, by name
        self._step_statistics: dict[str, Tensor] = {}  # their values at the step's start

    def attach(self, net: nn.Module) -> LayoutInvariance:
        """Keep an unsharded copy of ``net`` (before any strategy shards or wraps it); fix
        this process's CPU threads."""
        self._replica = copy.deepcopy(net)
        self._statistics = running_statistics(self._replica)
        torch.set_num_threads(self.threads)
        return self

    @property
    def replica(self) -> nn.Module | None:
        """The unsharded copy the run computes with (``attach``)."""
        return self._replica

    def take_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer``, set to step alike on every layout: an optimizer that scales each
        tensor's step by the tensor's norms (LARS, LAMB: ``whole_tensor_norms``) takes them of
        the whole tensor, where a sharded layout's DTensor would add its shards' parts in
        another order."""
        if hasattr(optimizer, "whole_tensor_norms"):
            optimizer.whole_tensor_norms = True
        return optimizer

    def use_device(self, device: torch.device | str) -> None:
        """Where the run computes; on CUDA, torch's deterministic algorithms. Call it before the
        first CUDA op (the app does, as it builds the run): cuBLAS reads its workspace setting
        when it starts."""
        if on_cuda(device):
            use_deterministic_algorithms()

    # --- where this rank's chunks are ----------------------------------------------------------

    @staticmethod
    def data_parallel(trainer) -> tuple[int, int]:
        """(data-parallel ranks, this rank's index) of the trainer's strategy."""
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def first_chunk(self, trainer, batch_idx: int, micro_batch: int) -> tuple[int, int]:
        """(global index of this micro batch's first chunk, chunk size)."""
        ranks, rank = self.data_parallel(trainer)
        accumulation = trainer.accumulate_grad_batches
        per_micro = self.chunks // (ranks * accumulation)
        if per_micro < 1 or self.chunks % (ranks * accumulation) or micro_batch % per_micro:
            raise ValueError(
                f"determinism.chunks={self.chunks} does not split into {ranks} data-parallel rank(s) x "
                f"{accumulation} micro batch(es) of {micro_batch} samples: chunks must be a multiple of "
                f"{ranks * accumulation} and divide the global batch {micro_batch * ranks * accumulation}"
            )
        return rank * (self.chunks // ranks) + (
            batch_idx % accumulation
        ) * per_micro, micro_batch // per_micro

    # --- the step ---------------------------------------------------------------------------------

    def training_step(self, module, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Forward and backward each chunk of ``batch`` on the replica; add its gradient (and the
        running statistics it left) to this rank's subtree. Returns the micro batch's loss,
        detached: the strategy's backward of it touches no parameter."""
        trainer = module.trainer
        _skip_ddp_reduction(trainer)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._load_weights(module)
        first, size = self.first_chunk(trainer, batch_idx, batch[0].shape[0])
        replica = self._replica
        parameters = [p for p in replica.parameters() if p.requires_grad]
        losses = []
        for index in range(batch[0].shape[0] // size):
            chunk = rows_of(batch, slice(index * size, (index + 1) * size))
            self._restart_statistics()
            with torch.random.fork_rng(devices=[]), _autocast(trainer):
                torch.manual_seed(chunk_seed(self.seed, trainer.global_step, first + index))
                loss = module.loss(chunk, net=replica)
                gradients = torch.autograd.grad(loss, parameters, allow_unused=True)
            leaves = [torch.zeros_like(p) if g is None else g for p, g in zip(parameters, gradients, strict=True)]
            leaves += [t.detach().clone() for t in self._statistics.values() if t.is_floating_point()]
            # NOTE: summed in float32 at least, at every level of the tree: a bf16-true rank's own
            # subtree summed in bf16 and the ranks' sums in float32 would round by layout.
            self._subtree.add([t.to(torch.promote_types(t.dtype, torch.float32)) for t in leaves])
            losses.append(loss.detach())
            self._chunk_losses.append(loss.detach())
        # the micro batch's loss as a normal step reports it (a mean over its chunks)
        return (tree_sum(losses) / len(losses)).requires_grad_()

    def finish(self, module) -> Tensor:
        """At the optimizer step: exchange the ranks' subtree sums, finish the tree, give each of
        the strategy's parameters its part of the global mean gradient and the network the
        chunks' mean running statistics. Returns the global batch's loss (the same on every rank)."""
        ranks, _ = self.data_parallel(module.trainer)
        subtree = self._subtree.total() + [tree_sum(self._chunk_losses)]
        self._subtree, self._chunk_losses = _Subtree(), []
        flat = torch.cat([t.reshape(-1) for t in subtree])
        if ranks > 1:
            gathered = [torch.empty_like(flat) for _ in range(ranks)]
            dist.all_gather(gathered, flat)  # every rank of these strategies is a data-parallel rank
            flat = tree_sum(gathered)
        flat = flat / self.chunks  # a power of two: exact
        self.losses.append(flat[-1].clone())
        targets = [p for p in module.net.parameters() if p.requires_grad]
        count = sum(p.numel() for p in targets)
        # before clipping, as every strategy logs it (train/grad_norm)
        self.gradient_norm = torch.linalg.vector_norm(flat[:count])
        gradient, statistics = _clip(flat[:count], module.trainer), flat[count:-1]
        for param, part in zip(targets, _pieces(gradient, targets), strict=True):
            _set_gradient(param, part)
        self._carry_statistics(module.net, statistics)
        return self.losses[-1]

    def _load_weights(self, module) -> None:
        """The replica takes the strategy's current weights (whole, where they are sharded), in
        their dtype and on their device, and the network's buffers."""
        if self._replica is None:
            raise RuntimeError("LayoutInvariance.attach(net) must be called before training")
        self.use_device(next(module.net.parameters()).device)  # for a loop that never called it
        with torch.no_grad():
            for mine, theirs in zip(self._replica.parameters(), module.net.parameters(), strict=True):
                _copy_into(mine, whole_tensor(theirs))
            for mine, theirs in zip(self._replica.buffers(), module.net.buffers(), strict=True):
                _copy_into(mine, theirs)
        self._step_statistics = {name: t.clone() for name, t in self._statistics.items()}
        self._replica.train(module.training)

    def _restart_statistics(self) -> None:
        """Each chunk's forward starts from the step's running statistics."""
        with torch.no_grad():
            for name, tensor in self._statistics.items():
                tensor.copy_(self._step_statistics[name])

    def _carry_statistics(self, net: nn.Module, means: Tensor) -> None:
        """The network's running statistics := the chunks' mean (floating point), or what every
        chunk left alike (a batch norm's step count)."""
        if not self._statistics:
            return
        theirs = dict(net.named_buffers())
        floating = [(n, t) for n, t in self._statistics.items() if t.is_floating_point()]
        with torch.no_grad():
            for (name, _), part in zip(floating, _pieces(means, [t for _, t in floating]), strict=True):
                theirs[name].copy_(part)
            for name, tensor in self._statistics.items():
                if not tensor.is_floating_point():
                    theirs[name].copy_(tensor)


def running_statistics(net: nn.Module) -> dict[str, Tensor]:
    """The buffers a training forward of ``net`` updates in place, by name: its batch norms'
    running mean, variance and step count."""
    found = {}
    for prefix, child in net.named_modules():
        if isinstance(child, nn.modules.batchnorm._NormBase) and child.track_running_stats:
            found.update({f"{prefix}.{name}".lstrip("."): buffer
                          for name, buffer in child.named_buffers(recurse=False) if buffer is not None})
    return found


def _pieces(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """``flat`` cut into tensors of the shapes of ``like``, in order."""
    sizes = [t.numel() for t in like]
    return [piece.view(t.shape) for piece, t in zip(flat.split(sizes), like, strict=True)]


def _copy_into(mine: Tensor, theirs: Tensor) -> None:
    """``mine`` := ``theirs``, taking its dtype and device (a bf16-true run's, the GPU's)."""
    if mine.dtype != theirs.dtype or mine.device != theirs.device:
        mine.data = torch.empty(mine.shape, dtype=theirs.dtype, device=theirs.device)
    mine.copy_(theirs)


def _autocast(trainer):
    """The autocast of the trainer's mixed precision (``bf16-mixed``: bfloat16). NOTE: FSDP's
    precision plugin leaves it out (its policy casts the sharded weights, which the replica is
    not), so the replica asks for it here; under DDP it nests in the same autocast."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = trainer.precision_plugin
    return MixedPrecision.autocast_context_manager(plugin) if isinstance(plugin, MixedPrecision) else nullcontext()


# cuBLAS workspace settings under which its kernels are deterministic (either of them).
DETERMINISTIC_CUBLAS_WORKSPACES = (":4096:8", ":16:8")


def on_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def use_deterministic_algorithms() -> None:
    """torch's deterministic CUDA kernels (an op without one raises rather than drifting), and
    the fixed cuBLAS workspace they need (``CUBLAS_WORKSPACE_CONFIG``, unless set to one)."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_CUBLAS_WORKSPACES:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS_WORKSPACES[0]
    torch.use_deterministic_algorithms(True)


def _skip_ddp_reduction(trainer) -> None:
    """Tell DDP (whose forward this step runs in) that no all-reduce is to follow: the
    parameters it wraps take no part in this backward."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(trainer.strategy, "model", None)
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = False


def _clip(gradient: Tensor, trainer) -> Tensor:
    """The whole gradient clipped as the trainer asks (norm or value), computed on the one
    flat gradient every rank holds: the same numbers on any layout."""
    limit = trainer.gradient_clip_val
    if not limit:
        return gradient
    if trainer.gradient_clip_algorithm == "value":
        return gradient.clamp(-limit, limit)
    norm = torch.linalg.vector_norm(gradient)
    return gradient * torch.clamp(limit / (norm + 1e-6), max=1.0)


def _set_gradient(param: Tensor, gradient: Tensor) -> None:
    """``param.grad`` = ``gradient``, or this rank's shard of it for a sharded parameter (cut
    locally: every rank holds the whole gradient)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gradient = gradient.to(param.dtype, copy=True)
    if isinstance(param, DTensor):
        gradient = distribute_tensor(gradient, param.device_mesh, param.placements, src_data_rank=None)
    param.grad = gradient
