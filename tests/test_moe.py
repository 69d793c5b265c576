"""The mixture-of-experts decoder against references written out here: the grouped experts
against the expert-by-expert loop (forward and every gradient), routing, the load-balancing
loss and the capacity's drops by their formulas on constructed examples, the
auxiliary-loss-free bias, torch's FLOP counter, published parameter counts (Qwen3-30B-A3B's
model card: 30.5B total, 3.3B activated; transformers' own Qwen3-MoE built on the meta device),
the callback, and the ``model=moe`` config."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.configs import compose_job
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from litscale.callbacks.moe import MoEStatsCallback, load_imbalance
from litscale.models import moe_layer
from litscale.models.llama import build_llama
from litscale.models.moe import PRESETS, MoEConfig, MoEDecoder, build_moe
from litscale.models.moe_layer import MoELayer, moe_reference_forward, plan_dispatch
from litscale.modules import CausalLMModule

SMALL = MoEConfig(n_layer=1, n_head=2, n_kv_heads=1, n_embd=16, ffn_hidden_size=32, n_experts=8, top_k=2,
                  moe_ffn_hidden_size=12, n_shared_experts=1)
TOLERANCE = dict(rtol=1.3e-6, atol=1e-5)  # DESIGN.md's fp32 parity


def random_layer(config: MoEConfig, seed: int = 0) -> MoELayer:
    """Weights of order-one outputs, the router's spread enough that the top-k is not a tie."""
    torch.manual_seed(seed)
    layer = MoELayer(config)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape) / math.sqrt(param.shape[-1]))
    return layer


def forward_and_gradients(layer: MoELayer, forward, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    params = [p for _, p in sorted(layer.named_parameters())]
    out = forward(x)
    return out, torch.autograd.grad(out, [x, *params], grad_out)


# --- grouped experts == the loop over experts -----------------------------------------------


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("n_shared_experts", [0, 1])
@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "capacity"])
def test_grouped_equals_reference_loop(score_func, n_shared_experts, capacity_factor):
    config = dataclasses.replace(SMALL, score_func=score_func, n_shared_experts=n_shared_experts,
                                 capacity_factor=capacity_factor, norm_topk_prob=score_func == "sigmoid")
    layer = random_layer(config)
    x, grad_out = torch.randn(3, 20, 16), torch.randn(3, 20, 16)
    grouped, grouped_grads = forward_and_gradients(layer, layer, x, grad_out)
    reference, reference_grads = forward_and_gradients(layer, partial(moe_reference_forward, layer), x, grad_out)
    torch.testing.assert_close(grouped, reference, **TOLERANCE)
    assert len(grouped_grads) == 2 + 3 + 3 * n_shared_experts  # input, router, experts, shared
    for grouped_grad, reference_grad in zip(grouped_grads, reference_grads, strict=True):
        assert grouped_grad.abs().sum() > 0
        torch.testing.assert_close(grouped_grad, reference_grad, **TOLERANCE)
    load, _ = layer.take_statistics()
    assert (load[-1] > 0) == (capacity_factor is not None)  # 0.75 drops some


