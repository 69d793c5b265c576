"""Logger factories for what Lightning's loggers leave to the user: W&B offline without a
key, one W&B group per sweep, and a resumed run that continues its W&B run."""

from __future__ import annotations

import glob
import netrc
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer


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


def prepare_wandb(config: dict, *, sweep_dir: str | None) -> None:
    """Group a sweep's W&B runs by sweep, and continue the W&B run of a resumed checkpoint."""
    node = (config.get("logger") or {}).get("wandb")
    if not isinstance(node, dict):
        return
    if sweep_dir and not node.get("group"):
        node["group"] = f"{config.get('name', 'litscale')}-{os.path.basename(sweep_dir.rstrip('/'))}"
    if config.get("ckpt_path") and not node.get("id"):
        node["id"] = wandb_run_id_in_checkpoint(config["ckpt_path"])


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
