"""A causal-LM data module of your own: the bytes of some text files, cut into windows."""

from __future__ import annotations

import glob

import torch
from torch.utils.data import Dataset

from litscale.data.base import ShardedDataModule


class Windows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: inputs and next-token targets."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index * self.seq_len: (index + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


class TextBytesDataModule(ShardedDataModule):
    """Byte-level next-token prediction over the files matching ``paths``. ShardedDataModule
    builds the loaders, each rank drawing its share of one seeded order."""

    task = "causal_lm"  # the models it pairs with: litscale's CausalLMModule

    def __init__(self, *, paths: str, seq_len: int = 128, vocab_size: int = 256,
                 val_fraction: float = 0.1, batch_size: int = 16, num_workers: int = 0,
                 seed: int = 0) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.paths, self.seq_len, self.vocab_size = paths, seq_len, vocab_size
        self.val_fraction = val_fraction

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len  # for perf/tokens_per_sec

    def setup(self, stage: str | None = None) -> None:
        files = sorted(glob.glob(self.paths))
        if not files:
            raise ValueError(f"data.paths={self.paths!r} matches no file")
        text = b"".join(open(path, "rb").read() for path in files)
        tokens = torch.tensor(list(text), dtype=torch.long)
        split = int(len(tokens) * (1 - self.val_fraction))
        self.train_dataset = Windows(tokens[:split], self.seq_len)
        self.val_dataset = Windows(tokens[split:], self.seq_len)