@pytest.mark.parametrize("hidden", [16, 12], ids=["grouped_mm", "per_group"])  # 24-byte rows: not aligned
def test_bf16_autocast_runs_the_experts_in_bf16(hidden):
    """Autocast does not cast ``_grouped_mm``'s operands; the layer does, as for a matmul."""
    layer = random_layer(dataclasses.replace(SMALL, moe_ffn_hidden_size=hidden))
    x = torch.randn(2, 24, 16)
    reference = moe_reference_forward(layer, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    # DESIGN.md's bf16 tolerance, absolute near zero relative to the outputs' scale
    torch.testing.assert_close(out.float(), reference, rtol=1.6e-2, atol=1.6e-2 * reference.abs().max().item())


def test_per_group_matmul_path_equals_grouped_mm(monkeypatch):
    """The path for CUDA float32 (a matmul per expert over its slice) gives the same numbers."""
    layer = random_layer(SMALL)
    x, grad_out = torch.randn(2, 24, 16), torch.randn(2, 24, 16)
    fused = forward_and_gradients(layer, layer, x, grad_out)
    monkeypatch.setattr(moe_layer, "_fused_grouped_mm_runs", lambda x, weight: False)
    looped = forward_and_gradients(layer, layer, x, grad_out)
    torch.testing.assert_close(looped, fused, **TOLERANCE)


# --- routing --------------------------------------------------------------------------------


def test_routing_is_per_token_and_deterministic():
    """A token goes to the same experts with the same weights whatever tokens surround it,
    in whatever order; and so its output is the same (dropless)."""
    layer = random_layer(SMALL)
    x = torch.randn(32, 16)
    order = torch.randperm(32)
    shuffled = torch.cat([torch.randn(7, 16), x[order]])  # other tokens first, then x permuted
    first, again, other = layer.gate(x), layer.gate(x), layer.gate(shuffled)
    assert torch.equal(first.expert_indices, again.expert_indices) and torch.equal(first.weights, again.weights)
    assert torch.equal(other.expert_indices[7:], first.expert_indices[order])
    torch.testing.assert_close(other.weights[7:], first.weights[order], rtol=0, atol=1e-7)
    torch.testing.assert_close(layer(shuffled)[7:], layer(x)[order], **TOLERANCE)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_topk_weights_normalised_when_asked(score_func):
    x = torch.randn(10, 16)
    normalised = random_layer(dataclasses.replace(SMALL, score_func=score_func, norm_topk_prob=True)).gate(x)
    raw = random_layer(dataclasses.replace(SMALL, score_func=score_func, norm_topk_prob=False)).gate(x)
    torch.testing.assert_close(normalised.weights.sum(-1), torch.ones(10))
    logits = x @ random_layer(SMALL).gate.weight.T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    torch.testing.assert_close(raw.weights, scores.gather(-1, raw.expert_indices))
    if score_func == "softmax":
        assert (raw.weights.sum(-1) < 1).all()  # a share of the probability, not all of it
    scaled = random_layer(dataclasses.replace(SMALL, score_func=score_func, routed_scaling=2.5)).gate(x)
    torch.testing.assert_close(scaled.weights, 2.5 * normalised.weights)


def constructed_layer(**overrides) -> MoELayer:
    """4 experts over 4 features, router weights the identity: a token's scores are its features."""
    config = MoEConfig(n_layer=1, n_head=1, n_kv_heads=1, n_embd=4, ffn_hidden_size=8, n_experts=4,
                       moe_ffn_hidden_size=4, **{"top_k": 1, **overrides})
    layer = random_layer(config)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(4))
    return layer


def test_aux_loss_is_its_formula_by_hand():
    """Tokens choose experts 0, 0, 1, 3: f = (1/2, 1/4, 0, 1/4); P_i the mean softmax
    probability; loss = coef * n_experts * sum_i f_i P_i."""
    layer = constructed_layer(aux_loss_coef=0.5).train()
    x = torch.tensor([[2.0, 0, 0, 0], [2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 0, 2.0]])
    layer(x)
    big, small = math.exp(2) / (math.exp(2) + 3), 1 / (math.exp(2) + 3)  # softmax of (2, 0, 0, 0)
    mean_probability = [(2 * big + 2 * small) / 4, (big + 3 * small) / 4, 4 * small / 4, (big + 3 * small) / 4]
    share = [1 / 2, 1 / 4, 0, 1 / 4]
    expected = 0.5 * 4 * sum(f * p for f, p in zip(share, mean_probability, strict=True))
    assert layer.aux_loss.item() == pytest.approx(expected, rel=1e-6)
    layer.aux_loss.backward()
    assert layer.gate.weight.grad.abs().sum() > 0  # through P; the counts f are constants


