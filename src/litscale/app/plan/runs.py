"""The planner's view of one run as configured: its plan, its model's facts, and the
prediction ``train()`` makes before launch (``litscale.app.prediction``) for the summary to
hold beside what the run measured."""

from __future__ import annotations

import dataclasses

from litscale.app.plan.description import RunDescription
from litscale.app.prediction import RunPrediction
from litscale.errors import ConfigError
from litscale.planner.cluster import Cluster
from litscale.planner.cost import Plan
from litscale.planner.model_facts import ModelFacts, model_facts
from litscale.user_paths import user_path


def configured_plan(run: RunDescription) -> Plan | None:
    """The run as configured, as the planner's ``Plan``; None where its strategy is not one the
    planner costs (not a registered litscale strategy, or not ``plannable``)."""
    from litscale.parallel.contract import contract_value
    from litscale.planner.strategies import registered, takes
    from litscale.strategies.pipeline import default_virtual_stages

    name = run.choices.get("strategy", "")
    cls = registered().get(name)
    if cls is None or not contract_value(cls, "plannable"):
        return None
    strategy, layout = run.strategy, run.layout
    microbatches, schedule = int(strategy.get("microbatches", 1)), str(strategy.get("schedule", "1f1b"))
    return Plan(name, layout.mesh, layout.micro_batch, layout.accumulation,
                bool(strategy.get("activation_checkpointing", False)), run.compute_dtype, run.param_dtype,
                microbatches, schedule, int(strategy.get("virtual_stages") or default_virtual_stages(schedule)),
                run.choices.get("compression", "none") if takes(cls, "compression") else "none",
                run.float8, options=configured_options(run, cls))


def configured_options(run: RunDescription, cls: type) -> dict:
    """The configured strategy's options as the planner's plans state them: the keys its
    ``candidate_meshes`` sets (so the run reads as the ranked plans do) and every other plain
    value that differs from its constructor's default (what may change how a rank holds its share)."""
    import inspect

    layout = run.layout
    stated = {key for options, _ in cls.candidate_meshes(world_size=layout.world_size, nodes=layout.num_nodes,
                                                           devices_per_node=layout.processes_per_node,
                                                           context_sizes=[1]) for key in options}
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    return {key: value for key, value in run.strategy.items() if key in defaults
            and isinstance(value, (bool, int, float, str)) and (key in stated or value != defaults[key])}


def predict_run(run: RunDescription) -> RunPrediction:
    """The planner's prediction for the run as configured, made once in ``train()`` before
    launch and carried to rank 0's summary (no figures where ``plan.predict_run`` is off, the
    strategy is not modelled, or the cluster is this machine and has no calibration of it).
    Nothing is timed here: the forward-backward is the one ``plan=show|auto`` timed for this
    model and cluster file where it did (``plan/compute_source``: ``timed``), else FLOPs at the
    cluster's throughput. A model and layout whose prediction a run on this machine
    contradicted get none (``plan/withheld``) until ``plan=show|auto`` times them again."""
    from litscale.app.build import build
    from litscale.planner import profile_cache
    from litscale.planner.calibrate import calibrated_figures
    from litscale.planner.compute_cost import profile_key, timed_forward_backward_s
    from litscale.planner.cost import predict

    plan = configured_plan(run)
    cluster_node = run.cluster
    if not run.plan.get("predict_run", True) or plan is None or cluster_node is None or "_target_" not in cluster_node or (
            cluster_node["_target_"].endswith(".local_cpu") and calibrated_figures() is None):
        return RunPrediction()
    cluster = build(cluster_node, trusted=run.trusted)
    facts = facts_of(run)
    identity = profile_identity(run, cluster) if cluster.is_this_machine else None
    if identity is not None:
        earlier = profile_cache.contradiction(identity, plan.describe())
        if earlier is not None:
            return RunPrediction(figures={"plan/cluster": cluster.name, "plan/withheld": earlier})
        facts = dataclasses.replace(facts, profiles=profile_cache.load(identity))
    prediction = predict(plan, facts, cluster)
    figures = {"plan/cluster": cluster.name, "plan/predicted_step_s": prediction.step_s,
               "plan/compute_source": "flops" if timed_forward_backward_s(plan, facts) is None else "timed",
               "plan/predicted_peak_bytes": prediction.peak_bytes,
               "plan/predicted_states_bytes": sum(prediction.memory[k] for k in ("params", "grads", "optimizer"))}
    cached_as = None if identity is None else {"identity": identity, "layout": plan.describe(),
                                               "profile_key": profile_key(plan)}
    return RunPrediction(figures=figures, contradiction_factor=profile_cache.CONTRADICTION_FACTOR, cached_as=cached_as)


def record_contradiction(prediction: RunPrediction, summary: dict) -> None:
    """Once the ranks are done (``train()``): where rank 0's ``summary`` says the run contradicted
    a prediction made on this machine (``plan/dropped``), that model and layout get no
    prediction until ``plan=show|auto`` times them again (``profile_cache.contradict``)."""
    from litscale.planner import profile_cache

    if not summary.get("plan/dropped") or prediction.cached_as is None:
        return
    key = prediction.cached_as
    profile_cache.contradict(key["identity"], key["layout"], {
        "predicted_step_s": summary["plan/predicted_step_s"], "measured_step_s": summary["perf/step_time_s"],
        "profile_key": key["profile_key"], "compute_source": summary["plan/compute_source"],
        "run": summary["output_dir"]})


