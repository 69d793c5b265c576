"""litscale against a plain PyTorch loop on one GPU, alternating, and float8 against bf16.

    python experiments/gpu/throughput.py --models gpt2_small llama_1b --repeats 2 --fp8 --out results.json

Each repeat runs ``python train.py experiment=<model>_h100 trainer=gpu`` then
``experiments/gpu/plain_loop.py`` with the same network, batch and sequence length (so a slow
minute of the machine hits both alike). litscale's figure is its summary's steady-state
``perf/tokens_per_sec`` (throughput callback, after its warm-up steps); the loop's is the same
mean over the same steps. ``--fp8`` adds litscale runs with ``precision=fp8`` (tensorwise and
rowwise recipes) beside bf16, with their loss curves (the CSV logger's ``train/loss``).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = {"gpt2_small": "gpt2_small_h100", "llama_1b": "llama_1b_h100"}


def litscale_run(model: str, steps: int, warmup: int, outputs: Path, *extra: str) -> dict:
    outputs.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "train.py", f"experiment={EXPERIMENTS[model]}", "trainer=gpu",
               f"trainer.max_steps={steps}", f"callbacks.throughput.warmup_steps={warmup}",
               "~callbacks.model_checkpoint", *extra]
    started = time.perf_counter()
    process = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "LITSCALE_OUTPUTS": str(outputs)})
    if process.returncode != 0:
        return {"runner": "litscale", "model": model, "extra": list(extra), "error": process.stderr[-2000:]}
    (path,) = glob.glob(str(outputs / "**" / "summary.json"), recursive=True)
    summary = json.loads(Path(path).read_text())
    return {"runner": "litscale", "model": model, "extra": list(extra), "wall_s": time.perf_counter() - started,
            "tokens_per_sec": summary.get("perf/tokens_per_sec"), "mfu": summary.get("perf/mfu"),
            "train_loss": summary.get("train/loss"), "losses": loss_curve(Path(path).parent),
            "peak_memory_gib": (summary.get("memory/peak_bytes") or 0) / 2**30 or None}


def loss_curve(run_dir: Path) -> list[list[float]]:
    rows = []
    for path in glob.glob(str(run_dir / "**" / "metrics.csv"), recursive=True):
        with open(path) as handle:
            rows += [[int(r["step"]), float(r["train/loss"])] for r in csv.DictReader(handle)
                     if r.get("train/loss")]
    return sorted(rows)


def plain_run(model: str, steps: int, warmup: int) -> dict:
    process = subprocess.run([sys.executable, "experiments/gpu/plain_loop.py", "--model", model,
                              "--steps", str(steps), "--warmup", str(warmup)],
                             cwd=REPO, capture_output=True, text=True)
    if process.returncode != 0:
        return {"runner": "plain", "model": model, "error": process.stderr[-2000:]}
    return json.loads(process.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(EXPERIMENTS), default=["gpt2_small"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("results.json"))
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/litscale-gpu-runs"))
    args = parser.parse_args()
    runs = []

    def record(run: dict) -> None:
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "losses"}), flush=True)
        args.out.write_text(json.dumps({"runs": runs, "medians": medians(runs)}, indent=1))

    for model in args.models:
        for repeat in range(args.repeats):
            record(litscale_run(model, args.steps, args.warmup, args.scratch / f"{model}-{repeat}"))
            record(plain_run(model, args.steps, args.warmup))
        if args.fp8:
            for recipe in ("tensorwise", "rowwise"):
                record(litscale_run(model, args.steps, args.warmup, args.scratch / f"{model}-fp8-{recipe}",
                                    "precision=fp8", f"precision.float8={recipe}"))


def medians(runs: list[dict]) -> dict:
    groups: dict[str, list[float]] = {}
    for run in runs:
        if run.get("tokens_per_sec"):
            key = "/".join([run["runner"], run["model"], *run.get("extra", [])])
            groups.setdefault(key, []).append(run["tokens_per_sec"])
    return {key: statistics.median(values) for key, values in groups.items()}


if __name__ == "__main__":
    main()