def test_bias_steers_selection_not_weights():
    layer = constructed_layer(bias_update_rate=0.1, top_k=2).train()
    x = torch.tensor([[3.0, 2.0, 0.0, 0.0]] * 6)  # every token prefers experts 0 and 1
    unbiased = layer.gate(x)
    assert unbiased.expert_indices.tolist() == [[0, 1]] * 6
    layer.update_bias(torch.tensor([6, 6, 0, 0]))  # 0 and 1 above the mean load of 3: down
    assert layer.gate.selection_bias.tolist() == pytest.approx([-0.1, -0.1, 0.1, 0.1])
    layer.update_bias(torch.tensor([3, 3, 3, 3]))  # balanced: unchanged
    assert layer.gate.selection_bias.tolist() == pytest.approx([-0.1, -0.1, 0.1, 0.1])
    with torch.no_grad():
        layer.gate.selection_bias.copy_(torch.tensor([0.0, -5.0, 0.0, 5.0]))
    biased = layer.gate(x)
    assert biased.expert_indices.tolist() == [[3, 0]] * 6  # chosen by score + bias
    scores = x.softmax(-1)  # ... weighed by the scores alone, renormalised over the chosen two
    expected = scores[:, [3, 0]] / scores[:, [3, 0]].sum(-1, keepdim=True)
    torch.testing.assert_close(biased.weights, expected)


@pytest.mark.slow
def test_bias_updates_even_out_a_skewed_load():
    layer = constructed_layer(bias_update_rate=0.01).train()
    torch.manual_seed(0)
    x = torch.randn(256, 4) + torch.tensor([1.0, 0.0, 0.0, 0.0])  # tokens lean to expert 0
    imbalances = []
    for _ in range(60):
        layer(x)
        load, _ = layer.take_statistics()
        imbalances.append(load_imbalance(load[None, :-1]).item())
        layer.update_bias(load[:-1])
    assert imbalances[0] > 1.7  # expert 0 takes about half the tokens
    assert max(imbalances[-10:]) < 1.1


def test_dropped_count_equals_the_capacity_formula():
    """Every token chooses experts 0 and 1: each takes ceil(cf * tokens * top_k / n_experts)
    rows, the earliest tokens, and drops the rest."""
    tokens, n_experts, factor = 10, 8, 1.5
    capacity = math.ceil(factor * tokens * 2 / n_experts)  # 4
    dispatch = plan_dispatch(torch.tensor([[0, 1]] * tokens), n_experts, capacity)
    assert dispatch.dropped.item() == 2 * (tokens - capacity) == 12
    assert dispatch.tokens_per_expert.tolist() == [capacity, capacity, 0, 0, 0, 0, 0, 0]
    assert dispatch.routed_per_expert.tolist() == [tokens, tokens, 0, 0, 0, 0, 0, 0]
    assert (dispatch.assignment // 2).tolist() == [0, 1, 2, 3] * 2  # earliest tokens kept

    layer = constructed_layer(capacity_factor=factor).train()  # top-1 over 4 experts
    x = torch.tensor([[1.0, 0, 0, 0]] * tokens)
    out = layer(x)
    kept = math.ceil(factor * tokens / 4)
    assert layer.capacity(tokens) == kept == 4
    load, _ = layer.take_statistics()
    assert load.tolist() == [tokens, 0, 0, 0, tokens - kept]
    assert (out[kept:] == 0).all() and (out[:kept] != 0).any()  # the residual carries the rest


# --- the decoder ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True, "n_shared_experts": 0, "moe_every": 2},
                                       {"score_func": "sigmoid", "top_k": 3, "dense_layers": 0}],
                         ids=["tiny", "tied_every_2nd", "sigmoid_top3"])
def test_flops_per_token_equals_torchs_flop_counter(overrides):
    """A real forward and backward of the tiny preset (dropless: the count does not depend on
    the routing). NOTE: SDPA's math backend, whose matmuls the counter sees; it does not count
    the CPU flash kernel."""
    batch, seq_len = 2, 32
    torch.manual_seed(0)
    net = build_moe(**overrides)
    tokens = torch.randint(256, (batch, seq_len))
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        net(tokens).float().sum().backward()
    assert net.flops_per_token(seq_len) * batch * seq_len == counter.get_total_flops()


