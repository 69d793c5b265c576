"""What a whole run trained, read back from what it leaves in its run dir: the global batch's
loss and the gradient's norm before clipping at every step (``csv/metrics.csv``, with
``logger=csv trainer.log_every_n_steps=1``), and the final weights (``model.pt``, the
consolidated export every run writes). Two runs compared on all three see a defect that the
last loss alone hides: Adam's first update is ``lr * g / |g|`` and norm clipping rescales a
large gradient to norm 1, so a gradient of the wrong size leaves the loss after one update
as it was; its norm does not.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import torch

# What a run must log with the overrides that give a trace (``TRACED``).
LOSS, GRADIENT_NORM = "train/loss", "train/grad_norm"
TRACED = ["logger=csv", "trainer.log_every_n_steps=1"]


@dataclass
class RunTrace:
    """A run's loss and gradient norm by step (0-based), and its final weights by name."""

    losses: dict[int, float]
    gradient_norms: dict[int, float]
    weights: dict[str, torch.Tensor]


def read_trace(output_dir: str | Path) -> RunTrace:
    """The trace of the run that wrote ``output_dir`` (``TRACED``'s overrides, rank 0's files)."""
    output_dir = Path(output_dir)
    by_step: dict[str, dict[int, float]] = {LOSS: {}, GRADIENT_NORM: {}}
    with open(output_dir / "csv" / "metrics.csv") as handle:
        for row in csv.DictReader(handle):
            for name, values in by_step.items():
                if row.get(name):
                    values[int(row["step"])] = float(row[name])
    weights = torch.load(output_dir / "model.pt", map_location="cpu", weights_only=True)
    return RunTrace(by_step[LOSS], by_step[GRADIENT_NORM], weights)


def differences(actual: RunTrace, expected: RunTrace, *, rel_tol: float, abs_tol: float, steps: int,
                gradient_norms: bool = True, weights_as_one: bool = False) -> list[str]:
    """Where ``actual`` differs from ``expected`` beyond the tolerance: each of ``steps`` steps'
    loss and (with ``gradient_norms``) gradient norm, then every weight, element by element or
    (``weights_as_one``) all of them as one vector: the norm of the difference against the
    expected weights' norm. A value missing from either side is a difference: a comparison that
    found nothing to compare says so.

    NOTE: ``weights_as_one`` for 16-bit compute: the gradient of an element that should be near
    zero (a key projection's bias: softmax ignores a constant added to every key) is bf16
    rounding noise, whose sign AdamW follows by a step of ``lr``; such a tensor differs by
    more than its own size while the network as a whole is within the relative tolerance."""
    found = []
    kinds = [(LOSS, actual.losses, expected.losses)]
    if gradient_norms:
        kinds.append((GRADIENT_NORM, actual.gradient_norms, expected.gradient_norms))
    for name, got, want in kinds:
        for step in range(steps):
            if step not in got or step not in want:
                found.append(f"{name} at step {step}: {got.get(step)} against {want.get(step)} (not logged)")
            elif not math.isclose(got[step], want[step], rel_tol=rel_tol, abs_tol=abs_tol):
                found.append(f"{name} at step {step}: {got[step]} != {want[step]}")
    if actual.weights.keys() != expected.weights.keys() or not expected.weights:
        found.append(f"weights: {sorted(actual.weights)[:4]}... against {sorted(expected.weights)[:4]}...")
        return found
    shapes = [name for name in expected.weights if actual.weights[name].shape != expected.weights[name].shape]
    found += [f"weight {name}: shape {list(actual.weights[name].shape)} != {list(expected.weights[name].shape)}"
              for name in shapes]
    if shapes:
        return found
    if weights_as_one:
        got, want = (torch.cat([w[name].double().flatten() for name in expected.weights])
                     for w in (actual.weights, expected.weights))
        gap, size = torch.linalg.vector_norm(got - want).item(), torch.linalg.vector_norm(want).item()
        if gap > rel_tol * size + abs_tol:
            found.append(f"weights: difference of norm {gap:.3g}, {gap / max(size, 1e-30):.3g} of theirs")
        return found
    for name, want in expected.weights.items():
        got, want = actual.weights[name].double(), want.double()
        if not torch.allclose(got, want, rtol=rel_tol, atol=abs_tol):
            found.append(f"weight {name}: max difference {(got - want).abs().max().item():.3g}")
    return found
