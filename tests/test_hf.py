"""Hugging Face transformers models in and out: ``model=hf`` (``HFCausalLM``) against the
transformers model's own logits, its declarations (the tensor-parallel plan translated from
transformers' own, pipeline units, stages), litscale's Llama to a transformers directory and
back, the one-line errors of an offline build, and on 2 gloo ranks a tiny Qwen3 under tensor
parallel, FSDP and a 2-stage pipeline against one process, exported and reopened by
transformers. Every model is built from a config here: nothing is downloaded."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers.cli import explain, run_train
from helpers.configs import compose_job
from helpers.deferred import Deferred
from helpers.parity import ParitySetup, assert_ranks_match, fit_on_mesh, reference
from helpers.without_extras import environment
from lightning.pytorch import Callback

from litscale.models.hf import HFCausalLM, HFModelConfig, build_hf
from litscale.models.llama import ROPE_SCALINGS, Llama, LlamaConfig
from litscale.models.moe import MoEConfig, MoEDecoder

# transformers, and litscale.models.hf_writing which imports it, at their first use (helpers.deferred).
AutoModelForCausalLM = Deferred("transformers", "AutoModelForCausalLM")
llama_from_hf = Deferred("litscale.models.llama", "llama_from_hf")
moe_from_hf = Deferred("litscale.models.moe", "moe_from_hf")
moe_layout_of = Deferred("litscale.models.moe_config", "moe_layout_of")
save_hf_directory = Deferred("litscale.models.hf_writing", "save_hf_directory")

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64)
LLAMA = HFModelConfig.of("llama", block_size=16, **SHAPE)
QWEN3 = HFModelConfig.of("qwen3", block_size=16, head_dim=8, **SHAPE)
QWEN3_TIED = HFModelConfig.of("qwen3", block_size=16, head_dim=8, tie_word_embeddings=True, **SHAPE)
# Sliding windows shorter than the sequence: every layer's mask is transformers' own choice.
MISTRAL_WINDOW = HFModelConfig.of("mistral", block_size=16, sliding_window=4, **SHAPE)
QWEN2_MIXED_WINDOWS = HFModelConfig.of("qwen2", block_size=16, use_sliding_window=True, sliding_window=4,
                                       max_window_layers=2, **SHAPE)
QWEN3_MOE = HFModelConfig.of("qwen3_moe", block_size=16, head_dim=8, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, norm_topk_prob=True, **SHAPE)
GPT2 = HFModelConfig.of("gpt2", block_size=16, n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=64)

TINY_LLAMA = LlamaConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64,
                         block_size=16)


def seeded(config: HFModelConfig) -> HFCausalLM:
    torch.manual_seed(0)
    return HFCausalLM(config)


def tokens(vocab_size: int = 64, seed: int = 3) -> torch.Tensor:
    return torch.randint(vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))


def with_random_gains(net: torch.nn.Module) -> torch.nn.Module:
    """Norm gains away from their initial ones, so a mix-up of two gains shows in the logits."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in net.parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    return net


# --- the wrapper against transformers' own forward ------------------------------------------


@pytest.mark.parametrize("config", [LLAMA, QWEN3, QWEN3_TIED, MISTRAL_WINDOW, QWEN2_MIXED_WINDOWS, GPT2, QWEN3_MOE],
                         ids=["llama", "qwen3", "qwen3-tied", "mistral-window", "qwen2-mixed-windows", "gpt2",
                              "qwen3-moe"])
