"""Local SGD's schedule state, the outer optimizer and the gradient hook: what
``strategy=local_sgd``, its streaming form (``streaming``) and ``strategy=federated`` share.
In a module of their own so that streaming builds on them without importing the strategy
that chooses it."""

# NOTE: no `from __future__ import annotations`: DDP checks local_sgd_hook's annotations.
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_local_sgd
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from litscale.compression.state import CompressionState

OuterOptimizer = Literal["none", "nesterov", "sgd", "adam"]


def build_outer_optimizer(kind: str, anchor: list[torch.Tensor], *, lr: float,
                          momentum: float) -> torch.optim.Optimizer:
    """The outer (server) optimizer over the anchor parameters: SGD with Nesterov or heavy-ball
    momentum, or Adam with ``momentum`` as its first beta. Adam's second beta 0.99 and eps 1e-3
    are FedAdam's (Reddi et al. 2021): a pseudo-gradient is a whole round's update, far larger
    than a gradient, and eps bounds how far a near-zero one is amplified."""
    if kind == "adam":
        return torch.optim.Adam(anchor, lr=lr, betas=(momentum, 0.99), eps=1e-3)
    return torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=kind == "nesterov")


class LocalSGDState(CompressionState):
    """The schedule's state: optimizer steps taken, the parameters at the last
    synchronisation and the outer optimizer (DiLoCo); counts the bytes each sync sends.

    ``identical_across_ranks``: after a synchronisation every rank holds the same state, so
    a checkpoint keeps one copy, not one per rank.
    """

    identical_across_ranks = True

    def __init__(self, *, sync_every: int, warmup_steps: int, outer_optimizer: str,
                 outer_lr: float, outer_momentum: float) -> None:
        super().__init__()
        self.sync_every, self.warmup_steps = sync_every, warmup_steps
        self.outer_optimizer, self.outer_lr, self.outer_momentum = outer_optimizer, outer_lr, outer_momentum
        self.hook_state = torch_local_sgd.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=warmup_steps,
            post_local_gradient_allreduce=False)
        self.optimizer_steps = 0
        self.outer: torch.optim.Optimizer | None = None  # over the anchor parameters (DiLoCo)
        self._restored_outer: dict[str, Any] | None = None

    def after_optimizer_step(self, params: list[torch.nn.Parameter]) -> None:
        """Synchronise the parameters if this step ends a period of ``sync_every`` steps."""
        local_step = self.count_step(params)
        if local_step is None or local_step % self.sync_every:
            return
        with torch.no_grad():
            self.synchronise(params)

    def count_step(self, params: list[torch.nn.Parameter]) -> int | None:
        """Count an optimizer step; the local step it was (None during warm-up). The local
        phase starts after the last warm-up step, from a restored checkpoint's state if any."""
        if self._restored_outer is not None:
            self._restore_outer(params)
        self.optimizer_steps += 1
        local_step = self.optimizer_steps - self.warmup_steps
        if local_step == 0:
            self.start_local_phase(params)
        return local_step if local_step > 0 else None

    def synchronise(self, params: list[torch.nn.Parameter]) -> None:
        """Every rank takes the mean of the parameters (then the outer step, if any)."""
        average_parameters(iter(params), self.group)
        if self.outer is not None:
            self._outer_step(params)
        self.bytes_sent += sum(p.numel() * p.element_size() for p in params)

    def start_local_phase(self, params: list[torch.nn.Parameter]) -> None:
        """DiLoCo's anchor: the parameters all ranks share as local steps begin (identical
        after DDP's warm-up or its initial broadcast); kept if a checkpoint restored it."""
        if self.outer_optimizer == "none" or self.outer is not None:
            return
        self._build_outer([p.detach().clone() for p in params])

    def _build_outer(self, anchor: list[torch.Tensor]) -> None:
        self.outer = build_outer_optimizer(self.outer_optimizer, anchor, lr=self.outer_lr,
                                           momentum=self.outer_momentum)

    def _restore_outer(self, params: list[torch.nn.Parameter]) -> None:
        saved, self._restored_outer = self._restored_outer, None
        self._build_outer([a.to(p) for a, p in zip(saved["anchor"], params, strict=True)])
        self.outer.load_state_dict(saved["optimizer"])  # moves momentum to the anchor's device

    def _outer_step(self, params: list[torch.nn.Parameter]) -> None:
        anchors = self.outer.param_groups[0]["params"]
        for anchor, param in zip(anchors, params, strict=True):
            anchor.grad = anchor - param  # the pseudo-gradient: minus the averaged delta
        self.outer.step()
        for anchor, param in zip(anchors, params, strict=True):
            param.copy_(anchor)

    def totals(self) -> dict[str, float]:
        return {**super().totals(), "steps": self.optimizer_steps}

    def state_dict(self) -> dict[str, Any]:
        outer = None if self.outer is None else {
            "anchor": [a.detach().cpu() for a in self.outer.param_groups[0]["params"]],
            "optimizer": self.outer.state_dict(),
        }
        return {**self.totals(), "hook_iteration": self.hook_state.iter, "outer": outer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bytes_sent, self.dense_bytes = int(state["bytes_sent"]), int(state["dense_bytes"])
        self.optimizer_steps = self.steps = int(state["steps"])
        self.hook_state.iter = int(state["hook_iteration"])
        self.outer, self._restored_outer = None, state.get("outer")


def local_sgd_hook(state: LocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``post_localSGD_hook`` (all-reduce during warm-up, nothing after), counting bytes."""
    gradient = bucket.buffer()
    dense = gradient.numel() * gradient.element_size()
    warming_up = state.hook_state.iter < state.hook_state.start_localSGD_iter
    state.bytes_sent += dense if warming_up else 0
    state.dense_bytes += dense
    return torch_local_sgd.post_localSGD_hook(state.hook_state, bucket)
