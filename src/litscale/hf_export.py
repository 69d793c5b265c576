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

transformers is an optional extra (``pip install 'litscale[hf]'``); importing this module
imports it (``litscale.export`` does so only when asked for a Hugging Face directory).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from litscale.models.hf import HFCausalLM
from litscale.models.llama import Llama, LlamaConfig, RopeScaling, check_shape

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
    if isinstance(net, Llama):
        return hf_config_of_llama(net.config)
    raise ValueError(f"{type(net).__name__} has no Hugging Face form; allowed: model=llama or model=hf")


def hf_weights_of(net: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def llama_from_hf(directory: str) -> Llama:
    """litscale's ``Llama`` with the weights of a local transformers Llama or Qwen3 directory
    (safetensors; never downloaded)."""
    source = f"{directory!r}"
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"{source} is not a local Hugging Face directory (no config.json); allowed: a "
                         "directory written by save_pretrained; models are never downloaded")
    config = llama_config_of_hf(AutoConfig.from_pretrained(directory, local_files_only=True), source)
    check_shape(config)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, use_safetensors=True,
                                                 dtype=torch.float32)
    with torch.device("meta"):  # the loaded tensors are assigned, not copied
        net = Llama(config)
    weights = {name.removeprefix(BASE_PREFIX): tensor for name, tensor in model.state_dict().items()}
    net.load_state_dict(weights, strict=True, assign=True)
    if config.tie_embeddings:  # assign replaced the two names' tensors one by one
        net.lm_head.weight = net.embed_tokens.weight
    return net
