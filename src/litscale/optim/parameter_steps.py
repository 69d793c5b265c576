"""What litscale's own optimizers (LARS, LAMB, Muon) share: a step that updates each parameter
with a gradient by its group's rule, Adam's betas checked as a user types them, and the whole
tensor of a DTensor shard."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer


def check_betas(betas: Sequence[float]) -> tuple[float, ...]:
    if not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"optimizer.betas={list(betas)} is not valid: expected numbers in [0, 1)")
    return tuple(betas)


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (all-gathered: every rank calls it), or the tensor itself."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if full_tensor is not None else tensor


class ParameterwiseOptimizer(Optimizer):
    """An optimizer whose step is ``_update(param, group)`` for each parameter with a gradient."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict) -> None:
        raise NotImplementedError
