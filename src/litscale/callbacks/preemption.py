"""Saving a checkpoint when the job is told to stop (SIGTERM, or SIGUSR1 as SLURM sends it,
or Ctrl-C).

Every rank stops after the same optimizer step, saves ``last.ckpt`` there with the others,
and the run exits cleanly, so ``ckpt_path=auto`` resumes exactly where it stopped. A second
Ctrl-C stops at once without saving (exit 1), and names the newest complete checkpoint there is.

A SIGINT that comes because the launcher died (its death signal, ``litscale.health.launcher``) is
named as that, not as a Ctrl-C: the ranks, which still reach each other, stop after a step they
agree on and save as for SIGTERM, then exit; where that save cannot be made (a peer gone too), one
line says so and names the checkpoint that remains, and the rank exits at once with code 1.

NOTE: Lightning's own handling is not used as it is: each rank's handler sets that rank's
flag, which Lightning reads in several places (the end of a batch, of an epoch, inside
validation) besides the per-batch broadcast of rank 0's flag, and it broadcasts from inside
the signal handler too. Ranks signalled a moment apart then stop at different places and no
checkpoint is written (seen in about 1 run in 3 with 2 CPU ranks). Here the handler only
notes the signal; the ranks agree on it at a step boundary, through the strategy's
``reduce_boolean_decision``, and only then raise Lightning's flag on every rank at once, so
Lightning stops them all at the end of that same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from litscale.checkpoint.background import wait_for_checkpoints
from litscale.checkpoint.resume import newest_last_checkpoint
from litscale.constraints import PositiveInt
from litscale.health.launcher import launcher_lost, launcher_pid, note_told_to_stop

# A Ctrl-C this soon after the first is the same keypress passed on, not the user's second:
# the terminal signals every process of the job, and torch's elastic agent then passes the
# SIGINT it got on to the ranks too.
SAME_CTRL_C_S = 1.0


class PreemptionCheckpoint(Callback):
    """On SIGTERM/SIGUSR1 (on any rank): every rank stops after the same step and saves
    ``<dirpath>/last.ckpt``.

    With several ranks they agree every ``check_every_n_steps`` optimizer steps (a small
    collective and a host sync; Lightning does one before every batch); a scheduler's grace
    period (SLURM's default is 30 s, often set to minutes) leaves room for that many steps.
    A single process stops after the step in which the signal came.
    """

    def __init__(self, *, dirpath: str, handle_sigusr1: bool = True,
                 check_every_n_steps: PositiveInt = 10) -> None:
        self.dirpath = dirpath
        self.handle_sigusr1 = handle_sigusr1
        self.check_every_n_steps = check_every_n_steps
        self.saved_path: str | None = None
        self.signalled = False  # this rank got a stop signal
        self.launcher_lost = False  # ... and it was the launcher's death signal
        self.stopping = False  # the ranks agreed to stop
        self._checked_at_step = -1
        self._saved_at_step = -1
        self._trainer: Trainer | None = None
        self._first_ctrl_c: float | None = None  # when the first Ctrl-C came (monotonic seconds)
        self._announced = False
        self._said_no_save = False
        self._previous_sigint = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here, not in on_fit_start: Lightning registers its handlers between the two. A signal
        # its handler took during start-up is put to the other ranks like any other.
        self._trainer, self.signalled, self.stopping = trainer, trainer.received_sigterm, False
        _set_lightning_stop_flag(trainer, False)
        self._checked_at_step = trainer.global_step
        for signum in self._stop_signals(trainer):
            signal.signal(signum, self._on_signal)  # Lightning's teardown restores the originals
        if threading.current_thread() is threading.main_thread():
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_signal)  # restored in teardown
        disable_lightning_sigterm_broadcast(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def _stop_signals(self, trainer: Trainer) -> list[signal.Signals]:
        if threading.current_thread() is not threading.main_thread():
            # Only the main thread may take signals; a rank run in a worker thread (Ray Train's)
            # is stopped by its engine, as Lightning's own connector also assumes.
            return []
        signals = [signal.SIGTERM]
        # SIGUSR1 stays with SLURM's auto-requeue when that is in charge (it saves and requeues).
        environment = trainer._accelerator_connector.cluster_environment
        slurm_requeues = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        if self.handle_sigusr1 and not slurm_requeues and hasattr(signal, "SIGUSR1"):
            signals.append(signal.SIGUSR1)
        return signals

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and launcher_lost():
            self.launcher_lost = True  # not a Ctrl-C: no second one will come to stop at once
        elif signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_ctrl_c is not None and now - self._first_ctrl_c > SAME_CTRL_C_S:
                raise KeyboardInterrupt  # the user's second Ctrl-C: stop at once, without saving
            self._first_ctrl_c = self._first_ctrl_c or now
        else:
            note_told_to_stop()  # a rank that fails before the step boundary exits at once (``wait_for_the_cause``)
        first = not self.signalled
        self.signalled = True
        launcher = self._trainer.strategy.launcher if self._trainer is not None else None
        if first and launcher is not None:
            launcher.kill(signum)  # processes Lightning itself started get it too, as in Lightning

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if self._first_ctrl_c is not None and not self._announced and launcher_lost():
            self.launcher_lost, self._first_ctrl_c = True, None  # it came as its launcher began to exit
        if self.launcher_lost and not self._announced:  # said here: not from a signal handler
            self._announced = True
            if trainer.local_rank == 0:  # a launcher starts a node's ranks: one line per launcher lost
                print(f"litscale: launcher lost: the process that started the ranks (pid {launcher_pid()}) is gone, "
                      "and the job's store with it (their SIGINT is its death signal, not a Ctrl-C); stopping "
                      "after a step every rank agrees on to save last.ckpt, then exiting", file=sys.stderr,
                      flush=True)
        if self._first_ctrl_c is not None and not self._announced:
            self._announced = True
            rank_zero_info("litscale: Ctrl-C: stopping after a step every rank agrees on and saving last.ckpt; "
                           "Ctrl-C again to stop at once without saving")
        step = trainer.global_step
        if self.stopping or step == self._checked_at_step:
            return  # already stopping, or a batch that only accumulated gradients
        self._checked_at_step = step
        if trainer.world_size > 1 and step % self.check_every_n_steps:
            return
        if trainer.strategy.reduce_boolean_decision(self.signalled, all=False):
            self.stopping = True
            _set_lightning_stop_flag(trainer, True)  # Lightning stops at the end of this batch

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A validation due at this step finishes first: Lightning would stop it at its first
        # batch (and the checkpoint would then be taken mid-validation).
        if self.stopping and not trainer.sanity_checking:
            _set_lightning_stop_flag(trainer, False)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.stopping and not trainer.sanity_checking:
            # NOTE: saved here, where ModelCheckpoint saves, and not after the step: Lightning's
            # restore takes a checkpoint of a step that validated for one saved at the end of that
            # validation, before the loop counts the step as logged, and counts it again on resume.
            # Saved after the step instead, the resumed run logged every step one step late.
            self._save(trainer)
            _set_lightning_stop_flag(trainer, True)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.launcher_lost and not isinstance(exception, SIGTERMException):
            self._say_no_save(trainer, exception)  # the stop failed: a peer gone too, or its save
            return
        if isinstance(exception, KeyboardInterrupt) and self._first_ctrl_c is not None:
            newest = newest_last_checkpoint(os.path.dirname(self.dirpath))
            kept = (f"the newest complete checkpoint is {newest} (ckpt_path=auto resumes from it)" if newest
                    else f"no complete checkpoint in {self.dirpath}: a rerun starts from step 0")
            rank_zero_info(f"litscale: stopped at step {trainer.global_step} by a second Ctrl-C, without saving; "
                           f"{kept}")
            return
        if not isinstance(exception, SIGTERMException) or trainer.sanity_checking:
            return
        if self._saved_at_step != trainer.global_step:  # not saved at this step's validation
            self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        self.saved_path, self._saved_at_step = os.path.join(self.dirpath, "last.ckpt"), trainer.global_step
        try:
            # Every rank: sharded strategies save together. The full state (optimizer, loops), to resume.
            trainer.save_checkpoint(self.saved_path, weights_only=False)
            wait_for_checkpoints(trainer.strategy)  # on disk before the line says so, and the job ends
        except Exception as error:
            if self.launcher_lost:
                self.saved_path = None
                self._say_no_save(trainer, error)
            raise
        cause = "after its launcher was lost" if self.launcher_lost else "on a termination signal"
        rank_zero_info(f"litscale: stopping at step {trainer.global_step} {cause}; "
                       f"saved {self.saved_path} (resume with ckpt_path=auto)")

    def _say_no_save(self, trainer: Trainer, error: BaseException) -> None:
        """Once, on a node's first rank: the ranks could not stop together and save without their
        launcher; the checkpoint that remains."""
        if self._said_no_save or trainer.local_rank != 0:
            return
        self._said_no_save = True
        newest = newest_last_checkpoint(os.path.dirname(self.dirpath))
        kept = (f"the newest complete checkpoint is {newest} (ckpt_path=auto resumes from it)" if newest
                else f"no complete checkpoint in {self.dirpath}: a rerun starts from step 0")
        cause = f"{type(error).__name__}: {error}".splitlines()[0]
        print(f"litscale: launcher lost, and no save is possible at step {trainer.global_step} without it ({cause}); "
              f"{kept}; exiting with code 1", file=sys.stderr, flush=True)


def _set_lightning_stop_flag(trainer: Trainer, value: bool) -> None:
    # NOTE: private: Lightning reads it (``trainer.received_sigterm``) to stop at the end of
    # the batch, and exposes no setter.
    trainer._signal_connector.received_sigterm = value


def disable_lightning_sigterm_broadcast(trainer: Trainer) -> None:
    """Drop the broadcast of rank 0's SIGTERM flag that Lightning's training loop does before
    every batch of a multi-rank run: a collective and a host sync per step (which on a GPU
    stops the CPU from queueing the next step's kernels early), made redundant by the ranks'
    own agreement above. Without the (private) hook, as in another Lightning version, nothing
    is changed."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = _no_broadcast


def _no_broadcast() -> None:
    """Stands in for Lightning's per-batch broadcast of the SIGTERM flag."""
