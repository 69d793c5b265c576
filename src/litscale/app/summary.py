"""What a run says at its start and its end, and ``summary.json``.

``summary.json`` in the run dir is the machine-readable record of a run: reports, notebooks
and tests read it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_only

from litscale.app.build import BuiltRun
from litscale.app.prediction import RunPrediction
from litscale.app.scaling_study import ScalingContext, find_baseline, scaling_metrics
from litscale.callbacks.communication import CommunicationCallback
from litscale.callbacks.memory import MemoryCallback
from litscale.callbacks.moe import MoEStatsCallback
from litscale.callbacks.straggler import StragglerReport
from litscale.callbacks.throughput import ThroughputCallback
from litscale.callbacks.watchdog import HangWatchdog

# Callbacks whose ``result`` (figures of the whole run) goes into summary.json.
MEASURING_CALLBACKS = (ThroughputCallback, MemoryCallback, CommunicationCallback, StragglerReport, MoEStatsCallback,
                       HangWatchdog)


def _count_params(module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def _say(line: str) -> None:
    print(f"litscale: {line}", flush=True)


def _speaks_for_the_job(built: BuiltRun) -> bool:
    """Whether this run's start and end are printed: under ``fault_tolerance=replicas`` only
    replica group 0's (the groups run the same layout; each writes its own summary.json)."""
    return built.replica_group is None or built.replica_group.group == 0


@rank_zero_only
def print_start(built: BuiltRun) -> None:
    """Derived numbers, computed once and printed: model size, strategy, devices, precision,
    and the run layout (processes, mesh, batch). The LR the global batch implies is the
    LR-scaling callback's line."""
    if not _speaks_for_the_job(built):
        return
    trainer, choices = built.trainer, built.choices
    net = built.config.model.get("net", {})
    model = choices.get("model", "model") + (f"-{net.preset}" if "preset" in net else "")
    _say(
        f"{model} {_count_params(built.module) / 1e6:.2f}M params | "
        f"strategy {choices.get('strategy', type(trainer.strategy).__name__)} | "
        f"{trainer.world_size} x {trainer.strategy.root_device.type} | "
        f"precision {built.config.precision.lightning} | max steps {trainer.max_steps}"
    )
    _say(f"layout: {built.layout.describe()}")


def _metric(trainer: Trainer, name: str) -> float | None:
    value = trainer.callback_metrics.get(name)
    return None if value is None else float(value)


