"""µP (maximal update parametrization, Yang et al. 2021, "Tensor Programs V"): hyper-parameters
tuned on a narrow model transfer to a wide one, because every layer's update moves its output
by the same amount at every width.

The rule compares each parameter's shape with its shape in the *base* model: the same model
built at ``base_width`` (``at_width``, on the meta device: no memory), as the ``mup`` package
does with its base shapes. A dimension that differs is a width dimension; its ratio is the
width multiplier ``m`` of that fan. From the two fans' ratios alone (no per-model code here):

================  ===========================  ==========  ================  ================
role              fans that grow               init std    AdamW lr          Muon lr (match_rms
                                                                             / original)
================  ===========================  ==========  ================  ================
input             out only (embeddings)        x1          x1                (AdamW)
vector            none (biases, norm gains)    x1          x1                (AdamW)
hidden            in and out                   x1/sqrt(m)  x1/m              x1/sqrt(m) / x1
readout           in only (a router)           x1/m        x1/m              x1/m / x1/sqrt(m)
output (declared) in only (the LM head)        x1          x1                (AdamW)
================  ===========================  ==========  ================  ================

Weight decay transfers as the ``mup`` package's ``MuAdamW`` makes it transfer: a group whose LR
is multiplied by ``k`` has its ``weight_decay`` divided by ``k``, so that the decoupled decay of
a step (AdamW's and Muon's ``p -= lr x weight_decay x p``) is the base width's at every width.
``MuAdamW`` (``decoupled_wd=False``, its default) divides the LR of its matrix-like parameters
by the width multiplier and multiplies their weight decay by it; here the same holds for every
multiplier (the readouts', Muon's), since each one scales the decay's step with the LR.

The declared output layer keeps its init and LR and the model multiplies its logits by
``1/m`` instead (``output_multiplier``, the ``mup`` package's ``MuReadout``): the same
function, and a tied embedding then needs nothing of its own, as input and output agree.
Attention scores are scaled by ``1/head_dim`` instead of ``1/sqrt(head_dim)``: each attention
module's ``score_multiplier`` is ``sqrt(base head_dim / head_dim)``. AdamW's steps are about
``lr`` per element whatever the gradient, so a matrix of ``m`` times the fan-in moves its
output ``m`` times as far: hence ``1/m``. Muon's orthogonal step is rescaled from the spectral
condition (Yang, Simon and Bernstein 2023: the update's spectral norm ``~ sqrt(fan_out /
fan_in)``), divided by what its own ``adjust_lr`` scale already grows by. At ``base_width``
every multiplier is 1: the µP model *is* the standard one, so an LR tuned there carries over.

A model declares ``mup_width`` (its width) and ``at_width(width)`` (itself at another width:
the same heads, layers and every other number), an ``output_multiplier`` its forward applies
to the logits, ``output_layers``, and a ``score_multiplier`` (with ``head_dim``) on each
attention module; ``models/gpt.py`` and ``models/llama.py`` do. The optimizer gets plain
``torch.optim`` param groups, one per multiplier, each with its ``lr``, ``weight_decay`` and
``lr_multiplier``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from litscale.optim.muon import MATRIX, output_layers, parameter_roles
from litscale.parallel.declarations import declared

# The optimizers the rule has multipliers for (Adam's per-element steps, Muon's orthogonal ones).
ADAM_FAMILY = ("torch.optim.AdamW", "torch.optim.Adam")
MUON = "litscale.optim.muon.Muon"
SUPPORTED_OPTIMIZERS = (*ADAM_FAMILY, MUON)


@dataclass(frozen=True)
class ParameterWidth:
    """One parameter's fans against the base model's, and what µP multiplies for it."""

    role: str  # input | vector | hidden | readout | output
    fan_in_ratio: float
    fan_out_ratio: float
    shape: tuple[int, ...]

    @property
    def init(self) -> float:
        if self.role == "hidden":
            return 1 / math.sqrt(self.fan_in_ratio)
        return 1 / self.fan_in_ratio if self.role == "readout" else 1.0

    @property
    def adam_lr(self) -> float:
        return 1 / self.fan_in_ratio if self.role in ("hidden", "readout") else 1.0

    def muon_lr(self, adjust_lr: str, base_shape: tuple[int, ...]) -> float:
        """The spectral condition's multiplier over what Muon's own scale grows by."""
        spectral = math.sqrt(self.fan_out_ratio / self.fan_in_ratio)
        return spectral / (muon_scale(self.shape, adjust_lr) / muon_scale(base_shape, adjust_lr))


def muon_scale(shape: tuple[int, ...], adjust_lr: str) -> float:
    """Muon's factor on its orthogonal step for a matrix of ``shape`` (``litscale.optim.muon``)."""
    rows, cols = shape[-2:]
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr == "match_rms_adamw" else math.sqrt(max(1.0, rows / cols))


