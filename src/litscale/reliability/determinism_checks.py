"""What ``determinism=layout_invariant`` refuses, before any rank starts.

Each check raises ``ValueError`` with one line naming the key and value it cannot hold and what
is allowed; the app's validation (``check_determinism``) turns it into a ``ConfigError``. Which
strategies allow the mode, each says itself (the strategy contract, ``litscale.parallel.contract``:
``Option.LAYOUT_INVARIANT``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

MODE = "determinism=layout_invariant"
# Lightning's precision whose loss scaler scales the loss and unscales the gradients: the mode's
# gradients are summed outside its backward, unscaled, so the scaler's step would divide them.
LOSS_SCALED = "16-mixed"
# What a network declares when it is a mixture of experts (litscale.models.moe.MoEDecoder).
EXPERT_HOOKS = ("auxiliary_loss", "take_router_statistics", "update_expert_bias", "expert_modules")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_layout(
    *,
    data_parallel: int,
    accumulation: int,
    micro_batch: int,
    chunks: int,
    compression: str | None,
    context_parallel: int = 1,
    precision: str = "32-true",
    precision_name: str | None = None,
) -> None:
    """Raise ``ValueError`` (one line) where the mode cannot hold for this run's layout:
    compressed or loss-scaled gradients, a sequence split over context-parallel ranks, or
    ``chunks`` that do not split the global batch alike on every layout."""
    if compression:
        raise ValueError(f"{MODE} sums exact gradients, not compression={compression}; allowed: compression=none")
    if context_parallel > 1:
        raise ValueError(
            f"strategy.context_parallel_size={context_parallel} is not supported with {MODE}: the mode "
            "splits the batch into chunks of whole samples, each forwarded on an unsplit replica of the "
            "network; allowed: strategy.context_parallel_size=1")
    if precision == LOSS_SCALED:
        raise ValueError(
            f"precision={precision_name or 'fp16_mixed'} is not supported with {MODE}: its loss scaler "
            "would unscale gradients the mode sums unscaled; allowed: precision=fp32, bf16_mixed or bf16_true")
    per_step = data_parallel * accumulation
    global_batch = micro_batch * per_step
    if not is_power_of_two(chunks) or chunks % per_step or global_batch % chunks:
        raise ValueError(
            f"determinism.chunks={chunks} must be a power of two, a multiple of {data_parallel} data-parallel "
            f"rank(s) x {accumulation} micro batch(es) = {per_step}, and divide the global batch {global_batch}"
        )


def check_network(net: nn.Module, *, model_name: str | None = None) -> None:
    """Raise ``ValueError`` (one line) for a network whose training needs more than its loss
    and gradient: a mixture of experts' load-balancing loss, router counts and expert-bias
    update are produced by the forward and read from the network that trains, while the mode
    forwards a replica of it."""
    hooks = [name for name in EXPERT_HOOKS if hasattr(net, name)]
    if hooks:
        raise ValueError(
            f"model={model_name or type(net).__name__} is not supported with {MODE}: the mode forwards "
            f"a replica of the network, and what its experts' training reads from the network itself "
            f"({', '.join(hooks)}) would be lost; allowed: a network without experts (e.g. model=gpt or "
            "llama)")
