"""The held-out accuracy study: configurations the cost model was not developed on.

The 35 configurations of ``study.py`` are the ones the cost model was developed against: every
term was added or fixed while their errors were read. Their Spearman says how well the model
fits them, not how well it ranks a user's layouts. Here each model group gets a seeded draw of
configurations at a model shape no test uses (``SHAPES``), over the layouts a 2-rank run can take
(``LAYOUTS``), micro batches and accumulation (the group's global batch kept, so the draw is what
``plan=auto`` chooses among), none equal to a developed-on configuration in layout, micro batch
and accumulation. Each is timed once by ``study.measure``, as the developed-on ones are.

What a group's figures mean: MAPE, the mean of |predicted / measured - 1|; Spearman, how well
the predicted step times rank the configurations as measured (1: the same order); each with a 95%
bootstrap interval, the 2.5th and 97.5th percentiles of the figure over ``RESAMPLES`` draws of the
group's configurations with replacement (seeded). With 8 configurations one misordered pair moves
Spearman by about 0.02-0.1, so the interval is wide; ``plan=auto`` takes the planner's pick for a
group only where its lower end reaches ``litscale.planner.trust.SPEARMAN_BAR``.

    python experiments/planner/study.py --held-out             # draw (seed 0), time, write
    python experiments/planner/study.py --held-out --seed 1 --per-group 10 --no-write
"""

from __future__ import annotations

import random
import statistics

PER_GROUP = 8
SEED = 0
RESAMPLES = 2000

# One shape per group that no test uses (``tests/test_planner_held_out.py`` checks): the
# architecture plan=auto is asked about is the group's preset; its held-out figures say how the
# model ranks layouts of that family on a shape it was not developed on.
SHAPES: dict[str, list[str]] = {
    "nano": ["+model.net.n_layer=6", "+model.net.n_embd=192", "+model.net.n_head=6"],
    "micro": ["+model.net.n_layer=4", "+model.net.n_embd=320", "+model.net.n_head=10"],
    "llama": ["+model.net.n_layer=3", "+model.net.n_embd=160", "+model.net.n_head=4", "model.net.n_kv_heads=2",
              "+model.net.ffn_hidden_size=448"],
    "moe": ["+model.net.n_layer=4", "+model.net.n_embd=80", "+model.net.n_head=4", "model.net.n_experts=12",
            "model.net.top_k=3"],
    "llama512": ["+model.net.n_layer=2", "+model.net.n_embd=224", "+model.net.n_head=4", "model.net.n_kv_heads=2",
                 "+model.net.ffn_hidden_size=576"],
}
GLOBAL_BATCH = {"nano": 16, "micro": 8, "llama": 16, "moe": 16, "llama512": 8}

# Layouts of 2 ranks: (name, overrides, data-parallel ranks, pipeline micro-batches or 0).
_DATA_PARALLEL = [
    ("ddp", ["strategy=ddp"], 2, 0),
    ("ddp-fp16", ["strategy=ddp", "compression=fp16"], 2, 0),
    ("ddp-powersgd", ["strategy=ddp", "compression=powersgd"], 2, 0),
    ("fsdp", ["strategy=fsdp"], 2, 0),
    ("fsdp-ac", ["strategy=fsdp", "strategy.activation_checkpointing=true"], 2, 0),
    ("zero1", ["strategy=deepspeed_zero", "strategy.stage=1"], 2, 0),
    ("zero2", ["strategy=deepspeed_zero", "strategy.stage=2"], 2, 0),
    ("zero3", ["strategy=deepspeed_zero", "strategy.stage=3"], 2, 0),
]
_TENSOR = ("tp2", ["strategy=tensor_parallel", "strategy.tensor_parallel_size=2"], 1, 0)
_PIPELINES = [
    ("pp2-1f1b", ["strategy=pipeline", "strategy.pipeline_parallel_size=2"], 1, 2),
    ("pp2-interleaved", ["strategy=pipeline", "strategy.pipeline_parallel_size=2",
                         "strategy.schedule=interleaved_1f1b"], 1, 2),
    ("pp2-gpipe", ["strategy=pipeline", "strategy.pipeline_parallel_size=2", "strategy.schedule=gpipe"], 1, 2),
]
LAYOUTS: dict[str, list[tuple[str, list[str], int, int]]] = {
    "nano": [*_DATA_PARALLEL, _TENSOR, *_PIPELINES],
    "micro": [*_DATA_PARALLEL, _TENSOR, *_PIPELINES],
    "llama": [*_DATA_PARALLEL, _TENSOR, *_PIPELINES],
    # A pipeline computes a mixture of experts without its load-balancing loss only, and
    # DeepSpeed's engine does not take expert parallel: the layouts a default MoE run trains.
    "moe": [*_DATA_PARALLEL[:5], _TENSOR,
            ("fsdp-ep2", ["strategy=fsdp", "strategy.expert_parallel_size=2"], 2, 0),
            ("fsdp-ep2-ac", ["strategy=fsdp", "strategy.expert_parallel_size=2",
                             "strategy.activation_checkpointing=true"], 2, 0)],
    "llama512": [*_DATA_PARALLEL, _TENSOR, *_PIPELINES[:2],
                 ("fsdp-cp2", ["strategy=fsdp", "strategy.context_parallel_size=2"], 1, 0)],
}


