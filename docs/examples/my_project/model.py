"""A small decoder written as single-device PyTorch, with what litscale's strategies read
declared beside it, as data: sharding units (FSDP), a tensor-parallel plan, pipeline blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyDecoderConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int


class Attention(nn.Module):
    def __init__(self, config: TinyDecoderConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.q = nn.Linear(config.n_embd, config.n_embd)
        self.k = nn.Linear(config.n_embd, config.n_embd)
        self.v = nn.Linear(config.n_embd, config.n_embd)
        self.out = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Heads counted from the projection's width, not from config.n_head: under tensor
        # parallel each rank's q/k/v hold n_head / tensor_parallel_size heads.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: TinyDecoderConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, config: TinyDecoderConfig) -> None:
        super().__init__()
        self.norm_1, self.attn = nn.LayerNorm(config.n_embd), Attention(config)
        self.norm_2, self.mlp = nn.LayerNorm(config.n_embd), MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class TinyDecoder(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]``."""

    # Tensor parallel: module-name pattern (relative to this module) -> style. Column-wise
    # q/k/v and up, row-wise out and down (Megatron's split); the rest stays replicated.
    tensor_parallel_plan = {
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.out": "rowwise",
        "blocks.*.mlp.up": "colwise",
        "blocks.*.mlp.down": "rowwise",
    }

    def __init__(self, config: TinyDecoderConfig) -> None:
        super().__init__()
        self.config = config  # n_head, n_embd and vocab_size are checked against the TP size
        self.embed: nn.Embedding | None = nn.Embedding(config.vocab_size, config.n_embd)
        self.position: nn.Embedding | None = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.n_embd)
        self.head: nn.Linear | None = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A pipeline stage is this module with the pieces it does not own set to None (or
        # deleted from `blocks`): skip what is not there.
        if self.embed is not None:
            x = self.embed(x) + self.position(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def sharding_units(self) -> list[nn.Module]:
        """FSDP gathers and frees each block on its own; the rest stays with the root."""
        return list(self.blocks.values())

    def pipeline_blocks(self) -> list[list[str]]:
        """The units a pipeline may cut between, in forward order."""
        return [["embed", "position"], *([f"blocks.{key}"] for key in self.blocks), ["norm", "head"]]


def build_tiny_decoder(*, vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 4,
                       n_embd: int = 64) -> TinyDecoder:
    """The config's ``model.net`` node: typed keyword-only arguments, which litscale checks
    the config's keys and values against before anything runs."""
    if n_embd % n_head:
        raise ValueError(f"model.net.n_embd={n_embd} must be divisible by n_head={n_head}")
    return TinyDecoder(TinyDecoderConfig(vocab_size=vocab_size, block_size=block_size,
                                         n_layer=n_layer, n_head=n_head, n_embd=n_embd))
