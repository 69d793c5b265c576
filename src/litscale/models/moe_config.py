"""The MoE decoder's numbers: ``MoEConfig`` (Llama's plus the experts') and its presets, as
data (STYLE: presets are data). The big presets are for planning on the meta device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from litscale.models.llama import LlamaConfig

ScoreFunction = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """Llama's numbers (``ffn_hidden_size`` is the dense layers' MLP width) plus the experts'.
    ``attention_head_dim`` sets the head width apart from ``n_embd / n_head`` (Qwen3-MoE's
    128 with 2048 / 32); ``capacity_factor`` None is dropless (``moe_layer.py``)."""

    n_experts: int = 8
    top_k: int = 2
    moe_ffn_hidden_size: int = 64
    n_shared_experts: int = 0
    dense_layers: int = 0
    moe_every: int = 1
    score_func: ScoreFunction = "softmax"
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    attention_head_dim: int | None = None

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.n_embd // self.n_head

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers: after the dense ones, every ``moe_every``-th (the
        ``moe_every``-th, ``2 moe_every``-th, ...: Qwen3-MoE's ``decoder_sparse_step``)."""
        return tuple(i for i in range(self.dense_layers, self.n_layer)
                     if (i - self.dense_layers + 1) % self.moe_every == 0)


PresetName = Literal["tiny", "qwen3_30b_a3b", "deepseek_v3_like"]

PRESETS: dict[str, MoEConfig] = {
    # 2-core CPU tests: a dense first layer, then two MoE layers of 8 experts, top-2, one shared.
    "tiny": MoEConfig(n_layer=3, n_head=4, n_kv_heads=2, n_embd=64, ffn_hidden_size=192, n_experts=8, top_k=2,
                      moe_ffn_hidden_size=64, n_shared_experts=1, dense_layers=1, aux_loss_coef=0.01,
                      bias_update_rate=0.001),
    # Qwen3-30B-A3B as its config.json publishes it (30.5B parameters, 3.3B active).
    "qwen3_30b_a3b": MoEConfig(n_layer=48, n_head=32, n_kv_heads=4, n_embd=2048, ffn_hidden_size=6144,
                               attention_head_dim=128, vocab_size=151936, block_size=32768, norm_eps=1e-6,
                               rope_theta=1_000_000.0, qk_norm=True, n_experts=128, top_k=8,
                               moe_ffn_hidden_size=768, norm_topk_prob=True, aux_loss_coef=0.001),
    # DeepSeek-V3's MoE shapes with grouped-query attention (128 query heads of 128, 8 key/value
    # heads) instead of its multi-head latent attention; sigmoid scores, aux-loss-free bias
    # (rate 0.001, its paper's), routed weights x 2.5. Left out: MLA, multi-token prediction,
    # node-limited group routing, YaRN and the sequence-wise balance loss (alpha 1e-4).
    "deepseek_v3_like": MoEConfig(n_layer=61, n_head=128, n_kv_heads=8, n_embd=7168, ffn_hidden_size=18432,
                                  attention_head_dim=128, vocab_size=129280, block_size=4096, norm_eps=1e-6,
                                  n_experts=256, top_k=8, moe_ffn_hidden_size=2048, n_shared_experts=1,
                                  dense_layers=3, score_func="sigmoid", norm_topk_prob=True, routed_scaling=2.5,
                                  bias_update_rate=0.001),
}


# --- a transformers Qwen3-MoE config as litscale's (model.net.from_hf, litscale.models.hf_writing) ---


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


def moe_config_of_hf(config: Any, source: str = "the config") -> MoEConfig:
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
