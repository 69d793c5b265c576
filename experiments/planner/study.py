"""How far to trust the planner on this machine: its predicted step time beside the measured
one for GPT-nano, GPT-micro and Llama-tiny under every strategy at 1 and 2 CPU ranks, and for
the tiny mixture-of-experts decoder (expert parallel) and Llama-tiny at 512 tokens (context parallel).

    python experiments/planner/study.py                  # every configuration, writes results
    python experiments/planner/study.py --only nano-ddp-mb8 --no-write
    python experiments/planner/study.py --groups moe llama512  # these models only, merged into results.json
    python experiments/planner/study.py --report-only    # README table and plot from results.json

Each configuration is an ordinary ``python train.py`` run with one thread per rank
(``LITSCALE_THREADS_PER_RANK=1``); both figures come from its ``summary.json``: the measured
``perf/step_time_s`` (the throughput callback's mean over the steps after warm-up, validation
excluded) and ``plan/predicted_step_s``, the planner's prediction for the run as configured
with ``cluster=local_cpu`` (calibrated first if this machine has no calibration). Over the
configurations of one model and global batch at 2 ranks (a "group": what ``plan=auto`` chooses
among), the planner's pick is the one it predicts fastest; regret = measured(pick) / measured(best).
A run starts only at a load average no higher than the core count, is kept only where other
processes took at most a quarter of a core while it ran (``litscale.measure.flops.disturbed``;
``LITSCALE_MAX_LOAD`` raises both), and records both (``load_average``, ``others_load``).

Writes ``results.json``, ``predicted_vs_measured.png`` and the results section of ``README.md``.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(HERE))  # this folder's held_out.py, also where a test loads this file by its path
from held_out import spearman  # noqa: E402

STEPS, WARMUP = 40, 10
COMMON = [
    f"trainer.max_steps={STEPS}",
    f"callbacks.throughput.warmup_steps={WARMUP}",
    "trainer.accelerator=cpu",
    "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false",
    "cluster=local_cpu",
]
MODELS = {
    "nano": ["model=gpt"],
    "micro": ["model=gpt", "model.net.preset=micro"],
    "llama": ["model=llama"],
    "moe": ["model=moe"],
    "llama512": ["model=llama", "data.seq_len=512"],
}

# name: (model, ranks, global batch group, overrides). Names read model-strategy-split.
CONFIGS: dict[str, tuple[str, int, list[str]]] = {
    # One rank: the loop's own costs beside the timed forward-backward.
    "nano-single-mb16": ("nano", 1, ["strategy=single", "data.batch_size=16"]),
    "nano-single-mb4x4": (
        "nano",
        1,
        ["strategy=single", "data.batch_size=4", "trainer.accumulate_grad_batches=4"],
    ),
    "micro-single-mb8": ("micro", 1, ["strategy=single", "data.batch_size=8"]),
    "llama-single-mb16": ("llama", 1, ["strategy=single", "data.batch_size=16"]),
    # Two ranks, GPT-nano, global batch 16: the group the planner picks from.
    "nano-ddp-mb8": ("nano", 2, ["strategy=ddp", "data.batch_size=8"]),
    "nano-ddp-mb4x2": (
        "nano",
        2,
        ["strategy=ddp", "data.batch_size=4", "trainer.accumulate_grad_batches=2"],
    ),
    "nano-ddp-mb2x4": (
        "nano",
        2,
        ["strategy=ddp", "data.batch_size=2", "trainer.accumulate_grad_batches=4"],
    ),
    "nano-ddp-fp16-mb8": ("nano", 2, ["strategy=ddp", "compression=fp16", "data.batch_size=8"]),
    "nano-ddp-powersgd-mb8": (
        "nano",
        2,
        ["strategy=ddp", "compression=powersgd", "data.batch_size=8"],
    ),
    "nano-ddp-topk-mb8": ("nano", 2, ["strategy=ddp", "compression=topk", "data.batch_size=8"]),
    "nano-fsdp-mb8": ("nano", 2, ["strategy=fsdp", "data.batch_size=8"]),
    "nano-fsdp-ac-mb8": (
        "nano",
        2,
        ["strategy=fsdp", "data.batch_size=8", "strategy.activation_checkpointing=true"],
    ),
    "nano-fsdp-mb4x2": (
        "nano",
        2,
        ["strategy=fsdp", "data.batch_size=4", "trainer.accumulate_grad_batches=2"],
    ),
    "nano-zero1-mb8": (
        "nano",
        2,
        ["strategy=deepspeed_zero", "strategy.stage=1", "data.batch_size=8"],
    ),
    "nano-zero3-mb8": (
        "nano",
        2,
        ["strategy=deepspeed_zero", "strategy.stage=3", "data.batch_size=8"],
    ),
    "nano-tp2-mb16": (
        "nano",
        2,
        ["strategy=tensor_parallel", "strategy.tensor_parallel_size=2", "data.batch_size=16"],
    ),
    "nano-pp2-1f1b-mb16x4": (
        "nano",
        2,
        [
            "strategy=pipeline",
            "strategy.pipeline_parallel_size=2",
            "strategy.microbatches=4",
            "data.batch_size=16",
        ],
    ),
    "nano-pp2-interleaved-mb16x4": (
        "nano",
        2,
        [
            "strategy=pipeline",
            "strategy.pipeline_parallel_size=2",
            "strategy.microbatches=4",
            "strategy.schedule=interleaved_1f1b",
            "data.batch_size=16",
        ],
    ),
    # Two ranks, GPT-micro (11M parameters), global batch 8.
    "micro-ddp-mb4": ("micro", 2, ["strategy=ddp", "data.batch_size=4"]),
    "micro-fsdp-mb4": ("micro", 2, ["strategy=fsdp", "data.batch_size=4"]),
    "micro-tp2-mb8": (
        "micro",
        2,
        ["strategy=tensor_parallel", "strategy.tensor_parallel_size=2", "data.batch_size=8"],
    ),
    "micro-pp2-mb8x2": (
        "micro",
        2,
        [
            "strategy=pipeline",
            "strategy.pipeline_parallel_size=2",
            "strategy.microbatches=2",
            "data.batch_size=8",
        ],
    ),
    # Two ranks, Llama-tiny, global batch 16.
    "llama-ddp-mb8": ("llama", 2, ["strategy=ddp", "data.batch_size=8"]),
    "llama-fsdp-mb8": ("llama", 2, ["strategy=fsdp", "data.batch_size=8"]),
    "llama-tp2-mb16": (
        "llama",
        2,
        ["strategy=tensor_parallel", "strategy.tensor_parallel_size=2", "data.batch_size=16"],
    ),
    # MoE-tiny, global batch 16: expert parallel is timed as FSDP's profile plus its all-to-all.
    "moe-single-mb16": ("moe", 1, ["strategy=single", "data.batch_size=16"]),
    "moe-ddp-mb8": ("moe", 2, ["strategy=ddp", "data.batch_size=8"]),
    "moe-fsdp-mb8": ("moe", 2, ["strategy=fsdp", "data.batch_size=8"]),
    "moe-fsdp-ep2-mb8": (
        "moe",
        2,
        ["strategy=fsdp", "strategy.expert_parallel_size=2", "data.batch_size=8"],
    ),
    "moe-tp2-mb16": (
        "moe",
        2,
        ["strategy=tensor_parallel", "strategy.tensor_parallel_size=2", "data.batch_size=16"],
    ),
    # Llama-tiny at 512 tokens, global batch 8: context parallel splits each sequence over both ranks.
    "llama512-single-mb8": ("llama512", 1, ["strategy=single", "data.batch_size=8"]),
    "llama512-ddp-mb4": ("llama512", 2, ["strategy=ddp", "data.batch_size=4"]),
    "llama512-fsdp-mb4": ("llama512", 2, ["strategy=fsdp", "data.batch_size=4"]),
    "llama512-fsdp-cp2-mb8": (
        "llama512",
        2,
        ["strategy=fsdp", "strategy.context_parallel_size=2", "data.batch_size=8"],
    ),
    "llama512-tp2-mb8": (
        "llama512",
        2,
        ["strategy=tensor_parallel", "strategy.tensor_parallel_size=2", "data.batch_size=8"],
    ),
}

GOALS = {"mape": 0.15, "spearman": 0.8, "regret": 1.10}
# The groups plan=auto chooses among: one model's configurations at 2 ranks (one global batch each).
GROUP_NAMES = {
    "nano": "GPT-nano",
    "micro": "GPT-micro",
    "llama": "Llama-tiny",
    "moe": "MoE-tiny",
    "llama512": "Llama-tiny at 512 tokens",
}
ACCURACY_FILE = REPO / "src" / "litscale" / "planner" / "accuracy.json"


def held_out() -> dict[str, str]:
    """The configurations a calibrated term was fitted on, with the term: never scored. The
    contention term is GPT-nano's step under DDP on 2 ranks at calibrate.py's probe micro batch
    (its probe sequence is the study's, data's default 128 tokens)."""
    from litscale.planner.calibrate import PROBE_MICRO

    name = f"nano-ddp-mb{PROBE_MICRO}"
    assert CONFIGS[name] == ("nano", 2, ["strategy=ddp", f"data.batch_size={PROBE_MICRO}"]), name
    return {name: "contention (calibrate.py's probe step)"}


def overrides_of(name: str, config: tuple[str, int, list[str]] | None = None) -> list[str]:
    model, ranks, extra = config or CONFIGS[name]
    return [*MODELS[model], *extra, f"trainer.devices={ranks}", *COMMON, f"name={name}"]


def time_profiles(names: list[str], configs: dict | None = None) -> None:
    """``plan=show`` once per model and rank count among ``names``, at the group's global batch
    (the smallest micro batch there, without accumulation): a run's prediction reads the
    forward-backward a plan of its model timed here (cached), and falls back to FLOPs at the
    calibrated peak where none has (``plan/compute_source``)."""
    configs = configs or CONFIGS
    micro: dict[tuple[str, int, tuple[str, ...]], int] = {}
    for name in names:
        model, ranks, extra = configs[name]
        batch = int(next(o for o in extra if o.startswith("data.batch_size=")).split("=")[1])
        shape = tuple(o for o in extra if "model.net." in o)  # a held-out draw's model shape
        micro[model, ranks, shape] = min(batch, micro.get((model, ranks, shape), batch))
    for (model, ranks, shape), batch in sorted(micro.items()):
        overrides = [
            *MODELS[model],
            *shape,
            f"data.batch_size={batch}",
            f"trainer.devices={ranks}",
            "trainer.accelerator=cpu",
            "cluster=local_cpu",
            "plan=show",
        ]
        print(f"$ python train.py {' '.join(overrides)}", flush=True)
        subprocess.run(
            [sys.executable, str(REPO / "train.py"), *overrides],
            cwd=REPO,
            check=True,
            capture_output=True,
            env={**os.environ, "LITSCALE_THREADS_PER_RANK": "1"},
            timeout=1800,
        )


SETTLE_S = 180  # how long a run waits for the machine's load to fall back below its cores


def quiet_load(name: str) -> float:
    """The last minute's load average once it is at most the core count. The study's own last
    2-rank run lifts it to about 2 for a minute after it ends, so a run waits for it to fall
    (up to ``SETTLE_S``) before calling the machine busy and stopping the study."""
    from litscale.measure import flops

    deadline = time.monotonic() + SETTLE_S
    while True:
        load = flops.load_average()
        busy = flops.busy(load)
        if not busy:
            return load
        if time.monotonic() > deadline:  # a step timed beside other work measures that work too
            raise SystemExit(f"{name}: not recorded: {busy} {SETTLE_S} s before its run; record the study on a "
                             "quiet machine")
        time.sleep(5)


ATTEMPTS = 3  # a run timed beside other work is timed again, this many times in all


def measure(name: str, outputs: Path, config: tuple[str, int, list[str]] | None = None) -> dict:
    from litscale.measure import flops

    config = config or CONFIGS[name]
    overrides = overrides_of(name, config)
    for attempt in range(1, ATTEMPTS + 1):
        load = quiet_load(name)  # before this run adds to it
        clock = flops.cpu_clock()  # what the cores give others while it runs (the run, once reaped, is ours)
        print(f"$ python train.py {' '.join(overrides)}", flush=True)
        env = {**os.environ, "LITSCALE_OUTPUTS": str(outputs / f"{name}-{attempt}"), "LITSCALE_THREADS_PER_RANK": "1"}
        started = time.perf_counter()
        process = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *overrides],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if process.returncode:
            raise RuntimeError(f"{name} failed:\n{process.stdout[-2000:]}\n{process.stderr[-3000:]}")
        wall_s, others = time.perf_counter() - started, flops.others_load(clock)
        disturbed = flops.disturbed(load, others)
        if not disturbed:
            break
        # a step timed beside other work measures that work too
        print(f"  {name}: timed at a {disturbed}: not kept (attempt {attempt} of {ATTEMPTS})", flush=True)
    else:
        raise SystemExit(f"{name}: not recorded: every attempt was timed beside other work; record the study on a "
                         "quiet machine")
    summary = json.loads(next((outputs / f"{name}-{attempt}" / name).glob("runs/*/summary.json")).read_text())
    model, ranks, _ = config
    return {
        "model": model,
        "ranks": ranks,
        "global_batch": summary["layout"]["global_batch"],
        "command": "python train.py " + " ".join(overrides),
        "measured_step_s": summary["perf/step_time_s"],
        "predicted_step_s": summary["plan/predicted_step_s"],
        "compute_source": summary.get("plan/compute_source"),
        "threads_per_rank": summary.get("threads_per_rank"),
        "load_average": round(load, 2),  # the last minute's, as the run started
        "others_load": None if others is None else round(others, 2),  # cores others kept busy meanwhile
        "wall_s": wall_s,
    }


def combined(runs: list[dict]) -> dict:
    """One configuration's passes: the median measured and predicted step times, and each pass's."""
    return {
        **runs[0],
        "measured_step_s": statistics.median(r["measured_step_s"] for r in runs),
        "predicted_step_s": statistics.median(r["predicted_step_s"] for r in runs),
        "measured_each": [r["measured_step_s"] for r in runs],
        "predicted_each": [r["predicted_step_s"] for r in runs],
        "load_average_each": [r["load_average"] for r in runs],
        "wall_s": sum(r["wall_s"] for r in runs),
    }


def spread(values: list[float]) -> str:
    """How far apart one configuration's passes measured: largest over smallest, less 1."""
    return f"{max(values) / min(values) - 1:.0%}" if len(values) > 1 else "-"


