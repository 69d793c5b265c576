"""Muon against AdamW at equal steps and at equal wall time, and Muon's step under FSDP.

(b) GPT-nano and Llama tiny on the byte corpus, ``optimizer=muon`` against ``optimizer=adamw``
at the same lr (1e-3: Muon's ``match_rms_adamw`` rule gives its matrices AdamW's update RMS)
and the same schedule, 3 seeds each: validation bits per byte after ``--steps`` steps, the
median step time, the optimizer state's bytes (the memory line's measurement), and the
validation loss at equal wall time (each run validates every ``--val-every`` steps; the
curve of the slower optimizer read at the faster one's last validation time).

(c) Muon's and AdamW's step time under ``strategy=fsdp`` at 2 and 4 ranks (one thread each),
GPT-nano, with the bytes every rank gathers per step for the orthogonalisation predicted:
each matrix's whole update, less the rank's own shard, in fp32.

    python experiments/muon/run.py                 # about 20 min on 2 cores; writes results.json
    python experiments/muon/run.py --steps 100 --seeds 1
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODELS = {"gpt-nano": ["model=gpt", "model.net.preset=nano"], "llama-tiny": ["model=llama"]}
COMMON = ["trainer.accelerator=cpu", "data.seq_len=64", "data.batch_size=16", "data.max_bytes=2000000",
          # the throughput and memory lines, without checkpoints
          "logger=csv", "~callbacks.model_checkpoint", "~callbacks.preemption", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=10",
          "trainer.limit_val_batches=8"]


def train(overrides: list[str], run_dir: Path) -> dict:
    command = [sys.executable, str(REPO / "train.py"), *COMMON, *overrides, f"hydra.run.dir={run_dir}"]
    process = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=3600)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}\n{process.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["val_curve"] = validation_curve(run_dir)
    return summary


def validation_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, val/loss) at each validation, from the run's CSV log."""
    points = []
    for path in run_dir.rglob("metrics.csv"):
        with open(path) as handle:
            for row in csv.DictReader(handle):
                if row.get("val/loss"):
                    points.append((int(row["step"]), float(row["val/loss"])))
    return sorted(points)


def loss_at(curve: list[tuple[int, float]], step: float) -> float:
    """The validation loss at ``step``, linear between validations."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:], strict=False):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return curve[-1][1]


def optimizers_compared(steps: int, seeds: int, val_every: int, work: Path) -> list[dict]:
    rows = []
    for model, model_overrides in MODELS.items():
        runs: dict[str, list[dict]] = {"adamw": [], "muon": []}
        for seed in range(1, seeds + 1):
            for optimizer in runs:
                summary = train([*model_overrides, f"optimizer={optimizer}", f"seed={seed}", f"trainer.max_steps={steps}",
                                 f"trainer.val_check_interval={val_every}"], work / f"{model}-{optimizer}-{seed}")
                runs[optimizer].append(summary)
        step_s = {name: statistics.median(s["perf/step_time_s"] for s in summaries) for name, summaries in runs.items()}
        faster, slower = sorted(runs, key=step_s.get)
        # At equal wall time: the slower optimizer's curve at the step it reaches in the time
        # the faster one took for all its steps.
        equal_time_step = steps * step_s[faster] / step_s[slower]
        for name, summaries in runs.items():
            row = {"model": model, "optimizer": name, "steps": steps,
                   "val_bpb": [round(s["val/bpb"], 4) for s in summaries],
                   "val_bpb_median": round(statistics.median(s["val/bpb"] for s in summaries), 4),
                   "step_s": round(step_s[name], 4),
                   "optimizer_state_mib": round(summaries[0]["memory/optimizer_bytes"] / 2**20, 3),
                   "val_loss_at_equal_time": round(statistics.median(
                       loss_at(s["val_curve"], equal_time_step if name == slower else steps) for s in summaries), 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def gathered_bytes_per_rank(world: int) -> int:
    """What each rank receives per step to orthogonalise GPT-nano's sharded matrices: every
    matrix whole, less its own shard, in fp32."""
    import torch

    from litscale.models.gpt import build_gpt
    from litscale.optim.muon import parameter_roles

    with torch.device("meta"):
        net = build_gpt(preset="nano", block_size=64)
    matrices = parameter_roles(net, 0.0)[0]["params"]
    return sum(p.numel() * 4 * (world - 1) // world for p in matrices)


def fsdp_step_times(steps: int, work: Path) -> list[dict]:
    rows = []
    for world in (2, 4):
        for optimizer in ("adamw", "muon"):
            summary = train([*MODELS["gpt-nano"], f"optimizer={optimizer}", "strategy=fsdp", f"trainer.devices={world}",
                             "launcher.oversubscribe=true", f"data.batch_size={16 // world}", f"trainer.max_steps={steps}",
                             "trainer.val_check_interval=1000", "trainer.limit_val_batches=0"],
                            work / f"fsdp{world}-{optimizer}")
            row = {"ranks": world, "optimizer": optimizer, "step_s": round(summary["perf/step_time_s"], 4),
                   "gathered_mib_per_rank_predicted": round(gathered_bytes_per_rank(world) / 2**20, 3)
                   if optimizer == "muon" else 0.0}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--fsdp-steps", type=int, default=30)
    parser.add_argument("--out", default=str(HERE / "results.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="litscale-muon-"))
    results = {"optimizers": optimizers_compared(args.steps, args.seeds, args.val_every, work),
               "fsdp": fsdp_step_times(args.fsdp_steps, work), "cores": os.cpu_count()}
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
