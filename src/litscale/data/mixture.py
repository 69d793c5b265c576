"""Several sources drawn at chosen weights: one order, the same on every layout.

An epoch of the mixture is ``length`` samples. Source ``s`` (weight ``w_s``, the weights summing
to 1) is due at the times ``(k + phase_s) / w_s``, ``k = 0, 1, ...`` (``phase_s`` drawn from the
seed); merging every source's times in order gives the interleave, in which each source's count
over any first ``n`` samples is within one of ``w_s n``: the realised shares match the weights at
every scale (10,000 samples: within 0.01%), not only on average. The ``k``-th time a source is
drawn it gives its next row of a seeded permutation of its rows, a new permutation each time it
runs out (a small source is repeated, a large one not exhausted).

The order is a pure function of the seed, the weights, the sources' sizes and the global sample
position: a resume at a global position (``litscale.data.resume``) continues every source exactly
where it stopped, on any layout. The checkpoint's data state records each source's draws too
(``positions``), so a resume whose sources or weights changed is refused instead of silently
drawing other rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from litscale.data.token_batch import SampleKey, TokenBatch, sample_key


def interleave(weights: Sequence[float], length: int, seed: int) -> np.ndarray:
    """The source of each of ``length`` samples (module docstring)."""
    weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    phases = np.random.default_rng(seed).random(len(weights))
    times, owners = [], []
    for source, (weight, phase) in enumerate(zip(weights, phases, strict=True)):
        if weight <= 0:
            continue
        k = np.arange(int(np.ceil(length * weight)) + 2)
        times.append((k + phase) / weight)
        owners.append(np.full(len(k), source))
    order = np.argsort(np.concatenate(times), kind="stable")
    return np.concatenate(owners)[order][:length]


class MixtureRows(Dataset):
    """The mixture of ``sources`` (datasets of ``TokenBatch`` rows with ``counted_tokens``) at
    ``weights``: sample ``i`` of data epoch ``e`` is a row of source ``interleave(...)[i]``.
    ``len`` is ``length``, one epoch of the mixture."""

    def __init__(self, sources: Sequence[Dataset], weights: Sequence[float], *, length: int, seed: int,
                 seq_len: int) -> None:
        if any(len(source) == 0 for source in sources):
            raise ValueError("data.sources: a source has no training rows")
        self.sources, self.weights, self.length, self.seed, self.seq_len = list(sources), list(weights), length, seed, seq_len
        self.owner = interleave(weights, length, seed)
        # the how-many-th draw of its source each sample is, within the epoch
        self.occurrence = np.zeros(length, dtype=np.int64)
        for source in range(len(sources)):
            mine = self.owner == source
            self.occurrence[mine] = np.arange(int(mine.sum()))
        self.per_epoch = np.bincount(self.owner, minlength=len(sources))

    def __len__(self) -> int:
        return self.length

    def row_of(self, index: int, epoch: int) -> tuple[int, int]:
        """(source, row of that source) of sample ``index`` of data epoch ``epoch``."""
        source = int(self.owner[index])
        draw = epoch * int(self.per_epoch[source]) + int(self.occurrence[index])
        return source, int(self._permutation(source, draw // len(self.sources[source]))[draw % len(self.sources[source])])

    def _permutation(self, source: int, round_: int) -> np.ndarray:
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + source) * 65_537 + round_)
        return torch.randperm(len(self.sources[source]), generator=generator).numpy()

    def counted_tokens(self, epoch: int = 0) -> np.ndarray:
        return self._per_sample(epoch, "counted_tokens")

    def real_tokens(self, epoch: int = 0) -> np.ndarray:
        return self._per_sample(epoch, "real_tokens")

    def attended_tokens(self, epoch: int = 0) -> np.ndarray:
        return self._per_sample(epoch, "attended_tokens")

    def _per_sample(self, epoch: int, name: str) -> np.ndarray:
        values = np.empty(self.length, dtype=np.int64)
        for source, dataset in enumerate(self.sources):
            mine = np.flatnonzero(self.owner == source)
            draws = epoch * int(self.per_epoch[source]) + self.occurrence[mine]
            size = len(dataset)
            rounds = draws // size
            rows = np.empty(len(mine), dtype=np.int64)
            for round_ in np.unique(rounds):
                at = rounds == round_
                rows[at] = self._permutation(source, int(round_))[draws[at] % size]
            values[mine] = getattr(dataset, name)()[rows]
        return values

    def positions(self, epoch: int, samples: int) -> list[int]:
        """How many rows each source has given once ``samples`` of data epoch ``epoch`` are drawn:
        its position, as the checkpoint's data state records it."""
        drawn = np.bincount(self.owner[:samples], minlength=len(self.sources))
        return [int(epoch * self.per_epoch[s] + drawn[s]) for s in range(len(self.sources))]

    def __getitem__(self, key: int | SampleKey) -> TokenBatch:
        key = sample_key(key)
        source, row = self.row_of(key.index, key.epoch)
        return self.sources[source][SampleKey(row, 0, key.counted_fraction)]
