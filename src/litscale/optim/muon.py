"""Muon (Jordan et al. 2024): orthogonalised momentum for the hidden matrices, AdamW for the rest,
under every strategy that hands the optimizer whole tensors or DTensor shards of them.

Per hidden matrix ``W`` with gradient ``G``, as ``torch.optim.Muon`` steps it (with
``ns_dtype=bfloat16`` and ``adjust_lr=original``, one process matches it exactly)::

    B = mu B + (1 - mu) G          U = G + mu (B - G)  (Nesterov; else U = B)
    O = NewtonSchulz5(U)           (5 quintic steps: U V^T of U's SVD, roughly; in float32 by
                                   default, bfloat16 as the reference and torch run it with
                                   ns_dtype=bfloat16, faster on a GPU)
    W = W (1 - lr wd) - lr s O     s = 0.2 sqrt(max(rows, cols)) ("match_rms_adamw", default:
                                   the update's RMS is AdamW's, so one lr serves both groups)
                                   or sqrt(max(1, rows / cols)) ("original")

Which tensors are hidden matrices is read from the model, not from per-model code in the
optimizer (``parameter_roles``): 2-D weights of any module but the embeddings and the declared
output layers, and each expert's matrix of a declared grouped-experts module (3-D, orthogonalised
per expert). Embeddings, output layers, biases, norm gains and convolutions take AdamW steps, as
the reference implementation does.

**Sharded matrices** (FSDP2, tensor parallel, expert parallel: DTensors): the orthogonalisation
needs the whole matrix. Each rank all-gathers the update of every sharded matrix
(``full_tensor``), orthogonalises it and keeps its own shard. Chosen over an owner per matrix
(gather to one rank, orthogonalise, scatter back) because it needs no schedule of owners and
gives every rank bit-identical results by construction; its cost is that every rank computes
every matrix's iteration (``world`` times the FLOPs of one process) and gathers every matrix
(the all-gather FSDP already does for the forward, once more per step). ZeRO (DeepSpeed) hands
its optimizer flat partitions with no matrix in them: at stages 1-2 DeepSpeed's own ZeRO Muon
steps it (``litscale.strategies.zero_muon``), at stage 3 it is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

from litscale.constraints import Fraction, NonNegativeFloat, PositiveFloat, PositiveInt
from litscale.optim.parameter_steps import ParameterwiseOptimizer, check_betas, whole_tensor
from litscale.parallel.declarations import declared, find_expert_modules

# A param group's role, in the groups ``parameter_roles`` builds: Muon steps "matrix" groups.
MATRIX, OTHER = "matrix", "other"
AdjustLR = Literal["match_rms_adamw", "original"]


def _unwrapped(optimizer: object) -> object:
    """The optimizer class inside a factory of one (a ``functools.partial``, the LR-scaling
    rule's wrapper)."""
    while (inner := getattr(optimizer, "original", None) or getattr(optimizer, "func", None)) is not None:
        optimizer = inner
    return optimizer


def wants_parameter_roles(optimizer: object) -> bool:
    """The optimizer (a class, or a factory of one) treats hidden matrices apart from embeddings
    and output layers: it is built from ``parameter_roles``' groups."""
    return bool(getattr(_unwrapped(optimizer), "wants_parameter_roles", False))


def adapts_each_tensor(optimizer: object) -> bool:
    """The optimizer (a class, or a factory of one) scales each weight tensor's step by that
    tensor's own norms (LARS's and LAMB's trust ratio): it must be handed whole tensors, or their
    DTensor shards, whose norms DTensor reduces, never a flat partition of several."""
    return bool(getattr(_unwrapped(optimizer), "adapts_each_tensor", False))


def parameter_roles(net: nn.Module, weight_decay: float) -> list[dict]:
    """Param groups for an optimizer that treats hidden matrices apart: the matrices (decayed),
    the other decayed tensors (embeddings, output layers) and the undecayed ones (biases, norm
    gains), each with its ``role``."""
    apart = {id(p) for m in net.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    apart |= {id(p) for m in output_layers(net) for p in m.parameters()}
    experts = {id(p) for m in find_expert_modules(net) for p in m.parameters() if p.dim() == 3}
    params = list({id(p): p for p in net.parameters() if p.requires_grad}.values())
    is_matrix = {id(p) for p in params if id(p) not in apart and (p.dim() == 2 or id(p) in experts)}
    matrices = [p for p in params if id(p) in is_matrix]
    others = [p for p in params if id(p) not in is_matrix]
    return [
        {"params": matrices, "weight_decay": weight_decay, "role": MATRIX},
        {"params": [p for p in others if p.dim() >= 2], "weight_decay": weight_decay, "role": OTHER},
        {"params": [p for p in others if p.dim() < 2], "weight_decay": 0.0, "role": OTHER},
    ]


def state_bytes_per_param(groups: list[dict]) -> float:
    """fp32 bytes of state per parameter over ``groups`` (``parameter_roles``' or an optimizer's):
    one momentum buffer for a matrix (4), AdamW's two moments for the rest (8)."""
    counts = [(sum(p.numel() for p in group["params"]), 4 if group.get("role") == MATRIX else 8) for group in groups]
    total = sum(count for count, _ in counts)
    return sum(count * size for count, size in counts) / total if total else 0.0


def newton_schulz_flops(shapes: Iterable[torch.Size], steps: int = 5) -> float:
    """Floating-point operations of ``newton_schulz`` over matrices of these ``shapes`` (a
    stacked expert weight: each of its matrices): per iteration on an ``m x n`` matrix
    (``m <= n``, the short side first), ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X``
    (2 m^2 n), the multiply-adds counted twice as ``torch.utils.flop_counter`` counts them."""
    total = 0.0
    for shape in shapes:
        *stack, rows, cols = shape
        short, long = min(rows, cols), max(rows, cols)
        total += math.prod(stack) * steps * (4 * short * short * long + 2 * short ** 3)
    return total


def output_layers(net: nn.Module) -> list[nn.Module]:
    """The layers that produce the model's output: declared (``output_layers``, names), else a
    transformers model's output embeddings, else none."""
    found = declared(net, "output_layers")
    if found:
        owner, names = found
        # A pipeline stage without the output layer holds None under its name.
        return [layer for name in names if isinstance(layer := _attribute_path(owner, name), nn.Module)]
    for owner in (net, getattr(net, "net", None)):
        getter = getattr(owner, "get_output_embeddings", None)
        layer = getter() if callable(getter) else None
        if layer is not None:
            return [layer]
    return []


def _attribute_path(owner: nn.Module, name: str) -> object:
    for part in name.split("."):
        owner = getattr(owner, part, None)
    return owner


# Keller Jordan's quintic coefficients and the norm's floor (torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NSDtype = Literal["float32", "bfloat16"]


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalised update: ``steps`` quintic Newton-Schulz iterations in ``dtype``, the
    iteration of ``torch.optim.Muon`` (which is fixed to bfloat16 and to 2-D: written here for
    float32, whose result one process and a sharded layout agree on to fp32 rounding, and for
    stacked experts, each matrix on its own)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:  # torch.optim.Muon's operations, so its bfloat16 rounding is matched too
        x = x / x.norm().clamp(min=NS_EPS)  # spectral norm at most 1
        multiply_add = torch.addmm
    else:  # stacked experts: each matrix normalised on its own
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        multiply_add = torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = multiply_add(x, multiply_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``param``: this rank's shard of a DTensor, cut locally."""
    if not hasattr(param, "device_mesh"):
        return whole
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank holds the same whole tensor and keeps its own slice.
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


class Muon(ParameterwiseOptimizer):
    """Muon for the ``matrix`` param groups, AdamW for the others (see the module docstring).
    Built from ``parameter_roles``' groups (``wants_parameter_roles``); a group without a role
    is taken as ``other``."""

    wants_parameter_roles = True

    def __init__(
        self,
        params: Iterable,
        *,
        lr: PositiveFloat,
        momentum: Fraction = 0.95,
        nesterov: bool = True,
        ns_steps: PositiveInt = 5,
        ns_dtype: NSDtype = "float32",
        adjust_lr: AdjustLR = "match_rms_adamw",
        betas: tuple[Fraction, Fraction] = (0.9, 0.95),
        eps: PositiveFloat = 1.0e-8,
        weight_decay: NonNegativeFloat = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                                  "ns_dtype": ns_dtype, "adjust_lr": adjust_lr, "betas": check_betas(betas), "eps": eps,
                                  "weight_decay": weight_decay, "role": OTHER})
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        rank_zero_info(f"litscale: {self.describe()}")

    def describe(self) -> str:
        """The split a run starts with: what Muon steps and what AdamW does."""
        counts = {role: [0, 0] for role in (MATRIX, OTHER)}
        for group in self.param_groups:
            counts[group["role"]][0] += len(group["params"])
            counts[group["role"]][1] += sum(p.numel() for p in group["params"])
        (matrices, matrix_numel), (others, other_numel) = counts[MATRIX], counts[OTHER]
        return (f"optimizer muon: {matrices} matrices ({matrix_numel:,} parameters) orthogonalised in "
                f"{self.defaults['ns_dtype']} | AdamW for {others} tensors ({other_numel:,}: embeddings, output "
                "layers, biases, norms)")

    def state_bytes_per_param(self) -> float:
        """fp32 bytes of state per parameter, the mean over every group (``state_bytes_per_param``)."""
        return state_bytes_per_param(self.param_groups)

    def _update(self, param: torch.Tensor, group: dict) -> None:
        (self._muon if group["role"] == MATRIX else self._adamw)(param, group)

    def _muon(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        buffer, grad = state["momentum_buffer"], param.grad
        buffer.lerp_(grad, 1 - group["momentum"])
        update = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
        orthogonal = newton_schulz(whole_tensor(update), group["ns_steps"], getattr(torch, group["ns_dtype"]))
        rows, cols = param.shape[-2:]
        scale = (0.2 * math.sqrt(max(rows, cols)) if group["adjust_lr"] == "match_rms_adamw"
                 else math.sqrt(max(1.0, rows / cols)))
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(_like(orthogonal.to(param.dtype), param), alpha=-group["lr"] * scale)

    def _adamw(self, param: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[param]
        if not state:
            state["step"] = 0  # a number, not a tensor: no host sync per parameter to read it
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"]
        exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], param.grad
        param.mul_(1 - group["lr"] * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
        param.addcdiv_(exp_avg, denominator, value=-group["lr"] / (1 - beta1**step))
