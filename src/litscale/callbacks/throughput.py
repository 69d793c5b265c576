"""Steady-state training throughput, logged under ``perf/*``.

Lightning's ``ThroughputMonitor`` is not used here: it reports a rolling window per logging
step and multiplies by the world size, where litscale wants the whole run's steady-state
average and counts data-parallel ranks only (tensor- and pipeline-parallel ranks share a
batch). What remains is two timestamps and a division.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from litscale.constraints import NonNegativeInt


def data_parallel_size(trainer: Trainer) -> int:
    """How many ranks consume distinct samples (1 for a single process)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))


class ThroughputCallback(Callback):
    """Samples/s and tokens/s over the whole job, after ``warmup_steps`` optimizer steps.

    Times are taken every ``log_every_n_steps`` only, so a CUDA run synchronises the device
    at most once per logging interval, not once per step.
    """

    def __init__(self, *, warmup_steps: NonNegativeInt = 10) -> None:
        self.warmup_steps = warmup_steps
        self.result: dict[str, float] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start: tuple[float, int] | None = None
        self._paused_s = 0.0  # validation time inside the measured interval, not training
        self._samples_per_step = 0
        self._tokens_per_sample = getattr(trainer.datamodule, "tokens_per_sample", None)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._samples_per_step:
            micro_batch = len(batch[0])
            self._samples_per_step = micro_batch * data_parallel_size(trainer) * trainer.accumulate_grad_batches
        step = trainer.global_step
        if self._start is None:
            # A short run still gets a figure: warm-up is at most a quarter of its steps.
            warmup = min(self.warmup_steps, max(1, trainer.max_steps // 4)) if trainer.max_steps > 0 \
                else self.warmup_steps
            if step >= warmup:
                self._start = (self._now(pl_module), step)
            return
        if step == self._start[1] or (step % trainer.log_every_n_steps and step != trainer.max_steps):
            return
        now = self._now(pl_module)
        self.result = self._summarise(now, step)
        pl_module.log_dict(self.result, rank_zero_only=True)

    @staticmethod
    def _now(pl_module: LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # time the GPU's work, not its queueing
        return time.perf_counter()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if getattr(self, "_start", None) is not None:
            self._paused_s += time.perf_counter() - self._validation_started

    def _summarise(self, now: float, step: int) -> dict[str, float]:
        elapsed, steps = now - self._start[0] - self._paused_s, step - self._start[1]
        samples_per_sec = steps * self._samples_per_step / elapsed
        result = {"perf/samples_per_sec": samples_per_sec, "perf/step_time_s": elapsed / steps}
        if self._tokens_per_sample:
            result["perf/tokens_per_sec"] = samples_per_sec * self._tokens_per_sample
        return result