def with_muon(facts: ModelFacts, *, ns_steps: int = 5, ns_dtype: str = "float32") -> ModelFacts:
    """``facts`` of a run that Muon steps: its state, its hidden matrices (their parameters and
    tensors) and the Newton-Schulz iterations' FLOPs over them."""
    from litscale.optim.muon import (
        MATRIX,
        newton_schulz_flops,
        parameter_roles,
        state_bytes_per_param,
    )

    groups = parameter_roles(facts.net, 0.0)
    matrices = [p for group in groups if group["role"] == MATRIX for p in group["params"]]
    return dataclasses.replace(
        facts, optimizer_state_bytes_per_param=state_bytes_per_param(groups),
        matrix_params=sum(p.numel() for p in matrices), matrix_tensors=len(matrices),
        newton_schulz_flops=newton_schulz_flops((p.shape for p in matrices), ns_steps), newton_schulz_dtype=ns_dtype)


def facts_of(run: RunDescription) -> ModelFacts:
    """The composed model's facts, read off a meta-device copy (traced once per model and code:
    ``planner.facts_cache``); a mixture of experts' load
    imbalance as ``plan.moe_load_imbalance`` states it, or measured from the tokens per expert
    of the run whose ``summary.json`` ``plan.moe_load_from`` names."""
    from litscale.app.checks.safety import locate_target
    from litscale.app.checks.validation import meta_net
    from litscale.optim.muon import wants_parameter_roles
    from litscale.planner import facts_cache

    shape = {"seq_len": run.seq_len, "vocab_size": run.vocab_size, "compute_dtype": run.compute_dtype,
             "param_dtype": run.param_dtype, "packed_documents": run.packed_documents}
    key = facts_cache.identity(run.net, **shape)
    net = meta_net(run.as_config)
    facts = facts_cache.load(key, net)
    if facts is None:
        facts = model_facts(net, **shape)
        facts_cache.store(key, facts)
    facts = facts.with_attended_length(data_attended_length(run))
    optimizer = run.optimizer
    if wants_parameter_roles(locate_target(optimizer["_target_"], "optimizer")):
        facts = with_muon(facts, ns_steps=int(optimizer.get("ns_steps", 5)),
                          ns_dtype=str(optimizer.get("ns_dtype", "float32")))
    plan = run.plan
    if facts.moe is None:
        return facts
    moe = dataclasses.replace(facts.moe, load_imbalance=float(plan.get("moe_load_imbalance", 1.0)))
    if plan.get("moe_load_from"):
        moe = dataclasses.replace(moe, tokens_per_expert=measured_tokens_per_expert(str(plan["moe_load_from"]), moe))
    return dataclasses.replace(facts, moe=moe)


def data_attended_length(run: RunDescription) -> float | None:
    """Where the rows pack documents: the keys a token attends to on average, as the data module
    states it once its rows are set up (``attended_length``), so the planner counts the masked
    attention's FLOPs as the run's MFU does; None for rows of one document, or where the data
    cannot be set up here (a prediction never fails a run: the whole row's attention is then
    counted, as before)."""
    if not run.packed_documents:
        return None
    from litscale.app.build import build

    try:
        datamodule = build(run.data, trusted=run.trusted)
        datamodule.prepare_data()  # found, not made, where validation prepared it before launch
        datamodule.setup("fit")
    except (OSError, ValueError):
        return None
    return datamodule.attended_length


def measured_tokens_per_expert(path: str, moe) -> tuple[tuple[float, ...], ...]:
    """A run's ``moe/tokens_per_expert`` (per MoE layer) from its ``summary.json``, checked
    against the model planned; ``ConfigError`` in one line where it cannot be read or does not fit."""
    import json

    key = "plan.moe_load_from"
    try:
        with open(user_path(path)) as file:
            rows = json.load(file).get("moe/tokens_per_expert")
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}={path} cannot be read ({error}); allowed: a run's summary.json") from error
    if not rows or any(len(row) != moe.n_experts for row in rows):
        raise ConfigError(f"{key}={path} has no moe/tokens_per_expert of {moe.n_experts} experts per layer; "
                          f"allowed: the summary.json of a run of this mixture of experts")
    return tuple(tuple(float(count) for count in row) for row in rows)


def profile_identity(run: RunDescription, cluster: Cluster) -> dict:
    """What a profile of the run's network on ``cluster`` depends on: the cache's key."""
    from litscale.planner.profile_cache import code_identity

    compression = run.config.get("compression") or {}
    return {"net": run.net, "seq_len": run.seq_len, "vocab_size": run.vocab_size,
            "packed_documents": run.packed_documents, "cluster": cluster.source, **code_identity(),
            "compression": compression if "_target_" in compression else None}
