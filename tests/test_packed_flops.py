"""The FLOPs of packed rows (``data.pack``, ``data.document_mask``): a row of documents that
attend only within themselves computes attention over each document, ``sum(l_i ** 2)`` pairs
where a row of one document computes ``T ** 2``. MFU and the planner count it so, against the
math: 12 x layers x heads x head_dim per pair (forward and backward, counted whole as litscale
and torch's FLOP counter count attention), the rest of a row's FLOPs as torch's counter counts
them on the meta device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from litscale.callbacks.throughput import ThroughputCallback
from litscale.data.token_batch import attended_tokens, document_positions
from litscale.measure import flops
from litscale.models.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64, block_size=16)
SEQ, DOCUMENTS = 16, [5, 6, 3]  # and 2 positions of padding, a document of its own
PAIRS = 5 * 5 + 6 * 6 + 3 * 3 + 2 * 2  # 74 of the dense row's 256
PER_PAIR = 12 * CONFIG.n_layer * CONFIG.n_head * CONFIG.head_dim  # QK^T and AV, forward 4, backward 8


def meta_llama() -> Llama:
    with torch.device("meta"):
        return Llama(CONFIG)


class WithoutFormula(torch.nn.Module):
    """The same network without ``flops_per_token``: its FLOPs are counted by torch's counter."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)


def counted_dense_row() -> float:
    """One row of ``SEQ`` tokens, forward and backward, as torch's counter counts it: attention
    over the whole row (its T x T matmuls counted whatever the mask)."""
    with FlopCounterMode(display=False) as counter:
        meta_llama()(torch.zeros(1, SEQ, dtype=torch.long, device="meta")).float().sum().backward()
    return float(counter.get_total_flops())


@pytest.mark.slow  # over half a second alone
def test_a_packed_rows_attention_is_counted_over_its_documents():
    positions = document_positions(DOCUMENTS, SEQ)
    assert attended_tokens(positions) == PAIRS and attended_tokens(torch.arange(SEQ).numpy()) == SEQ**2
    dense = counted_dense_row()
    packed = dense - PER_PAIR * (SEQ**2 - PAIRS)
    example = torch.zeros(2, SEQ, dtype=torch.long)
    for net in (meta_llama(), WithoutFormula(meta_llama())):  # the model's formula, and torch's counter
        assert flops.flops_per_sample(net, example, SEQ, PAIRS / SEQ) == pytest.approx(packed, rel=1e-12)
        # a row of one document is the dense row, whichever way it is said
        assert flops.flops_per_sample(net, example, SEQ) == pytest.approx(dense, rel=1e-12)
        assert flops.flops_per_sample(net, example, SEQ, float(SEQ)) == pytest.approx(dense, rel=1e-12)


def test_mfu_of_packed_rows_counts_each_documents_attention(tmp_path, monkeypatch):
    """The throughput callback of a run whose data states packed rows: its MFU is the dense
    count's times the packed row's FLOPs over the dense row's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(flops, "probe_matmul_flops", lambda dtype, size=512, seconds=0.5: 1e10)
    monkeypatch.setattr(flops, "load_average", lambda: 0.0)

    def mfu(attended_length: float | None) -> float:
        callback = ThroughputCallback(warmup_steps=1)
        strategy = SimpleNamespace(root_device=torch.device("cpu"))
        datamodule = SimpleNamespace(tokens_per_sample=SEQ, attended_length=attended_length)
        trainer = SimpleNamespace(precision="32-true", world_size=1, strategy=strategy, datamodule=datamodule)
        module = SimpleNamespace(net=meta_llama(), device=torch.device("cpu"))
        callback.setup(trainer, module, "fit")
        callback.on_train_start(trainer, module)
        callback._start, callback._samples_per_step = (0.0, 0), 1000
        return callback._summarise(trainer, 1.0, 1)["perf/mfu"]  # 1000 rows in one second

    dense = counted_dense_row()
    assert mfu(None) == pytest.approx(1000 * dense / 1e10, rel=1e-12)
    assert mfu(PAIRS / SEQ) / mfu(None) == pytest.approx((dense - PER_PAIR * (SEQ**2 - PAIRS)) / dense, rel=1e-12)


def test_the_planner_prices_packed_rows_attention_over_their_documents_on_h100_8x():
    """A Llama of 8 layers 1,024 wide at 8,192 tokens in rows of documents of 1,024, on
    cluster=h100_8x under FSDP: its forward-backward is predicted at the packed row's FLOPs over
    the dense row's (the math's), and its step time lower by the difference (FSDP's gathers
    hidden behind the compute either way)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from litscale.parallel.layout import MeshSizes
    from litscale.planner.cost import Plan, predict
    from litscale.planner.model_facts import ModelFacts

    seq, document = 8192, 1024
    config = LlamaConfig(n_layer=8, n_head=8, n_kv_heads=8, n_embd=1024, ffn_hidden_size=4096, vocab_size=32000,
                         block_size=seq)
    with torch.device("meta"):
        net = Llama(config)
    cluster = instantiate(OmegaConf.load("conf/cluster/h100_8x.yaml"))
    # The facts a cost needs (FLOPs, sizes); the traced activations are memory's, not time's.
    facts = ModelFacts(num_params=sum(p.numel() for p in net.parameters()), flops_per_token=net.flops_per_token(seq),
                       seq_len=seq, layers=config.n_layer, hidden=config.n_embd, heads=config.n_head,
                       activation_bytes_per_sample=0.0, vocab_size=config.vocab_size, net=net)
    packed = facts.with_attended_length(document)  # every token attends within its 1,024
    # 6 FLOPs per weight a token multiplies by (q, k, v, o, the SwiGLU's three, the head) per
    # token, and attention's pairs
    weights = config.n_layer * (4 * 1024 * 1024 + 3 * 1024 * 4096) + 1024 * 32000
    per_pair = 12 * config.n_layer * config.n_head * config.head_dim
    dense_row = 6 * weights * seq + per_pair * seq**2
    share = (dense_row - per_pair * (seq**2 - seq * document)) / dense_row  # 0.61 here
    plan = Plan("fsdp", MeshSizes(data_shard=8), micro_batch=1, accumulation=1, compute_dtype="bfloat16")
    dense_prediction, packed_prediction = predict(plan, facts, cluster), predict(plan, packed, cluster)
    assert packed_prediction.compute_s == pytest.approx(dense_prediction.compute_s * share, rel=1e-9)
    assert packed_prediction.exposed_comm_s == dense_prediction.exposed_comm_s == 0
    assert dense_prediction.step_s - packed_prediction.step_s == pytest.approx(
        dense_prediction.compute_s * (1 - share), rel=1e-9)


