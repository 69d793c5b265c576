"""Logger factories for what Lightning's loggers leave to the user."""

from __future__ import annotations

import netrc
import os
from pathlib import Path


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
):
    """A ``WandbLogger`` that runs offline when no API key is configured, so nothing breaks
    without network or account. wandb is imported only here, when this logger is chosen."""
    from lightning.pytorch.loggers import WandbLogger

    if offline is None:
        offline = not wandb_api_key_configured()
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(save_dir=save_dir, project=project, name=name, group=group, offline=offline)