def candidates(model: str) -> list[tuple[str, list[str]]]:
    """Every (name, overrides) of ``model``'s group at its global batch: each layout with each
    micro batch and accumulation that make the batch (a pipeline's micro batch split into 2 or 4
    micro-batches), at the group's held-out shape."""
    found = []
    batch = GLOBAL_BATCH[model]
    for layout, overrides, data_ranks, _ in LAYOUTS[model]:
        per_rank = batch // data_ranks
        for micro in (m for m in (1, 2, 4, 8, 16) if per_rank % m == 0):
            accumulation = per_rank // micro
            splits = (2, 4) if layout.startswith("pp2") else (0,)
            for split in (s for s in splits if not s or micro % s == 0):
                extra = [f"strategy.microbatches={split}"] if split else []
                name = f"{model}-held-{layout}-mb{micro}x{accumulation}" + (f"-m{split}" if split else "")
                found.append((name, [*overrides, *extra, f"data.batch_size={micro}",
                                     f"trainer.accumulate_grad_batches={accumulation}", *SHAPES[model]]))
    return found


def developed_on(configs: dict[str, tuple[str, int, list[str]]]) -> set[tuple[str, frozenset[str]]]:
    """The developed-on configurations (``study.CONFIGS``) as (model, their overrides with the
    accumulation spelled out): a drawn one equal to one of these in layout, micro batch and
    accumulation is left out whatever its shape."""
    found = set()
    for model, _, extra in configs.values():
        spelled = set(extra)
        if not any(o.startswith("trainer.accumulate_grad_batches=") for o in extra):
            spelled.add("trainer.accumulate_grad_batches=1")
        found.add((model, frozenset(spelled)))
    return found


def draw(configs: dict[str, tuple[str, int, list[str]]], *, seed: int = SEED,
         per_group: int = PER_GROUP) -> dict[str, tuple[str, int, list[str]]]:
    """``per_group`` configurations of each group, drawn with ``random.Random(seed)`` from its
    candidates not developed on, as ``study.CONFIGS`` holds them: name -> (model, 2, overrides)."""
    rng, seen = random.Random(seed), developed_on(configs)
    drawn = {}
    for model in SHAPES:
        pool = [(name, overrides) for name, overrides in candidates(model)
                if (model, frozenset(o for o in overrides if o not in SHAPES[model])) not in seen]
        for name, overrides in rng.sample(pool, per_group):
            drawn[name] = (model, 2, overrides)
    return drawn


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (ties share their mean rank); hand-written to keep scipy out of the stack."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def interval(values: list[float]) -> list[float]:
    """The 2.5th and 97.5th percentiles (statistics' inclusive quantiles)."""
    cuts = statistics.quantiles(values, n=40, method="inclusive")
    return [cuts[0], cuts[-1]]


