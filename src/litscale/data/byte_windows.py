"""Fixed-length windows over byte ranges of a memory-mapped uint8 token file."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


def coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        elif end > start:
            merged.append((start, end))
    return merged


def num_windows(ranges: list[tuple[int, int]], seq_len: int) -> int:
    return sum(max(0, (end - start - 1) // seq_len) for start, end in ranges)


def held_out_cut(total: int, val_fraction: float, seq_len: int) -> int:
    """Where a split by position puts val: the last ``val_fraction`` of ``total`` tokens, and
    at least one window of them, so validation never runs on an empty set. Below
    ``seq_len + 1`` the data holds no train window either (the caller says why, in its terms)."""
    return total - max(math.ceil(total * val_fraction), seq_len + 1)


class MemmapWindows(Dataset):
    """A dataset over a memory-mapped file of ``dtype`` tokens, opened lazily in each process:
    memmaps do not pickle to DataLoader workers."""

    def __init__(self, path: str, dtype: np.dtype) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self._data: np.memmap | None = None

    def data(self) -> np.memmap:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._data

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_data"] = None
        return state


class ByteWindows(MemmapWindows):
    """Non-overlapping windows of ``seq_len + 1`` bytes (stride ``seq_len``) of a uint8 file.

    Windows never cross the end of a byte range, so train and val ranges never mix.
    """

    def __init__(self, path: str, ranges: list[tuple[int, int]], seq_len: int) -> None:
        super().__init__(path, np.uint8)
        self.seq_len = seq_len
        self.ranges = coalesce(ranges)
        counts = [max(0, (end - start - 1) // seq_len) for start, end in self.ranges]
        self._starts = np.array([start for start, _ in self.ranges], dtype=np.int64)
        self._cumulative = np.cumsum(np.array(counts, dtype=np.int64))

    def __len__(self) -> int:
        return int(self._cumulative[-1]) if len(self._cumulative) else 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        run = int(np.searchsorted(self._cumulative, index, side="right"))
        first = int(self._cumulative[run - 1]) if run else 0
        offset = int(self._starts[run]) + (index - first) * self.seq_len
        window = torch.from_numpy(self.data()[offset : offset + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]
