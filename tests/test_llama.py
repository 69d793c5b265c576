"""The Llama / Qwen3 decoder against references written out here (RoPE as complex numbers,
Llama 3.1's frequency scaling as Meta publishes it, attention head by head, RMSNorm and
SwiGLU by their formulas, torch's FLOP counter, published parameter counts), its pipeline
stages and tensor-parallel checks. Its parity with one process under FSDP, tensor parallel
(GQA, QK-norm) and pipelines, on 2 and 4 ranks, is in ``test_parity.py`` (family ``llama``)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import typing

import pytest
import torch
import torch.nn.functional as F
from helpers.configs import compose_job

from litscale.models.llama import (
    PRESETS,
    ROPE_SCALINGS,
    Llama,
    LlamaConfig,
    PresetName,
    apply_rope,
    build_llama,
    rope_frequencies,
    rope_tables,
)

# --- references -----------------------------------------------------------------------------


def rope_by_complex_numbers(x: torch.Tensor, frequencies: list[float]) -> torch.Tensor:
    """``x`` ``[batch, seq, heads, head_dim]`` rotated in float64: feature ``i`` and feature
    ``i + head_dim / 2`` are the real and imaginary parts of one complex number, multiplied by
    ``exp(1j * position * frequencies[i])``."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    positions = torch.arange(x.shape[1], dtype=torch.float64)
    angles = positions[:, None] * torch.tensor(frequencies, dtype=torch.float64)[None, :]
    turned = z * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat((turned.real, turned.imag), dim=-1)


def rope_base_frequencies(head_dim: int, theta: float) -> list[float]:
    """Su et al.'s ``theta ** (-2i / head_dim)`` for each pair ``i``."""
    return [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]


def llama3_scaled_frequencies(frequencies: list[float], *, factor: float, low_freq_factor: float,
                              high_freq_factor: float, original_max_positions: int) -> list[float]:
    """Meta's ``apply_scaling`` (llama-models, Llama 3.1), as published."""
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    scaled = []
    for freq in frequencies:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            scaled.append(freq)
        elif wavelen > low_freq_wavelen:
            scaled.append(freq / factor)
        else:
            smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return scaled


