"""Gradient compression as DDP communication hooks.

A hook is a plain ``(state, bucket) -> Future[Tensor]`` function, as
``DistributedDataParallel.register_comm_hook`` takes it; ``CommHook`` pairs it with its state
so a strategy can attach both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CommHook:
    """A DDP communication hook and the state object passed to it on every bucket."""

    hook: Callable[..., Any]
    state: Any = None
