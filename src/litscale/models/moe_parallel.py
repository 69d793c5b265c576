"""What the MoE decoder declares about itself for model-parallel strategies, as data.

- ``tensor_parallel_plan(net)``: Llama's plan (``llama_parallel.py``) for the attention, the
  norms, the embedding and head, and the dense layers' SwiGLU (named layer by layer). The MoE
  layers' router, routed and shared experts are left whole by tensor parallel for now: each
  rank runs the layer on the whole sequence (``MoELayer._forward_replicated`` under sequence
  parallel), computing the same expert gradients, at the cost of repeating the layer on every
  tensor-parallel rank. Splitting the experts belongs to expert parallel.
- ``pipeline_blocks(net)``: Llama's: the embedding, each decoder layer, the final norm + head.
- ``expert_modules(net)``: the modules holding stacked expert weights, expert index first,
  which expert parallel shards along dim 0; it wraps each one's forward (rows sorted by
  expert, rows per expert) with an all-to-all of rows and counts before it and the reverse
  after it, the seam ``MoELayer.forward`` leaves for it (``strategies/expert_parallel.py``).

The training loss under a pipeline: the schedule calls the LightningModule's ``loss_fn`` on
the last stage only, so the load-balancing loss of MoE layers (``auxiliary_loss``) is not
added there; the auxiliary-loss-free bias still balances the experts.
"""

from __future__ import annotations

from torch import nn

from litscale.models.llama_parallel import QK_NORM_PLAN, TENSOR_PARALLEL_PLAN
from litscale.models.llama_parallel import pipeline_blocks as llama_pipeline_blocks

DENSE_MLP_PLAN = {pattern: style for pattern, style in TENSOR_PARALLEL_PLAN.items()
                  if pattern.startswith("layers.*.mlp.")}
# Llama's plan but for the dense MLP's projections: attention, norms, embedding, head.
NON_MLP_PLAN = {pattern: style for pattern, style in TENSOR_PARALLEL_PLAN.items() if pattern not in DENSE_MLP_PLAN}


def tensor_parallel_plan(net: nn.Module) -> dict[str, str]:
    """Attention entries, QK-norm's with QK-norm, and the dense MLP's named per dense layer:
    every pattern of a plan must match a module, and torch warns for each layer a wildcard
    misses (the MoE layers have no ``mlp.gate_proj``)."""
    config = net.config
    dense = [i for i in range(config.n_layer) if i not in config.moe_layers]
    dense_mlps = {pattern.replace("layers.*.", f"layers.{i}."): style
                  for i in dense for pattern, style in DENSE_MLP_PLAN.items()}
    return {**NON_MLP_PLAN, **dense_mlps, **(QK_NORM_PLAN if config.qk_norm else {})}


def pipeline_blocks(net: nn.Module) -> list[list[str]]:
    return llama_pipeline_blocks(net)


def expert_modules(net: nn.Module) -> list[str]:
    """Names (relative to ``net``) of the grouped-experts modules it holds."""
    return [f"layers.{index}.mlp.experts" for index in net.moe_layers()]
