"""``plan.verify=k``: the planner's top ``k`` plans, each written as an experiment config, run
as short jobs of one Hydra multirun on this machine, and each prediction printed and recorded
beside what was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from litscale.planner.cluster import Cluster
from litscale.planner.cost import Prediction


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


def verify(ranked: list[Prediction], experiments: list[str], *, config_dir: str, extra: list[str], steps: int,
           accelerator: str) -> list[dict]:
    """Run each plan's experiment (``<config_dir>/experiment/<name>.yaml``) ``steps`` steps, as one
    Hydra multirun through litscale's launcher, and return per plan the predicted and measured
    step time and memory; write them to ``<config_dir>/verify.json``. ``extra``: overrides the
    experiment files cannot hold. A job that fails is recorded with its error, and the sweep
    goes on with the plans after it."""
    sweep_dir = os.path.join(config_dir, "verify")
    summaries, errors, pending = {}, {}, list(range(len(experiments)))
    while pending:
        names = [experiments[i] for i in pending]
        print(f"litscale: verifying {len(names)} plan(s) as one multirun, {steps} steps each: "
              f"{', '.join(names)} (logs in {sweep_dir})", flush=True)
        error = _multirun([
            "-m", "--config-dir", config_dir, f"experiment={','.join(names)}", *extra,
            f"trainer.accelerator={accelerator}", f"trainer.max_steps={steps}",
            f"callbacks.throughput.warmup_steps={min(10, steps // 3)}", "trainer.enable_progress_bar=false",
            f"hydra.sweep.dir={sweep_dir}", "hydra.sweep.subdir=${hydra.runtime.choices.experiment}"],
            log=os.path.join(sweep_dir, f"multirun_{pending[0] + 1}.log"))
        for i in pending:
            found = Path(sweep_dir, experiments[i], "summary.json")
            if found.exists():
                summaries[i] = json.loads(found.read_text())
        failed = next((i for i in pending if i not in summaries), None)
        if failed is None:
            break
        # Hydra stops a multirun at its first failed job: that one gets the error, and the
        # jobs after it, which never started, run in the next multirun
        errors[failed] = error or "no summary.json written"
        pending = [i for i in pending if i > failed]
    records = [_record(prediction, summaries.get(i, {}), errors.get(i), experiments[i])
               for i, prediction in enumerate(ranked)]
    path = Path(config_dir) / "verify.json"
    path.write_text(json.dumps(records, indent=2))
    return records


def _multirun(arguments: list[str], *, log: str) -> str | None:
    """``python train.py <arguments>``, its output in ``log``; the last ``error:`` line (None on success)."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as output:
        process = subprocess.run([sys.executable, sys.argv[0], *arguments], stdout=output,
                                 stderr=subprocess.STDOUT, text=True)
    if process.returncode == 0:
        return None
    errors = [line for line in Path(log).read_text().splitlines() if line.startswith("error:")]
    return (errors or [f"exit code {process.returncode}"])[-1]


def _record(prediction: Prediction, summary: dict, error: str | None, experiment: str) -> dict:
    states = sum(summary.get(f"memory/{k}_bytes", 0) for k in ("params", "grads", "optimizer"))
    return {
        "plan": prediction.plan.describe(), "experiment": experiment,
        "predicted_step_s": prediction.step_s, "measured_step_s": summary.get("perf/step_time_s"),
        "predicted_states_bytes": sum(prediction.memory[k] for k in ("params", "grads", "optimizer")),
        "measured_states_bytes": states or None, "error": error,
    }


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
