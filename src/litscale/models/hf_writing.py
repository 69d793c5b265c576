"""Hugging Face directories out of litscale's LLMs, and litscale's Llama out of one.

``save_hf_directory(net, state_dict, directory)`` writes ``config.json`` and
``model.safetensors`` (transformers' ``save_pretrained``), which
``AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)`` opens. The state
dict is the full one of ``net``, as ``litscale.checkpoint.export.consolidated_state_dict`` gathers it
from any strategy. A ``model=hf`` network is a transformers model already (its keys are
transformers'); litscale's ``Llama`` has the modules of transformers' ``LlamaForCausalLM``
(``Qwen3ForCausalLM`` with QK-norm) less their ``model.`` prefix and the same RoPE layout
(``models/llama.py``), so its conversion is a mapping of config numbers and that prefix,
both ways: ``llama_from_hf(directory)`` loads such a directory into litscale's ``Llama``.
litscale's MoE decoder is transformers' ``Qwen3MoeForCausalLM`` with each layer's experts
stacked (``mlp.experts.gate_proj`` ``[n_experts, hidden, dim]`` is its ``mlp.experts.<e>.
gate_proj.weight`` for every ``e``): ``moe_from_hf`` and the export stack and unstack them.

transformers is an optional extra (``pip install 'litscale[hf]'``); importing this module
imports it (``litscale.checkpoint.export`` does so only when asked for a Hugging Face directory).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from litscale.models.hf import HFCausalLM
from litscale.models.hf_reading import BASE_PREFIX
from litscale.models.llama import Llama, LlamaConfig
from litscale.models.moe import EXPERT_PROJECTIONS, MoEConfig, MoEDecoder


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


# --- litscale's MoE decoder <-> transformers' Qwen3-MoE ------------------------------------



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


