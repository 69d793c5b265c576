"""Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"):
DiLoCo whose parameters are synchronised one fragment at a time, with the exchange overlapped
with inner steps and the outer gradient sent in fewer bits.

- **Fragments** (``fragments=F``): the model's blocks (its declared ``pipeline_blocks``: GPT's
  embeddings, each transformer block, the final norm and head) are dealt to fragments in the
  paper's strided pattern, block ``b`` to fragment ``b mod F``; a parameter in no block goes to
  fragment 0. Fragment ``f`` is synchronised every ``H = sync_every`` local steps, at the steps
  ``s`` with ``s = f * H // F (mod H)``: one fragment at a time, each once a period.
- **Overlap** (``overlap_steps=tau``): a fragment's exchange starts after local step ``s``
  (an asynchronous collective) and the workers take ``tau`` more inner steps before they wait
  on it; then the fragment's outer step runs and each worker merges
  ``theta_local <- alpha * theta_local + (1 - alpha) * theta_global`` (``mixing_factor=alpha``;
  0 keeps the global fragment alone, as DiLoCo does). ``tau=0`` waits at once.
- **Quantized outer gradient** (``outer_dtype``): ``fp32`` all-reduces the fragment's
  parameters (their mean gives the outer gradient, as DiLoCo does). ``bf16``, ``fp8_e4m3`` and
  ``int4`` quantize each worker's outer gradient ``theta_sync - theta_local`` (plus the
  residual of its last quantization: error feedback) and *all-gather* the quantized bytes; every
  worker decodes all of them and sums in fp32 in rank order. All-gather, not all-reduce: no
  collective reduces int4 or fp8, and a ring all-reduce of a cast would round every partial sum
  again; the paper likewise keeps the accumulation in fp32. Each worker then sends only its own
  quantized payload, and every worker holds the identical mean.

``comm/bytes_per_sync`` (mean) and ``comm/peak_bytes`` (largest) count what one worker sends in
one fragment's exchange; ``comm/bytes_sent`` the run's total.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from litscale.compression.outer_quantization import (
    OuterDtype,
    Quantized,
    dequantize,
    quantize_with_feedback,
)
from litscale.strategies.local_sgd_state import LocalSGDState, build_outer_optimizer
from litscale.strategies.stages import find_blocks


def check_fragments(fragments: int, net: nn.Module) -> None:
    """``fragments`` must not exceed the blocks ``net`` declares (one line, before start-up)."""
    if fragments == 1:
        return
    try:
        _, units = find_blocks(net)
    except ValueError:
        raise ValueError(
            f"strategy.fragments={fragments} splits the model by its blocks, but "
            f"{type(net).__name__} declares none (pipeline_blocks); allowed: "
            "strategy.fragments=1"
        ) from None
    if fragments > len(units):
        raise ValueError(
            f"strategy.fragments={fragments} is more than the {len(units)} blocks "
            f"{type(net).__name__} declares (pipeline_blocks); allowed: 1..{len(units)}"
        )


def parameter_fragments(module: nn.Module, fragments: int) -> list[list[str]]:
    """The trainable parameters' names of ``module``, by fragment: its blocks dealt strided
    (block ``b`` to fragment ``b mod fragments``), a parameter outside every block to fragment 0,
    a shared (tied) parameter to the fragment of the first block holding it."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if fragments == 1:
        return [[name for name, _ in named]]
    check_fragments(fragments, module)
    owner, units = find_blocks(module)
    fragment_of: dict[int, int] = {}
    for index, unit in enumerate(units):
        for name in unit:
            for param in owner.get_submodule(name).parameters():
                fragment_of.setdefault(id(param), index % fragments)
    names: list[list[str]] = [[] for _ in range(fragments)]
    for name, param in named:
        names[fragment_of.get(id(param), 0)].append(name)
    return names


