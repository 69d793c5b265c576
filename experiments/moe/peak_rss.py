"""A callback for the context-parallel runs of ``run.py``: each rank's resident memory.

litscale's memory callback measures the states a rank holds (parameters, gradients, optimizer
state) and, on CUDA, the allocator's peak; on a CPU there is no allocator high-water mark, and
activations are what context parallel divides. The kernel keeps one per process (``VmHWM``, the
peak resident set), so this reads it at the end of training, with the resident set at the
start of training, and writes both to ``<run dir>/peak_rss/rank<N>.json``. Added to a run with
``+callbacks.peak_rss._target_=peak_rss.PeakRSS allowed_targets=[peak_rss]`` and this folder on
``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer


def status_kib(field: str) -> int:
    """One ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRSS(Callback):
    """Writes this rank's resident set at the start of training and its peak at the end."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_kib = status_kib("VmRSS")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = Path(trainer.default_root_dir) / "peak_rss"
        folder.mkdir(parents=True, exist_ok=True)
        figures = {
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "rss_at_train_start_bytes": 1024 * self._start_kib,
            "peak_rss_bytes": 1024 * status_kib("VmHWM"),
        }
        (folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(figures) + "\n")
