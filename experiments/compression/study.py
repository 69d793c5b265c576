"""Gradient compression study: every ``compression=`` option (and local SGD / DiLoCo) on
GPT-nano with 2 CPU ranks, several seeds, plus the bytes PowerSGD and top-k send for
GPT-small's shapes.

    python experiments/compression/study.py                  # all methods, 300 steps, 3 seeds
    python experiments/compression/study.py --steps 30 --seeds 0 --methods none topk

Writes ``results.json``, ``results.md`` (the tables) and ``loss_vs_bytes.png`` here.
Every byte figure is what the hooks counted as handed to collectives by rank 0
(``comm/bytes_sent``, the communication callback's running total), warm-up included; dense
bytes are the DDP buckets the hooks received (the dense all-reduce payload).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# SGD + momentum: error feedback's guarantees are for SGD (with Adam, a coordinate that
# top-k sends once in 100 steps gets one Adam-normalised step instead of 100).
COMMON = ["trainer.accelerator=cpu", "trainer.devices=2", "data.seq_len=32", "data.max_bytes=400000",
          "data.batch_size=8", "optimizer=sgd", "optimizer.lr=0.3", "trainer.limit_val_batches=8",
          "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=5",
          "callbacks.model_checkpoint.save_top_k=0", "callbacks.model_checkpoint.save_last=false"]
METHODS = {
    "none": ["strategy=ddp"],
    "fp16": ["strategy=ddp", "compression=fp16"],
    "bf16": ["strategy=ddp", "compression=bf16"],
    "powersgd": ["strategy=ddp", "compression=powersgd", "compression.rank=4"],
    "topk": ["strategy=ddp", "compression=topk", "compression.ratio=0.01"],
    "topk10": ["strategy=ddp", "compression=topk", "compression.ratio=0.1"],
    "qsgd": ["strategy=ddp", "compression=qsgd"],
    "terngrad": ["strategy=ddp", "compression=terngrad"],
    "signsgd": ["strategy=ddp", "compression=signsgd"],
    "local_sgd": ["strategy=local_sgd", "strategy.sync_every=8"],
    "local_sgd_h2": ["strategy=local_sgd", "strategy.sync_every=2"],
    "diloco": ["strategy=local_sgd", "strategy.sync_every=8", "strategy.outer_optimizer=nesterov"],
}
LABELS = {"none": "dense (none)", "powersgd": "powersgd rank 4", "topk": "topk 1% + EF",
          "topk10": "topk 10% + EF", "qsgd": "qsgd 7 levels", "signsgd": "signsgd + EF",
          "local_sgd": "local SGD H=8", "local_sgd_h2": "local SGD H=2", "diloco": "DiLoCo H=8"}
GOAL = 0.05  # "final validation loss within 5% of dense"


def train(method: str, seed: int, steps: int, outputs: Path) -> dict:
    name = f"{method}-seed{seed}"
    overrides = [*COMMON, *METHODS[method], f"seed={seed}", f"trainer.max_steps={steps}",
                 f"trainer.val_check_interval={steps}", f"name={name}"]
    env = {**os.environ, "LITSCALE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"}
    process = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=3600)
    if process.returncode:
        raise RuntimeError(f"{name} failed:\n{process.stderr[-3000:]}")
    summary = json.loads(next((outputs / name).glob("runs/*/summary.json")).read_text())
    rows = list(csv.DictReader((Path(summary["output_dir"]) / "csv" / "metrics.csv").open()))
    return {"summary": summary, "rows": rows,
            "command": "python train.py " + " ".join(overrides)}


def _by_step(rows: list[dict], key: str) -> dict[int, float]:
    # The CSV logger's rows are not in step order (validation rows are written apart).
    return {int(row["step"]): float(row[key]) for row in rows if row.get(key)}


def run_figures(run: dict, steps: int, dense_bytes_per_step: float) -> dict:
    """What one run did: losses, and its bytes from the callback's running totals. A run
    without a hook (dense DDP) sent the dense buckets every step."""
    summary, rows = run["summary"], run["rows"]
    sent, dense = _by_step(rows, "comm/bytes_sent"), _by_step(rows, "comm/dense_bytes")
    if not sent:  # no hook: DDP's own all-reduce of every bucket
        sent = dense = {step: step * dense_bytes_per_step for step in range(0, steps + 1, 5)}
    logged = sorted(sent)
    half = min(logged, key=lambda step: abs(step - steps // 2))
    last = logged[-1]
    losses = _by_step(rows, "train/loss")
    curve = [(step, sent[min((s for s in logged if s >= step), default=last)], loss)
             for step, loss in sorted(losses.items())]
    compress = _by_step(rows, "comm/compress_time_s")
    return {
        "val_loss": summary["val/loss"], "train_loss": summary["train/loss"],
        "bytes_sent": sent[last], "dense_bytes": dense[last], "steps_counted": last,
        "ratio_run": dense[last] / sent[last],
        # Steady state: the second half of the run, past any warm-up (PowerSGD's dense
        # start, local SGD's) and any early logging window.
        "ratio_steady": (dense[last] - dense[half]) / (sent[last] - sent[half]),
        "compress_time_ms": 1000 * statistics.mean(compress.values()) if compress else 0.0,
        "step_time_ms": 1000 * summary.get("perf/step_time_s", float("nan")),
        "curve": curve, "command": run["command"],
    }


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def nano_table(methods: list[str], seeds: list[int], steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        runs = {(method, seed): train(method, seed, steps, Path(scratch))
                for method in methods for seed in seeds}
    dense_per_step = next(float(r["comm/dense_bytes_per_step"]) for run in runs.values()
                          for r in run["rows"] if r.get("comm/dense_bytes_per_step"))
    table = []
    for method in methods:
        per_seed = [run_figures(runs[method, seed], steps, dense_per_step) for seed in seeds]
        val_mean, val_sd = _mean_sd([r["val_loss"] for r in per_seed])
        table.append({
            "method": method, "seeds": seeds, "runs": per_seed,
            "val_loss_mean": val_mean, "val_loss_sd": val_sd,
            **{key: statistics.mean(r[key] for r in per_seed)
               for key in ("ratio_run", "ratio_steady", "bytes_sent", "dense_bytes",
                           "compress_time_ms", "step_time_ms")},
        })
    dense_loss = next(r["val_loss_mean"] for r in table if r["method"] == "none")
    for r in table:
        r["vs_dense"] = r["val_loss_mean"] / dense_loss - 1
        r["meets_goal"] = r["vs_dense"] <= GOAL
    return table


def shape_table(preset: str) -> list[dict]:
    """Bytes one step of each hook sends for ``preset``'s parameter shapes, measured by
    running the hooks (1-rank gloo group) on random gradients in DDP-sized buckets."""
    subprocess_code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import shapes; shapes.main({preset!r})"
    process = subprocess.run([sys.executable, "-c", subprocess_code], cwd=REPO, capture_output=True,
                             text=True, timeout=3600)
    if process.returncode:
        raise RuntimeError(process.stderr[-3000:])
    return json.loads(process.stdout.strip().splitlines()[-1])


def write_report(results: dict) -> None:
    seeds = results["seeds"]
    lines = [f"## GPT-nano, 2 CPU ranks (gloo), {results['steps']} steps, seeds {seeds}", "",
             "| method | final val loss (mean ± sd) | vs dense | within 5%? | ratio over the run "
             "| ratio, 2nd half | bytes sent (rank 0) | compress ms/step | step ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["nano"]:
        lines.append(
            f"| {LABELS.get(r['method'], r['method'])} | {r['val_loss_mean']:.3f} ± {r['val_loss_sd']:.3f} "
            f"| {100 * r['vs_dense']:+.1f}% | {'yes' if r['meets_goal'] else '**no**'} "
            f"| {r['ratio_run']:.1f}x | {r['ratio_steady']:.1f}x | {r['bytes_sent'] / 2**20:,.1f} MiB "
            f"| {r['compress_time_ms']:.1f} | {r['step_time_ms']:.0f} |")
    for preset in ("nano", "small"):
        lines += ["", f"## Bytes per step on GPT-{preset}'s parameter shapes (hooks run on random gradients)", "",
                  "| method | dense bytes | sent bytes | ratio |", "|---|---|---|---|"]
        for r in results["shapes"][preset]:
            lines.append(f"| {r['method']} | {r['dense']:,} | {r['sent']:,} | {r['dense'] / r['sent']:.1f}x |")
    lines += ["", f"Machine: {results['machine']}; wall time {results['wall_time_s'] / 60:.0f} min", ""]
    report = "\n".join(lines)
    (HERE / "results.md").write_text(report)
    readme = (HERE / "README.md").read_text()
    start, end = "<!-- results: written by study.py -->", "<!-- end results -->"
    if start in readme and end in readme:
        before, rest = readme.split(start, 1)
        after = rest.split(end, 1)[1]
        plot_line = "\n![loss vs bytes](loss_vs_bytes.png)\n"
        (HERE / "README.md").write_text(f"{before}{start}\n{report}{plot_line}{end}{after}")


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for r in results["nano"]:
        # Each seed's points: (step, rank 0's cumulative bytes as its hook counted them, train
        # loss); the mean over seeds at each logged step, smoothed over 5 logged points.
        curves = [run["curve"] for run in r["runs"]]
        length = min(len(c) for c in curves)
        sent = [statistics.mean(c[i][1] for c in curves) for i in range(length)]
        loss = [statistics.mean(c[i][2] for c in curves) for i in range(length)]
        smooth = [statistics.mean(loss[max(0, i - 4):i + 1]) for i in range(length)]
        axis.plot(sent, smooth, label=LABELS.get(r["method"], r["method"]))
    axis.set_xscale("log")
    axis.set_xlabel("cumulative bytes sent by rank 0 (measured by the hooks)")
    axis.set_ylabel(f"train loss (mean of {len(results['seeds'])} seeds, running mean of 5)")
    axis.set_title(f"GPT-nano, 2 CPU ranks, {results['steps']} steps: loss vs bytes on the wire")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(HERE / "loss_vs_bytes.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the tables and plot from results.json, running nothing")
    args = parser.parse_args()
    if args.report_only:
        results = json.loads((HERE / "results.json").read_text())
        write_report(results)
        plot(results)
        return
    started = time.time()
    results = {
        "steps": args.steps, "seeds": args.seeds,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
        "command": "python experiments/compression/study.py " + " ".join(sys.argv[1:]),
        "shapes": {preset: shape_table(preset) for preset in ("nano", "small")},
        "nano": nano_table(["none", *[m for m in args.methods if m != "none"]], args.seeds, args.steps),
    }
    results["wall_time_s"] = time.time() - started
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results)
    plot(results)
    print((HERE / "results.md").read_text())


if __name__ == "__main__":
    main()
