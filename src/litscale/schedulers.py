"""Learning-rate schedules counted in optimizer steps.

Built as ``LambdaLR`` multipliers so they compose with any optimizer and save/load with
Lightning's checkpoints. ``total_steps`` is supplied by the LightningModule from the
trainer's estimate of optimizer steps, so the schedule ends at the last optimizer step
whatever the world size or gradient accumulation.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from litscale.constraints import Fraction, NonNegativeInt


def warmup_multiplier(step: int, warmup_steps: int) -> float:
    """Linear ramp from 1/warmup_steps to 1 over the first ``warmup_steps`` steps."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def warmup_cosine(
    optimizer: Optimizer,
    *,
    total_steps: int,
    warmup_steps: NonNegativeInt = 0,
    min_lr_ratio: Fraction = 0.1,
) -> LambdaLR:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` x the peak LR at ``total_steps``."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return warmup_multiplier(step, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, multiplier)


def constant(optimizer: Optimizer, *, total_steps: int, warmup_steps: NonNegativeInt = 0) -> LambdaLR:
    """The base LR throughout, after an optional linear warmup."""
    return LambdaLR(optimizer, lambda step: warmup_multiplier(step, warmup_steps))
