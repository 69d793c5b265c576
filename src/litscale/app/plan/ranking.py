"""``plan=show`` / ``plan=auto``: the planner's ranking for the composed run, printed instead
of training; ``auto`` also writes the fastest plan as an experiment config."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import NamedTuple

from omegaconf import DictConfig

from litscale.app.plan.description import RunDescription
from litscale.app.plan.runs import configured_plan, facts_of, profile_identity
from litscale.app.plan.verify import aligned
from litscale.errors import ConfigError
from litscale.parallel.layout import RunLayout
from litscale.planner.cluster import Cluster
from litscale.planner.cost import Plan, Prediction
from litscale.planner.model_facts import ModelFacts
from litscale.planner.search import plans, search, why_not
from litscale.planner.strategies import Refusals
from litscale.planner.trust import Trust, trust_for

GiB = 2**30
# The longest forward-backward (by FLOPs at the probed peak) worth timing before planning on
# this machine; longer ones are predicted from FLOPs.
PROFILE_LIMIT_S = 2.0
# The largest run whose ranks' first steps plan=show traces, one after the other, on this machine.
MAX_TRACED_RANKS = 16
MAX_TRACED_PARAMS_BYTES = 2 * GiB


def run_plan(run: RunDescription) -> dict:
    """Rank every plan for the run's model and global batch on its cluster; print the top
    ``plan.top`` and why the others cannot run, then the run as configured (at any world
    size: no process starts); return the winner's overrides. Raise ``ConfigError`` when the
    run as configured would not fit in the cluster's device memory."""
    cluster, facts, configured, ranked, pruned, cluster_overrides = _ranking(run)
    layout, settings = run.layout, run.plan
    _say(f"plan: {facts.num_params / 1e6:.2f}M params, {facts.layers} layers, seq {facts.seq_len}, global batch "
         f"{layout.global_batch} on {cluster.name} ({cluster.nodes} x {cluster.devices_per_node} devices, "
         f"{cluster.device_memory_bytes / GiB:.0f} GiB each; {cluster.source or 'figures as configured'})")
    print(table(ranked[: int(settings["top"])], cluster), flush=True)
    reasons = Counter(p.reason for p in pruned)
    if pruned:
        _say(f"{len(pruned)} plan(s) cannot run; the commonest reasons:")
    for reason, count in reasons.most_common(5):
        _say(f"  {count} x {reason}")
    if not ranked:
        _say("no plan fits: see the reasons above")
    too_big = _as_configured(run, cluster, facts, configured, fitting=bool(ranked))
    if ranked:
        _say(f"fastest: {ranked[0].plan.describe()} -> python train.py {' '.join(overrides(ranked[0].plan, cluster))}")
    if too_big and settings["mode"] == "show":  # a dry run: refused as the launch would be, after the plans that fit
        raise ConfigError(too_big)
    if not ranked:
        return {}
    plan_dir = os.path.join(run.output_dir, "plan")
    top = ranked[: int(settings["verify"])]
    best = (_verify(run, cluster, top, plan_dir) if top else None) or ranked[0]
    winner = overrides(best.plan, cluster)
    if settings["mode"] != "auto":
        return {"plan/winner": winner, "plan/predicted_step_s": best.step_s}
    trust = sweep_trust(run, verified=bool(top))
    if trust is not None:
        _say(trust.line(given_fits=not too_big))
    if trust is None or trust.picks or too_big:
        left = _experiment(run, winner + cluster_overrides, plan_dir, "planned", "plan=auto's pick")
    else:
        winner = []
        left = _experiment(run, cluster_overrides, plan_dir, "planned",
                           "the given layout (plan=auto did not pick)", keep_layout=True)
    _say(f"written: {os.path.join(plan_dir, 'experiment', 'planned.yaml')}; run it with python train.py "
         f"--config-dir {plan_dir} experiment=planned{''.join(' ' + o for o in left)}")
    return {"plan/winner": winner, "plan/predicted_step_s": best.step_s,
            **({} if trust is None else {"plan/picked": trust.picks or bool(too_big)})}


