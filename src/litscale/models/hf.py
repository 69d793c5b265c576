"""Hugging Face ``transformers`` causal LMs as zoo networks (``model=hf``), built offline.

A model is built from a transformers config, randomly initialised (seeded by the run), or
loaded from a local checkpoint directory (safetensors weights). Nothing is downloaded: a
checkpoint is opened with ``local_files_only=True``, and a name that is not a local path is
an error, never a hub id.

``HFCausalLM`` makes the transformers model look like the rest of the zoo: ``forward(tokens)
-> logits`` (causal, no KV cache), and the model-parallel declarations, derived from the
model's own data (``hf_parallel.py``). Its children are the transformers model's, so its
``state_dict`` keys are the transformers checkpoint's (``model.layers.0.mlp.up_proj.weight``):
``litscale.models.hf_writing`` writes them out as they are.

transformers is an optional extra (``pip install 'litscale[hf]'``); only this module and
``litscale.models.hf_writing`` import it, and nothing imports them unless ``model=hf`` or a Hugging
Face export is asked for.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from litscale.arguments import checked_arguments
from litscale.constraints import PositiveInt
from litscale.extras import TRANSFORMERS
from litscale.models.hf_parallel import (
    LAYER_BY_LAYER_FAMILIES,
    pipeline_blocks,
    tensor_parallel_plan,
    tensor_parallel_sizes,
)
from litscale.user_paths import user_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# NOTE: transformers is imported in the functions that use it: its configs take 0.7 s, and its
# model classes pull in transformers.generation, and with it scikit-learn and pandas (1.5 s
# more), which importing this module (a config's target, a test module's collection) does not need.

# With neither model.net.config nor model.net.path: a Qwen3 as small as Llama's `tiny` preset
# (a few hundred thousand parameters), for 2-core CPU runs and tests.
TINY_CONFIG: dict[str, Any] = {
    "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
}
EXAMPLE_TYPES = "llama, mistral, qwen2, qwen3, gpt2"
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class HFModelConfig:
    """Which transformers causal LM to build, as hashable data (a test caches and pickles it,
    as it does ``GPTConfig``): the transformers config as JSON text (``model_type`` and the
    fields it sets), the sequence length trained on, and optionally a local checkpoint
    directory whose weights are loaded into that architecture."""

    transformers_json: str
    block_size: int = 128
    checkpoint: str | None = None

    @classmethod
    def of(cls, model_type: str, *, block_size: int = 128, checkpoint: str | None = None,
           **fields: Any) -> HFModelConfig:
        """``HFModelConfig.of("qwen3", hidden_size=64, ...)``: fields as transformers names them."""
        return cls(json.dumps({"model_type": model_type, **fields}, sort_keys=True), block_size, checkpoint)

    def transformers_config(self) -> PretrainedConfig:
        from transformers import AutoConfig

        fields = json.loads(self.transformers_json)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)

    @property
    def model_type(self) -> str:
        return json.loads(self.transformers_json)["model_type"]

    @property
    def vocab_size(self) -> int:
        return self.transformers_config().vocab_size


def load_transformers_model(config: HFModelConfig) -> PreTrainedModel:
    """The transformers model: its checkpoint's weights, or random ones from the torch seed.
    On the meta device (a pre-flight check wants shapes only) the weights are not read."""
    from transformers import AutoModelForCausalLM

    transformers_config = config.transformers_config()
    if config.checkpoint is None or torch.get_default_device().type == "meta":
        return AutoModelForCausalLM.from_config(transformers_config)
    # NOTE: safetensors only: a pickled .bin checkpoint can run code when it is loaded.
    return AutoModelForCausalLM.from_pretrained(config.checkpoint, config=transformers_config,
                                                local_files_only=True, use_safetensors=True,
                                                dtype=torch.float32)


class HFCausalLM(nn.Module):
    """A transformers causal LM as a zoo network: token ids ``[B, T]`` -> logits ``[B, T, vocab]``
    (or, on a pipeline stage, hidden states in or out, as ``Llama``)."""

    # Model-parallel declarations, derived from the transformers model (see hf_parallel.py).
    tensor_parallel_plan = tensor_parallel_plan
    tensor_parallel_sizes = tensor_parallel_sizes
    pipeline_blocks = pipeline_blocks
    # forward takes ``positions`` of packed rows and keeps attention inside each document.
    attends_within_documents = True

    def __init__(self, config: HFModelConfig) -> None:
        super().__init__()
        self.config = config
        model = load_transformers_model(config)
        for name, child in model.named_children():
            self.add_module(name, child)
        # NOTE: kept outside the module tree, so parameter names have no extra prefix; it
        # shares every child with this module, and its own forward serves the families
        # outside LAYER_BY_LAYER_FAMILIES.
        object.__setattr__(self, "transformers_model", model)
        self.runs_layer_by_layer = model.config.model_type in LAYER_BY_LAYER_FAMILIES

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` ``[batch, seq]`` of packed rows: transformers' own position ids, from
        which its masks keep attention inside each document (a run of consecutive positions)."""
        if self.runs_layer_by_layer:
            return self._forward_by_layer(tokens, positions)
        return self.transformers_model(input_ids=tokens, position_ids=positions, use_cache=False).logits

    def _forward_by_layer(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The Llama family's own forward (transformers' ``LlamaModel.forward`` without the
        cache), written out unit by unit so that a pipeline stage skips the units it does not
        own (``None``): token ids (or hidden states) -> logits (or hidden states)."""
        base = self.model
        x = tokens if base.embed_tokens is None else base.embed_tokens(tokens)
        positions = torch.arange(x.shape[1], device=x.device)
        if position_ids is None:
            position_ids = positions[None]
        kinds = [attention_type(layer, base.config) for layer in base.layers]
        masks = attention_masks(base.config, x, positions, set(kinds), position_ids)
        rotary = base.rotary_emb(x, position_ids)
        for layer, kind in zip(base.layers, kinds, strict=True):
            x = layer(x, attention_mask=masks[kind], position_ids=position_ids, cache_position=positions,
                      position_embeddings=rotary)
        if base.norm is not None:
            x = base.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x

    def sharding_units(self) -> list[nn.Module]:
        """The submodules FSDP gathers and frees one at a time: the decoder layers, which
        transformers names as the modules never to split (``_no_split_modules``)."""
        kinds = set(self.transformers_model._no_split_modules or ())
        return [module for module in self.modules() if type(module).__name__ in kinds]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() counts a tied one once

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, counted as for ``Llama``: 6 per weight of every matrix a
        layer multiplies by (embedding tables are lookups; a tied output layer multiplies, so it
        counts) plus attention's 12 x layers x heads x head_dim x T. Counts the layers held.
        (Also what spares the throughput callback counting FLOPs on the meta device, where
        transformers' rotary embedding cannot run.)"""
        matrices = sum(p.numel() for module in self.modules() if not isinstance(module, nn.Embedding)
                       for p in module.parameters(recurse=False) if p.dim() >= 2)
        config = self.transformers_model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention = 12 * len(self.sharding_units()) * config.num_attention_heads * head_dim * seq_len
        return 6 * matrices + attention