def summarize(built: BuiltRun, *, started_at: float, export: str | None = None,
              scaling: ScalingContext | None = None, prediction: RunPrediction | None = None) -> dict:
    """Collect final metrics; rank 0 adds scaling efficiency against its baseline (and logs
    it) and the planner's ``prediction`` (made before launch) beside the step it measured,
    writes ``summary.json`` and prints a few lines."""
    trainer, module = built.trainer, built.module
    measured = {name: value for callback in trainer.callbacks if isinstance(callback, MEASURING_CALLBACKS)
                for name, value in callback.result.items()}
    measured.update(getattr(trainer.strategy, "result", {}))  # a strategy's own record (federated rounds)
    layout = built.layout
    summary = {
        "train/loss": _metric(trainer, "train/loss"),
        "train/grad_norm": _metric(trainer, "train/grad_norm"),
        "val/loss": _metric(trainer, "val/loss"),
        "val/loss_initial": getattr(module, "initial_val_loss", None),
        "val/bpb": _metric(trainer, "val/bpb"),
        "val/accuracy": _metric(trainer, "val/accuracy"),
        **measured,
        **_lr_scaling(trainer),
        "steps": trainer.global_step,
        "global_batch": layout.global_batch,
        "micro_batch": layout.micro_batch,
        "data_parallel_size": layout.data_parallel_size,
        "accumulate_grad_batches": layout.accumulation,
        "layout": layout.as_dict(),
        "lr": _scaled_lr(trainer),
        "world_size": layout.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "num_params": _count_params(module),
        "data": _data_facts(built.datamodule),
        "choices": built.choices,
        "overrides": scaling.overrides if scaling else [],
        "scaling/mode": "strong" if layout.strong_scaling else "weak",
        "output_dir": os.path.abspath(built.config.paths.output_dir),
        "checkpoint": _best_checkpoint(trainer),
        "export": export,  # the consolidated weights of the net (litscale.checkpoint.export)
        "export_hf": _hf_export_dir(export, built.config),
        "wall_time_s": time.time() - started_at,
    }
    summary = {k: v for k, v in summary.items() if v is not None}
    if trainer.is_global_zero:
        summary.update(_log_scaling(trainer, summary, scaling or ScalingContext()))
        # A step watched for its CPU memory peak (memory/peak_rank) is slowed by the watching:
        # its time is no measurement to hold a prediction to.
        timed = "memory/peak_rank" not in summary
        if prediction is not None:  # made before launch (app.run.predict_once): held to the step measured
            summary.update(prediction.held_to(summary.get("perf/step_time_s") if timed else None))
        path = os.path.join(summary["output_dir"], "summary.json")
        os.makedirs(summary["output_dir"], exist_ok=True)
        _plot_label_histograms(summary)
        summary.update(_loss_curve(trainer, summary["output_dir"]))
        _log_data_facts(trainer, summary.get("data") or {})
        with open(path + ".tmp", "w") as handle:
            json.dump(summary, handle, indent=2)
        os.replace(path + ".tmp", path)  # never a half-written summary
        if _speaks_for_the_job(built):
            _print_end(summary)
    return summary


def _log_scaling(trainer: Trainer, summary: dict, context: ScalingContext) -> dict[str, float]:
    """``scaling/*`` against the baseline, logged at the last step (rank 0 only)."""
    baseline = find_baseline(context)
    metrics = scaling_metrics(summary, baseline)
    if metrics and (baseline is not None or context.sweep_dir):
        figures = {name: value for name, value in metrics.items() if name != "scaling/flags"}
        for logger in trainer.loggers:
            logger.log_metrics(figures, step=trainer.global_step)
        return metrics
    return {}


def _scaled_lr(trainer: Trainer) -> float | None:
    """The peak LR after the lr_scaling rule (None without the callback)."""
    return _lr_scaling(trainer).get("lr_scaling/peak_lr")


def _lr_scaling(trainer: Trainer) -> dict:
    """What the LR-scaling rule did: rule, base and scaled peak LR, the global batch it saw."""
    from litscale.optim.lr_scaling import LRScaling

    rule = next((c for c in trainer.callbacks if isinstance(c, LRScaling) and c.lr is not None), None)
    if rule is None:
        return {}
    return {"lr_scaling/rule": rule.rule, "lr_scaling/base_lr": rule.base_lr,
            "lr_scaling/peak_lr": rule.lr, "lr_scaling/base_batch_size": rule.base_batch_size,
            "lr_scaling/global_batch": rule.global_batch}


def _hf_export_dir(export: str | None, config) -> str | None:
    """``<run dir>/hf/`` where ``export_hf=true`` wrote a transformers directory beside ``model.pt``."""
    from litscale.checkpoint.export import HF_DIRNAME

    if export is None or not config.get("export_hf", False):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(export)), HF_DIRNAME)


def _best_checkpoint(trainer: Trainer) -> str | None:
    callback = trainer.checkpoint_callback
    if callback is None:
        return None
    return getattr(callback, "last_model_path", None) or getattr(callback, "best_model_path", None) or None


# What a data module can say of what it feeds the model (token data: its vocabulary and the
# bytes per token that turn val/loss into val/bpb; the tokenizer is added by name).
DATA_FACTS = ("vocab_size", "seq_len", "val_bytes_per_token")