def metrics(all_runs: dict[str, dict], excluded: dict[str, str]) -> dict:
    """The pooled figures and the 2-rank groups' picks, over the scored configurations only."""
    runs = {name: run for name, run in all_runs.items() if name not in excluded}

    def mape(names: list[str]) -> float:
        if not names:
            return float("nan")
        return statistics.fmean(
            abs(runs[n]["predicted_step_s"] / runs[n]["measured_step_s"] - 1) for n in names
        )

    names = list(runs)
    groups: dict[str, list[str]] = {}
    for name, run in runs.items():
        if run["ranks"] == 2:
            groups.setdefault(f"{run['model']} global batch {run['global_batch']}", []).append(name)
    by_group = {}
    for group, members in groups.items():
        pick = min(members, key=lambda n: runs[n]["predicted_step_s"])
        best = min(members, key=lambda n: runs[n]["measured_step_s"])
        by_group[group] = {
            "configurations": len(members),
            "pick": pick,
            "best": best,
            "regret": runs[pick]["measured_step_s"] / runs[best]["measured_step_s"],
            "spearman": spearman(
                [runs[n]["predicted_step_s"] for n in members],
                [runs[n]["measured_step_s"] for n in members],
            )
            if len(members) > 2
            else None,
            "mape": mape(members),
        }
    return {
        "mape": mape(names),
        "mape_1_rank": mape([n for n in names if runs[n]["ranks"] == 1]),
        "mape_2_ranks": mape([n for n in names if runs[n]["ranks"] == 2]),
        "spearman": spearman(
            [runs[n]["predicted_step_s"] for n in names],
            [runs[n]["measured_step_s"] for n in names],
        ),
        "regret": max((g["regret"] for g in by_group.values()), default=float("nan")),
        "groups": by_group,
        "per_group": group_statistics(runs),
        "held_out": dict(excluded),
    }


