"""scikit-learn's bundled 8x8 handwritten digits: a real classification set with no download."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import TensorDataset

from litscale.arguments import checked_arguments
from litscale.constraints import NonNegativeInt, OpenFraction, PositiveFloat, PositiveInt
from litscale.data.base import ShardedDataModule
from litscale.data.partition import Partition
from litscale.extras import SCIKIT_LEARN


class DigitsDataModule(ShardedDataModule):
    """The 1797 8x8 digit images of ``sklearn.datasets.load_digits``, 10 classes.

    Pixels are scaled to [0, 1] and then standardised with the mean and std of the training
    split (one scalar each). The train/val split is a permutation drawn from ``split_seed``,
    independent of ``seed`` (which only orders training), so runs with different seeds
    validate on the same images. Batches are ``(x, y)``: float32 ``[B, 1, 8, 8]`` and int64
    ``[B]``.

    Args:
        batch_size: Per-device micro batch size.
        val_fraction: Fraction of images held out for validation.
        split_seed: Seed of the train/val split.
        input_shape: Must be ``[1, 8, 8]``; a key so model configs can interpolate
            ``${data.input_shape}``.
        num_classes: Must be 10; a key for ``${data.num_classes}``.
        num_workers: DataLoader workers per rank.
        seed: Seed of the training order (and of a partition).
        partition: ``iid``, or non-IID by label over the ranks: ``dirichlet`` or ``shards``.
        alpha: The Dirichlet concentration (``partition=dirichlet``).
        shards_per_client: Label-sorted shards per rank (``partition=shards``).
    """

    task = "classification"
    requires = (SCIKIT_LEARN,)  # litscale.extras: the images come with scikit-learn
    input_shape: tuple[int, ...] = (1, 8, 8)
    num_classes: int = 10

    @checked_arguments("data")
    def __init__(
        self,
        *,
        batch_size: PositiveInt,
        val_fraction: OpenFraction = 0.2,
        split_seed: int = 0,
        input_shape: Sequence[PositiveInt] = (1, 8, 8),
        num_classes: int = 10,
        num_workers: NonNegativeInt = 0,
        seed: int = 0,
        partition: Partition = "iid",
        alpha: PositiveFloat = 0.5,
        shards_per_client: PositiveInt = 2,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed, partition=partition,
                         alpha=alpha, shards_per_client=shards_per_client)
        if tuple(int(d) for d in input_shape) != type(self).input_shape:
            raise ValueError(
                f"data.input_shape={list(input_shape)} does not match the digits images, "
                f"which are {list(type(self).input_shape)}"
            )
        if int(num_classes) != type(self).num_classes:
            raise ValueError(
                f"data.num_classes={num_classes} does not match the digits data, "
                f"which has {type(self).num_classes} classes"
            )
        self.val_fraction = float(val_fraction)
        self.split_seed = int(split_seed)
        self.mean: float | None = None
        self.std: float | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        # Imported here: scikit-learn is an optional extra and slow to import.
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.as_tensor(digits.target, dtype=torch.int64)
        generator = torch.Generator().manual_seed(self.split_seed)
        order = torch.randperm(len(labels), generator=generator)
        num_val = max(1, round(len(labels) * self.val_fraction))
        val_idx, train_idx = order[:num_val], order[num_val:]
        train_x = images[train_idx]
        # Statistics of the training split only, so nothing about val leaks into inputs.
        mean, std = train_x.mean(), train_x.std()
        self.mean, self.std = float(mean), float(std)
        self.train_dataset = TensorDataset((train_x - mean) / std, labels[train_idx])
        self.val_dataset = TensorDataset((images[val_idx] - mean) / std, labels[val_idx])

    def train_labels(self) -> torch.Tensor:
        return self._require(self.train_dataset, "train").tensors[1]
