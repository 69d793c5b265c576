"""fp16 / bf16 all-reduce: torch's default hooks, wrapped to count the bytes they send."""

# NOTE: no `from __future__ import annotations` here: DDP's register_comm_hook checks the
# hook's annotations, which must be real types (dist.GradBucket, Future[Tensor]), not strings.
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from litscale.compression.state import CompressionState

_CAST_HOOKS = {torch.float16: default_hooks.fp16_compress_hook,
               torch.bfloat16: default_hooks.bf16_compress_hook}


class CastState(CompressionState):
    """State of ``cast_compression_hook``: the dtype gradients are all-reduced in."""

    def __init__(self, *, dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dtype = dtype


def cast_compression_hook(state: CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``fp16_compress_hook`` / ``bf16_compress_hook``: cast, all-reduce, cast back."""
    gradient = bucket.buffer()
    # torch's hook all-reduces ``gradient.to(dtype)``: that tensor is what goes on the wire.
    state.record(bucket, sent_bytes=gradient.numel() * torch.finfo(state.dtype).bits // 8,
                 dense_bytes=gradient.numel() * gradient.element_size())
    with state.timed():
        return _CAST_HOOKS[state.dtype](state.process_group, bucket)
