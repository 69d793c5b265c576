"""Measured memory per rank on one GPU beside the planner's prediction, and the largest micro
batch that fits (found by doubling) beside the planner's predicted largest.

    python experiments/gpu/memory.py --models gpt2_small llama_1b --out memory.json

Each row is a short ``train.py`` run (4 steps, ``model.compile=false``: the eager network's
activations, which the planner models) with ``cluster=h100_8x`` so its summary carries the
planner's ``plan/predicted_states_bytes`` and ``plan/predicted_peak_bytes`` beside the
measured ``memory/*`` (parameters, gradients, optimizer state after the first step) and
``memory/peak_bytes`` (``torch.cuda.max_memory_allocated``). The planner's predicted peak is
linear in the micro batch, so two of its predictions give the largest micro batch it expects
to fit in the cluster file's 80 GiB.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

from throughput import EXPERIMENTS, REPO  # this folder's: the same experiment configs

STRATEGIES = {"single": ["strategy=single"], "fsdp": ["strategy=fsdp"],
              "zero2": ["strategy=deepspeed_zero", "strategy.stage=2"]}
DEVICE_BYTES = 80 * 2**30  # conf/cluster/h100_8x.yaml
KEYS = ("memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes", "memory/peak_bytes",
        "plan/predicted_states_bytes", "plan/predicted_peak_bytes")


def run(model: str, outputs: Path, *extra: str) -> dict:
    outputs.mkdir(parents=True, exist_ok=True)
    process = subprocess.run(
        [sys.executable, "train.py", f"experiment={EXPERIMENTS[model]}", "trainer=gpu", "cluster=h100_8x",
         "model.compile=false", "trainer.max_steps=4", "callbacks.throughput.warmup_steps=1",
         "~callbacks.model_checkpoint", *extra],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "LITSCALE_OUTPUTS": str(outputs)})
    row = {"model": model, "extra": list(extra)}
    if process.returncode != 0:
        row["error"] = "out of memory" if "OutOfMemoryError" in process.stderr else process.stderr[-1500:]
        return row
    (path,) = glob.glob(str(outputs / "**" / "summary.json"), recursive=True)
    summary = json.loads(Path(path).read_text())
    return {**row, "micro_batch": summary.get("micro_batch"), **{k: summary.get(k) for k in KEYS}}


def predicted_largest(a: dict, b: dict) -> int | None:
    """The largest micro batch whose predicted peak is within the device, from two predictions."""
    (x1, y1), (x2, y2) = ((r["micro_batch"], r["plan/predicted_peak_bytes"]) for r in (a, b))
    if None in (y1, y2) or x1 == x2:
        return None
    per_sample = (y2 - y1) / (x2 - x1)
    return int((DEVICE_BYTES - (y1 - per_sample * x1)) // per_sample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(EXPERIMENTS), default=sorted(EXPERIMENTS))
    parser.add_argument("--out", type=Path, default=Path("memory.json"))
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/litscale-gpu-memory"))
    parser.add_argument("--max-doublings", type=int, default=5)
    parser.add_argument("--parts", nargs="+", choices=["strategies", "largest"], default=["strategies", "largest"])
    args = parser.parse_args()
    result: dict = {"strategies": [], "largest_micro_batch": []}

    def save(row: dict, table: str) -> None:
        result[table].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(result, indent=1))

    if args.out.exists():  # parts measured by an earlier call are kept
        result = json.loads(args.out.read_text())
    for model in args.models:
        for name, overrides in STRATEGIES.items() if "strategies" in args.parts else ():
            save({"strategy": name, **run(model, args.scratch / f"{model}-{name}", *overrides)}, "strategies")
        rows, batch = [], None
        for doubling in range(args.max_doublings if "largest" in args.parts else 0):
            batch = (rows[-1]["micro_batch"] * 2) if rows else None
            row = run(model, args.scratch / f"{model}-batch-{doubling}",
                      *([f"data.batch_size={batch}"] if batch else []))
            if "error" in row:
                save({"model": model, "largest_fitting": rows[-1]["micro_batch"] if rows else None,
                      "first_failing": batch, "failure": row["error"][:200],
                      "planner_predicted_largest": predicted_largest(rows[0], rows[-1]) if len(rows) > 1 else None},
                     "largest_micro_batch")
                break
            rows.append(row)
        else:
            if not rows:
                continue
            save({"model": model, "largest_fitting": rows[-1]["micro_batch"], "first_failing": None,
                  "planner_predicted_largest": predicted_largest(rows[0], rows[-1])}, "largest_micro_batch")


if __name__ == "__main__":
    main()