def test_logits_equal_the_transformers_models_own(config):
    net = seeded(config).eval()  # GPT-2's config has dropout
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config.transformers_config()).eval()
    assert net.state_dict().keys() == model.state_dict().keys()  # transformers' names, unprefixed
    with torch.no_grad():
        torch.testing.assert_close(net(tokens()), model(tokens(), use_cache=False).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_logits_are_causal():
    net = seeded(QWEN3)
    changed = tokens().clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 64
    with torch.no_grad():
        torch.testing.assert_close(net(changed)[:, :10], net(tokens())[:, :10])


@pytest.mark.slow
def test_flops_per_token_counts_what_torchs_flop_counter_counts():
    """Eager attention, whose matmuls the counter sees (CPU's fused SDPA kernel it does not);
    the counter also counts the rotary table's tiny matmul."""
    from torch.utils.flop_counter import FlopCounterMode

    net = seeded(HFModelConfig.of("qwen3", block_size=16, head_dim=8, attn_implementation="eager", **SHAPE))
    with FlopCounterMode(display=False) as counter:
        net(tokens()[:1]).float().sum().backward()
    assert net.flops_per_token(16) * 16 == pytest.approx(counter.get_total_flops(), rel=1e-4)


# --- declarations ---------------------------------------------------------------------------

LLAMA_PLAN = {
    "model.embed_tokens": "embedding",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "head",
}
QWEN3_PLAN = {**{k: v for k, v in LLAMA_PLAN.items() if k != "lm_head"},
              "model.layers.*.self_attn.q_norm": "head_norm",
              "model.layers.*.self_attn.k_norm": "head_norm",
              "lm_head": "head"}


@pytest.mark.parametrize(("config", "plan"), [(LLAMA, LLAMA_PLAN), (QWEN3, QWEN3_PLAN), (QWEN3_TIED, QWEN3_PLAN)],
                         ids=["llama", "qwen3", "qwen3-tied"])
def test_tensor_parallel_plan_is_transformers_own_translated(config, plan):
    net = seeded(config)
    assert net.tensor_parallel_plan() == plan
    assert list(net.tensor_parallel_plan()) == list(plan)  # applied in this order


def test_a_style_litscale_does_not_translate_is_one_line():
    net = seeded(LLAMA)
    config = net.transformers_model.config
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.gate_proj": "local_colwise"}
    with pytest.raises(ValueError) as error:
        net.tensor_parallel_plan()
    assert str(error.value) == (
        "model.net: llama's tensor-parallel plan gives layers.*.mlp.gate_proj the Hugging Face style "
        "'local_colwise', which litscale does not translate; allowed: colwise, rowwise, sequence_parallel "
        "(colwise_rep on the output layer), or a plan of litscale styles in strategy.plan")


def test_a_model_without_a_plan_leaves_it_to_the_strategy():
    from litscale.strategies import TensorParallelStrategy

    net = seeded(GPT2)
    assert net.tensor_parallel_plan() is None
    with pytest.raises(ValueError, match="^HFCausalLM declares no tensor-parallel plan"):
        TensorParallelStrategy(tensor_parallel_size=2).validate_setup(world_size=2, net=net)


def test_pipeline_units_are_embedding_layers_and_norm_with_head():
    assert seeded(QWEN3).pipeline_blocks() == [
        ["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["model.layers.2"],
        ["model.layers.3"], ["model.norm", "lm_head"]]


def test_a_pipeline_of_a_family_not_run_layer_by_layer_is_one_line():
    from litscale.strategies import PipelineParallelStrategy

    with torch.device("meta"):  # as the pre-flight check builds it
        net = HFCausalLM(GPT2)
    with pytest.raises(ValueError) as error:
        PipelineParallelStrategy(schedule="1f1b", microbatches=2).validate_setup(world_size=2, net=net)
    assert str(error.value) == ("strategy=pipeline needs a model litscale runs layer by layer, but model.net has "
                                "model_type='gpt2'; allowed: llama, mistral, qwen2, qwen3")


def test_pipeline_stages_compose_and_keep_checkpoint_keys():
    from litscale.strategies.stages import keep_stages

    net = seeded(QWEN3)
    units = net.pipeline_blocks()
    first, second = (keep_stages(copy.deepcopy(net), units, [0, 3], [0, 1], rank)[rank] for rank in (0, 1))
    with torch.no_grad():
        hidden = first(tokens())
        assert hidden.shape == (2, 16, 32)
        torch.testing.assert_close(second(hidden), net(tokens()), rtol=0, atol=0)
    assert set(first.state_dict()) | set(second.state_dict()) == set(net.state_dict())
    assert not set(first.state_dict()) & set(second.state_dict())
    assert "model.layers.3.self_attn.q_norm.weight" in second.state_dict()
    assert [type(unit).__name__ for unit in second.sharding_units()] == ["Qwen3DecoderLayer"] * 2


# --- Hugging Face directories out and in ----------------------------------------------------


@pytest.mark.parametrize("config", [
    TINY_LLAMA,
    dataclasses.replace(TINY_LLAMA, qk_norm=True, tie_embeddings=True),  # Qwen3ForCausalLM
    dataclasses.replace(TINY_LLAMA, n_kv_heads=1, rope_theta=500_000.0, rope_scaling=ROPE_SCALINGS["llama3.1"]),
], ids=["llama", "qwen3-qk-norm-tied", "llama3.1-rope-scaling"])
def test_llama_to_a_transformers_directory_and_back(config, tmp_path):
    torch.manual_seed(0)
    net = with_random_gains(Llama(config))
    save_hf_directory(net, net.state_dict(), str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert type(model).__name__ == ("Qwen3ForCausalLM" if config.qk_norm else "LlamaForCausalLM")
    back = llama_from_hf(str(tmp_path))
    assert back.config == config
    assert (back.lm_head.weight is back.embed_tokens.weight) == config.tie_embeddings
    with torch.no_grad():
        expected = net(tokens())
        torch.testing.assert_close(model(tokens()).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(back(tokens()), expected, rtol=0, atol=0)


@pytest.mark.parametrize("config", [QWEN3, QWEN3_TIED], ids=["qwen3", "qwen3-tied"])
@pytest.mark.slow  # over half a second alone
def test_a_transformers_qwen3_into_litscales_llama(config, tmp_path):
    torch.manual_seed(0)
    model = with_random_gains(AutoModelForCausalLM.from_config(config.transformers_config()))
    model.save_pretrained(tmp_path)
    net = llama_from_hf(str(tmp_path))
    assert net.config.qk_norm and net.config.tie_embeddings == config.transformers_config().tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(net(tokens()), model(tokens()).logits, rtol=0, atol=0)


TINY_MOE = MoEConfig(n_layer=3, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64, block_size=16,
                     qk_norm=True, n_experts=4, top_k=2, moe_ffn_hidden_size=16, dense_layers=1)


@pytest.mark.parametrize("config", [TINY_MOE, dataclasses.replace(TINY_MOE, dense_layers=0, tie_embeddings=True,
                                                                  attention_head_dim=16, norm_topk_prob=False),
                                     # every other block a mixture of experts (Qwen3-MoE's decoder_sparse_step=2)
                                     dataclasses.replace(TINY_MOE, n_layer=4, dense_layers=0, moe_every=2),
                                     dataclasses.replace(TINY_MOE, n_layer=6, dense_layers=1, moe_every=2)],
                         ids=["dense-first", "all-moe-tied-wide-heads", "moe-every-2", "dense-first-moe-every-2"])
def test_moe_to_a_transformers_qwen3_moe_directory_and_back(config, tmp_path):
    torch.manual_seed(0)
    net = with_random_gains(MoEDecoder(config))
    save_hf_directory(net, net.state_dict(), str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    back = moe_from_hf(str(tmp_path))
    assert back.config == config
    with torch.no_grad():
        expected = net(tokens())
        torch.testing.assert_close(model(tokens()).logits, expected, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(back(tokens()), expected, rtol=0, atol=0)


def test_the_moe_layers_of_a_qwen3_moe_config_are_read_as_dense_layers_then_every_kth():
    assert moe_layout_of([1, 3], 4) == (0, 2)
    assert moe_layout_of([2, 4], 6) == (1, 2)
    assert moe_layout_of([1, 2, 3], 4) == (1, 1)
    assert moe_layout_of([], 3) == (3, 1)
    with pytest.raises(ValueError) as error:
        moe_layout_of([0, 2, 3], 4, "'hf'")
    assert str(error.value) == ("'hf' has MoE layers [0, 2, 3]; allowed: the dense layers first, then every k-th "
                                "layer a MoE layer to the last (model.net.dense_layers, model.net.moe_every)")


def test_a_transformers_qwen3_moe_into_litscales_moe(tmp_path):
    torch.manual_seed(0)
    model = with_random_gains(AutoModelForCausalLM.from_config(QWEN3_MOE.transformers_config()))
    model.save_pretrained(tmp_path)
    net = moe_from_hf(str(tmp_path))
    assert net.config.moe_layers == (0, 1, 2, 3) and net.config.head_dim == 8
    with torch.no_grad():
        torch.testing.assert_close(net(tokens()), model(tokens()).logits, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    ({"n_shared_experts": 1}, "model.net.n_shared_experts=1 has no Qwen3-MoE form; allowed: n_shared_experts=0"),
    ({"score_func": "sigmoid"}, "model.net.score_func='sigmoid' has no Qwen3-MoE form; allowed: score_func='softmax'"),
], ids=["shared-experts", "sigmoid"])
def test_a_moe_qwen3_moe_lacks_is_one_line(change, message, tmp_path):
    net = MoEDecoder(dataclasses.replace(TINY_MOE, **change))
    with pytest.raises(ValueError) as error:
        save_hf_directory(net, net.state_dict(), str(tmp_path))
    assert str(error.value) == message


def test_an_hf_model_exports_and_loads_back_from_its_directory(tmp_path):
    net = with_random_gains(seeded(QWEN3_TIED))
    save_hf_directory(net, net.state_dict(), str(tmp_path))
    loaded = build_hf(path=str(tmp_path), vocab_size=64, block_size=16)
    assert loaded.config.checkpoint == str(tmp_path)
    with torch.no_grad():
        expected = net(tokens())
        torch.testing.assert_close(loaded(tokens()), expected, rtol=0, atol=0)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
        torch.testing.assert_close(model(tokens()).logits, expected, rtol=0, atol=0)


def test_export_needs_every_weight_and_an_llm(tmp_path):
    from litscale.models.gpt import build_gpt

    net = seeded(QWEN3)
    stage = {k: v for k, v in net.state_dict().items() if not k.startswith("lm_head")}
    with pytest.raises(ValueError) as error:
        save_hf_directory(net, stage, str(tmp_path))
    assert str(error.value) == ("the weights to export lack lm_head.weight (and 0 more): a pipeline stage holds "
                                "only its own layers; allowed: the full weights of the network")
    with pytest.raises(ValueError) as error:
        save_hf_directory(build_gpt(), {}, str(tmp_path))
    assert str(error.value) == "GPT has no Hugging Face form; allowed: model=llama, model=moe or model=hf"


def test_a_transformers_model_litscales_llama_lacks_is_one_line(tmp_path):
    config = HFModelConfig.of("llama", attention_bias=True, **SHAPE)
    AutoModelForCausalLM.from_config(config.transformers_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as error:
        llama_from_hf(str(tmp_path))
    assert str(error.value) == (f"model.net.from_hf={str(tmp_path)!r} has attention_bias=True, which litscale's Llama does not "
                                "have; allowed: attention_bias=False")


# --- building offline: the one-line errors ----------------------------------------------------

NEVER_DOWNLOADED = ("allowed: a local Hugging Face checkpoint directory (config.json and safetensors weights); "
                    "models are never downloaded")


@pytest.mark.parametrize(("arguments", "message"), [
    ({"path": "/no/such/checkpoint"},
     f"model.net.path='/no/such/checkpoint' is not a local directory; {NEVER_DOWNLOADED}"),
    ({"path": "Qwen/Qwen3-0.6B"},
     f"model.net.path='Qwen/Qwen3-0.6B' is not a local directory; {NEVER_DOWNLOADED}"),
    ({"config": "Qwen/Qwen3-0.6B"},
     "model.net.config='Qwen/Qwen3-0.6B' is not a local config.json or a directory holding one; allowed: a local "
     "path, or a mapping with model_type; models are never downloaded"),
    ({"config": {"hidden_size": 32}},
     "model.net.config has no model_type; allowed: a mapping with model_type (e.g. llama, mistral, qwen2, qwen3, "
     "gpt2) and that model's config fields"),
    ({"config": {"model_type": "my_remote_model"}},
     "model.net.config.model_type='my_remote_model' is not a model type transformers 4.57.6 knows; allowed: "
     "e.g. llama, mistral, qwen2, qwen3, gpt2"),
    ({"config": {"model_type": "t5"}},
     "model.net.config has model_type='t5', which has no causal language model in transformers; allowed: a "
     "decoder, e.g. llama, mistral, qwen2, qwen3, gpt2"),
    ({"config": {"model_type": "qwen3", "vocab_size": 100}, "vocab_size": 256},
     "model.net.config sets vocab_size=100 but data.vocab_size=256; allowed: 256 (or leave vocab_size out: it "
     "follows data.vocab_size)"),
    ({"config": {"model_type": "gpt2", "n_positions": 64}, "block_size": 128},
     "model.net.block_size=128 (data.seq_len) is longer than model.net.config's max_position_embeddings=64; "
     "allowed: at most 64"),
    ({"config": {"model_type": "qwen3"}, "path": "/ckpt"},
     "model.net.config and model.net.path='/ckpt' are both set; allowed: one of them (a checkpoint brings its "
     "own config)"),
], ids=["missing-path", "hub-id-as-path", "hub-id-as-config", "no-model-type", "unknown-model-type",
        "not-a-causal-lm", "vocab-mismatch", "sequence-longer-than-positions", "config-and-path"])
def test_build_errors_are_one_line(arguments, message):
    with pytest.raises(ValueError) as error:
        build_hf(**arguments)
    assert str(error.value) == message


def test_a_misspelt_config_field_is_named():
    with pytest.raises(ValueError, match=r"^model\.net\.config\.hiden_size is not a field of Qwen3Config; "
                                         r"allowed: .*hidden_size"):
        build_hf(config={"model_type": "qwen3", "hiden_size": 32})


def test_a_checkpoint_without_safetensors_or_of_another_vocabulary_is_refused(tmp_path):
    seeded(QWEN3).transformers_model.save_pretrained(tmp_path, safe_serialization=False)
    with pytest.raises(ValueError) as error:
        build_hf(path=str(tmp_path))
    assert str(error.value) == (
        f"model.net.path={str(tmp_path)!r} holds no safetensors weights (model.safetensors or "
        "model.safetensors.index.json); allowed: a safetensors checkpoint (pickled .bin weights are never loaded)")
    seeded(QWEN3).transformers_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as error:
        build_hf(path=str(tmp_path), vocab_size=256)
    assert str(error.value) == (f"model.net.path={str(tmp_path)!r} has vocab_size=64 but data.vocab_size=256; "
                                "allowed: data.vocab_size=64, the checkpoint's")


def test_on_the_meta_device_a_checkpoint_gives_shapes_without_reading_weights(tmp_path):
    seeded(QWEN3).transformers_model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read on meta")
    with torch.device("meta"):
        net = build_hf(path=str(tmp_path), vocab_size=64)
    assert all(p.is_meta for p in net.parameters())


@pytest.mark.slow
def test_model_hf_config_composes_validates_and_follows_the_datas_vocabulary(tmp_path, outputs_root):
    from litscale.app.build import build_module
    from litscale.app.checks.validation import validate

    cfg, choices = compose_job(["model=hf", "data.seq_len=32",
                                "model.net.config={model_type: llama, hidden_size: 32, intermediate_size: 64, "
                                "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2}"],
                               tmp_path / "run")
    validate(cfg, choices=choices)
    net = build_module(cfg).net
    assert net.transformers_model.config.vocab_size == cfg.data.vocab_size
    assert net(torch.randint(cfg.data.vocab_size, (2, 32))).shape == (2, 32, cfg.data.vocab_size)


@pytest.mark.parametrize(("devices", "refusal"), [
    (4, "strategy.tensor_parallel_size=4 does not divide model.net.config.num_key_value_heads=2; allowed: a "
        "divisor of 2"),
    (2, None),
], ids=["tp4", "tp2"])
def test_a_tensor_parallel_size_the_key_value_heads_do_not_split_by_is_one_line(devices, refusal, tmp_path,
                                                                                  outputs_root):
    """Found by the combination test: the default Qwen3's 2 key/value heads at TP 4 were accepted,
    and its attention failed in the first forward ("shape '[8, 32, -1, 32]' is invalid")."""
    from litscale.app.checks.validation import ConfigError, validate

    cfg, choices = compose_job(["model=hf", "data=synthetic", "data.seq_len=32", "strategy=tensor_parallel",
                                "trainer.accelerator=cpu", f"trainer.devices={devices}",
                                "launcher.oversubscribe=true"], tmp_path / "run")
    try:
        validate(cfg, choices=choices, this_machine=False)
    except ConfigError as error:
        assert str(error) == refusal
    else:
        assert refusal is None


@pytest.mark.parametrize("strategy", [["strategy=single"], ["strategy=ddp", "trainer.devices=2"],
                                      ["strategy=fsdp", "trainer.devices=2"]])
def test_a_missing_checkpoint_is_one_line_before_any_rank_starts_whatever_the_strategy(
        strategy, tmp_path, outputs_root):
    from litscale.app.checks.validation import ConfigError, validate

    cfg, choices = compose_job(["model=hf", "model.net.path=/no/such/checkpoint", "trainer.accelerator=cpu",
                                *strategy], tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value) == f"model.net.path='/no/such/checkpoint' is not a local directory; {NEVER_DOWNLOADED}"


@pytest.mark.full
@pytest.mark.slow  # starts train.py
@pytest.mark.parametrize("raising", [False, pytest.param(True, marks=pytest.mark.soak)],  # soak: CI's time
                         ids=["transformers-absent", "transformers-refused"])
@pytest.mark.parametrize(("path", "message"), [
    ("/no/such/checkpoint", f"model.net.path='/no/such/checkpoint' is not a local directory; {NEVER_DOWNLOADED}"),
    (None, "model=hf needs the transformers package, which is not installed; install it with: "
           "pip install 'litscale[hf]'"),
], ids=["bad-path", "good-path"])
def test_without_the_hf_extra_model_hf_is_refused_in_litscales_one_line(path, message, raising, tmp_path):
    """The path is checked before transformers is asked for: a bad path is named as such; a good
    one without transformers says how to install it. In a process where transformers is absent
    (or where a finder refuses it)."""
    if path is None:
        seeded(QWEN3).transformers_model.save_pretrained(tmp_path / "checkpoint")
        path = str(tmp_path / "checkpoint")
    process = run_train("model=hf", f"model.net.path={path}", "trainer.max_steps=1", outputs=tmp_path,
                        env=environment(("transformers",), raising=raising))
    shown = [line for line in (process.stdout + process.stderr).splitlines() if line.strip()]
    assert (process.returncode, shown) == (2, [f"error: {message}"]), explain(process)


@pytest.mark.parametrize(("overrides", "message"), [
    (["export_hf=true"], "export_hf=true needs model=llama, model=moe or model=hf (got model=gpt)"),
])
def test_export_hf_is_refused_in_one_line_where_it_cannot_work(overrides, message, tmp_path, outputs_root):
    from litscale.app.checks.validation import ConfigError, validate

    cfg, choices = compose_job(overrides, tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value) == message


def test_export_hf_is_accepted_for_a_mixture_of_experts(tmp_path, outputs_root):
    """litscale.models.hf_writing writes a MoE's Hugging Face form (tested above): a run may ask for it."""
    from litscale.app.checks.validation import validate

    cfg, choices = compose_job(["export_hf=true", "model=moe", "data=synthetic", "data.seq_len=32"], tmp_path / "run")
    validate(cfg, choices=choices)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_llama_run_with_export_hf_writes_a_directory_transformers_loads(tmp_path):
    """``train.py model=llama export_hf=true``: ``<run dir>/hf`` loads in transformers with the
    logits of the run's own exported weights (``model.pt``) in litscale's Llama."""
    from helpers.cli import explain, summaries
    from helpers.inprocess import train_on_pool

    from litscale.models.llama import build_llama

    process = train_on_pool("model=llama", "export_hf=true", "trainer.accelerator=cpu", "trainer.max_steps=3",
                            "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "data.seq_len=32",
                            "data.max_bytes=200000", "trainer.enable_progress_bar=false", outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    (summary,) = summaries(tmp_path)
    assert summary["export_hf"] == f"{summary['output_dir']}/hf"  # in the summary and the closing line
    assert f"outputs: {summary['output_dir']} (summary.json, checkpoints/, model.pt, hf/, logs)" in process.stdout
    weights = torch.load(summary["export"], weights_only=True)
    net = build_llama(preset="tiny", vocab_size=weights["embed_tokens.weight"].shape[0], block_size=32)
    net.load_state_dict(weights)
    config = net.config
    hf = AutoModelForCausalLM.from_pretrained(f"{summary['output_dir']}/hf", local_files_only=True)
    tokens = torch.randint(config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, net(tokens), rtol=1e-5, atol=1e-5)


# --- on 2 gloo ranks ----------------------------------------------------------------------------


class ExportAtFitEnd(Callback):
    """Writes the trained model's Hugging Face directory as a run's end does (every rank
    gathers; rank 0 writes)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_fit_end(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        from litscale.checkpoint.export import export_model

        # What is exported is gathered from shards: the translated plan did split the model.
        assert isinstance(pl_module.net.model.layers[0].self_attn.q_proj.weight, DTensor)
        export_model(trainer, pl_module, self.directory, hugging_face=True)


def hf_setup(config: HFModelConfig) -> ParitySetup:
    # Two micro batches of 8 per rank: a 1F1B pipeline of 2 stages splits each into 4.
    return ParitySetup(config=config, net_class=HFCausalLM, optimizer="adamw", weight_decay=0.1,
                       global_batch=16, accumulation=2)


TIED, UNTIED = hf_setup(QWEN3_TIED), hf_setup(QWEN3)
CASES = {  # name -> (strategy factory, its options, setup)
    "tensor_parallel": ("tensor_parallel", {"sequence_parallel": True, "loss_parallel": True}, TIED),
    "fsdp": ("fsdp", {}, TIED),
    "pipeline_1f1b": ("pipeline", {"schedule": "1f1b", "microbatches": 4}, UNTIED),
    # transformers' own Qwen3-MoE (experts as one nn.Linear each, looped over) under FSDP.
    "qwen3_moe_fsdp": ("fsdp", {}, hf_setup(QWEN3_MOE)),
}


def fit_cases(rank: int, world_size: int, export_directory: str) -> dict:
    from helpers import strategies

    traces = {}
    for name, (factory, options, setup) in CASES.items():
        callbacks = [ExportAtFitEnd(export_directory)] if name == "tensor_parallel" else []
        traces[name] = fit_on_mesh(rank, world_size, getattr(strategies, factory)(**options), setup,
                                   gradients=True, local_weights=True, callbacks=callbacks)
    return traces


@pytest.fixture(scope="module")
def two_rank_fits(tmp_path_factory):
    """Each case's trace on each rank, and the directory the tensor-parallel fit exported."""
    from helpers.distributed import run_distributed

    directory = tmp_path_factory.mktemp("tensor_parallel_export")
    ranks = run_distributed(fit_cases, 2, str(directory), timeout=600)
    return {name: [traces[name] for traces in ranks] for name in CASES}, directory


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_tiny_qwen3_matches_one_process_step_by_step(two_rank_fits, name):
    traces, _ = two_rank_fits
    setup = CASES[name][2]
    assert_ranks_match(traces[name], [reference(setup)] * 2)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tensor_parallel_training_exports_what_transformers_loads(two_rank_fits):
    traces, directory = two_rank_fits
    trained = seeded(QWEN3_TIED)
    trained.load_state_dict(traces["tensor_parallel"][0].weights)  # rank 0's, gathered whole
    model = AutoModelForCausalLM.from_pretrained(directory / "hf", local_files_only=True)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, trained(tokens()), rtol=0, atol=0)


# --- your own checkpoint, from the command line ------------------------------------------------


FROM_HF_CASES = [
    ("moe", QWEN3_MOE, ("model.net.aux_loss_coef=0", "strategy=fsdp", "strategy.expert_parallel_size=2",
                        "trainer.devices=2", "data.batch_size=4")),
    pytest.param("llama", QWEN3, ("strategy=tensor_parallel", "trainer.devices=2", "data.batch_size=8"),
                 marks=pytest.mark.soak),  # soak: CI's time (test_tiny_qwen3_matches_one_process_step_by_step: TP)
    # Each stage's weights gathered for the export.
    pytest.param("llama", QWEN3, ("strategy=pipeline", "trainer.devices=2", "data.batch_size=8"),
                 marks=pytest.mark.soak),  # soak: CI's time
]


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("model", "config", "layout"), FROM_HF_CASES, ids=["qwen3_moe-ep2", "qwen3-tp2", "qwen3-pp2"])
def test_a_transformers_directory_fine_tunes_on_a_parallel_layout_and_exports_what_it_trained(
        tmp_path, model, config, layout):
    """``model=moe|llama model.net.from_hf=<dir>``: a Qwen3-MoE (Qwen3) directory written by
    transformers trains 4 steps at one process and at expert (tensor) parallel 2 to the same
    losses; each run's ``hf/`` export gives, in transformers, the logits its trained weights
    (``model.pt``) give in litscale's decoder. The MoE balance loss is off: it weighs each
    rank's own micro batch, which no single process reproduces (docs/moving-runs.md)."""
    from helpers.cli import summaries, train_losses
    from helpers.inprocess import train_on_pool

    torch.manual_seed(0)
    directory = tmp_path / model
    with_random_gains(AutoModelForCausalLM.from_config(config.transformers_config())).save_pretrained(directory)
    original = (moe_from_hf if model == "moe" else llama_from_hf)(str(directory), block_size=16)
    common = (f"model={model}", f"model.net.from_hf={directory}", "data=synthetic",
              "data.vocab_size=64", "data.seq_len=16", "export_hf=true", "trainer.max_steps=4",
              "trainer.log_every_n_steps=1", "logger=csv", "trainer.val_check_interval=4",
              "trainer.limit_val_batches=1", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false")
    runs = {}
    same_loss = tuple(o for o in layout if o.startswith("model."))
    for name, overrides, ranks in (("one", ("strategy=single", "data.batch_size=8", *same_loss), 1),
                                   ("parallel", layout, 2)):
        process = train_on_pool(*common, *overrides, f"name={name}", outputs=tmp_path / name, devices=ranks)
        assert process.returncode == 0, explain(process)
        (runs[name],) = summaries(tmp_path / name)
    one, parallel = (train_losses(runs[name]["output_dir"]) for name in ("one", "parallel"))
    assert sorted(one) == sorted(parallel) == [0, 1, 2, 3]
    torch.testing.assert_close(torch.tensor(list(parallel.values())), torch.tensor(list(one.values())),
                               rtol=1.3e-6, atol=1e-5)
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    for summary in runs.values():
        trained = copy.deepcopy(original)
        trained.load_state_dict(torch.load(summary["export"], weights_only=True))
        # The checkpoint's weights were the start: 4 steps move them a little, not to a new init.
        start, end = original.embed_tokens.weight, trained.embed_tokens.weight
        assert 0 < (end - start).norm() < 0.5 * start.norm()
        exported = AutoModelForCausalLM.from_pretrained(summary["export_hf"], local_files_only=True)
        with torch.no_grad():
            torch.testing.assert_close(exported(tokens).logits, trained(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("build", "arguments", "message"), [
    ("moe", {"from_hf": "/no/such"}, f"model.net.from_hf='/no/such' is not a local directory; {NEVER_DOWNLOADED}"),
    ("llama", {"from_hf": "/no/such", "n_kv_heads": 2},
     "model.net.n_kv_heads=2 with model.net.from_hf: the checkpoint fixes the architecture; allowed: leave "
     "model.net.n_kv_heads unset"),
], ids=["missing", "architecture-beside-it"])
def test_from_hf_errors_are_one_line(build, arguments, message):
    from litscale.models.llama import build_llama
    from litscale.models.moe import build_moe

    with pytest.raises(ValueError) as error:
        {"moe": build_moe, "llama": build_llama}[build](**arguments)
    assert str(error.value) == message


def test_from_hf_on_the_meta_device_reads_the_config_not_the_weights(tmp_path):
    AutoModelForCausalLM.from_config(QWEN3_MOE.transformers_config()).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read on meta")
    from litscale.models.moe import build_moe

    with torch.device("meta"):
        net = build_moe(from_hf=str(tmp_path), vocab_size=64, block_size=16)
    assert net.config.n_experts == 4 and all(p.is_meta for p in net.parameters())
    with pytest.raises(ValueError, match=r"has vocab_size=64 but data.vocab_size=256; allowed: data.vocab_size=64"):
        build_moe(from_hf=str(tmp_path), vocab_size=256)