@pytest.mark.slow  # tokenizes the example conversations and packs them (over a second alone)
def test_packed_sft_rows_state_their_documents_and_the_planner_reads_them(tmp_path, monkeypatch):
    """``data=sft data.pack=true``: the data states the keys a token attends to over its training
    rows, as counted here from each row's positions, and the planner's facts of the run count
    attention at that figure."""
    import numpy as np
    from helpers.configs import compose_job, described

    from litscale.app.plan.runs import facts_of
    from litscale.data.sft import SFTDataModule

    module = SFTDataModule(seq_len=128, batch_size=2, pack=True, cache_dir=str(tmp_path / "data"))
    module.prepare_data()
    module.setup("fit")
    pairs = []
    for index in range(len(module.train_dataset)):
        positions = module.train_dataset[index].positions.numpy()
        starts = [i for i in range(len(positions)) if i == 0 or positions[i] != positions[i - 1] + 1]
        pairs.append(sum((end - start) ** 2 for start, end in zip(starts, [*starts[1:], len(positions)], strict=True)))
    assert module.attended_length == pytest.approx(np.mean(pairs) / 128, rel=1e-12)
    assert module.attended_length < 0.5 * 128  # several documents a row
    monkeypatch.setenv("LITSCALE_CACHE", str(tmp_path))
    run = described(*compose_job(["model=llama", "data=sft", "data.pack=true", "data.seq_len=128",
                                  "trainer.accelerator=cpu", f"data.cache_dir={tmp_path / 'data'}"], tmp_path / "run"))
    facts = facts_of(run)
    assert facts.attended_length == pytest.approx(module.attended_length, rel=1e-12)
    per_pair = 12 * facts.layers * facts.heads * (facts.hidden // facts.heads)
    dense_row = facts.net.flops_per_token(128) * 128  # the whole row's attention, as before
    assert facts.flops_per_token * 128 == pytest.approx(dense_row - per_pair * 128 * (128 - module.attended_length),
                                                        rel=1e-12)


def test_document_mask_windows_state_the_documents_of_their_text(tmp_path):
    """``data=tokens data.document_mask=true``: the keys a token attends to, from windows whose
    documents end at each end-of-text token, as counted here from the tokens themselves (every
    window read: fewer than the windows the data module reads at most)."""
    import json

    from litscale.data.tokens import TokenDataModule

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {n} " + "x" * (n % 7)}) + "\n" for n in range(60)))
    options = dict(seq_len=16, batch_size=2, tokenizer="byte", paths=str(corpus), cache_dir=str(tmp_path / "cache"))
    module, whole = TokenDataModule(**options, document_mask=True), TokenDataModule(**options)
    for data in (module, whole):
        data.prepare_data()
        data.setup("fit")
    assert whole.attended_length is None  # rows of one document: the whole row's attention
    pairs = []
    for index in range(len(module.train_dataset)):
        ends = (module.train_dataset[index].tokens == module.tokenizer.eos_id).nonzero().flatten().tolist()
        bounds = [0, *[end + 1 for end in ends if end + 1 < 16], 16]
        pairs.append(sum((b - a) ** 2 for a, b in zip(bounds, bounds[1:], strict=False)))
    assert len(pairs) < 256 and module.attended_length == pytest.approx(sum(pairs) / len(pairs) / 16, rel=1e-12)
    assert module.attended_length < 16
