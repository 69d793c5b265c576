"""Dense vs mixture-of-experts at equal active FLOPs, and context parallel's step time and
memory per rank against the sequence length, on CPU, each run through ``train.py``.

    python experiments/moe/run.py                     # every part; finished runs are kept
    python experiments/moe/run.py --part moe --seeds 0 1 2
    python experiments/moe/run.py --part speed --rounds 4
    python experiments/moe/run.py --part cp
    python experiments/moe/report.py                  # README tables and plots from results.json

Every run is one ``train.py`` command (its ``command`` in ``results.json``), read back from its
own outputs: ``summary.json`` and the CSV logger's ``metrics.csv``. ``results.json`` is written
after every run and a rerun skips the runs it holds (``--redo`` runs them again), so an
interrupted study resumes where it stopped. Configurations alternate within each seed, and
the short tokens/s runs within each round (a different one first each time), so that the
machine's load, shared with other jobs, falls on all of them alike; the load average is
recorded before and after every run.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = HERE / "results.json"
RUNS_ROOT = REPO / "outputs" / "experiments_moe"

COMMON = [
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "callbacks.model_checkpoint.save_top_k=0",
    "callbacks.model_checkpoint.save_last=false",
]

# Part 1. The dense run is Llama's `tiny` preset (2 layers of width 128, SwiGLU of 384). The MoE
# run has the same attention and depth; each of its MLPs is 8 routed experts of width 128, top 2,
# plus one shared expert of 128: a token passes 3 x 128 = 384 hidden units, the dense MLP's width,
# so the active FLOPs differ only by the router (128 x 8 weights a layer).
MOE_BODY = [
    "model=moe",
    "+model.net.n_layer=2",
    "+model.net.n_embd=128",
    "+model.net.dense_layers=0",
    "+model.net.moe_ffn_hidden_size=128",
    "model.net.n_experts=8",
    "model.net.top_k=2",
    "model.net.n_shared_experts=1",
]
MOE_CONFIGS = {
    "dense": {"label": "dense Llama tiny", "overrides": ["model=llama"]},
    "moe_none": {
        "label": "MoE, no balancing",
        "overrides": [*MOE_BODY, "model.net.aux_loss_coef=0", "model.net.bias_update_rate=0"],
    },
    "moe_bias": {
        "label": "MoE, aux-loss-free bias (rate 1e-3)",
        "overrides": [*MOE_BODY, "model.net.aux_loss_coef=0", "model.net.bias_update_rate=0.001"],
    },
    "moe_aux": {
        "label": "MoE, balance loss (coef 1e-2)",
        "overrides": [*MOE_BODY, "model.net.aux_loss_coef=0.01", "model.net.bias_update_rate=0"],
    },
    # What a capacity drops when nothing balances the router (the others are dropless).
    "moe_none_capacity": {
        "label": "MoE, no balancing, capacity 1.25",
        "overrides": [
            *MOE_BODY,
            "model.net.aux_loss_coef=0",
            "model.net.bias_update_rate=0",
            "model.net.capacity_factor=1.25",
        ],
    },
}

# Tokens/s alone: short runs of every configuration above, in rounds (a different one first
# each round), so a change in the machine's load falls on all of them alike.
SPEED_STEPS = 40

# Part 2. Llama tiny under FSDP: one rank (context 1) against two ranks splitting every sequence
# (context 2), the same global batch of 4 sequences; no validation, so the peak memory is training's.
CP_SEQ_LENS = (256, 512, 1024, 2048)
CP_STEPS = 8
CP_SIZES = {
    1: ["strategy=fsdp", "trainer.devices=1"],
    2: ["strategy=fsdp", "strategy.context_parallel_size=2", "trainer.devices=2"],
}
CP_COMMON = [
    "model=llama",
    "data.batch_size=4",
    f"trainer.max_steps={CP_STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=0",
    "trainer.num_sanity_val_steps=0",
    "+callbacks.peak_rss._target_=peak_rss.PeakRSS",
    "allowed_targets=[peak_rss]",
]


def load_average() -> list[float]:
    return list(os.getloadavg())


def machine() -> dict:
    import lightning
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }


def train(name: str, overrides: list[str], threads: int) -> tuple[Path, float, str]:
    """One ``python train.py`` at low priority; its run dir, wall seconds and command."""
    command = ["python", "train.py", *overrides, f"name={name}"]
    env = {
        **os.environ,
        "LITSCALE_OUTPUTS": str(RUNS_ROOT),
        "LITSCALE_THREADS_PER_RANK": str(threads),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO / "src"), str(HERE), os.environ.get("PYTHONPATH")])
        ),
    }
    started = time.perf_counter()
    done = subprocess.run(
        ["nice", "-n", "10", sys.executable, "train.py", *command[2:]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    found = re.search(r"litscale: outputs: (\S+)", done.stdout + done.stderr)
    return Path(found.group(1)), wall, " ".join(command)


def metrics_rows(run_dir: Path) -> list[dict[str, float]]:
    """The CSV logger's rows, each as the numbers it holds."""
    path = next(run_dir.glob("csv/**/metrics.csv"))
    with path.open() as handle:
        return [
            {k: float(v) for k, v in row.items() if v not in ("", None)}
            for row in csv.DictReader(handle)
        ]


