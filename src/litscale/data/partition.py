"""Non-IID client data: a classification set's training samples split over data-parallel ranks
(federated clients) by label, deterministically from a seed.

- ``iid``: the shared shuffled order (``ShardedDataModule``'s ``DistributedSampler``).
- ``dirichlet``: for every class, the shares of its samples the clients get are drawn from
  ``Dirichlet(alpha)`` (Hsu et al. 2019): small ``alpha`` (0.1) gives each client a few
  classes, large (100) nearly the global mix.
- ``shards``: samples sorted by label are cut into ``clients x shards_per_client`` shards and
  each client gets ``shards_per_client`` of them (McMahan et al. 2017's pathological split).

- ``source`` (token data, ``TokenDataModule``): whole documents by source file, the corpus's
  files in order cut into contiguous runs of about equal tokens, one run a client
  (``contiguous_source_clients``): each client reads other packages, or other files of a corpus.

Written here rather than taken from Flower Datasets' partitioners, which split a Hugging Face
``datasets.Dataset`` and bring that stack with them; the splits are a few lines of numpy.

Clients hold different numbers of samples, but every client's epoch is the same number of
batches (its samples reshuffled and repeated as needed): ranks must agree on when an epoch,
and its validation, ends. Federated averaging weighs clients by what they hold
(``ClientSampler.client_samples``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Sampler

from litscale.data.resume import ResumableOrder

Partition = Literal["iid", "dirichlet", "shards"]
_DIRICHLET_DRAWS = 100  # redraws allowed until every client holds at least a micro batch


def partition_indices(labels: Sequence[int], clients: int, partition: str, *, alpha: float,
                      shards_per_client: int, seed: int, min_samples: int = 1) -> list[list[int]]:
    """The training-sample indices of each client (sorted), a pure function of its arguments."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    if partition == "dirichlet":
        return _dirichlet(labels, clients, alpha, rng, min_samples)
    if partition == "shards":
        return _shards(labels, clients, shards_per_client, rng, min_samples)
    return [sorted(part.tolist()) for part in np.array_split(rng.permutation(len(labels)), clients)]


def _dirichlet(labels: np.ndarray, clients: int, alpha: float, rng: np.random.Generator,
               min_samples: int) -> list[list[int]]:
    for _ in range(_DIRICHLET_DRAWS):
        parts: list[list[int]] = [[] for _ in range(clients)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            cuts = (np.cumsum(rng.dirichlet([alpha] * clients)) * len(members)).astype(int)[:-1]
            for part, piece in zip(parts, np.split(members, cuts), strict=True):
                part.extend(piece.tolist())
        if min(len(part) for part in parts) >= min_samples:
            return [sorted(part) for part in parts]
    raise ValueError(
        f"data.partition=dirichlet with data.alpha={alpha} left a client fewer than {min_samples} "
        f"samples (a micro batch) in {_DIRICHLET_DRAWS} draws over {clients} clients; "
        "raise data.alpha or lower data.batch_size")


def _shards(labels: np.ndarray, clients: int, per_client: int, rng: np.random.Generator,
            min_samples: int) -> list[list[int]]:
    # A random order first, then a stable sort by label: within a label, samples are shuffled.
    order = rng.permutation(len(labels))
    by_label = order[np.argsort(labels[order], kind="stable")]
    shards = np.array_split(by_label, clients * per_client)
    dealt = rng.permutation(len(shards))
    parts = [sorted(np.concatenate([shards[s] for s in dealt[k * per_client:(k + 1) * per_client]]).tolist())
             for k in range(clients)]
    if min(len(part) for part in parts) < min_samples:
        raise ValueError(
            f"data.partition=shards with data.shards_per_client={per_client} gives a client fewer than "
            f"{min_samples} samples (a micro batch); raise data.shards_per_client or lower data.batch_size")
    return parts


def contiguous_source_clients(source_tokens: Sequence[int], clients: int) -> list[int]:
    """The client of each source, sources in corpus order: contiguous runs of about
    ``1 / clients`` of the tokens each; a source goes to the client whose share holds its middle
    token (a source is never split)."""
    total = float(sum(source_tokens))
    owners, before = [], 0
    for size in source_tokens:
        owners.append(min(clients - 1, int((before + size / 2) * clients / total)))
        before += size
    return owners


def label_histograms(labels: Sequence[int], parts: Sequence[Sequence[int]], num_classes: int) -> list[list[int]]:
    """Samples of each class on each client: ``[client][class]``."""
    labels = np.asarray(labels)
    return [np.bincount(labels[list(part)], minlength=num_classes).tolist() for part in parts]


def label_skew(histograms: Sequence[Sequence[int]]) -> float:
    """The mean over clients of the total-variation distance between a client's label mix and
    the mix of all clients together: 0 when every client looks like the whole, near 1 when
    each holds classes the others lack."""
    counts = np.asarray(histograms, dtype=float)
    overall = counts.sum(0) / counts.sum()
    mixes = counts / counts.sum(1, keepdims=True)
    return float(0.5 * np.abs(mixes - overall).sum(1).mean())


class ClientSampler(ResumableOrder, Sampler[int]):
    """One client's samples, reshuffled every epoch (from ``seed``, the epoch and the client)
    and repeated to ``epoch_samples``, the same count on every client. ``client_samples``:
    how many distinct samples the client holds (its FedAvg weight)."""

    def __init__(self, indices: Sequence[int], *, epoch_samples: int, seed: int, client: int) -> None:
        self.indices = torch.as_tensor(list(indices), dtype=torch.int64)
        self.client_samples = len(self.indices)
        self.epoch_samples, self.seed, self.client = epoch_samples, seed, client
        self.epoch = 0

    def __len__(self) -> int:
        return self.epoch_samples

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 1009 + self.client)
        repeats = -(-self.epoch_samples // self.client_samples)
        order = torch.cat([self.indices[torch.randperm(self.client_samples, generator=generator)]
                           for _ in range(repeats)])[: self.epoch_samples]
        return self.resumed(iter(order.tolist()))


def plot_label_histograms(histograms: Sequence[Sequence[int]], path: str) -> str | None:
    """A stacked bar per client of its samples by class, written to ``path``; None without
    matplotlib (an optional extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    counts = np.asarray(histograms)
    figure, axes = plt.subplots(figsize=(1.2 + 0.5 * len(counts), 3.2))
    bottom = np.zeros(len(counts))
    colors = plt.get_cmap("tab10" if counts.shape[1] <= 10 else "tab20")
    for label in range(counts.shape[1]):
        axes.bar(range(len(counts)), counts[:, label], bottom=bottom, color=colors(label % colors.N),
                 label=str(label))
        bottom += counts[:, label]
    axes.set_xlabel("client (rank)")
    axes.set_ylabel("training samples")
    axes.set_xticks(range(len(counts)))
    if counts.shape[1] <= 20:  # more (source files) would bury the bars under the legend
        axes.legend(title="class", fontsize=6, title_fontsize=7, ncol=2, loc="upper left",
                    bbox_to_anchor=(1, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