def pass_pairs(passes: int) -> dict[str, list[tuple[int, int]]]:
    """(predicted pass, measured pass) pairs: the same pass, and each pass's predictions against
    every other pass's measurements."""
    pairs = [(p, m) for p in range(passes) for m in range(passes)]
    return {
        "same": [(p, m) for p, m in pairs if p == m],
        "cross": [(p, m) for p, m in pairs if p != m],
    }


def group_statistics(runs: dict[str, dict]) -> dict[str, dict]:
    """Per model, over its configurations at 2 ranks: Spearman and MAPE of the predicted against
    the measured step time for each (predicted pass, measured pass) pair, same-pass and cross-pass;
    ``lowest_cross_pass``: the lowest cross-pass Spearman, with the pair it came from (not a
    held-out figure: these are the configurations the cost model was developed on)."""
    found = {}
    for model, group in GROUP_NAMES.items():
        members = [n for n, r in runs.items() if r["model"] == model and r["ranks"] == 2]
        if len(members) < 3:
            continue
        passes = len(runs[members[0]]["measured_each"])
        stats = {"configurations": len(members), "global_batch": runs[members[0]]["global_batch"]}
        for kind, pairs in pass_pairs(passes).items():
            stats[kind] = [
                {
                    "predicted_pass": p + 1,
                    "measured_pass": m + 1,
                    "spearman": spearman(
                        [runs[n]["predicted_each"][p] for n in members],
                        [runs[n]["measured_each"][m] for n in members],
                    ),
                    "mape": statistics.fmean(
                        abs(runs[n]["predicted_each"][p] / runs[n]["measured_each"][m] - 1)
                        for n in members
                    ),
                }
                for p, m in pairs
            ]
        if stats["cross"]:
            stats["lowest_cross_pass"] = min(stats["cross"], key=lambda pair: pair["spearman"])
        found[group] = stats
    return found


