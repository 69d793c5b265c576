"""The Hydra job behind ``train.py``: errors a user can act on become one line and an exit code."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from litscale.errors import ConfigError
from litscale.launch import RankFailure
from litscale.preflight import EXIT_BAD_CONFIG


def run_job(cfg: DictConfig) -> float | None:
    """Train one job; return its final validation loss, or exit non-zero with one line."""
    from litscale.run import train

    try:
        summary = train(cfg)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_CONFIG) from None
    except RankFailure as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    return summary.get("val/loss")
