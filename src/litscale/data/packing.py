"""Rows of examples: one example per row, padded, or several packed into a row.

An example of ``n`` tokens trains on ``n - 1`` positions (each token predicts the next); a row
holds ``seq_len`` positions. One longer than that is cut to its first ``seq_len`` positions
(``overlong=truncate``) or left out (``drop``); one that trains on nothing (none of its targets
is an assistant's token, as after a cut) is left out. ``pack=true`` fills rows by best fit
decreasing (the longest example first, into the row it leaves least room in), deterministic;
each example keeps its own positions from 0 (``litscale.data.token_batch``), and the rest of a
row is padding that nothing is trained on.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from litscale.data.sft_cache import ExampleCache
from litscale.data.token_batch import (
    IGNORE_INDEX,
    SampleKey,
    TokenBatch,
    document_positions,
    sample_key,
)

Overlong = Literal["truncate", "drop"]


@dataclass
class Examples:
    """Examples of a cache taken for one split: where each starts in the cache and how many
    tokens of it are used; what was cut or left out, counted for the summary."""

    starts: np.ndarray
    lengths: np.ndarray  # tokens used: positions + 1
    counts: dict[str, int] = field(default_factory=dict)


def take_examples(cache: ExampleCache, chosen: np.ndarray, seq_len: int, overlong: Overlong, *,
                  windows: bool = False) -> Examples:
    """The examples ``chosen`` (indices into ``cache``), fitted to rows of ``seq_len`` positions:
    cut or dropped (``overlong``), or for a text source (``windows``) split into windows that
    train on every token once; those with nothing to train on left out."""
    starts, ends = cache.starts[:-1][chosen], cache.starts[1:][chosen]
    counts = {"examples": len(chosen), "truncated": 0, "dropped_overlong": 0, "dropped_nothing_to_train": 0}
    if windows:
        pieces = [(start, min(e, start + seq_len + 1)) for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
                  for start in range(s, max(s + 1, e - 1), seq_len)]
        starts = np.array([p[0] for p in pieces], dtype=np.int64)
        lengths = np.array([p[1] - p[0] for p in pieces], dtype=np.int64)
    else:
        lengths = ends - starts
        long = lengths - 1 > seq_len
        if overlong == "drop":
            counts["dropped_overlong"] = int(long.sum())
            starts, lengths = starts[~long], lengths[~long]
        else:
            counts["truncated"] = int(long.sum())
            lengths = np.minimum(lengths, seq_len + 1)
    trained = cache.trained()
    has_targets = np.array([trained[s + 1:s + n].any() for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)],
                           dtype=bool)
    counts["dropped_nothing_to_train"] = int((~has_targets).sum()) if len(has_targets) else 0
    if len(has_targets):
        starts, lengths = starts[has_targets], lengths[has_targets]
    return Examples(starts.astype(np.int64), lengths.astype(np.int64), counts)


def pack_rows(positions: np.ndarray, seq_len: int, pack: bool) -> list[list[int]]:
    """Which examples (by index) each row holds, each example ``positions[i] <= seq_len`` long:
    one per row, or packed best fit decreasing."""
    if not pack:
        return [[i] for i in range(len(positions))]
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(positions)), key=lambda i: (-int(positions[i]), i)):
        need = int(positions[i])
        at = bisect.bisect_left(room, (need, -1))
        if at < len(room):
            left, row = room.pop(at)
        else:
            left, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        if left - need > 0:
            bisect.insort(room, (left - need, row))
    return rows


class ExampleRows(Dataset):
    """Rows of ``seq_len`` positions from one cache's examples (``pack_rows``): each a
    ``TokenBatch`` row whose targets count only the examples' trained tokens. Memory-mapped
    files are opened lazily in each process (DataLoader workers)."""

    def __init__(self, cache: ExampleCache, examples: Examples, *, seq_len: int, pack: bool, pad_id: int) -> None:
        self.cache, self.seq_len, self.pad_id = cache, seq_len, pad_id
        self.starts, self.lengths = examples.starts, examples.lengths
        self.rows = pack_rows(self.lengths - 1, seq_len, pack)
        self._tokens = self._trained = None
        trained = cache.trained()
        per_example = np.array([int(trained[s + 1:s + n].sum()) for s, n in
                                zip(self.starts.tolist(), self.lengths.tolist(), strict=True)], dtype=np.int64)
        self._counted = np.array([per_example[row].sum() for row in self.rows], dtype=np.int64)
        self._real = np.array([(self.lengths[row] - 1).sum() for row in self.rows], dtype=np.int64)
        # Each example, then the padding, is a document of its row (``document_positions``): the
        # attention pairs of ``token_batch.attended_tokens``, from the lengths without building rows.
        self._attended = np.array([((self.lengths[row] - 1) ** 2).sum() + (seq_len - real) ** 2
                                   for row, real in zip(self.rows, self._real, strict=True)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def counted_tokens(self, epoch: int = 0) -> np.ndarray:
        """The trained targets of each row (the sampler's counted fractions are made of them)."""
        return self._counted

    def real_tokens(self, epoch: int = 0) -> np.ndarray:
        """The positions of each row that hold an example (the rest is padding)."""
        return self._real

    def attended_tokens(self, epoch: int = 0) -> np.ndarray:
        """The attention pairs of each row (``token_batch.attended_tokens``)."""
        return self._attended

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None, "_trained": None}

    def __getitem__(self, key: int | SampleKey) -> TokenBatch:
        key = sample_key(key)
        if self._tokens is None:
            self._tokens, self._trained = self.cache.tokens(), self.cache.trained()
        tokens = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        targets = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        at, lengths = 0, []
        for example in self.rows[key.index]:
            start, length = int(self.starts[example]), int(self.lengths[example])
            ids = self._tokens[start:start + length].astype(np.int64)
            keep = self._trained[start + 1:start + length].astype(bool)
            tokens[at:at + length - 1] = ids[:-1]
            targets[at:at + length - 1] = np.where(keep, ids[1:], IGNORE_INDEX)
            at += length - 1
            lengths.append(length - 1)
        return TokenBatch(torch.from_numpy(tokens), torch.from_numpy(targets),
                          torch.from_numpy(document_positions(lengths, self.seq_len)),
                          torch.tensor(key.counted_fraction, dtype=torch.float64))
