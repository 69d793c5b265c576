"""``CommHook``: a DDP communication hook paired with its state."""

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
