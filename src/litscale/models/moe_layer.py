"""A mixture-of-experts MLP as plain single-device PyTorch: token-choice top-k routing, then
the experts computed grouped (torchtitan's and Megatron-Core's layout).

- **Routing** (``TopKRouter``, named ``gate`` as in Hugging Face's Qwen3-MoE and DeepSeek-V3):
  float32 scores over the experts, ``softmax`` or ``sigmoid``; each token picks the ``top_k``
  highest, its output the sum of theirs weighted by their scores (renormalised to sum to 1
  with ``norm_topk_prob``, then times ``routed_scaling``). A per-expert ``selection_bias``
  (a buffer: DeepSeek-V3's auxiliary-loss-free balancing) is added to the scores for the
  choice only, never to the weights; ``MoELayer.update_bias`` moves it after each optimizer
  step by ``rate * sign(mean load - load)``.
- **Capacity / drop policy**: dropless by default (``capacity_factor=None``): every token
  reaches its ``top_k`` experts, as in torchtitan and Megatron's dropless mode. With a
  ``capacity_factor`` each expert takes at most ``ceil(capacity_factor * tokens * top_k /
  n_experts)`` tokens of a forward, the earliest in the flattened ``[batch * seq]`` order
  (GShard's and Switch's position order); an overflowing assignment adds nothing, and the
  residual stream carries the token past the layer. Dropped assignments are counted.
- **Experts** (``GroupedExperts``): SwiGLU experts with their weights stacked, expert index
  first (``gate_proj``/``up_proj`` ``[n_experts, hidden, dim]``, ``down_proj`` ``[n_experts,
  dim, hidden]``: Hugging Face's per-expert ``nn.Linear`` weights stacked), so expert parallel
  shards dim 0. They take the routed rows sorted by expert with the count per expert, and one
  grouped matmul per projection computes every expert (``grouped_matmul``): ``torch._grouped_mm``,
  which in torch 2.13 runs on the CPU in float32 too (forward and backward, checked against the
  loop), so CPU tests exercise the kernel GPUs run; a matmul per expert where it does not.
- **The dispatch / combine seam**: ``MoELayer.forward`` routes, sorts the (token, expert)
  assignments by expert (``plan_dispatch``), calls ``self.experts(rows, tokens_per_expert)``
  and scatters the weighted outputs back. Expert parallel wraps that one call with an
  all-to-all of rows and counts before it and the reverse after it (torchtitan's
  ``ExpertParallel``), each rank then holding ``n_experts / ep`` of the stacked weights;
  nothing else here changes.
- **Load balancing loss** (Switch Transformer / GShard): ``n_experts * sum_i f_i * P_i``, with
  ``f_i`` the share of the forward's (token, expert) assignments routed to expert ``i`` (before
  any drop) and ``P_i`` the mean over tokens of expert ``i``'s probability (the softmax, or the
  sigmoid scores normalised to sum 1 per token, as DeepSeek-V3's balance loss). 1 when balanced.
  Times ``aux_loss_coef``, it is kept from the last training forward for the LightningModule
  to add to the loss (``MoEDecoder.auxiliary_loss``).

``moe_reference_forward`` computes the same layer expert by expert in a Python loop: what the
grouped path is tested against, not what training runs.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import flop_counter

from litscale.measure.tensor_bytes import shapes_only
from litscale.models.llama import WHOLE_SEQUENCE, SwiGLU
from litscale.models.moe_config import MoEConfig

# --- grouped matmul --------------------------------------------------------------------------


def _fused_grouped_mm_runs(x: Tensor, weight: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: rows of a multiple of 16 bytes (the
    kernels' alignment, CPU's too: a bf16 width of 12 is refused), and on CUDA only bf16 (torch
    2.13), on the CPU any float dtype in eager mode (forward and backward checked in float32 and
    bf16); its meta kernel, and so ``torch.compile``'s tracing and fake tensors, takes only bf16."""
    if any(size * x.element_size() % 16 for size in weight.shape[1:]):
        return False
    if x.dtype == torch.bfloat16:
        return True
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and not shapes_only(x)


