"""Top-k, QSGD, TernGrad and scaled-sign compression as DDP comm hooks, with error feedback.

Compressed gradients cannot be summed while compressed (top-k supports differ across ranks,
quantisation scales differ), so each rank all-gathers every rank's payload and decodes and
averages them locally, as the reference implementations of these methods do. The payload is
the codec's tensors viewed as bytes and concatenated: one collective per bucket, and its
length is exactly what ``bytes_sent`` counts.
"""

# NOTE: no `from __future__ import annotations` here: DDP's register_comm_hook checks the
# hook's annotations, which must be real types (dist.GradBucket, Future[Tensor]), not strings.
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from litscale.compression.codecs import Segments
from litscale.compression.state import CompressionState


class Codec(Protocol):
    stochastic: bool  # whether encode needs uniform noise (one number per element)

    def encode(self, flat: Tensor, segments: Segments, uniform: Tensor | None) -> list[Tensor]: ...

    def decode(self, parts: list[Tensor], segments: Segments) -> Tensor: ...


class AllGatherCompressionState(CompressionState):
    """State of ``allgather_compression_hook``: the codec, counters and residuals."""

    def __init__(self, *, codec: Codec, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.codec = codec


def _to_bytes(parts: list[Tensor]) -> Tensor:
    return torch.cat([part.contiguous().view(torch.uint8).reshape(-1) for part in parts])


def _from_bytes(payload: Tensor, like: list[Tensor]) -> list[Tensor]:
    parts, offset = [], 0
    for part in like:
        size = part.numel() * part.element_size()
        piece = payload[offset: offset + size]
        if offset % part.element_size():
            # A part after an odd number of 2-byte values (top-k's bf16 values, then its int32
            # indices) starts off its type's alignment, where a view is refused: read a copy.
            piece = piece.clone()
        parts.append(piece.view(part.dtype).view(part.shape))
        offset += size
    return parts


def encode_with_error_feedback(state: AllGatherCompressionState, bucket: dist.GradBucket) -> list[Tensor]:
    """Encode the bucket's gradient plus the residual of earlier steps; keep the new residual
    (what this step's encoding left out) for the next step."""
    gradient = bucket.buffer()
    layout = state.layout(bucket)
    if state.error_feedback:
        residual = state.residuals.get(bucket.index(), layout, gradient.device)
        corrected = gradient + residual if residual is not None else gradient.clone()
    else:
        corrected = gradient
    segments = layout[1]
    uniform = state.uniform_noise(layout, gradient.device) if state.codec.stochastic else None
    parts = state.codec.encode(corrected, segments, uniform)
    if state.error_feedback:
        decoded = state.codec.decode(parts, segments).to(corrected.dtype)
        state.residuals.set(bucket.index(), layout, corrected - decoded)
    return parts


def allgather_compression_hook(
    state: AllGatherCompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[Tensor]:
    """DDP comm hook: compress, all-gather every rank's payload, decode and average."""
    gradient = bucket.buffer()
    segments = state.layout(bucket)[1]
    with state.timed():
        parts = encode_with_error_feedback(state, bucket)
        payload = _to_bytes(parts)
    state.record(bucket, sent_bytes=payload.numel(), dense_bytes=gradient.numel() * gradient.element_size())
    world_size = state.world_size()
    gathered = [torch.empty_like(payload) for _ in range(world_size)]
    future = dist.all_gather(gathered, payload, group=state.group, async_op=True).get_future()

    def decode_and_average(_: torch.futures.Future) -> Tensor:
        with state.timed():
            total = torch.zeros(gradient.numel(), dtype=torch.float32, device=gradient.device)
            for rank_payload in gathered:
                total += state.codec.decode(_from_bytes(rank_payload, parts), segments).float()
            gradient.copy_(total.div_(world_size))
        return gradient

    return future.then(decode_and_average)
