"""What the planner needs to know of a model, read off a meta-device copy: its size, FLOPs per
token, layers, width, and the bytes autograd saves for backward (the activations)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelFacts:
    """``activation_bytes`` per sample (fp32, no activation checkpointing), traced at micro
    batch 1 and 2 so a fixed part (independent of the batch) is told from the per-sample one."""

    num_params: int
    flops_per_token: float
    seq_len: int
    layers: int
    hidden: int
    heads: int
    activation_bytes_per_sample: float
    activation_bytes_fixed: float = 0.0

    def activations(self, micro_batch: int) -> float:
        return self.activation_bytes_fixed + micro_batch * self.activation_bytes_per_sample

    def boundary_bytes(self, micro_batch: int, dtype_bytes: int = 4) -> float:
        """One layer's input (or output): what a pipeline stage sends, what a checkpointed layer keeps."""
        return micro_batch * self.seq_len * self.hidden * dtype_bytes


def saved_activation_bytes(net: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves in one forward of ``net`` (parameters excluded),
    each storage counted once. ``net`` and ``tokens`` on the meta device: shapes only.

    NOTE: counted with ``saved_tensors_hooks`` rather than an allocator's peak, which the meta
    device does not have: what backward keeps alive is what stays in memory between forward
    and backward, the activations a plan must fit."""
    weights = {p.untyped_storage()._cdata for p in net.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:
            seen[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        net(tokens)
    return sum(seen.values())


def model_facts(net: nn.Module, *, seq_len: int, vocab_size: int) -> ModelFacts:
    """Facts of a zoo network (GPT, Llama, Hugging Face) built on the meta device."""
    config = getattr(net, "config", None)
    layers = len(net.sharding_units()) if hasattr(net, "sharding_units") else 1
    hidden = _first(config, ("n_embd", "dim", "hidden_size"), 0)
    heads = _first(config, ("n_head", "n_heads", "num_attention_heads"), 1)
    traced = [saved_activation_bytes(net, torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
                                     .clamp_(max=vocab_size - 1)) for batch in (1, 2)]
    per_sample = traced[1] - traced[0]
    return ModelFacts(num_params=sum(p.numel() for p in net.parameters()),
                      flops_per_token=float(net.flops_per_token(seq_len)), seq_len=seq_len, layers=layers,
                      hidden=hidden, heads=heads, activation_bytes_per_sample=per_sample,
                      activation_bytes_fixed=traced[0] - per_sample)


def _first(config, names: tuple[str, ...], default: int) -> int:
    if hasattr(config, "transformers_config"):
        config = config.transformers_config()
    return next((int(getattr(config, n)) for n in names if getattr(config, n, None)), default)
