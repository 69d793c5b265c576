"""Causal LM over a tokenized corpus (``data=tokens``): text, JSONL or Parquet files, or by
default the Python standard library's source, tokenized once and packed into sequences."""

from __future__ import annotations

import functools
import logging
import os
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Sampler

from litscale.arguments import checked_arguments
from litscale.constraints import NonNegativeInt, OpenFraction, PositiveInt
from litscale.data.base import ShardedDataModule
from litscale.data.byte_corpus import default_cache_dir
from litscale.data.byte_windows import MemmapWindows, coalesce, held_out_cut
from litscale.data.documents import corpus_files, missing_paths_error, read_documents
from litscale.data.partition import ClientSampler, contiguous_source_clients
from litscale.data.token_batch import (
    SampleKey,
    TokenBatch,
    attended_tokens,
    positions_after_ends,
    sample_key,
)
from litscale.data.token_cache import TokenCache, build_cache, cache_stem, is_complete, load_cache
from litscale.data.tokenizer import load_tokenizer
from litscale.data.tokenizer_directory import write_tokenizer_directory
from litscale.user_paths import user_path

__all__ = ["PackedSequences", "TokenDataModule", "missing_paths_error"]

log = logging.getLogger(__name__)

#: The windows read to estimate ``attended_length`` (a few hundred thousand tokens at most).
ATTENDED_SAMPLE = 256


