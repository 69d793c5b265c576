"""Context parallel's pieces against their definitions: the load-balanced chunks and their
positions, the chunked attention against causal SDPA over the whole sequence, and, on gloo
ranks, the sharded attention and a whole Llama forward and backward against one process's
(the training parity is in ``test_parity.py``, family ``context_parallel``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_distributed

from litscale.models.llama import Llama, LlamaConfig
from litscale.strategies.context_attention import causal_attention_of_chunks
from litscale.strategies.context_parallel import (
    SequenceShard,
    chunks_of,
    in_sequence_order,
    shard_sequence,
)

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
    # What an all-gather of every rank's share hands attention, put back in sequence order.
    assert torch.equal(in_sequence_order(torch.cat(held)[None, None], size)[0, 0], everything)
    # Causal work (keys each query sees) is the same on every rank: the point of the pairing.
    work = {int((tokens + 1).sum()) for tokens in held}
    assert len(work) == 1


def _rows_and_gradients(whole, weight, size, rank, dtype, chunked):
    """Rank ``rank`` of ``size``'s rows of causal attention over the whole sequence, and the
    gradients of q (those rows), k and v that those rows alone contribute, as fp32: computed by
    the chunked attention, or by one causal SDPA over the whole sequence."""
    chunks = chunks_of(rank, size)
    chunk = whole[0].shape[2] // (2 * size)
    rows = torch.cat([torch.arange(g * chunk, (g + 1) * chunk) for g in chunks])
    leaves = [t.to(dtype, copy=True).requires_grad_() for t in whole]
    if chunked:
        # Queries as a decoder hands them over (a transposed view).
        queries = leaves[0].detach().transpose(1, 2).contiguous().transpose(1, 2)[:, :, rows].requires_grad_()
        out = causal_attention_of_chunks(queries, leaves[1], leaves[2], chunks)
    else:
        queries = leaves[0]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)[:, :, rows]
    (out * weight[:, :, rows].to(dtype)).sum().backward()
    grad_q = queries.grad if chunked else queries.grad[:, :, rows]
    return [t.float() for t in (out, grad_q, leaves[1].grad, leaves[2].grad)]


def _inputs(heads: int, kv_heads: int, length: int, seed: int = 0):
    torch.manual_seed(seed)
    return [torch.randn(2, h, length, 8) for h in (heads, kv_heads, kv_heads)], torch.randn(2, heads, length, 8)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2), (4, 4)], ids=["gqa", "gqa3", "mha"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_chunked_attention_equals_causal_sdpa_over_the_whole_sequence(heads, kv_heads, size):
    """Each rank's chunks (first, middle and last of the sequence) against the same rows of one
    causal SDPA: the output and the gradients of q, k and v."""
    whole, weight = _inputs(heads, kv_heads, 16 * size)
    for rank in range(size):
        expected = _rows_and_gradients(whole, weight, size, rank, torch.float32, chunked=False)
        got = _rows_and_gradients(whole, weight, size, rank, torch.float32, chunked=True)
        for name, mine, theirs in zip(("output", "grad q", "grad k", "grad v"), got, expected, strict=True):
            torch.testing.assert_close(mine, theirs, **TOLERANCE, msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_attention_in_bf16_is_as_close_to_fp32_as_sdpa_in_bf16(seed):
    """bf16 rounds the partial outputs before their merge: no more than 1.5x the error of one
    bf16 SDPA over the whole sequence, both against fp32."""
    whole, weight = _inputs(4, 2, 64, seed)
    exact = _rows_and_gradients(whole, weight, 2, 0, torch.float32, chunked=False)
    single = _rows_and_gradients(whole, weight, 2, 0, torch.bfloat16, chunked=False)
    chunked = _rows_and_gradients(whole, weight, 2, 0, torch.bfloat16, chunked=True)
    for name, mine, theirs, truth in zip(("output", "grad q", "grad k", "grad v"), chunked, single, exact, strict=True):
        assert (mine - truth).abs().max() <= 1.5 * (theirs - truth).abs().max(), name


def test_chunked_attention_builds_no_chunk_by_chunk_tensor():
    """What context parallel exists for: no mask, scores or probabilities of ``chunk x keys``.
    Every tensor forward and backward create is at most the size of the keys or the queries."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for tensor in torch.utils._pytree.tree_leaves(result):
                if isinstance(tensor, torch.Tensor):
                    self.largest = max(self.largest, tensor.numel())
            return result

    chunk, heads, kv_heads = 128, 4, 2
    queries = torch.randn(1, heads, 2 * chunk, 8, requires_grad=True)
    keys, values = (torch.randn(1, kv_heads, 4 * chunk, 8, requires_grad=True) for _ in range(2))
    with LargestOutput() as seen:
        causal_attention_of_chunks(queries, keys, values, chunks_of(0, 2)).sum().backward()
    assert seen.largest <= queries.numel() < chunk * chunk


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
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.soak)])  # soak: CI's time
def test_sharded_attention_and_llama_equal_one_process(world_size):
    for rank, differences in enumerate(run_distributed(_attention_and_llama, world_size, timeout=400)):
        worst = {name: value for name, value in differences.items() if value > TOLERANCE["atol"]}
        assert not worst, f"rank {rank}: {worst}"
