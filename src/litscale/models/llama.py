"""A Llama-3 / Qwen3-style decoder as plain single-device PyTorch.

Pre-norm decoder layers with RMSNorm, rotary position embeddings (RoPE, Su et al. 2021, with
Llama 3.1's long-context frequency scaling as an option), grouped-query attention (Ainslie
et al. 2023: ``n_kv_heads`` key/value heads shared by groups of query heads), a SwiGLU MLP
(Shazeer 2020) and, optionally, Qwen3's QK-norm (an RMSNorm over each query and key head
before RoPE). No biases, no dropout. Module names are those of Hugging Face's Llama and Qwen3
(``embed_tokens``, ``layers.<i>.self_attn.q_proj``, ``mlp.gate_proj``, ``norm``, ``lm_head``)
less their ``model.`` prefix, and RoPE pairs feature ``i`` with feature ``i + head_dim / 2``
(their ``rotate_half`` layout), so their checkpoints' tensors correspond by name.

Parallelism is not written here, as for GPT (``gpt.py``): the strategies read what the model
declares (``llama_parallel.py``). Layers live in a ``ModuleDict`` keyed by index and every
top-level piece may be ``None`` (pipeline stages); the attention counts its heads from the
projections' output width (tensor parallel); RoPE's tables are computed in the attention,
so every pipeline stage has them, nothing is stored in checkpoints, and a meta-device model
(for planning and memory figures) needs no materialising of buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from litscale.arguments import checked_arguments
from litscale.constraints import PositiveFloat, PositiveInt
from litscale.models.documents import Documents
from litscale.models.hf_reading import refuse_architecture_with_checkpoint
from litscale.models.llama_parallel import (
    context_parallel_attention,
    pipeline_blocks,
    tensor_parallel_plan,
)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Meta's ``apply_scaling``, Hugging Face's
    ``rope_type="llama3"``): wavelengths shorter than ``original_max_positions /
    high_freq_factor`` are kept, those longer than ``original_max_positions / low_freq_factor``
    are stretched by ``factor``, and the band between is interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


RopeScalingName = Literal["llama3.1"]
ROPE_SCALINGS: dict[str, RopeScaling] = {
    "llama3.1": RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=8192),
}


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture numbers; a preset is a named instance of this (STYLE: presets are data).
    ``block_size`` is the sequence length trained on (RoPE has no position table: longer
    inputs run)."""

    n_layer: int
    n_head: int
    n_kv_heads: int
    n_embd: int
    ffn_hidden_size: int
    vocab_size: int = 256
    block_size: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PresetName = Literal["tiny", "small", "llama3_1b", "llama3_8b", "qwen3_8b"]

PRESETS: dict[str, LlamaConfig] = {
    # A few hundred thousand parameters, for 2-core CPU tests.
    "tiny": LlamaConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=128, ffn_hidden_size=384),
    "small": LlamaConfig(n_layer=12, n_head=12, n_kv_heads=4, n_embd=768, ffn_hidden_size=2048,
                         vocab_size=32000, block_size=1024, tie_embeddings=True),
    # Meta's Llama-3.2-1B (1.24 B parameters, tied embeddings): the size of one-GPU throughput runs.
    "llama3_1b": LlamaConfig(n_layer=16, n_head=32, n_kv_heads=8, n_embd=2048, ffn_hidden_size=8192,
                             vocab_size=128256, block_size=8192, rope_theta=500_000.0, tie_embeddings=True),
    # Meta's Llama-3-8B (Llama-3.1-8B is this with rope_scaling="llama3.1").
    "llama3_8b": LlamaConfig(n_layer=32, n_head=32, n_kv_heads=8, n_embd=4096, ffn_hidden_size=14336,
                             vocab_size=128256, block_size=8192, rope_theta=500_000.0),
    # Qwen3-8B: the same attention shape, with QK-norm.
    "qwen3_8b": LlamaConfig(n_layer=36, n_head=32, n_kv_heads=8, n_embd=4096, ffn_hidden_size=12288,
                            vocab_size=151936, block_size=32768, norm_eps=1e-6, rope_theta=1_000_000.0,
                            qk_norm=True),
}


# --- rotary position embeddings --------------------------------------------------------------


