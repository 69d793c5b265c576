"""The planner's predicted peak memory per rank against the measured one, on CPU.

Each cell trains 2 steps with ``callbacks.memory.measure_peak=true`` (the second step is
watched by torch's MemTracker, litscale.measure.step_memory) and reads ``memory/peak_bytes`` (the
busiest rank's) and ``plan/predicted_peak_bytes`` from its summary.json. The prediction is the
one every run makes of itself before launch (litscale.app.plan.runs.predict_run), so the planner needs
this machine's calibration (``python -m litscale.planner.calibrate``) for the run to predict.

    python experiments/planner/memory_table.py            # every cell, writes memory_table.json
    python experiments/planner/memory_table.py --only gpt  # the cells whose name has "gpt" (the rest kept)
    python experiments/planner/memory_table.py --report    # README.md's table from memory_table.json

Goal (issue: a planner whose pick you can take): every cell within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GOAL = 0.10

MODELS = {
    "gpt_nano": ["model=gpt"],
    "llama_tiny": ["model=llama"],
    "moe_tiny": ["model=moe"],
}
# (name, ranks, overrides): single, ddp, fsdp, ZeRO 1-3, TP, PP (three schedules) and EP, CP where a model splits its sequence.
LAYOUTS = [
    ("single", 1, ["strategy=single"]),
    ("ddp", 2, ["strategy=ddp"]),
    ("fsdp", 2, ["strategy=fsdp"]),
    ("fsdp", 4, ["strategy=fsdp", "launcher.oversubscribe=true"]),
    ("zero1", 2, ["strategy=deepspeed_zero", "strategy.stage=1"]),
    ("zero2", 2, ["strategy=deepspeed_zero", "strategy.stage=2"]),
    ("zero3", 2, ["strategy=deepspeed_zero", "strategy.stage=3"]),
    ("tp", 2, ["strategy=tensor_parallel"]),
    ("pp_1f1b", 2, ["strategy=pipeline", "strategy.microbatches=4"]),
    ("pp_gpipe", 2, ["strategy=pipeline", "strategy.schedule=gpipe", "strategy.microbatches=4"]),
    ("pp_interleaved", 2, ["strategy=pipeline", "strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2",
                           "strategy.microbatches=4"]),
]
EXTRA = [
    ("llama_tiny", "fsdp_cp2", 2, ["strategy=fsdp", "strategy.context_parallel_size=2"]),
    ("llama_tiny", "fsdp_cp4", 4, ["strategy=fsdp", "strategy.context_parallel_size=4", "launcher.oversubscribe=true"]),
    ("moe_tiny", "fsdp_ep2", 2, ["strategy=fsdp", "strategy.expert_parallel_size=2"]),
]
COMMON = ["trainer.max_steps=2", "trainer.accelerator=cpu", "callbacks.memory.measure_peak=true",
          "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.batch_size=8", "logger=csv"]


def cells() -> list[tuple[str, int, list[str]]]:
    out = [(f"{model}/{name}@{ranks}", ranks, [*model_overrides, *layout, f"trainer.devices={ranks}"])
           for model, model_overrides in MODELS.items() for name, ranks, layout in LAYOUTS]
    out += [(f"{model}/{name}@{ranks}", ranks, [*MODELS[model], *layout, f"trainer.devices={ranks}"])
            for model, name, ranks, layout in EXTRA]
    return out


def run_cell(overrides: list[str], outputs: Path) -> dict:
    command = [sys.executable, "train.py", *COMMON, *overrides, f"paths.root_dir={outputs}", "name=memory"]
    process = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    summaries = sorted(outputs.glob("memory/runs/*/summary.json"))
    if process.returncode != 0 or not summaries:
        tail = (process.stderr or process.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": tail[0][:300]}
    summary = json.loads(summaries[-1].read_text())
    measured, predicted = summary.get("memory/peak_bytes"), summary.get("plan/predicted_peak_bytes")
    row = {"measured_bytes": measured, "predicted_bytes": predicted,
           "predicted_states_bytes": summary.get("plan/predicted_states_bytes"),
           "measured_states_bytes": sum(summary.get(k, 0.0) for k in
                                        ("memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes")),
           "peak_rank": summary.get("memory/peak_rank")}
    if measured and predicted:
        row["error"] = predicted / measured - 1
    return row


README = Path(__file__).with_name("README.md")
BEGIN, END = "<!-- memory table -->", "<!-- end memory table -->"


def report(results: dict) -> str:
    """The recorded cells as a markdown table, each met or missed."""
    lines = ["| cell | overrides | measured peak | predicted | error | within 10% |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for name, row in results["cells"].items():
        if not isinstance(row.get("error"), float):
            lines.append(f"| {name} | `{' '.join(row['overrides'])}` | | | | no comparison: {row.get('error')} |")
            continue
        lines.append(f"| {name} | `{' '.join(row['overrides'])}` | {row['measured_bytes'] / 2**20:.2f} MiB | "
                     f"{row['predicted_bytes'] / 2**20:.2f} MiB | {row['error']:+.1%} | "
                     f"{'met' if abs(row['error']) <= results['goal'] else 'missed'} |")
    errors = [abs(r["error"]) for r in results["cells"].values() if isinstance(r.get("error"), float)]
    lines.append(f"\n{sum(e <= results['goal'] for e in errors)} of {len(results['cells'])} cells within "
                 f"{results['goal']:.0%}; largest error {max(errors):.1%}; load average at the end "
                 f"{results['load_average']:.2f} (memory does not depend on it).")
    return "\n".join(lines)


def write_report(path: Path) -> None:
    text = README.read_text()
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    README.write_text(f"{before}{BEGIN}\n{report(json.loads(path.read_text()))}\n{END}{after}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--out", default=str(Path(__file__).with_name("memory_table.json")))
    parser.add_argument("--report", action="store_true", help="only write README.md's table from --out")
    args = parser.parse_args()
    if args.report:
        return write_report(Path(args.out))
    rows = {}
    for name, _, overrides in cells():
        if args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as outputs:
            rows[name] = {"overrides": overrides, **run_cell(overrides, Path(outputs))}
        row = rows[name]
        figure = (f"measured {row['measured_bytes'] / 2**20:8.2f} MiB  predicted {row['predicted_bytes'] / 2**20:8.2f} MiB"
                  f"  {row['error']:+.1%}" if "measured_bytes" in row and row.get("error") is not None
                  else f"no comparison: {row.get('error') or row}")
        print(f"{name:28s} {figure}", flush=True)
    errors = [abs(r["error"]) for r in rows.values() if isinstance(r.get("error"), float)]
    within = sum(e <= GOAL for e in errors)
    print(f"{within} of {len(rows)} cells within {GOAL:.0%} ({len(rows) - len(errors)} without a comparison)")
    out = Path(args.out)
    if args.only and out.exists():  # a partial re-record: the other cells stay as recorded
        rows = {**json.loads(out.read_text())["cells"], **rows}
    out.write_text(json.dumps({"goal": GOAL, "load_average": os.getloadavg()[0], "cells": rows}, indent=1))


if __name__ == "__main__":
    main()