class Ranking(NamedTuple):
    """What the planner found for a run: the cluster (refit where ``plan.calibrate_from``
    asked), the model's facts, the run as configured as a plan, every plan that runs fastest
    first, the plans that cannot run, and the overrides that keep a refit's constants."""

    cluster: Cluster
    facts: ModelFacts
    configured: Plan | None
    ranked: list[Prediction]
    pruned: list
    cluster_overrides: list[str]


def _ranking(run: RunDescription) -> Ranking:
    """The planner's ``Ranking`` for the run's model and global batch on its cluster."""
    from litscale.app.build import build

    layout = run.layout
    cluster: Cluster = build(run.cluster, trusted=run.trusted)
    check_devices_per_node(layout, cluster, run.choices)
    if layout.world_size > cluster.world_size:  # a what-if: the configured world, of this cluster's devices
        cluster = dataclasses.replace(cluster, nodes=layout.num_nodes, devices_per_node=layout.processes_per_node)
    refit_overrides: list[str] = []
    if run.plan.get("calibrate_from") is not None:
        from litscale.app.plan.refit import refit

        cluster, refit_overrides = refit(run, cluster)
    dtypes = {"compute_dtype": run.compute_dtype, "param_dtype": run.param_dtype, "float8": run.float8}
    facts = facts_of(run)
    # Each layout asked once, for the timing and the ranking, with the run's own options (Muon,
    # the determinism mode, ...): a strategy that refuses them is never ranked.
    refusals = Refusals(facts.net, facts.seq_len, run_options=run.run_options, settings=run.settings)
    runnable = [p for p in plans(cluster, facts, layout.global_batch, **dtypes)
                if why_not(p, cluster, facts, layout.global_batch, refusals) is None]
    configured = configured_plan(run)
    facts = timed_here(run, cluster, facts, runnable + ([configured] if configured else []))
    ranked, pruned = search(cluster, facts, layout.global_batch, refusals=refusals, **dtypes)
    return Ranking(cluster, facts, configured, ranked, pruned, refit_overrides)


def pick_layout(cfg: DictConfig, choices: dict[str, str]) -> tuple[list[str], str]:
    """``hydra.sweeper.plan=auto``: the layout overrides a sweeper's trial is launched with
    ([]: its given layout) and the one line that says why. Picked before the trial starts, so
    that its launcher (Ray, SLURM, ...) gives it the devices the picked layout uses. The pick is
    taken where the trial's model group ranks its plans as measured (``litscale.planner.trust``)
    or where the given layout would not fit the device's memory (by the formula: no strategy is
    built here, as ``plan=show`` builds one, to keep each trial's planning to the cost model)."""
    from litscale.app.checks.validation import validate
    from litscale.app.plan.description import describe
    from litscale.planner.cost import predict

    run = describe(cfg, choices, validate(cfg, choices=choices, this_machine=False))
    cluster, facts, configured, ranked, _, _ = _ranking(run)
    if not ranked:
        return [], f"plan=auto: no plan fits on cluster={choices.get('cluster', cluster.name)}: this job keeps its given layout"
    fits = configured is None or predict(configured, facts, cluster).peak_bytes <= cluster.device_memory_bytes
    trust = configured_trust(run)
    picked = overrides(ranked[0].plan, cluster) if trust.picks or not fits else []
    return picked, trust.line(given_fits=fits)


def sweep_trust(run: RunDescription, *, verified: bool) -> Trust | None:
    """In a sweep's job whose pick is not measured (no ``plan.verify``), whether the planner may
    pick its layout (``litscale.planner.trust``: the model group's held-out Spearman); None
    elsewhere (a single ``plan=auto`` prints its ranking for the user to judge)."""
    if verified or run.job.sweep_dir is None:
        return None
    return configured_trust(run)


def configured_trust(run: RunDescription) -> Trust:
    """``trust_for`` the job's network (``model.net`` as composed) at its sequence length."""
    return trust_for(run.net, seq_len=run.seq_len)


