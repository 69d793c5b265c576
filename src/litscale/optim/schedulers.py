"""Learning-rate schedules counted in optimizer steps.

Built as ``LambdaLR`` multipliers so they compose with any optimizer and save/load with
Lightning's checkpoints. ``total_steps`` is supplied by the LightningModule from
``trainer.estimated_stepping_batches``: ``max_steps`` when set, else the optimizer steps
the data gives (per-rank batches / accumulation, rounded up, x epochs), so a schedule ends
at the last optimizer step whatever the world size or gradient accumulation.

Every schedule is: a linear warmup (``warmup_steps``, or ``warmup_fraction`` x total steps),
then a decay that reaches ``min_lr_ratio`` x the peak LR exactly at the last optimizer step
(step ``total_steps - 1``, 0-based), so the final LR is one the run actually uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from litscale.constraints import Fraction, NonNegativeInt


def check_warmup_keys(prefix: str, warmup_steps: int | None, warmup_fraction: float | None) -> None:
    """One of ``warmup_steps`` / ``warmup_fraction`` at most: two ways to say one ramp."""
    if warmup_steps and warmup_fraction is not None:
        raise ValueError(
            f"{prefix}.warmup_steps={warmup_steps} and {prefix}.warmup_fraction={warmup_fraction} "
            f"are both set; set one of them to null ({prefix}.warmup_fraction=null keeps "
            f"warmup_steps, {prefix}.warmup_steps=null keeps warmup_fraction)"
        )


def resolve_warmup_steps(total_steps: int, *, warmup_steps: int | None = None,
                         warmup_fraction: float | None = None) -> int:
    """Warmup length in optimizer steps: ``warmup_steps``, or ``warmup_fraction`` x total."""
    check_warmup_keys("scheduler", warmup_steps, warmup_fraction)
    if warmup_fraction is not None:
        return round(warmup_fraction * total_steps)
    return int(warmup_steps or 0)


def warmup_multiplier(step: int, warmup_steps: int) -> float:
    """Linear ramp (step + 1) / warmup_steps over 0-based optimizer steps: the first step
    already moves, and step ``warmup_steps - 1`` is at the peak."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def _schedule(optimizer: Optimizer, total_steps: int, warmup: int,
              decay: Callable[[float], float]) -> LambdaLR:
    """Warmup, then ``decay(progress)`` with progress 0 after warmup and 1 at the last step."""
    last = max(total_steps - 1, warmup)

    def multiplier(step: int) -> float:
        if step < warmup:
            return warmup_multiplier(step, warmup)
        return decay(min(1.0, (step - warmup) / max(1, last - warmup)))

    return LambdaLR(optimizer, multiplier)


def warmup_cosine(
    optimizer: Optimizer,
    *,
    total_steps: int,
    warmup_steps: NonNegativeInt | None = 0,
    warmup_fraction: Fraction | None = None,
    min_lr_ratio: Fraction = 0.1,
) -> LambdaLR:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` x the peak LR at the last step."""
    warmup = resolve_warmup_steps(total_steps, warmup_steps=warmup_steps,
                                  warmup_fraction=warmup_fraction)
    return _schedule(optimizer, total_steps, warmup, lambda progress: min_lr_ratio + (
        1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def warmup_linear(
    optimizer: Optimizer,
    *,
    total_steps: int,
    warmup_steps: NonNegativeInt | None = 0,
    warmup_fraction: Fraction | None = None,
    min_lr_ratio: Fraction = 0.0,
) -> LambdaLR:
    """Linear warmup, then linear decay to ``min_lr_ratio`` x the peak LR at the last step."""
    warmup = resolve_warmup_steps(total_steps, warmup_steps=warmup_steps,
                                  warmup_fraction=warmup_fraction)
    return _schedule(optimizer, total_steps, warmup,
                     lambda progress: 1 - (1 - min_lr_ratio) * progress)


def constant(
    optimizer: Optimizer,
    *,
    total_steps: int,
    warmup_steps: NonNegativeInt | None = 0,
    warmup_fraction: Fraction | None = None,
) -> LambdaLR:
    """The base LR throughout, after an optional linear warmup."""
    warmup = resolve_warmup_steps(total_steps, warmup_steps=warmup_steps,
                                  warmup_fraction=warmup_fraction)
    return _schedule(optimizer, total_steps, warmup, lambda progress: 1.0)
