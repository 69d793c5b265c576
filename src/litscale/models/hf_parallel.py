"""What a transformers causal LM (``HFCausalLM``, ``hf.py``) declares for model-parallel
strategies, derived from the transformers model's own data rather than written per family.

- ``tensor_parallel_plan(net)``: the model's ``base_model_tp_plan`` (transformers' style
  names, under its base-model prefix ``model.``) translated to litscale's (``TRANSLATIONS``;
  the styles are ``litscale.strategies.tensor_plan.STYLES``), plus what litscale's own
  Llama plan has (``llama_parallel.py``) and transformers' leaves out: the token embedding
  split by vocabulary rows, the output layer as ``head`` (transformers' ``colwise_rep``; loss
  parallel may keep its logits split), and per-head QK-norms (Qwen3) as ``head_norm``, whose
  gains' gradients are summed over the ranks (each rank normalises its own heads). The
  attention counts its heads from each projection's output width (``view(..., -1,
  head_dim)``), so a column-wise split runs unchanged. No sequence parallelism: a
  transformers decoder layer hands its attention the input by keyword, which litscale's
  ``sequence_input`` style (it gathers a positional input) never sees; with no
  ``sequence_start`` entry, litscale runs the plan as plain tensor parallel.
- ``pipeline_blocks(net)``: the base model's pieces in the order of its
  ``base_model_pp_plan`` (token embedding, each decoder layer, final norm), the output layer
  with the last. Only for ``LAYER_BY_LAYER_FAMILIES``, whose forward ``HFCausalLM`` writes
  out unit by unit (their layers take hidden states and rotary position embeddings), so a
  stage skips the units set to ``None`` and checkpoint keys stay the same.
"""

from __future__ import annotations

from torch import nn

LAYER_BY_LAYER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# transformers' tensor-parallel style -> litscale's, where the two split the same way.
TRANSLATIONS: dict[str, str] = {"colwise": "colwise", "rowwise": "rowwise", "sequence_parallel": "norm"}
OUTPUT_LAYER_STYLE = "colwise_rep"  # column-wise, logits gathered: litscale's `head`


# The transformers config fields a tensor-parallel split divides: the heads (query and
# key/value: q/k/v split by heads), the MLP's hidden features, the vocabulary (the embedding).
TENSOR_PARALLEL_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def tensor_parallel_sizes(net: nn.Module) -> dict[str, int]:
    """Each field of ``TENSOR_PARALLEL_FIELDS`` the config has, under the key a user sets it by
    (``model.net.config.<field>``). NOTE: found by the combination test: the default Qwen3's 2
    key/value heads at TP 4 were accepted and its attention failed in the first forward."""
    config = net.transformers_model.config
    return {f"model.net.config.{field}": value for field in TENSOR_PARALLEL_FIELDS
            if isinstance(value := getattr(config, field, None), int)}


def tensor_parallel_plan(net: nn.Module) -> dict[str, str] | None:
    """Module-name pattern (relative to ``net``) -> litscale style, or ``None`` for a model
    with no ``base_model_tp_plan`` (GPT-2): litscale then asks for ``strategy.plan``."""
    model = net.transformers_model
    if not model.config.base_model_tp_plan:
        return None
    output = _name_in(net, model.get_output_embeddings())
    plan = {_name_in(net, model.get_input_embeddings()): "embedding"}
    plan |= {f"{model.base_model_prefix}.{pattern}": translated(model, pattern, style)
             for pattern, style in model.config.base_model_tp_plan.items()}
    plan |= qk_norm_plan(net)
    for pattern, style in (type(model)._tp_plan or {}).items():  # the causal LM's own: its output layer
        if not (pattern == output and style == OUTPUT_LAYER_STYLE):
            plan[pattern] = translated(model, pattern, style)
    plan[output] = "head"
    return plan


def translated(model: nn.Module, pattern: str, style: str) -> str:
    if style not in TRANSLATIONS:
        raise ValueError(
            f"model.net: {model.config.model_type}'s tensor-parallel plan gives {pattern} the Hugging Face style "
            f"{style!r}, which litscale does not translate; allowed: {', '.join(TRANSLATIONS)} "
            f"({OUTPUT_LAYER_STYLE} on the output layer), or a plan of litscale styles in strategy.plan")
    return TRANSLATIONS[style]


def qk_norm_plan(net: nn.Module) -> dict[str, str]:
    """``head_norm`` for each per-head query/key norm. One over all heads' features at once
    (OLMo2's) would see only this rank's heads under a column-wise split: an error."""
    head_dim = getattr(net.transformers_model.config, "head_dim", None)
    plan = {}
    for name, module in net.named_modules():
        if name.rpartition(".")[2] not in ("q_norm", "k_norm"):
            continue
        width = module.weight.shape[-1]
        if width != head_dim:
            raise ValueError(f"model.net: {name} normalises {width} features, not one head's {head_dim}; "
                             "allowed under tensor parallel: per-head query/key norms (as Qwen3's)")
        plan[".".join("*" if part.isdigit() else part for part in name.split("."))] = "head_norm"
    return plan


def pipeline_blocks(net: nn.Module) -> list[list[str]]:
    """Units in forward order, each a list of submodule names of ``net``; a pipeline stage
    owns a contiguous run of units."""
    model = net.transformers_model
    if model.config.model_type not in LAYER_BY_LAYER_FAMILIES:
        raise ValueError(f"strategy=pipeline needs a model litscale runs layer by layer, but model.net has "
                         f"model_type={model.config.model_type!r}; allowed: {', '.join(LAYER_BY_LAYER_FAMILIES)}")
    prefix = model.base_model_prefix
    base = net.get_submodule(prefix)
    units: list[list[str]] = []
    for name in model.config.base_model_pp_plan:  # transformers' own order of the pieces
        piece = base.get_submodule(name)
        if isinstance(piece, nn.ModuleList):
            units += [[f"{prefix}.{name}.{index}"] for index in piece._modules]
        else:
            units.append([f"{prefix}.{name}"])
    units[-1].append(_name_in(net, model.get_output_embeddings()))
    return units


def _name_in(net: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in net.named_modules() if candidate is module)
