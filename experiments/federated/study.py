"""Federated averaging on non-IID digits: FedAvg, FedProx and FedOpt against DDP at equal
samples, IID vs Dirichlet 1.0 vs Dirichlet 0.1, several seeds; validation accuracy after
every round, against rounds and against the bytes a client uploads.

    python experiments/federated/study.py                          # 4 clients, 3 seeds
    python experiments/federated/study.py --clients 8 --append     # 8 clients beside the 4 recorded

Every cell is ``python train.py experiment=digits_mlp ...`` (the ``command`` in results.json),
built by the same code (Hydra's composition, ``validate``, ``build_run``, ``Trainer.fit``) but
in one process group of ``clients`` gloo ranks started once for all cells: on a 2-core machine
a ``train.py`` start of 4 ranks costs minutes, a cell's fit seconds. One client per rank, every
client in every round (``clients_per_round`` unset), so a federated run trains on as many
samples per step as DDP does. A round is ``LOCAL_STEPS`` optimizer steps; DDP validates at the
same steps. Bytes are what one client hands to collectives: its parameters once a round
(federated), its gradients every step (DDP), 4 bytes an element. Writes ``results.json``,
``accuracy.png`` and the README's table here; ``--report`` rewrites the table and plot from
``results.json`` alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOCAL_STEPS = 10
HOLDS_PT = 2.0  # a method "holds" when its final accuracy is at most this many points below DDP's
COMMON = ["experiment=digits_mlp", "trainer.accelerator=cpu", "data.batch_size=32", "callbacks=none",
          "logger=none", "trainer.enable_progress_bar=false", "launcher.oversubscribe=true"]
METHODS = {
    "ddp": ["strategy=ddp"],
    "fedavg": ["strategy=federated"],
    "fedprox": ["strategy=federated", "strategy.proximal_mu=0.1"],
    "fedopt": ["strategy=federated", "strategy.outer_optimizer=nesterov", "strategy.outer_lr=0.7",
               "strategy.outer_momentum=0.9"],
}
LABELS = {"ddp": "DDP (every step)", "fedavg": "FedAvg", "fedprox": "FedProx (mu 0.1)",
          "fedopt": "FedOpt (server Nesterov, lr 0.7)"}
PARTITIONS = {"iid": ["data.partition=iid"], "dir1.0": ["data.partition=dirichlet", "data.alpha=1.0"],
              "dir0.1": ["data.partition=dirichlet", "data.alpha=0.1"]}


def overrides_of(method: str, partition: str, clients: int, seed: int, rounds: int) -> list[str]:
    strategy = METHODS[method] + ([f"strategy.local_steps={LOCAL_STEPS}"] if method != "ddp" else [])
    return [*COMMON, *strategy, *PARTITIONS[partition], f"trainer.devices={clients}", f"seed={seed}",
            f"trainer.max_steps={rounds * LOCAL_STEPS}", f"trainer.val_check_interval={LOCAL_STEPS}"]


def fit_cell(overrides: list[str], output_dir: str, metric: str = "val/accuracy") -> dict:
    """One cell on this rank, as ``train.py`` builds it; every rank calls it. Returns
    ``metric`` after every validation (under its last name: ``accuracy``, ``loss``) and the
    strategy's own ``comm/*`` figures (streaming DiLoCo's peak bytes)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from lightning.pytorch import Callback
    from omegaconf import OmegaConf, open_dict

    from litscale.app.build import build_run
    from litscale.app.checks.validation import validate

    class Metric(Callback):
        def __init__(self) -> None:
            self.by_step: dict[int, float] = {}

        def on_validation_end(self, trainer, pl_module) -> None:
            if not trainer.sanity_checking:
                self.by_step[trainer.global_step] = float(trainer.callback_metrics[metric])

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if isinstance(v, str)}
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.paths.output_dir = output_dir
    layout = validate(cfg, choices=choices)
    built = build_run(OmegaConf.to_container(cfg, resolve=True), choices, layout)
    curve = Metric()
    built.trainer.callbacks.append(curve)
    built.trainer.fit(built.module, datamodule=built.datamodule)
    facts = built.datamodule.partition_facts or {}
    comm = {k: v for k, v in getattr(built.trainer.strategy, "result", {}).items() if k.startswith("comm/")}
    return {metric.split("/")[-1]: [curve.by_step[step] for step in sorted(curve.by_step)], "comm": comm,
            "num_params": sum(p.numel() for p in built.module.parameters()),
            "label_skew": facts.get("label_skew"), "client_samples": facts.get("client_samples")}


