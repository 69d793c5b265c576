"""The token batch contract: what a batch carries beside its tokens, and how its loss counts.

Who sets it: the data modules whose rows mask part of the loss or pack several documents
(``data=sft``, ``data=tokens`` with ``document_mask=true``); who reads it: the causal LM module
(``litscale.modules``), the pipeline's loss, the layout-invariant chunks, context parallel's
sequence split (every ``[batch, sequence]`` tensor is cut as the tokens are).

A ``TokenBatch`` is four tensors, batched by the default collate:

- ``tokens`` ``[B, T]`` (int64): the model's input;
- ``targets`` ``[B, T]`` (int64): the next token at each position, or ``IGNORE_INDEX`` where the
  position does not count (a prompt's tokens, padding);
- ``positions`` ``[B, T]`` (int64): each token's position in its document, restarting at 0
  where a packed row's next document begins: a model that attends within documents
  (``attends_within_documents``) takes its rotary positions from them and keeps attention
  inside each run of consecutive positions (``litscale.models.documents``);
- ``counted_fraction`` ``[B]`` (float64): the counted share of the target positions of the
  whole global batch the sample trains in (all ranks, all micro batches of its optimizer step),
  the same for every sample of a step.

The loss of any slice of a global batch (a rank's micro batch, a pipeline's micro batch, a
context-parallel rank's share of the sequence, a layout-invariant chunk) is its summed token
loss over ``counted_fraction x its target positions``. Every strategy averages equal slices with
equal weight (DDP over ranks, FSDP over data x context, Lightning over accumulation, the
pipeline over its micro batches); that average is then the summed loss over the global
batch's counted tokens: the mean over them, on every layout, with no collective to count them.
Without a mask the fraction is 1 and the loss the plain mean.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

#: A target that does not count (``torch.nn.functional.cross_entropy``'s default ignore index).
IGNORE_INDEX = -100


class TokenBatch(NamedTuple):
    """A batch of token rows that may mask its targets and pack documents (module docstring)."""

    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    counted_fraction: torch.Tensor


class SampleKey(NamedTuple):
    """What a training sampler hands a counted dataset for one sample: its index, the data epoch
    (a mixture draws other rows of its sources in another epoch), and the counted fraction of the
    global batch it trains in."""

    index: int
    epoch: int
    counted_fraction: float


def sample_key(key: int | SampleKey) -> SampleKey:
    """``key`` as a ``SampleKey``: a plain index (validation, a user's loader) is epoch 0, with no
    global batch (fraction 0: the loss then counts the batch's own tokens)."""
    return key if isinstance(key, SampleKey) else SampleKey(int(key), 0, 0.0)


def rows_of(batch, rows: slice):
    """The rows ``rows`` of every tensor of ``batch`` (a ``TokenBatch`` or a plain tuple), of the same kind."""
    taken = (t[rows] for t in batch)
    return batch._make(taken) if isinstance(batch, TokenBatch) else tuple(taken)


def loss_denominator(targets: torch.Tensor, counted_fraction: torch.Tensor | None) -> torch.Tensor:
    """What a slice's summed token loss (its ``targets``) is divided by: ``counted_fraction`` x
    its target positions while training on a global batch; where there is none (fraction 0 or
    None: validation, a loader without a global order), its own counted tokens, at least 1, so
    an empty slice adds 0. float64, and no host sync (``torch.where``)."""
    own = (targets != IGNORE_INDEX).sum().clamp(min=1).to(torch.float64)
    if counted_fraction is None:
        return own
    fraction = counted_fraction.reshape(-1)[0].to(device=targets.device, dtype=torch.float64)
    return torch.where(fraction > 0, fraction * targets.numel(), own)


def counted_tokens(batch) -> int:
    """The target positions of ``batch`` that count in the loss (every one of a plain batch)."""
    targets = batch[1]
    return int((targets != IGNORE_INDEX).sum()) if isinstance(batch, TokenBatch) else targets.numel()


def step_fractions(counted: np.ndarray, *, global_batch: int, seq_len: int) -> np.ndarray:
    """The counted fraction of each consecutive global batch of ``counted`` (counted target
    positions per sample, in the global order; a short last batch is its own), float64."""
    if not len(counted):
        return np.zeros(0)
    starts = np.arange(0, len(counted), global_batch)
    totals = np.add.reduceat(counted.astype(np.int64), starts)
    sizes = np.diff(np.append(starts, len(counted)))
    return totals / (sizes * float(seq_len))


def document_positions(lengths: list[int] | np.ndarray, seq_len: int) -> np.ndarray:
    """Positions of a row of ``seq_len`` tokens holding documents of ``lengths`` in order, each
    counted from 0, then the rest of the row (padding) as one more document."""
    positions = np.empty(seq_len, dtype=np.int64)
    start = 0
    for length in [*lengths, seq_len - int(np.sum(lengths))]:
        positions[start:start + length] = np.arange(length)
        start += length
    return positions


def attended_tokens(positions: np.ndarray) -> int:
    """The (query, key) pairs a row's attention computes, counted whole as the FLOP formulas
    count attention (``litscale.measure.flops``): the sum of its documents' squared lengths,
    each document a run of consecutive positions (``litscale.models.documents``' rule, padding
    one more); ``seq_len ** 2`` for a row of one document."""
    starts = np.flatnonzero(np.r_[True, positions[1:] != positions[:-1] + 1])
    lengths = np.diff(np.r_[starts, len(positions)])
    return int((lengths.astype(np.int64) ** 2).sum())


def positions_after_ends(tokens: np.ndarray, end_id: int) -> np.ndarray:
    """Positions of a packed window of raw text: counted from the window's start, and from 0
    again after each end-of-text token (a document's last)."""
    starts = np.zeros(len(tokens), dtype=bool)
    starts[0] = True
    starts[1:] = tokens[:-1] == end_id
    first = np.maximum.accumulate(np.where(starts, np.arange(len(tokens)), 0))
    return np.arange(len(tokens)) - first


def model_inputs(net, batch: TokenBatch) -> tuple[torch.Tensor, ...]:
    """What ``net`` is called with for ``batch``: the tokens, and their positions where the net
    attends within documents (``attends_within_documents``: packed rows). Validation refuses
    packed rows for any other net, so the positions of unpacked rows (one document) are all a
    net without them misses."""
    if getattr(net, "attends_within_documents", False):
        return batch.tokens, batch.positions
    return (batch.tokens,)


def packs_documents(data) -> str | None:
    """The data key that packs several documents into a row (``data.pack``, ``data.document_mask``),
    where ``data`` (a data config) sets one, else None."""
    for key in ("pack", "document_mask"):
        if data.get(key):
            return f"data.{key}"
    return None