def attention_type(layer: nn.Module, config: PretrainedConfig) -> str:
    """Which mask a decoder layer takes, as each family decides: per layer (Qwen2, Qwen3), for
    every layer by the config's window (Mistral), or causal (Llama)."""
    if hasattr(layer, "attention_type"):
        return layer.attention_type
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def attention_masks(config: PretrainedConfig, hidden: torch.Tensor, positions: torch.Tensor,
                    kinds: set[str], position_ids: torch.Tensor | None = None) -> dict:
    """transformers' own mask of each attention type in ``kinds``, for a batch without padding
    (``None`` where the attention kernel applies causality itself); with ``position_ids`` of
    packed rows, transformers adds each document's block to it."""
    position_ids = positions[None] if position_ids is None else position_ids
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    return {kind: builders[kind](config=config, input_embeds=hidden, attention_mask=None,
                                 cache_position=positions, past_key_values=None, position_ids=position_ids)
            for kind in kinds}


# --- the factory ---------------------------------------------------------------------------


@checked_arguments("model.net")
def build_hf(
    *,
    config: str | dict[str, Any] | None = None,
    path: str | None = None,
    vocab_size: PositiveInt | None = None,
    block_size: PositiveInt | None = None,
) -> HFCausalLM:
    """A transformers causal LM, never downloaded: from ``config`` (a mapping with
    ``model_type`` and config fields, or a local ``config.json`` / directory holding one),
    randomly initialised; or from ``path``, a local checkpoint directory (safetensors), with
    its weights. Neither: a tiny Qwen3 (``TINY_CONFIG``). ``vocab_size`` (the data's) fills a
    config that does not fix it and must equal one that does; ``block_size`` is the sequence
    length trained on."""
    if config is not None and path is not None:
        raise ValueError(f"model.net.config and model.net.path={path!r} are both set; allowed: one of them "
                         "(a checkpoint brings its own config)")
    path = user_path(path) if path is not None else None
    config = user_path(config) if isinstance(config, str) else config
    if path is not None:
        fields, source = checkpoint_fields(path), f"model.net.path={path!r}"
        _config_class(fields.get("model_type"), f"{source}: model_type")
    elif isinstance(config, str):
        fields, source = config_file_fields(config), f"model.net.config={config!r}"
    else:
        fields, source = checked_fields(config if config is not None else TINY_CONFIG), "model.net.config"
    fields = with_vocab_size(fields, vocab_size, source, from_checkpoint=path is not None)
    spec = HFModelConfig(json.dumps(fields, sort_keys=True), block_size=block_size or 128, checkpoint=path)
    check_causal_lm(spec, source)
    return HFCausalLM(spec)


