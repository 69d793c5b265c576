"""``plan.verify=k``: the planner's top ``k`` plans run as short jobs on this machine, and each
prediction printed and recorded beside what was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from litscale.planner.cluster import Cluster
from litscale.planner.cost import Prediction

# Overrides of the user's command line that a verified plan replaces or that would recurse.
PLAN_KEYS = ("plan", "cluster", "strategy", "trainer.devices", "trainer.num_nodes", "data.batch_size",
             "trainer.accumulate_grad_batches", "trainer.max_steps", "name", "hydra.")


def check_verifiable(cluster: Cluster) -> str | None:
    """Why the plans of ``cluster`` cannot be measured here (None: they can)."""
    if cluster.nodes > 1:
        return f"plan.verify runs on this machine, but cluster={cluster.name} has {cluster.nodes} nodes"
    if cluster.name != "local_cpu":
        import torch

        if torch.cuda.device_count() < cluster.devices_per_node:
            return (f"plan.verify runs on this machine, which has {torch.cuda.device_count()} GPU(s), not "
                    f"cluster={cluster.name}'s {cluster.devices_per_node}; use cluster=local_cpu")
    return None


def verify(ranked: list[Prediction], winners: list[list[str]], *, user_overrides: list[str], steps: int,
           output_dir: str, accelerator: str) -> list[dict]:
    """Run each plan ``steps`` steps (``python train.py``, one after another) and return, per
    plan, the predicted and measured step time and memory; write them to ``verify.json``."""
    kept = [o for o in user_overrides if not o.lstrip("+~").startswith(PLAN_KEYS)]
    records = []
    for index, (prediction, overrides) in enumerate(zip(ranked, winners, strict=True), 1):
        print(f"litscale: verifying {index}/{len(ranked)}: {prediction.plan.describe()}", flush=True)
        summary = _measure([*kept, *overrides, f"trainer.accelerator={accelerator}", f"trainer.max_steps={steps}",
                            f"callbacks.throughput.warmup_steps={min(10, steps // 3)}"])
        records.append({
            "plan": prediction.plan.describe(), "overrides": overrides,
            "predicted_step_s": prediction.step_s, "measured_step_s": summary.get("perf/step_time_s"),
            "predicted_states_bytes": sum(prediction.memory[k] for k in ("params", "grads", "optimizer")),
            "measured_states_bytes": sum(summary.get(f"memory/{k}_bytes", 0) for k in ("params", "grads", "optimizer"))
            or None,
            "error": summary.get("error"),
        })
    path = Path(output_dir) / "verify.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2))
    return records


def _measure(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as outputs:
        process = subprocess.run([sys.executable, sys.argv[0], *overrides, "trainer.enable_progress_bar=false"],
                                 env={**os.environ, "LITSCALE_OUTPUTS": outputs}, capture_output=True, text=True)
        found = sorted(Path(outputs).glob("**/summary.json"))
        if process.returncode or not found:
            errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
            return {"error": (errors or [f"exit code {process.returncode}"])[-1]}
        return json.loads(found[-1].read_text())


def order_mistakes(records: list[dict]) -> list[str]:
    """Each pair of measured plans (in predicted order) that measured the other way round."""
    measured = [(i, r) for i, r in enumerate(records, 1) if r["measured_step_s"]]
    return [f"predicted order wrong: #{i} {a['plan']} ({a['measured_step_s']:.4g} s measured) is slower than "
            f"#{j} {b['plan']} ({b['measured_step_s']:.4g} s)"
            for i, a in measured for j, b in measured if i < j and a["measured_step_s"] > b["measured_step_s"]]


def table(records: list[dict]) -> str:
    rows = [("plan", "step s predicted", "measured", "measured / predicted", "states MiB predicted", "measured")]
    for r in records:
        measured = r["measured_step_s"]
        ratio = f"{measured / r['predicted_step_s']:.2f}" if measured else r.get("error") or "n/a"
        states = r["measured_states_bytes"]
        rows.append((r["plan"], f"{r['predicted_step_s']:.4g}", f"{measured:.4g}" if measured else "-", ratio,
                     f"{r['predicted_states_bytes'] / 2**20:.2f}", f"{states / 2**20:.2f}" if states else "-"))
    return aligned(rows)


def aligned(rows: list[tuple[str, ...]]) -> str:
    """Rows of cells as a plain-text table, each column as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
