"""The token batch contract (``litscale.data.token_batch``) in one process: the loss of equal
slices of a masked global batch averages to its mean over counted tokens (as torch's own
``cross_entropy`` with an ignore index takes it), the samplers key every sample with its
global batch's counted fraction on every layout, documents are transformers' packed sequences,
and a packed row's documents never see each other in litscale's Llama, its mixture of experts
and a transformers Qwen3. The strategies' share of the same claims (FSDP, tensor and pipeline
parallel, context parallel) is in ``test_sft_strategies.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from litscale.data.base import ContiguousBlockSampler, ResumableSampler
from litscale.data.token_batch import (
    IGNORE_INDEX,
    SampleKey,
    TokenBatch,
    document_positions,
    positions_after_ends,
    rows_of,
)
from litscale.models.documents import document_ids
from litscale.models.llama import Llama, LlamaConfig
from litscale.modules import next_token_loss

TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}
TINY = LlamaConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64, block_size=24)


def _masked_batch(rows: int = 8, length: int = 12, vocab: int = 16, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, vocab, generator=generator)
    targets = torch.randint(vocab, (rows, length), generator=generator)
    # rows with very different counts: one row counts nothing, one everything
    keep = torch.rand(rows, length, generator=generator) < torch.linspace(0.0, 1.0, rows)[:, None]
    return logits, torch.where(keep, targets, IGNORE_INDEX)


@pytest.mark.parametrize("row_slices, sequence_slices", [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 3)])
def test_equal_slices_of_a_global_batch_average_to_its_mean_over_counted_tokens(row_slices, sequence_slices):
    """Ranks x accumulation (rows) and context-parallel shares (the sequence): each slice's
    loss with the global batch's fraction, averaged with equal weight, is torch's own mean."""
    logits, targets = _masked_batch()
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    fraction = torch.tensor([(targets != IGNORE_INDEX).sum().item() / targets.numel()], dtype=torch.float64)
    losses = [next_token_loss(rows_l, rows_t, fraction)
              for rows_l, rows_t in zip(logits.chunk(row_slices), targets.chunk(row_slices), strict=True)
              for piece_l, piece_t in [(rows_l, rows_t)]
              for rows_l, rows_t in zip(piece_l.chunk(sequence_slices, 1), piece_t.chunk(sequence_slices, 1), strict=True)]
    torch.testing.assert_close(torch.stack(losses).mean(), expected, **TOLERANCE)
    # a plain per-slice mean is not it (what the contract replaces): the rows count differently
    if row_slices > 1:
        plain = torch.stack([F.cross_entropy(lg.flatten(0, 1), tg.flatten(), ignore_index=IGNORE_INDEX)
                             for lg, tg in zip(logits.chunk(row_slices)[1:], targets.chunk(row_slices)[1:],
                                               strict=True)])
        assert not torch.allclose(plain.mean(), expected)


def test_without_a_global_fraction_a_slice_is_its_own_mean_and_an_empty_one_adds_zero():
    logits, targets = _masked_batch()
    own = next_token_loss(logits, targets, torch.zeros(1, dtype=torch.float64))
    torch.testing.assert_close(own, F.cross_entropy(logits.flatten(0, 1), targets.flatten()), **TOLERANCE)
    nothing = next_token_loss(logits[:1], torch.full_like(targets[:1], IGNORE_INDEX), torch.zeros(1))
    assert nothing.item() == 0.0


class CountedRows(torch.utils.data.Dataset):
    """A counted dataset: sample ``i`` counts ``counts[i]`` of its ``seq_len`` targets."""

    seq_len = 10

    def __init__(self, size: int = 50) -> None:
        self.counts = np.random.default_rng(0).integers(0, self.seq_len + 1, size)

    def __len__(self) -> int:
        return len(self.counts)

    def counted_tokens(self, epoch: int) -> np.ndarray:
        return self.counts

    def __getitem__(self, key):
        return key


def _keys(ranks: int, micro: int, accumulation: int, *, block: bool = False, skip: int = 0, epoch: int = 0):
    """Every rank's keys for one epoch, as (rank, j-th sample, key)."""
    dataset = CountedRows()
    found = []
    for rank in range(ranks):
        if block:
            sampler = ContiguousBlockSampler(dataset, num_replicas=ranks, rank=rank, shuffle=True, seed=7,
                                             drop_last=True, block=micro * accumulation)
        else:
            sampler = ResumableSampler(dataset, num_replicas=ranks, rank=rank, shuffle=True, seed=7, drop_last=True)
        sampler.count_steps(global_batch=micro * ranks * accumulation, micro_batch=micro)
        if skip:
            sampler.resume_at(epoch, skip // ranks)
        sampler.set_epoch(epoch)
        found += [(rank, j, key) for j, key in enumerate(sampler)]
    return dataset, found


@pytest.mark.parametrize("ranks, micro, accumulation, block", [(1, 8, 1, False), (2, 4, 1, False), (2, 2, 2, False),
                                                                (4, 1, 2, False), (2, 2, 2, True)])
def test_samplers_key_each_sample_with_its_global_batch_counted_fraction(ranks, micro, accumulation, block):
    """Global batch ``s`` is positions ``s G .. (s+1) G - 1`` of the seeded permutation, on every
    layout; each of its samples carries its counted targets over ``G x seq_len``."""
    dataset, found = _keys(ranks, micro, accumulation, block=block)
    G = micro * ranks * accumulation
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(7)).tolist()
    steps = len(dataset) // G
    by_step: dict[int, list[int]] = {}
    for _, j, key in found:
        assert isinstance(key, SampleKey) and key.epoch == 0
        by_step.setdefault(j // (micro * accumulation), []).append(key.index)
        step = j // (micro * accumulation)
        if step < steps:
            chosen = order[step * G:(step + 1) * G]
            assert key.counted_fraction == pytest.approx(dataset.counts[chosen].sum() / (G * dataset.seq_len), rel=1e-15)
    for step in range(steps):
        assert sorted(by_step[step]) == sorted(order[step * G:(step + 1) * G])


def test_a_resumed_sampler_keys_the_rest_of_the_epoch_as_the_uninterrupted_one():
    _, whole = _keys(2, 2, 2)
    _, resumed = _keys(2, 2, 2, skip=8)  # two global batches of 4 into the epoch
    for rank in range(2):
        ours = [key for r, _, key in resumed if r == rank]
        theirs = [key for r, j, key in whole if r == rank and j >= 4]
        assert ours == theirs[:len(ours)] and len(ours) >= 4


def test_document_ids_are_transformers_packed_sequences():
    from transformers.masking_utils import find_packed_sequence_indices

    rows = torch.stack([torch.from_numpy(document_positions(lengths, 20))
                        for lengths in ([20], [3, 5, 7], [1, 1, 1, 10], [19])])
    rows[1, :3] += 4  # a window that starts inside a document
    assert torch.equal(document_ids(rows), find_packed_sequence_indices(rows))


def test_positions_of_raw_text_restart_after_each_end_of_text():
    tokens = np.array([5, 6, 0, 7, 8, 9, 0, 0, 3])
    assert positions_after_ends(tokens, 0).tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 0]