def bootstrap(predicted: list[float], measured: list[float], *, seed: int = SEED,
              resamples: int = RESAMPLES) -> dict[str, float | list[float]]:
    """MAPE and Spearman of ``predicted`` against ``measured`` step times, each with its 95%
    percentile interval over ``resamples`` resamples of the configurations with replacement. A
    resample whose measured (or predicted) times are all one value has no ranking and is
    skipped for Spearman."""
    n, rng = len(predicted), random.Random(seed)
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured, strict=True)]
    mapes, rhos = [], []
    for _ in range(resamples):
        picked = [rng.randrange(n) for _ in range(n)]
        mapes.append(statistics.fmean(errors[i] for i in picked))
        xs, ys = [predicted[i] for i in picked], [measured[i] for i in picked]
        if len(set(xs)) > 1 and len(set(ys)) > 1:
            rhos.append(spearman(xs, ys))
    return {"configurations": n, "mape": statistics.fmean(errors), "mape_interval": interval(mapes),
            "spearman": spearman(predicted, measured), "spearman_interval": interval(rhos)}


def group_figures(runs: dict[str, dict], group_names: dict[str, str], *, seed: int = SEED) -> dict[str, dict]:
    """Each group's held-out figures (``bootstrap``) over its drawn runs, with its shape;
    ``group_names``: model -> group (``study.GROUP_NAMES``)."""
    found = {}
    for model, group in group_names.items():
        members = [run for run in runs.values() if run["model"] == model]
        if len(members) < 3:
            continue
        figures = bootstrap([r["predicted_step_s"] for r in members], [r["measured_step_s"] for r in members],
                            seed=seed)
        found[group] = {**figures, "shape": SHAPES[model], "global_batch": members[0]["global_batch"]}
    return found


def _others_while_timed(held: dict) -> str:
    """What other processes took of the cores while each run was timed, where it was recorded."""
    others = [run["others_load"] for run in held["runs"].values() if run.get("others_load") is not None]
    return f"; other processes kept {min(others):.2f}-{max(others):.2f} of a core busy while each ran" if others else ""


def _calibration_line(held: dict) -> str:
    """The calibration every prediction read, where it was recorded."""
    calibration = held.get("calibration") or {}
    if calibration.get("contention") is None:
        return ""
    return (f" The predictions read this machine's calibration of {calibration['measured']} (load average "
            f"{calibration['load_average']} as it began, other processes {calibration['others_load']} of a core "
            f"while it ran): two ranks' contention {calibration['contention']:.2f}x.")


def report(held: dict) -> str:
    """The README's held-out section: how it was recorded (the machine's load), each group's
    figures with their intervals and what plan=auto does with them, and each configuration."""
    from litscale.planner.trust import SPEARMAN_BAR

    before, after = held["load_average"]["before"], held["load_average"]["after"]
    loads = [run["load_average"] for run in held["runs"].values()]
    lines = [
        f"Recorded {held['date']} with `python experiments/planner/study.py --held-out --seed {held['seed']} "
        f"--per-group {held['per_group']}` on {held['machine']}, at `nice -n {held['nice']}`, one run per "
        f"configuration; load average (1, 5, 15 min) {' / '.join(f'{v:.1f}' for v in before)} before and "
        f"{' / '.join(f'{v:.1f}' for v in after)} after, {min(loads):.2f}-{max(loads):.2f} as each run started"
        f"{_others_while_timed(held)}.{_calibration_line(held)}",
        "",
        "| group (2 ranks) | held-out shape | configurations | MAPE (95% interval) | Spearman (95% interval) | "
        "plan=auto |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    for group, g in held["groups"].items():
        (mape_low, mape_high), (low, high) = g["mape_interval"], g["spearman_interval"]
        verdict = "picks" if low >= SPEARMAN_BAR else f"**keeps the given layout** (lower end below {SPEARMAN_BAR})"
        lines.append(f"| {group}, global batch {g['global_batch']} | `{' '.join(g['shape'])}` | {g['configurations']} | "
                     f"{g['mape']:.1%} ({mape_low:.1%} to {mape_high:.1%}) | {g['spearman']:.3f} ({low:.3f} to "
                     f"{high:.3f}) | {verdict} |")
    lines += ["", "| configuration | predicted s/step | measured s/step | error |", "| --- | ---: | ---: | ---: |"]
    for name, run in held["runs"].items():
        lines.append(f"| `{name}` | {run['predicted_step_s']:.4f} | {run['measured_step_s']:.4f} | "
                     f"{run['predicted_step_s'] / run['measured_step_s'] - 1:+.1%} |")
    return "\n".join(lines) + "\n"
