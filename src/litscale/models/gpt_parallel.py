"""What GPT declares about itself for model-parallel strategies, as data.

- ``TENSOR_PARALLEL_PLAN``: module-name pattern (relative to the GPT) -> tensor-parallel
  style name (Megatron-LM's split, Shoeybi et al. 2019): the query/key/value projections and
  the MLP's up projection are split column-wise (each rank holds whole heads / a slice of the
  hidden units), the attention output and MLP down projections row-wise (one all-reduce, or
  with sequence parallelism one reduce-scatter, per sub-layer), the token embedding by
  vocabulary rows, the LM head column-wise (by vocabulary). The ``norm``,
  ``sequence_input`` and ``sequence_start`` entries only act with sequence parallelism
  (Korthikanti et al. 2022): LayerNorms and dropout then run on a slice of the sequence.
  The styles are defined in ``litscale.strategies.tensor_plan.STYLES``.
- ``pipeline_blocks(net)``: the ordered units a pipeline may cut between: the embeddings,
  each transformer block, and the final norm + head. A stage keeps its units and sets the
  others to ``None`` (``GPT.forward`` skips them), so checkpoint keys stay the same.
"""

from __future__ import annotations

from torch import nn

TENSOR_PARALLEL_PLAN: dict[str, str] = {
    "wte": "embedding",
    "drop": "sequence_start",
    "blocks.*.ln_1": "norm",
    "blocks.*.attn": "sequence_input",
    "blocks.*.attn.q_proj": "colwise",
    "blocks.*.attn.k_proj": "colwise",
    "blocks.*.attn.v_proj": "colwise",
    "blocks.*.attn.out_proj": "rowwise",
    "blocks.*.ln_2": "norm",
    "blocks.*.mlp": "sequence_input",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "ln_f": "norm",
    "lm_head": "head",
}


def pipeline_blocks(net: nn.Module) -> list[list[str]]:
    """Units in forward order, each a list of submodule names of ``net``; a pipeline stage
    owns a contiguous run of units."""
    return [["wte", "wpe"], *([f"blocks.{key}"] for key in net.blocks), ["ln_f", "lm_head"]]
