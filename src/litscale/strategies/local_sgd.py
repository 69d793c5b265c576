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
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.compression import CommHook
from litscale.compression.outer_quantization import OuterDtype
from litscale.constraints import Fraction, NonNegativeInt, PositiveFloat, PositiveInt
from litscale.parallel.contract import Option
from litscale.strategies.ddp import DDPStrategy
from litscale.strategies.local_sgd_state import OuterOptimizer, local_sgd_hook


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
    # Local SGD's math, not its code: each rank's optimizer steps on that rank's share of the
    # batch and only then are parameters averaged (AdamW's update is not linear in the gradient).
    averages_across_replica_groups = False  # each rank steps on its own gradients
    refuses = {Option.LAYOUT_INVARIANT: "each rank's optimizer steps on its own share of the batch before the "
               "parameters are averaged, so the model depends on the number of ranks by design (at sync_every=1 too)",
               Option.COMPRESSION: "its synchronisation already is its communication hook"}
    untraced = "its parameter averaging every few steps is not traced"
    phase_collectives = {"backward": "gradient all-reduce (warm-up)", "optimizer": "parameter all-reduce"}
    plannable = False  # parameters averaged every few steps: not the planner's synchronous step

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

    def validate_setup(self, *, world_size: int, net: torch.nn.Module, seq_len: int | None = None,
                       micro_batch: int | None = None) -> None:
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