def accuracy_record(results: dict, held: dict | None = None) -> dict:
    """What ``plan=auto`` in a sweep reads (``litscale.planner.trust``): each group's network as
    composed (its architecture: the data's shape left out), its held-out figures (``held``, the
    recorded ``--held-out`` study: MAPE and Spearman with their bootstrap intervals over
    configurations the cost model was not developed on) where recorded, and beside them, for
    reference only, the lowest cross-pass Spearman of the configurations it was developed on."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from litscale.planner.trust import architecture

    groups = {}
    added = {
        name: addition["date"]
        for addition in results.get("additions", [])
        for name in addition["configurations"]
    }
    held_groups = (held or {}).get("groups", {})
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for model, group in GROUP_NAMES.items():
            stats = results["metrics"]["per_group"].get(group)
            if stats is None or "lowest_cross_pass" not in stats:
                continue
            composed = compose(config_name="train", overrides=MODELS[model])
            net = OmegaConf.to_container(composed.model.net, resolve=True)
            lowest = stats["lowest_cross_pass"]
            dates = {
                added[n] for n, r in results["runs"].items() if r["model"] == model and n in added
            }
            groups[group] = {
                "net": architecture(net),
                "seq_len": int(composed.data.seq_len),  # plan=auto reads the group at a job's length first
                "developed_on": {
                    **({"date": ", ".join(sorted(dates))} if dates else {}),
                    "configurations": stats["configurations"],
                    "lowest_cross_pass_spearman": round(lowest["spearman"], 4),
                    "pass": f"predicted in pass {lowest['predicted_pass']}, measured in pass "
                    f"{lowest['measured_pass']}",
                },
            }
            if group in held_groups:
                groups[group]["held_out"] = held_record(held, group)
    return {
        "source": "experiments/planner/study.py",
        "date": results["date"],
        "machine": results["machine"],
        "fitted_on": sorted(results["metrics"].get("held_out", {})),
        "groups": groups,
    }


def held_record(held: dict, group: str) -> dict:
    """One group's held-out figures as plan=auto reads them, rounded to 4 places."""
    figures = held["groups"][group]
    return {"date": held["date"], "seed": held["seed"], "configurations": figures["configurations"],
            "shape": figures["shape"], "spearman": round(figures["spearman"], 4),
            "spearman_interval": [round(v, 4) for v in figures["spearman_interval"]],
            "mape": round(figures["mape"], 4), "mape_interval": [round(v, 4) for v in figures["mape_interval"]]}