def check_devices_per_node(layout: RunLayout, cluster: Cluster, choices: dict[str, str]) -> None:
    """A node of ``cluster`` has so many devices: more processes per node is a mistake (64
    devices of ``h100_8x`` are 8 nodes of 8), said in one line before anything is planned."""
    if layout.processes_per_node > cluster.devices_per_node and not cluster.is_this_machine:
        nodes = -(-layout.world_size // cluster.devices_per_node)
        raise ConfigError(
            f"trainer.devices={layout.processes_per_node}: a node of cluster={choices.get('cluster', cluster.name)} "
            f"has {cluster.devices_per_node} devices; for {layout.world_size} devices set "
            f"trainer.devices={cluster.devices_per_node} trainer.num_nodes={nodes}")


def _as_configured(run: RunDescription, cluster: Cluster, facts: ModelFacts, plan: Plan | None, *,
                   fitting: bool) -> str | None:
    """Print the run as configured: its layout, LR, the strategy built on a fake process group
    at the configured world, and the predicted memory per rank; return why it does not fit when
    that memory, with the parameters as built, exceeds the device's (None: it fits): ``plan=show``
    refuses it before any process starts, ``plan=auto`` writes a plan that fits instead."""
    from litscale.optim.lr_scaling import scaled_lr
    from litscale.planner.cost import predict

    layout = run.layout
    _say(f"as configured: {layout.describe()}")
    scaling = run.config.get("lr_scaling") or {}
    rule = scaling.get("rule", "none")
    if rule != "none":
        base_lr = float(run.optimizer["lr"])
        lr = scaled_lr(base_lr, global_batch=layout.global_batch,
                       base_batch_size=int(scaling["base_batch_size"]), rule=rule)
        _say(f"as configured: lr {base_lr:g} scaled by the {rule} rule to {lr:.4g} "
             f"(global batch {layout.global_batch}, base {scaling['base_batch_size']})")
    built, step_peak = _dry_run(run)
    _trace_collectives(run, built)
    if plan is None:
        _say(f"as configured: strategy={run.choices.get('strategy')} is not in the planner's model; no prediction")
        return None
    prediction = predict(plan, facts, cluster)
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in prediction.memory.items() if k != "total" and (v or k != "buffers"))
    _say(f"as configured: {plan.describe()}: {prediction.peak_bytes / GiB:.2f} GiB per rank predicted ({parts}), "
         f"{prediction.step_s:.4g} s per step on {cluster.name}")
    if step_peak is not None:
        measured = step_peak * (1 + cluster.allocator_overhead)
        _say(f"as configured: one rank's training step at world {layout.world_size}, traced with fake tensors: "
             f"{measured / GiB:.3g} GiB per rank at its peak{' with the allocator overhead' if cluster.allocator_overhead else ''}, "
             f"predicted {prediction.peak_bytes / GiB:.3g} GiB ({prediction.peak_bytes / measured - 1:+.1%})")
    peak = prediction.peak_bytes
    if built is not None:  # what the formula's even share leaves out (a pipeline's gathered stage it counts already)
        peak += max(0.0, built - prediction.memory["params"]) * (1 + cluster.allocator_overhead)
        if built > 1.05 * prediction.memory["params"]:
            _say(f"as configured: rank 0 holds {built / prediction.memory['params']:.2f}x the predicted parameters "
                 f"(shards of whole rows, parameters a split leaves whole): {peak / GiB:.2f} GiB per rank")
    if peak > cluster.device_memory_bytes:
        too_big = (f"the run as configured needs {peak / GiB:.1f} GiB per rank, more than "
                   f"cluster={cluster.name}'s {cluster.device_memory_bytes / GiB:.0f} GiB per device")
        if run.plan["mode"] == "show":
            return too_big + ("; the plans above fit" if fitting else "")
        _say(f"{too_big}; plan=auto writes the fastest plan that fits instead")
        return too_big
    return None


