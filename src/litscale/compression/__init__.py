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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class CommHook:
    """A DDP communication hook and the state object passed to it on every bucket."""

    hook: Callable[..., Any]
    state: Any = None

    def register(self, ddp_model: nn.Module) -> None:
        """Attach to a ``DistributedDataParallel`` model (``register_comm_hook``), first naming
        its parameters in the state so checkpointed residuals are keyed by name."""
        bind = getattr(self.state, "bind", None)
        if bind is not None:
            bind(ddp_model)
        ddp_model.register_comm_hook(self.state, self.hook)


from litscale.compression.factories import (  # noqa: E402  (they import CommHook)
    bf16,
    fp16,
    powersgd,
    qsgd,
    signsgd,
    terngrad,
    topk,
)
from litscale.compression.state import CompressionState  # noqa: E402

__all__ = ["CommHook", "CompressionState", "bf16", "fp16", "powersgd", "qsgd", "signsgd",
           "terngrad", "topk"]