def rms_normalised(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """Zhang & Sennrich's RMSNorm: ``x / sqrt(mean(x^2) + eps) * gain`` over the last dim."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gain


def attention_by_hand(attention, x: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """The attention sub-layer head by head in float64: query head ``h`` reads key/value head
    ``h // (n_head / n_kv_heads)`` (the k/v heads repeated), causal softmax, output projection."""
    batch, seq, _ = x.shape
    x = x.double()

    def heads(proj):
        return (x @ proj.weight.double().T).view(batch, seq, -1, config.head_dim)

    q, k, v = heads(attention.q_proj), heads(attention.k_proj), heads(attention.v_proj)
    if config.qk_norm:
        q = rms_normalised(q, attention.q_norm.weight.double(), config.norm_eps)
        k = rms_normalised(k, attention.k_norm.weight.double(), config.norm_eps)
    frequencies = rope_base_frequencies(config.head_dim, config.rope_theta)
    q, k = rope_by_complex_numbers(q, frequencies), rope_by_complex_numbers(k, frequencies)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    group = config.n_head // config.n_kv_heads
    outputs = []
    for head in range(config.n_head):
        kv_head = head // group
        scores = q[:, :, head] @ k[:, :, kv_head].transpose(1, 2) / math.sqrt(config.head_dim)
        weights = scores.masked_fill(future, -math.inf).softmax(-1)
        outputs.append(weights @ v[:, :, kv_head])
    return torch.cat(outputs, dim=-1) @ attention.o_proj.weight.double().T


def hand_count(c: LlamaConfig) -> int:
    """Parameters from the dimensions alone; a tied LM head is the embedding, counted once."""
    d, kv_width = c.n_embd, c.n_kv_heads * c.head_dim
    attention = 2 * d * d + 2 * d * kv_width + (2 * c.head_dim if c.qk_norm else 0)
    layer = attention + 3 * d * c.ffn_hidden_size + 2 * d
    tables = c.vocab_size * d * (1 if c.tie_embeddings else 2)
    return c.n_layer * layer + d + tables


def with_random_weights(net: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Matrices of order-one outputs and gains away from 1, so that every term shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in net.parameters():
            if param.dim() < 2:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
    return net


TINY = PRESETS["tiny"]
QK_NORM_TIED = dataclasses.replace(TINY, qk_norm=True, tie_embeddings=True)


# --- presets and parameter counts -----------------------------------------------------------


def test_preset_names_are_the_presets():
    assert list(typing.get_args(PresetName)) == list(PRESETS)


def test_llama3_8b_on_meta_has_the_published_parameter_count():
    with torch.device("meta"):
        model = build_llama(preset="llama3_8b")
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() == 8_030_261_248  # Llama-3-8B: 8.03e9
    c = model.config
    assert (c.n_embd, c.n_layer, c.n_head, c.n_kv_heads, c.ffn_hidden_size) == (4096, 32, 32, 8, 14336)
    assert (c.vocab_size, c.rope_theta, c.tie_embeddings) == (128256, 500_000.0, False)


@pytest.mark.slow
def test_llama31_scaling_applies_to_the_8b_preset():
    with torch.device("meta"):
        model = build_llama(preset="llama3_8b", rope_scaling="llama3.1")
    assert model.config.rope_scaling == ROPE_SCALINGS["llama3.1"]
    assert model.num_params() == 8_030_261_248  # frequencies, not parameters


@pytest.mark.slow
def test_qwen3_8b_on_meta_has_the_published_parameter_counts():
    """Qwen3-8B's model card: 8.2B parameters, 6.95B of them outside the embeddings."""
    with torch.device("meta"):
        model = build_llama(preset="qwen3_8b")
    tables = model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    assert round(model.num_params() / 1e9, 1) == 8.2
    assert round((model.num_params() - tables) / 1e9, 2) == 6.95


@pytest.mark.parametrize("preset", list(PRESETS))
def test_param_count_matches_hand_count(preset):
    with torch.device("meta"):
        model = build_llama(preset=preset)
    assert model.num_params() == hand_count(PRESETS[preset])


def test_tiny_preset_is_a_few_hundred_thousand_parameters():
    assert 100_000 < build_llama().num_params() < 1_000_000


# --- rotary position embeddings -------------------------------------------------------------


def test_rope_matches_complex_rotation():
    config = dataclasses.replace(TINY, n_embd=64, n_head=4)  # head_dim 16
    x = torch.randn(2, 24, 3, config.head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(config, 24, x.device)
    expected = rope_by_complex_numbers(x, rope_base_frequencies(config.head_dim, config.rope_theta))
    torch.testing.assert_close(apply_rope(x, cos, sin).double(), expected, rtol=1e-5, atol=1e-5)


def test_rope_keeps_position_zero_and_norms_of_pairs():
    x = torch.randn(1, 8, 2, TINY.head_dim, generator=torch.Generator().manual_seed(1))
    rotated = apply_rope(x, *rope_tables(TINY, 8, x.device))
    assert torch.equal(rotated[:, 0], x[:, 0])

    def pair_norms(t):
        first, second = t.chunk(2, dim=-1)
        return first**2 + second**2

    torch.testing.assert_close(pair_norms(rotated), pair_norms(x))


def test_llama31_rope_scaling_matches_metas_formula():
    config = dataclasses.replace(PRESETS["llama3_8b"], rope_scaling=ROPE_SCALINGS["llama3.1"])
    base = rope_base_frequencies(config.head_dim, config.rope_theta)
    expected = llama3_scaled_frequencies(base, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_positions=8192)
    got = rope_frequencies(config).double()
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0)
    # Every regime is exercised: kept, divided by the factor, and the smooth band between.
    kept = sum(e == b for e, b in zip(expected, base, strict=True))
    stretched = sum(math.isclose(e, b / 8.0) for e, b in zip(expected, base, strict=True))
    assert kept > 0 and stretched > 0 and kept + stretched < len(base)


def test_without_scaling_frequencies_are_sus():
    got = rope_frequencies(PRESETS["llama3_8b"]).double()
    expected = torch.tensor(rope_base_frequencies(128, 500_000.0), dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


# --- attention, norms, MLP ------------------------------------------------------------------


@pytest.mark.parametrize("config", [TINY, QK_NORM_TIED, dataclasses.replace(TINY, n_kv_heads=1),
                                    dataclasses.replace(TINY, n_kv_heads=4)],
                         ids=["gqa", "gqa_qk_norm", "multi_query", "multi_head"])
def test_attention_matches_heads_computed_by_hand(config):
    """Grouped-query attention is full multi-head attention with each k/v head repeated for
    its group of query heads; with QK-norm, q and k are RMS-normalised per head before RoPE."""
    attention = with_random_weights(Llama(config)).layers["0"].self_attn
    x = torch.randn(2, 12, config.n_embd, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = attention(x)
    torch.testing.assert_close(got.double(), attention_by_hand(attention, x, config), rtol=1e-4, atol=1e-5)


def test_qk_norm_on_and_off():
    plain, normed = Llama(TINY), Llama(QK_NORM_TIED)
    assert not any("_norm" in name and "self_attn" in name for name, _ in plain.named_parameters())
    gains = {name: p.shape for name, p in normed.named_parameters() if name.endswith(("q_norm.weight", "k_norm.weight"))}
    assert gains == {f"layers.{i}.self_attn.{n}.weight": (TINY.head_dim,)
                     for i in range(TINY.n_layer) for n in ("q_norm", "k_norm")}
    assert "layers.*.self_attn.q_norm" not in plain.tensor_parallel_plan()
    assert normed.tensor_parallel_plan()["layers.*.self_attn.q_norm"] == "head_norm"


def test_rms_norms_follow_the_formula_with_the_configured_eps():
    config = dataclasses.replace(QK_NORM_TIED, norm_eps=1e-2)  # comparable to mean(x^2) below
    net = with_random_weights(Llama(config))
    norms = [net.norm, net.layers["0"].input_layernorm, net.layers["1"].post_attention_layernorm]
    x = 0.1 * torch.randn(3, 5, config.n_embd, generator=torch.Generator().manual_seed(3))
    head = 0.1 * torch.randn(3, 5, 4, config.head_dim, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for norm in norms:
            torch.testing.assert_close(norm(x), rms_normalised(x, norm.weight, 1e-2))
        q_norm = net.layers["0"].self_attn.q_norm
        torch.testing.assert_close(q_norm(head), rms_normalised(head, q_norm.weight, 1e-2))


def test_swiglu_shapes_and_values():
    mlp = with_random_weights(Llama(TINY)).layers["0"].mlp
    d, hidden = TINY.n_embd, TINY.ffn_hidden_size
    assert (mlp.gate_proj.weight.shape, mlp.up_proj.weight.shape, mlp.down_proj.weight.shape) == \
        ((hidden, d), (hidden, d), (d, hidden))
    x = torch.randn(2, 7, d, generator=torch.Generator().manual_seed(5)).double()
    gate, up = x @ mlp.gate_proj.weight.double().T, x @ mlp.up_proj.weight.double().T
    expected = (gate / (1 + torch.exp(-gate)) * up) @ mlp.down_proj.weight.double().T  # silu(g) = g sigmoid(g)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x.float()).double(), expected, rtol=1e-4, atol=1e-5)


# --- the whole network ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_llama().eval()


def test_forward_shape(tiny):
    with torch.no_grad():
        assert tiny(torch.randint(256, (3, 17))).shape == (3, 17, 256)


@pytest.mark.parametrize("config", [TINY, QK_NORM_TIED], ids=["gqa", "qk_norm_tied"])
def test_causal(config):
    net = with_random_weights(Llama(config)).eval()
    tokens = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(6))
    t = 12
    changed = tokens.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % 256
    with torch.no_grad():
        before, after = net(tokens), net(changed)
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, t + 1], before[:, t + 1])


def test_initial_loss_is_uniform(tiny):
    generator = torch.Generator().manual_seed(7)
    tokens, targets = (torch.randint(256, (8, 64), generator=generator) for _ in range(2))
    with torch.no_grad():
        loss = F.cross_entropy(tiny(tokens).flatten(0, 1), targets.flatten())
    assert abs(loss.item() - math.log(256)) < 0.1


def test_tied_embeddings_share_storage():
    tied, untied = build_llama(tie_embeddings=True), build_llama()
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()
    assert untied.num_params() - tied.num_params() == TINY.vocab_size * TINY.n_embd


@pytest.mark.parametrize("config", [TINY, QK_NORM_TIED, dataclasses.replace(TINY, n_kv_heads=1, n_layer=3)],
                         ids=["gqa", "qk_norm_tied", "multi_query"])
def test_flops_per_token_equals_torchs_flop_counter(config):
    """Forward and backward of a batch on the meta device, as ``litscale.measure.flops`` counts a
    network without a formula."""
    from torch.utils.flop_counter import FlopCounterMode

    batch, seq_len = 2, 64
    with torch.device("meta"):
        net = Llama(config)
        tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        net(tokens).float().sum().backward()
    assert net.flops_per_token(seq_len) * batch * seq_len == counter.get_total_flops()


def test_build_llama_overrides():
    model = build_llama(n_layer=3, n_kv_heads=4, block_size=32, qk_norm=True, rope_theta=500_000.0)
    assert list(model.layers) == ["0", "1", "2"]
    assert model.config == dataclasses.replace(TINY, n_layer=3, n_kv_heads=4, block_size=32, qk_norm=True,
                                               rope_theta=500_000.0)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"n_kv_heads": 3}, "model.net.n_kv_heads=3 must divide n_head=4"),
    ({"n_head": 3}, "model.net.n_embd=128 must be divisible by n_head=3"),
    ({"n_embd": 132, "n_head": 4}, "model.net.n_embd / n_head = 33 must be even: RoPE rotates pairs of features"),
    ({"rope_scaling": "yarn"}, "model.net.rope_scaling='yarn' is not valid: expected one of: 'llama3.1' or null"),
])
def test_build_llama_rejects_in_one_line(overrides, message):
    with pytest.raises(ValueError) as error:
        build_llama(**overrides)
    assert str(error.value) == message


