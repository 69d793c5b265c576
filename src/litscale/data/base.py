"""Base data module: per-device micro batches drawn from one shared global order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from litscale.data.partition import (
    ClientSampler,
    label_histograms,
    label_skew,
    partition_indices,
)
from litscale.data.resume import ResumableOrder, shared_position, skipped_line, unshared_position
from litscale.data.token_batch import SampleKey, step_fractions
from litscale.parallel.layout import replicas_around


class ResumableSampler(ResumableOrder, DistributedSampler):
    """A ``DistributedSampler`` that can start an epoch part-way, for resumes, and that keys each
    sample of a counted dataset (``count_steps``) with its global batch's counted fraction."""

    #: Set by ``count_steps``: (samples per global batch, per micro batch).
    _steps: tuple[int, int] | None = None

    def __iter__(self) -> Iterator[Any]:
        order = self.resumed(self.rank_order())
        return order if self._steps is None else self.keyed(order)

    def rank_order(self) -> Iterator[int]:
        """This rank's indices for the epoch: every ``num_replicas``-th of the permutation."""
        return DistributedSampler.__iter__(self)

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """The global order of data epoch ``epoch`` (default: the current one), every rank's
        samples: the seeded permutation (the index order without ``shuffle``), cut to what the
        ranks draw."""
        if not self.shuffle:
            return np.arange(self.total_size)
        generator = torch.Generator()
        generator.manual_seed(self.seed + (self.epoch if epoch is None else epoch))
        return torch.randperm(len(self.dataset), generator=generator).numpy()[:self.total_size]

    def count_steps(self, *, global_batch: int, micro_batch: int) -> None:
        """Hand each sample of the counted dataset (``counted_tokens(epoch)``, ``seq_len``) to it as
        a ``SampleKey`` with the counted fraction of its global batch of ``global_batch``
        samples: every rank computes the same fractions from the shared order, no message."""
        self._steps = (global_batch, micro_batch)

    def drawn_per_epoch(self) -> int:
        """Samples of a whole epoch's order the ranks draw together (whole micro batches)."""
        micro = self._steps[1] if self._steps else 1
        return self.num_samples // micro * micro * self.num_replicas

    def keyed(self, order: Iterator[int]) -> Iterator[SampleKey]:
        global_batch, micro_batch = self._steps
        per_rank = global_batch // self.num_replicas
        start = self.skipped * self.num_replicas  # the global position this epoch's steps start at
        # NOTE: the loader drops a short last micro batch: the last step trains whole ones only.
        trained = (self.num_samples - self.skipped) // micro_batch * micro_batch * self.num_replicas
        positions = self.epoch_order()[start:start + trained]
        counted = np.asarray(self.dataset.counted_tokens(self.epoch))[positions]
        fractions = step_fractions(counted, global_batch=global_batch, seq_len=self.dataset.seq_len)
        for j, index in enumerate(order):
            fraction = fractions[j // per_rank] if j // per_rank < len(fractions) else 0.0
            yield SampleKey(int(index), self.epoch, float(fraction))


class ContiguousBlockSampler(ResumableSampler):
    """The same permutation, but each optimizer step's global batch of ``block x num_replicas``
    consecutive indices is cut into contiguous blocks, rank ``r`` taking the ``r``-th
    (``determinism=layout_invariant``: a chunk of the global batch is then the same samples,
    in the same order, on every layout)."""

    def __init__(self, *args: Any, block: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.block = block
        step = block * self.num_replicas
        self.total_size = len(self.dataset) // step * step  # whole global batches only
        self.num_samples = self.total_size // self.num_replicas

    def rank_order(self) -> Iterator[int]:
        order = self.epoch_order().tolist()
        step = self.block * self.num_replicas
        for start in range(0, self.total_size, step):
            yield from order[start + self.rank * self.block:start + (self.rank + 1) * self.block]


def resume_position(trainer: Any) -> tuple[int, int]:
    """``(epoch, batches already trained in it)`` when a fit resumes mid-epoch, else (0, 0).

    NOTE: Lightning restores its loop progress before it asks for the train dataloader, but
    restarts a non-stateful loader from the start of the epoch, replaying batches the run
    already trained on. Reading the restored progress lets the sampler skip them instead.
    """
    fit_loop = getattr(trainer, "fit_loop", None) if trainer is not None else None
    if fit_loop is None or not fit_loop.restarting:
        return 0, 0
    return trainer.current_epoch, batches_drawn(trainer)


def batches_drawn(trainer: Any) -> int:
    """The micro batches this rank's training loop has taken in Lightning's current epoch."""
    fit_loop = getattr(trainer, "fit_loop", None) if trainer is not None else None
    return int(fit_loop.epoch_loop.batch_progress.current.ready) if fit_loop is not None else 0


class ShardedDataModule(LightningDataModule):
    """A data module whose loaders shard one seeded global order across data-parallel ranks.

    Subclasses fill ``self.train_dataset`` and ``self.val_dataset`` in ``setup``; this class
    builds the loaders. The train loader always uses a ``DistributedSampler`` (with one
    replica too), so the sample indices of global step ``k`` are the same whether the run
    uses ``R`` ranks with micro batch ``b`` or one process with batch ``R * b``: the sampler
    draws one permutation from ``seed + epoch`` regardless of ``R`` and hands rank ``r`` every
    ``R``-th index of it. The Trainer must be built with ``use_distributed_sampler=False`` so
    Lightning keeps these samplers.

    A classification set may instead be split over the ranks by label (``partition``:
    ``dirichlet`` or ``shards``, ``litscale.data.partition``): each rank then draws from its own
    samples only, as a federated client does.

    Args:
        batch_size: Per-device micro batch size.
        num_workers: DataLoader worker processes per rank.
        seed: Seed of the training order (and of the partition); reshuffled every epoch.
        partition: ``iid`` (the shared order), ``dirichlet`` or ``shards`` (non-IID by label).
        alpha: The Dirichlet concentration of ``partition=dirichlet``.
        shards_per_client: The shards each rank gets with ``partition=shards``.
    """

    #: Set for ``determinism=layout_invariant``: the samples a rank takes per optimizer step
    #: (micro batch x accumulation), drawn as one contiguous block (``ContiguousBlockSampler``).
    rank_block: int | None = None
    #: ``(group, groups)`` under ``fault_tolerance=replicas`` (``litscale.reliability.replica_groups``).
    replica_group: tuple[int, int] = (0, 1)
    #: Set for a job whose data-parallel count changes between its starts on its own (``elastic=true``:
    #: Ray's ``min_workers``/``max_workers``, an elastic PyTorchJob): a resume whose position the new
    #: count cannot share out skips ahead to the next one it can, and says so, instead of raising.
    elastic: bool = False
    #: False where the dataset's own index order is the training order (a mixture interleaves
    #: its sources by weight, ``litscale.data.mixture``): the ranks then share it unshuffled.
    shuffle_order: bool = True

    #: ``"causal_lm"`` (batches ``(x, y)`` of int64 ``[B, T]``, ``y`` = ``x`` shifted by one)
    #: or ``"classification"`` (``x`` float32 ``[B, C, H, W]``, ``y`` int64 ``[B]``).
    task: str = "causal_lm"

    def __init__(self, *, batch_size: int, num_workers: int = 0, seed: int = 0,
                 partition: str = "iid", alpha: float = 0.5, shards_per_client: int = 2) -> None:
        super().__init__()
        self.partition, self.alpha, self.shards_per_client = partition, float(alpha), int(shards_per_client)
        self.partition_facts: dict[str, Any] | None = None  # per-client labels (summary.json)
        if int(batch_size) < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if int(num_workers) < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self._restored_state: dict[str, Any] | None = None  # a checkpoint's loader position
        # (data epoch, global samples skipped at its start, batches_drawn then) of the epoch the
        # train loader is in: what state_dict counts the run's position from.
        self._epoch_start: tuple[int, int, int] | None = None

    @property
    def tokens_per_sample(self) -> int | None:
        """Tokens in one sample (for throughput logging), or None when not token data."""
        return None

    @property
    def attended_length(self) -> float | None:
        """Where rows pack documents that attend only within themselves: the keys a row's
        token attends to, on average (its attention pairs over its length, ``token_batch.attended_tokens``,
        averaged over the training rows), what MFU and the planner count attention at instead of
        the whole row (``litscale.measure.flops.flops_per_sample``); None where a row is one
        document (or before ``setup``)."""
        return None

    def replicas(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of the data-parallel group; ``(1, 0)`` without a trainer.

        Taken from the strategy rather than the world size because model-parallel strategies
        give several ranks the same data shard.
        """
        trainer = self.trainer
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
        if not kwargs:
            return 1, 0
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def train_replicas(self) -> tuple[int, int]:
        """``replicas()`` over every replica group of ``fault_tolerance=replicas``: group ``g``'s
        ranks take the ``g``-th block of ranks, so the groups together read what one
        data-parallel job of all their ranks reads (validation stays within each group)."""
        num_replicas, rank = self.replicas()
        group, groups = self.replica_group
        return replicas_around(num_replicas, rank, group=group, groups=groups)

    def _require(self, dataset: Dataset | None, split: str) -> Dataset:
        if dataset is None:
            raise RuntimeError(
                f"{type(self).__name__}.{split}_dataset is not built; call setup() first"
            )
        return dataset

    def train_labels(self) -> Sequence[int] | None:
        """The class of every training sample, which a partition by label needs; None when the
        set has none (token data) or they are not cheap to list and no partition asks."""
        return None

    def train_sampler(self) -> Sampler:
        """The training sampler for this rank (Lightning calls ``set_epoch`` on it)."""
        num_replicas, rank = self.train_replicas()
        dataset = self._require(self.train_dataset, "train")
        if self.rank_block is not None:
            return self._counting(ContiguousBlockSampler(dataset, num_replicas=num_replicas, rank=rank,
                                                         shuffle=self.shuffle_order, seed=self.seed,
                                                         drop_last=True, block=self.rank_block))
        labels = self.train_labels()
        if self.partition == "iid":
            sampler = self._counting(ResumableSampler(dataset, num_replicas=num_replicas, rank=rank,
                                                      shuffle=self.shuffle_order, seed=self.seed, drop_last=True))
            # The IID split's label mix is reported where it is compared: federated clients.
            clients = getattr(getattr(self.trainer, "strategy", None), "simulates_clients", False)
            if clients and labels is not None and num_replicas > 1 and self.partition_facts is None:
                shares = [list(ResumableSampler(dataset, num_replicas=num_replicas, rank=r, shuffle=True,
                                                seed=self.seed, drop_last=True)) for r in range(num_replicas)]
                self._record_partition(labels, shares)
            return sampler
        if labels is None:
            raise ValueError(f"data.partition={self.partition} splits samples by label, but "
                             f"{type(self).__name__} has no labels; use data.partition=iid")
        parts = partition_indices(labels, num_replicas, self.partition, alpha=self.alpha,
                                  shards_per_client=self.shards_per_client, seed=self.seed,
                                  min_samples=self.batch_size)
        if self.partition_facts is None:
            self._record_partition(labels, parts)
        return ClientSampler(parts[rank], epoch_samples=len(dataset) // num_replicas, seed=self.seed,
                             client=rank)

    def _counting(self, sampler: ResumableSampler) -> ResumableSampler:
        """``sampler``, keying each sample with its global batch's counted fraction where the
        dataset counts its targets (``counted_tokens``: ``litscale.data.token_batch``)."""
        if hasattr(sampler.dataset, "counted_tokens"):
            accumulation = int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1) if self.trainer else 1
            sampler.count_steps(global_batch=self.batch_size * sampler.num_replicas * accumulation,
                                micro_batch=self.batch_size)
        return sampler

    def _record_partition(self, labels: Sequence[int], parts: list[list[int]]) -> None:
        """What each rank's client holds, by class: kept for summary.json and printed once."""
        histograms = label_histograms(labels, parts, int(torch.as_tensor(labels).max()) + 1)
        how = {"dirichlet": f"dirichlet (alpha {self.alpha:g})", "source": "by source file",
               "shards": f"shards ({self.shards_per_client} per client)"}.get(self.partition, "iid")
        self.partition_facts = {"partition": self.partition, "label_histograms": histograms,
                                "label_skew": label_skew(histograms),
                                "client_samples": [len(part) for part in parts]}
        rank_zero_info(f"litscale: data partition {how} over {len(parts)} clients: label skew "
                       f"{self.partition_facts['label_skew']:.3f} (mean total-variation distance of a "
                       "client's label mix from the whole)")
        for client, histogram in enumerate(histograms):
            rank_zero_info(f"litscale:   client {client}: {sum(histogram)} samples, "
                           f"{self._describe_labels(histogram)}")

    def _describe_labels(self, histogram: list[int]) -> str:
        """A client's labels for the log line (``TokenDataModule``: its source files)."""
        return f"by class {histogram}"

    def val_sampler(self) -> DistributedSampler:
        """The validation sampler; it pads with repeated samples so every rank has equal work."""
        num_replicas, rank = self.replicas()
        return DistributedSampler(
            self._require(self.val_dataset, "val"),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=False,
            drop_last=False,
        )

    def _loader(self, dataset: Dataset, sampler: DistributedSampler, drop_last: bool) -> DataLoader:
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            kwargs["persistent_workers"] = True
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            drop_last=drop_last,
            **kwargs,
        )

    def state_dict(self) -> dict[str, Any]:
        """The loader's position, saved in every checkpoint (Lightning stores a data module's
        state): the data epoch, the samples of it all data-parallel ranks have drawn together,
        the permutation's seed. Counted in global samples so that a resume on another layout
        (ranks, micro batch, accumulation) continues where the run stopped."""
        if self._epoch_start is None:  # no training epoch began: where a resume would start
            return dict(self._restored_state or {"epoch": 0, "samples_drawn": 0, "seed": self.seed,
                                                 "dataset_samples": len(self.train_dataset or ())})
        epoch, skipped, batches_then = self._epoch_start
        drawn = (batches_drawn(self.trainer) - batches_then) * self.batch_size * self.train_replicas()[0]
        return {"epoch": epoch, "samples_drawn": skipped + drawn, "seed": self.seed,
                "dataset_samples": len(self._require(self.train_dataset, "train"))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Kept until the train loader is built (Lightning restores a data module's state
        before its ``setup``, so the training set is not there to compare yet)."""
        self._restored_state = dict(state)

    def _resume_point(self, num_replicas: int) -> tuple[int, int] | None:
        """``(data epoch, samples of this rank's order to skip)`` on a resume: the checkpoint's
        global position shared out over this run's data-parallel ranks (``shared_position``); a
        finished epoch moves to the next. A checkpoint saved without one: Lightning's epoch and
        this rank's batches."""
        epoch, batches = resume_position(self.trainer)
        restored, self._restored_state = self._restored_state, None
        if restored is None:
            return (epoch, batches * self.batch_size) if batches else None
        epoch, samples = int(restored["epoch"]), int(restored["samples_drawn"])
        point = shared_position(epoch, samples, dataset_samples=len(self._require(self.train_dataset, "train")),
                                ranks=num_replicas, block=self.rank_block)
        if point.skipped:
            reason = unshared_position(epoch, samples, ranks=num_replicas, block=self.rank_block)
            if not self.elastic:  # the app refuses it before launch (litscale.app.checks.checkpoint)
                raise ValueError(f"trainer.devices: {reason}; allowed: a count of data-parallel ranks that divides "
                                 f"it, elastic=true to skip ahead to sample {samples + point.skipped}, or start "
                                 "fresh with ckpt_path=null")
            rank_zero_info(f"litscale: elastic resume: {reason}: {skipped_line(samples, point)}")
        return point.epoch, point.samples // num_replicas

    def _continue_restored_order(self) -> None:
        """A resume draws the checkpoint's permutation: its seed, over a training set of its
        size (another size is another order: refused)."""
        restored = self._restored_state
        if restored is None:
            return
        ours = len(self._require(self.train_dataset, "train"))
        if restored.get("dataset_samples", ours) != ours:
            raise ValueError(
                f"data: the checkpoint's training set has {restored['dataset_samples']} samples, this "
                f"run's {ours}; resume with the data it was trained on, or start fresh with ckpt_path=null")
        if restored.get("seed", self.seed) != self.seed:
            rank_zero_info(f"litscale: data.seed={self.seed}, but the checkpoint's order was drawn from "
                           f"seed {restored['seed']}: the run continues that order")
            self.seed = int(restored["seed"])

    def _epoch_began(self, epoch: int, skipped: int) -> None:
        self._epoch_start = (epoch, skipped * self.train_replicas()[0], batches_drawn(self.trainer))

    def train_dataloader(self) -> DataLoader:
        self._continue_restored_order()
        sampler = self.train_sampler()
        num_replicas = self.train_replicas()[0]
        point = self._resume_point(num_replicas)
        if point is not None:
            sampler.resume_at(*point)
        sampler.on_epoch_start = self._epoch_began
        # drop_last keeps every step's global batch full, which step-for-step parity needs.
        return self._loader(self._require(self.train_dataset, "train"), sampler, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._require(self.val_dataset, "val"), self.val_sampler(), False)
