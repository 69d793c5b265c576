"""One training step of the run as configured, at its world size, on this machine: the network
the dry run split over torch's fake process group (its collectives return at once) is given
fake tensors (shapes, no storage: ``FakeTensorMode``), and torch's ``MemTracker`` watches two
steps of forward, loss, backward and the configured optimizer, in Lightning's order (the second
holds the state the first made, and the first's gradients through its forward). Its peak is what one rank of the planned job allocates, set beside the planner's
prediction by ``plan=show|auto plan.fake_step=true``; torchtitan estimates memory the same way.

Nothing is stored, so 64 ranks of GPT-2 small at 1,024 tokens take seconds on 2 cores. Under
DDP the gradients live in its reducer's buckets, which its C++ reducer makes and fake tensors
cannot build; the step keeps them as the reducer does (``ReducerBuckets``). Under context
parallel the step is fed rank 0's two chunks of each sequence, as the strategy cuts its batches.
A mixture of experts routes by the router's values, which fake tensors do not have: its
shapes are those of an even routing (every expert its share of the rows, and under expert
parallel every peer as many rows as it sends: ``TokenExchange``), as the planner costs it.
Not run (and said why): the strategies built on DDP with their own averaging (local SGD,
federated); a pipeline, whose stages exchange activations point to point; a network that is
not a causal language model; DeepSpeed, which the dry run does not build.
"""

from __future__ import annotations

from typing import Any

from torch import nn

PIPELINE = "a pipeline's stages exchange activations point to point, which the fake process group does not carry"
NOT_CAUSAL_LM = "the model is not a causal language model (the step feeds it tokens)"
# NOTE: local SGD and federated averaging keep copies of the model and run steps without DDP's
# reduction; their memory is not DDP's step.
OWN_AVERAGING = "the strategy averages its ranks' models on its own schedule, which this step does not run"


def why_not(cfg: Any, strategy: Any, holder: nn.Module, stages: list) -> str | None:
    """Why one step of this run cannot run on the fake process group; None: it can."""
    from litscale.parallel.contract import contract_value

    if not contract_value(strategy, "plannable"):
        return OWN_AVERAGING
    if stages:
        return PIPELINE
    if not str(cfg.model.get("_target_", "")).endswith("CausalLMModule"):
        return NOT_CAUSAL_LM
    return None


class ReducerBuckets:
    """DDP's gradient buckets as far as memory goes: one flat buffer per dtype for every
    gradient, made when DDP wraps the model and kept for the run (torch's reducer splits it into
    25 MiB buckets; the bytes are the same). Each backward's new gradient is copied in and freed;
    with ``gradient_as_bucket_view`` (litscale's default) the parameter's ``.grad`` then is its
    view of the bucket, else the gradient stays beside its copy, as the reducer leaves them."""

    def __init__(self, net: nn.Module, *, as_view: bool) -> None:
        import torch

        params = [p for p in net.parameters() if p.requires_grad]
        self.buffers = {dtype: torch.empty(sum(p.numel() for p in params if p.dtype == dtype), dtype=dtype)
                        for dtype in {p.dtype for p in params}}
        offsets = dict.fromkeys(self.buffers, 0)
        for param in params:
            start = offsets[param.dtype]
            offsets[param.dtype] += param.numel()
            view = self.buffers[param.dtype][start:offsets[param.dtype]].view_as(param)
            param.register_post_accumulate_grad_hook(self._copy_in(view, as_view))

    @staticmethod
    def _copy_in(view, as_view: bool):
        def hook(param) -> None:
            view.copy_(param.grad)
            if as_view:
                param.grad = view
        return hook


def peak_of_one_step(cfg: Any, holder: nn.Module, strategy: Any = None) -> int:
    """Bytes one rank holds at the peak of a training step of ``holder["net"]`` (already split
    on the fake process group, on the meta device), with the configured optimizer, micro batch,
    sequence and precision; under DDP (``strategy``), with its reducer's buckets."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from litscale.app.build import build, trusted_targets
    from litscale.measure.step_memory import TOTAL, total_only_tracker
    from litscale.modules import next_token_loss, optimizer_groups

    net, precision = holder["net"], cfg.precision
    mixed = precision.compute_dtype != precision.param_dtype and precision.compute_dtype != "float32"
    autocast = torch.autocast("cpu", dtype=getattr(torch, precision.compute_dtype)) if mixed else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True):
        holder.to_empty(device="cpu")
        factory = build(cfg.optimizer, trusted=trusted_targets(cfg))
        optimizer = factory(optimizer_groups(net, factory, float(cfg.model.get("weight_decay", 0.0))))
        tokens = torch.zeros(int(cfg.data.batch_size), int(cfg.data.seq_len) + 1, dtype=torch.long)
        inputs, targets = _this_ranks_share(tokens[:, :-1], cfg), _this_ranks_share(tokens[:, 1:], cfg)
        tracker = total_only_tracker()
        tracker.track_external(net, optimizer)
        with tracker:
            if _reduces_in_buckets(strategy):  # made when DDP wraps the model, before the first step
                # NOTE: Lightning's private attribute: the keywords its DDPStrategy wraps the model with.
                ReducerBuckets(net, as_view=strategy._ddp_kwargs.get("gradient_as_bucket_view", False))
            for _ in range(2):
                with autocast:
                    logits = net(inputs)
                    loss = next_token_loss(logits, targets)  # CausalLMModule's: its fp32 copy is in the peak
                # In Lightning's order (its closure): the last step's gradients are dropped after
                # the forward, not before it, so they are part of the forward's peak.
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")][TOTAL])


def _reduces_in_buckets(strategy: Any) -> bool:
    from lightning.pytorch.strategies import DDPStrategy

    return isinstance(strategy, DDPStrategy)


def _this_ranks_share(tokens: Any, cfg: Any) -> Any:
    """Rank 0's share of each sequence under context parallel, as the strategy cuts its batches
    (two chunks of every sequence: the load-balanced split); the whole sequences otherwise."""
    from litscale.strategies.context_parallel import shard_sequence

    context = int(cfg.strategy.get("context_parallel_size") or 1)
    return shard_sequence(tokens, 0, context) if context > 1 else tokens
