"""Injecting faults on purpose, to check that runs survive them (the reliability suite).

    python train.py +callbacks.fault._target_=litscale.callbacks.faults.InjectFault \
        +callbacks.fault.at_step=20 +callbacks.fault.kind=sigkill +callbacks.fault.rank=1

Faults that stall a job instead of failing it (for the hang watchdog, ``callbacks/watchdog.py``):
``kind=hang`` (the rank sleeps inside step ``at_step``), ``kind=skip_collective`` (the rank
skips its gradient all-reduce at ``at_step`` and goes on, as after a data-dependent branch, so
the others wait), ``kind=wrong_shape`` (at ``at_step`` every rank all-reduces a small metric
and this rank's is empty, as on a rank with no samples of it: the others wait in that
all-reduce, while it goes on), ``kind=slow`` (the rank sleeps ``delay_s`` in every step from ``at_step`` on,
``for_steps`` of them if set; with ``during=validation``, in every validation batch),
``kind=freeze`` (the rank's whole process stops itself with SIGSTOP at ``at_step``, its
heartbeat and watchdog threads with it, as under a debugger or a C call holding the GIL).
``kind=hang`` with ``during=export`` or ``during=summary`` hangs in that work after ``fit``.
With ``during=save`` a fault that acts at once (``sigkill``, ``exception``, ...) acts as the
rank begins the first checkpoint save from step ``at_step`` on: the other ranks are then inside
that save, waiting for this rank's part.

A fault fires once per run, and not in a run resumed from a checkpoint: the restart that a
fault provokes (``torchrun --max-restarts``, a requeued job, the same command again with
``ckpt_path=auto``) resumes from the last checkpoint before ``at_step`` and must then get
past it. ``+callbacks.fault.after_resume=true`` fires in resumed runs too. A restart that
finds no checkpoint starts afresh and meets the fault again, so checkpoint before
``at_step`` (``trainer.val_check_interval`` smaller than it).

``+callbacks.fault.record=<file>``: the rank the fault acts on writes, as it acts, a line of JSON
with its kind, step, rank and wall-clock time (``experiments/reliability/faults.py`` times
from it how long the job takes to say what happened).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from litscale.constraints import NonNegativeInt, PositiveFloat, PositiveInt

# How long `kind=hang` sleeps: longer than any job waits for a rank.
HANG_S = 7 * 24 * 3600.0


class InjectedFault(RuntimeError):
    """The exception ``InjectFault(kind="exception")`` raises."""


class InjectFault(Callback):
    """At optimizer step ``at_step`` on rank ``rank`` (every rank if None): raise an
    exception, SIGKILL this rank, SIGTERM or SIGUSR1 the job (as a scheduler preempting it, or
    warning of its time limit, would), make the weights NaN, or stall (``hang``,
    ``skip_collective``, ``slow``: see the module's docstring). ``during="validation"``: in
    the first validation batch from that step on instead. With ``after_resume=False`` a run
    resumed from a checkpoint (``trainer.ckpt_path`` set) is left alone."""

    def __init__(
        self,
        *,
        at_step: NonNegativeInt,
        kind: Literal["exception", "sigterm", "sigusr1", "sigkill", "nan_weights", "hang",
                      "skip_collective", "wrong_shape", "slow", "freeze", "ctrl_c", "ctrl_c_twice"] = "exception",
        rank: NonNegativeInt | None = None,
        replica_group: NonNegativeInt | None = None,
        during: Literal["train", "validation", "save", "export", "summary"] = "train",
        after_resume: bool = False,
        delay_s: PositiveFloat = 1.0,
        for_steps: PositiveInt | None = None,
        record: str | None = None,
    ) -> None:
        self.at_step = at_step
        self.kind = kind
        self.rank = rank
        self.replica_group = replica_group
        self.during = during
        self.after_resume = after_resume
        self.delay_s = delay_s
        self.for_steps = for_steps
        self.record = record
        self._recorded = False
        self._fired = False
        self._skipped_at: int | None = None
        self._wait_from_step: int | None = None  # this rank's next collective would pair wrongly

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # NOTE: decided from the run's own state rather than TORCHELASTIC_RESTART_COUNT, so it
        # holds alike for torchrun restarts, requeued SLURM jobs and ckpt_path=auto by hand.
        if trainer.ckpt_path is not None and not self.after_resume:
            self._fired = True

    def _on_this_rank(self, trainer: Trainer) -> bool:
        """``rank`` (within its replica group under ``fault_tolerance=replicas``) of ``replica_group``:
        the group the replicas' callback was handed."""
        from litscale.reliability.replica_groups import ReplicaFaultTolerance

        if self.replica_group is not None:
            group = next((c.group for c in trainer.callbacks if isinstance(c, ReplicaFaultTolerance)), 0)
            if group != self.replica_group:
                return False
        return self.rank is None or trainer.global_rank == self.rank

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.during != "train" or self._fired:
            return
        step = trainer.global_step
        if self.kind == "wrong_shape" and step == self.at_step:
            self._sync_a_metric_of_the_wrong_shape(trainer)
        if not self._on_this_rank(trainer):
            return
        if self.kind == "slow" and step >= self.at_step and (
                self.for_steps is None or step < self.at_step + self.for_steps):
            self._record_firing(trainer)
            time.sleep(self.delay_s)
        elif self.kind == "hang" and step == self.at_step:
            self._record_firing(trainer)
            time.sleep(HANG_S)
        elif self.kind == "freeze" and step == self.at_step:
            self._record_firing(trainer)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "skip_collective" and step == self.at_step:
            self._record_firing(trainer)
            # DDP reads this flag in forward: the backward that follows reduces nothing here,
            # while the other ranks' gradient all-reduce waits for this rank.
            ddp_model(trainer).require_backward_grad_sync = False
            self._skipped_at = step
            self._wait_from_step = step + 1

    def _sync_a_metric_of_the_wrong_shape(self, trainer: Trainer) -> None:
        """Every rank all-reduces a metric of ``METRIC_SIZE`` values; on this fault's rank it is
        empty. gloo and NCCL return at once from an empty all-reduce, and the others wait for
        this rank's values."""
        import torch.distributed as dist

        wrong = self._on_this_rank(trainer)
        if wrong:
            self._record_firing(trainer)
        dist.all_reduce(torch.zeros(0 if wrong else METRIC_SIZE))
        if wrong:
            self._wait_from_step = trainer.global_step

    def on_after_fit(self, trainer: Trainer, work: str, collective: str | None = None) -> None:
        """The run's work after fit (``litscale.health.beats.after_fit``): ``kind=hang``
        with ``during`` that work hangs there."""
        if self.kind == "hang" and self.during == work and not self._fired and self._on_this_rank(trainer):
            self._fired = True
            self._record_firing(trainer)
            time.sleep(HANG_S)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        if self._wait_from_step is not None and trainer.global_step >= self._wait_from_step:
            # NOTE: the next gradient all-reduce of this rank would pair with the others'
            # previous one. NCCL then waits forever; gloo aborts the process at the first
            # collective whose size differs. Waiting here is NCCL's behaviour, on any backend.
            time.sleep(HANG_S)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._skipped_at is not None:
            ddp_model(trainer).require_backward_grad_sync = True
        if self.during == "train" and trainer.global_step == self.at_step and self.kind in INSTANT_KINDS:
            self._fire(trainer, pl_module, where="")

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if (self.kind == "slow" and self.during == "validation" and not trainer.sanity_checking
                and trainer.global_step >= self.at_step and self._on_this_rank(trainer)):
            self._record_firing(trainer)
            time.sleep(self.delay_s)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if (self.during == "validation" and not trainer.sanity_checking and self.kind in INSTANT_KINDS
                and trainer.global_step >= self.at_step):
            self._fire(trainer, pl_module, where=" in validation")

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Lightning builds the checkpoint on every rank, then the strategy writes it: a rank
        # that stops here leaves the others inside that save, waiting for its part.
        if self.during == "save" and trainer.global_step >= self.at_step and self.kind in INSTANT_KINDS:
            self._fire(trainer, pl_module, where=" in a checkpoint save")

    def _fire(self, trainer: Trainer, pl_module: LightningModule, *, where: str) -> None:
        if self._fired or not self._on_this_rank(trainer):
            return
        self._fired = True
        self._record_firing(trainer)
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
        if self.kind.startswith("ctrl_c"):
            # A terminal's Ctrl-C: SIGINT to every process of the job's group (run it in a group
            # of its own); the twice kind presses it again ``delay_s`` later.
            os.killpg(os.getpgid(0), signal.SIGINT)
            if self.kind == "ctrl_c_twice":
                time.sleep(self.delay_s)
                os.killpg(os.getpgid(0), signal.SIGINT)
            return
        # A scheduler's preemption signal reaches the whole job: under litscale's launcher (or
        # torchrun) that is the agent, which passes it on to every rank.
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ
        stop_signal = signal.SIGUSR1 if self.kind == "sigusr1" else signal.SIGTERM
        os.kill(os.getppid() if under_agent else os.getpid(), stop_signal)

    def _record_firing(self, trainer: Trainer) -> None:
        """The first time the fault acts: its line in ``record`` (written before a fault that
        ends or stops this process)."""
        if self.record is None or self._recorded:
            return
        self._recorded = True
        line = {"kind": self.kind, "step": trainer.global_step, "rank": trainer.global_rank, "time": time.time()}
        with open(self.record, "a") as handle:
            handle.write(json.dumps(line) + "\n")


# The values of the metric ``kind=wrong_shape`` all-reduces.
METRIC_SIZE = 4

# The kinds that act once, at the end of step ``at_step``; the others stall a step.
INSTANT_KINDS = ("exception", "sigterm", "sigusr1", "sigkill", "nan_weights", "ctrl_c", "ctrl_c_twice")


def ddp_model(trainer: Trainer) -> Any:
    """The rank's ``DistributedDataParallel`` module, which ``kind=skip_collective`` needs."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(trainer.strategy, "model", None)
    if not isinstance(model, DistributedDataParallel):
        raise ValueError("callbacks.fault.kind=skip_collective needs a DDP strategy (strategy=ddp); "
                         f"got {type(trainer.strategy).__name__}")
    return model
