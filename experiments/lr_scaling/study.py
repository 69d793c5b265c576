"""LR-scaling study: does the final loss survive a 16x larger global batch?

The small ResNet on scikit-learn's 8x8 digits (SGD + momentum, cosine decay) is trained on
a fixed number of samples at global batch base x1, x4 and x16 under each rule (none, linear,
sqrt; with warmup, and linear without warmup). One process emulates each global batch with a
larger micro batch: litscale's samplers make R ranks x micro batch b see the same global
batches as one process with b x R, and the rule sees the same global batch either way.

It is a plain Lightning script (no Hydra): litscale's modules, data, schedulers and the
``LRScaling`` callback, reused as a library. Writes ``results.json``, ``results.md`` (the
table, also pasted into README.md between the result markers) and ``loss_curves.png``.

    python experiments/lr_scaling/study.py            # ~11 min of CPU time on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
import warnings
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from litscale.data.digits import DigitsDataModule
from litscale.models.resnet import ResNet
from litscale.modules import ClassificationModule
from litscale.optim.lr_scaling import LRScaling
from litscale.optim.schedulers import warmup_cosine

HERE = Path(__file__).resolve().parent
# (rule, warmup fraction of the run's optimizer steps); warmup replaces the scheduler's own.
VARIANTS = [("none", 0.1), ("linear", 0.0), ("linear", 0.1), ("sqrt", 0.1)]


class LossRecorder(Callback):
    """Training loss per optimizer step, with the samples seen so far."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.samples.append((trainer.global_step) * len(batch[0]))
        self.losses.append(float(outputs["loss"]))


def run(*, global_batch: int, rule: str, warmup_fraction: float, args) -> dict:
    seed_everything(args.seed, workers=True, verbose=False)
    torch.set_num_threads(args.threads)
    steps = args.samples // global_batch
    module = ClassificationModule(
        net=ResNet(input_shape=(1, 8, 8), num_classes=10, widths=tuple(args.widths),
                   blocks_per_stage=args.blocks_per_stage),
        optimizer=functools.partial(torch.optim.SGD, lr=args.base_lr, momentum=0.9),
        scheduler=functools.partial(warmup_cosine, warmup_steps=0, min_lr_ratio=0.0),
    )
    scaling = LRScaling(rule=rule, base_batch_size=args.base_batch,
                        warmup_fraction=warmup_fraction if warmup_fraction else None,
                        warmup_steps=None if warmup_fraction else 0)
    recorder = LossRecorder()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, logger=False,
        callbacks=[scaling, recorder], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, check_val_every_n_epoch=None,
        val_check_interval=steps,  # one validation pass, over the whole val split, at the end
        use_distributed_sampler=False,
    )
    data = DigitsDataModule(batch_size=global_batch, seed=args.seed)
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    val_loss = trainer.callback_metrics["val/loss"]
    return {
        "global_batch": global_batch, "multiplier": global_batch // args.base_batch,
        "rule": rule, "warmup_fraction": warmup_fraction, "steps": steps, "lr": scaling.lr,
        "val_loss": float(val_loss), "val_accuracy": float(trainer.callback_metrics["val/accuracy"]),
        "curve": {"samples": recorder.samples, "loss": recorder.losses},
        "seconds": time.perf_counter() - started,
    }


def label(rule: str, warmup_fraction: float) -> str:
    return f"{rule} + warmup" if warmup_fraction else f"{rule}, no warmup"


def final_train_loss(result: dict) -> float:
    """Mean training loss over the last 10% of the run's samples (one step is too noisy)."""
    losses = result["curve"]["loss"]
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def table(results: list[dict], multipliers: list[int]) -> str:
    columns = " | ".join(f"x{m}: lr, val loss, train loss" for m in multipliers)
    lines = [f"| rule | {columns} | x{multipliers[-1]} vs x1: val, train |",
             "|" + "---|" * (len(multipliers) + 2)]
    for rule, warmup in VARIANTS:
        row = {r["multiplier"]: r for r in results
               if r["rule"] == rule and r["warmup_fraction"] == warmup}
        cells = [f"{row[m]['lr']:g}, {row[m]['val_loss']:.4f}, {final_train_loss(row[m]):.4f}"
                 for m in multipliers]
        first, last = row[multipliers[0]], row[multipliers[-1]]
        val_gap = last["val_loss"] / first["val_loss"] - 1
        train_gap = final_train_loss(last) / final_train_loss(first) - 1
        lines.append(f"| {label(rule, warmup)} | " + " | ".join(cells)
                     + f" | {val_gap:+.1%}, {train_gap:+.1%} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(VARIANTS), figsize=(4 * len(VARIANTS), 3.4), sharey=True)
    for axis, (rule, warmup) in zip(axes, VARIANTS, strict=True):
        for r in results:
            if r["rule"] == rule and r["warmup_fraction"] == warmup:
                axis.plot(r["curve"]["samples"], _smooth(r["curve"]["loss"], r["multiplier"]),
                          label=f"x{r['multiplier']} (batch {r['global_batch']})")
        axis.set(title=label(rule, warmup), xlabel="samples seen", yscale="log")
    axes[0].set_ylabel("train loss (smoothed)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _smooth(values: list[float], multiplier: int) -> list[float]:
    """Running mean over a fixed number of samples (fewer steps for bigger batches)."""
    window = max(1, 32 // multiplier)
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def write_readme_table(markdown: str) -> None:
    readme = HERE / "README.md"
    text = readme.read_text()
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        readme.write_text(f"{before}{start}\n{markdown}\n{end}{rest.split(end, 1)[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16 * 1024, help="training samples per run")
    parser.add_argument("--base-batch", type=int, default=16)
    parser.add_argument("--base-lr", type=float, default=0.02, help="SGD LR tuned at --base-batch")
    parser.add_argument("--multipliers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 32], help="ResNet stages")
    parser.add_argument("--blocks-per-stage", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--replot", action="store_true",
                        help="redo the table and plot from --out/results.json, training nothing")
    args = parser.parse_args()
    if args.replot:
        results = json.loads((args.out / "results.json").read_text())["results"]
        return report(results, args)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # per-run banners
    warnings.filterwarnings("ignore")
    results, done = [], {}
    for multiplier in args.multipliers:
        for rule, warmup in VARIANTS:
            # At x1 every rule gives the base LR: the same run, trained once.
            key = (multiplier, rule if multiplier != 1 else "any", warmup)
            if key not in done:
                done[key] = run(global_batch=args.base_batch * multiplier, rule=rule,
                                warmup_fraction=warmup, args=args)
            result = {**done[key], "rule": rule}
            print(f"x{multiplier:<3} {label(rule, warmup):<18} lr {result['lr']:<8g} "
                  f"val/loss {result['val_loss']:.4f}  ({result['seconds']:.0f} s)", flush=True)
            results.append(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(
        args).items()}, "results": results}, indent=1))
    report(results, args)


def report(results: list[dict], args) -> None:
    multipliers = sorted({r["multiplier"] for r in results})
    markdown = table(results, multipliers)
    (args.out / "results.md").write_text(markdown + "\n")
    plot(results, args.out / "loss_curves.png")
    if args.out == HERE:
        write_readme_table(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
