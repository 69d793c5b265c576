"""What Llama declares about itself for model-parallel strategies, as data.

- ``TENSOR_PARALLEL_PLAN``: module-name pattern (relative to the Llama) -> tensor-parallel
  style name, Megatron-LM's split as for GPT (``gpt_parallel.py``): the query/key/value
  projections and the MLP's gate and up projections column-wise (each rank holds whole query
  and key/value heads, with grouped-query attention the same share of each, and a slice of
  the hidden units), the attention output and MLP down projections row-wise, the token
  embedding by vocabulary rows, the LM head column-wise (by vocabulary; loss parallel keeps
  its logits split). ``norm``, ``sequence_input`` and ``sequence_start`` only act with
  sequence parallelism: the RMSNorms then run on a slice of the sequence.
- ``QK_NORM_PLAN``: added when the model normalises queries and keys (Qwen3). Those norms
  act on each head's features, which tensor parallel never splits, so their forward needs
  nothing; but each rank sees only its own heads, so each computes a part of the gain's
  gradient, and ``head_norm`` makes the gain a replicated tensor whose gradient is summed
  over the ranks.
- ``pipeline_blocks(net)``: the ordered units a pipeline may cut between: the token
  embedding, each decoder layer, and the final norm + LM head. A stage keeps its units and
  sets the others to ``None`` (``Llama.forward`` skips them), so checkpoint keys stay the same.
- ``context_parallel_attention(net)``: the modules where tokens meet (each layer's
  attention): a context-parallel strategy sets their ``sequence`` to its rank's shard; every
  other module works token by token and runs on the shard as it is.

The styles are defined in ``litscale.strategies.tensor_plan.STYLES``.
"""

from __future__ import annotations

from torch import nn

TENSOR_PARALLEL_PLAN: dict[str, str] = {
    "embed_tokens": "embedding",
    # The residual stream begins at the first layer's input, the embedding's output; a later
    # pipeline stage receives it already cut, so only layer 0 slices the sequence.
    "layers.0": "sequence_start",
    "layers.*.input_layernorm": "norm",
    "layers.*.self_attn": "sequence_input",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.post_attention_layernorm": "norm",
    "layers.*.mlp": "sequence_input",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "norm": "norm",
    "lm_head": "head",
}

QK_NORM_PLAN: dict[str, str] = {
    "layers.*.self_attn.q_norm": "head_norm",
    "layers.*.self_attn.k_norm": "head_norm",
}


def tensor_parallel_plan(net: nn.Module) -> dict[str, str]:
    """The plan for this network: QK-norm entries only where those norms exist (every
    pattern of a plan must match a module)."""
    return {**TENSOR_PARALLEL_PLAN, **(QK_NORM_PLAN if net.config.qk_norm else {})}


def pipeline_blocks(net: nn.Module) -> list[list[str]]:
    """Units in forward order, each a list of submodule names of ``net``; a pipeline stage
    owns a contiguous run of units."""
    return [["embed_tokens"], *([f"layers.{key}"] for key in net.layers), ["norm", "lm_head"]]


def context_parallel_attention(net: nn.Module) -> list[nn.Module]:
    """Each decoder layer's attention (held by this pipeline stage)."""
    return [layer.self_attn for layer in net.layers.values()]