def hand_count(c: MoEConfig) -> tuple[int, int]:
    """``(total, active)`` parameters from the dimensions alone (untied)."""
    d, head = c.n_embd, c.head_dim
    attention = 2 * d * c.n_head * head + 2 * d * c.n_kv_heads * head + (2 * head if c.qk_norm else 0) + 2 * d
    expert = 3 * d * c.moe_ffn_hidden_size
    moe = d * c.n_experts + c.n_shared_experts * expert
    layers = len(c.moe_layers)
    dense = (c.n_layer - layers) * 3 * d * c.ffn_hidden_size
    base = c.n_layer * attention + dense + layers * moe + 2 * c.vocab_size * d + d
    return base + layers * c.n_experts * expert, base + layers * c.top_k * expert


class RealTensors(TorchDispatchMode):
    """Records every op that gives a tensor with storage (not on the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.created += [f"{func}{list(t.shape)}" for t in tree_leaves(out)
                         if isinstance(t, torch.Tensor) and not t.is_meta]
        return out


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_build_on_meta_without_storage_with_their_parameter_counts(preset):
    with torch.device("meta"), RealTensors() as real:
        net = build_moe(preset=preset)
    assert real.created == []  # nothing materialised, not even for an init (a 675B model otherwise)
    assert all(p.is_meta for p in net.parameters()) and all(b.is_meta for b in net.buffers())
    assert (net.num_params(), net.num_active_params()) == hand_count(PRESETS[preset])


@pytest.mark.slow
def test_qwen3_30b_a3b_matches_its_model_card_and_transformers():
    with torch.device("meta"):
        net = build_moe(preset="qwen3_30b_a3b")
    assert (net.num_params(), net.num_active_params()) == (30_532_122_624, 3_353_032_704)  # "30.5B, 3.3B"
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Qwen3-30B-A3B's config.json over transformers' defaults (Qwen3-15B-A2B's), 2 of its 48 layers.
    hf_config = Qwen3MoeConfig(num_hidden_layers=2, head_dim=128, norm_topk_prob=True, rope_theta=1e6)
    with torch.device("meta"):
        reference = Qwen3MoeForCausalLM(hf_config)
        ours = build_moe(preset="qwen3_30b_a3b", n_layer=2)
    assert ours.num_params() == sum(p.numel() for p in reference.parameters())
    c = ours.config
    assert (c.n_embd, c.n_head, c.n_kv_heads, c.head_dim, c.n_experts, c.top_k, c.moe_ffn_hidden_size,
            c.vocab_size, c.rope_theta, c.norm_eps, c.aux_loss_coef) == (
        hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.head_dim,
        hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
        hf_config.vocab_size, hf_config.rope_theta, hf_config.rms_norm_eps, hf_config.router_aux_loss_coef)


def test_deepseek_v3_like_shapes():
    """DeepSeek-V3's 671B (37B activated) with MLA; GQA attention here makes it ~0.6% more."""
    c = PRESETS["deepseek_v3_like"]
    assert c.moe_layers == tuple(range(3, 61)) and c.score_func == "sigmoid" and c.bias_update_rate > 0
    total, _ = hand_count(c)
    assert abs(total / 671e9 - 1) < 0.01