def curve(rows: list[dict], key: str) -> list[list[float]]:
    """``[step, value]`` of every row logging ``key``, by step."""
    return sorted([int(row["step"]), row[key]] for row in rows if key in row and "step" in row)


def moe_run(config: str, seed: int, steps: int) -> dict:
    spec = MOE_CONFIGS[config]
    overrides = [
        *spec["overrides"],
        *COMMON,
        f"seed={seed}",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps // 4}",
    ]
    load_before = load_average()
    run_dir, wall, command = train(f"{config}-seed{seed}", overrides, threads=1)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = metrics_rows(run_dir)
    keep = (
        "val/bpb",
        "val/loss",
        "val/loss_initial",
        "train/loss",
        "perf/tokens_per_sec",
        "perf/step_time_s",
        "perf/flops_per_sample",
        "num_params",
        "moe/load_imbalance",
        "moe/load_imbalance_mean",
        "moe/load_imbalance_per_layer",
        "moe/dropped_fraction",
        "moe/aux_loss",
        "moe/tokens_per_expert",
        "moe/layers",
        "memory/params_bytes",
        "threads_per_rank",
        "wall_time_s",
    )
    return {
        "config": config,
        "seed": seed,
        "steps": steps,
        "command": command,
        "process_wall_s": wall,
        "load_before": load_before,
        "load_after": load_average(),
        "summary": {k: summary[k] for k in keep if k in summary},
        "seq_len": summary["data"].get("seq_len")
        if isinstance(summary.get("data"), dict)
        else None,
        "curves": {
            key: curve(rows, key)
            for key in (
                "val/bpb",
                "train/loss",
                "moe/load_imbalance",
                "moe/dropped_fraction",
                "moe/aux_loss",
            )
        },
    }


def step_times(rows: list[dict]) -> list[float]:
    """Seconds of each measured step, from the throughput callback's running mean logged every
    step (``perf/step_time_s`` at step k is the mean over the steps since its warm-up)."""
    logged = curve(rows, "perf/step_time_s")
    if not logged:
        return []
    first = logged[0][0] - 1  # the step its clock started at: the first figure covers one step
    elapsed = [(step, mean * (step - first)) for step, mean in logged]
    return [elapsed[0][1]] + [b[1] - a[1] for a, b in itertools.pairwise(elapsed)]


