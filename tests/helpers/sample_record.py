"""Which samples a run trained: each rank's sample indices, step by step, as its sampler drew
them (for the tests that check a resume's samples against the order's arithmetic)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from lightning.pytorch import Callback


class _Drawn:
    """A sampler that notes each index it hands the loader (everything else is the sampler's)."""

    def __init__(self, sampler: Any, drawn: list[int]) -> None:
        self.sampler, self.drawn = sampler, drawn

    def __iter__(self) -> Iterator[int]:
        for index in self.sampler:
            self.drawn.append(int(index))
            yield index

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


class SampleRecord(Callback):
    """Appends ``{"rank", "step", "indices"}`` per trained micro batch to ``<path>/rank<r>.jsonl``
    (``step``: the optimizer steps done before it).

    NOTE: the loader's fetcher draws a batch ahead of the one trained, so the ``k``-th trained
    micro batch is found as the ``k``-th batch of what the sampler handed out, not its last."""

    def __init__(self, *, path: str) -> None:
        self.path = path
        self.drawn: list[int] = []
        self.trained = 0
        self.batch_size = 1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        batch_sampler = trainer.train_dataloader.batch_sampler
        self.batch_size = batch_sampler.batch_size
        batch_sampler.sampler = _Drawn(batch_sampler.sampler, self.drawn)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        start = self.trained * self.batch_size
        indices = self.drawn[start:start + self.batch_size]
        self.trained += 1
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, f"rank{trainer.global_rank}.jsonl"), "a") as handle:
            handle.write(json.dumps({"rank": trainer.global_rank, "step": trainer.global_step,
                                     "indices": indices}) + "\n")
