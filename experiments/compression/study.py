"""Gradient compression study: every ``compression=`` option (and local SGD / DiLoCo) on
GPT-nano with 2 CPU ranks, plus the bytes PowerSGD and top-k send for GPT-small's shapes.

    python experiments/compression/study.py                 # all methods, 150 steps each
    python experiments/compression/study.py --steps 30 --methods none topk

Writes ``results.json``, ``results.md`` (the tables) and ``loss_vs_bytes.png`` here.
Bytes are what the hooks counted as handed to collectives by one rank per optimizer step;
dense bytes are the DDP buckets the hooks received (the dense all-reduce payload).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
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
    "qsgd": ["strategy=ddp", "compression=qsgd"],
    "terngrad": ["strategy=ddp", "compression=terngrad"],
    "signsgd": ["strategy=ddp", "compression=signsgd"],
    "local_sgd": ["strategy=local_sgd", "strategy.sync_every=8"],
    "diloco": ["strategy=local_sgd", "strategy.sync_every=8", "strategy.outer_optimizer=nesterov"],
}
LABELS = {"none": "dense (none)", "powersgd": "powersgd rank 4", "topk": "topk 1% + EF",
          "qsgd": "qsgd 7 levels", "signsgd": "signsgd + EF", "local_sgd": "local SGD H=8",
          "diloco": "DiLoCo H=8"}


def train(method: str, steps: int, outputs: Path) -> dict:
    overrides = [*COMMON, *METHODS[method], f"trainer.max_steps={steps}",
                 f"trainer.val_check_interval={steps}", f"name={method}"]
    env = {**os.environ, "LITSCALE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"}
    process = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=3600)
    if process.returncode:
        raise RuntimeError(f"{method} failed:\n{process.stderr[-3000:]}")
    summary = json.loads(next((outputs / method).glob("runs/*/summary.json")).read_text())
    rows = list(csv.DictReader((Path(summary["output_dir"]) / "csv" / "metrics.csv").open()))
    return {"summary": summary, "rows": rows, "command": "python train.py " + " ".join(overrides)}


def curve(rows: list[dict], dense_bytes_per_step: float) -> list[tuple[int, float, float]]:
    """(step, cumulative bytes sent, train loss) at each logged step."""
    points, sent, last_step = [], 0.0, 0
    # The CSV logger's rows are not in step order (validation rows are written apart).
    for row in sorted((r for r in rows if r.get("train/loss")), key=lambda r: int(r["step"])):
        step = int(row["step"])
        per_step = next((float(r["comm/bytes_per_step"]) for r in rows
                         if r.get("comm/bytes_per_step") and int(r["step"]) >= step), dense_bytes_per_step)
        sent += per_step * (step - last_step)
        last_step = step
        points.append((step, sent, float(row["train/loss"])))
    return points


def nano_table(methods: list[str], steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        runs = {method: train(method, steps, Path(scratch)) for method in methods}
    dense = next((float(r["comm/dense_bytes_per_step"]) for run in runs.values() for r in run["rows"]
                  if r.get("comm/dense_bytes_per_step")), None)
    table = []
    for method, run in runs.items():
        summary, comm = run["summary"], [r for r in run["rows"] if r.get("comm/bytes_per_step")]
        sent = float(comm[-1]["comm/bytes_per_step"]) if comm else dense
        table.append({
            "method": method, "val_loss": summary["val/loss"], "train_loss": summary["train/loss"],
            "bytes_per_step": sent, "dense_bytes_per_step": dense,
            "compression_ratio": dense / sent,
            "compress_time_ms": 1000 * float(comm[-1]["comm/compress_time_s"]) if comm else 0.0,
            "step_time_ms": 1000 * summary.get("perf/step_time_s", float("nan")),
            "curve": curve(run["rows"], dense), "command": run["command"],
        })
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
    lines = ["## GPT-nano, 2 CPU ranks (gloo), " + f"{results['steps']} steps", "",
             "| method | final val loss | vs dense | bytes/step (rank) | ratio | compress ms/step | step ms |",
             "|---|---|---|---|---|---|---|"]
    dense_loss = next(r["val_loss"] for r in results["nano"] if r["method"] == "none")
    for r in results["nano"]:
        lines.append(f"| {LABELS.get(r['method'], r['method'])} | {r['val_loss']:.3f} | "
                     f"{100 * (r['val_loss'] / dense_loss - 1):+.1f}% | {r['bytes_per_step']:,.0f} | "
                     f"{r['compression_ratio']:.1f}x | {r['compress_time_ms']:.1f} | {r['step_time_ms']:.0f} |")
    for preset in ("nano", "small"):
        lines += ["", f"## Bytes per step on GPT-{preset}'s parameter shapes (hooks run on random gradients)", "",
                  "| method | dense bytes | sent bytes | ratio |", "|---|---|---|---|"]
        for r in results["shapes"][preset]:
            lines.append(f"| {r['method']} | {r['dense']:,} | {r['sent']:,} | {r['dense'] / r['sent']:.1f}x |")
    lines += ["", f"Machine: {results['machine']}", ""]
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
        steps, _, loss = zip(*sorted(r["curve"]), strict=True)
        # Bytes at step s = s x the method's bytes per step; the loss is rank 0's per-step
        # train loss, smoothed over 5 logged points so methods can be told apart.
        sent = [step * r["bytes_per_step"] for step in steps]
        smooth = [sum(loss[max(0, i - 4):i + 1]) / len(loss[max(0, i - 4):i + 1]) for i in range(len(loss))]
        axis.plot(sent, smooth, label=LABELS.get(r["method"], r["method"]))
    axis.set_xscale("log")
    axis.set_xlabel("cumulative bytes sent by one rank")
    axis.set_ylabel("train loss (rank 0, running mean of 5)")
    axis.set_title(f"GPT-nano, 2 CPU ranks, {results['steps']} steps: loss vs bytes on the wire")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(HERE / "loss_vs_bytes.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
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
        "steps": args.steps,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
        "shapes": {preset: shape_table(preset) for preset in ("nano", "small")},
        "nano": nano_table(["none", *[m for m in args.methods if m != "none"]], args.steps),
    }
    results["wall_time_s"] = time.time() - started
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results)
    plot(results)
    print((HERE / "results.md").read_text())


if __name__ == "__main__":
    main()
