"""Writes the results section of experiments/moe/README.md (between its results markers) and
the plots ``bpb_vs_step.png``, ``load_balance.png`` and ``context_parallel.png`` from
``results.json`` alone: no figure in them is typed by hand.

    python experiments/moe/report.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from run import MOE_CONFIGS

HERE = Path(__file__).resolve().parent
MIB = 2**20
START, END = "<!-- results: written by report.py -->", "<!-- end results -->"


def by_config(runs: dict) -> dict[str, list[dict]]:
    """Runs grouped by configuration, in the order run.py defines them, seeds sorted."""
    groups = {
        name: sorted((r for r in runs.values() if r["config"] == name), key=lambda r: r["seed"])
        for name in MOE_CONFIGS
    }
    return {name: group for name, group in groups.items() if group}


def median_of(group: list[dict], key: str) -> float:
    return statistics.median(r["summary"][key] for r in group)


def flops_per_token(run: dict) -> float:
    return run["summary"]["perf/flops_per_sample"] / run["seq_len"]


def _load_range(runs: list[dict]) -> str:
    loads = [value for r in runs for value in (r["load_before"][0], r["load_after"][0])]
    return f"{min(loads):.1f} to {max(loads):.1f}"


def speed_rounds(results: dict) -> dict[str, dict]:
    """Per configuration, tokens/s of each round's short run and its ratio to the dense run of
    the same round (both measured minutes apart, so under nearly the same load)."""
    runs = results.get("speed", {}).values()
    dense = {
        r["round"]: r["summary"]["perf/tokens_per_sec"] for r in runs if r["config"] == "dense"
    }
    table = {}
    for name in MOE_CONFIGS:
        mine = sorted((r for r in runs if r["config"] == name), key=lambda r: r["round"])
        if not mine:
            continue
        speeds = [r["summary"]["perf/tokens_per_sec"] for r in mine]
        ratios = [
            s / dense[r["round"]] for s, r in zip(speeds, mine, strict=True) if r["round"] in dense
        ]
        table[name] = {"tokens_per_sec": speeds, "ratios": ratios, "runs": mine}
    return table


def median_ratio(speed: dict[str, dict], name: str) -> float | None:
    return statistics.median(speed[name]["ratios"]) if speed.get(name, {}).get("ratios") else None


def moe_verdict(groups: dict[str, list[dict]], speed: dict[str, dict]) -> list[str]:
    if "dense" not in groups:
        return []
    dense_bpb = median_of(groups["dense"], "val/bpb")
    lines = []
    for name, group in groups.items():
        if name == "dense":
            continue
        bpb, ratio = median_of(group, "val/bpb"), median_ratio(speed, name)
        below = bpb < dense_bpb
        wins = sum(
            r["summary"]["val/bpb"] < d["summary"]["val/bpb"]
            for r in group
            for d in groups["dense"]
            if d["seed"] == r["seed"]
        )
        lines.append(
            f"- {MOE_CONFIGS[name]['label']}: **{bpb:.3f}** bits per byte, {'**below**' if below else '**not below**'} "
            f"the dense run's {dense_bpb:.3f} ({100 * (bpb / dense_bpb - 1):+.1f}%; lower on {wins} of {len(group)} "
            f"seeds), at {f'{ratio:.2f}x' if ratio else 'an unmeasured share of'} its tokens/s; load imbalance {median_of(group, 'moe/load_imbalance_mean'):.2f} "
            f"on average over the run, {median_of(group, 'moe/load_imbalance'):.2f} at the last step."
        )
    return lines


def speed_table(speed: dict[str, dict]) -> list[str]:
    if "dense" not in speed:
        return []
    rounds = speed["dense"]["runs"]
    every = [r for row in speed.values() for r in row["runs"]]
    lines = [
        "",
        f"Tokens/s alone: {len(rounds)} rounds of short runs ({rounds[0]['command'].split('max_steps=')[1].split()[0]} "
        "steps, no validation), every configuration once a round, a different one first each round; "
        f"load average (1 min) {_load_range(every)}:",
        "",
        "| configuration | tokens/s per round | median | vs dense, per round | vs dense (median) |",
        "|---|---|---:|---|---:|",
    ]
    for name, row in speed.items():
        lines.append(
            f"| {MOE_CONFIGS[name]['label']} | {' / '.join(f'{v:,.0f}' for v in row['tokens_per_sec'])} "
            f"| {statistics.median(row['tokens_per_sec']):,.0f} | {' / '.join(f'{v:.2f}' for v in row['ratios'])} "
            f"| **{median_ratio(speed, name):.2f}x** |"
        )
    return lines


def moe_section(results: dict) -> list[str]:
    groups = by_config(results["moe"])
    if not groups:
        return []
    speed = speed_rounds(results)
    any_run = next(iter(groups.values()))[0]
    dense_flops = flops_per_token(groups["dense"][0]) if "dense" in groups else None
    every = [r for group in groups.values() for r in group]
    tokens_per_step = round(
        any_run["summary"]["perf/step_time_s"] * any_run["summary"]["perf/tokens_per_sec"]
    )
    lines = [
        f"### Dense vs MoE at equal active FLOPs: {any_run['steps']} steps of {tokens_per_step:,} tokens, "
        f"seeds {sorted({r['seed'] for r in every})}",
        "",
        *moe_verdict(groups, speed),
        "",
        "| configuration | params | FLOPs/token (litscale) | vs dense | val bpb (median) | per seed "
        "| tokens/s (in these runs) | load imbalance, run mean | last step "
        "| dropped | balance loss (1 = even) |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for name, group in groups.items():
        flops = flops_per_token(group[0])
        moe = "moe/load_imbalance_mean" in group[0]["summary"]
        cells = [
            MOE_CONFIGS[name]["label"],
            f"{group[0]['summary']['num_params']:,}",
            f"{flops / 1e6:.3f}M",
            f"{100 * (flops / dense_flops - 1):+.2f}%" if dense_flops else "-",
            f"**{median_of(group, 'val/bpb'):.3f}**",
            " / ".join(f"{r['summary']['val/bpb']:.3f}" for r in group),
            " / ".join(f"{r['summary']['perf/tokens_per_sec']:,.0f}" for r in group),
        ]
        if moe:
            cells += [
                f"{median_of(group, 'moe/load_imbalance_mean'):.2f}",
                f"{median_of(group, 'moe/load_imbalance'):.2f}",
                f"{100 * median_of(group, 'moe/dropped_fraction'):.1f}%",
                f"{median_of(group, 'moe/aux_loss'):.3f}",
            ]
        else:
            cells += ["-"] * 4
        lines.append("| " + " | ".join(cells) + " |")
    lines += speed_table(speed)
    lines += [
        "",
        "Assignments routed to each expert over the whole run, before a capacity's drops (the first "
        "seed, each MoE layer; an even split is the mean):",
        "",
        "| configuration | layer | tokens per expert | max / mean |",
        "|---|---:|---|---:|",
    ]
    for name, group in groups.items():
        run = group[0]["summary"]
        for layer, counts in zip(
            run.get("moe/layers", []), run.get("moe/tokens_per_expert", []), strict=True
        ):
            lines.append(
                f"| {MOE_CONFIGS[name]['label']} | {layer} | {', '.join(f'{c:,}' for c in counts)} "
                f"| {max(counts) / statistics.mean(counts):.2f} |"
            )
    lines += [
        "",
        f"FLOPs/token is `perf/flops_per_sample` of each run's `summary.json` over `data.seq_len` "
        f"({any_run['seq_len']}): the model's own count (`flops_per_token`: 6 per weight a token multiplies, "
        "only the chosen experts', plus attention), which `tests/test_moe.py` checks against "
        "`torch.utils.flop_counter`. Params count every expert. tokens/s is `perf/tokens_per_sec`, "
        "the throughput callback's steady state, validation excluded, one torch thread per run "
        f"(`LITSCALE_THREADS_PER_RANK=1`). Load average (1 min) around these runs: {_load_range(every)}.",
        "",
        "Commands (the first seed; the others differ in `seed=`), each run by `run.py` as "
        "`LITSCALE_THREADS_PER_RANK=1 nice -n 10 python train.py ...`:",
        "",
        "```bash",
    ]
    lines += [group[0]["command"] for group in groups.values()]
    lines += [
        "```",
        "",
        "![val bpb vs step](bpb_vs_step.png)",
        "",
        "![load balance](load_balance.png)",
        "",
    ]
    return lines


def cp_rows(results: dict) -> list[dict]:
    return sorted(results["cp"].values(), key=lambda r: (r["seq_len"], r["context"]))


def cp_figures(run: dict) -> dict:
    ranks = run["ranks"]
    states = sum(run["summary"][f"memory/{k}_bytes"] for k in ("params", "grads", "optimizer"))
    return {
        "step_s": statistics.median(run["step_times_s"]),
        "steps": len(run["step_times_s"]),
        "peak": max(r["peak_rss_bytes"] for r in ranks),
        "growth": max(r["peak_rss_bytes"] - r["rss_at_train_start_bytes"] for r in ranks),
        "states": states,
        "tokens": run["summary"]["global_batch"] * run["seq_len"],
    }


def cp_verdict(rows: list[dict]) -> list[str]:
    lines = []
    lengths = sorted({r["seq_len"] for r in rows})
    for seq_len in lengths:
        pair = {r["context"]: cp_figures(r) for r in rows if r["seq_len"] == seq_len}
        if set(pair) != {1, 2}:
            continue
        one, two = pair[1], pair[2]
        lines.append(
            f"- seq_len {seq_len}: context 2 steps in {two['step_s']:.3f} s against {one['step_s']:.3f} s "
            f"({one['step_s'] / two['step_s']:.2f}x the speed); training added {two['growth'] / MIB:.0f} MiB "
            f"to a context-2 rank's resident set against {one['growth'] / MIB:.0f} MiB to the single rank's "
            f"({two['growth'] / max(one['growth'], 1):.2f}x)."
        )
    return lines


def cp_section(results: dict) -> list[str]:
    rows = cp_rows(results)
    if not rows:
        return []
    lines = [
        f"### Context parallel: Llama tiny, {rows[0]['summary']['global_batch']} sequences a step, "
        f"one rank (context 1) vs two (context 2)",
        "",
        *cp_verdict(rows),
        "",
        "| seq_len | context | ranks | tokens/step | step s (median) | per step | peak RSS per rank "
        "| RSS growth in training | states per rank (memory callback) | load average |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for run in rows:
        f = cp_figures(run)
        lines.append(
            f"| {run['seq_len']} | {run['context']} | {run['summary']['world_size']} | {f['tokens']:,} "
            f"| **{f['step_s']:.3f}** | {' / '.join(f'{t:.2f}' for t in run['step_times_s'])} "
            f"| {f['peak'] / MIB:.0f} MiB | {f['growth'] / MIB:.0f} MiB | {f['states'] / MIB:.2f} MiB "
            f"| {run['load_before'][0]:.1f} / {run['load_after'][0]:.1f} |"
        )
    lines += [
        "",
        "Step s is the median of the steps after the throughput callback's warm-up, each step's time "
        "recovered from `perf/step_time_s` (its running mean, logged every step, in the run's "
        "`metrics.csv`). Memory: litscale's memory callback measures the states a rank holds "
        "(parameters, gradients, AdamW state: the last column); on a CPU nothing in litscale measures "
        "activations, so `peak_rss.py` (a callback added to these runs) records each rank's peak "
        "resident set (the kernel's `VmHWM`, whole process: Python, torch, data) and its resident set "
        "when training starts; RSS growth is the difference, the largest over the ranks. One torch "
        "thread per rank: context 1 runs on one core, context 2 on two. Load average (1 min) before / "
        "after each run.",
        "",
        "Commands, each run by `run.py` as `LITSCALE_THREADS_PER_RANK=1 nice -n 10 python train.py ...` "
        "with `experiments/moe` on `PYTHONPATH` (for `peak_rss.py`):",
        "",
        "```bash",
    ]
    lines += [run["command"] for run in rows]
    lines += ["```", "", "![context parallel](context_parallel.png)", ""]
    return lines


def report(results: dict) -> str:
    m = results["machine"]
    parts = [results.get(part, {}).values() for part in ("moe", "cp", "speed")]
    dates = sorted(r["date"] for runs in parts for r in runs)
    minutes = sum(r["process_wall_s"] for runs in parts for r in runs) / 60
    lines = [
        f"Recorded {dates[0]} to {dates[-1]} UTC with `python experiments/moe/run.py`: {m['cores']} cores "
        f"({m['cpu']}), {m['system']}, Python {m['python']}, torch {m['torch']}, lightning {m['lightning']}. "
        "The machine was shared with other jobs (load averages below, on 2 cores) and every run was at "
        "`nice -n 10`: throughput and step times are indicative, bits per byte are not affected. "
        f"The {sum(len(runs) for runs in parts)} `train.py` commands took {minutes:.0f} min in all.",
        "",
    ]
    lines += moe_section(results) + cp_section(results)
    return "\n".join(lines)


def plot_moe(results: dict, folder: Path) -> None:
    import matplotlib.pyplot as plt

    groups = by_config(results["moe"])
    figure, (bpb, train) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (name, group) in enumerate(groups.items()):
        for axis, key in ((bpb, "val/bpb"), (train, "train/loss")):
            curves = [r["curves"][key] for r in group]
            for c in curves:
                axis.plot(
                    [p[0] for p in c], [p[1] for p in c], color=f"C{index}", alpha=0.25, lw=0.8
                )
            length = min(len(c) for c in curves)
            axis.plot(
                [curves[0][i][0] for i in range(length)],
                [statistics.median(c[i][1] for c in curves) for i in range(length)],
                color=f"C{index}",
                marker="osD^v"[index % 5] if key == "val/bpb" else None,
                ls=("-", "--", ":", "-.")[index % 4],
                label=MOE_CONFIGS[name]["label"],
            )
    bpb.set_ylabel("val bits per byte (median of seeds; faint: each seed)")
    train.set_ylabel("train loss (nats per byte)")
    for axis in (bpb, train):
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    bpb.set_ylim(top=min(6.0, bpb.get_ylim()[1]))
    figure.suptitle("Dense Llama vs MoE at equal active FLOPs per token (CPU)")
    figure.tight_layout()
    figure.savefig(folder / "bpb_vs_step.png", dpi=110)
    plt.close(figure)

    moe_groups = {k: v for k, v in groups.items() if k != "dense"}
    figure, (curve_axis, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (name, group) in enumerate(moe_groups.items(), start=1):
        for seed_index, run in enumerate(group):
            c = run["curves"]["moe/load_imbalance"]
            curve_axis.plot(
                [p[0] for p in c],
                [p[1] for p in c],
                color=f"C{index}",
                alpha=1 if seed_index == 0 else 0.35,
                label=MOE_CONFIGS[name]["label"] if seed_index == 0 else None,
            )
        counts = group[0]["summary"]["moe/tokens_per_expert"]
        shares = [[c / sum(layer) for c in layer] for layer in counts]
        width = 0.8 / len(moe_groups)
        for layer, share in enumerate(shares):
            x = [layer * (len(share) + 2) + e + (index - 1) * width for e in range(len(share))]
            bars.bar(
                x,
                share,
                width=width,
                color=f"C{index}",
                label=MOE_CONFIGS[name]["label"] if layer == 0 else None,
            )
    counts = next(iter(moe_groups.values()))[0]["summary"]["moe/tokens_per_expert"]
    layers = next(iter(moe_groups.values()))[0]["summary"]["moe/layers"]
    experts = len(counts[0])
    bars.axhline(1 / experts, color="grey", lw=0.8, ls="--")
    bars.set_xticks(
        [
            layer * (experts + 2) + e + 0.4 - 0.4 / len(moe_groups)
            for layer in range(len(counts))
            for e in range(experts)
        ],
        [str(e) for _ in counts for e in range(experts)],
    )
    bars.set_xlabel(
        f"expert, in layer {' | layer '.join(str(i) for i in layers)} (the dashed line: an even split)"
    )
    bars.set_ylabel("share of the layer's routed assignments over the run (first seed)")
    curve_axis.axhline(1.0, color="grey", lw=0.8, ls="--")
    curve_axis.set_xlabel("step")
    curve_axis.set_title("solid: the first seed, faint: the others", fontsize=9)
    curve_axis.set_ylabel("moe/load_imbalance (max / mean tokens per expert; 1 is even)")
    for axis in (curve_axis, bars):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(
        "Router load over training: no balancing, aux-loss-free bias, balance loss, a capacity"
    )
    figure.tight_layout()
    figure.savefig(folder / "load_balance.png", dpi=110)
    plt.close(figure)


def plot_cp(results: dict, folder: Path) -> None:
    import matplotlib.pyplot as plt

    rows = cp_rows(results)
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, context in enumerate(sorted({r["context"] for r in rows})):
        runs = [r for r in rows if r["context"] == context]
        lengths = [r["seq_len"] for r in runs]
        figures = [cp_figures(r) for r in runs]
        time_axis.plot(
            lengths,
            [f["step_s"] for f in figures],
            marker="o",
            color=f"C{index}",
            label=f"context {context}: {runs[0]['summary']['world_size']} rank(s) of one thread",
        )
        time_axis.fill_between(
            lengths,
            [min(r["step_times_s"]) for r in runs],
            [max(r["step_times_s"]) for r in runs],
            color=f"C{index}",
            alpha=0.2,
        )
        memory_axis.plot(
            lengths,
            [f["growth"] / MIB for f in figures],
            marker="o",
            color=f"C{index}",
            label=f"context {context}: RSS growth in training",
        )
        memory_axis.plot(
            lengths,
            [f["peak"] / MIB for f in figures],
            marker="s",
            ls="--",
            color=f"C{index}",
            alpha=0.6,
            label=f"context {context}: peak RSS",
        )
    for axis in (time_axis, memory_axis):
        axis.set_xscale("log", base=2)
        axis.set_xticks(
            sorted({r["seq_len"] for r in rows}),
            [str(n) for n in sorted({r["seq_len"] for r in rows})],
        )
        axis.set_yscale("log")
        axis.set_xlabel("data.seq_len")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
    time_axis.set_ylabel("step time, s (median; band: min to max)")
    memory_axis.set_ylabel("MiB per rank (the largest rank)")
    figure.suptitle("Context parallel on CPU: Llama tiny, FSDP, 1 vs 2 gloo ranks")
    figure.tight_layout()
    figure.savefig(folder / "context_parallel.png", dpi=110)
    plt.close(figure)


def write_readme(text: str) -> None:
    readme = (HERE / "README.md").read_text()
    before, rest = readme.split(START, 1)
    after = rest.split(END, 1)[1]
    (HERE / "README.md").write_text(f"{before}{START}\n{text}{END}{after}")


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    results = json.loads((HERE / "results.json").read_text())
    write_readme(report(results))
    if results["moe"]:
        plot_moe(results, HERE)
    if results["cp"]:
        plot_cp(results, HERE)


if __name__ == "__main__":
    main()
