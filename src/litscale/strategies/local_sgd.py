"""Local SGD and DiLoCo: parameters synchronised every ``sync_every`` steps, not gradients
every step.

Post-local SGD (Lin et al. 2020) with torch's pieces: ``post_localSGD_hook`` all-reduces
gradients during ``warmup_steps`` and communicates nothing afterwards; every ``sync_every``
optimizer steps the parameters are averaged (``model_averaging.utils.average_parameters``).
With ``outer_optimizer=nesterov`` this is DiLoCo (Douillard et al. 2023): the averaged
parameter delta since the last synchronisation is a pseudo-gradient for an outer SGD with
Nesterov momentum, applied to the parameters of the last synchronisation. ``sgd`` (heavy-ball
momentum) and ``adam`` are FedOpt's server optimizers (Reddi et al. 2021), which
``strategy=federated`` shares.

Lightning's ``DDPStrategy(model_averaging_period=...)`` averages only on CUDA and has no
outer optimizer, so the schedule is written here, around torch's hook and averaging.
"""

# NOTE: no `from __future__ import annotations`: DDP checks local_sgd_hook's annotations.
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_local_sgd
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.compression import CommHook
from litscale.compression.outer_quantization import OuterDtype
from litscale.compression.state import CompressionState
from litscale.constraints import Fraction, NonNegativeInt, PositiveFloat, PositiveInt
from litscale.strategies.ddp import DDPStrategy

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


class LocalSGDStrategy(DDPStrategy):
    """DDP whose gradients stay local after ``warmup_steps``; parameters are averaged every
    ``sync_every`` optimizer steps, optionally through an outer optimizer (DiLoCo's Nesterov
    SGD, or FedOpt's heavy-ball SGD or Adam).

    Streaming DiLoCo (``litscale.strategies.streaming``): ``fragments`` synchronised in turn,
    each every ``sync_every`` steps; ``overlap_steps`` inner steps taken while a fragment's
    exchange is in flight, then merged with ``mixing_factor``; ``outer_dtype`` the format the
    outer gradient is sent in (with error feedback below fp32).

    Takes no ``compression``: there is no per-step gradient exchange to compress.
    """

    # Where a rank waits for its peers, by phase (litscale.callbacks.watchdog).
    phase_collectives = {"backward": "gradient all-reduce (warm-up)", "optimizer": "parameter all-reduce"}

    @checked_arguments("strategy")
    def __init__(
        self,
        *,
        sync_every: PositiveInt = 8,
        warmup_steps: NonNegativeInt = 0,
        outer_optimizer: OuterOptimizer = "none",
        outer_lr: PositiveFloat = 0.7,
        outer_momentum: Fraction = 0.9,
        fragments: PositiveInt = 1,
        outer_dtype: OuterDtype = "fp32",
        overlap_steps: NonNegativeInt = 0,
        mixing_factor: Fraction = 0.0,
        bucket_cap_mb: PositiveFloat = 25,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: PositiveInt = 1800,
    ) -> None:
        # NOTE: imported here: streaming.py builds on LocalSGDState, above.
        from litscale.strategies.streaming import StreamingState

        if fragments > sync_every:
            raise ValueError(f"strategy.fragments={fragments} is more than strategy.sync_every={sync_every}: "
                             f"each fragment is synchronised at its own step of a period; allowed: 1..{sync_every}")
        if overlap_steps >= sync_every:
            raise ValueError(f"strategy.overlap_steps={overlap_steps} is not fewer than strategy.sync_every="
                             f"{sync_every}: a fragment's exchange must land before its next one; "
                             f"allowed: 0..{sync_every - 1}")
        self.local_sgd = StreamingState(sync_every=sync_every, warmup_steps=warmup_steps,
                                        outer_optimizer=outer_optimizer, outer_lr=outer_lr,
                                        outer_momentum=outer_momentum, fragments=fragments,
                                        outer_dtype=outer_dtype, overlap_steps=overlap_steps,
                                        mixing_factor=mixing_factor)
        self.fragment_names: list[list[str]] = []  # parameter names by fragment, set at train start
        super().__init__(compression=CommHook(hook=local_sgd_hook, state=self.local_sgd),
                         bucket_cap_mb=bucket_cap_mb, process_group_backend=process_group_backend,
                         timeout_s=timeout_s)

    def validate_setup(self, *, world_size: int, net: torch.nn.Module) -> None:
        """Pre-flight: enough blocks for ``fragments``."""
        from litscale.strategies.streaming import check_fragments

        check_fragments(self.local_sgd.fragments, net)

    @property
    def result(self) -> dict[str, Any]:
        """What ``summary.json`` keeps: bytes of the synchronisations and the fragments' sizes."""
        state = self.local_sgd
        sizes = [sum(p.numel() for p in state._members(self._params(), f)) for f in range(len(state.fragment_index))]
        return {"comm/syncs": state.syncs, "comm/peak_bytes": state.peak_bytes,
                "comm/bytes_per_sync": state.sync_bytes / max(1, state.syncs),
                "local_sgd/fragment_params": sizes}

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        from litscale.strategies.streaming import parameter_fragments

        module = self.lightning_module
        self.fragment_names = parameter_fragments(module, self.local_sgd.fragments)
        self.local_sgd.set_fragments(self.fragment_names,
                                     [name for name, p in module.named_parameters() if p.requires_grad])
        if self.local_sgd.warmup_steps == 0 and self.local_sgd.optimizer_steps == 0:
            self.local_sgd.start_local_phase(self._params())

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.local_sgd.after_optimizer_step(self._params())
        return output

    @override
    def on_train_end(self) -> None:
        self.local_sgd.finish(self._params())  # an exchange still in flight lands before the end
        super().on_train_end()
