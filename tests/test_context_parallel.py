"""Context parallel's pieces against their definitions: the load-balanced chunks and their
positions, and, on gloo ranks, the sharded attention and a whole Llama forward and backward
against one process's (the training parity is in ``test_parity.py``, family ``context_parallel``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_distributed

from litscale.models.llama import Llama, LlamaConfig
from litscale.strategies.context_parallel import SequenceShard, chunks_of, shard_sequence

TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}


def _shard_on(rank: int, size: int) -> SequenceShard:
    return SequenceShard(SimpleNamespace(get_local_rank=lambda: rank, size=lambda: size))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ranks_hold_chunk_i_and_its_mirror_and_together_the_whole_sequence(size):
    length = 8 * size
    everything = torch.arange(length)
    held = [shard_sequence(everything[None], rank, size)[0] for rank in range(size)]
    chunk = length // (2 * size)
    for rank, tokens in enumerate(held):
        first, last = rank, 2 * size - 1 - rank
        assert chunks_of(rank, size) == (first, last)
        assert tokens.tolist() == [*range(first * chunk, (first + 1) * chunk), *range(last * chunk, (last + 1) * chunk)]
        # The positions RoPE reads are the positions of the tokens the rank holds.
        assert torch.equal(_shard_on(rank, size).positions(len(tokens), torch.device("cpu")), tokens)
    assert sorted(torch.cat(held).tolist()) == everything.tolist()
    # Causal work (keys each query sees) is the same on every rank: the point of the pairing.
    work = {int((tokens + 1).sum()) for tokens in held}
    assert len(work) == 1


def _attention_and_llama(rank: int, world_size: int) -> dict[str, float]:
    """Largest differences between this rank's sharded computation and its share of one
    process's: SDPA (GQA) forward and the gradients of q, k, v; a Llama's logits and every
    parameter gradient (summed over ranks, as the data x context mean sums them)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from litscale.strategies.context_parallel import apply_context_parallel

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("context_parallel",))
    shard = SequenceShard(mesh)
    share = lambda t, dim=2: shard_sequence(t, rank, world_size, dim)  # noqa: E731
    torch.manual_seed(0)
    length = 16 * world_size
    q, k, v = torch.randn(2, 4, length, 8), torch.randn(2, 2, length, 8), torch.randn(2, 2, length, 8)
    weight = torch.randn(2, 4, length, 8)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    (expected * weight).sum().backward()
    local = [share(t).requires_grad_() for t in (q, k, v)]
    got = shard.attend(*local)
    (got * share(weight)).sum().backward()
    differences = {"attention": (got - share(expected)).abs().max().item()}
    for name, mine, theirs in zip("qkv", local, whole, strict=True):
        differences[f"grad {name}"] = (mine.grad - share(theirs.grad)).abs().max().item()

    config = LlamaConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64,
                         block_size=length)
    torch.manual_seed(0)
    reference, split = Llama(config), Llama(config)
    split.load_state_dict(reference.state_dict())
    apply_context_parallel(split, mesh)
    tokens = torch.randint(0, 64, (2, length))
    logits = reference(tokens)
    logits.square().mean().backward()
    local_logits = split(share(tokens, 1))
    (local_logits.square().sum() / logits.numel()).backward()
    differences["logits"] = (local_logits - share(logits.detach(), 1)).abs().max().item()
    for name, param in split.named_parameters():
        dist.all_reduce(param.grad)
        expected_grad = dict(reference.named_parameters())[name].grad
        differences[f"grad {name}"] = ((param.grad - expected_grad).abs()
                                       - TOLERANCE["rtol"] * expected_grad.abs()).max().item()
    return differences


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.full)])
def test_sharded_attention_and_llama_equal_one_process(world_size):
    for rank, differences in enumerate(run_distributed(_attention_and_llama, world_size, timeout=400)):
        worst = {name: value for name, value in differences.items() if value > TOLERANCE["atol"]}
        assert not worst, f"rank {rank}: {worst}"
