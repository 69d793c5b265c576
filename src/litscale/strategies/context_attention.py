"""Causal attention of a context-parallel rank's query chunks over the whole sequence's keys
and values, on kernels whose memory grows with the sequence, not with its square.

A query chunk ``g`` (of ``2 cp``, ``chunk`` tokens each) sees two blocks of keys: the chunks
before it, whole (no mask), and its own chunk, causally (query ``i`` up to key ``i``: square,
so ``is_causal`` aligns as it should). Each block runs as one fused-attention kernel call with
no mask, and the two partial results are merged exactly by their log-sum-exps:

    lse = log(exp(lse_a) + exp(lse_b)),    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

A boolean mask over the ``chunk x (g + 1) chunk`` keys, the form this replaces, with
``enable_gqa``, rules the fused kernels out on CUDA (flash takes no mask, efficient no GQA, so
SDPA falls back to its math kernel, which materialises ``[batch, heads, chunk, (g + 1) chunk]``
scores and probabilities); on CPU the flash kernel runs, but on a dense float copy of the mask
kept for backward, and skips no masked block (``experiments/cp_memory/`` measures both).

The kernels: public SDPA returns no log-sum-exp, so this calls the aten ops behind it that do.
On CPU ``_scaled_dot_product_flash_attention_for_cpu`` (the one CPU SDPA itself picks: every
dtype, any head dim). On CUDA ``_scaled_dot_product_efficient_attention`` rather than flash:
it takes fp32 as well as bf16/fp16 and returns the same log-sum-exp, so one path serves every
precision (flash is faster in bf16; a later choice). ``flex_attention(return_lse=True)`` was
the other candidate: uncompiled, as it runs on CPU without a C++ toolchain, it computes the
scores densely, the cost this removes.

Backward: the kernels mark their log-sum-exp non-differentiable, so autograd through the
merge would miss the gradient that flows through it. Instead each block's backward kernel is
called with the *merged* output and log-sum-exp (ring attention's backward): its
probabilities ``exp(s - lse)`` are then the block's share of the whole softmax and its
``rowsum(dO * O)`` term is the whole row's, which makes each block's gradients exactly its
part of the whole attention's.

Grouped-query attention (fewer key/value heads) without ``enable_gqa``, which the CUDA
efficient kernel does not take: for the unmasked block, the ``group`` query heads that share
one key/value head are folded into one head of ``group x chunk`` queries (every query sees
every key, so their order does not matter), which costs no key/value copy; for the causal
diagonal the one chunk of keys and values is repeated per query head (folding would misalign
``is_causal``), and its gradients are summed back over each group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# The CUDA efficient kernel pads its log-sum-exp's last dimension to a multiple of this; its
# backward is given one shaped as its forward returns it.
_EFFICIENT_LSE_ALIGNMENT = 32


def causal_attention_of_chunks(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               query_chunks: Sequence[int]) -> torch.Tensor:
    """Causal attention of ``queries`` (``[batch, heads, n x chunk, head_dim]``: the sequence's
    chunks ``query_chunks``, in that order) over ``keys`` and ``values`` of the whole sequence in
    order (``[batch, kv_heads, 2 cp x chunk, head_dim]``; ``heads`` a multiple of ``kv_heads``).
    Differentiable in all three; equal to the rows of causal SDPA over the whole sequence."""
    return _CausalAttentionOfChunks.apply(queries, keys, values, tuple(query_chunks))


class _CausalAttentionOfChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries, keys, values, query_chunks):
        chunk = queries.shape[2] // len(query_chunks)
        outputs, lses = [], []
        for rows, g in zip(queries.split(chunk, dim=2), query_chunks, strict=True):
            own, earlier = slice(g * chunk, (g + 1) * chunk), slice(0, g * chunk)
            out, lse = _diagonal_forward(rows, keys[:, :, own], values[:, :, own])
            if g > 0:
                earlier_out, earlier_lse = _earlier_forward(rows, keys[:, :, earlier], values[:, :, earlier])
                out, lse = merge_partials(out, lse, earlier_out, earlier_lse)
            outputs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outputs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(queries, keys, values, out, lse)
        ctx.query_chunks = query_chunks
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        queries, keys, values, out, lse = ctx.saved_tensors
        chunk = queries.shape[2] // len(ctx.query_chunks)
        grad_queries = torch.empty_like(queries)
        # Key chunks gather gradients from several query chunks: sum them in fp32.
        grad_keys = torch.zeros_like(keys, dtype=torch.float32)
        grad_values = torch.zeros_like(values, dtype=torch.float32)
        for index, g in enumerate(ctx.query_chunks):
            rows = slice(index * chunk, (index + 1) * chunk)
            # Every block's backward reads the merged output and log-sum-exp (module docstring).
            merged = (grad_out[:, :, rows], queries[:, :, rows], out[:, :, rows], lse[:, :, rows].contiguous())
            own, earlier = slice(g * chunk, (g + 1) * chunk), slice(0, g * chunk)
            grad_q, grad_k, grad_v = _diagonal_backward(*merged, keys[:, :, own], values[:, :, own])
            grad_keys[:, :, own] += grad_k
            grad_values[:, :, own] += grad_v
            if g > 0:
                earlier_q, earlier_k, earlier_v = _earlier_backward(*merged, keys[:, :, earlier], values[:, :, earlier])
                grad_q = grad_q + earlier_q
                grad_keys[:, :, earlier] += earlier_k
                grad_values[:, :, earlier] += earlier_v
            grad_queries[:, :, rows] = grad_q
        return grad_queries, grad_keys.to(keys.dtype), grad_values.to(values.dtype), None


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint sets of keys, from each one's output and log-sum-exp (in
    fp32, so that a bf16 output's rounding is not compounded by the weights)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = (out_a.float() * (lse_a - lse).exp().unsqueeze(-1)
           + out_b.float() * (lse_b - lse).exp().unsqueeze(-1))
    return out.to(out_a.dtype), lse


def _diagonal_forward(queries, keys, values):
    group = queries.shape[1] // keys.shape[1]
    return _kernel_forward(queries, _repeat_heads(keys, group), _repeat_heads(values, group), is_causal=True)


def _diagonal_backward(grad_out, queries, out, lse, keys, values):
    group = queries.shape[1] // keys.shape[1]
    grad_q, grad_k, grad_v = _kernel_backward(grad_out, queries, _repeat_heads(keys, group),
                                              _repeat_heads(values, group), out, lse, is_causal=True)
    return grad_q, _sum_heads(grad_k, group), _sum_heads(grad_v, group)


def _earlier_forward(queries, keys, values):
    kv_heads = keys.shape[1]
    out, lse = _kernel_forward(_fold_groups(queries, kv_heads), keys, values, is_causal=False)
    return out.reshape(queries.shape), lse.reshape(queries.shape[:3])


def _earlier_backward(grad_out, queries, out, lse, keys, values):
    kv_heads = keys.shape[1]
    grad_out, folded_queries, out, lse = (_fold_groups(t, kv_heads) for t in (grad_out, queries, out, lse))
    grad_q, grad_k, grad_v = _kernel_backward(grad_out, folded_queries, keys, values, out, lse, is_causal=False)
    return grad_q.reshape(queries.shape), grad_k, grad_v


def _fold_groups(tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[batch, heads, rows, ...]`` as ``[batch, kv_heads, heads / kv_heads x rows, ...]``: query
    head ``h`` uses key/value head ``h // group`` (``repeat_interleave``'s order, SDPA's GQA)."""
    batch, heads, rows, *rest = tensor.shape
    return tensor.reshape(batch, kv_heads, heads // kv_heads * rows, *rest)


def _repeat_heads(tensor: torch.Tensor, group: int) -> torch.Tensor:
    return tensor if group == 1 else tensor.repeat_interleave(group, dim=1)


def _sum_heads(tensor: torch.Tensor, group: int) -> torch.Tensor:
    if group == 1:
        return tensor
    batch, heads, *rest = tensor.shape
    return tensor.reshape(batch, heads // group, group, *rest).sum(2)


def _kernel_forward(queries, keys, values, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention with its log-sum-exp (``[batch, heads, rows]``, fp32)."""
    if queries.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(queries, keys, values, 0.0, is_causal)
    out, lse, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        queries, keys, values, None, True, 0.0, is_causal)
    return out, lse[..., :queries.shape[2]]


def _kernel_backward(grad_out, queries, keys, values, out, lse, is_causal: bool):
    """The gradients of queries, keys and values of ``_kernel_forward`` given an output and
    log-sum-exp (not necessarily its own: see the module docstring)."""
    if queries.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, queries, keys, values, out, lse, 0.0, is_causal)
    padded_lse = F.pad(lse, (0, -lse.shape[-1] % _EFFICIENT_LSE_ALIGNMENT))
    # Without dropout the kernel reads no random state; these stand for the forward's empty ones.
    no_dropout = torch.empty((), dtype=torch.int64)
    grad_q, grad_k, grad_v, _grad_bias = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, queries, keys, values, None, out, padded_lse, no_dropout, no_dropout, 0.0,
        [True, True, True, False], is_causal)
    return grad_q, grad_k, grad_v