# --- pipeline stages ------------------------------------------------------------------------


def cut(net: Llama, cuts: list[int]) -> list[torch.nn.Module]:
    """Each stage of ``net`` as the pipeline strategy leaves it on its rank (one stage per rank)."""
    from litscale.strategies.stages import keep_stages

    ranks = list(range(len(cuts)))
    return [keep_stages(copy.deepcopy(net), net.pipeline_blocks(), cuts, ranks, rank)[rank] for rank in ranks]


def test_pipeline_blocks_are_embedding_layers_and_head(tiny):
    assert tiny.pipeline_blocks() == [["embed_tokens"], ["layers.0"], ["layers.1"], ["norm", "lm_head"]]


def test_pipeline_stages_compose_and_keep_checkpoint_keys(tiny):
    first, second = cut(tiny, [0, 2])
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, TINY.n_embd)
        assert torch.equal(second(hidden), tiny(tokens))
    full_keys = set(tiny.state_dict())
    assert set(first.state_dict()) | set(second.state_dict()) == full_keys
    assert not set(first.state_dict()) & set(second.state_dict())
    assert "layers.1.self_attn.q_proj.weight" in second.state_dict()
    assert first.num_params() + second.num_params() == tiny.num_params()
    assert tiny.sharding_units() == list(tiny.layers.values())


# --- tensor-parallel checks before any process starts ---------------------------------------


def test_kv_heads_that_do_not_split_over_tensor_parallel_are_one_line():
    from litscale.strategies import TensorParallelStrategy

    with torch.device("meta"):
        net = build_llama(n_kv_heads=1)
    with pytest.raises(ValueError) as error:
        TensorParallelStrategy(tensor_parallel_size=2).validate_setup(world_size=2, net=net)
    assert str(error.value) == ("strategy.tensor_parallel_size=2 does not divide model.net.n_kv_heads=1; "
                                "allowed: a divisor of 1")


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_config_with_kv_heads_that_do_not_split_is_rejected_by_validation(tmp_path, outputs_root):
    from litscale.app.checks.validation import ConfigError, validate

    cfg, choices = compose_job(["model=llama", "strategy=tensor_parallel", "trainer.accelerator=cpu",
                                "trainer.devices=2", "model.net.n_kv_heads=1"], tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value) == ("strategy.tensor_parallel_size=2 does not divide model.net.n_kv_heads=1; "
                                "allowed: a divisor of 1")
