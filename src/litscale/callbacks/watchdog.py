"""``HangWatchdog``: no job hangs without saying why.

Every rank of a multi-rank run keeps a heartbeat (its step and phase, and the collective
that phase waits in where its strategy declares one: ``phase_collectives``); global rank 0
watches them all (``litscale.health``). When no rank has moved for its limit, the job is
hung: every rank writes its Python stacks to ``<dirpath>/hang-<step>/rank<N>.txt``, rank 0
prints ``error: hang at step S: rank R stuck in ... for T s; ranks ... waiting in ...;
stacks in ...`` and every rank exits with code 1, long before the process group's timeout.
Rank 1 keeps a standby watchdog for a rank 0 that freezes whole (``litscale.health.watchdog``).
The watch stays on after ``fit``, through the run's export and summary (phases ``export`` and
``summary``, limit ``after_fit_timeout_s``), until ``end_watch``.

A single process has no peer to wait for: nothing runs there.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from litscale.constraints import PositiveFloat
from litscale.health.beats import AFTER_FIT
from litscale.health.diagnosis import Limits
from litscale.health.heartbeat import Heartbeat
from litscale.health.store import health_store
from litscale.health.watchdog import Watchdog

# Step times the median is taken over (the most recent).
MEDIAN_OVER_STEPS = 50


class HangWatchdog(Callback):
    """Stop a hung job within ``timeout_s`` (default: ``max(min_timeout_s, step_multiple x the
    median step)``) of its last progress, naming the rank it waits for; longer limits before
    the first step is done, in validation and in a checkpoint save."""

    def __init__(
        self,
        *,
        dirpath: str,
        timeout_s: PositiveFloat | None = None,
        min_timeout_s: PositiveFloat = 60.0,
        step_multiple: PositiveFloat = 20.0,
        first_step_timeout_s: PositiveFloat = 600.0,
        validation_timeout_s: PositiveFloat = 600.0,
        checkpoint_timeout_s: PositiveFloat = 600.0,
        after_fit_timeout_s: PositiveFloat = 600.0,
        interval_s: PositiveFloat = 1.0,
    ) -> None:
        self.dirpath = dirpath
        self.timeout_s, self.min_timeout_s, self.step_multiple = timeout_s, min_timeout_s, step_multiple
        self.first_step_timeout_s = first_step_timeout_s
        self.validation_timeout_s, self.checkpoint_timeout_s = validation_timeout_s, checkpoint_timeout_s
        self.after_fit_timeout_s = after_fit_timeout_s
        self.interval_s = interval_s
        self.heartbeat: Heartbeat | None = None
        self.watchdog: Watchdog | None = None
        self._collectives: dict[str, str] = {}
        self._step_times: deque[float] = deque(maxlen=MEDIAN_OVER_STEPS)
        self._batch_started: float | None = None
        # summary.json: ``health/watched`` is false when a heartbeat or the watchdog died
        self.result: dict[str, bool] = {}

    def limits(self, median_step_s: float | None) -> Limits:
        step_s = self.timeout_s or max(self.min_timeout_s, self.step_multiple * (median_step_s or 0.0))
        return Limits(step_s=step_s, first_step_s=max(self.first_step_timeout_s, step_s),
                      validation_s=max(self.validation_timeout_s, step_s),
                      checkpoint_s=max(self.checkpoint_timeout_s, step_s),
                      silent_s=min(step_s, 15 * self.interval_s),
                      after_fit_s=max(self.after_fit_timeout_s, step_s))

    # --- start and stop ----------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or trainer.world_size < 2 or self.heartbeat is not None:
            return
        self._collectives = dict(getattr(trainer.strategy, "phase_collectives", {}))
        rank = trainer.global_rank
        watching = rank in (0, 1)  # rank 1: the standby, for a rank 0 frozen whole
        try:
            # a watchdog thread gets a client of its own
            stores = [health_store() for _ in range(2 if watching else 1)]
        except (KeyError, ValueError, RuntimeError) as error:  # no store to reach: train unwatched
            print(f"litscale: rank {rank}: hang watchdog off, the launcher's store is out of reach "
                  f"({type(error).__name__}: {error})".splitlines()[0], file=sys.stderr, flush=True)
            return
        self.heartbeat = Heartbeat(stores[0], rank, interval_s=self.interval_s).start()
        if watching:
            self.watchdog = Watchdog(stores[1], trainer.world_size, limits=self.limits, stacks_root=self.dirpath,
                                     poll_s=self.interval_s, standby=rank != 0,
                                     own=self.heartbeat if rank != 0 else None).start()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # the watch goes on through the run's work after fit, which comes next (``end_watch``)
        self.on_after_fit(trainer, AFTER_FIT[0])

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.close()  # a failed rank is the launcher's to report, not a hang

    def on_after_fit(self, trainer: Trainer, work: str, collective: str | None = None) -> None:
        """This rank is in ``work`` after fit (one of ``AFTER_FIT``), waiting in ``collective``."""
        if self.heartbeat is not None:
            self.heartbeat.mark(trainer.global_step, work, collective)

    def close(self) -> None:
        for part in (self.watchdog, self.heartbeat):
            if part is not None:
                part.close()
        self.watchdog = self.heartbeat = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.heartbeat is not None:
            died = any(part is not None and part.failure for part in (self.watchdog, self.heartbeat))
            self.result = {"health/watched": not died}

    # --- where this rank is ------------------------------------------------------------------

    def _mark(self, trainer: Trainer, phase: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.mark(trainer.global_step, phase, self._collectives.get(phase))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark(trainer, "data")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_started = time.perf_counter()
        self._mark(trainer, "forward")

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        self._mark(trainer, "backward")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._mark(trainer, "optimizer")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._mark(trainer, "data")
        if self.heartbeat is None or self._batch_started is None:
            return
        self.heartbeat.first_step_done()
        self._step_times.append(time.perf_counter() - self._batch_started)
        if self.watchdog is not None:
            self.watchdog.median_step_s = statistics.median(self._step_times)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark(trainer, "validation")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark(trainer, "data")

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        self._mark(trainer, "checkpoint")


def end_watch(trainer: Trainer) -> None:
    """The run's work is over: close the heartbeat and the watchdog (a rank done on purpose)."""
    for callback in trainer.callbacks:
        if isinstance(callback, HangWatchdog):
            callback.close()