def addition_line(addition: dict) -> str:
    """A subset run later (``--groups``/``--only``): its date, the machine's load and its calibration."""
    calibration = addition["calibration"]
    before, after = addition["load_average"]
    return (
        f"Added {addition['date']} (`--groups`/`--only`, the other configurations kept as recorded): "
        f"{', '.join(f'`{n}`' for n in addition['configurations'])}; the machine was shared, load average "
        f"(1, 5, 15 min) {' / '.join(f'{v:.1f}' for v in before)} before and "
        f"{' / '.join(f'{v:.1f}' for v in after)} after, `nice -n 10`; calibration ({calibration['measured']}): "
        f"{link_figures(calibration)}, contention {calibration['contention']:.3f}."
    )


def link_figures(calibration: dict) -> str:
    """The calibration's gloo figures: each collective's own where it timed them apart."""
    kinds = calibration.get("collectives")
    if not kinds:
        return (f"gloo latency {calibration.get('latency_s', 0) * 1e3:.2f} ms, bandwidth "
                f"{calibration.get('bandwidth_bytes_s', 0) / 1e9:.2f} GB/s")
    return "gloo latency and bandwidth, each between stretches of compute: " + "; ".join(
        f"{kind} {fitted['latency_s'] * 1e3:.2f} ms, {fitted['bandwidth_bytes_s'] / 1e9:.2f} GB/s"
        for kind, fitted in kinds.items())