def _data_facts(datamodule) -> dict | None:
    facts = {name: getattr(datamodule, name) for name in DATA_FACTS
             if isinstance(getattr(datamodule, name, None), (int, float))}
    facts.update(getattr(datamodule, "partition_facts", None) or {})  # clients' labels (non-IID)
    tokenizer = getattr(datamodule, "tokenizer", None)
    if isinstance(getattr(tokenizer, "name", None), str):
        facts["tokenizer"] = tokenizer.name
    run_facts = getattr(datamodule, "run_facts", None)  # what a run trained on (data=sft: tokens, packing, sources)
    if run_facts is not None:
        facts.update(run_facts())
    return facts or None


# Figures of data=sft that the loggers (W&B) get too, as data/<name>.
LOGGED_DATA_FACTS = ("tokens_trained", "tokens_seen", "packing_efficiency")


def _log_data_facts(trainer: Trainer, facts: dict) -> None:
    """The tokens trained on beside those seen, the packing efficiency and each source's share,
    logged at the last step (rank 0 only)."""
    metrics = {f"data/{name}": float(facts[name]) for name in LOGGED_DATA_FACTS if name in facts}
    metrics.update({f"data/source_share/{name}": share for name, share in (facts.get("source_shares") or {}).items()})
    if metrics:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def _loss_curve(trainer: Trainer, output_dir: str) -> dict:
    """``loss_curve.png`` beside summary.json, from what the run logged (``LossCurve``)."""
    from litscale.callbacks.loss_curve import LossCurve, plot_loss_curve

    curve = next((c for c in trainer.callbacks if isinstance(c, LossCurve)), None)
    plot = None if curve is None else plot_loss_curve(curve.points, os.path.join(output_dir, "loss_curve.png"))
    return {"loss_curve_plot": plot} if plot else {}


def _plot_label_histograms(summary: dict) -> None:
    """``label_histograms.png`` beside summary.json: each client's samples by class."""
    histograms = (summary.get("data") or {}).get("label_histograms")
    if histograms:
        from litscale.data.partition import plot_label_histograms

        plot = plot_label_histograms(histograms, os.path.join(summary["output_dir"], "label_histograms.png"))
        summary["data"]["label_histograms_plot"] = plot


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _print_end(summary: dict) -> None:
    losses = f"train/loss {_fmt(summary.get('train/loss'))}"
    if "val/loss" in summary:
        losses += f" | val/loss {_fmt(summary['val/loss'])}"
        if "val/loss_initial" in summary:
            losses += f" (from {_fmt(summary['val/loss_initial'])})"
    for extra in ("val/bpb", "val/accuracy"):
        if extra in summary:
            losses += f" | {extra} {_fmt(summary[extra])}"
    _say(f"done: {summary['steps']} steps in {summary['wall_time_s']:.1f} s | {losses}")
    if "perf/samples_per_sec" in summary:
        rate = f"{summary['perf/samples_per_sec']:,.1f} samples/s"
        if "perf/tokens_per_sec" in summary:
            rate += f", {summary['perf/tokens_per_sec']:,.0f} tokens/s"
        _say(f"throughput {rate} over {summary['world_size']} process(es), steady state")
    if "perf/mfu" in summary:
        comm = "" if "perf/comm_share" not in summary else (
            f" | gradient all-reduce {summary['perf/comm_share']:.0%} of a step, "
            f"{summary.get('perf/comm_exposed_share', float('nan')):.0%} not overlapped")
        _say(f"MFU {summary['perf/mfu']:.1%} ({summary['perf/tflops']:.3g} TFLOP/s){comm}{mfu_caveats(summary)}")
    if "comm/compression_ratio" in summary:
        _say(f"compression {summary['comm/compression_ratio']:.1f}x fewer bytes than dense over the "
             f"run | {summary['comm/bytes_per_step'] / 2**20:.3g} MiB sent per step by rank 0 "
             f"(dense {summary['comm/dense_bytes_per_step'] / 2**20:.3g} MiB) | "
             f"{summary['comm/compress_time_s'] * 1e3:.2f} ms compressing per step")
    if "health/slowest_rank" in summary:
        _say(f"slowest rank: {summary['health/slowest_rank']} at {summary['health/straggler_ratio']:.2f}x "
             "the median of its peers' forward times (median over the run)")
    data = summary.get("data") or {}
    if "tokens_trained" in data:
        shares = ", ".join(f"{name} {share:.1%}" for name, share in (data.get("source_shares") or {}).items())
        _say(f"data: trained on {data['tokens_trained']:,} of {data['tokens_seen']:,} tokens seen | packing "
             f"efficiency {data['packing_efficiency']:.1%} | {data.get('examples_truncated', 0)} examples truncated, "
             f"{data.get('examples_dropped_overlong', 0)} dropped as too long" + (f" | sources: {shares}" if shares else ""))
    _print_prediction(summary)
    if "scaling/efficiency" in summary:
        flags = summary.get("scaling/flags")
        _say(f"scaling: {summary['scaling/speedup']:.2f}x speedup on {summary['world_size']} "
             f"devices = {summary['scaling/efficiency']:.1%} efficiency ({summary['scaling/mode']})"
             + (f"; not a measurement to trust: {'; '.join(flags)}" if flags else ""))
    exports = "".join(f", {os.path.basename(summary[k].rstrip(os.sep))}{'/' if k == 'export_hf' else ''}"
                      for k in ("export", "export_hf") if k in summary)
    _say(f"outputs: {summary['output_dir']} (summary.json, checkpoints/{exports}, logs)")


