"""Saving a checkpoint when the job is told to stop (SIGTERM, or SIGUSR1 as SLURM sends it).

Lightning already turns SIGTERM into ``SIGTERMException`` at the next batch boundary on every
rank (rank 0's flag is broadcast each step), and calls ``on_exception`` on every rank. This
callback saves ``last.ckpt`` there, so ``ckpt_path=auto`` resumes from that step, and routes
SIGUSR1 to the same path when SLURM's own requeue handler is not in charge of it.
"""

from __future__ import annotations

import os
import signal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class PreemptionCheckpoint(Callback):
    """On SIGTERM/SIGUSR1: save ``<dirpath>/last.ckpt`` and let the run stop cleanly."""

    def __init__(self, *, dirpath: str, handle_sigusr1: bool = True) -> None:
        self.dirpath = dirpath
        self.handle_sigusr1 = handle_sigusr1
        self.saved_path: str | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning registers its SIGTERM handler before fit starts; SIGUSR1 gets the same
        # one unless SLURM auto-requeue owns it (it then saves and requeues by itself).
        environment = trainer._accelerator_connector.cluster_environment
        slurm_requeues = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        if self.handle_sigusr1 and not slurm_requeues and hasattr(signal, "SIGUSR1"):
            signal.signal(signal.SIGUSR1, signal.getsignal(signal.SIGTERM))

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.sanity_checking:
            return
        self.saved_path = os.path.join(self.dirpath, "last.ckpt")
        trainer.save_checkpoint(self.saved_path)  # every rank: sharded strategies save together
        rank_zero_info(f"litscale: stopping at step {trainer.global_step} on a termination signal; "
                       f"saved {self.saved_path} (resume with ckpt_path=auto)")
