"""Hugging Face directories out of litscale's LLMs, and litscale's Llama out of one.

``save_hf_directory(net, state_dict, directory)`` writes ``config.json`` and
``model.safetensors`` (transformers' ``save_pretrained``), which
``AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)`` opens. The state
dict is the full one of ``net``, as ``litscale.export.consolidated_state_dict`` gathers it
from any strategy. A ``model=hf`` network is a transformers model already (its keys are
transformers'); litscale's ``Llama`` has the modules of transformers' ``LlamaForCausalLM``
(``Qwen3ForCausalLM`` with QK-norm) less their ``model.`` prefix and the same RoPE layout
(``models/llama.py``), so its conversion is a mapping of config numbers and that prefix,
both ways: ``llama_from_hf(directory)`` loads such a directory into litscale's ``Llama``.
litscale's MoE decoder is transformers' ``Qwen3MoeForCausalLM`` with each layer's experts
stacked (``mlp.experts.gate_proj`` ``[n_experts, hidden, dim]`` is its ``mlp.experts.<e>.
gate_proj.weight`` for every ``e``): ``moe_from_hf`` and the export stack and unstack them.

transformers is an optional extra (``pip install 'litscale[hf]'``); importing this module
imports it (``litscale.export`` does so only when asked for a Hugging Face directory).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from litscale.models.hf import HFCausalLM, checkpoint_fields, with_vocab_size
from litscale.models.llama import Llama, LlamaConfig, RopeScaling, check_shape
from litscale.models.moe import MoEConfig, MoEDecoder
from litscale.models.moe import check_shape as check_moe_shape

BASE_PREFIX = "model."  # transformers' base model, which litscale's Llama is without its head


def save_hf_directory(net: nn.Module, state_dict: dict[str, torch.Tensor], directory: str) -> str:
    """Write ``state_dict`` (``net``'s full weights) as a transformers checkpoint directory;
    return its path."""
    config, weights = hf_config_of(net), hf_weights_of(net, state_dict)
    with torch.device("meta"):  # only its config, names and tied keys are read: no memory
        model = AutoModelForCausalLM.from_config(config)
    missing = sorted(set(model.state_dict()) - set(weights))
    if missing:
        raise ValueError(f"the weights to export lack {missing[0]} (and {len(missing) - 1} more): a pipeline "
                         "stage holds only its own layers; allowed: the full weights of the network")
    model.save_pretrained(directory, state_dict=weights)
    return os.path.abspath(directory)


def hf_config_of(net: nn.Module) -> PretrainedConfig:
    """The transformers config of a zoo LLM, or a one-line error for a network without one."""
    if isinstance(net, HFCausalLM):
        return net.config.transformers_config()
    if isinstance(net, MoEDecoder):
        return hf_config_of_moe(net.config)
    if isinstance(net, Llama):
        return hf_config_of_llama(net.config)
    raise ValueError(f"{type(net).__name__} has no Hugging Face form; allowed: model=llama, model=moe or model=hf")


def hf_weights_of(net: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(net, MoEDecoder):
        return hf_weights_of_moe(state_dict)
    if isinstance(net, Llama):
        return {name if name.startswith("lm_head.") else BASE_PREFIX + name: tensor
                for name, tensor in state_dict.items()}
    return dict(state_dict)


# --- litscale's Llama <-> transformers' Llama and Qwen3 -------------------------------------


def hf_config_of_llama(config: LlamaConfig) -> PretrainedConfig:
    """transformers' ``LlamaConfig``, or ``Qwen3Config`` where the model normalises queries
    and keys (Qwen3's QK-norm)."""
    scaling = config.rope_scaling
    return AutoConfig.for_model(
        "qwen3" if config.qk_norm else "llama",
        vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
        rope_scaling=None if scaling is None else {
            "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_positions},
        tie_word_embeddings=config.tie_embeddings, hidden_act="silu", attention_bias=False)


def llama_config_of_hf(config: PretrainedConfig, source: str = "the config") -> LlamaConfig:
    """litscale's ``LlamaConfig`` for a transformers Llama or Qwen3 config, or a one-line
    error naming the first feature litscale's Llama does not have."""
    if config.model_type not in ("llama", "qwen3"):
        raise ValueError(f"{source} has model_type={config.model_type!r}; allowed: llama or qwen3")
    unsupported = {
        "hidden_act": (config.hidden_act, "silu"),
        "attention_bias": (config.attention_bias, False),
        "mlp_bias": (getattr(config, "mlp_bias", False), False),
        "attention_dropout": (config.attention_dropout, 0.0),
        "use_sliding_window": (getattr(config, "use_sliding_window", False), False),
        "head_dim": (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                     config.hidden_size // config.num_attention_heads),
    }
    for field, (value, allowed) in unsupported.items():
        if value != allowed:
            raise ValueError(f"{source} has {field}={value!r}, which litscale's Llama does not have; "
                             f"allowed: {field}={allowed!r}")
    return LlamaConfig(
        n_layer=config.num_hidden_layers, n_head=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads, n_embd=config.hidden_size,
        ffn_hidden_size=config.intermediate_size, vocab_size=config.vocab_size,
        block_size=config.max_position_embeddings, norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        rope_scaling=rope_scaling_of_hf(config.rope_scaling, source), qk_norm=config.model_type == "qwen3",
        tie_embeddings=config.tie_word_embeddings)


def rope_scaling_of_hf(scaling: dict | None, source: str) -> RopeScaling | None:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"{source} has rope_scaling rope_type={kind!r}, which litscale's Llama does not have; "
                         "allowed: llama3 or none")
    return RopeScaling(factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                       high_freq_factor=scaling["high_freq_factor"],
                       original_max_positions=scaling["original_max_position_embeddings"])


def llama_from_hf(directory: str, *, vocab_size: int | None = None, block_size: int | None = None,
                  key: str = "model.net.from_hf") -> Llama:
    """litscale's ``Llama`` with the weights of a local transformers Llama or Qwen3 directory
    (safetensors; never downloaded), trained on ``block_size`` tokens of a ``vocab_size``
    vocabulary (the data's). On the meta device (a pre-flight check) only the config is read."""
    source = f"{key}={directory!r}"
    config = fitted_to_data(llama_config_of_hf(hf_config_of_directory(directory, key), source),
                            vocab_size, block_size, source)
    check_shape(config)
    if reading_shapes_only():
        return Llama(config)
    with torch.device("meta"):  # the loaded tensors are assigned, not copied
        net = Llama(config)
    net.load_state_dict(hf_weights(directory), strict=True, assign=True)
    if config.tie_embeddings:  # assign replaced the two names' tensors one by one
        net.lm_head.weight = net.embed_tokens.weight
    return net


def refuse_architecture_with_checkpoint(given: dict) -> None:
    """``model.net.from_hf`` brings the architecture: a number set beside it is an error, not
    silently ignored."""
    name, value = next(((n, v) for n, v in given.items() if v is not None), (None, None))
    if name is not None:
        raise ValueError(f"model.net.{name}={value} with model.net.from_hf: the checkpoint fixes the "
                         f"architecture; allowed: leave model.net.{name} unset")


def hf_config_of_directory(directory: str, key: str) -> PretrainedConfig:
    """The transformers config of a local checkpoint directory with safetensors weights."""
    checkpoint_fields(directory, key)  # a local directory, its config.json, safetensors: or one line
    return AutoConfig.from_pretrained(directory, local_files_only=True)


def hf_weights(directory: str) -> dict[str, torch.Tensor]:
    """A local transformers checkpoint's weights by litscale's names (safetensors only: a
    pickled .bin can run code when it is loaded)."""
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, use_safetensors=True,
                                                 dtype=torch.float32)
    return {name.removeprefix(BASE_PREFIX): tensor for name, tensor in model.state_dict().items()}


def reading_shapes_only() -> bool:
    """Built under ``torch.device("meta")``: the app's checks before any rank starts want the
    shapes, not gigabytes of weights."""
    return torch.get_default_device().type == "meta"


def fitted_to_data(config, vocab_size: int | None, block_size: int | None, source: str):
    """A checkpoint's config trained on the data's sequences: its vocabulary must be the data's
    (``with_vocab_size``); ``block_size`` (data.seq_len) within its positions replaces them."""
    with_vocab_size({"vocab_size": config.vocab_size}, vocab_size, source, from_checkpoint=True)
    if block_size is None:
        return config
    if block_size > config.block_size:
        raise ValueError(f"model.net.block_size={block_size} (data.seq_len) is longer than {source}'s "
                         f"max_position_embeddings={config.block_size}; allowed: at most {config.block_size}")
    return replace(config, block_size=block_size)


# --- litscale's MoE decoder <-> transformers' Qwen3-MoE ------------------------------------

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def hf_config_of_moe(config: MoEConfig) -> PretrainedConfig:
    """transformers' ``Qwen3MoeConfig``, or a one-line error naming the first option Qwen3-MoE
    does not have (its router is a softmax over the experts, with no shared experts, no
    scaling of the weights, no capacity and QK-norm always on)."""
    unsupported = {"n_shared_experts": (config.n_shared_experts, 0), "score_func": (config.score_func, "softmax"),
                   "routed_scaling": (config.routed_scaling, 1.0), "capacity_factor": (config.capacity_factor, None),
                   "qk_norm": (config.qk_norm, True), "rope_scaling": (config.rope_scaling, None)}
    for field, (value, allowed) in unsupported.items():
        if value != allowed:
            raise ValueError(f"model.net.{field}={value!r} has no Qwen3-MoE form; allowed: {field}={allowed!r}")
    return AutoConfig.for_model(
        "qwen3_moe", vocab_size=config.vocab_size, hidden_size=config.n_embd,
        intermediate_size=config.ffn_hidden_size, moe_intermediate_size=config.moe_ffn_hidden_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim, num_experts=config.n_experts, num_experts_per_tok=config.top_k,
        norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(config.n_layer) if i not in config.moe_layers],
        max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
        router_aux_loss_coef=config.aux_loss_coef, tie_word_embeddings=config.tie_embeddings,
        hidden_act="silu", attention_bias=False)


def hf_weights_of_moe(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Llama's names, each stacked expert weight unstacked into one per expert; the router's
    selection bias (not in Qwen3-MoE) must be zero, as it changes which experts are chosen."""
    weights = {}
    for name, tensor in state_dict.items():
        if name.endswith(".gate.selection_bias"):
            if torch.any(tensor != 0):
                raise ValueError(f"{name} is not zero (model.net.bias_update_rate moved it); Qwen3-MoE routes "
                                 "without a bias; allowed: a model trained with bias_update_rate=0")
            continue
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf in EXPERT_PROJECTIONS:
            weights |= {f"{BASE_PREFIX}{prefix}.{e}.{leaf}.weight": w for e, w in enumerate(tensor.unbind(0))}
        else:
            weights[name if name.startswith("lm_head.") else BASE_PREFIX + name] = tensor
    return weights


def moe_layout_of(sparse: list[int], n_layer: int, source: str = "the config") -> tuple[int, int]:
    """``(dense_layers, moe_every)`` that put the MoE layers at ``sparse``, or a one-line error.

    NOTE: the export writes ``mlp_only_layers`` (every dense layer) with ``decoder_sparse_step``
    1, so a model with ``moe_every`` > 1 comes back as a list of MoE layers, not as a step."""
    if not sparse:
        return n_layer, 1
    for every in range(1, n_layer + 1):
        dense_layers = sparse[0] - every + 1
        if dense_layers >= 0 and sparse == [i for i in range(dense_layers, n_layer)
                                            if (i - dense_layers + 1) % every == 0]:
            return dense_layers, every
    raise ValueError(f"{source} has MoE layers {sparse}; allowed: the dense layers first, then every k-th layer "
                     "a MoE layer to the last (model.net.dense_layers, model.net.moe_every)")


def moe_config_of_hf(config: PretrainedConfig, source: str = "the config") -> MoEConfig:
    """litscale's ``MoEConfig`` for a transformers Qwen3-MoE config: its MoE layers as litscale
    lays them out (the first ``dense_layers`` dense, then every ``moe_every``-th), else one line."""
    if config.model_type != "qwen3_moe":
        raise ValueError(f"{source} has model_type={config.model_type!r}; allowed: qwen3_moe")
    sparse = [i for i in range(config.num_hidden_layers)
              if i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0]
    dense_layers, moe_every = moe_layout_of(sparse, config.num_hidden_layers, source)
    head_dim = getattr(config, "head_dim", None)
    return MoEConfig(
        n_layer=config.num_hidden_layers, n_head=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
        n_embd=config.hidden_size, ffn_hidden_size=config.intermediate_size,
        attention_head_dim=None if head_dim == config.hidden_size // config.num_attention_heads else head_dim,
        vocab_size=config.vocab_size,
        block_size=config.max_position_embeddings, norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        qk_norm=True, tie_embeddings=config.tie_word_embeddings, n_experts=config.num_experts,
        top_k=config.num_experts_per_tok, moe_ffn_hidden_size=config.moe_intermediate_size, n_shared_experts=0,
        dense_layers=dense_layers, moe_every=moe_every, norm_topk_prob=config.norm_topk_prob,
        aux_loss_coef=config.router_aux_loss_coef)


def moe_from_hf(directory: str, *, vocab_size: int | None = None, block_size: int | None = None,
                key: str = "model.net.from_hf", **training: float | None) -> MoEDecoder:
    """litscale's MoE decoder with the weights of a local transformers Qwen3-MoE directory
    (safetensors; never downloaded): each layer's experts stacked. ``training``: the routing
    choices transformers does not store (``aux_loss_coef``, ``bias_update_rate``,
    ``capacity_factor``; None keeps the checkpoint's, dropless). Meta device: the config only."""
    source = f"{key}={directory!r}"
    config = fitted_to_data(moe_config_of_hf(hf_config_of_directory(directory, key), source),
                            vocab_size, block_size, source)
    config = replace(config, **{name: value for name, value in training.items() if value is not None})
    check_moe_shape(config)
    net = MoEDecoder(config)
    if reading_shapes_only():
        return net
    weights = hf_weights(directory)
    for index in config.moe_layers:
        experts = f"layers.{index}.mlp.experts"
        for leaf in EXPERT_PROJECTIONS:
            weights[f"{experts}.{leaf}"] = torch.stack(
                [weights.pop(f"{experts}.{e}.{leaf}.weight") for e in range(config.n_experts)])
        weights[f"layers.{index}.mlp.gate.selection_bias"] = torch.zeros(config.n_experts)
    net.load_state_dict(weights, strict=True)
    return net
