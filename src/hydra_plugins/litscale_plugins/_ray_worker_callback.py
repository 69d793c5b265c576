"""The callback each Ray Train job runs with (``ray_worker``): a SIGTERM handed to the job's
``PreemptionCheckpoint``, checkpoints copied to URI storage as rank 0 publishes them."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from hydra_plugins.litscale_plugins import _ray_worker_state as state
from hydra_plugins.litscale_plugins.ray_storage import CHECKPOINTS


class RayWorkerCallback(Callback):
    """Added to each Ray job's callbacks: hands a SIGTERM the worker took to the job's
    ``PreemptionCheckpoint``, copies each checkpoint rank 0 publishes to URI storage as it
    appears, and notes whether the run stopped to save."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if state.stop_requested.is_set():
            for callback in preemption_callbacks(trainer):
                callback.signalled = True
        if state.stored_run_dir is not None and trainer.is_global_zero:
            state.stored_run_dir.upload_changed(CHECKPOINTS)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # NOTE: here, not in teardown: Lightning ends a run its stop flag ended (SIGTERMException)
        # through on_exception, and calls no callback's teardown then. This callback comes after
        # the job's PreemptionCheckpoint, whose on_exception has saved by now.
        if any(callback.saved_path for callback in preemption_callbacks(trainer)):
            state.stopped_at_step = trainer.global_step


def preemption_callbacks(trainer: Trainer) -> list[Any]:
    from litscale.callbacks.preemption import PreemptionCheckpoint

    return [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