def checkpoint_fields(path: str, key: str = "model.net.path") -> dict[str, Any]:
    """The config fields of a local checkpoint directory that holds safetensors weights (``key``:
    the config key that named it, for the error)."""
    if not os.path.isdir(path):
        raise ValueError(f"{key}={path!r} is not a local directory; allowed: a local Hugging Face "
                         "checkpoint directory (config.json and safetensors weights); models are never downloaded")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{key}={path!r} has no config.json; allowed: a directory written by "
                         "save_pretrained (config.json and model.safetensors)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in SAFETENSORS_FILES):
        raise ValueError(f"{key}={path!r} holds no safetensors weights "
                         f"({' or '.join(SAFETENSORS_FILES)}); allowed: a safetensors checkpoint (pickled .bin "
                         "weights are never loaded)")
    return _read_json(os.path.join(path, "config.json"), f"{key}={path!r}")


def config_file_fields(config: str) -> dict[str, Any]:
    """The fields of a local config.json, given as the file or the directory holding it."""
    file = os.path.join(config, "config.json") if os.path.isdir(config) else config
    if not os.path.isfile(file):
        raise ValueError(f"model.net.config={config!r} is not a local config.json or a directory holding one; "
                         "allowed: a local path, or a mapping with model_type; models are never downloaded")
    return checked_fields(_read_json(file, f"model.net.config={config!r}"))


def _read_json(file: str, source: str) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as handle:
            fields = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{source}: {file} is not a readable JSON config ({error})".splitlines()[0]) from None
    if not isinstance(fields, dict):
        raise ValueError(f"{source}: {file} is not a JSON object; allowed: a transformers config.json")
    return fields


def checked_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A config given as fields: a ``model_type`` transformers knows, and only its fields (a
    misspelt field would silently keep its default, e.g. a 4096-wide model)."""
    model_type = fields.get("model_type")
    if model_type is None:
        raise ValueError(f"model.net.config has no model_type; allowed: a mapping with model_type "
                         f"(e.g. {EXAMPLE_TYPES}) and that model's config fields")
    config_class = _config_class(model_type, "model.net.config.model_type")
    # attn_implementation is read by the config's constructor but not written back by to_dict.
    known = set(config_class().to_dict()) | set(config_class.attribute_map) | {"attn_implementation"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"model.net.config.{unknown[0]} is not a field of {config_class.__name__}; "
                         f"allowed: {', '.join(sorted(known))}")
    return dict(fields)


def _config_class(model_type: Any, key: str) -> type[PretrainedConfig]:
    # NOTE: the first use of transformers in a build, after the checks of model.net.path and
    # model.net.config that need none: a bad path is named as such with or without the extra.
    if TRANSFORMERS.missing():
        raise ValueError(TRANSFORMERS.refusal("model=hf"))
    import transformers
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        # Also what a config for remote code (auto_map) gets: such code is never fetched or run.
        raise ValueError(f"{key}={model_type!r} is not a model type transformers {transformers.__version__} "
                         f"knows; allowed: e.g. {EXAMPLE_TYPES}")
    return CONFIG_MAPPING[model_type]


def with_vocab_size(fields: dict[str, Any], vocab_size: int | None, source: str, *,
                    from_checkpoint: bool) -> dict[str, Any]:
    """``fields`` with the data's vocabulary where they give none; a different one is an error,
    not a silent resize (a smaller one cannot embed every token, a larger one trains rows that
    no token uses)."""
    given = fields.get("vocab_size")
    if vocab_size is None or given == vocab_size:
        return fields
    if given is None:
        return {**fields, "vocab_size": vocab_size}
    if from_checkpoint:
        raise ValueError(f"{source} has vocab_size={given} but data.vocab_size={vocab_size}; allowed: "
                         f"data.vocab_size={given}, the checkpoint's")
    raise ValueError(f"{source} sets vocab_size={given} but data.vocab_size={vocab_size}; allowed: {vocab_size} "
                     "(or leave vocab_size out: it follows data.vocab_size)")


def check_causal_lm(spec: HFModelConfig, source: str) -> None:
    """transformers has a causal LM for the config, and its positions cover the sequence."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if spec.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{source} has model_type={spec.model_type!r}, which has no causal language model in "
                         f"transformers; allowed: a decoder, e.g. {EXAMPLE_TYPES}")
    positions = getattr(spec.transformers_config(), "max_position_embeddings", None)
    if isinstance(positions, int) and spec.block_size > positions:
        raise ValueError(f"model.net.block_size={spec.block_size} (data.seq_len) is longer than {source}'s "
                         f"max_position_embeddings={positions}; allowed: at most {positions}")
