"""The Hydra job behind ``train.py``: errors a user can act on become one line and an exit code."""

from __future__ import annotations

import sys
import traceback

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
    except RankFailure as error:  # its traceback was printed by the launcher
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Exception as error:  # a single-process run: the same report as a failed rank
        traceback.print_exc()
        print(f"error: {type(error).__name__}: {str(error).strip().splitlines()[0]}",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if summary.get("preempted"):
        steps = f" after {summary['steps']} steps" if "steps" in summary else ""
        print(f"litscale: preempted{steps}; last.ckpt saved; run again with ckpt_path=auto to "
              "resume", flush=True)
        return None
    return summary.get("val/loss")