def _dry_run(run: RunDescription) -> tuple[float | None, int | None]:
    """Build the configured strategy at the configured world on a fake process group (no rank
    starts); say what rank 0 holds and return its parameters' bytes (None: not built) and, with
    ``plan.fake_step``, one step's peak bytes there (None: not run, and the line says why)."""
    from litscale.app.plan.dry_run import REPLICATED_MESH, built_on_fake_world

    built = built_on_fake_world(run.config, run.layout.world_size)
    if built["params_bytes"] is None:
        _say(f"as configured: not built ({built['skipped']})")
    elif built["mesh"] == REPLICATED_MESH:
        _say(f"as configured: every rank holds the whole model, {_size(built['params_bytes'])} of parameters")
    else:
        _say(f"as configured: built on a fake process group of {built['ranks']} ranks (mesh {built['mesh']}): rank 0 "
             f"holds {_size(built['params_bytes'])} of parameters")
    if run.plan.get("fake_step") and "step_peak_bytes" not in built:
        _say(f"as configured: no training step traced ({built.get('step_skipped') or built.get('skipped')})")
    params = None if built["params_bytes"] is None else float(built["params_bytes"])
    return params, built.get("step_peak_bytes")


def _trace_collectives(run: RunDescription, built: float | None) -> None:
    """Each rank's first step traced on a fake process group at the configured world; raises
    ``ConfigError`` (refused, as the launch would be) where the ranks' collectives differ.
    ``built``: the bytes of parameters rank 0 holds. NOTE: each rank's step runs here for real,
    one after the other, so a what-if at hundreds of ranks or of a model larger than this
    machine is not traced (``preflight.collectives=true`` traces any run that starts here)."""
    from litscale.app.checks.collectives import check_collectives, not_traced_reason

    strategy, layout = run.choices.get("strategy", ""), run.layout
    reason = not_traced_reason(strategy, run.as_config) if layout.world_size > 1 else None
    if reason is None and layout.world_size > MAX_TRACED_RANKS:
        reason = f"{layout.world_size} ranks: plan=show traces at most {MAX_TRACED_RANKS}, one after the other here"
    elif reason is None and (built or 0) > MAX_TRACED_PARAMS_BYTES:
        reason = (f"rank 0 holds {_size(built)} of parameters: plan=show traces at most "
                  f"{_size(MAX_TRACED_PARAMS_BYTES)} per rank here")
    _say(f"as configured: collectives not traced ({reason})" if reason else
         f"as configured: {check_collectives(run.as_config, strategy, layout)}")


def timed_here(run: RunDescription, cluster: Cluster, facts: ModelFacts, plans_: list[Plan]) -> ModelFacts:
    """On this machine, ``facts`` with the network timed as each of ``plans_`` runs it, at
    the micro batches that take under ``PROFILE_LIMIT_S``; elsewhere ``facts`` as they are.
    What an earlier plan timed for this model and cluster file is read back, not timed again;
    what is new is timed in a child process and cached, unless the machine was busy then
    (``flops.busy``: used for this plan only, and said)."""
    from litscale.app.plan.profile import profiles_in_child
    from litscale.measure import flops
    from litscale.planner import profile_cache
    from litscale.planner.compute_cost import profile_key

    peak = cluster.peak_flops["float32"]
    keys: dict[str, set[int]] = {}
    for plan in plans_:
        micro = plan.pipeline_micro_batch
        if facts.flops_per_token * micro * facts.seq_len / peak < PROFILE_LIMIT_S:
            keys.setdefault(profile_key(plan), set()).add(micro)
    if not cluster.is_this_machine or not keys:
        return facts
    identity = profile_identity(run, cluster)
    profiles = profile_cache.load(identity)
    todo = profile_cache.missing(profiles, keys)
    if todo:
        load, clock = flops.load_average(), flops.cpu_clock()  # before the child adds to them
        timed = profiles_in_child(identity["net"], keys=todo, seq_len=facts.seq_len, vocab_size=identity["vocab_size"],
                                  compression=identity["compression"], packed_documents=identity["packed_documents"])
        timed = {key: dataclasses.replace(profile, load_average=round(load, 2)) for key, profile in timed.items()}
        profiles = profile_cache.merged(profiles, timed)
        busy = flops.disturbed(load, flops.others_load(clock))
        if busy:
            _say(f"profiles {', '.join(sorted(todo))} timed at a {busy}: used for this plan, not cached")
        else:
            profile_cache.store(identity, profiles, retimed=set(todo))
    return dataclasses.replace(facts, profiles={key: profiles[key] for key in keys})