def cp_run(context: int, seq_len: int) -> dict:
    overrides = [*CP_COMMON, *CP_SIZES[context], *COMMON, f"data.seq_len={seq_len}"]
    load_before = load_average()
    run_dir, wall, command = train(f"cp{context}-seq{seq_len}", overrides, threads=1)
    summary = json.loads((run_dir / "summary.json").read_text())
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "peak_rss").glob("rank*.json"))]
    return {
        "context": context,
        "seq_len": seq_len,
        "command": command,
        "process_wall_s": wall,
        "load_before": load_before,
        "load_after": load_average(),
        "step_times_s": step_times(metrics_rows(run_dir)),
        "summary": {
            k: summary.get(k)
            for k in (
                "perf/step_time_s",
                "perf/tokens_per_sec",
                "memory/params_bytes",
                "memory/grads_bytes",
                "memory/optimizer_bytes",
                "world_size",
                "threads_per_rank",
                "num_params",
                "global_batch",
            )
        },
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
    }


def speed_run(config: str, round_index: int) -> dict:
    """A short run of one configuration for tokens/s alone: no validation, the throughput
    callback's steady state after its warm-up."""
    overrides = [
        *MOE_CONFIGS[config]["overrides"],
        *COMMON,
        "seed=0",
        f"trainer.max_steps={SPEED_STEPS}",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
    ]
    load_before = load_average()
    run_dir, wall, command = train(f"speed-{config}-round{round_index}", overrides, threads=1)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "config": config,
        "round": round_index,
        "command": command,
        "process_wall_s": wall,
        "load_before": load_before,
        "load_after": load_average(),
        "summary": {k: summary[k] for k in ("perf/tokens_per_sec", "perf/step_time_s")},
    }


def save(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("moe", "cp", "speed", "all"), default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200, help="steps of every dense and MoE run")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the tokens/s runs")
    parser.add_argument("--redo", action="store_true", help="run again what results.json holds")
    args = parser.parse_args(argv)
    if args.steps % 4:
        parser.error("--steps must be a multiple of 4: 4 validations, the last at the last step")
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.setdefault("moe", {})
    results.setdefault("cp", {})
    results.setdefault("speed", {})
    results["machine"] = machine()
    plan: list[tuple[str, str, dict]] = []
    if args.part in ("moe", "all"):
        names = list(MOE_CONFIGS)
        for index, seed in enumerate(args.seeds):
            shift = index % len(names)  # a different configuration first each seed
            plan += [
                (
                    "moe",
                    f"{c}-seed{seed}-steps{args.steps}",
                    {"config": c, "seed": seed, "steps": args.steps},
                )
                for c in names[shift:] + names[:shift]
            ]
    if args.part in ("cp", "all"):
        plan += [
            ("cp", f"cp{c}-seq{s}", {"context": c, "seq_len": s})
            for s in CP_SEQ_LENS
            for c in CP_SIZES
        ]
    if args.part in ("speed", "all"):
        names = list(MOE_CONFIGS)
        for index in range(args.rounds):
            shift = index % len(names)
            plan += [
                ("speed", f"{c}-round{index}", {"config": c, "round_index": index})
                for c in names[shift:] + names[:shift]
            ]
    todo = [
        (part, key, kwargs) for part, key, kwargs in plan if args.redo or key not in results[part]
    ]
    print(
        f"{len(plan)} runs planned, {len(plan) - len(todo)} already in {RESULTS.name}", flush=True
    )
    for number, (part, key, kwargs) in enumerate(todo, 1):
        print(
            f"[{number}/{len(todo)}] {key} (load average {os.getloadavg()[0]:.1f}) ...", flush=True
        )
        record = {"moe": moe_run, "cp": cp_run, "speed": speed_run}[part](**kwargs)
        record["date"] = time.strftime("%Y-%m-%d %H:%M")
        results[part][key] = record
        save(results)
        figures = record["summary"]
        print(
            f"    done in {record['process_wall_s']:.0f} s: "
            + (
                f"val/bpb {figures['val/bpb']:.3f}, {figures['perf/tokens_per_sec']:,.0f} tokens/s"
                if part == "moe"
                else f"{figures['perf/tokens_per_sec']:,.0f} tokens/s"
                if part == "speed"
                else f"{len(record['step_times_s'])} steps timed, peak RSS per rank "
                + ", ".join(f"{r['peak_rss_bytes'] / 2**20:.0f} MiB" for r in record["ranks"])
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
