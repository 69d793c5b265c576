"""Saving a checkpoint when the job is told to stop (SIGTERM, or SIGUSR1 as SLURM sends it).

Lightning already turns SIGTERM into ``SIGTERMException`` at the next batch boundary on every
rank (rank 0's flag is broadcast each step), and calls ``on_exception`` on every rank. This
callback saves ``last.ckpt`` there, so ``ckpt_path=auto`` resumes from that step, and routes
SIGUSR1 to the same path when SLURM's own requeue handler is not in charge of it.
"""

from __future__ import annotations

import itertools
import os
import signal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from litscale.constraints import PositiveInt


class PreemptionCheckpoint(Callback):
    """On SIGTERM/SIGUSR1: save ``<dirpath>/last.ckpt`` and let the run stop cleanly.

    With several ranks, whether rank 0 got the signal is shared every ``check_every_n_batches``
    training batches (Lightning does it before every batch).
    """

    def __init__(self, *, dirpath: str, handle_sigusr1: bool = True,
                 check_every_n_batches: PositiveInt = 10) -> None:
        self.dirpath = dirpath
        self.handle_sigusr1 = handle_sigusr1
        self.check_every_n_batches = check_every_n_batches
        self.saved_path: str | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning registers its SIGTERM handler before fit starts; SIGUSR1 gets the same
        # one unless SLURM auto-requeue owns it (it then saves and requeues by itself).
        environment = trainer._accelerator_connector.cluster_environment
        slurm_requeues = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        if self.handle_sigusr1 and not slurm_requeues and hasattr(signal, "SIGUSR1"):
            signal.signal(signal.SIGUSR1, signal.getsignal(signal.SIGTERM))
        thin_out_sigterm_checks(trainer, self.check_every_n_batches)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.sanity_checking:
            return
        self.saved_path = os.path.join(self.dirpath, "last.ckpt")
        trainer.save_checkpoint(self.saved_path)  # every rank: sharded strategies save together
        rank_zero_info(f"litscale: stopping at step {trainer.global_step} on a termination signal; "
                       f"saved {self.saved_path} (resume with ckpt_path=auto)")


def thin_out_sigterm_checks(trainer: Trainer, every_n_batches: int) -> None:
    """Share rank 0's SIGTERM flag every ``every_n_batches`` training batches instead of before
    every batch.

    NOTE: Lightning's training loop broadcasts the flag and reads it back with ``.item()``
    before each batch of a multi-rank run: a collective and a host synchronisation per step,
    which on a GPU stops the CPU from queueing the next step's kernels early. A scheduler's
    grace period (SLURM's default is 30 s, often set to minutes) leaves room for a few steps.
    Every rank counts the same batches, so all still check at the same ones. Without the
    (private) hook, as in another Lightning version, Lightning's own check stays as it is.
    """
    loop = trainer.fit_loop.epoch_loop
    check = getattr(loop, "_broadcast_sigterm_tensor", None)
    if check is None or every_n_batches <= 1 or "_broadcast_sigterm_tensor" in vars(loop):
        return  # absent, not asked for, or already thinned out (a second fit)
    batches = itertools.count()

    def check_every_n() -> None:
        if next(batches) % every_n_batches == 0:
            check()

    loop._broadcast_sigterm_tensor = check_every_n
