"""The planner on packed rows (``data.pack``, ``data.document_mask``): the network is traced and
timed with attention kept inside each document, so a plan counts what the masked kernel keeps
and costs; and ``plan=show`` plans a ``data=sft`` run."""

from __future__ import annotations

import json

import pytest
import torch

from litscale.data.token_batch import document_positions
from litscale.models.llama import Llama, LlamaConfig
from litscale.planner.model_facts import Profile, model_facts

CONFIG = LlamaConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=64, ffn_hidden_size=128, vocab_size=256, block_size=128)
SEQ = 128


def _saved_bytes(net: torch.nn.Module, rows: int, packed: bool) -> int:
    """What autograd keeps for backward of a real forward and loss (its storages, the weights
    left out), counted here on real tensors."""
    tokens = torch.randint(CONFIG.vocab_size, (rows, SEQ))
    positions = torch.as_tensor(document_positions([SEQ // 4] * 3, SEQ)).expand(rows, SEQ)
    weights = {p.untyped_storage().data_ptr() for p in net.parameters()}
    saved: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        logits = net(tokens, positions) if packed else net(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    return sum(saved.values())


@pytest.mark.slow  # traces the network four times (over a second alone)
def test_packed_rows_are_traced_with_the_masked_attention_and_cost_what_it_keeps():
    torch.manual_seed(0)
    net = Llama(CONFIG)
    with torch.device("meta"):
        meta = Llama(CONFIG)
    causal = model_facts(meta, seq_len=SEQ, vocab_size=CONFIG.vocab_size)
    packed = model_facts(meta, seq_len=SEQ, vocab_size=CONFIG.vocab_size, packed_documents=True)
    for facts, is_packed in ((causal, False), (packed, True)):
        per_sample = (_saved_bytes(net, 4, is_packed) - _saved_bytes(net, 2, is_packed)) / 2
        assert facts.activation_bytes_per_sample == per_sample
    # the masked kernel keeps its scores (and the mask): a causal trace would under-count it
    assert packed.activation_bytes_per_sample > 1.05 * causal.activation_bytes_per_sample  # 1.11x here
    assert packed.packed_documents and not causal.packed_documents


@pytest.mark.slow  # composes, validates and builds a data=sft run's data (over a second alone)
def test_plan_show_plans_a_fine_tuning_run_on_packed_rows(tmp_path, monkeypatch, capsys):
    """``plan=show`` with ``data=sft data.pack=true``: every plan is timed on packed rows (the
    timing itself stubbed: what is checked is what the planner asks for), and the run as
    configured is predicted and printed; nothing trains."""
    from helpers.configs import compose_job

    from litscale.app.plan import profile as plan_profile
    from litscale.app.run import train

    monkeypatch.setenv("LITSCALE_CACHE", str(tmp_path))
    (tmp_path / "cluster_local_cpu.json").write_text(json.dumps({
        "cores": 2, "memory_bytes": 8 * 2**30, "peak_flops": {"float32": 1e11, "bfloat16": 2e11},
        "bandwidth_bytes_s": 1e9, "latency_s": 1e-4, "measured": "test"}))
    asked: list[bool] = []

    def child(net_config, *, keys, seq_len, vocab_size, compression=None, packed_documents=False):
        asked.append(packed_documents)
        return {key: Profile({m: 0.01 * m for m in micros}, 0.005) for key, micros in keys.items()}

    monkeypatch.setattr(plan_profile, "profiles_in_child", child)
    cfg, choices = compose_job(["plan=show", "model=llama", "data=sft", "data.pack=true", "data.seq_len=64",
                                "trainer.accelerator=cpu", f"data.cache_dir={tmp_path / 'data'}"], tmp_path / "run")
    train(cfg, choices=choices)
    out = capsys.readouterr().out
    assert asked == [True]
    assert "litscale: as configured: single pp1 dp1 tp1 mb8 acc1: " in out and "litscale: fastest: " in out
    assert not (tmp_path / "run" / "summary.json").exists()