def mfu_caveats(summary: dict) -> str:
    """What the MFU line must say beside its figure: that the peak it divides by is provisional,
    or that the run's 16-bit matmuls are emulated on this CPU (its 16-bit peak far below fp32's)."""
    caveats = []
    ratio = summary.get("perf/peak_vs_fp32")
    if ratio is not None and ratio < 1:
        caveats.append(f"of this CPU's 16-bit peak, {1 / ratio:.3g}x below its fp32 one (no 16-bit units: "
                       "emulated, so fp32 runs faster here)")
    if summary.get("perf/mfu_provisional"):
        caveats.append(f"provisional: {summary['perf/mfu_provisional']}")
    return "".join(f" | {caveat}" for caveat in caveats)


def _print_prediction(summary: dict) -> None:
    """The planner's step time beside the measured one; a prediction the run contradicted, or
    one withheld because an earlier run did, says so."""
    withheld = summary.get("plan/withheld")
    if withheld:
        _say(f"planner: no prediction for this model and layout: its last one, {withheld['predicted_step_s']:.4g} "
             f"s/step, was contradicted by the {withheld['measured_step_s']:.4g} s/step measured in "
             f"{withheld['run']}; plan=show times it again")
        return
    if "plan/predicted_step_s" not in summary or "perf/step_time_s" not in summary:
        return
    source = "" if summary.get("plan/compute_source") != "flops" else (
        " (compute from FLOPs: plan=show times this model here once, and runs read that)")
    line = (f"planner: predicted {summary['plan/predicted_step_s']:.4g} s/step on cluster "
            f"{summary['plan/cluster']}{source}, measured {summary['perf/step_time_s']:.4g} s/step")
    if summary.get("plan/dropped"):
        line += (f": {summary['plan/off_by']:.1f}x off, so no longer used for this model and layout "
                 "(plan=show times it again)")
    elif "plan/off_by" in summary:
        line += f": {summary['plan/off_by']:.1f}x off (cluster={summary['plan/cluster']}'s figures are not this run's)"
    _say(line)


def finish_loggers(trainer: Trainer, status: str) -> None:
    """Finalize loggers, including W&B's run, which Lightning leaves open."""
    for logger in trainer.loggers:
        logger.finalize(status)
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=0 if status == "success" else 1)
