"""Synthetic, deterministic, learnable data of any size for benchmarks and smoke tests."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch.utils.data import Dataset

from litscale.arguments import checked_arguments
from litscale.constraints import NonNegativeInt, PositiveFloat, PositiveInt
from litscale.data.base import ShardedDataModule
from litscale.data.partition import Partition

# Cap on the inputs the classification labels look at: the projection that makes labels
# learnable would otherwise grow with the image size times the class count.
_MAX_LABEL_FEATURES = 4096


def _stream_base(seed: int, stream: str) -> int:
    """A 32-bit start point for ``(seed, stream)``, spread by a hash."""
    digest = hashlib.sha256(f"{stream}:{seed}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _generator(base: int, index: int) -> torch.Generator:
    # torch's CPU generator keeps only the low 32 bits of a seed, so the seed cannot carry
    # seed and index in separate bit ranges. Consecutive indices from a hashed base never
    # collide within a seed; two seeds' runs overlap only if their bases land within
    # num_samples of each other (odds ~ num_samples / 2**32).
    return torch.Generator().manual_seed((base + index) % 2**32)


class _SeededSamples(Dataset):
    """``num_samples`` samples, each drawn on demand from its own generator, seeded by
    ``(seed, offset + index)``: any sample is the same on any rank, in any order, and memory
    does not grow with ``num_samples``. A subclass draws one sample in ``draw``."""

    def __init__(self, *, num_samples: int, seed: int, offset: int) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.offset = offset
        self._base = _stream_base(seed, "samples")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return self.draw(_generator(self._base, self.offset + index))

    def draw(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class SyntheticLM(_SeededSamples):
    """Token sequences that walk a fixed random cycle through the vocabulary.

    Each token's successor is fixed (a bigram a model can learn, so loss falls); each sample
    starts at a random point of the cycle.
    """

    def __init__(
        self, *, num_samples: int, seq_len: int, vocab_size: int, seed: int, offset: int = 0
    ) -> None:
        super().__init__(num_samples=num_samples, seed=seed, offset=offset)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.cycle = torch.randperm(vocab_size, generator=_generator(_stream_base(seed, "lm"), 0))

    def draw(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(torch.randint(self.vocab_size, (1,), generator=generator))
        positions = (start + torch.arange(self.seq_len + 1)) % self.vocab_size
        window = self.cycle[positions]
        return window[:-1], window[1:]


class SyntheticImages(_SeededSamples):
    """Gaussian images labelled by the argmax of a fixed random linear map of their pixels.

    The labels are a linear function of the input, so a classifier can learn them; samples
    are generated per index like :class:`SyntheticLM`.
    """

    def __init__(
        self,
        *,
        num_samples: PositiveInt,
        input_shape: tuple[int, ...],
        num_classes: PositiveInt,
        seed: int,
        offset: int = 0,
    ) -> None:
        super().__init__(num_samples=num_samples, seed=seed, offset=offset)
        self.input_shape = input_shape
        self.num_classes = num_classes
        features = min(math.prod(input_shape), _MAX_LABEL_FEATURES)
        self.projection = torch.randn(
            num_classes, features, generator=_generator(_stream_base(seed, "projection"), 0)
        )

    def draw(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.input_shape, generator=generator)
        features = x.reshape(-1)[: self.projection.shape[1]]
        return x, torch.argmax(self.projection @ features)


class SyntheticDataModule(ShardedDataModule):
    """Deterministic synthetic data for benchmarks: causal LM tokens or labelled images.

    Train samples are indices ``[0, num_samples)`` and val samples indices
    ``[num_samples, num_samples + val_samples)`` of the same generator, so they differ. The
    content depends on ``seed`` only; ``seed`` also orders training.

    Args:
        batch_size: Per-device micro batch size.
        task: ``"causal_lm"`` or ``"classification"``.
        num_samples: Training samples per epoch.
        val_samples: Validation samples.
        seq_len: Tokens per sample (causal LM).
        vocab_size: Vocabulary size (causal LM).
        input_shape: ``[C, H, W]`` of an image (classification).
        num_classes: Number of classes (classification).
        num_workers: DataLoader workers per rank.
        seed: Seed of the content, of the training order and of a partition.
        partition: ``iid``, or non-IID by label over the ranks (classification): ``dirichlet`` or
            ``shards``.
        alpha: The Dirichlet concentration (``partition=dirichlet``).
        shards_per_client: Label-sorted shards per rank (``partition=shards``).
    """

    @checked_arguments("data")
    def __init__(
        self,
        *,
        batch_size: PositiveInt,
        task: Literal["causal_lm", "classification"] = "causal_lm",
        num_samples: PositiveInt = 100_000,
        val_samples: PositiveInt = 1_000,
        seq_len: PositiveInt = 128,
        vocab_size: PositiveInt = 256,
        input_shape: Sequence[PositiveInt] = (3, 32, 32),
        num_classes: PositiveInt = 10,
        num_workers: NonNegativeInt = 0,
        seed: int = 0,
        partition: Partition = "iid",
        alpha: PositiveFloat = 0.5,
        shards_per_client: PositiveInt = 2,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed, partition=partition,
                         alpha=alpha, shards_per_client=shards_per_client)
        if int(num_samples) + int(val_samples) > 2**32:
            raise ValueError("data.num_samples + data.val_samples must be at most 2**32")
        shape = tuple(int(d) for d in input_shape)
        if not shape:
            raise ValueError("data.input_shape=[] is not valid: expected a list of ints >= 1")
        self.task = task
        self.num_samples = int(num_samples)
        self.val_samples = int(val_samples)
        self.seq_len = int(seq_len)
        self.vocab_size = int(vocab_size)
        self.input_shape = shape
        self.num_classes = int(num_classes)

    @property
    def tokens_per_sample(self) -> int | None:
        return self.seq_len if self.task == "causal_lm" else None

    def _dataset(self, num_samples: int, offset: int) -> Dataset:
        if self.task == "causal_lm":
            return SyntheticLM(
                num_samples=num_samples,
                seq_len=self.seq_len,
                vocab_size=self.vocab_size,
                seed=self.seed,
                offset=offset,
            )
        return SyntheticImages(
            num_samples=num_samples,
            input_shape=self.input_shape,
            num_classes=self.num_classes,
            seed=self.seed,
            offset=offset,
        )

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        self.train_dataset = self._dataset(self.num_samples, 0)
        self.val_dataset = self._dataset(self.val_samples, self.num_samples)

    def train_labels(self) -> list[int] | None:
        # Generated per sample (a forward of the label map each): listed only when a partition needs them.
        if self.task != "classification" or self.partition == "iid":
            return None
        dataset = self._require(self.train_dataset, "train")
        return [int(dataset[index][1]) for index in range(len(dataset))]
