"""Lossy gradient codecs: what a rank sends for a flat bucket of gradients, and how it is
read back.

A bucket is a concatenation of parameters (``segments``: their sizes). Every codec works
within each parameter (top-k per tensor, scales per block of one tensor), never across
them: DDP regroups parameters into different buckets after its first step and after every
restart, and a compression that depended on the grouping would not resume exactly.

Each codec turns the bucket into a few tensors whose sizes depend only on the segments (so
every rank's payload has the same length and one ``all_gather`` exchanges them). Low-bit
codes are packed 8/4/2 per byte because torch has no sub-byte integer dtype: the bytes on
the wire are then the bits the method promises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

Segments = tuple[int, ...]


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes in ``[0, 2**bits)`` (bits in 1, 2, 4, 8) into a uint8 tensor."""
    if bits == 8:
        return codes.to(torch.uint8)
    per_byte = 8 // bits
    padded = torch.nn.functional.pad(codes.to(torch.uint8), (0, -codes.numel() % per_byte))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (padded.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """The inverse of ``pack_bits``: the first ``numel`` codes, as int64."""
    if bits == 8:
        return packed[:numel].long()
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.view(-1, 1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel].long()


def code_bits(values: int) -> int:
    """Bits per code for ``values`` distinct codes, rounded up to a width that packs into bytes."""
    needed = max(1, math.ceil(math.log2(values)))
    return next(width for width in (1, 2, 4, 8) if width >= needed)


def block_ids(segments: Segments, block_size: int, device: torch.device) -> tuple[Tensor, int]:
    """For each element, the index of its block (blocks never span two parameters)."""
    ids, first = [], 0
    for numel in segments:
        ids.append(torch.arange(numel, device=device) // block_size + first)
        first += math.ceil(numel / block_size)
    return torch.cat(ids), first


@dataclass(frozen=True)
class TopK:
    """Keep the ``ceil(ratio x numel)`` largest magnitudes of each parameter; send their
    values and int32 indices into the bucket."""

    ratio: float
    stochastic = False

    def k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.ratio * numel)))

    def encode(self, flat: Tensor, segments: Segments, uniform: Tensor | None = None) -> list[Tensor]:
        indices, offset = [], 0
        for piece, numel in zip(flat.split(list(segments)), segments, strict=True):
            indices.append(piece.abs().topk(self.k(numel), sorted=False).indices + offset)
            offset += numel
        index = torch.cat(indices)
        # int32 indices: a bucket holds far fewer than 2**31 elements, and 4 bytes fewer per
        # kept value is the difference between 33x and 50x at 1%.
        return [flat[index], index.to(torch.int32)]

    def decode(self, parts: list[Tensor], segments: Segments) -> Tensor:
        values, indices = parts
        return values.new_zeros(sum(segments)).index_put_((indices.long(),), values, accumulate=True)


@dataclass(frozen=True)
class QSGD:
    """QSGD (Alistarh et al. 2017): per block of ``block_size`` elements, ``|g_i| / ||g||_2``
    stochastically rounded to one of ``levels`` levels; unbiased. Sends one float32 norm per
    block and a packed (sign, level) code per element."""

    levels: int
    block_size: int
    stochastic = True

    @property
    def bits(self) -> int:
        return code_bits(2 * self.levels + 1)

    def encode(self, flat: Tensor, segments: Segments, uniform: Tensor | None = None) -> list[Tensor]:
        ids, blocks = block_ids(segments, self.block_size, flat.device)
        values = flat.float()
        norms = values.new_zeros(blocks).index_add_(0, ids, values.square()).sqrt_()
        scaled = values.abs() / norms[ids].clamp_min(torch.finfo(torch.float32).tiny) * self.levels
        level = (scaled + uniform).floor_().clamp_(max=self.levels)  # P(up) = fractional part
        codes = (torch.sign(values) * level + self.levels).long()
        return [norms, pack_bits(codes, self.bits)]

    def decode(self, parts: list[Tensor], segments: Segments) -> Tensor:
        norms, packed = parts
        ids, _ = block_ids(segments, self.block_size, norms.device)
        signed_level = unpack_bits(packed, self.bits, ids.numel()).float() - self.levels
        return signed_level * norms[ids] / self.levels


@dataclass(frozen=True)
class TernGrad:
    """TernGrad (Wen et al. 2017): per block, ``max |g|`` x a stochastic ternary
    ``{-1, 0, +1}`` with ``P(|code| = 1) = |g_i| / max |g|``; unbiased. 2 bits per element."""

    block_size: int
    stochastic = True

    def encode(self, flat: Tensor, segments: Segments, uniform: Tensor | None = None) -> list[Tensor]:
        ids, blocks = block_ids(segments, self.block_size, flat.device)
        magnitude = flat.float().abs()
        scales = magnitude.new_zeros(blocks).scatter_reduce_(0, ids, magnitude, "amax")
        keep = uniform < magnitude / scales[ids].clamp_min(torch.finfo(torch.float32).tiny)
        codes = (torch.sign(flat.float()) * keep + 1).long()
        return [scales, pack_bits(codes, 2)]

    def decode(self, parts: list[Tensor], segments: Segments) -> Tensor:
        scales, packed = parts
        ids, _ = block_ids(segments, self.block_size, scales.device)
        return (unpack_bits(packed, 2, ids.numel()).float() - 1) * scales[ids]


@dataclass(frozen=True)
class ScaledSign:
    """signSGD with a scale, as in EF-SignSGD (Karimireddy et al. 2019): per block,
    ``mean |g|`` x ``sign(g)``. 1 bit per element (zero is sent as +)."""

    block_size: int
    stochastic = False

    def encode(self, flat: Tensor, segments: Segments, uniform: Tensor | None = None) -> list[Tensor]:
        ids, blocks = block_ids(segments, self.block_size, flat.device)
        magnitude = flat.float().abs()
        sums = magnitude.new_zeros(blocks).index_add_(0, ids, magnitude)
        scales = sums / torch.bincount(ids, minlength=blocks)
        return [scales, pack_bits((flat >= 0).long(), 1)]

    def decode(self, parts: list[Tensor], segments: Segments) -> Tensor:
        scales, packed = parts
        ids, _ = block_ids(segments, self.block_size, scales.device)
        return (unpack_bits(packed, 1, ids.numel()).float() * 2 - 1) * scales[ids]
