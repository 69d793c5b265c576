"""Context parallel: each sample's sequence split over ``cp`` ranks, attention over all of it.

Load-balanced causal sharding (Megatron-LM's, and torch's "head-tail" balancer): the sequence
is cut into ``2 cp`` equal chunks and rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``.
Under a causal mask chunk ``g`` attends to ``g + 1`` chunks, so each rank's pair attends to
``2 cp + 1``: the same work on every rank, where contiguous shards would leave the last rank
``2 cp - 1`` times the first's.

Attention: in each layer, every rank all-gathers the keys and values of the whole sequence
from its context-parallel peers and attends with its own queries (the all-gather form of
context parallelism, Llama 3's for long context: with grouped-query attention the keys and
values are a fraction of the queries, and one gather costs fewer messages than ``cp - 1``
ring steps). The gather is torch's autograd-aware functional all-gather, whose backward is
the reduce-scatter that sums every rank's gradient of a rank's keys and values.
Each query chunk attends to the chunks before its own unmasked and to its own causally, two
fused-kernel calls merged by log-sum-exp (``context_attention``): no rank builds a mask or
scores of ``chunk x sequence``.

Everything else in a decoder acts token by token and runs on a rank's shard unchanged; RoPE
takes the shard's own positions (``SequenceShard.positions``). Each rank's loss is the mean
over its tokens (every rank holds as many), and FSDP averages gradients over the data x
context ranks: together, the global batch's mean loss and gradient, as one process has them.

NOTE: why not torch's ``context_parallel`` (``torch.distributed.tensor.experimental``, ring
attention): in torch 2.13 it replaces only the CUDA attention kernels (flash, efficient,
cuDNN). On CPU, SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, for which it has
no rule (``NotImplementedError`` on gloo, tried), and it shards position buffers in place,
where Llama here computes RoPE from positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from litscale.models.documents import Documents
from litscale.parallel.declarations import declared, find_moe_layers
from litscale.strategies.context_attention import causal_attention_of_chunks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    """The two of ``2 size`` chunks a context-parallel rank holds, in the order it holds them."""
    return rank, 2 * size - 1 - rank


def shard_sequence(tensor: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s share of ``tensor``'s sequence dimension: its two chunks, concatenated."""
    pieces = tensor.chunk(2 * size, dim)
    return torch.cat([pieces[chunk] for chunk in chunks_of(rank, size)], dim)


def shard_batch(batch: Any, mesh: DeviceMesh) -> Any:
    """Every ``[batch, sequence, ...]`` tensor of a batch (tokens, targets) cut to this rank's
    share on ``mesh`` (the context dimension): every context-parallel peer loads the same batch."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    rank, size = mesh.get_local_rank(), mesh.size()
    return apply_to_collection(batch, torch.Tensor,
                               lambda t: shard_sequence(t, rank, size) if t.dim() >= 2 else t)


class SequenceShard:
    """One context-parallel rank's share of the sequence (``chunks_of``): its tokens'
    positions, and attention of its queries over the keys and values of every rank of ``mesh``.
    What a model's attention reads from its ``sequence`` (``litscale.models.llama.WholeSequence``
    is the single-device one)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.rank, self.size = mesh.get_local_rank(), mesh.size()

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        chunk = length // 2
        return torch.cat([torch.arange(g * chunk, (g + 1) * chunk, device=device)
                          for g in chunks_of(self.rank, self.size)])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Documents | None = None) -> torch.Tensor:
        """Causal attention on ``[batch, heads, local seq, head_dim]``: each of this rank's two
        query chunks over the gathered key/value chunks up to and including its own; with packed
        rows (``documents``, of this rank's tokens), only over keys of the query's document."""
        keys, values = self.gather_in_sequence_order(k), self.gather_in_sequence_order(v)
        if documents is None:
            return causal_attention_of_chunks(q, keys, values, chunks_of(self.rank, self.size))
        # The documents of the whole sequence, from every rank's positions: gathered once per forward.
        whole = documents.kept("whole sequence", lambda: Documents(self.gather_in_sequence_order(
            documents.positions[:, None], dim=2)[:, 0]))
        rows = self.positions(q.shape[2], q.device)  # where this rank's tokens sit in the sequence
        return whole.attend(q, keys, values, query_rows=rows)

    def sum_over_sequence(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` (no gradient) of this rank's tokens summed with its peers': the whole
        sequence's."""
        summed = counts.clone()
        torch.distributed.all_reduce(summed, group=self.mesh.get_group())
        return summed

    def gather_in_sequence_order(self, tensor: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """Every rank's share of ``[batch, heads, local seq, head_dim]``, as the whole sequence."""
        from torch.distributed._functional_collectives import all_gather_single

        return in_sequence_order(all_gather_single(tensor.contiguous(), dim, self.mesh), self.size)


def in_sequence_order(gathered: torch.Tensor, size: int) -> torch.Tensor:
    """The all-gather of ``size`` ranks' shares (dimension 2), rank ``j``'s block holding chunks
    ``chunks_of(j, size)``, as the sequence in order: one copy, after which the chunks a query
    sees unmasked are one slice."""
    pieces = gathered.chunk(2 * size, dim=2)
    held = [g for j in range(size) for g in chunks_of(j, size)]
    return torch.cat([pieces[held.index(g)] for g in range(2 * size)], dim=2)


def attention_modules(module: nn.Module) -> list[nn.Module] | None:
    """What ``module`` or its ``net`` declares as ``context_parallel_attention``, or None."""
    found = declared(module, "context_parallel_attention")
    return None if found is None else list(found[1])


def check_context_parallel_fits(net: nn.Module, context_parallel_size: int) -> None:
    """Pre-flight: a model splits its sequence only where it says where its tokens meet."""
    if context_parallel_size > 1 and not attention_modules(net):
        raise ValueError(
            f"strategy.context_parallel_size={context_parallel_size} needs a model with attention that "
            f"declares context_parallel_attention; {type(net).__name__} does not; allowed: 1 "
            "(or model=llama, model=moe)")
    for layer in find_moe_layers(net) if context_parallel_size > 1 else ():
        if getattr(layer, "capacity_factor", None) is not None:
            raise ValueError(
                f"model.net.capacity_factor={layer.capacity_factor} with strategy.context_parallel_size="
                f"{context_parallel_size}: each rank would drop tokens by its own share of the sequence, "
                "not by the whole sequence as one process does; allowed: model.net.capacity_factor=null "
                "(dropless) or strategy.context_parallel_size=1")


def check_sequence_splits(seq_len: int | None, context_parallel_size: int) -> None:
    """Pre-flight: the sequence (of data that has one) cuts into ``2 cp`` equal chunks."""
    if context_parallel_size > 1 and seq_len is not None and seq_len % (2 * context_parallel_size):
        raise ValueError(
            f"data.seq_len={seq_len} does not split into 2 x strategy.context_parallel_size="
            f"{context_parallel_size} equal chunks; allowed: a multiple of {2 * context_parallel_size}")


def apply_context_parallel(module: nn.Module, mesh: DeviceMesh) -> None:
    """Give each attention ``module`` declares, and each of its MoE layers, this rank's share
    of the sequence on ``mesh`` (the context dimension): the MoE layers count the experts'
    load of the whole sequence for their balance loss."""
    shard = SequenceShard(mesh)
    for user in [*(attention_modules(module) or ()), *find_moe_layers(module)]:
        user.sequence = shard
