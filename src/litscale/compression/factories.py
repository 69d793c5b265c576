"""One typed keyword-only factory per ``compression=`` option; each returns a ``CommHook``.

Their signatures are the schema the config validator checks ``compression.*`` keys against.
"""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Interval

from litscale.arguments import checked_arguments
from litscale.compression.allgather import AllGatherCompressionState, allgather_compression_hook
from litscale.compression.casts import CastState, cast_compression_hook
from litscale.compression.codecs import QSGD, ScaledSign, TernGrad, TopK
from litscale.compression.hook import CommHook
from litscale.compression.powersgd import PowerSGDCompressionState, powersgd_compression_hook
from litscale.constraints import NonNegativeInt, PositiveFloat, PositiveInt

Ratio = Annotated[float, Interval(gt=0, le=1)]
Levels = Annotated[int, Interval(ge=1, le=127)]


def fp16() -> CommHook:
    """All-reduce gradients in float16 (torch's ``fp16_compress_hook``): 2x fewer bytes."""
    return CommHook(hook=cast_compression_hook, state=CastState(dtype=torch.float16))


def bf16() -> CommHook:
    """All-reduce gradients in bfloat16 (torch's ``bf16_compress_hook``): 2x fewer bytes."""
    return CommHook(hook=cast_compression_hook, state=CastState(dtype=torch.bfloat16))


@checked_arguments("compression")
def powersgd(
    *,
    rank: PositiveInt = 4,
    start_iteration: PositiveInt = 10,
    warm_start: bool = True,
    batched: bool = False,
    min_compression_rate: PositiveFloat = 2.0,
    error_feedback: bool = True,
    seed: NonNegativeInt = 0,
) -> CommHook:
    """PowerSGD rank-``rank`` approximation of each gradient matrix (torch's hooks); dense
    all-reduce for the first ``start_iteration`` steps; ``batched`` compresses a whole bucket
    as one square matrix (``batched_powerSGD_hook``)."""
    if (error_feedback or warm_start) and start_iteration < 2:
        raise ValueError(
            f"compression.start_iteration={start_iteration} is not valid with error_feedback or "
            "warm_start: expected >= 2 (DDP rebuilds its buckets after the first step)"
        )
    if batched and not _batched_powersgd_works():
        raise ValueError(
            f"compression.batched=true is not available with torch {torch.__version__}: its "
            "batched_powerSGD_hook orthogonalises a 2-D matrix that _orthogonalize rejects; "
            "use compression.batched=false")
    state = PowerSGDCompressionState(
        rank=rank, start_iteration=start_iteration, warm_start=warm_start, batched=batched,
        min_compression_rate=min_compression_rate, error_feedback=error_feedback, seed=seed)
    return CommHook(hook=powersgd_compression_hook, state=state)


def _batched_powersgd_works() -> bool:
    """torch 2.13's ``batched_powerSGD_hook`` passes a 2-D matrix to ``_orthogonalize``, which
    asserts a 3-D batch: probe that here rather than fail in the first compressed step."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    try:
        _orthogonalize(torch.eye(4, 2))
    except AssertionError:
        return False
    return True


def _allgather(codec, *, error_feedback: bool, seed: int) -> CommHook:
    state = AllGatherCompressionState(codec=codec, error_feedback=error_feedback, seed=seed)
    return CommHook(hook=allgather_compression_hook, state=state)


@checked_arguments("compression")
def topk(*, ratio: Ratio = 0.01, error_feedback: bool = True, seed: NonNegativeInt = 0) -> CommHook:
    """Top-k sparsification: the ``ratio`` largest-magnitude entries of each bucket, sent as
    values + int32 indices with all-gather."""
    return _allgather(TopK(ratio=ratio), error_feedback=error_feedback, seed=seed)


@checked_arguments("compression")
def qsgd(*, levels: Levels = 7, block_size: PositiveInt = 512, error_feedback: bool = False,
         seed: NonNegativeInt = 0) -> CommHook:
    """QSGD: ``levels`` quantisation levels per sign, stochastic rounding (unbiased), one
    float32 norm per ``block_size`` elements."""
    return _allgather(QSGD(levels=levels, block_size=block_size), error_feedback=error_feedback,
                      seed=seed)


@checked_arguments("compression")
def terngrad(*, block_size: PositiveInt = 512, error_feedback: bool = False,
             seed: NonNegativeInt = 0) -> CommHook:
    """TernGrad: stochastic {-1, 0, +1} x max|g| per ``block_size`` elements (unbiased)."""
    return _allgather(TernGrad(block_size=block_size), error_feedback=error_feedback, seed=seed)


@checked_arguments("compression")
def signsgd(*, block_size: PositiveInt = 512, error_feedback: bool = True,
            seed: NonNegativeInt = 0) -> CommHook:
    """1-bit sign x mean|g| per ``block_size`` elements (EF-SignSGD with error feedback)."""
    return _allgather(ScaledSign(block_size=block_size), error_feedback=error_feedback, seed=seed)
