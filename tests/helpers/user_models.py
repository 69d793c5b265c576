"""Networks a user might write, for tests that need one the zoo does not have."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn


class RankBranchNet(nn.Module):
    """A tiny causal LM whose rank 1 (and no other) all-reduces its hidden state in forward: a
    rank-dependent branch that hangs a real job at its first step."""

    def __init__(self, *, vocab_size: int, n_embd: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        if dist.is_initialized() and dist.get_rank() == 1:
            dist.all_reduce(hidden)
        return self.head(hidden)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, as the planner asks of a network: 6 x parameters (no attention)."""
        return 6.0 * sum(p.numel() for p in self.parameters())
