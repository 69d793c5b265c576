"""A GPT decoder (nanoGPT-like) as plain single-device PyTorch.

Parallelism is not written here: strategies read what the model declares about itself
(``gpt_parallel.py`` beside this file) and apply it. Two choices in this file exist so that
they can: blocks live in a ``ModuleDict`` keyed by layer index, and every top-level piece
may be ``None``, so a pipeline stage is this same class with the layers it does not own
deleted (torchtitan's approach) and checkpoint keys stay the same on every stage; and the
query/key/value projections are separate ``Linear`` layers, so splitting them column-wise
across tensor-parallel ranks splits whole heads (a fused ``qkv`` would be cut across q|k|v).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from litscale.arguments import checked_arguments
from litscale.constraints import Fraction, PositiveInt
from litscale.models.gpt_parallel import TENSOR_PARALLEL_PLAN, pipeline_blocks


@dataclass(frozen=True)
class GPTConfig:
    """Architecture numbers; a preset is a named instance of this (STYLE: presets are data)."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 256
    block_size: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PresetName = Literal["nano", "micro", "small", "medium"]

# GPT-2 sizes (Radford et al. 2019); `nano` is small enough for 2-core CPU tests.
PRESETS: dict[str, GPTConfig] = {
    "nano": GPTConfig(n_layer=4, n_head=4, n_embd=128),
    "micro": GPTConfig(n_layer=6, n_head=6, n_embd=384),
    "small": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024,
                       tie_embeddings=True),
    "medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=50304, block_size=1024,
                        tie_embeddings=True),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, bias = config.n_embd, config.bias
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, d, bias=bias)
        self.v_proj = nn.Linear(d, d, bias=bias)
        self.out_proj = nn.Linear(d, d, bias=bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        # On the scores' 1/sqrt(head_dim); µP sets it (litscale.optim.mup), a plain run leaves it at 1.
        self.score_multiplier = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # NOTE: heads are counted from the projection's output width, not from the config,
        # so a tensor-parallel shard that holds n_head / tp heads runs unchanged.
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.score_multiplier != 1.0:
            q = q * self.score_multiplier
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.out_proj(y))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token ids ``[B, T]`` -> logits ``[B, T, vocab]``."""

    # Model-parallel declarations (see gpt_parallel.py); strategies read them.
    tensor_parallel_plan = TENSOR_PARALLEL_PLAN
    pipeline_blocks = pipeline_blocks
    output_layers = ("lm_head",)  # the layer an optimizer of matrices (Muon) leaves to AdamW
    output_multiplier = 1.0  # on the logits; µP sets it (litscale.optim.mup)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte: nn.Embedding | None = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe: nn.Embedding | None = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head: nn.Linear | None = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def reset_parameters(self) -> None:
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).
        for name, param in self.named_parameters():
            if param.dim() < 2:
                nn.init.zeros_(param) if name.endswith("bias") else nn.init.ones_(param)
            elif name.endswith(("out_proj.weight", "down.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (or, on a later pipeline stage, hidden states) -> logits (or hidden states)."""
        x = tokens
        if self.wte is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
            if self.output_multiplier != 1.0:
                x = x * self.output_multiplier
        return x

    # µP's declarations (litscale.optim.mup): the width, and this model at another width.
    def mup_width(self) -> int:
        return self.config.n_embd

    def at_width(self, width: int) -> GPT:
        config = replace(self.config, n_embd=width)
        check_shape(config)
        return type(self)(config)

    def sharding_units(self) -> list[nn.Module]:
        """The submodules a sharded strategy (FSDP) gathers and frees one at a time: the blocks.
        Embeddings, final norm and head stay with the root, which runs first and last."""
        return list(self.blocks.values())

    def num_params(self, *, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}  # tied weights counted once
        total = sum(p.numel() for p in params.values())
        if exclude_embeddings:
            # Lookups cost no matmul FLOPs: the position table always, the token table unless
            # it is tied to the output head (nanoGPT counts the same way).
            if self.wpe is not None:
                total -= self.wpe.weight.numel()
            if self.wte is not None and not self.config.tie_embeddings:
                total -= self.wte.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x non-embedding params + attention (PaLM appendix B)."""
        c = self.config
        return 6 * self.num_params(exclude_embeddings=True) + 12 * c.n_layer * c.n_embd * seq_len


@checked_arguments("model.net")
def build_gpt(
    *,
    preset: PresetName = "nano",
    vocab_size: PositiveInt | None = None,
    block_size: PositiveInt | None = None,
    n_layer: PositiveInt | None = None,
    n_head: PositiveInt | None = None,
    n_embd: PositiveInt | None = None,
    dropout: Fraction | None = None,
    bias: bool | None = None,
    tie_embeddings: bool | None = None,
) -> GPT:
    """A GPT from a named preset, with any architecture number overridden."""
    overrides = dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd, dropout=dropout, bias=bias, tie_embeddings=tie_embeddings)
    config = replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    check_shape(config)
    return GPT(config)


def check_shape(config: GPTConfig) -> None:
    """Heads tile the width."""
    if config.n_embd % config.n_head:
        raise ValueError(f"model.net.n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
