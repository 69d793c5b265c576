"""Packed rows: documents told apart by their position ids, and attention that stays inside each.

A packed row holds several documents back to back; the data gives each token its position in
its document (``litscale.data.token_batch``), restarting at 0. A document is a run of
consecutive positions: a token whose position is not its left neighbour's plus one starts a
new one (transformers' rule, ``masking_utils.find_packed_sequence_indices``, so a Hugging Face
model and litscale's own see the same documents). Attention then lets query ``i`` see key ``j``
only when ``j <= i`` and both lie in the same document: no document sees another's tokens, and
changing one leaves the others' outputs bit-identical (masked scores contribute an exact 0).

The kernels: on CPU, SDPA with a boolean ``[batch, 1, queries, keys]`` mask (what CPU SDPA
takes); on CUDA, FlexAttention with a block mask built once per forward, compiled, which skips
the blocks a document never reaches instead of materialising the mask. Under context parallel
the queries are a rank's two chunks and the keys the whole sequence (``query_rows`` says where
each query sits in it), whose documents the rank learns by gathering every rank's positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` document number of each token: 0 for the first document of a row, one
    more at each token whose position is not its left neighbour's plus one."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts.cumsum(-1) - 1


class Documents:
    """The documents of a batch of packed rows, from its ``positions`` ``[batch, seq]``: what a
    model's attention (``attend(q, k, v, documents)``) and RoPE read. Built once per forward;
    the masks are made on first use and kept (every layer asks for the same one)."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self.ids = document_ids(positions)
        self._kept: dict[object, object] = {}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               query_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q`` ``[batch, heads, queries, head_dim]`` over ``k``, ``v`` ``[batch,
        kv_heads, seq, head_dim]`` (fewer heads: GQA) of these rows, within documents and
        causally. The queries are the whole sequence, or the tokens at ``query_rows`` of it (a
        context-parallel rank's chunks)."""
        whole = query_rows is None
        query_index = torch.arange(q.shape[2], device=q.device) if whole else query_rows
        query_ids = self.ids if whole else self.ids[:, query_rows]
        if q.device.type == "cuda":
            mask = self.kept(("block mask", whole), lambda: _block_mask(query_ids, self.ids, query_index))
            return _compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        mask = self.kept(("mask", whole), lambda: _boolean_mask(query_ids, self.ids, query_index))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def kept(self, key: object, build: Callable[[], object]) -> object:
        """``build()``, made once per forward: every layer asks for the same mask."""
        if key not in self._kept:
            self._kept[key] = build()
        return self._kept[key]


def _boolean_mask(query_ids: torch.Tensor, key_ids: torch.Tensor, query_index: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, queries, keys]``: True where the query may see the key."""
    keys = torch.arange(key_ids.shape[1], device=key_ids.device)
    causal = query_index[:, None] >= keys[None, :]
    return ((query_ids[:, :, None] == key_ids[:, None, :]) & causal)[:, None]


def _block_mask(query_ids: torch.Tensor, key_ids: torch.Tensor, query_index: torch.Tensor):
    """FlexAttention's block mask of the same rule (CUDA): blocks no query of which sees any
    key of are skipped, not computed and masked."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(batch, head, query, key):
        return (query_ids[batch, query] == key_ids[batch, key]) & (query_index[query] >= key)

    return create_block_mask(same_document_causal, query_ids.shape[0], None, query_ids.shape[1],
                             key_ids.shape[1], device=query_ids.device)


@functools.cache
def _compiled_flex_attention():
    # NOTE: uncompiled, flex_attention computes every score densely (torch warns); compiled once
    # per process, it generates the block-sparse kernel.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)
