"""Stopping a run whose loss stays NaN/inf, after saving a checkpoint to inspect.

A single non-finite loss is left to the machinery meant for it (fp16's loss scaler skips
that step and lowers the scale). A streak of them means the weights are gone: every rank
stops together, with one clear message. The check reads a device-side counter once every
``check_every_n_steps`` steps, so it adds no per-step host synchronisation.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from litscale.checkpoint.background import wait_for_checkpoints
from litscale.constraints import PositiveInt


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN/inf for too many consecutive steps."""


class NonFiniteLossGuard(Callback):
    """Raise ``NonFiniteLossError`` on every rank after ``patience`` consecutive non-finite
    losses on any rank, saving ``<dirpath>/nonfinite-step<N>.ckpt`` first.

    The checkpoint is not named ``last.ckpt``: ``ckpt_path=auto`` keeps resuming from the
    last good one.
    """

    def __init__(self, *, dirpath: str, patience: PositiveInt = 10,
                 check_every_n_steps: PositiveInt = 10) -> None:
        self.dirpath = dirpath
        self.patience = patience
        self.check_every_n_steps = check_every_n_steps
        self._streak: torch.Tensor | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        finite = torch.isfinite(loss.detach())
        if self._streak is None:
            self._streak = torch.zeros((), dtype=torch.int64, device=loss.device)
        self._streak = torch.where(finite, torch.zeros_like(self._streak), self._streak + 1)
        if trainer.global_step % self.check_every_n_steps == 0:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        streak = int(trainer.strategy.reduce(self._streak.clone(), reduce_op="max"))
        if streak < self.patience:
            return
        path = os.path.join(self.dirpath, f"nonfinite-step{trainer.global_step}.ckpt")
        trainer.save_checkpoint(path, weights_only=False)  # the full state, to inspect
        wait_for_checkpoints(trainer.strategy)
        raise NonFiniteLossError(
            f"train/loss was NaN/inf for {streak} consecutive steps up to step "
            f"{trainer.global_step}; stopped every rank and saved {path}; resume from the last "
            "good checkpoint with a lower optimizer.lr, trainer.gradient_clip_val or precision=bf16_mixed"
        )