def _experiment(run: RunDescription, plan_overrides: list[str], plan_dir: str, name: str, what: str, *,
                keep_layout: bool = False) -> list[str]:
    """Write ``<plan_dir>/experiment/<name>.yaml``: the user's run with ``plan_overrides``
    (``keep_layout``: with its own strategy, devices and batch split); return the overrides a
    file cannot hold."""
    from litscale.app.experiment_file import carried_overrides, write_experiment

    carried = carried_overrides(run.job.overrides, keep_layout=keep_layout)
    return write_experiment([*carried, *plan_overrides], os.path.join(plan_dir, "experiment", f"{name}.yaml"),
                            groups=set(run.choices), comment=f"Written by litscale's planner: {what}.")


def _verify(run: RunDescription, cluster: Cluster, top: list[Prediction], plan_dir: str) -> Prediction | None:
    """Measure ``top`` here, each written as ``<plan_dir>/experiment/verify_<i>.yaml``; return the
    plan measured fastest (None when none could be measured), after saying where the predicted
    order was wrong."""
    from litscale.app.checks.devices import resolve_accelerator
    from litscale.app.plan.verify import check_verifiable, order_mistakes, table, verify

    reason = check_verifiable(cluster)
    if reason:
        _say(f"not verified: {reason}")
        return None
    names = [f"verify_{i}" for i in range(1, len(top) + 1)]
    for i, (prediction, name) in enumerate(zip(top, names, strict=True), 1):
        left = _experiment(run, overrides(prediction.plan, cluster), plan_dir, name,
                           f"plan #{i} ({prediction.plan.describe()})")
    records = verify(top, names, config_dir=plan_dir, extra=left, steps=int(run.plan["verify_steps"]),
                     accelerator=resolve_accelerator(str(run.config["trainer"].get("accelerator", "auto"))))
    _say(f"predicted vs measured (also in {os.path.join(plan_dir, 'verify.json')}):")
    print(table(records), flush=True)
    measured = [(r, p) for r, p in zip(records, top, strict=True) if r["measured_step_s"]]
    if not measured:
        return None
    for line in order_mistakes(records):
        _say(line)
    fastest, prediction = min(measured, key=lambda pair: pair[0]["measured_step_s"])
    _say(f"measured fastest: {fastest['plan']}" + (" (the predicted order held)" if not order_mistakes(records)
                                                  else ""))
    return prediction


def table(ranked: list[Prediction], cluster: Cluster) -> str:
    rows = [("#", "plan", "step s", "tokens/s", "MFU", "GiB/rank", "comm exposed s", "bound by")]
    for index, p in enumerate(ranked, 1):
        rows.append((str(index), p.plan.describe(), f"{p.step_s:.4g}", f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}",
                     f"{p.peak_bytes / GiB:.2f}", f"{p.exposed_comm_s:.3g}", p.binding(cluster)))
    return aligned(rows)


def overrides(plan: Plan, cluster: Cluster) -> list[str]:
    """The command-line overrides that run ``plan``: its strategy with the options it was
    planned with (each one, so the run does not depend on the option file's defaults)."""
    from litscale.parallel.layout import mesh_of
    from litscale.planner.strategies import built

    laid_out = mesh_of(built(plan.strategy, plan.strategy_options()), plan.mesh.world_size)
    if laid_out != plan.mesh:  # a command line that would run another layout than the one planned
        raise ValueError(f"{plan.describe()}: strategy={plan.strategy} with {plan.options} lays out {laid_out}")
    return [f"strategy={plan.strategy}",
            *(f"strategy.{key}={str(value).lower() if isinstance(value, bool) else value}"
              for key, value in plan.strategy_options().items()),
            f"trainer.devices={cluster.devices_per_node}", f"trainer.num_nodes={cluster.nodes}",
            f"data.batch_size={plan.micro_batch}", f"trainer.accumulate_grad_batches={plan.accumulation}"]


def _size(nbytes: float) -> str:
    """``6.4 MiB``: bytes in the largest binary unit that leaves at least 1."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:.0f} bytes"


def _say(line: str) -> None:
    print(f"litscale: {line}", flush=True)
