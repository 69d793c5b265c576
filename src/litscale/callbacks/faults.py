"""Injecting faults on purpose, to check that runs survive them (the reliability suite).

    python train.py +callbacks.fault._target_=litscale.callbacks.faults.InjectFault \
        +callbacks.fault.at_step=20 +callbacks.fault.kind=sigkill +callbacks.fault.rank=1
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
    exception, SIGKILL this rank, SIGTERM the job (as a scheduler preempting it would), or
    make the weights NaN."""

    def __init__(
        self,
        *,
        at_step: PositiveInt,
        kind: Literal["exception", "sigterm", "sigkill", "nan_weights"] = "exception",
        rank: NonNegativeInt | None = None,
    ) -> None:
        self.at_step = at_step
        self.kind = kind
        self.rank = rank
        self._fired = False

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._fired or trainer.global_step != self.at_step:
            return
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        self._fired = True
        if self.kind == "exception":
            raise InjectedFault(f"injected fault at step {self.at_step} on rank {trainer.global_rank}")
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
        os.kill(os.getppid() if under_agent else os.getpid(), signal.SIGTERM)
