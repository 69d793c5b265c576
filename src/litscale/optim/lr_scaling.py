"""Learning-rate scaling from the effective global batch, and the callback that applies it.

The rules are pure functions of (base LR, global batch, base batch, rule):

- ``none``:   lr = base_lr
- ``linear``: lr = base_lr x global_batch / base_batch_size  (Goyal et al. 2017)
- ``sqrt``:   lr = base_lr x sqrt(global_batch / base_batch_size)  (Krizhevsky 2014; Adam-family)

where global batch = micro batch x data-parallel size x gradient accumulation. Tensor- and
pipeline-parallel ranks share one data shard, so they do not multiply it; nodes do (they are
part of the data-parallel size).

``LRScaling`` is a Lightning callback that needs no Hydra: it learns the data-parallel size
once the strategy has set up its environment (the callback ``setup`` hook runs after that and
before ``configure_optimizers``), then replaces the module's ``optimizer_factory`` so the
optimizer is *created* with the scaled LR. Editing param groups afterwards would be too late:
a scheduler built in ``configure_optimizers`` has already captured ``base_lrs``.

Warmup: when the callback is given ``warmup_steps`` or ``warmup_fraction``, its warmup
*replaces* the scheduler's (it is passed to the module's ``scheduler_factory``), so a run never
ramps twice; with neither set, the scheduler's own warmup stands.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only
from torch.optim import Optimizer

from litscale.arguments import checked_arguments
from litscale.constraints import Fraction, NonNegativeInt, PositiveInt
from litscale.loggers import is_logging_step
from litscale.optim.mup import WidthScaling
from litscale.optim.schedulers import check_warmup_keys, constant, warmup_multiplier
from litscale.parallel.contract import data_parallel_size
from litscale.parallel.layout import RunLayout

Rule = Literal["none", "linear", "sqrt"]
RULES: tuple[str, ...] = ("none", "linear", "sqrt")

__all__ = ["LRScaling", "Rule", "global_batch", "scaled_lr", "warmup_multiplier"]


def global_batch(micro_batch: int, data_parallel_size: int, accumulation: int) -> int:
    """Samples per optimizer step: micro batch x data-parallel ranks x accumulated micro batches."""
    for name, value in (("micro_batch", micro_batch), ("data_parallel_size", data_parallel_size),
                        ("accumulation", accumulation)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return int(micro_batch) * int(data_parallel_size) * int(accumulation)


def scaled_lr(base_lr: float, *, global_batch: int, base_batch_size: int, rule: Rule) -> float:
    """The LR for ``global_batch`` given ``base_lr`` tuned at ``base_batch_size``."""
    if base_batch_size < 1 or global_batch < 1:
        raise ValueError(f"batch sizes must be >= 1, got global_batch={global_batch}, "
                         f"base_batch_size={base_batch_size}")
    ratio = global_batch / base_batch_size
    if rule == "none":
        return base_lr
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"rule={rule!r} is not valid: expected one of: {', '.join(map(repr, RULES))}")


class ScaledOptimizerFactory:
    """An optimizer factory that calls ``original`` with ``lr`` replaced by the scaled LR; with
    ``width`` (µP), its param groups split by the width's LR multipliers."""

    def __init__(self, original: Callable[..., Optimizer], lr: float, width: WidthScaling | None = None) -> None:
        self.original, self.lr, self.width = original, lr, width

    def __call__(self, params: Iterable, **kwargs: Any) -> Optimizer:
        if self.width is not None:
            params = self.width.param_groups(list(params), self.lr, optimizer_keywords(self.original))
        return self.original(params, **{**kwargs, "lr": self.lr})