class WidthScaling:
    """µP for one network at ``base_width``: the roles and multipliers of its parameters (by
    name), the init and forward multipliers to apply, and the optimizer's param groups."""

    def __init__(self, net: nn.Module, base_width: int) -> None:
        found = declared(net, "mup_width")
        if found is None or not callable(getattr(found[0], "at_width", None)):
            raise ValueError(f"the network must declare mup_width and at_width(width): {type(net).__name__} "
                             "does not (see docs/width-scaling.md)")
        self.owner, self.width = found[0], int(found[1])
        self.base_width = int(base_width)
        with torch.device("meta"):
            self.base = self.owner.at_width(self.base_width)
        self.base_shapes = {name: tuple(p.shape) for name, p in self.base.named_parameters()}
        self.output_ratio = self.width / self.base_width

    # --- roles ------------------------------------------------------------------------------

    def parameters(self) -> dict[str, tuple[nn.Parameter, ParameterWidth]]:
        """Every parameter of the network held here, by name (relative to the owner), with its
        fans against the base model's. A pipeline stage holds some; a sharded one is measured
        by its global shape."""
        embeddings = {id(m.weight) for m in self.owner.modules() if isinstance(m, nn.Embedding)}
        outputs = {id(p) for m in output_layers(self.owner) for p in m.parameters()}
        found = {}
        for name, param in self.owner.named_parameters():
            shape = tuple(param.shape)
            base = self.base_shapes.get(name, shape)
            ratios = [now / then for now, then in zip(shape, base, strict=True)]
            if param.dim() < 2:
                fan_in, fan_out = 1.0, ratios[0] if ratios else 1.0
            elif id(param) in embeddings and id(param) not in outputs:
                fan_in, fan_out = ratios[0], ratios[1]  # [vocab, width]: a lookup's fan-in is its rows
            else:
                fan_in, fan_out = ratios[-1], ratios[-2]  # [(experts,) out, in]
            found[name] = (param, ParameterWidth(self._role(param, fan_in, fan_out, outputs), fan_in, fan_out, shape))
        return found

    @staticmethod
    def _role(param: nn.Parameter, fan_in: float, fan_out: float, outputs: set[int]) -> str:
        if id(param) in outputs:
            return "output"
        if param.dim() < 2:
            return "vector"
        if fan_in == 1.0:
            return "input"
        return "hidden" if fan_out != 1.0 else "readout"

    # --- the network -----------------------------------------------------------------------------

    def apply(self, networks: Iterable[nn.Module] = ()) -> bool:
        """Set the forward multipliers on the network (and on ``networks``: copies the run also
        computes with, the layout-invariant replica) and scale its init; False when this network
        had it already (a second fit of the same module), whose weights are then left alone."""
        applied = self.owner.output_multiplier == 1 / self.output_ratio
        base_attention = {name: m for name, m in self.base.named_modules() if hasattr(m, "score_multiplier")}
        for network in (self.owner, *networks):
            owner = declared(network, "mup_width")[0]
            owner.output_multiplier = 1 / self.output_ratio
            for name, module in owner.named_modules():
                if name in base_attention:  # scores 1/head_dim, relative to the base's 1/sqrt(head_dim)
                    module.score_multiplier = math.sqrt(base_attention[name].head_dim / module.head_dim)
        if applied and self.output_ratio != 1.0:
            return False
        with torch.no_grad():
            for param, width in self.parameters().values():
                if width.init != 1.0:
                    param.mul_(width.init)
        return True

    # --- the optimizer ---------------------------------------------------------------------------

    def lr_multiplier(self, name: str, width: ParameterWidth, group: dict, optimizer_keywords: dict) -> float:
        if group.get("role") == MATRIX:
            return width.muon_lr(optimizer_keywords.get("adjust_lr", "match_rms_adamw"),
                                 self.base_shapes.get(name, width.shape))
        return width.adam_lr

    def param_groups(self, groups: list[dict], lr: float, optimizer_keywords: dict) -> list[dict]:
        """``groups`` split by LR multiplier: each keeps its other settings (role) and gets ``lr``
        x its multiplier and its weight decay (the group's, else ``optimizer_keywords``') / its
        multiplier (``MuAdamW``'s rule: the step's decay ``lr x weight_decay`` is the base
        width's), the multiplier kept as ``lr_multiplier``."""
        named = {id(param): (name, width) for name, (param, width) in self.parameters().items()}
        split = []
        for group in groups:
            by_multiplier: dict[float, list] = {}
            for param in group["params"]:
                name, width = named.get(id(param), (None, None))
                multiplier = 1.0 if width is None else self.lr_multiplier(name, width, group, optimizer_keywords)
                by_multiplier.setdefault(multiplier, []).append(param)
            decay = group.get("weight_decay", optimizer_keywords.get("weight_decay"))
            split += [{**group, "params": params, "lr": lr * multiplier, "lr_multiplier": multiplier,
                       **({} if decay is None else {"weight_decay": decay / multiplier})}
                      for multiplier, params in by_multiplier.items()]
        return split

    def describe(self, optimizer_keywords: dict, muon: bool) -> str:
        """The start-of-run line: width, multipliers, and what each role's tensors get."""
        matrices = {id(p) for group in parameter_roles(self.owner, 0.0) if group["role"] == MATRIX
                    for p in group["params"]} if muon else set()
        counts: dict[tuple, int] = {}
        for name, (param, width) in self.parameters().items():
            group = {"role": MATRIX} if id(param) in matrices else {}
            key = (width.role, round(width.init, 6), round(self.lr_multiplier(name, width, group, optimizer_keywords), 6))
            counts[key] = counts.get(key, 0) + 1
        roles = " | ".join(f"{role} ({n}): init x{init:g} lr x{lr:g} weight decay x{round(1 / lr, 6):g}"
                           for (role, init, lr), n in sorted(counts.items()))
        scores = sorted({round(m.score_multiplier, 6) for m in self.owner.modules() if hasattr(m, "score_multiplier")})
        return (f"litscale: lr scaling: µP width {self.width} / base {self.base_width} = x{self.output_ratio:g} | "
                f"{roles} | logits x{1 / self.output_ratio:g} | attention scores x{', '.join(f'{s:g}' for s in scores) or '-'}")