def grouped_matmul(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """``x`` ``[rows, in]`` sorted by group, ``weight`` ``[groups, out, in]``, ``offsets`` the
    end row of each group (int32) -> ``[rows, out]``: each group's rows times its weight's
    transpose.

    ``torch._grouped_mm`` (one kernel for every group, torchtitan's path) where it runs;
    elsewhere (CUDA float32 or float16, ``torch.compile`` outside bf16, widths not aligned to
    16 bytes) a matmul per group over its contiguous slice of rows, which reads the group sizes
    on the host. Both are counted by torch's FLOP counter (see
    ``_grouped_mm_flops``). Under autocast the operands are cast as autocast casts a matmul's,
    which it does not do for this op.
    """
    if _autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    if _fused_grouped_mm_runs(x, weight):
        out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        if out.requires_grad:
            # NOTE: the CPU backward rejects a gradient with zero strides (an expanded one, as
            # from a sum); contiguous gradients are what any real loss hands back anyway.
            out.register_hook(torch.Tensor.contiguous)
        return out
    if shapes_only(x) and not torch.compiler.is_compiling():
        # NOTE: the loop below reads the group sizes, which a shape trace does not have; one
        # matmul of the same shapes saves the same tensors and counts the same FLOPs.
        return x @ weight[0].T
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([x[start:end] @ weight[group].T for group, (start, end) in enumerate(zip(starts, ends, strict=True))])


def _autocast_enabled(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """FLOPs of ``aten._grouped_mm``, which torch's FLOP counter leaves at 0 (torch 2.13): two
    per multiply-add of every group, whichever operand the groups cut. Forward ``[rows, in] x
    [groups, in, out]`` and the input gradient are ``2 rows in out``; the weight gradient
    ``[in, rows] x [rows, out]`` (groups cut the contracted rows) is the same count."""
    if len(a_shape) == 3 and len(b_shape) == 2:  # [groups, m, k] x [k, n cut by groups]
        return 2 * math.prod(a_shape[1:]) * b_shape[-1]
    return 2 * math.prod(a_shape) * b_shape[-1]


if torch.ops.aten._grouped_mm not in flop_counter.flop_registry:
    flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


# --- routing ---------------------------------------------------------------------------------


@dataclass
class Routing:
    """Each token's experts ``expert_indices`` ``[tokens, top_k]`` (best first), the weights
    their outputs are summed with ``weights`` ``[tokens, top_k]``, and every expert's
    probability ``probabilities`` ``[tokens, n_experts]`` (sums to 1 per token); float32."""

    expert_indices: Tensor
    weights: Tensor
    probabilities: Tensor


class TopKRouter(nn.Module):
    """Token-choice top-k router: a linear map to one score per expert, in float32."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.n_embd))
        # Persistent: a resumed run must choose as the saved one did (DeepSeek-V3's
        # `e_score_correction_bias`). Zero, and so inert, unless the bias is updated.
        self.register_buffer("selection_bias", torch.zeros(config.n_experts))
        self.top_k, self.score_func = config.top_k, config.score_func
        self.norm_topk_prob, self.routed_scaling = config.norm_topk_prob, config.routed_scaling

    def forward(self, x: Tensor) -> Routing:
        # NOTE: float32 whatever the training precision (torchtitan, DeepSeek-V3): a bf16
        # rounding flips the choice between close scores, and autocast would run it in bf16.
        with torch.autocast(x.device.type, enabled=False) if _autocast_enabled(x.device.type) else nullcontext():
            logits = F.linear(x.float(), self.weight.float())
        if self.score_func == "softmax":
            scores = probabilities = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
            probabilities = scores / scores.sum(dim=-1, keepdim=True)
        # The bias steers which experts are chosen, never how much their outputs weigh.
        chosen = (scores.detach() + self.selection_bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(chosen, weights * self.routed_scaling, probabilities)


@dataclass
class Dispatch:
    """The rows the experts compute: row ``r`` is assignment ``assignment[r]`` of the
    flattened ``[tokens * top_k]`` choices (token ``assignment[r] // top_k``), rows sorted by
    expert and, within an expert, by token; ``tokens_per_expert`` rows per expert (after the
    capacity), ``routed_per_expert`` assignments per expert before it (the load), ``dropped``
    the assignments the capacity turned away."""

    assignment: Tensor
    tokens_per_expert: Tensor
    routed_per_expert: Tensor
    dropped: Tensor


def plan_dispatch(expert_indices: Tensor, n_experts: int, capacity: int | None) -> Dispatch:
    """Sort the (token, expert) assignments by expert, keeping at most ``capacity`` per expert
    (the earliest tokens), all of them when ``capacity`` is None."""
    flat = expert_indices.flatten()
    # NOTE: stable, so each expert's rows stay in token order: the order the capacity keeps
    # them in, and a layout that does not depend on how the sort breaks ties.
    sorted_experts, assignment = torch.sort(flat, stable=True)
    routed = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    if capacity is None:
        return Dispatch(assignment, routed, routed, routed.new_zeros(()))
    first_row = routed.cumsum(0) - routed
    position = torch.arange(flat.numel(), device=flat.device) - first_row[sorted_experts]
    kept = routed.clamp(max=capacity)
    return Dispatch(assignment[position < capacity], kept, routed, (routed - kept).sum())


# --- experts and the layer -------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts, weights stacked with the expert index first."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, rows: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """``rows`` ``[n, dim]`` sorted by expert, ``tokens_per_expert`` ``[n_experts]`` -> each
        row through its expert, ``[n, dim]`` in the same order."""
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        gate, up, down = (_local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        hidden = F.silu(grouped_matmul(rows, gate, offsets)) * grouped_matmul(rows, up, offsets)
        return grouped_matmul(hidden, down, offsets)

    def expert(self, index: int, x: Tensor) -> Tensor:
        """Expert ``index`` alone on ``x`` (the reference loop's computation)."""
        hidden = F.silu(F.linear(x, self.gate_proj[index])) * F.linear(x, self.up_proj[index])
        return F.linear(hidden, self.down_proj[index])


class MoELayer(nn.Module):
    """Routed experts plus ``n_shared_experts`` always-on ones (DeepSeek's, one SwiGLU as wide
    as them together): ``[..., dim] -> [..., dim]``. In training mode each forward records its
    load for ``take_statistics`` and its load-balancing loss in ``aux_loss``. ``sequence``
    (``WholeSequence``) sums the experts' load over the sequence: under context parallel, over
    the ranks that hold its shares."""

    sequence = WHOLE_SEQUENCE

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.capacity_factor, self.aux_loss_coef = config.capacity_factor, config.aux_loss_coef
        self.bias_update_rate = config.bias_update_rate
        self.gate = TopKRouter(config)
        self.experts = GroupedExperts(config.n_experts, config.n_embd, config.moe_ffn_hidden_size)
        self.shared_experts = (SwiGLU(config, config.n_shared_experts * config.moe_ffn_hidden_size)
                               if config.n_shared_experts else None)
        self.aux_loss: Tensor | None = None  # coefficient x balance loss of the last training forward
        self._load: Tensor | None = None  # assignments per expert, then dropped ones, since taken
        self._balance: Tensor | None = None
        self._forwards = 0

    def capacity(self, tokens: int) -> int | None:
        """Rows each expert takes in a forward of ``tokens`` tokens; None: dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)

    def forward(self, x: Tensor) -> Tensor:
        if _is_dtensor(x):
            return self._forward_replicated(x)
        flat = x.reshape(-1, x.shape[-1])
        routing = self.gate(flat)
        dispatch = plan_dispatch(routing.expert_indices, self.n_experts, self.capacity(len(flat)))
        token = dispatch.assignment // self.top_k
        # The seam: expert parallel moves these rows to the experts' ranks and back.
        expert_out = self.experts(flat[token], dispatch.tokens_per_expert)
        weights = routing.weights.flatten()[dispatch.assignment, None].to(expert_out.dtype)
        out = flat.new_zeros(flat.shape, dtype=expert_out.dtype).index_add_(0, token, expert_out * weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.training:
            self._record(routing, dispatch)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _forward_replicated(self, x: Tensor) -> Tensor:
        """Under sequence-parallel tensor parallel, whose plan leaves the experts whole for now
        (the input then arrives as a DTensor): every rank runs the layer on the whole gathered
        sequence, so the experts' gradients are the same on each rank and need no reduction,
        and hands back its own slice of the sequence as a plain tensor, as the dense layers'
        row-wise down projection does (``moe_parallel.py``)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh, replicated = x.device_mesh, [Replicate()]
        out = self.forward(x.redistribute(mesh, replicated).to_local())
        return DTensor.from_local(out, mesh, replicated, run_check=False).redistribute(mesh, [Shard(1)]).to_local()

    def _record(self, routing: Routing, dispatch: Dispatch) -> None:
        load = dispatch.routed_per_expert
        # f_i: each expert's share of the whole sequence's assignments. Under context parallel,
        # with this rank's P_i, the mean over the ranks of their losses (the gradient mean) is
        # the whole sequence's loss: f_i P_i is not linear in the tokens, f_i alone is constant.
        whole = self.sequence.sum_over_sequence(load)
        share = whole.float() / whole.sum()
        balance = self.n_experts * (share * routing.probabilities.mean(dim=0)).sum()
        self.aux_loss = self.aux_loss_coef * balance if self.aux_loss_coef else None
        counts = torch.cat([load, dispatch.dropped[None]]).detach()
        self._load = counts if self._load is None else self._load + counts
        self._balance = balance.detach() if self._balance is None else self._balance + balance.detach()
        self._forwards += 1

    def counted_load(self) -> Tensor | None:
        """The counts ``take_statistics`` will hand back (assignments per expert, then dropped
        ones), not reset: replica groups (``litscale.reliability.replica_groups``) sum them over the groups
        in place before the step's bias update reads them."""
        return self._load

    def take_statistics(self) -> tuple[Tensor, Tensor] | None:
        """``(assignments per expert then dropped ones [n_experts + 1], mean balance loss)`` of
        the training forwards since the last call (None if none), on the device, and reset."""
        if self._load is None:
            return None
        taken = (self._load, self._balance / self._forwards)
        self._load, self._balance, self._forwards = None, None, 0
        return taken

    @torch.no_grad()
    def update_bias(self, load: Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: raise the selection bias of experts
        loaded below the mean by ``bias_update_rate``, lower it above (``load`` ``[n_experts]``,
        summed over the data-parallel ranks so that every rank moves it alike)."""
        if self.bias_update_rate:
            load = load.float()
            self.gate.selection_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))


def _local(weight: Tensor) -> Tensor:
    """A weight as this rank holds it: under expert parallel a DTensor sharded by expert, whose
    local experts are the ones the rows sent here belong to (``strategies/expert_parallel.py``)."""
    return weight.to_local() if _is_dtensor(weight) else weight


def _is_dtensor(x: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def moe_reference_forward(layer: MoELayer, x: Tensor) -> Tensor:
    """``layer`` computed expert by expert in a Python loop: each expert on the tokens that chose
    it (the first ``capacity`` of them in token order), weighted, summed; the shared experts
    added. The definition the grouped path is tested against; records no statistics."""
    flat = x.reshape(-1, x.shape[-1])
    routing = layer.gate(flat)
    capacity = layer.capacity(len(flat))
    out = torch.zeros_like(flat)
    for expert in range(layer.n_experts):
        token, slot = (routing.expert_indices == expert).nonzero(as_tuple=True)  # token order
        if capacity is not None:
            token, slot = token[:capacity], slot[:capacity]
        out = out.index_add(0, token, layer.experts.expert(expert, flat[token]) * routing.weights[token, slot, None])
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(flat)
    return out.view(x.shape)
