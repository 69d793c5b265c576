"""µP transfer: does the best LR stay put as the model widens?

An LR sweep at several widths of a GPT (2 layers, 4 heads, width = n_embd) on the built-in
byte corpus, under the standard parametrisation (SP) and under µP (``lr_scaling=mup``, base
width = the narrowest), for AdamW and Muon: each run's validation loss after ``--steps``
steps (8 held-out batches, the same for every run), the best LR at each width, and the loss
curves. The claim checked (docs/width-scaling.md): under µP the best LR at the widest width is
within 2x of the narrowest's (one step of the grid, which is spaced 2x); under SP it is not.

In-process (one interpreter, the same batches for every run), with the parts a run uses:
``WidthScaling`` for the init, forward multipliers and param groups, the optimizer factories
of ``conf/optimizer``, a linear warmup of 10 steps then a constant LR.

    python experiments/mup/run.py                          # about 20 min on 2 cores
    python experiments/mup/run.py --widths 64,128 --steps 50 --optimizers adamw
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from litscale.app.mup_check import compose_config, first_batches
from litscale.models.gpt import GPT, GPTConfig
from litscale.modules import optimizer_groups
from litscale.optim.lr_scaling import ScaledOptimizerFactory
from litscale.optim.muon import Muon
from litscale.optim.mup import WidthScaling

HERE = Path(__file__).resolve().parent
OPTIMIZERS = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0),
    "muon": lambda params, lr: Muon(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0),
}
WARMUP = 10
VAL_BATCHES = 8


def batches(steps: int, seq_len: int, batch_size: int) -> tuple[list, list]:
    """The first ``steps`` training batches of the byte corpus and ``VAL_BATCHES`` validation ones."""
    cfg = compose_config([f"data.seq_len={seq_len}", f"data.batch_size={batch_size}"])
    return first_batches(cfg, steps), first_batches(cfg, VAL_BATCHES, split="val")


def train(width: int, base_width: int, lr: float, optimizer: str, parametrisation: str, train_batches: list,
          val_batches: list, seq_len: int, seed: int) -> dict:
    torch.manual_seed(seed)
    net = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=width, vocab_size=256, block_size=seq_len))
    factory = OPTIMIZERS[optimizer]
    groups = optimizer_groups(net, Muon if optimizer == "muon" else torch.optim.AdamW, 0.0)
    if parametrisation == "mup":
        scaling = WidthScaling(net, base_width)
        scaling.apply()
        built = ScaledOptimizerFactory(factory, lr, scaling)(groups)
    else:
        built = factory(groups, lr)
    peaks = [group["lr"] for group in built.param_groups]
    losses = []
    for step, (tokens, targets) in enumerate(train_batches):
        for group, peak in zip(built.param_groups, peaks, strict=True):
            group["lr"] = peak * min(1.0, (step + 1) / WARMUP)
        loss = F.cross_entropy(net(tokens).flatten(0, 1).float(), targets.flatten())
        built.zero_grad(set_to_none=True)
        loss.backward()
        built.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    with torch.no_grad():
        val = sum(F.cross_entropy(net(t).flatten(0, 1).float(), y.flatten()).item() for t, y in val_batches)
    val = val / len(val_batches) if math.isfinite(losses[-1]) else float("inf")
    return {"val_loss": val if math.isfinite(val) else float("inf"), "train_losses": losses}


def best_lrs(results: list[dict], optimizer: str, parametrisation: str, widths: list[int]) -> dict[int, float]:
    best = {}
    for width in widths:
        runs = [r for r in results if (r["optimizer"], r["parametrisation"], r["width"]) == (optimizer, parametrisation, width)]
        best[width] = min(runs, key=lambda r: r["val_loss"])["lr"]
    return best


def plot(results: list[dict], optimizers: list[str], widths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(optimizers), 2, figsize=(11, 4 * len(optimizers)), squeeze=False, sharey="row")
    for row, optimizer in enumerate(optimizers):
        for column, parametrisation in enumerate(("sp", "mup")):
            axis = axes[row][column]
            for width in widths:
                runs = sorted((r for r in results if (r["optimizer"], r["parametrisation"], r["width"]) ==
                               (optimizer, parametrisation, width)), key=lambda r: r["lr"])
                axis.plot([r["lr"] for r in runs], [min(r["val_loss"], 6.0) for r in runs], marker="o",
                          label=f"width {width}")
            axis.set(xscale="log", xlabel="lr", title=f"{optimizer}, {parametrisation}")
        axes[row][0].set_ylabel("val loss (nats/byte), capped at 6")
        axes[row][1].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def reusable_runs(args: argparse.Namespace) -> dict[tuple, dict]:
    """The runs of results.json trained with this invocation's steps, sequence, batch and seed
    (the base width is the narrowest, as here): by optimizer, parametrisation, width and lr."""
    path = HERE / "results.json"
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    same = all(saved["args"][key] == getattr(args, key) for key in ("steps", "seq_len", "batch_size", "seed"))
    if not same or int(saved["args"]["widths"].split(",")[0]) != int(args.widths.split(",")[0]):
        return {}
    return {(r["optimizer"], r["parametrisation"], r["width"], r["lr"]): {**r, "train_losses": [r["final_train_loss"]]}
            for r in saved["runs"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--optimizers", default="adamw,muon")
    parser.add_argument("--log2-lrs", default="-13,-12,-11,-10,-9,-8,-7,-6,-5")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--muon-log2-lrs", default=None, help="Muon's grid, if not --log2-lrs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse", action="store_true",
                        help="read the runs results.json already holds for the same steps, sequence, batch and seed")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    optimizers = args.optimizers.split(",")
    grids = {optimizer: [2.0 ** int(e) for e in ((args.muon_log2_lrs if optimizer == "muon" else None)
                                                  or args.log2_lrs).split(",")] for optimizer in optimizers}
    train_batches, val_batches = batches(args.steps, args.seq_len, args.batch_size)
    done = reusable_runs(args) if args.reuse else {}
    results, started = [], time.perf_counter()
    for optimizer in optimizers:
        for parametrisation in ("sp", "mup"):
            for width in widths:
                for lr in grids[optimizer]:
                    if (optimizer, parametrisation, width, lr) in done:
                        results.append(done[optimizer, parametrisation, width, lr])
                        continue
                    if parametrisation == "mup" and width == widths[0]:
                        # At the base width µP is the standard model (tests/test_mup.py): the same run.
                        same = next(r for r in results if (r["optimizer"], r["parametrisation"], r["width"], r["lr"])
                                    == (optimizer, "sp", width, lr))
                        results.append({**same, "parametrisation": "mup"})
                        continue
                    run = train(width, widths[0], lr, optimizer, parametrisation, train_batches, val_batches,
                                args.seq_len, args.seed)
                    results.append({"optimizer": optimizer, "parametrisation": parametrisation, "width": width,
                                    "lr": lr, **run})
                    print(f"{optimizer} {parametrisation} width {width} lr {lr:.2e}: val {run['val_loss']:.4f} "
                          f"({time.perf_counter() - started:.0f} s)", flush=True)
    summary = {}
    lines = ["| optimizer | param. | " + " | ".join(f"best lr at {w}" for w in widths) +
             " | widest / narrowest | within 2x |", "|---|---|" + "---|" * (len(widths) + 2)]
    for optimizer in optimizers:
        for parametrisation in ("sp", "mup"):
            best = best_lrs(results, optimizer, parametrisation, widths)
            ratio = best[widths[-1]] / best[widths[0]]
            within = 0.5 <= ratio <= 2.0
            summary[f"{optimizer}/{parametrisation}"] = {"best_lr": best, "ratio": ratio, "within_2x": within}
            lines.append(f"| {optimizer} | {parametrisation} | " + " | ".join(f"{best[w]:.2e}" for w in widths) +
                         f" | {ratio:g} | {'yes' if within else 'no'} |")
    table = "\n".join(lines)
    print(table)
    (HERE / "results.json").write_text(json.dumps({"args": vars(args), "summary": summary, "runs": [
        {k: v for k, v in r.items() if k != "train_losses"} | {"final_train_loss": r["train_losses"][-1]}
        for r in results]}, indent=1))
    (HERE / "results.md").write_text(f"# µP transfer: best LR by width (from run.py)\n\n{table}\n")
    plot(results, optimizers, widths, HERE / "transfer.png")
    print(f"wrote {HERE / 'results.json'}, {HERE / 'results.md'}, {HERE / 'transfer.png'}")


if __name__ == "__main__":
    main()
