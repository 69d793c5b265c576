"""Hydra's basic sweeper, less the jobs of a device sweep that ``train.py`` skips.

``python train.py -m trainer.devices=1,2 strategy=single,ddp`` is a grid; one of its cells,
``strategy=single`` at 2 devices, cannot run. ``litscale.app.preflight`` finds such cells
before Hydra starts, prints one line for each, and names them in ``LITSCALE_SKIPPED_JOBS``
(a JSON list of override lists); this sweeper runs the grid without them, numbering the jobs
it runs 0, 1, ... as Hydra's does. Without that variable it is Hydra's ``BasicSweeper``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override

from litscale.app.preflight import SKIPPED_JOBS_ENV


class SkippingSweeper(BasicSweeper):
    """``BasicSweeper`` that leaves out the jobs ``train.py`` named in ``LITSCALE_SKIPPED_JOBS``."""

    def __init__(self, max_batch_size: int | None, params: dict[str, str] | None = None) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        # Popped: the list belongs to this command line, not to sweeps its jobs may start.
        self.skipped = {frozenset(job) for job in json.loads(os.environ.pop(SKIPPED_JOBS_ENV, "[]"))}

    def split_arguments(self, overrides: list[Override], max_batch_size: int | None) -> list[Any]:
        """The batches of jobs of ``BasicSweeper``, without the skipped jobs."""
        batches = BasicSweeper.split_arguments(overrides, max_batch_size)
        kept = [[job for job in batch if frozenset(job) not in self.skipped] for batch in batches]
        return [batch for batch in kept if batch]
