"""The scaling report of a sweep: a table and a plot of throughput and efficiency vs devices.

Written to the sweep dir at the end of every multirun (``ScalingReport``, a Hydra callback),
and logged to W&B when the sweep used ``logger=wandb``. ``python -m litscale.app.report DIR``
makes it for any folder of finished runs; the notebook and the scaling study use the same
functions.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from litscale.app.scaling_study import THROUGHPUT, scaling_metrics, variant_of

COLUMNS = ("variant", "devices", "samples/s", "tokens/s", "speedup", "efficiency", "MFU", "val/loss",
           "planner error", "not to be believed")


def load_summaries(root: str) -> list[dict]:
    """Every ``summary.json`` under ``root`` (each with its ``run_dir``), oldest first."""
    paths = sorted(glob.glob(os.path.join(glob.escape(root), "**", "summary.json"), recursive=True),
                   key=os.path.getmtime)
    summaries = []
    for path in paths:
        with open(path) as handle:
            summaries.append({**json.load(handle), "run_dir": os.path.dirname(path)})
    return summaries


def scaling_rows(summaries: list[dict]) -> list[dict[str, Any]]:
    """One row per run, efficiency against its variant's 1-device run (recomputed here, so a
    sweep that ran its 1-device job last still gets every figure), else against the baseline
    the run named (``scaling.baseline``)."""
    baselines = {variant_of(s.get("overrides", [])): s for s in summaries if s.get("world_size") == 1}
    labels = variant_labels([variant_of(s.get("overrides", [])) for s in summaries])
    rows = []
    for summary in summaries:
        variant = variant_of(summary.get("overrides", []))
        baseline = baselines.get(variant)
        # No 1-device job of its own (a pipeline needs 2 ranks): the baseline the run named.
        metrics = scaling_metrics(summary, baseline) if baseline else summary
        rows.append({
            "variant": labels[variant] or summary.get("choices", {}).get("strategy", "default"),
            "devices": summary.get("world_size", 1),
            "samples/s": summary.get(THROUGHPUT), "tokens/s": summary.get("perf/tokens_per_sec"),
            "speedup": metrics.get("scaling/speedup"), "efficiency": metrics.get("scaling/efficiency"),
            "MFU": summary.get("perf/mfu"), "val/loss": summary.get("val/loss"),
            "planner error": planner_error(summary),
            "not to be believed": "; ".join(metrics.get("scaling/flags", []) + mfu_flags(summary)) or None,
            "run_dir": summary["run_dir"],
        })
    return sorted(rows, key=lambda row: (row["variant"], row["devices"]))


def mfu_flags(summary: dict) -> list[str]:
    """Why a run's MFU is provisional (its CPU peak was not probed on a quiet machine, or the
    run beat it)."""
    return [f"MFU provisional: {summary['perf/mfu_provisional']}"] if summary.get("perf/mfu_provisional") else []


def planner_error(summary: dict) -> float | None:
    """The planner's predicted step over the measured one, less 1 (None: no prediction)."""
    predicted, measured = summary.get("plan/predicted_step_s"), summary.get("perf/step_time_s")
    return predicted / measured - 1 if predicted and measured else None


def variant_labels(variants: list[str]) -> dict[str, str]:
    """Each variant shown by the overrides that tell it apart (the shared ones say nothing)."""
    parts = {variant: set(variant.split()) for variant in variants}
    shared = set.intersection(*parts.values()) if parts else set()
    return {variant: " ".join(sorted(p - shared)) for variant, p in parts.items()}


def _cell(value: Any, column: str) -> str:
    if value is None:
        return "-" if column == "not to be believed" else "n/a"
    if column in ("efficiency", "MFU"):
        return f"{value:.1%}"
    if column == "speedup":
        return f"{value:.2f}x"
    if column == "planner error":
        return f"{value:+.0%}"
    if isinstance(value, float):
        return f"{value:,.1f}" if column.endswith("/s") else f"{value:.4f}"
    return str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row[c], c) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str) -> str | None:
    """Throughput and efficiency vs devices, one line per variant; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for variant in dict.fromkeys(row["variant"] for row in rows):
        points = [r for r in rows if r["variant"] == variant and r["samples/s"]]
        devices = [r["devices"] for r in points]
        line, = left.plot(devices, [r["samples/s"] for r in points], marker="o", label=variant)
        base = next((r["samples/s"] / r["speedup"] for r in points if r["speedup"]), None)
        if base:  # linear scaling from this variant's 1-device throughput
            left.plot(devices, [base * n for n in devices], linestyle=":", color=line.get_color())
        efficient = [r for r in points if r["efficiency"] is not None]
        right.plot([r["devices"] for r in efficient], [r["efficiency"] for r in efficient],
                   marker="o", label=variant)
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="ideal")
    left.set(xlabel="devices", ylabel="samples/s", title="Throughput (dotted: linear)")
    right.set(xlabel="devices", ylabel="throughput(N) / (N x throughput(1))",
              title="Scaling efficiency", ylim=(0, 1.2))
    left.set_ylim(bottom=0)
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.set_xticks(sorted({row["devices"] for row in rows}))
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_report(root: str, out_dir: str | None = None) -> dict[str, str] | None:
    """``scaling_report.{md,json,png}`` for the runs under ``root``; None when there are none."""
    rows = scaling_rows(load_summaries(root))
    if not rows:
        return None
    out_dir = out_dir or root
    paths = {"markdown": os.path.join(out_dir, "scaling_report.md"),
             "json": os.path.join(out_dir, "scaling_report.json")}
    with open(paths["markdown"], "w") as handle:
        handle.write("# Scaling report\n\n" + markdown_table(rows))
    with open(paths["json"], "w") as handle:
        json.dump(rows, handle, indent=2)
    image = plot(rows, os.path.join(out_dir, "scaling_report.png"))
    if image:
        paths["plot"] = image
    return paths


def log_to_wandb(paths: dict[str, str], *, config: DictConfig) -> None:
    """The report as a W&B table (+ plot) in its own run of the sweep's group."""
    import wandb

    from litscale.loggers import wandb_api_key_configured

    node = config.logger.wandb
    offline = node.get("offline")
    offline = not wandb_api_key_configured() if offline is None else offline
    sweep = os.path.basename(str(config.hydra.sweep.dir).rstrip("/"))
    with open(paths["json"]) as handle:
        rows = json.load(handle)
    run = wandb.init(project=node.get("project") or "litscale", dir=str(config.hydra.sweep.dir),
                     group=node.get("group") or f"{config.name}-{sweep}", job_type="scaling-report",
                     name=f"{config.name}-scaling-report", mode="offline" if offline else "online")
    run.log({"scaling/report": wandb.Table(columns=list(COLUMNS),
                                           data=[[row[c] for c in COLUMNS] for row in rows])}
            | ({"scaling/plot": wandb.Image(paths["plot"])} if "plot" in paths else {}))
    run.finish()


class ScalingReport(Callback):
    """Hydra callback: at the end of a multirun, the scaling report of its jobs."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = str(config.hydra.sweep.dir)
        paths = write_report(sweep_dir) if os.path.isdir(sweep_dir) else None
        if paths is None:
            return
        shown = ", ".join(os.path.basename(p) for p in paths.values())
        print(f"litscale: scaling report: {sweep_dir} ({shown})", flush=True)
        if "wandb" in (config.get("logger") or {}):
            log_to_wandb(paths, config=config)


if __name__ == "__main__":
    written = write_report(sys.argv[1] if len(sys.argv) > 1 else "outputs")
    print(json.dumps(written, indent=2) if written else "no summary.json found")
