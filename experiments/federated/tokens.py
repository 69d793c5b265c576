"""The study's token half: GPT-nano on the standard library's tokens split by source file
(``data=tokens data.partition=source``), 4 clients; FedAvg, FedProx and FedOpt against DDP at
equal samples, and streaming DiLoCo (fragments, int4, overlap) against plain DiLoCo: validation
loss after every round and the bytes a worker sends, its peak sync included.

    python experiments/federated/tokens.py            # 3 seeds, 4 rounds of 10 steps (as recorded)
    python experiments/federated/tokens.py --report   # the table and plot again from tokens.json

Every cell is ``python train.py <overrides>`` (the ``command`` in tokens.json), run by
``study.py``'s harness: the same composition, validation and build as ``train.py``, in one
process group of 4 gloo ranks started once for all cells. A round is ``LOCAL_STEPS`` optimizer
steps (DDP validates at the same steps); every method trains on the same samples per step.
Bytes: DDP sends its gradients every step, FedAvg/FedProx/FedOpt a client's parameters once
a round (4 bytes an element); DiLoCo and streaming DiLoCo what the strategy counted
(``comm/bytes_per_sync`` x ``comm/syncs``, ``comm/peak_bytes``). Writes ``tokens.json``,
``tokens.png`` and the README's token table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import study
from study import HERE, run_cells

LOCAL_STEPS = 10
CLIENTS = 4
COMMON = [
    "data=tokens",
    "model=gpt",
    "data.seq_len=64",
    "data.batch_size=8",
    "data.partition=source",
    "trainer.accelerator=cpu",
    "callbacks=none",
    "logger=none",
    "trainer.enable_progress_bar=false",
    "launcher.oversubscribe=true",
    "trainer.limit_val_batches=8",
    "scheduler=constant",
]
DILOCO = [
    "strategy=local_sgd",
    f"strategy.sync_every={LOCAL_STEPS}",
    "strategy.outer_optimizer=nesterov",
    "strategy.outer_lr=0.7",
    "strategy.outer_momentum=0.9",
]
METHODS = {  # the digits study's DDP, FedAvg, FedProx and FedOpt, then DiLoCo and streaming DiLoCo
    **study.METHODS,
    "diloco": DILOCO,
    "streaming": [*DILOCO, "strategy.fragments=3"],
    "streaming_int4": [*DILOCO, "strategy.fragments=3", "strategy.outer_dtype=int4"],
    "streaming_int4_overlap": [
        *DILOCO,
        "strategy.fragments=3",
        "strategy.outer_dtype=int4",
        "strategy.overlap_steps=1",
        "strategy.mixing_factor=0.5",
    ],
}
LABELS = {
    **study.LABELS,
    "diloco": "DiLoCo (fp32, whole model)",
    "streaming": "streaming DiLoCo, 3 fragments, fp32",
    "streaming_int4": "streaming, 3 fragments, int4",
    "streaming_int4_overlap": "streaming, 3 fragments, int4, overlap 1, mixing 0.5",
}


def overrides_of(method: str, seed: int, rounds: int) -> list[str]:
    local = (
        [f"strategy.local_steps={LOCAL_STEPS}"]
        if METHODS[method][0] == "strategy=federated"
        else []
    )
    return [
        *COMMON,
        *METHODS[method],
        *local,
        f"trainer.devices={CLIENTS}",
        f"seed={seed}",
        f"trainer.max_steps={rounds * LOCAL_STEPS}",
        f"trainer.val_check_interval={LOCAL_STEPS}",
    ]


def with_bytes(run: dict) -> dict:
    """``sent_bytes`` (a worker's total) and ``peak_bytes`` (its largest single exchange)."""
    comm = run.get("comm") or {}
    if "comm/syncs" in comm:
        return {
            **run,
            "sent_bytes": comm["comm/bytes_per_sync"] * comm["comm/syncs"],
            "peak_bytes": comm["comm/peak_bytes"],
        }
    # DDP's gradients (a step), a client's parameters (a round): 4 bytes an element
    return {**run, "sent_bytes": run["upload_bytes"][-1], "peak_bytes": 4 * run["num_params"]}


def by_method(results: dict) -> dict[str, dict]:
    """Per method, over its seeds: the mean loss after every round, the final loss's mean and
    sd, and the bytes (the same for every seed)."""
    groups: dict[str, list[dict]] = {}
    for run in results["runs"]:
        groups.setdefault(run["method"], []).append(run)
    summary = {}
    for method, runs in groups.items():
        final = [run["loss"][-1] for run in runs]
        summary[method] = {
            "loss": [
                statistics.mean(losses) for losses in zip(*(r["loss"] for r in runs), strict=True)
            ],
            "final": statistics.mean(final),
            "sd": statistics.stdev(final) if len(final) > 1 else 0.0,
            "sent_bytes": runs[0]["sent_bytes"],
            "peak_bytes": runs[0]["peak_bytes"],
        }
    return summary


def streaming_findings(methods: dict) -> list[str]:
    """Each streaming variant against plain DiLoCo: how much smaller its peak exchange and its
    total, and how far its mean final loss."""
    plain = methods.get("diloco")
    if plain is None:
        return []
    lines = [
        "Streaming DiLoCo against plain DiLoCo (the same outer Nesterov step, every 10 steps):",
        "",
    ]
    for method in ("streaming", "streaming_int4", "streaming_int4_overlap"):
        if method in methods:
            run = methods[method]
            lines.append(
                f"- {LABELS[method]}: peak exchange {plain['peak_bytes'] / run['peak_bytes']:.1f}x smaller, "
                f"{plain['sent_bytes'] / run['sent_bytes']:.1f}x fewer bytes in all, final loss "
                f"{run['final'] - plain['final']:+.3f}"
            )
    return lines


def write_report(results: dict) -> None:
    methods = by_method(results)
    skew = next(
        (run["label_skew"] for run in results["runs"] if run.get("label_skew") is not None),
        float("nan"),
    )
    ddp = methods.get("ddp")
    lines = [
        f"GPT-nano on the standard library's BPE tokens split by source file over {CLIENTS} clients "
        f"(label skew {skew:.2f} over source files), {results['rounds']} rounds of {LOCAL_STEPS} steps, "
        f"batch 8 x 64 tokens per client, seeds {results['seeds']}; final validation loss (mean ± sd "
        "over seeds) and what a worker sent.",
        "",
        "| method | final val loss | vs DDP | sent by a worker | peak single exchange |",
        "|---|---|---|---|---|",
    ]
    for method in METHODS:
        if method not in methods:
            continue
        run = methods[method]
        versus = "" if ddp is None or method == "ddp" else f"{run['final'] - ddp['final']:+.3f}"
        lines.append(
            f"| {LABELS[method]} | {run['final']:.3f} ± {run['sd']:.3f} | {versus} | "
            f"{run['sent_bytes'] / 2**20:.2f} MiB | {run['peak_bytes'] / 2**20:.3f} MiB |"
        )
    lines += ["", *streaming_findings(methods)]
    lines += [
        "",
        f"Machine: {results['machine']}; wall time {results['wall_time_s'] / 60:.0f} min.",
        "",
        "![validation loss against rounds and bytes](tokens.png)",
    ]
    readme = (HERE / "README.md").read_text()
    start, end = "<!-- tokens: written by tokens.py from tokens.json -->", "<!-- end tokens -->"
    before, rest = readme.split(start, 1)
    (HERE / "README.md").write_text(
        f"{before}{start}\n" + "\n".join(lines) + f"\n{end}{rest.split(end, 1)[1]}"
    )


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for method, run in by_method(results).items():
        rounds = range(1, len(run["loss"]) + 1)
        by_round.plot(rounds, run["loss"], marker="o", ms=3, label=LABELS[method])
        # every method sends the same bytes each round (a streaming round: each fragment once)
        sent = [run["sent_bytes"] * r / len(run["loss"]) / 2**20 for r in rounds]
        by_bytes.plot(sent, run["loss"], marker="o", ms=3)
    by_round.set_xlabel("round")
    by_bytes.set_xlabel("MiB sent by a worker")
    by_bytes.set_xscale("log")
    for axes in (by_round, by_bytes):
        axes.set_ylabel("val loss (mean over seeds)")
    by_round.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(HERE / "tokens.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--report", action="store_true", help="rewrite the table and plot from tokens.json"
    )
    parser.add_argument(
        "--append", action="store_true", help="keep tokens.json's runs of other seeds"
    )
    args = parser.parse_args()
    path = HERE / "tokens.json"
    if not args.report:
        started, runs, before_s = time.time(), [], 0.0
        if args.append:  # keep the recorded seeds
            recorded = json.loads(path.read_text())
            runs = [run for run in recorded["runs"] if run["seed"] not in args.seeds]
            before_s = recorded["wall_time_s"]

        def record(run: dict) -> None:
            runs.append(with_bytes(run))
            path.write_text(
                json.dumps(
                    {
                        "rounds": args.rounds,
                        "seeds": sorted({r["seed"] for r in runs}),
                        "local_steps": LOCAL_STEPS,
                        "runs": runs,
                        "wall_time_s": before_s + time.time() - started,
                        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU gloo "
                        "ranks, shared with other jobs",
                    },
                    indent=1,
                )
            )

        from litscale.data.tokens import TokenDataModule

        # the token cache, once, before the ranks
        TokenDataModule(seq_len=64, batch_size=8).prepare_data()
        cells = [
            {
                "method": method,
                "clients": CLIENTS,
                "seed": seed,
                "metric": "val/loss",
                "local_steps": LOCAL_STEPS,
                "overrides": overrides_of(method, seed, args.rounds),
            }
            for seed in args.seeds
            for method in args.methods
        ]
        run_cells(CLIENTS, cells, record)
    results = json.loads(path.read_text())
    write_report(results)
    plot(results)


if __name__ == "__main__":
    main()