def _rank(rank: int, world_size: int, port: int, cells: list[dict], scratch: str, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for index, cell in enumerate(cells):
        metric = cell.get("metric", "val/accuracy")
        figures = fit_cell(cell["overrides"], os.path.join(scratch, str(index)), metric)
        if rank == 0:
            name = metric.split("/")[-1]
            rounds = len(figures[name])
            # DDP: gradients every step; federated and DiLoCo: the parameters once a round
            per_round = 4 * figures["num_params"] * (cell.get("local_steps", LOCAL_STEPS) if cell["method"] == "ddp" else 1)
            run = {**{k: v for k, v in cell.items() if k != "overrides"}, **figures,
                   "upload_bytes": [per_round * r for r in range(1, rounds + 1)],
                   "command": "python train.py " + " ".join(cell["overrides"])}
            results.put(run)
            print(f"{run['command']}: {name} {run[name][-1]:.3f}", flush=True)
    dist.destroy_process_group()


def run_cells(clients: int, cells: list[dict], on_run) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        processes = [context.Process(target=_rank, args=(rank, clients, port, cells, scratch, results))
                     for rank in range(clients)]
        for process in processes:
            process.start()
        runs = []
        for _ in cells:  # written as they finish: an interrupted study keeps its finished cells
            runs.append(results.get())
            on_run(runs[-1])
        for process in processes:
            process.join()
    if any(process.exitcode for process in processes):
        sys.exit("a rank failed")
    return runs


def _skew(runs: list[dict], clients: int, partition: str) -> float:
    skews = [run["label_skew"] for run in runs if (run["clients"], run["partition"]) == (clients, partition)
             and run["label_skew"] is not None]
    return statistics.mean(skews) if skews else float("nan")


def summarise(runs: list[dict]) -> list[dict]:
    """Mean and sd over seeds of the final accuracy, per (clients, partition, method)."""
    cells: dict[tuple, list[dict]] = {}
    for run in runs:
        cells.setdefault((run["clients"], run["partition"], run["method"]), []).append(run)
    table = []
    for (clients, partition, method), group in cells.items():
        final = [run["accuracy"][-1] for run in group]
        table.append({"clients": clients, "partition": partition, "method": method, "seeds": len(group),
                      "final_accuracy_mean": statistics.mean(final),
                      "final_accuracy_sd": statistics.stdev(final) if len(final) > 1 else 0.0,
                      # DDP reports no split of IID data: the skew is the federated runs' of that data
                      "label_skew_mean": _skew(runs, clients, partition),
                      "upload_bytes": group[0]["upload_bytes"][-1]})
    return table


def write_report(results: dict) -> None:
    lines = [f"Digits MLP, {results['rounds']} rounds of {LOCAL_STEPS} steps, batch 32 per client, "
             f"seeds {results['seeds']}; final validation accuracy (mean ± sd over seeds) and what a "
             "client uploaded.", "",
             "| clients | partition (label skew) | method | final accuracy | vs DDP | uploaded by a client |",
             "|---|---|---|---|---|---|"]
    table = results["table"]
    ddp = {(r["clients"], r["partition"]): r["final_accuracy_mean"] for r in table if r["method"] == "ddp"}
    for r in sorted(table, key=lambda r: (r["clients"], list(PARTITIONS).index(r["partition"]),
                                          list(METHODS).index(r["method"]))):
        baseline = ddp.get((r["clients"], r["partition"]))
        versus = "" if baseline is None or r["method"] == "ddp" else \
            f"{100 * (r['final_accuracy_mean'] - baseline):+.1f} pt"
        lines.append(f"| {r['clients']} | {r['partition']} ({r['label_skew_mean']:.2f}) | "
                     f"{LABELS[r['method']]} | {r['final_accuracy_mean']:.3f} ± {r['final_accuracy_sd']:.3f} "
                     f"| {versus} | {r['upload_bytes'] / 2**20:.2f} MiB |")
    lines += ["", f"Which methods hold accuracy (final accuracy within {HOLDS_PT:g} points of DDP's at the same "
              "samples):", ""]
    for (clients, partition), baseline in sorted(ddp.items(), key=lambda k: (k[0][0], list(PARTITIONS).index(k[0][1]))):
        cell = [r for r in table if (r["clients"], r["partition"]) == (clients, partition) and r["method"] != "ddp"]
        held = [LABELS[r["method"]] for r in cell if baseline - r["final_accuracy_mean"] <= HOLDS_PT / 100]
        lost = [f"{LABELS[r['method']]} ({100 * (r['final_accuracy_mean'] - baseline):+.1f} pt)" for r in cell
                if baseline - r["final_accuracy_mean"] > HOLDS_PT / 100]
        lines.append(f"- {clients} clients, {partition}: hold: {', '.join(held) or 'none'}; "
                     f"do not: {', '.join(lost) or 'none'}")
    lines += ["", f"Machine: {results['machine']}; wall time {results['wall_time_s'] / 60:.0f} min.", "",
              "![accuracy against rounds and bytes](accuracy.png)"]
    report = "\n".join(lines)
    readme = (HERE / "README.md").read_text()
    start, end = "<!-- results: written by study.py from results.json -->", "<!-- end results -->"
    before, rest = readme.split(start, 1)
    (HERE / "README.md").write_text(f"{before}{start}\n{report}\n{end}{rest.split(end, 1)[1]}")


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    partitions = [p for p in PARTITIONS if any(r["partition"] == p for r in results["runs"])]
    clients = sorted({r["clients"] for r in results["runs"]})
    figure, axes = plt.subplots(2, len(partitions) * len(clients), figsize=(4 * len(partitions) * len(clients), 7),
                                squeeze=False)
    for column, (count, partition) in enumerate((c, p) for c in clients for p in partitions):
        for method in METHODS:
            runs = [r for r in results["runs"] if (r["clients"], r["partition"], r["method"]) == (count, partition, method)]
            if not runs:
                continue
            mean = [statistics.mean(values) for values in zip(*(r["accuracy"] for r in runs), strict=True)]
            rounds = range(1, len(mean) + 1)
            axes[0][column].plot(rounds, mean, marker="o", ms=3, label=LABELS[method])
            axes[1][column].plot([b / 2**20 for b in runs[0]["upload_bytes"]], mean, marker="o", ms=3)
        axes[0][column].set_title(f"{count} clients, {partition}")
        axes[0][column].set_xlabel("round")
        axes[1][column].set_xlabel("MiB uploaded by a client")
        axes[1][column].set_xscale("log")
        for row in (0, 1):
            axes[row][column].set_ylabel("val accuracy")
            axes[row][column].set_ylim(0, 1)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(HERE / "accuracy.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=list(PARTITIONS))
    parser.add_argument("--report", action="store_true", help="rewrite the table and plot from results.json")
    parser.add_argument("--append", action="store_true", help="keep results.json's runs of other client counts")
    args = parser.parse_args()
    if args.report:
        results = json.loads((HERE / "results.json").read_text())
    else:
        started, runs, before_s = time.time(), [], 0.0
        if args.append:  # keep the recorded cells of other client counts
            recorded = json.loads((HERE / "results.json").read_text())
            runs = [run for run in recorded["runs"] if run["clients"] not in args.clients]
            before_s = recorded["wall_time_s"]

        def record(run: dict) -> None:
            runs.append(run)
            results = {"rounds": args.rounds, "seeds": sorted({r["seed"] for r in runs}),
                       "local_steps": LOCAL_STEPS, "runs": runs, "table": summarise(runs),
                       "wall_time_s": before_s + time.time() - started,
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU gloo ranks"}
            (HERE / "results.json").write_text(json.dumps(results, indent=1))

        for clients in args.clients:
            # seed by seed: an interrupted study has whole seeds of every cell
            cells = [{"method": method, "partition": partition, "clients": clients, "seed": seed,
                      "overrides": overrides_of(method, partition, clients, seed, args.rounds)}
                     for seed in args.seeds for partition in args.partitions for method in args.methods]
            run_cells(clients, cells, record)
        results = json.loads((HERE / "results.json").read_text())
    write_report(results)
    plot(results)


if __name__ == "__main__":
    main()
