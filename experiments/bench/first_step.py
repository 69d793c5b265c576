"""A benchmark-only callback: the wall-clock time (``time.time()``) at which the first optimizer
step of a run ended, written to a file, so the start-up benchmark can subtract the time it
launched ``python train.py``. Added from the command line:

    PYTHONPATH=experiments/bench python train.py allowed_targets=[first_step] \
        +callbacks.first_step._target_=first_step.FirstStepTime +callbacks.first_step.path=t.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lightning.pytorch import Callback


class FirstStepTime(Callback):
    """Writes ``{"first_step_end": <epoch seconds>}`` to ``path`` after the first optimizer step."""

    def __init__(self, *, path: str) -> None:
        self.path = path
        self.written = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.written and trainer.global_step >= 1 and trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"first_step_end": time.time()}))
            self.written = True