def optimizer_keywords(factory: Callable[..., Optimizer]) -> dict:
    """The keywords a ``functools.partial`` factory builds its optimizer with: the ones it was
    given over its optimizer's defaults (a group's weight decay, where the group sets none, is
    the optimizer's default: AdamW's 0.01); {} for another callable."""
    if not isinstance(factory, functools.partial):
        return {}
    defaults = {name: parameter.default for name, parameter in inspect.signature(factory.func).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    return {**defaults, **factory.keywords}


def base_lr_of(factory: Callable[..., Optimizer]) -> float:
    """The ``lr=`` keyword of a ``functools.partial`` factory (what Hydra's ``_partial_`` builds)."""
    if isinstance(factory, ScaledOptimizerFactory):
        factory = factory.original
    if isinstance(factory, functools.partial) and "lr" in factory.keywords:
        return float(factory.keywords["lr"])
    raise TypeError(
        "LRScaling needs the module's optimizer_factory to be a functools.partial with lr=..., "
        f"got {factory!r}"
    )


class LRScaling(Callback):
    """Scale the module's LR from the effective global batch, and own the warmup if given one.

    Works with any LightningModule that builds its optimizer from ``self.optimizer_factory``
    (a ``functools.partial(OptimizerClass, lr=...)``) and, optionally, its scheduler from
    ``self.scheduler_factory(optimizer, total_steps=..., warmup_steps=..., warmup_fraction=...)``
    (litscale's modules and schedulers do).

    Args:
        rule: ``none``, ``linear`` or ``sqrt`` (see the module docstring).
        base_batch_size: The global batch the module's LR was tuned for.
        warmup_steps: Linear warmup in optimizer steps; replaces the scheduler's warmup.
        warmup_fraction: Warmup as a fraction of the run's optimizer steps (instead of steps).
        micro_batch_size: Per-device batch; by default the datamodule's ``batch_size``.
        layout: The run's layout (``litscale.parallel.layout``): its micro batch, data-parallel size and
            accumulation make the global batch. Without it they are read from the trainer.
        base_width: µP (``litscale.optim.mup``, ``lr_scaling=mup``): the width the LR was tuned at.
            The network is µP-parametrised against itself at that width (init, logits, attention
            scores) and the optimizer's groups get their width's LR multipliers, on top of the
            batch rule. None: no width scaling.
    """

    @checked_arguments("lr_scaling")
    def __init__(
        self,
        *,
        rule: Rule = "linear",
        base_batch_size: PositiveInt = 256,
        warmup_steps: NonNegativeInt | None = None,
        warmup_fraction: Fraction | None = None,
        micro_batch_size: PositiveInt | None = None,
        layout: RunLayout | None = None,
        base_width: PositiveInt | None = None,
    ) -> None:
        check_warmup_keys("lr_scaling", warmup_steps, warmup_fraction)
        self.rule, self.base_batch_size = rule, int(base_batch_size)
        self.base_width = base_width
        self.warmup_steps, self.warmup_fraction = warmup_steps, warmup_fraction
        self.micro_batch_size, self.layout = micro_batch_size, layout
        self.global_batch: int | None = None
        self.base_lr: float | None = None
        self.lr: float | None = None

    @property
    def owns_warmup(self) -> bool:
        return self.warmup_steps is not None or self.warmup_fraction is not None

    def _micro_batch(self, trainer: Trainer) -> int:
        if self.micro_batch_size is not None:
            return int(self.micro_batch_size)
        batch_size = getattr(trainer.datamodule, "batch_size", None)
        if batch_size is None:
            raise ValueError("LRScaling cannot find the micro batch: the datamodule has no "
                             "batch_size; pass LRScaling(micro_batch_size=...)")
        return int(batch_size)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.layout is not None:  # replica groups (fault_tolerance=replicas) are data parallel too
            micro, dp, accumulation = self.layout.micro_batch, self.layout.batch_ranks, self.layout.accumulation
        else:
            micro, dp = self._micro_batch(trainer), data_parallel_size(trainer.strategy)
            accumulation = trainer.accumulate_grad_batches
        self.global_batch = global_batch(micro, dp, accumulation)
        factory = getattr(pl_module, "optimizer_factory", None)
        if factory is None and self.rule == "none" and not self.owns_warmup and self.base_width is None:
            return  # nothing to change; a module of another shape is left alone
        self.base_lr = base_lr_of(factory)
        self.lr = scaled_lr(self.base_lr, global_batch=self.global_batch,
                            base_batch_size=self.base_batch_size, rule=self.rule)
        original = factory.original if isinstance(factory, ScaledOptimizerFactory) else factory
        width = self._scale_width(pl_module, original)
        pl_module.optimizer_factory = ScaledOptimizerFactory(original, self.lr, width)
        if self.owns_warmup:
            self._take_over_warmup(pl_module)
        self._print(micro, dp, accumulation)
        if width is not None:
            self._print_width(width, original)

    def _scale_width(self, pl_module: LightningModule, factory: Callable[..., Optimizer]) -> WidthScaling | None:
        """µP's network side, before any strategy shards or wraps the network: the forward's
        multipliers and the init (also on the layout-invariant replica the run computes with)."""
        if self.base_width is None:
            return None
        width = WidthScaling(pl_module.net, self.base_width)
        replica = getattr(getattr(pl_module, "determinism", None), "replica", None)
        width.apply(networks=[replica] if replica is not None else [])
        return width

    def _take_over_warmup(self, pl_module: LightningModule) -> None:
        scheduler = getattr(pl_module, "scheduler_factory", None) or constant
        pl_module.scheduler_factory = functools.partial(
            scheduler, warmup_steps=self.warmup_steps, warmup_fraction=self.warmup_fraction)

    def _warmup_text(self) -> str:
        if self.warmup_fraction is not None:
            return f"warmup {self.warmup_fraction:g} of steps (lr_scaling)"
        if self.warmup_steps is not None:
            return f"warmup {self.warmup_steps} steps (lr_scaling)"
        return "warmup from the scheduler"

    @rank_zero_only
    def _print(self, micro: int, dp: int, accumulation: int) -> None:
        print(
            f"litscale: lr scaling: micro batch {micro} x data-parallel {dp} x accumulation "
            f"{accumulation} = global batch {self.global_batch} | base lr {self.base_lr:g} at "
            f"batch {self.base_batch_size} | rule {self.rule} -> lr {self.lr:g} | "
            f"{self._warmup_text()}",
            flush=True,
        )

    @rank_zero_only
    def _print_width(self, width: WidthScaling, factory: Callable[..., Optimizer]) -> None:
        from litscale.optim.muon import wants_parameter_roles

        print(width.describe(optimizer_keywords(factory), muon=wants_parameter_roles(factory)), flush=True)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.global_batch is None:
            return
        if trainer.ckpt_path is not None and self.lr is not None:
            self._rescale_restored_schedules(trainer)
        # Logged once, straight to the loggers: self.log would aggregate it per epoch.
        for logger in trainer.loggers:
            logger.log_metrics({"lr_scaling/global_batch": float(self.global_batch)},
                               step=trainer.global_step)

    def _rescale_restored_schedules(self, trainer: Trainer) -> None:
        """A resumed run restores the LR its checkpoint was scaled for (the schedulers'
        ``base_lrs`` and the param groups' LRs); rescale them to this run's global batch, so
        a change of world size or accumulation on resume keeps the rule, and the schedule
        keeps its position."""
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            # A µP group's LR is the rule's times its width multiplier.
            ratio = self.lr * scheduler.optimizer.param_groups[0].get("lr_multiplier", 1.0) / scheduler.base_lrs[0]
            if ratio == 1.0:
                continue
            scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
            for group in scheduler.optimizer.param_groups:
                group["lr"] *= ratio
                if "initial_lr" in group:
                    group["initial_lr"] *= ratio
            if trainer.is_global_zero:
                print(f"litscale: lr scaling: resumed from a checkpoint scaled for another global "
                      f"batch; LR schedule rescaled x{ratio:g} to peak lr {self.lr:g}", flush=True)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: Optimizer) -> None:
        # The LR this optimizer step is about to use (not per micro batch), on the steps the
        # loggers write; a Python float, so no device sync.
        if is_logging_step(trainer):
            group = optimizer.param_groups[0]
            pl_module.log("lr_scaling/lr", float(group["lr"]) / group.get("lr_multiplier", 1.0),
                          on_step=True, on_epoch=False, rank_zero_only=True)
