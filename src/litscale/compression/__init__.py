"""Gradient compression as DDP communication hooks.

A hook is a plain ``(state, bucket) -> Future[Tensor]`` function, as
``DistributedDataParallel.register_comm_hook`` takes it; ``CommHook`` pairs it with its state
so a strategy can attach both. The factories below (the ``_target_`` of each
``conf/compression/*.yaml``) build one per method; every state counts the bytes it sent and
has ``state_dict()`` / ``load_state_dict()``.

On a plain DDP model::

    hook = topk(ratio=0.01, error_feedback=True)
    hook.register(ddp_model)            # names parameters, then register_comm_hook
"""

from __future__ import annotations

from litscale.compression.factories import bf16, fp16, powersgd, qsgd, signsgd, terngrad, topk
from litscale.compression.hook import CommHook
from litscale.compression.state import CompressionState

__all__ = ["CommHook", "CompressionState", "bf16", "fp16", "powersgd", "qsgd", "signsgd",
           "terngrad", "topk"]
