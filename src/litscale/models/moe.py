"""A mixture-of-experts decoder (Qwen3-MoE, DeepSeek-V3, Mixtral style) as plain
single-device PyTorch.

Llama's decoder (``llama.py``: RMSNorm, RoPE, grouped-query attention with optional QK-norm)
whose MLP is a mixture of experts (``moe_layer.py``: token-choice top-k routing, shared
experts, experts computed grouped) in every ``moe_every``-th layer after the first
``dense_layers`` dense ones, which keep a SwiGLU of ``ffn_hidden_size`` (DeepSeek-V3's first
3). Module names follow Hugging Face's Qwen3-MoE and DeepSeek-V3 (``layers.<i>.mlp.gate``,
``mlp.shared_experts``), the experts' weights stacked (``mlp.experts.gate_proj`` is
``[n_experts, hidden, dim]``: their per-expert ``nn.Linear`` weights along dim 0).

Training needs two things beside the forward, both wired by litscale's configs: the
LightningModule adds ``auxiliary_loss()`` (the load-balancing loss of the last training
forward) to the loss, and ``litscale.callbacks.moe.MoEStatsCallback`` reads the router's
counts after each optimizer step, sums them over the ranks and applies
``update_expert_bias`` (auxiliary-loss-free balancing); a loop of one's own calls the same.

Parallelism is declared beside it (``moe_parallel.py``) as for Llama; its numbers and presets
are in ``moe_config.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from litscale.arguments import checked_arguments
from litscale.constraints import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from litscale.models.hf_reading import refuse_architecture_with_checkpoint
from litscale.models.llama import Llama
from litscale.models.moe_config import (
    PRESETS,
    MoEConfig,
    PresetName,
    ScoreFunction,
    moe_config_of_hf,
)
from litscale.models.moe_layer import MoELayer
from litscale.models.moe_parallel import expert_modules, pipeline_blocks, tensor_parallel_plan

__all__ = ["PRESETS", "MoEConfig", "MoEDecoder", "PresetName", "RouterStatistics", "build_moe"]


@dataclass
class RouterStatistics:
    """What the routers saw since the last take, one row per MoE layer of the config (rows of
    layers this rank does not hold, on a pipeline stage, are zero): ``load`` ``[layers,
    n_experts + 1]`` assignments per expert then dropped ones, ``balance`` ``[layers]`` mean
    load-balancing loss (1 when balanced). On the device; ``load`` is summed over ranks as is."""

    load: Tensor
    balance: Tensor


class MoEDecoder(Llama):
    """Decoder-only MoE transformer: token ids ``[B, T]`` -> logits ``[B, T, vocab]``. Llama's
    decoder (its embedding, layers, norm, head, init and forward) with experts as the MLP of
    the layers ``config.moe_layers`` names."""

    # Model-parallel declarations (see moe_parallel.py); strategies read them.
    tensor_parallel_plan = tensor_parallel_plan
    pipeline_blocks = pipeline_blocks
    expert_modules = expert_modules
    # Llama's init (GPT-2's): the experts' down projections write into the residual stream too.
    residual_writers = (*Llama.residual_writers, "experts.down_proj")

    def mlp_for_layer(self, index: int) -> nn.Module | None:
        return MoELayer(self.config) if index in self.config.moe_layers else None

    @staticmethod
    def check_config(config: MoEConfig) -> None:
        check_shape(config)

    def moe_layers(self) -> dict[int, MoELayer]:
        """The MoE layers this module holds, by layer index."""
        return {int(key): layer.mlp for key, layer in self.layers.items() if isinstance(layer.mlp, MoELayer)}

    # --- training hooks: loss, statistics, bias -----------------------------------------------

    def auxiliary_loss(self) -> Tensor | None:
        """The load-balancing loss of the last training forward, summed over the MoE layers and
        times ``aux_loss_coef`` (Switch Transformer adds it at every layer), to add to the
        training loss; None when off. Taken: a second call returns None."""
        losses = [layer.aux_loss for layer in self.moe_layers().values() if layer.aux_loss is not None]
        for layer in self.moe_layers().values():
            layer.aux_loss = None
        return torch.stack(losses).sum() if losses else None

    def take_router_statistics(self) -> RouterStatistics | None:
        """The routers' counts since the last take (training forwards only), and reset them;
        None if no held MoE layer ran."""
        rows = {index: row for row, index in enumerate(self.config.moe_layers)}
        taken = {index: layer.take_statistics() for index, layer in self.moe_layers().items()}
        taken = {index: value for index, value in taken.items() if value is not None}
        if not taken:
            return None
        some_load = next(iter(taken.values()))[0]
        load = some_load.new_zeros(len(rows), self.config.n_experts + 1)
        balance = torch.zeros(len(rows), device=some_load.device)
        for index, (layer_load, layer_balance) in taken.items():
            load[rows[index]], balance[rows[index]] = layer_load, layer_balance
        return RouterStatistics(load=load, balance=balance)

    def update_expert_bias(self, load: Tensor) -> None:
        """Apply each held MoE layer's bias update from ``load`` ``[config MoE layers,
        n_experts (+ 1)]`` (``RouterStatistics.load`` summed over the data-parallel ranks)."""
        rows = {index: row for row, index in enumerate(self.config.moe_layers)}
        for index, layer in self.moe_layers().items():
            layer.update_bias(load[rows[index], : self.config.n_experts])

    # --- sizes ----------------------------------------------------------------------------------

    def num_active_params(self) -> int:
        """Parameters a token uses: all but the routed experts it does not choose (embedding
        and head included, as Qwen3-30B-A3B's 3.3B "activated" counts them)."""
        c = self.config
        unchosen = (c.n_experts - c.top_k) * 3 * c.n_embd * c.moe_ffn_hidden_size
        return self.num_params() - len(self.moe_layers()) * unchosen

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as torch's FLOP counter counts them (``llama.py``'s rule):
        6 per weight a token multiplies (attention, dense MLPs, router, its ``top_k`` routed
        experts, shared experts, head; the embedding is a lookup) plus attention's two
        ``T x T`` matmuls, 12 x ``n_head x head_dim x T`` per layer. Exact when dropless,
        whatever the routing; an upper bound with a capacity. Counts the layers held."""
        c = self.config
        linear_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        per_moe_layer = c.n_embd * c.n_experts + c.top_k * 3 * c.n_embd * c.moe_ffn_hidden_size
        weights = linear_weights + len(self.moe_layers()) * per_moe_layer
        return 6 * weights + 12 * len(self.layers) * c.n_head * c.head_dim * seq_len


def check_shape(config: MoEConfig) -> None:
    """Query heads group over key/value heads, RoPE rotates pairs, experts and layers fit."""
    checks = [
        (config.n_head % config.n_kv_heads == 0, f"model.net.n_kv_heads={config.n_kv_heads} must divide "
                                                   f"n_head={config.n_head}"),
        (config.attention_head_dim is not None or config.n_embd % config.n_head == 0,
         f"model.net.n_embd={config.n_embd} must be divisible by n_head={config.n_head}"),
        (config.head_dim % 2 == 0, f"model.net head_dim={config.head_dim} must be even: RoPE rotates pairs"),
        (config.top_k <= config.n_experts, f"model.net.top_k={config.top_k} must be at most "
                                           f"n_experts={config.n_experts}"),
        (config.dense_layers <= config.n_layer, f"model.net.dense_layers={config.dense_layers} must be at "
                                                f"most n_layer={config.n_layer}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


@checked_arguments("model.net")
def build_moe(
    *,
    preset: PresetName = "tiny",
    vocab_size: PositiveInt | None = None,
    block_size: PositiveInt | None = None,
    n_layer: PositiveInt | None = None,
    n_head: PositiveInt | None = None,
    n_kv_heads: PositiveInt | None = None,
    n_embd: PositiveInt | None = None,
    ffn_hidden_size: PositiveInt | None = None,
    attention_head_dim: PositiveInt | None = None,
    norm_eps: PositiveFloat | None = None,
    rope_theta: PositiveFloat | None = None,
    n_experts: PositiveInt | None = None,
    top_k: PositiveInt | None = None,
    moe_ffn_hidden_size: PositiveInt | None = None,
    n_shared_experts: NonNegativeInt | None = None,
    dense_layers: NonNegativeInt | None = None,
    moe_every: PositiveInt | None = None,
    score_func: ScoreFunction | None = None,
    norm_topk_prob: bool | None = None,
    routed_scaling: PositiveFloat | None = None,
    aux_loss_coef: NonNegativeFloat | None = None,
    bias_update_rate: NonNegativeFloat | None = None,
    capacity_factor: PositiveFloat | None = None,
    qk_norm: bool | None = None,
    tie_embeddings: bool | None = None,
    from_hf: str | None = None,
) -> MoEDecoder:
    """An MoE decoder from a named preset, with any number overridden (``None`` keeps the
    preset's; the presets are dropless, so ``capacity_factor`` None is dropless). ``from_hf``:
    a local transformers Qwen3-MoE directory instead, its architecture and weights (to
    fine-tune); the routing choices it does not store (balance loss, bias update, capacity) apply."""
    architecture = dict(n_layer=n_layer, n_head=n_head, n_kv_heads=n_kv_heads, n_embd=n_embd,
                        ffn_hidden_size=ffn_hidden_size, attention_head_dim=attention_head_dim, norm_eps=norm_eps,
                        rope_theta=rope_theta, n_experts=n_experts, top_k=top_k,
                        moe_ffn_hidden_size=moe_ffn_hidden_size, n_shared_experts=n_shared_experts,
                        dense_layers=dense_layers, moe_every=moe_every, score_func=score_func,
                        norm_topk_prob=norm_topk_prob, routed_scaling=routed_scaling, qk_norm=qk_norm,
                        tie_embeddings=tie_embeddings)
    training = dict(aux_loss_coef=aux_loss_coef, bias_update_rate=bias_update_rate, capacity_factor=capacity_factor)
    if from_hf is not None:
        refuse_architecture_with_checkpoint(architecture)
        return moe_from_hf(from_hf, vocab_size=vocab_size, block_size=block_size, **training)
    overrides = dict(architecture, **training, vocab_size=vocab_size, block_size=block_size)
    config = replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    check_shape(config)
    return MoEDecoder(config)


def moe_from_hf(directory: str, *, vocab_size: int | None = None, block_size: int | None = None,
                key: str = "model.net.from_hf", **training: float | None) -> MoEDecoder:
    """litscale's MoE decoder with the weights of a local transformers Qwen3-MoE directory
    (safetensors; never downloaded): each layer's experts stacked. ``training``: the routing
    choices transformers does not store (``aux_loss_coef``, ``bias_update_rate``,
    ``capacity_factor``; None keeps the checkpoint's, dropless). Meta device: the config only."""
    from litscale.models.hf_reading import checkpoint_config, hf_weights, reading_shapes_only

    config = checkpoint_config(directory, moe_config_of_hf, vocab_size, block_size, key)
    config = replace(config, **{name: value for name, value in training.items() if value is not None})
    check_shape(config)
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


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # transformers' names, one Linear per expert