def test_rows_of_keeps_a_token_batch_a_token_batch():
    batch = TokenBatch(*(torch.arange(12).view(4, 3) for _ in range(3)), torch.ones(4, dtype=torch.float64))
    half = rows_of(batch, slice(2, 4))
    assert isinstance(half, TokenBatch) and half.tokens.tolist() == [[6, 7, 8], [9, 10, 11]]
    assert rows_of(tuple(batch[:2]), slice(0, 1))[0].tolist() == [[0, 1, 2]]


# --- packed rows in the models -------------------------------------------------------------------

LENGTHS = [7, 9, 5]  # and 3 tokens of padding: one more document


def _packed(vocab: int = 64, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (2, 24), generator=generator)
    positions = torch.from_numpy(document_positions(LENGTHS, 24))[None].repeat(2, 1)
    changed = tokens.clone()
    changed[:, 7:16] = torch.randint(vocab, (2, 9), generator=generator)  # every token of document 1
    return tokens, changed, positions


def _assert_documents_apart(net, vocab: int = 64) -> None:
    """Changing every token of document 1 leaves every other token's logits bit-identical, and
    each document's logits are those of the document run alone."""
    tokens, changed, positions = _packed(vocab)
    with torch.no_grad():
        logits, logits_changed = net(tokens, positions), net(changed, positions)
        others = torch.cat([torch.arange(7), torch.arange(16, 24)])
        assert torch.equal(logits[:, others], logits_changed[:, others])
        assert not torch.equal(logits[:, 7:16], logits_changed[:, 7:16])
        start = 0
        for length in LENGTHS:
            alone = net(tokens[:, start:start + length])
            torch.testing.assert_close(logits[:, start:start + length], alone, **TOLERANCE)
            start += length


@pytest.mark.slow  # over half a second alone
def test_llama_keeps_packed_documents_apart():
    torch.manual_seed(0)
    _assert_documents_apart(Llama(TINY))


def test_mixture_of_experts_keeps_packed_documents_apart():
    from litscale.models.moe import MoEConfig, MoEDecoder

    torch.manual_seed(0)
    config = MoEConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64,
                       block_size=24, n_experts=4, top_k=2, moe_ffn_hidden_size=32)
    _assert_documents_apart(MoEDecoder(config))


def test_transformers_model_keeps_packed_documents_apart():
    from litscale.models.hf import HFCausalLM, HFModelConfig

    torch.manual_seed(0)
    config = HFModelConfig.of("qwen3", block_size=24, head_dim=8, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    _assert_documents_apart(HFCausalLM(config))


def test_unpacked_positions_are_the_plain_causal_forward():
    torch.manual_seed(0)
    net = Llama(TINY)
    tokens = torch.randint(64, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(net(tokens, torch.arange(24).expand(2, 24)), net(tokens), **TOLERANCE)


def test_document_mask_windows_restart_positions_after_each_end_of_text(tmp_path):
    """``data=tokens`` with ``data.document_mask=true``: packed windows of raw text as
    ``TokenBatch`` rows whose positions restart after every end-of-text token, every target counted."""
    import json

    from litscale.data.tokens import TokenDataModule

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {n} " + "x" * (n % 7)}) + "\n" for n in range(60)))
    module = TokenDataModule(seq_len=16, batch_size=2, tokenizer="byte", paths=str(corpus), document_mask=True,
                             cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    module.setup("fit")
    row = module.train_dataset[3]
    assert isinstance(row, TokenBatch) and (row.targets != IGNORE_INDEX).all()
    ends = (row.tokens == module.tokenizer.eos_id).nonzero().flatten().tolist()
    assert ends and all(row.positions[end + 1] == 0 for end in ends if end + 1 < 16)
    assert module.train_dataset.counted_tokens().tolist() == [16] * len(module.train_dataset)
