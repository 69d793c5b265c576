"""One training step of the run as configured, at its world size, on this machine: the network
the dry run split over torch's fake process group (its collectives return at once) is given
fake tensors (shapes, no storage: ``FakeTensorMode``), and torch's ``MemTracker`` watches two
steps of forward, loss, backward and the configured optimizer, in Lightning's order (the second
holds the state the first made, and the first's gradients through its forward). Its peak is what one rank of the planned job allocates, set beside the planner's
prediction by ``plan=show|auto plan.fake_step=true``; torchtitan estimates memory the same way.

Nothing is stored, so 64 ranks of GPT-2 small at 1,024 tokens take seconds on 2 cores. Not
run (and said why): DDP and the strategies built on it (its gradient buckets); a pipeline, whose stages exchange activations point to point; a mixture of
experts, whose routing reads the router's values, which fake tensors do not have; context
parallel, whose ranks take their chunks of each sequence in the training loop; a network that
is not a causal language model; DeepSpeed, which the dry run does not build.
"""

from __future__ import annotations

from typing import Any

from torch import nn

PIPELINE = "a pipeline's stages exchange activations point to point, which the fake process group does not carry"
EXPERTS = "a mixture of experts routes each token by the router's values, which fake tensors do not have"
CONTEXT = "context parallel feeds each rank its chunks of every sequence in the training loop, which this step does not"
NOT_CAUSAL_LM = "the model is not a causal language model (the step feeds it tokens)"
# NOTE: a step of the bare network drops its gradients before the backward; DDP's gradient
# buckets keep every gradient's memory for the whole run, beside the backward's temporaries.
DDP_REDUCER = ("DDP's gradient buckets are made by its C++ reducer, which fake tensors cannot run, and a step "
               "without them leaves out that they hold every gradient for the whole run")


def why_not(cfg: Any, strategy: Any, holder: nn.Module, stages: list) -> str | None:
    """Why one step of this run cannot run on the fake process group; None: it can."""
    from lightning.pytorch.strategies import DDPStrategy

    from litscale.declarations import find_expert_modules

    if isinstance(strategy, DDPStrategy):
        return DDP_REDUCER
    if stages:
        return PIPELINE
    if find_expert_modules(holder["net"]):
        return EXPERTS
    if int(cfg.strategy.get("context_parallel_size") or 1) > 1:
        return CONTEXT
    if not str(cfg.model.get("_target_", "")).endswith("CausalLMModule"):
        return NOT_CAUSAL_LM
    return None


def peak_of_one_step(cfg: Any, holder: nn.Module) -> int:
    """Bytes one rank holds at the peak of a training step of ``holder["net"]`` (already split
    on the fake process group, on the meta device), with the configured optimizer, micro batch,
    sequence and precision."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from litscale.app.build import build, trusted_targets
    from litscale.modules import next_token_loss, optimizer_groups
    from litscale.step_memory import TOTAL, total_only_tracker

    net, precision = holder["net"], cfg.precision
    mixed = precision.compute_dtype != precision.param_dtype and precision.compute_dtype != "float32"
    autocast = torch.autocast("cpu", dtype=getattr(torch, precision.compute_dtype)) if mixed else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True):
        holder.to_empty(device="cpu")
        factory = build(cfg.optimizer, trusted=trusted_targets(cfg))
        optimizer = factory(optimizer_groups(net, factory, float(cfg.model.get("weight_decay", 0.0))))
        tokens = torch.zeros(int(cfg.data.batch_size), int(cfg.data.seq_len) + 1, dtype=torch.long)
        tracker = total_only_tracker()
        tracker.track_external(net, optimizer)
        with tracker:
            for _ in range(2):
                with autocast:
                    logits = net(tokens[:, :-1])
                    loss = next_token_loss(logits, tokens[:, 1:])  # CausalLMModule's: its fp32 copy is in the peak
                # In Lightning's order (its closure): the last step's gradients are dropped after
                # the forward, not before it, so they are part of the forward's peak.
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")][TOTAL])
