"""``StragglerReport``: which rank is slow, from the times each rank already takes.

Every rank times its forward (from the batch's start to its backward: local compute and
data, which under DDP holds no collective, so a slow rank's extra time shows there and not on
the others) and its whole step, and every ``every_n_steps`` publishes the window's medians to
the job's store; rank 0 reads them (no collective), logs ``health/slowest_rank`` and
``health/straggler_ratio`` (the slowest rank's forward time over the median of the other
ranks': with two ranks, the other's) and, when
one rank stays above ``threshold`` for ``windows`` windows in a row, says so once. The run's
summary names the slowest rank over the run and its median ratio.

Under FSDP and tensor parallel the forward holds collectives too: there the fast ranks wait
in it, and the ratio understates a straggler.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed import DistError

from litscale.constraints import PositiveFloat, PositiveInt
from litscale.health.store import health_store, read_json_keys
from litscale.loggers import log_to_loggers


class StragglerReport(Callback):
    def __init__(self, *, threshold: PositiveFloat = 1.2, every_n_steps: PositiveInt = 20,
                 windows: PositiveInt = 3) -> None:
        self.threshold, self.every_n_steps, self.windows = threshold, every_n_steps, windows
        self.result: dict[str, float] = {}
        self._store = None
        self._forward: list[float] = []
        self._step: list[float] = []
        self._started: float | None = None
        self._window = 0
        self._ratios: dict[int, list[float]] = {}  # rank -> its ratio in each window (rank 0)
        self._streak: tuple[int, int] = (-1, 0)  # (rank above threshold, windows in a row)
        self._reported = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.world_size > 1 and self._store is None:
            try:
                self._store = health_store()
            except (KeyError, ValueError, RuntimeError):  # no store to reach: no report (the watchdog says so)
                self._store = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._started = time.perf_counter()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        if self._started is not None:
            self._forward.append(time.perf_counter() - self._started)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._started is None or self._store is None:
            return
        self._step.append(time.perf_counter() - self._started)
        if trainer.global_step == 0 or trainer.global_step % self.every_n_steps or not self._forward:
            return
        # The window just closed is published; rank 0 reads the one before, which every rank
        # has published by now (their steps are in lockstep to within one).
        window = {"forward_s": statistics.median(self._forward), "step_s": statistics.median(self._step)}
        self._forward, self._step = [], []
        try:
            self._store.set(f"window/{self._window}/{trainer.global_rank}", json.dumps(window).encode())
            if trainer.global_rank == 0 and self._window > 0:
                self._read_window(trainer, self._window - 1)
        except DistError:  # the store is gone (its launcher with it): no report, the training goes on
            self._store = None  # (the watchdog's heartbeat, a client of the same store, says so)
        self._window += 1

    def _read_window(self, trainer: Trainer, window: int) -> None:
        keys = [f"window/{window}/{rank}" for rank in range(trainer.world_size)]
        values = read_json_keys(self._store, keys)
        if any(value is None for value in values):
            return
        figures = [json.loads(value) for value in values]
        forward = [f["forward_s"] for f in figures]
        ratios = [_ratio_to_peers(forward, rank) for rank in range(len(forward))]
        for rank, ratio in enumerate(ratios):
            self._ratios.setdefault(rank, []).append(ratio)
        slowest = max(range(len(ratios)), key=lambda r: ratios[r])
        metrics = {"health/slowest_rank": float(slowest), "health/straggler_ratio": ratios[slowest]}
        metrics.update({f"health/forward_s/rank{r}": f["forward_s"] for r, f in enumerate(figures)})
        metrics.update({f"health/step_s/rank{r}": f["step_s"] for r, f in enumerate(figures)})
        log_to_loggers(trainer, metrics)
        self._note_streak(slowest, ratios[slowest], trainer.global_step)
        self._summarize()

    def _note_streak(self, rank: int, ratio: float, step: int) -> None:
        above = ratio > self.threshold
        streak_rank, count = self._streak
        self._streak = (rank, count + 1 if above and rank == streak_rank else int(above))
        if self._streak[1] >= self.windows and not self._reported:
            self._reported = True
            print(f"litscale: straggler: rank {rank} takes {ratio:.2f}x the median of its peers' forward times, "
                  f"above {self.threshold:g}x for {self.windows} windows of {self.every_n_steps} steps "
                  f"(to step {step})", flush=True)

    def _summarize(self) -> None:
        medians = {rank: statistics.median(ratios) for rank, ratios in self._ratios.items()}
        slowest = max(medians, key=medians.get)
        self.result = {"health/slowest_rank": slowest, "health/straggler_ratio": medians[slowest]}


def _ratio_to_peers(times: list[float], rank: int) -> float:
    peers = statistics.median(times[:rank] + times[rank + 1:])
    return times[rank] / peers if peers > 0 else 1.0