def num_sequences(num_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens, one every ``seq_len``, in ``num_tokens`` tokens."""
    return max(0, (num_tokens - 1) // seq_len)


class PackedSequences(MemmapWindows):
    """Windows of ``seq_len + 1`` tokens, one every ``seq_len``, over the token ranges of a
    memory-mapped file read as one stream.

    The ranges are one split's documents, each ending in the end-of-text token: a window runs
    from one document into the next of its split, as packing does, and skips the documents
    of the other split that lie between them in the file. Window ``k`` starts at token
    ``k * seq_len`` of the stream, so every token but the first is a target exactly once; only
    the tail shorter than a window is left out.
    """

    def __init__(self, path: str, dtype: np.dtype, ranges: list[tuple[int, int]], seq_len: int) -> None:
        super().__init__(path, dtype)
        self.seq_len = seq_len
        self.ranges = coalesce(ranges)
        starts = np.array([start for start, _ in self.ranges], dtype=np.int64)
        lengths = np.array([end - start for start, end in self.ranges], dtype=np.int64)
        self._stream_ends = np.cumsum(lengths)
        # Added to a position in the stream, gives the position in the file, per range.
        self._file_offsets = starts - (self._stream_ends - lengths)

    @property
    def num_tokens(self) -> int:
        return int(self._stream_ends[-1]) if len(self._stream_ends) else 0

    def __len__(self) -> int:
        return num_sequences(self.num_tokens, self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences")
        positions = index * self.seq_len + np.arange(self.seq_len + 1)
        runs = np.searchsorted(self._stream_ends, positions, side="right")
        window = torch.from_numpy(self.data()[positions + self._file_offsets[runs]].astype(np.int64))
        return window[:-1], window[1:]


class DocumentWindows(PackedSequences):
    """``PackedSequences`` as ``TokenBatch`` rows (``data.document_mask=true``): each window's
    positions restart after every end-of-text token, so a model that attends within documents
    keeps each document to itself; every target counts."""

    def __init__(self, path: str, dtype: np.dtype, ranges: list[tuple[int, int]], seq_len: int, end_id: int) -> None:
        super().__init__(path, dtype, ranges, seq_len)
        self.end_id = end_id

    def counted_tokens(self, epoch: int = 0) -> np.ndarray:
        return np.full(len(self), self.seq_len, dtype=np.int64)

    def __getitem__(self, key: int | SampleKey) -> TokenBatch:
        key = sample_key(key)
        tokens, targets = super().__getitem__(key.index)
        positions = torch.from_numpy(positions_after_ends(tokens.numpy(), self.end_id))
        return TokenBatch(tokens, targets, positions, torch.tensor(key.counted_fraction, dtype=torch.float64))


class TokenDataModule(ShardedDataModule):
    """Causal LM over a corpus tokenized once into a memory-mapped cache (``token_cache``).

    A text file is one document; a JSONL line or a Parquet row (``text_field``) is one. Each
    document ends in the tokenizer's end-of-text token, and a split's documents are packed
    into sequences of ``seq_len + 1`` tokens (:class:`PackedSequences`). Documents go to val
    by a hash of their text (stable when files are added or reordered); when that leaves either
    split without a full sequence, the last ``val_fraction`` of the tokens is val instead.

    Validation builds the cache and the splits in the launching process before any rank
    starts (``prepare_before_launch``): a bad file is reported in one line, and the ranks find
    the cache instead of each waiting on rank 0 to tokenize.

    Args:
        seq_len: Tokens per sample; a sample is ``seq_len + 1`` consecutive tokens.
        batch_size: Per-device micro batch size.
        tokenizer: ``byte``, ``bpe`` or the path of a ``tokenizer.json`` or a directory holding
            one (``litscale.data.tokenizer``); never downloaded.
        paths: Glob pattern or list of patterns of ``.jsonl``, ``.parquet`` or text files
            (``~`` and ``**`` expanded); None for the ``.py`` files of the standard library.
        text_field: The field of a JSONL record or the Parquet column that holds the text.
        vocab_size: The model's vocabulary; None for the tokenizer's, and at least that. A key
            so model configs can interpolate ``${data.vocab_size}``.
        val_fraction: Expected fraction of documents (or tokens, in the fallback) held out.
        cache_dir: Where the token cache goes; default ``$LITSCALE_CACHE`` or
            ``~/.cache/litscale/data``.
        num_workers: DataLoader workers per rank.
        seed: Seed of the training order.
        partition: ``iid`` (one shared order), or ``source``: each rank (a federated client)
            trains on whole documents of its own source files (``contiguous_source_clients``);
            a sequence is packed within one client's documents.
        document_mask: Batches are ``TokenBatch``es whose positions restart at each document,
            so that attention never crosses from one document into the next packed beside it
            (model=llama, moe or hf; ``litscale.models.documents``).
    """

    task = "causal_lm"
    #: litscale.app.checks.validation prepares and sets up the data before any rank starts.
    prepare_before_launch = True

    @checked_arguments("data")
    def __init__(
        self,
        *,
        seq_len: PositiveInt,
        batch_size: PositiveInt,
        tokenizer: str = "bpe",
        paths: str | list[str] | None = None,
        text_field: str = "text",
        vocab_size: PositiveInt | None = None,
        val_fraction: OpenFraction = 0.05,
        cache_dir: str | None = None,
        num_workers: NonNegativeInt = 0,
        seed: int = 0,
        partition: Literal["iid", "source"] = "iid",
        document_mask: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed, partition=partition)
        self.tokenizer = load_tokenizer(tokenizer)
        if vocab_size is not None and vocab_size < self.tokenizer.vocab_size:
            raise ValueError(
                f"data.vocab_size={vocab_size} is smaller than the {self.tokenizer.vocab_size} "
                f"tokens of data.tokenizer={tokenizer!r}; leave it null for the tokenizer's"
            )
        self.vocab_size = int(vocab_size or self.tokenizer.vocab_size)
        self.paths = paths
        self.text_field = text_field
        self.seq_len = int(seq_len)
        self.val_fraction = float(val_fraction)
        self.cache_dir = user_path(cache_dir) if cache_dir else default_cache_dir()
        if document_mask and partition != "iid":
            raise ValueError(f"data.document_mask=true counts each global batch's tokens from the shared order, "
                             f"which data.partition={partition} does not draw; allowed: data.partition=iid")
        self.document_mask = bool(document_mask)
        self.split_by_document = True
        self.train_documents = self.val_documents = 0
        self.val_bytes_per_token = 1.0

    @property
    def tokens_per_sample(self) -> int | None:
        return self.seq_len

    @property
    def attended_length(self) -> float | None:
        """Of windows with ``document_mask``, estimated from up to ``ATTENDED_SAMPLE`` windows
        spread evenly over the training split: the documents of a window are found by reading its
        tokens, and reading every window of a corpus (a pass over the whole file) before launch
        would cost more than the estimate is off by."""
        if not self.document_mask or self.train_dataset is None or not len(self.train_dataset):
            return None
        windows = self.train_dataset
        chosen = np.unique(np.linspace(0, len(windows) - 1, min(len(windows), ATTENDED_SAMPLE)).astype(np.int64))
        pairs = [attended_tokens(windows[int(index)].positions.numpy()) for index in chosen]
        return float(np.mean(pairs)) / self.seq_len

    def save_tokenizer(self, directory: str) -> list[str]:
        """The tokenizer, as transformers reads it (an exported Hugging Face directory's)."""
        return write_tokenizer_directory(self.tokenizer, None, directory)

    def _source(self) -> str:
        return f"data.paths={self.paths!r}" if self.paths is not None else "the standard library"

    def cache_stem(self) -> str:
        """``<cache_dir>/tokens-<key>`` for the corpus as it is now on disk."""
        return cache_stem(self.cache_dir, corpus_files(self.paths), self.tokenizer, self.text_field)

    def prepare_data(self) -> None:
        self._built_cache()

    def _built_cache(self) -> str:
        """The stem of the corpus's token cache, tokenizing the corpus first unless it exists."""
        files = corpus_files(self.paths)
        stem = cache_stem(self.cache_dir, files, self.tokenizer, self.text_field)
        if not is_complete(stem):
            log.info("tokenizing %d files with %s into %s", len(files), self.tokenizer.name, stem)
            build_cache(stem, read_documents(files, self.text_field, with_source=True), self.tokenizer,
                        total_bytes=sum(os.path.getsize(f) for f in files), source=self._source())
        return stem

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        # Without Lightning (or with a cache dir not shared across nodes) the cache may not be
        # built here yet; building is atomic, so ranks building it at once are harmless.
        cache = load_cache(self._built_cache())
        train, val = self._split(cache)
        self._cache = cache
        self.val_bytes_per_token = _bytes_per_token(cache, val)
        self._val_bytes = (cache, val)
        windows = (functools.partial(DocumentWindows, end_id=self.tokenizer.eos_id) if self.document_mask
                   else PackedSequences)
        self.train_dataset = windows(cache.path, cache.dtype, train, self.seq_len)
        self.val_dataset = windows(cache.path, cache.dtype, val, self.seq_len)
        log.info("%d train and %d val sequences of %d tokens (%s)", len(self.train_dataset),
                 len(self.val_dataset), self.seq_len,
                 "split by document" if self.split_by_document else "split by position")

    def val_bytes_per_token_over(self, sequences: int) -> float:
        """Bytes per token of the first ``sequences`` held-out sequences: what a validation
        limited to fewer batches (``trainer.limit_val_batches``) evaluates, ranks included (the
        val sampler gives rank r sequences r, r + world, ...: the first batches of all ranks
        are the first sequences)."""
        cache, spans = self._val_bytes
        return _bytes_per_token(cache, first_tokens(spans, sequences * self.seq_len))

    def _split(self, cache: TokenCache) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        in_val = cache.split_keys < np.uint64(int(self.val_fraction * 2.0**64))
        documents = np.stack([cache.starts[:-1], cache.starts[1:]], axis=1)
        self._train_document_ids = np.flatnonzero(~in_val)
        train = [(start, end) for start, end in documents[~in_val].tolist()]
        val = [(start, end) for start, end in documents[in_val].tolist()]
        self.train_documents, self.val_documents = len(train), len(val)
        if all(num_sequences(sum(end - start for start, end in split), self.seq_len)
               for split in (train, val)):
            self.split_by_document = True
            return train, val
        total = cache.num_tokens
        cut = held_out_cut(total, self.val_fraction, self.seq_len)
        if cut < self.seq_len + 1:
            raise ValueError(
                f"data.seq_len={self.seq_len} is too long for {self._source()}, which tokenizes to "
                f"{total} tokens: one train and one val sequence need {2 * (self.seq_len + 1)}"
            )
        self.split_by_document = False
        self._train_document_ids = np.flatnonzero(cache.starts[:-1] < cut)
        self.train_documents = int(np.count_nonzero(cache.starts[:-1] < cut))
        self.val_documents = int(np.count_nonzero(cache.starts[1:] > cut))
        return [(0, cut)], [(cut, total)]


    def train_sampler(self) -> Sampler:
        if self.partition != "source":
            return super().train_sampler()
        num_replicas, rank = self.train_replicas()
        parts, labels = self._source_parts(num_replicas)
        if self.partition_facts is None:
            self._record_partition(labels, parts)
            self.partition_facts["sources"] = self._source_names
        return ClientSampler(parts[rank], epoch_samples=len(self.train_dataset) // num_replicas,
                             seed=self.seed, client=rank)

    def _source_parts(self, clients: int) -> tuple[list[list[int]], list[int]]:
        """Each client's train sequences (windows wholly inside its documents) and every
        sequence's source (the file of its first token, numbered among the train sources)."""
        cache, ids = self._cache, self._train_document_ids
        if not self.split_by_document or (cache.sources[ids] < 0).any():
            raise ValueError(f"data.partition=source needs whole documents by file, which {self._source()} "
                             "does not split into (too few tokens for a split by document); use data.partition=iid")
        lengths = (cache.starts[1:] - cache.starts[:-1])[ids]
        files, source_of_document = np.unique(cache.sources[ids], return_inverse=True)
        source_tokens = np.bincount(source_of_document, weights=lengths).astype(np.int64)
        client_of_document = np.asarray(contiguous_source_clients(source_tokens.tolist(), clients))[source_of_document]
        ends = np.cumsum(lengths)  # each train document's end in the packed stream
        starts, total, seq = ends - lengths, len(self.train_dataset), self.seq_len
        parts = []
        for client in range(clients):
            owned = np.flatnonzero(client_of_document == client)
            if len(owned):
                first = -(-int(starts[owned[0]]) // seq)
                last = min(total, (int(ends[owned[-1]]) - seq - 1) // seq + 1)
            if not len(owned) or last - first < self.batch_size:
                raise ValueError(f"data.partition=source leaves client {client} fewer than data.batch_size="
                                 f"{self.batch_size} sequences of {self._source()} over {clients} clients; "
                                 "use fewer clients, a shorter data.seq_len or a larger corpus")
            parts.append(list(range(first, last)))
        document_at = np.searchsorted(ends, np.arange(total) * seq, side="right")
        labels = source_of_document[document_at].tolist()
        paths = corpus_files(self.paths)
        root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
        self._source_names = [os.path.relpath(paths[f], root) for f in files.tolist()]
        return parts, labels

    def _describe_labels(self, histogram: list[int]) -> str:
        held = [self._source_names[s] for s, count in enumerate(histogram) if count]
        return f"from {len(held)} source files ({held[0]} ... {held[-1]})"


def first_tokens(spans: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """``spans`` cut after their first ``count`` tokens (packed sequences read them in order)."""
    kept = []
    for start, end in spans:
        if count <= 0:
            break
        kept.append((start, min(end, start + count)))
        count -= end - start
    return kept


def _bytes_per_token(cache: TokenCache, spans: list[tuple[int, int]]) -> float:
    """UTF-8 bytes of text per token over ``spans`` of the token file, end-of-text tokens
    counted (they are predicted too), so ``val/bpb`` compares tokenizers on the same text.
    A document cut by a span counts its bytes in proportion to its tokens inside."""
    starts = cache.starts
    total_bytes = 0.0
    tokens = 0
    for start, end in spans:
        tokens += end - start
        first = int(np.searchsorted(starts, start, side="right")) - 1
        last = int(np.searchsorted(starts, end, side="left"))
        for doc in range(first, last):
            doc_start, doc_end = int(starts[doc]), int(starts[doc + 1])
            inside = min(end, doc_end) - max(start, doc_start)
            total_bytes += cache.text_bytes[doc] * inside / (doc_end - doc_start)
    return total_bytes / tokens if tokens else 1.0
