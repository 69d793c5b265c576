"""Injecting faults on purpose, to check that runs survive them (the reliability suite).

    python train.py +callbacks.fault._target_=litscale.callbacks.faults.InjectFault \
        +callbacks.fault.at_step=20 +callbacks.fault.kind=sigkill +callbacks.fault.rank=1

A fault fires once per run, and not in a run resumed from a checkpoint: the restart that a
fault provokes (``torchrun --max-restarts``, a requeued job, the same command again with
``ckpt_path=auto``) resumes from the last checkpoint before ``at_step`` and must then get
past it. ``+callbacks.fault.after_resume=true`` fires in resumed runs too. A restart that
finds no checkpoint starts afresh and meets the fault again, so checkpoint before
``at_step`` (``trainer.val_check_interval`` smaller than it).
"""

from __future__ import annotations

import os
import signal
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from litscale.constraints import NonNegativeInt, PositiveInt


class InjectedFault(RuntimeError):
    """The exception ``InjectFault(kind="exception")`` raises."""


class InjectFault(Callback):
    """At optimizer step ``at_step`` on rank ``rank`` (every rank if None): raise an
    exception, SIGKILL this rank, SIGTERM or SIGUSR1 the job (as a scheduler preempting it, or
    warning of its time limit, would), or make the weights NaN. ``during="validation"``: in
    the first validation batch from that step on instead. With ``after_resume=False`` a run
    resumed from a checkpoint (``trainer.ckpt_path`` set) is left alone."""

    def __init__(
        self,
        *,
        at_step: PositiveInt,
        kind: Literal["exception", "sigterm", "sigusr1", "sigkill", "nan_weights"] = "exception",
        rank: NonNegativeInt | None = None,
        during: Literal["train", "validation"] = "train",
        after_resume: bool = False,
    ) -> None:
        self.at_step = at_step
        self.kind = kind
        self.rank = rank
        self.during = during
        self.after_resume = after_resume
        self._fired = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # NOTE: decided from the run's own state rather than TORCHELASTIC_RESTART_COUNT, so it
        # holds alike for torchrun restarts, requeued SLURM jobs and ckpt_path=auto by hand.
        if trainer.ckpt_path is not None and not self.after_resume:
            self._fired = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.during == "train" and trainer.global_step == self.at_step:
            self._fire(trainer, pl_module, where="")

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if (self.during == "validation" and not trainer.sanity_checking
                and trainer.global_step >= self.at_step):
            self._fire(trainer, pl_module, where=" in validation")

    def _fire(self, trainer: Trainer, pl_module: LightningModule, *, where: str) -> None:
        if self._fired or (self.rank is not None and trainer.global_rank != self.rank):
            return
        self._fired = True
        if self.kind == "exception":
            raise InjectedFault(f"injected fault{where} at step {trainer.global_step} on rank "
                                f"{trainer.global_rank}")
        if self.kind == "nan_weights":
            with torch.no_grad():
                for parameter in pl_module.parameters():
                    parameter.fill_(float("nan"))
            return
        if self.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)  # this rank dies, as on a hardware fault
        # A scheduler's preemption signal reaches the whole job: under litscale's launcher (or
        # torchrun) that is the agent, which passes it on to every rank.
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ
        stop_signal = signal.SIGUSR1 if self.kind == "sigusr1" else signal.SIGTERM
        os.kill(os.getppid() if under_agent else os.getpid(), stop_signal)