def rope_frequencies(config: LlamaConfig, device: torch.device | None = None) -> torch.Tensor:
    """Rotation per position, in radians, of each of a head's ``head_dim / 2`` feature pairs:
    ``theta ** (-2i / head_dim)``, rescaled by ``config.rope_scaling`` if set (float32)."""
    exponents = torch.arange(0, config.head_dim, 2, device=device, dtype=torch.float32) / config.head_dim
    frequencies = 1.0 / config.rope_theta**exponents
    scaling = config.rope_scaling
    if scaling is None:
        return frequencies
    wavelengths = 2 * math.pi / frequencies
    # 0 at the long-wavelength edge of the band (fully stretched), 1 at its short edge (kept).
    smooth = ((scaling.original_max_positions / wavelengths - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    return (1 - smooth) * frequencies / scaling.factor + smooth * frequencies


def rope_tables(config: LlamaConfig, seq_len: int, device: torch.device, *,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the angles at positions ``0 .. seq_len - 1`` (or at ``positions``: a
    context-parallel rank's, or ``[batch, seq_len]`` of packed rows), each ``[..., seq_len,
    head_dim / 2]`` (float32)."""
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    angles = positions.to(device, torch.float32)[..., None] * rope_frequencies(config, device)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, head_dim]``: feature ``i`` of the first half and
    feature ``i`` of the second half form one pair (complex number), turned by its angle
    (``cos``, ``sin``: ``[seq, head_dim / 2]``, or ``[batch, seq, head_dim / 2]`` for packed rows)."""
    first, second = x.float().chunk(2, dim=-1)  # in float32, as Meta's reference does
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # the same angles for every head
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1).type_as(x)


# --- the layers ----------------------------------------------------------------------------


class WholeSequence:
    """The sequence as one device holds it: tokens at positions ``0 .. T-1``, each attending to
    itself and those before it. A context-parallel strategy gives each attention its own
    (``litscale.strategies.context_parallel.SequenceShard``: a rank's share of the sequence,
    attention over the whole of it); the model code stays single-device."""

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        return torch.arange(length, device=device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Documents | None = None) -> torch.Tensor:
        """Causal attention on ``[batch, heads, seq, head_dim]`` (fewer key/value heads: GQA),
        within each document of packed rows (``documents``)."""
        if documents is not None:
            return documents.attend(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def sum_over_sequence(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-token counts of the whole sequence: here, this device's."""
        return counts


WHOLE_SEQUENCE = WholeSequence()


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE and optional QK-norm. ``sequence`` says
    which positions the input holds and attends over them (``WholeSequence``)."""

    sequence = WHOLE_SEQUENCE

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d, head_dim = config.n_embd, config.head_dim
        self.config = config
        self.q_proj = nn.Linear(d, config.n_head * head_dim, bias=False)
        self.k_proj = nn.Linear(d, config.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, config.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * head_dim, d, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=config.norm_eps) if config.qk_norm else None
        # On the scores' 1/sqrt(head_dim); µP sets it (litscale.optim.mup), a plain run leaves it at 1.
        self.score_multiplier = 1.0

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # NOTE: heads are counted from each projection's output width, not from the config,
        # so a tensor-parallel shard holding n_head / tp query and n_kv_heads / tp key/value
        # heads runs unchanged (and keeps their ratio, which SDPA's GQA needs).
        q, k, v = (proj(x).view(batch, seq, -1, self.config.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = documents.positions if documents is not None else self.sequence.positions(seq, x.device)
        cos, sin = rope_tables(self.config, seq, x.device, positions=positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.score_multiplier != 1.0:
            q = q * self.score_multiplier
        y = self.sequence.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, ``hidden_size`` units wide (the config's
    ``ffn_hidden_size`` unless given: a mixture of experts sizes its shared experts apart)."""

    def __init__(self, config: LlamaConfig, hidden_size: int | None = None) -> None:
        super().__init__()
        hidden_size = hidden_size or config.ffn_hidden_size
        self.gate_proj = nn.Linear(config.n_embd, hidden_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, hidden_size, bias=False)
        self.down_proj = nn.Linear(hidden_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention, then pre-norm MLP (a SwiGLU unless ``mlp`` is given: a mixture of
    experts, ``moe.py``), each added to the residual stream."""

    def __init__(self, config: LlamaConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(config)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), documents=documents)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Decoder-only transformer: token ids ``[B, T]`` -> logits ``[B, T, vocab]``."""

    # Model-parallel declarations (see llama_parallel.py); strategies read them.
    tensor_parallel_plan = tensor_parallel_plan
    pipeline_blocks = pipeline_blocks
    context_parallel_attention = context_parallel_attention
    output_layers = ("lm_head",)  # the layer an optimizer of matrices (Muon) leaves to AdamW
    output_multiplier = 1.0  # on the logits; µP sets it (litscale.optim.mup)
    # forward takes ``positions`` of packed rows and keeps attention inside each document.
    attends_within_documents = True

    # Parameters that write into the residual stream (their init is scaled by 1/sqrt(2 n_layer)).
    residual_writers: tuple[str, ...] = ("o_proj.weight", "down_proj.weight")

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, mlp=self.mlp_for_layer(i))
                                     for i in range(config.n_layer)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        # GPT-2's init, as for GPT: N(0, 0.02), the projections that write into the residual
        # stream scaled by 1/sqrt(2 * n_layer); the norms' gains (the only vectors) at 1.
        for name, param in self.named_parameters():
            if param.dim() < 2:
                nn.init.ones_(param)
            elif name.endswith(self.residual_writers):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(param, std=0.02)

    def mlp_for_layer(self, index: int) -> nn.Module | None:
        """Layer ``index``'s MLP; None is the SwiGLU (the MoE decoder puts experts in some)."""
        return None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (or, on a later pipeline stage, hidden states) -> logits (or hidden states).
        ``positions`` ``[batch, seq]``: each token's position in its document, for packed rows
        (``litscale.models.documents``); None: one causal sequence per row."""
        x = tokens
        if self.embed_tokens is not None:
            x = self.embed_tokens(tokens)
        documents = Documents(positions) if positions is not None else None
        for layer in self.layers.values():
            x = layer(x, documents=documents)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
            if self.output_multiplier != 1.0:
                x = x * self.output_multiplier
        return x

    # µP's declarations (litscale.optim.mup): the width, and this model at another width.
    def mup_width(self) -> int:
        return self.config.n_embd

    def at_width(self, width: int) -> Llama:
        config = replace(self.config, n_embd=width)
        self.check_config(config)
        return type(self)(config)

    @staticmethod
    def check_config(config: LlamaConfig) -> None:
        check_shape(config)

    def sharding_units(self) -> list[nn.Module]:
        """The submodules a sharded strategy (FSDP) gathers and frees one at a time: the
        decoder layers. Embedding, final norm and head stay with the root."""
        return list(self.layers.values())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() counts a tied one once

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, as torch's FLOP counter counts them:
        6 per weight of every linear layer (2 forward, 4 backward for the input and weight
        gradients; the embedding is a lookup) plus attention's two ``T x T`` matmuls, 12 x
        ``n_head x head_dim x T`` per layer (counted whole, as for GPT: PaLM appendix B).
        Key/value heads shared by GQA change only the first term. Counts the layers held."""
        linear_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        attention = 12 * len(self.layers) * self.config.n_head * self.config.head_dim * seq_len
        return 6 * linear_weights + attention


def check_shape(config: LlamaConfig) -> None:
    """Heads tile the width, query heads group evenly over key/value heads, RoPE rotates pairs."""
    if config.n_embd % config.n_head:
        raise ValueError(f"model.net.n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
    if config.n_head % config.n_kv_heads:
        raise ValueError(f"model.net.n_kv_heads={config.n_kv_heads} must divide n_head={config.n_head}")
    if config.head_dim % 2:
        raise ValueError(f"model.net.n_embd / n_head = {config.head_dim} must be even: RoPE rotates "
                         "pairs of features")


@checked_arguments("model.net")
def build_llama(
    *,
    preset: PresetName = "tiny",
    vocab_size: PositiveInt | None = None,
    block_size: PositiveInt | None = None,
    n_layer: PositiveInt | None = None,
    n_head: PositiveInt | None = None,
    n_kv_heads: PositiveInt | None = None,
    n_embd: PositiveInt | None = None,
    ffn_hidden_size: PositiveInt | None = None,
    norm_eps: PositiveFloat | None = None,
    rope_theta: PositiveFloat | None = None,
    rope_scaling: RopeScalingName | None = None,
    qk_norm: bool | None = None,
    tie_embeddings: bool | None = None,
    from_hf: str | None = None,
) -> Llama:
    """A Llama from a named preset, with any architecture number overridden (``None`` keeps
    the preset's); ``rope_scaling`` names one of ``ROPE_SCALINGS``. ``from_hf``: a local
    transformers Llama or Qwen3 directory instead, its architecture and weights (to fine-tune)."""
    architecture = dict(n_layer=n_layer, n_head=n_head, n_kv_heads=n_kv_heads, n_embd=n_embd,
                        ffn_hidden_size=ffn_hidden_size, norm_eps=norm_eps, rope_theta=rope_theta,
                        rope_scaling=rope_scaling, qk_norm=qk_norm, tie_embeddings=tie_embeddings)
    if from_hf is not None:
        refuse_architecture_with_checkpoint(architecture)
        return llama_from_hf(from_hf, vocab_size=vocab_size, block_size=block_size)
    overrides = dict(architecture, vocab_size=vocab_size, block_size=block_size,
                     rope_scaling=ROPE_SCALINGS[rope_scaling] if rope_scaling else None)
    config = replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    check_shape(config)
    return Llama(config)


# --- a transformers Llama / Qwen3 config as litscale's (model.net.from_hf, litscale.models.hf_writing) ---


def llama_config_of_hf(config: Any, source: str = "the config") -> LlamaConfig:
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
    from litscale.models.hf_reading import checkpoint_config, hf_weights, reading_shapes_only

    config = checkpoint_config(directory, llama_config_of_hf, vocab_size, block_size, key)
    check_shape(config)
    if reading_shapes_only():
        return Llama(config)
    with torch.device("meta"):  # the loaded tensors are assigned, not copied
        net = Llama(config)
    net.load_state_dict(hf_weights(directory), strict=True, assign=True)
    if config.tie_embeddings:  # assign replaced the two names' tensors one by one
        net.lm_head.weight = net.embed_tokens.weight
    return net