def sync_offsets(sync_every: int, fragments: int) -> list[int]:
    """Local step, modulo ``sync_every``, after which each fragment is synchronised."""
    return [f * sync_every // fragments for f in range(fragments)]


@dataclass
class InFlight:
    """A fragment's exchange: started after a local step, finished (merged) at ``due``.
    ``result`` is the mean of the fragment's parameters (``fp32``) or of the workers' outer
    gradients (quantized), once waited for."""

    fragment: int
    due: int
    quantized: bool
    works: list[Any] = field(default_factory=list)
    decode: Callable[[], torch.Tensor] | None = None
    result: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self.result is None:
            for work in self.works:
                work.wait()
            self.result, self.decode, self.works = self.decode(), None, []
        return self.result


class StreamingState(LocalSGDState):
    """Local SGD / DiLoCo's state synchronising fragments in turn (see the module docstring);
    ``fragments=1, outer_dtype=fp32, overlap_steps=0`` is DiLoCo as ``LocalSGDState`` runs it.

    ``fragment_index``: each fragment's positions in the strategy's parameter list, set by the
    strategy (``set_fragments``) before the first step.
    """

    def __init__(
        self,
        *,
        fragments: int,
        outer_dtype: OuterDtype,
        overlap_steps: int,
        mixing_factor: float,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.fragments, self.outer_dtype = fragments, outer_dtype
        self.overlap_steps, self.mixing_factor = overlap_steps, mixing_factor
        self.offsets = sync_offsets(self.sync_every, fragments)
        self.fragment_index: list[list[int]] = []
        self.residuals_by_fragment: dict[int, torch.Tensor] = {}  # error feedback, this rank's
        self.in_flight: list[InFlight] = []
        self.syncs = self.sync_bytes = self.peak_bytes = 0
        # Error-feedback residuals differ by rank: a checkpoint keeps every rank's.
        self.identical_across_ranks = outer_dtype == "fp32"

    def set_fragments(self, names: list[list[str]], parameter_names: list[str]) -> None:
        position = {name: index for index, name in enumerate(parameter_names)}
        self.fragment_index = [[position[name] for name in fragment] for fragment in names]

    @property
    def uses_anchor(self) -> bool:
        """A quantized exchange sends outer gradients, which need the last synchronised
        parameters even with no outer optimizer (then plain SGD, lr 1: the mean)."""
        return self.outer_optimizer != "none" or self.outer_dtype != "fp32"

    def start_local_phase(self, params: list[nn.Parameter]) -> None:
        if self.uses_anchor and self.outer is None:
            self._build_outer([p.detach().clone() for p in params])

    def _build_outer(self, anchor: list[torch.Tensor]) -> None:
        if self.outer_optimizer != "none":
            return super()._build_outer(anchor)
        self.outer = build_outer_optimizer("sgd", anchor, lr=1.0, momentum=0.0)

    def due_fragments(self, local_step: int) -> list[int]:
        return [
            f
            for f, offset in enumerate(self.offsets)
            if (local_step - offset) % self.sync_every == 0
        ]

    def after_optimizer_step(self, params: list[nn.Parameter]) -> None:
        """Start the exchange of the fragments due after this step, then merge those due now."""
        local_step = self.count_step(params)
        if local_step is None:
            return
        with torch.no_grad():
            for fragment in self.due_fragments(local_step):
                self.in_flight.append(
                    self._start(params, fragment, due=local_step + self.overlap_steps)
                )
            self.finish(params, up_to=local_step)

    def finish(self, params: list[nn.Parameter], up_to: int | None = None) -> None:
        """Merge every exchange due by local step ``up_to`` (all of them when None)."""
        due = [entry for entry in self.in_flight if up_to is None or entry.due <= up_to]
        self.in_flight = [entry for entry in self.in_flight if entry not in due]
        with torch.no_grad():
            for entry in due:
                self._merge(params, entry)

    def _members(self, params: list[nn.Parameter], fragment: int) -> list[torch.Tensor]:
        return [params[i] for i in self.fragment_index[fragment]]

    def _anchors(self, fragment: int) -> list[torch.Tensor]:
        anchors = self.outer.param_groups[0]["params"]
        return [anchors[i] for i in self.fragment_index[fragment]]

    def _start(self, params: list[nn.Parameter], fragment: int, *, due: int) -> InFlight:
        members, world = self._members(params, fragment), dist.get_world_size(self.group)
        if self.outer_dtype == "fp32":
            flat = parameters_to_vector(members) / world  # as average_parameters divides first
            entry = InFlight(
                fragment,
                due,
                quantized=False,
                works=[dist.all_reduce(flat, group=self.group, async_op=True)],
                decode=lambda: flat,
            )
            self._count(flat.numel() * flat.element_size())
            return entry
        outer_gradient = parameters_to_vector(self._anchors(fragment)) - parameters_to_vector(
            members
        )
        residual = self.residuals_by_fragment.get(fragment)
        quantized, self.residuals_by_fragment[fragment] = quantize_with_feedback(
            outer_gradient,
            None if residual is None else residual.to(outer_gradient),
            self.outer_dtype,
        )
        payloads = [torch.empty_like(quantized.payload) for _ in range(world)]
        scales = [torch.empty_like(quantized.scales) for _ in range(world)]
        works = [dist.all_gather(payloads, quantized.payload, group=self.group, async_op=True)]
        if quantized.scales.numel():
            works.append(dist.all_gather(scales, quantized.scales, group=self.group, async_op=True))

        def decode() -> torch.Tensor:
            total = torch.zeros_like(outer_gradient)
            for payload, scale in zip(
                payloads, scales, strict=True
            ):  # rank order: equal everywhere
                total += dequantize(Quantized(payload, scale, quantized.numel), self.outer_dtype)
            return total / world

        self._count(quantized.nbytes)
        return InFlight(fragment, due, quantized=True, works=works, decode=decode)

    def _count(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.sync_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, nbytes)
        self.syncs += 1

    def _merge(self, params: list[nn.Parameter], entry: InFlight) -> None:
        members = self._members(params, entry.fragment)
        result = entry.value().to(members[0].device)
        if self.outer is None:
            merged = result.split([p.numel() for p in members])
        else:
            anchors = self._anchors(entry.fragment)
            for anchor in self.outer.param_groups[0]["params"]:
                anchor.grad = None  # only this fragment's outer step
            gradients = result.split([a.numel() for a in anchors]) if entry.quantized else None
            if not entry.quantized:
                means = result.split([a.numel() for a in anchors])
                gradients = [
                    anchor - mean.view_as(anchor)
                    for anchor, mean in zip(anchors, means, strict=True)
                ]
            for anchor, gradient in zip(anchors, gradients, strict=True):
                anchor.grad = gradient.view_as(anchor).clone()
            self.outer.step()
            merged = anchors
        alpha = self.mixing_factor
        for param, value in zip(members, merged, strict=True):
            value = value.view_as(param)
            param.copy_(value) if alpha == 0 else param.mul_(alpha).add_(value, alpha=1 - alpha)

    def totals(self) -> dict[str, float]:
        return {
            **super().totals(),
            "syncs": self.syncs,
            "sync_bytes": self.sync_bytes,
            "peak_bytes": self.peak_bytes,
        }

    def state_dict(self) -> dict[str, Any]:
        in_flight = [
            {
                "fragment": e.fragment,
                "due": e.due,
                "quantized": e.quantized,
                "result": e.value().detach().cpu(),
            }
            for e in self.in_flight
        ]
        residuals = {f: r.detach().cpu() for f, r in self.residuals_by_fragment.items()}
        return {**super().state_dict(), "in_flight": in_flight, "fragment_residuals": residuals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # .get: a local SGD checkpoint from before streaming DiLoCo counted no syncs
        self.syncs, self.sync_bytes = int(state.get("syncs", 0)), int(state.get("sync_bytes", 0))
        self.peak_bytes = int(state.get("peak_bytes", 0))
        self.residuals_by_fragment = dict(state.get("fragment_residuals") or {})
        self.in_flight = [
            InFlight(e["fragment"], e["due"], e["quantized"], result=e["result"])
            for e in state.get("in_flight") or []
        ]
