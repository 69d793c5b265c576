"""Train from Hydra config groups: ``python train.py strategy=ddp trainer.devices=2``.

The command line is checked first (every job of a sweep included), so a bad config fails
in one line before Hydra creates a run dir or any rank starts. Under ``torchrun`` or ``srun``
each rank runs this script; see ``litscale.app.launch`` for how they share one run dir.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

CONFIG_DIR = str(Path(__file__).resolve().parent / "conf")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    """One Hydra job; returns the final validation loss (for Hydra sweepers)."""
    from litscale.app.cli import run_job

    return run_job(cfg)


if __name__ == "__main__":
    # Before litscale's first import: torchmetrics (through Lightning) then skips transformers
    # and scipy here and in every rank this starts, about 3 s each (litscale/torchmetrics_backends.py).
    os.environ.setdefault("LITSCALE_SKIP_TORCHMETRICS_BACKENDS", "1")
    from litscale.app.preflight import check_command_line, skip_jobs
    from litscale.app.scaling_study import THREADS_ENV, baseline_first, threads_per_rank_of_sweep

    sys.argv[1:] = baseline_first(sys.argv[1:])  # a device sweep runs its 1-device baseline first
    threads = threads_per_rank_of_sweep(sys.argv[1:], cores=len(os.sched_getaffinity(0)))
    if threads and THREADS_ENV not in os.environ:  # like-for-like threads in every job
        os.environ[THREADS_ENV] = str(threads)
    # A device sweep's cells that cannot run (strategy=single at 2 devices) are named and left out.
    skip_jobs(check_command_line(sys.argv[1:], config_dir=CONFIG_DIR, config_name="train"))
    # Under torchrun/srun every rank composes its own config: agree on one run dir first.
    from litscale.app.launch import prepare_external_rank  # imports torch: after the cheap checks

    sys.argv += prepare_external_rank()
    main()
