"""The outer gradient of streaming DiLoCo in fewer bits: ``bf16``, ``fp8_e4m3`` or ``int4``,
as bytes a collective can carry, with error feedback.

- ``bf16``: a cast (2 bytes an element, no scale).
- ``fp8_e4m3``: each block of ``BLOCK`` elements divided by its absmax / 448 (e4m3's largest
  finite value), then cast to ``float8_e4m3fn`` (round to nearest): 1 byte an element plus one
  fp32 scale a block.
- ``int4``: each block divided by its absmax / 7 and rounded to the nearest integer in
  ``[-7, 7]`` (symmetric), two to a byte: half a byte an element plus one fp32 scale a block.

Error feedback: what quantizing lost (the input minus what the receivers decode) is added to
the next outer gradient of the same fragment, so nothing is lost for good, only late.

Written here, not taken from torchao: its int4 and fp8 paths are kernels for weights and
matmuls (CUDA first), not a wire format for an arbitrary flat vector; the formats are a few
lines of torch, which casts to ``float8_e4m3fn`` on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

OuterDtype = Literal["fp32", "bf16", "fp8_e4m3", "int4"]
BLOCK = 128  # elements sharing one scale
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
INT4_MAX = 7  # symmetric int4: -7..7


@dataclass
class Quantized:
    """One rank's quantized outer gradient: ``payload`` (uint8) and ``scales`` (fp32, one per
    block; empty for bf16); ``numel`` elements once decoded."""

    payload: torch.Tensor
    scales: torch.Tensor
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends for it."""
        return self.payload.numel() + self.scales.numel() * self.scales.element_size()


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, ``[blocks, BLOCK]``."""
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK))
    return padded.view(-1, BLOCK)


def _scales(blocks: torch.Tensor, largest: float) -> torch.Tensor:
    scales = blocks.abs().amax(dim=1) / largest
    return torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: any scale


def quantize(flat: torch.Tensor, dtype: OuterDtype) -> Quantized:
    """``flat`` (fp32, 1-D) in ``dtype``'s wire format."""
    flat = flat.detach().float()
    if dtype == "bf16":
        return Quantized(flat.to(torch.bfloat16).view(torch.uint8), flat.new_empty(0), flat.numel())
    blocks = _blocks(flat)
    if dtype == "fp8_e4m3":
        scales = _scales(blocks, FP8_MAX)
        codes = (blocks / scales[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        return Quantized(codes.reshape(-1), scales, flat.numel())
    if dtype == "int4":
        scales = _scales(blocks, INT4_MAX)
        levels = (
            torch.round(blocks / scales[:, None]).clamp_(-INT4_MAX, INT4_MAX).to(torch.uint8) + 8
        )
        levels = levels.reshape(-1, 2)
        return Quantized((levels[:, 0] | (levels[:, 1] << 4)).contiguous(), scales, flat.numel())
    raise ValueError(
        f"outer_dtype={dtype!r} is not a quantized format; allowed: bf16, fp8_e4m3, int4"
    )


def dequantize(quantized: Quantized, dtype: OuterDtype) -> torch.Tensor:
    """The fp32 vector ``quantized`` stands for."""
    payload, scales, numel = quantized.payload, quantized.scales, quantized.numel
    if dtype == "bf16":
        return payload.view(torch.bfloat16).float()
    if dtype == "fp8_e4m3":
        values = payload.view(torch.float8_e4m3fn).float().view(-1, BLOCK)
    else:
        levels = torch.stack([payload & 0x0F, payload >> 4], dim=1).reshape(-1, BLOCK)
        values = levels.float() - 8
    return (values * scales[:, None]).reshape(-1)[:numel]


def payload_size(numel: int, dtype: OuterDtype) -> tuple[int, int]:
    """``(payload bytes, scales)`` of a quantized vector of ``numel`` elements: what every rank
    sends for it, known before it is quantized (the all-gather's buffers)."""
    if dtype == "bf16":
        return 2 * numel, 0
    blocks = -(-numel // BLOCK)
    return (blocks * BLOCK if dtype == "fp8_e4m3" else blocks * BLOCK // 2), blocks


def quantize_with_feedback(
    flat: torch.Tensor, residual: torch.Tensor | None, dtype: OuterDtype
) -> tuple[Quantized, torch.Tensor]:
    """Quantize ``flat`` plus the last ``residual``; returns the quantized value and the new
    residual (what this quantization lost), ``flat + residual - dequantize(quantized)``."""
    target = flat if residual is None else flat + residual
    quantized = quantize(target, dtype)
    return quantized, target - dequantize(quantized, dtype)
