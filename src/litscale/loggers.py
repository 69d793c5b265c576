"""Logger factories for what Lightning's loggers leave to the user: W&B offline without a
key, one W&B group per sweep, and a resumed run that continues its W&B run; and the steps at
which the loggers write, so per-step values are logged only when someone reads them."""

from __future__ import annotations

import glob
import netrc
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer

from litscale.extras import WANDB


def is_logging_step(trainer: Trainer | None, step: int | None = None) -> bool:
    """Whether the loggers write the values logged for optimizer step ``step`` (1-based; by
    default the step in progress, ``global_step + 1``): every ``log_every_n_steps``, and the
    last step, whose values the summary reads. True without a trainer (log as Lightning would).

    NOTE: one ``LightningModule.log`` costs about 0.35 ms of Python on a CPU core (Lightning
    moves its result objects to the value's device on every call), 5-10% of a small model's
    step; a value logged between logging steps is overwritten unread.
    """
    if trainer is None or trainer.log_every_n_steps <= 1:
        return True
    step = trainer.global_step + 1 if step is None else step
    # NOTE: every rank must decide alike: the module averages the logged loss over the ranks (a
    # collective). The epoch's last batch is one process's only: federated clients hold
    # different numbers of batches, so their epochs end at different steps (a rank that logged
    # there waited in the loss's all-reduce while the others averaged parameters: a hang).
    last_of_epoch = trainer.is_last_batch and trainer.world_size == 1
    return step % trainer.log_every_n_steps == 0 or last_of_epoch or 0 < trainer.max_steps <= step


def log_to_loggers(trainer: Trainer, metrics: dict[str, float | str]) -> None:
    """Write ``metrics`` of the batch that just ended straight to the loggers (rank 0 only, as
    Lightning's loggers do), in the row of that optimizer step.

    NOTE: for final per-interval figures (throughput, bytes sent), which need no reduction
    across ranks or steps. ``LightningModule.log_dict`` would pass each key through
    Lightning's result collection, about 0.35 ms of Python per key: the throughput figures
    alone took 3-5% of a tiny model's training loop (experiments/bench). Lightning logs a
    batch's values under its count of stepped batches, one behind ``global_step`` once the
    step is taken. Only numbers go to the loggers (TensorBoard's refuses a string); what a
    figure's words say (``perf/mfu_provisional``) reaches ``summary.json`` and the run's lines.
    """
    numbers = {name: value for name, value in metrics.items() if not isinstance(value, str)}
    for logger in trainer.loggers:
        logger.log_metrics(numbers, step=trainer.global_step - 1)


def wandb_api_key_configured() -> bool:
    """True when W&B can authenticate: ``WANDB_API_KEY`` or a ``wandb login`` netrc entry."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_logger(
    *,
    save_dir: str,
    project: str = "litscale",
    name: str | None = None,
    group: str | None = None,
    offline: bool | None = None,
    id: str | None = None,
):
    """A ``WandbLogger`` that runs offline when no API key is configured, so nothing breaks
    without network or account. wandb is imported only here, when this logger is chosen.
    ``id`` continues that W&B run (set from the checkpoint when a run resumes)."""
    from lightning.pytorch.loggers import WandbLogger

    if offline is None:
        offline = not wandb_api_key_configured()
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(save_dir=save_dir, project=project, name=name, group=group, offline=offline,
                       id=id, resume="allow" if id else None)


wandb_logger.requires = (WANDB,)  # litscale.extras: checked before any run dir exists


class WandbRunId(Callback):
    """Keeps the W&B run id in every checkpoint, so a resumed run logs to the same W&B run."""

    def __init__(self) -> None:
        self.run_id: str | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        from lightning.pytorch.loggers import WandbLogger

        logger = next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)
        if logger is not None and trainer.is_global_zero:
            self.run_id = logger.experiment.id

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}


def wandb_run_id_in_checkpoint(path: str) -> str | None:
    """The W&B run id a checkpoint was written under, if it kept one (``WandbRunId``)."""
    import torch

    if os.path.isdir(path):  # sharded: Lightning's meta.pt (DCP) or DeepSpeed's model states
        candidates = [os.path.join(path, "meta.pt"),
                      *glob.glob(os.path.join(glob.escape(path), "*", "mp_rank_00_model_states.pt"))]
        path = next((p for p in candidates if os.path.isfile(p)), "")
    if not os.path.isfile(path):
        return None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - a checkpoint we cannot read just starts a new W&B run
        return None
    states = checkpoint.get("callbacks", {}) if isinstance(checkpoint, dict) else {}
    return next((state.get("run_id") for key, state in states.items()
                 if "WandbRunId" in str(key) and isinstance(state, dict)), None)
