"""``plan.calibrate_from``: the cluster file's fitted constants refit from the user's own runs.

Every run records its measured step (``perf/step_time_s`` in its ``summary.json``). Each run
named is rebuilt from its ``.hydra/config.yaml`` as the planner sees a run (its plan, its
model's facts, on this machine the profiles a plan timed) and predicted again on the cluster
being planned, while two constants move: ``achieved_fraction`` (the share of the peak that a
step predicted from FLOPs reaches) and ``overhead_per_microbatch_s`` (fixed time per
forward-backward: the framework's own work, which no FLOP count sees). They are fitted to the
measured steps by the least mean absolute percentage error, on a log grid refined once.

Judged on runs the fit did not see: k-fold over the runs, each fold predicted with constants
fitted on the others, against the cluster file's own constants (fitted on none of them). A fit
no better held out is said and not used.

NOTE: a grid and not a least-squares solver: the step is piecewise in the constants
(communication hides behind compute up to the overlap, then not), the error is a mean of
absolute values, and two constants on tens of runs cost well under a second per fit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections import Counter

from omegaconf import OmegaConf

from litscale.app.checks.validation import calibrate_from_paths
from litscale.app.plan.description import RunDescription, describe
from litscale.app.plan.runs import configured_plan, facts_of, profile_identity
from litscale.errors import ConfigError
from litscale.planner.cluster import Cluster
from litscale.planner.cost import Plan, predict
from litscale.planner.model_facts import ModelFacts

KEY = "plan.calibrate_from"
CONSTANTS = ("achieved_fraction", "overhead_per_microbatch_s")
MIN_RUNS = 3
REFINEMENTS = 3
FOLDS = 5


@dataclasses.dataclass(frozen=True)
class Sample:
    """One finished run as the planner predicts it, and the step it measured."""

    run_dir: str
    plan: Plan
    facts: ModelFacts
    measured_step_s: float


def refit(run: RunDescription, cluster: Cluster) -> tuple[Cluster, list[str]]:
    """``cluster`` with its constants refit from the runs under ``plan.calibrate_from`` and the
    overrides that keep them, where that lowers the error on held-out runs; else ``cluster``
    as it is and no overrides. Prints what it found, and writes it to ``<run dir>/plan/calibration.json``."""
    paths = calibrate_from_paths(run.plan["calibrate_from"])
    samples, skipped = gather(paths, run.choices.get("cluster", cluster.name), cluster,
                              allowed_targets=list(run.config.get("allowed_targets") or ()))
    shown = ", ".join(f"{count} x {reason}" for reason, count in skipped.most_common(3))
    if len(samples) < MIN_RUNS:
        raise ConfigError(f"{KEY}={_shown(paths)}: {len(samples)} run(s) with a measured step on "
                          f"cluster={cluster.name}{f' ({shown})' if shown else ''}; allowed: run dirs or "
                          f"sweep dirs holding at least {MIN_RUNS} such runs")
    _say(f"{len(samples)} run(s) on cluster={cluster.name} under {_shown(paths)}"
         + (f"; {sum(skipped.values())} skipped: {shown}" if skipped else ""))
    given = {name: getattr(cluster, name) for name in CONSTANTS}
    fitted = fit(samples, cluster)
    before = mape(samples, cluster, given)
    folds = min(FOLDS, len(samples))
    after = held_out_mape(samples, cluster, folds)
    _say("  ".join(f"{name} {given[name]:.4g} -> {fitted[name]:.4g}" for name in CONSTANTS))
    _write_record(run.output_dir, samples, cluster, given, fitted, before, after)
    if after >= before:
        _say(f"held-out MAPE {before:.1%} (the cluster file's) -> {after:.1%} ({folds}-fold over "
             f"{len(samples)} runs): no better, so the ranking keeps the cluster file's constants")
        return cluster, []
    kept = [f"cluster.{name}={fitted[name]:.4g}" for name in CONSTANTS]
    _say(f"held-out MAPE {before:.1%} (the cluster file's) -> {after:.1%} ({folds}-fold over {len(samples)} "
         f"runs); the ranking below uses them; to keep them: {' '.join(kept)}")
    return dataclasses.replace(cluster, **fitted), kept


def gather(paths: list[str], cluster_choice: str, cluster: Cluster, *,
           allowed_targets: list[str]) -> tuple[list[Sample], Counter]:
    """The runs under ``paths`` that ran on ``cluster_choice`` and measured a step, as
    ``Sample``s (oldest first), and why each other run was left out. Each is rebuilt trusting
    ``allowed_targets`` (this run's), never the list its own config holds."""
    from litscale.app.report import load_summaries

    samples, skipped, facts_cache = [], Counter(), {}
    for path in paths:
        for summary in load_summaries(path):
            found = _sample(summary, cluster_choice, cluster, facts_cache, allowed_targets)
            if isinstance(found, Sample):
                samples.append(found)
            else:
                skipped[found] += 1
    return samples, skipped


def _sample(summary: dict, cluster_choice: str, cluster: Cluster, facts_cache: dict,
            allowed_targets: list[str]) -> Sample | str:
    """``summary``'s run as a ``Sample``, or why it cannot be one."""
    from litscale.app import resolvers  # noqa: F401  (the config's own interpolations)
    from litscale.app.checks.validation import validate
    from litscale.planner import profile_cache

    run_dir, choices = summary["run_dir"], summary.get("choices") or {}
    measured = summary.get("perf/step_time_s")
    if not measured:
        return "no measured step time (too few steps)"
    if choices.get("cluster") != cluster_choice:
        return f"another cluster ({choices.get('cluster')})"
    config = os.path.join(run_dir, ".hydra", "config.yaml")
    if not os.path.exists(config):
        return "no .hydra/config.yaml"
    try:
        cfg = OmegaConf.load(config)
        cfg.paths.output_dir = run_dir  # Hydra's runtime interpolation, outside Hydra
        # NOTE: a run dir is anyone's files: what it may build is what this run trusts, not the
        # allowed_targets it wrote itself (validation imports and builds its _target_s).
        cfg.allowed_targets = allowed_targets
        cfg.ckpt_path = None  # its resume point changes no step time, and its files are not read
        run = describe(cfg, choices, validate(cfg, choices=choices, this_machine=False))
        plan = configured_plan(run)
        if plan is None:
            return f"strategy={choices.get('strategy')} not in the planner's model"
        identity = json.dumps([run.config["model"], run.seq_len, run.vocab_size, run.optimizer], default=str)
        if identity not in facts_cache:
            facts = facts_of(run)
            if cluster.is_this_machine:  # what the run's own prediction read
                facts = dataclasses.replace(facts, profiles=profile_cache.load(profile_identity(run, cluster)))
            facts_cache[identity] = facts
    except Exception as error:  # a run this checkout cannot rebuild: said, not fatal
        return f"not rebuilt ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return Sample(run_dir, plan, facts_cache[identity], float(measured))


def predicted_step_s(sample: Sample, cluster: Cluster, constants: dict) -> float:
    return predict(sample.plan, sample.facts, dataclasses.replace(cluster, **constants)).step_s


def mape(samples: list[Sample], cluster: Cluster, constants: dict) -> float:
    """Mean absolute percentage error of the step times ``constants`` predict for ``samples``."""
    return statistics.fmean(abs(predicted_step_s(s, cluster, constants) / s.measured_step_s - 1) for s in samples)


def fit(samples: list[Sample], cluster: Cluster) -> dict:
    """The constants of least ``mape`` on ``samples``: a log grid, then ``REFINEMENTS`` finer
    ones around the best so far; the cluster's own constants win a tie (a constant the runs do
    not move stays as given)."""
    given = {name: getattr(cluster, name) for name in CONSTANTS}
    longest = max(s.measured_step_s / max(s.plan.forward_backwards, 1) for s in samples)
    best = _best(samples, cluster, given, _geometric(0.001, 1.0, 19), [0.0, *_geometric(longest * 1e-4, longest, 12)])
    span = 1.4  # the coarse grid's step, either way
    for _ in range(REFINEMENTS):
        fraction, overhead = best["achieved_fraction"], best["overhead_per_microbatch_s"]
        fractions = [f for f in _geometric(fraction / span, fraction * span, 7) if f <= 1.0]
        overheads = ([0.0, *_geometric(longest * 1e-5, longest * 1e-4, 4)] if overhead == 0
                     else _geometric(overhead / span**2, overhead * span**2, 7))
        best = _best(samples, cluster, best, fractions, overheads)
        span = span ** (1 / 3)  # each round's step: a third of the last round's (in log)
    return best


def held_out_mape(samples: list[Sample], cluster: Cluster, folds: int) -> float:
    """``mape`` of each run predicted with constants ``fit`` on the other folds (run i in fold i mod k)."""
    errors = []
    for fold in range(folds):
        held = [s for i, s in enumerate(samples) if i % folds == fold]
        rest = [s for i, s in enumerate(samples) if i % folds != fold]
        constants = fit(rest, cluster)
        errors += [abs(predicted_step_s(s, cluster, constants) / s.measured_step_s - 1) for s in held]
    return statistics.fmean(errors)


def _best(samples: list[Sample], cluster: Cluster, incumbent: dict, fractions: list[float],
          overheads: list[float]) -> dict:
    best, best_error = incumbent, mape(samples, cluster, incumbent)
    for fraction in fractions:
        for overhead in overheads:
            candidate = {"achieved_fraction": fraction, "overhead_per_microbatch_s": overhead}
            error = mape(samples, cluster, candidate)
            if error < best_error - 1e-12:
                best, best_error = candidate, error
    return best


def _geometric(low: float, high: float, points: int) -> list[float]:
    return [low * (high / low) ** (i / (points - 1)) for i in range(points)]


def _write_record(output_dir: str, samples: list[Sample], cluster: Cluster, given: dict, fitted: dict,
                  before: float, after: float) -> None:
    """Each run's measured step and the steps predicted with the given and the fitted constants,
    in ``<output_dir>/plan/calibration.json``."""
    path = os.path.join(output_dir, "plan", "calibration.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    runs = [{"run_dir": s.run_dir, "plan": s.plan.describe(), "measured_step_s": s.measured_step_s,
             "predicted_given_s": predicted_step_s(s, cluster, given),
             "predicted_fitted_s": predicted_step_s(s, cluster, fitted)} for s in samples]
    record = {"cluster": cluster.name, "given": given, "fitted": fitted, "mape_given": before,
              "mape_held_out": after, "runs": runs}
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle, indent=1)
    os.replace(path + ".tmp", path)
    _say(f"each run's measured and predicted steps: {path}")


def _shown(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else f"[{','.join(paths)}]"


def _say(line: str) -> None:
    print(f"litscale: calibrate_from: {line}", flush=True)
