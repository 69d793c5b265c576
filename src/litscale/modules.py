"""LightningModules that wrap zoo networks for a task (causal LM, classification).

They receive the network built and the optimizer/scheduler as factories (Hydra partials, or
any callable), so the same module serves every strategy: a strategy may shard or wrap
``self.net`` before ``configure_optimizers`` runs, and the factory then sees the final
parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics.aggregation import MeanMetric

from litscale.data.token_batch import (
    IGNORE_INDEX,
    TokenBatch,
    counted_tokens,
    loss_denominator,
    model_inputs,
)
from litscale.loggers import is_logging_step
from litscale.reliability.determinism import LayoutInvariance

OptimizerFactory = Callable[[Iterable], Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]


def next_token_loss(logits: Tensor, targets: Tensor, counted_fraction: Tensor | None = None) -> Tensor:
    """Mean next-token cross-entropy over the logits in fp32 (a copy, for 16-bit logits). With
    ``counted_fraction`` (a ``TokenBatch``'s): summed over the counted targets and divided by
    that share of the targets (``litscale.data.token_batch``), so the slices' mean over every
    layout is the global batch's mean over its counted tokens."""
    if counted_fraction is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
    return summed / loss_denominator(targets, counted_fraction).float()


def optimizer_groups(net: nn.Module, optimizer: object, weight_decay: float) -> list[dict]:
    """The param groups ``optimizer`` (a class or factory) is built from: by weight decay, and by
    role where it asks for them (Muon)."""
    from litscale.optim.muon import parameter_roles, wants_parameter_roles

    return (parameter_roles if wants_parameter_roles(optimizer) else weight_decay_groups)(net, weight_decay)


def weight_decay_groups(net: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm gains are excluded, as in GPT-2 and the LAMB paper."""
    params = [p for p in net.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class TaskModule(LightningModule):
    """What both tasks share: optimizer/scheduler wiring, val-loss bookkeeping, compile."""

    task: str = ""

    def __init__(
        self,
        *,
        net: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        weight_decay: float = 0.0,
        compile: bool = False,
        determinism: LayoutInvariance | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        # NOTE: set up before any strategy shards ``net``: it keeps an unsharded copy.
        self.determinism = determinism.attach(net) if determinism is not None else None
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.weight_decay = weight_decay
        self.compile_net = compile
        self.val_loss = MeanMetric()
        # This optimizer step's micro-batch losses, logged as train/loss at the step; replica
        # groups (litscale.reliability.replica_groups) average them over the groups before that.
        self.window_losses: list[Tensor] = []
        self.initial_val_loss: float | None = None

    def configure_model(self) -> None:
        # NOTE: nn.Module.compile compiles in place: parameter names, and so checkpoints, stay
        # those of the eager net (torch.compile(net) would prefix every key with `_orig_mod.`).
        # Lightning calls this before a strategy wraps or shards the net.
        if self.compile_net and getattr(self.net, "_compiled_call_impl", None) is None:
            self.net.compile()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, batch: tuple[Tensor, Tensor], net: nn.Module | None = None) -> Tensor:
        """The batch's mean loss through ``net`` (default: this module's network)."""
        raise NotImplementedError

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.determinism is not None:  # it logs the global batch's loss at the optimizer step
            return self.determinism.training_step(self, batch, batch_idx)
        loss = self.loss(batch)
        if is_logging_step(self._trainer):
            # A loss-parallel loss is a replicated DTensor, whose local value is the loss.
            self.window_losses.append((loss.to_local() if hasattr(loss, "to_local") else loss).detach())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.determinism is not None:
            loss = self.determinism.finish(self)
            if is_logging_step(self._trainer):
                self.log("train/loss", loss, prog_bar=True)
                self.log("train/grad_norm", self.determinism.gradient_norm)
            return
        if self.window_losses and not self._strategy_accumulates_on():
            # The logged loss is the global batch's: the mean of the accumulation window's micro
            # batches, then of every rank's (equal micro batches; a context or tensor parallel
            # peer holds a share or a copy of the same samples' loss). One process with the same
            # global batch logs the same value, whatever the layout.
            window, self.window_losses = torch.stack(self.window_losses).mean(), []
            together = getattr(self._trainer.strategy, "ranks_step_together", True)
            self.log("train/loss", window, prog_bar=True, sync_dist=together)
            self._log_gradient_norm(optimizer)

    def _log_gradient_norm(self, optimizer) -> None:
        """``train/grad_norm``: the 2-norm of the whole gradient the optimizer steps on (the
        global batch's mean gradient, summed over shards and stages), before clipping; the same
        number on every layout of a synchronous strategy, as one process takes it. A strategy
        that keeps gradients apart (DeepSpeed) logs its engine's instead."""
        from litscale.parallel.contract import contract_value
        from litscale.parallel.gradient_norm import global_gradient_norm
        from litscale.parallel.layout import mesh_of

        strategy = self._trainer.strategy
        if contract_value(strategy, "keeps_gradients_apart"):
            return
        sizes = mesh_of(strategy, self._trainer.world_size)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.log("train/grad_norm", global_gradient_norm(parameters, sizes=sizes))

    def _strategy_accumulates_on(self) -> bool:
        """A strategy that accumulates gradients itself (DeepSpeed) has Lightning call
        ``on_before_optimizer_step`` at every micro batch: True while its window goes on.
        NOTE: Lightning's fit loop knows, through a private method (``_should_accumulate``)."""
        trainer = self._trainer
        return (trainer is not None and trainer.strategy.handles_gradient_accumulation
                and trainer.fit_loop._should_accumulate())

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        # a mean over samples, or over counted tokens where the batch masks some (TokenBatch)
        weight = counted_tokens(batch) if isinstance(batch, TokenBatch) else batch[0].shape[0]
        self.val_loss.update(self.loss(batch), weight=weight)

    def on_validation_epoch_end(self) -> None:
        val_loss = self.val_loss.compute()  # synchronised across ranks by torchmetrics
        self.val_loss.reset()
        if self.trainer.sanity_checking:
            # The pre-training validation pass is the baseline the summary compares against.
            self.initial_val_loss = float(val_loss)
            return
        self.log_validation(val_loss)

    def log_validation(self, val_loss: Tensor) -> None:
        # The value is already the same on every rank; sync_dist only keeps Lightning from
        # warning that an epoch-level metric was not reduced.
        self.log("val/loss", val_loss, prog_bar=True, sync_dist=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # NOTE: Lightning's mixed-precision plugin refuses to clip for a fused optimizer, which
        # would unscale the gradients itself; under bf16 autocast there is no loss scale and so
        # nothing to unscale: clip as every other precision does (fused AdamW on GPU needs this).
        if self.determinism is not None:
            return  # clipped in ``determinism.finish``, on the whole gradient, alike on every layout
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and getattr(plugin, "scaler", False) is None and \
                getattr(optimizer, "_step_supports_amp_scaling", False):
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val,
                                     gradient_clip_algorithm or GradClipAlgorithmType.NORM)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def param_groups(self) -> list[dict]:
        """The optimizer's param groups (``optimizer_groups``)."""
        return optimizer_groups(self.net, self.optimizer_factory, self.weight_decay)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.param_groups())
        if self.determinism is not None:
            self.determinism.take_optimizer(optimizer)
        if self.scheduler_factory is None:
            return optimizer
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = self.scheduler_factory(optimizer, total_steps=total_steps)
        # Schedulers count optimizer steps, whatever the world size or accumulation.
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class CausalLMModule(TaskModule):
    """Next-token prediction; logs ``val/bpb``, bits per byte of text: the loss per token over
    the bytes a token stands for on the val split (the data module's ``val_bytes_per_token``;
    1 for byte-level data), so runs with different tokenizers compare."""

    task = "causal_lm"

    def loss(self, batch: tuple[Tensor, Tensor] | TokenBatch, net: nn.Module | None = None) -> Tensor:
        net = net or self.net
        if not isinstance(batch, TokenBatch):
            tokens, targets = batch
            return self.loss_fn(net(tokens), targets)
        # Validation counts the batch's own tokens (a zero fraction); training its global batch's.
        fraction = batch.counted_fraction if self.training else torch.zeros_like(batch.counted_fraction)
        return self.loss_fn(net(*model_inputs(net, batch)), batch.targets, fraction)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """The next-token loss (``train/loss``, comparable with ``val/loss``) plus the net's
        ``auxiliary_loss()`` of this forward when it has one: a mixture of experts' load-balancing
        loss (``litscale.models.moe``), logged as ``train/moe_aux_loss``."""
        loss = super().training_step(batch, batch_idx)
        take_auxiliary = getattr(self.net, "auxiliary_loss", None)
        auxiliary = take_auxiliary() if take_auxiliary is not None else None
        if auxiliary is None:
            return loss
        if is_logging_step(self._trainer):
            self.log("train/moe_aux_loss", auxiliary)
        return loss + auxiliary

    def configure_model(self) -> None:
        compiled = getattr(self.net, "_compiled_call_impl", None) is not None
        super().configure_model()
        if self.compile_net and not compiled:
            # The fp32 cast of the [B, T, vocab] logits fuses into the loss kernels instead of
            # materialising a float copy (GPT-2 small, batch 32 x 1024: 6.6 GB).
            self.loss_fn = torch.compile(self.loss_fn)

    def loss_fn(self, logits: Tensor, targets: Tensor, counted_fraction: Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy (a pipeline's last stage calls it on its output), over
        the counted tokens of a ``TokenBatch`` (``next_token_loss``)."""
        return next_token_loss(logits, targets, counted_fraction)

    def log_validation(self, val_loss: Tensor) -> None:
        super().log_validation(val_loss)
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        bytes_per_token = getattr(datamodule, "val_bytes_per_token", 1.0)
        over = getattr(datamodule, "val_bytes_per_token_over", None)
        if over is not None:  # the text the loss was taken on, when validation stops early
            bytes_per_token = over(evaluated_sequences(self.trainer, datamodule))
        self.log("val/bpb", val_loss / math.log(2) / bytes_per_token, sync_dist=True)


def evaluated_sequences(trainer, datamodule) -> int:
    """How many held-out samples this validation covers on all ranks together: its batches
    per rank (``limit_val_batches`` applied) x batch size x data-parallel ranks, at most all."""
    batches = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
    batches = batches[0] if isinstance(batches, list) else batches
    replicas, _ = datamodule.replicas()
    total = len(datamodule.val_dataset)
    return total if math.isinf(batches) else min(total, int(batches) * datamodule.batch_size * replicas)


class ClassificationModule(TaskModule):
    """Cross-entropy classification; logs ``val/accuracy``."""

    task = "classification"

    def __init__(self, **kwargs) -> None:  # the validator follows **kwargs to TaskModule
        super().__init__(**kwargs)
        self.val_accuracy = MeanMetric()

    def on_validation_epoch_start(self) -> None:
        self.val_accuracy.reset()

    def loss(self, batch: tuple[Tensor, Tensor], net: nn.Module | None = None) -> Tensor:
        inputs, labels = batch
        logits = (net or self.net)(inputs)
        if not self.training:
            self.val_accuracy.update((logits.argmax(-1) == labels).float().mean(), weight=len(labels))
        return F.cross_entropy(logits.float(), labels)

    def log_validation(self, val_loss: Tensor) -> None:
        super().log_validation(val_loss)
        self.log("val/accuracy", self.val_accuracy.compute(), sync_dist=True)