def report(results: dict) -> str:
    runs, m = results["runs"], results["metrics"]
    calibration = results.get("calibration", {})
    lines = [
        f"Machine: {results['machine']}. Recorded {results['date']} with `python experiments/planner/study.py`; "
        f"{STEPS} steps per run, the last {STEPS - WARMUP} timed; one thread per rank; "
        f"{len(next(iter(runs.values())).get('measured_each', [0]))} pass(es), each configuration's median "
        "reported. Calibration "
        f"({calibration.get('measured', '?')}): {link_figures(calibration)}, contention "
        f"{calibration.get('contention', 1.0):.3f}.",
        *map(addition_line, results.get("additions", [])),
        "",
        "| configuration | ranks | global batch | predicted s/step | measured s/step | error | "
        "measured spread | predicted spread |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    held = m.get("held_out", {})
    for name, r in runs.items():
        error = r["predicted_step_s"] / r["measured_step_s"] - 1
        shown = f"`{name}` (held out: {held[name]})" if name in held else f"`{name}`"
        lines.append(
            f"| {shown} | {r['ranks']} | {r['global_batch']} | {r['predicted_step_s']:.4f} | "
            f"{r['measured_step_s']:.4f} | {error:+.1%} | {spread(r.get('measured_each', []))} | "
            f"{spread(r.get('predicted_each', []))} |"
        )

    def verdict(value: float, goal: float, higher_is_better: bool = False) -> str:
        met = value >= goal if higher_is_better else value <= goal
        return "met" if met else "**missed**"

    lines += [
        "",
        "| figure | reached | goal | |",
        "| --- | ---: | ---: | --- |",
        f"| MAPE, all {len(runs) - len(held)} scored configurations | {m['mape']:.1%} | <= 15% | {verdict(m['mape'], 0.15)} |",
        f"| MAPE, 1 rank / 2 ranks | {m['mape_1_rank']:.1%} / {m['mape_2_ranks']:.1%} | | |",
        f"| Spearman, all scored configurations | {m['spearman']:.3f} | >= 0.8 | "
        f"{verdict(m['spearman'], 0.8, True)} |",
        f"| regret, worst group | {m['regret']:.3f} | <= 1.10 | {verdict(m['regret'], 1.10)} |",
        "",
        "| group (2 ranks) | configurations | planner's pick | measured best | regret | Spearman | MAPE |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for group, g in m["groups"].items():
        rho = f"{g['spearman']:.3f}" if g["spearman"] is not None else "-"
        lines.append(
            f"| {group} | {g['configurations']} | `{g['pick']}` | `{g['best']}` | {g['regret']:.3f} | "
            f"{rho} | {g['mape']:.1%} |"
        )
    return "\n".join(lines + ["", *group_table(m["per_group"])]) + "\n"


def group_table(per_group: dict[str, dict]) -> list[str]:
    """Each model's 2-rank configurations on their own: Spearman and MAPE for each pass pair
    (predicted pass -> measured pass). These are the configurations the cost model was developed
    on, so no figure here is held out: plan=auto reads the ``--held-out`` study's instead."""

    def each(pairs: list[dict], key: str, form: str) -> str:
        return " / ".join(f"{pair[key]:{form}}" for pair in pairs)

    some = next(iter(per_group.values()))
    if "lowest_cross_pass" not in some:  # one pass: no other pass to measure against
        return ["Per model group: one pass was run, so no cross-pass figure exists; `--passes 2` or more gives one."]
    heads = [
        " / ".join(f"{p['predicted_pass']}->{p['measured_pass']}" for p in some[kind])
        for kind in ("same", "cross")
    ]
    lines = [
        f"Per model group, the calibration's configuration excluded (passes: predicted -> measured; same-pass "
        f"{heads[0]}, cross-pass {heads[1]}). The cost model was developed on these configurations and its "
        "predictions are the same in both passes, so a cross-pass figure is one set of predictions against "
        "another noisy measurement of the same configurations, not a held-out one (the held-out study is below):",
        "",
        "| group (2 ranks) | configurations | Spearman same-pass | Spearman cross-pass | MAPE same-pass | "
        "MAPE cross-pass |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for group, g in per_group.items():
        lines.append(
            f"| {group}, global batch {g['global_batch']} | {g['configurations']} | "
            f"{each(g['same'], 'spearman', '.3f')} | {each(g['cross'], 'spearman', '.3f')} | "
            f"{each(g['same'], 'mape', '.1%')} | {each(g['cross'], 'mape', '.1%')} |"
        )
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    figure, axis = plt.subplots(figsize=(6.5, 6))
    for ranks, marker in ((1, "s"), (2, "o")):
        for index, model in enumerate(MODELS):
            chosen = [r for r in runs.values() if r["ranks"] == ranks and r["model"] == model]
            if chosen:
                axis.scatter(
                    [r["measured_step_s"] for r in chosen],
                    [r["predicted_step_s"] for r in chosen],
                    marker=marker,
                    color=f"C{index}",
                    label=f"{model}, {ranks} rank(s)",
                )
    values = [v for r in runs.values() for v in (r["measured_step_s"], r["predicted_step_s"])]
    low, high = min(values) * 0.8, max(values) * 1.25
    axis.plot([low, high], [low, high], color="black", lw=0.8, label="prediction = measurement")
    axis.fill_between(
        [low, high],
        [low * 0.85, high * 0.85],
        [low * 1.15, high * 1.15],
        color="grey",
        alpha=0.15,
        label="within 15%",
    )
    axis.set(
        xscale="log",
        yscale="log",
        xlim=(low, high),
        ylim=(low, high),
        xlabel="measured s/step",
        ylabel="predicted s/step (plan/predicted_step_s)",
        title=f"Planner on this machine: MAPE {results['metrics']['mape']:.1%}, "
        f"Spearman {results['metrics']['spearman']:.2f}",
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_section(name: str, script: str, text: str) -> None:
    """Replace the README's section between ``<!-- name: written by script -->`` and ``<!-- end name -->``."""
    path = HERE / "README.md"
    start, end = f"<!-- {name}: written by {script} -->", f"<!-- end {name} -->"
    before, rest = path.read_text().split(start, 1)
    path.write_text(f"{before}{start}\n{text}{end}{rest.split(end, 1)[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="*", choices=list(CONFIGS), help="configurations to run (default: all)"
    )
    parser.add_argument(
        "--groups",
        nargs="*",
        choices=list(MODELS),
        help="run these models' configurations only, merged into the recorded results.json",
    )
    parser.add_argument(
        "--passes", type=int, default=2, help="runs of each configuration (medians are reported)"
    )
    parser.add_argument("--no-write", action="store_true", help="print, write nothing")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite README and plot from results.json"
    )
    parser.add_argument("--held-out", action="store_true",
                        help="time a seeded draw of configurations the cost model was not developed on (held_out.py)")
    parser.add_argument("--seed", type=int, default=0, help="the held-out draw's seed")
    parser.add_argument("--per-group", type=int, default=8, help="held-out configurations per model group")
    args = parser.parse_args()
    if args.held_out:
        return record_held_out(seed=args.seed, per_group=args.per_group, write=not args.no_write)
    if args.report_only:  # the figures recomputed from the recorded runs
        results = json.loads((HERE / "results.json").read_text())
        results["metrics"] = metrics(results["runs"], held_out())
    else:
        names = args.only or [
            n for n, (model, _, _) in CONFIGS.items() if model in (args.groups or MODELS)
        ]
        samples, load_before = {}, os.getloadavg()
        time_profiles(names)
        with tempfile.TemporaryDirectory() as outputs:
            for index in range(
                args.passes
            ):  # every configuration once per pass: drifts in the machine's load
                for name in names:  # fall on all of them, not on a few
                    r = measure(name, Path(outputs) / f"pass{index}")
                    samples.setdefault(name, []).append(r)
                    print(
                        f"  pass {index + 1}: predicted {r['predicted_step_s']:.4f} s, measured "
                        f"{r['measured_step_s']:.4f} s ({r['predicted_step_s'] / r['measured_step_s'] - 1:+.1%})",
                        flush=True,
                    )
        runs = {name: combined(runs_of_name) for name, runs_of_name in samples.items()}
        import torch

        from litscale.planner.calibrate import calibration_path

        results = {
            "machine": f"{os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}",
            "calibration": json.loads(calibration_path().read_text()),  # what local_cpu read
            "date": time.strftime("%Y-%m-%d"),
            "runs": runs,
        }
        if args.groups or args.only:  # a subset: the recorded runs kept, these added beside them
            recorded = json.loads((HERE / "results.json").read_text())
            addition = {key: results[key] for key in ("date", "calibration")}
            addition.update(
                configurations=list(runs), load_average=[os.getloadavg(), load_before][::-1]
            )
            results = {
                **recorded,
                "runs": {**recorded["runs"], **runs},
                "additions": [*recorded.get("additions", []), addition],
            }
        results["metrics"] = metrics(results["runs"], held_out())
    text = report(results)
    print(text)
    if args.no_write:
        return
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    ACCURACY_FILE.write_text(json.dumps(accuracy_record(results, recorded_held_out()), indent=1) + "\n")
    plot(results, HERE / "predicted_vs_measured.png")
    write_section("accuracy", "study.py", text)


HELD_OUT_FILE = HERE / "held_out.json"


def recorded_held_out() -> dict | None:
    """The recorded held-out study (``held_out.json``), None before one is recorded."""
    return json.loads(HELD_OUT_FILE.read_text()) if HELD_OUT_FILE.exists() else None


def record_held_out(*, seed: int, per_group: int, write: bool) -> None:
    """Draw (``held_out.draw``), time each configuration once, and write ``held_out.json``, the
    held-out figures into ``accuracy.json`` (beside the recorded developed-on ones) and the README."""
    import held_out as held_out_study  # this folder's held_out.py (``held_out()`` here is the calibration's)

    drawn = held_out_study.draw(CONFIGS, seed=seed, per_group=per_group)
    before = os.getloadavg()
    time_profiles(list(drawn), drawn)
    runs = {}
    with tempfile.TemporaryDirectory() as outputs:
        for name, config in drawn.items():
            runs[name] = {**measure(name, Path(outputs), config), "overrides": config[2]}
            print(f"  predicted {runs[name]['predicted_step_s']:.4f} s, measured {runs[name]['measured_step_s']:.4f} s",
                  flush=True)
    import torch

    from litscale.planner.calibrate import calibrated_figures

    figures = calibrated_figures() or {}  # the calibration every prediction read (the plan=show above wrote it)
    held = {"date": time.strftime("%Y-%m-%d"), "seed": seed, "per_group": per_group, "nice": os.nice(0),
            "machine": f"{os.cpu_count()} cores, {platform.platform()}, torch {torch.__version__}",
            "calibration": {key: figures.get(key) for key in ("measured", "load_average", "others_load", "contention")},
            "load_average": {"before": before, "after": os.getloadavg()}, "runs": runs,
            "groups": held_out_study.group_figures(runs, GROUP_NAMES, seed=seed)}
    text = held_out_study.report(held)
    print(text)
    if not write:
        return
    HELD_OUT_FILE.write_text(json.dumps(held, indent=1) + "\n")
    results = json.loads((HERE / "results.json").read_text())
    results["metrics"] = metrics(results["runs"], held_out())
    ACCURACY_FILE.write_text(json.dumps(accuracy_record(results, held), indent=1) + "\n")
    write_section("held-out", "study.py", text)


if __name__ == "__main__":
    main()