@pytest.mark.slow
def test_causal_lm_module_adds_the_aux_loss_once():
    torch.manual_seed(0)
    module = CausalLMModule(net=build_moe(), optimizer=torch.optim.AdamW)
    batch = (torch.randint(256, (2, 16)), torch.randint(256, (2, 16)))
    with pytest.warns(UserWarning, match="self.log"):  # no trainer attached
        total = module.training_step(batch, 0)
    language_model_loss = module.loss(batch)  # the same weights and batch: the same routing
    auxiliary = module.net.auxiliary_loss()
    assert auxiliary is not None and auxiliary > 0
    torch.testing.assert_close(total, language_model_loss + auxiliary)
    assert module.net.auxiliary_loss() is None  # taken
    dense = CausalLMModule(net=build_llama(), optimizer=torch.optim.AdamW)
    torch.testing.assert_close(dense.training_step(batch, 0), dense.loss(batch))


# --- the callback ---------------------------------------------------------------------------


def run_callback_step(callback: MoEStatsCallback, net, step: int) -> None:
    trainer = SimpleNamespace(global_step=step, log_every_n_steps=50, is_last_batch=False, max_steps=100,
                              loggers=[], strategy=None)
    callback.on_train_batch_end(trainer, SimpleNamespace(net=net), None, None, 0)


def test_callback_updates_bias_from_counts_summed_over_ranks(monkeypatch):
    """Another rank's counts (here what a fake all-reduce adds) decide the bias: locally expert
    0 is under-loaded, over both ranks it is the busiest."""
    torch.manual_seed(0)
    net = build_moe().train()
    net(torch.randint(256, (2, 16)))
    local = net.take_router_statistics().load
    other_rank = torch.zeros_like(local)
    other_rank[:, 0] = 1000
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: tensor.add_(other_rank))
    net(torch.randint(256, (2, 16)))
    callback = MoEStatsCallback()
    callback.on_train_start(SimpleNamespace(global_step=0), None)
    run_callback_step(callback, net, step=1)
    for layer in net.moe_layers().values():
        assert layer.gate.selection_bias[0].item() == pytest.approx(-0.001)
    callback.on_train_end(None, None)
    assert sum(callback.result["moe/tokens_per_expert"][0]) == 2 * 16 * 2 + 1000  # tokens x top_k + other rank


@pytest.mark.slow  # over half a second alone
def test_callback_figures_and_inert_for_dense_nets():
    torch.manual_seed(0)
    net = build_moe(capacity_factor=1.0).train()
    callback = MoEStatsCallback()
    callback.on_train_start(SimpleNamespace(global_step=0), None)
    for step in (1, 2):
        net(torch.randint(256, (4, 32)))
        run_callback_step(callback, net, step)
        run_callback_step(callback, net, step)  # a batch without an optimizer step: nothing
    callback.on_train_end(None, None)
    result = callback.result
    assert result["moe/layers"] == [1, 2] and len(result["moe/tokens_per_expert"]) == 2
    assert [sum(row) for row in result["moe/tokens_per_expert"]] == [2 * 4 * 32 * 2] * 2
    assert 1 <= result["moe/load_imbalance"] <= 4 and 1 <= result["moe/load_imbalance_mean"] <= 4
    assert 0 < result["moe/dropped_fraction"] < 1 and result["moe/aux_loss"] >= 1 - 1e-3
    dense = MoEStatsCallback()
    dense.on_train_start(SimpleNamespace(global_step=0), None)
    run_callback_step(dense, build_llama(), step=1)
    dense.on_train_end(None, None)
    assert dense.result == {}


# --- the config -----------------------------------------------------------------------------


@pytest.mark.parametrize("callbacks", ["default", "none"])
def test_model_moe_composes_and_builds_with_its_callback(callbacks, tmp_path, outputs_root):
    from litscale.app.build import _build_named, build_module
    from litscale.app.checks.validation import validate

    cfg, choices = compose_job(["model=moe", f"callbacks={callbacks}"], tmp_path / "run")
    validate(cfg, choices=choices)
    module = build_module(cfg)
    assert isinstance(module.net, MoEDecoder) and module.net.config == dataclasses.replace(
        PRESETS["tiny"], vocab_size=cfg.data.vocab_size, block_size=cfg.data.seq_len)
    assert any(isinstance(c, MoEStatsCallback) for c in _build_named(cfg.callbacks))
