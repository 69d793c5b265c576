"""Every plan for a model, a cluster and a global batch: enumerated, pruned with the reason a
plan cannot run, predicted and ranked by step time.

The layouts are the strategies' own (``candidate_meshes`` of each plannable strategy,
``planner/strategies.py``); a dimension the model has (experts) or a knob a strategy takes
(activation checkpointing, a pipeline's micro-batches and schedule) multiplies them. Each plan
is then checked by its strategy, as a run would be, and pruned with the strategy's own line;
the planner's own reasons are only what no strategy can know: the global batch, the cluster's
nodes and the device's memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from litscale.parallel.layout import MeshSizes
from litscale.planner.cluster import Cluster
from litscale.planner.cost import Plan, Prediction, predict
from litscale.planner.model_facts import ModelFacts
from litscale.planner.strategies import Refusals, plannable, registered, takes

PIPELINE_MICROBATCHES = (1, 2, 4, 8)
# (schedule, stages per rank): 1F1B, and interleaved 1F1B whose bubble is half as long.
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2))


@dataclass(frozen=True)
class Pruned:
    plan: Plan
    reason: str


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_sizes(ranks: int, facts: ModelFacts) -> list[int]:
    """How many ranks may split each sequence: 1, and where the model declares attention that
    context parallel splits, each divisor of ``ranks`` (the strategies refuse the sizes the
    sequence does not split into)."""
    return [c for c in divisors(ranks) if c == 1 or facts.kv_width]


def candidates(cluster: Cluster, facts: ModelFacts) -> Iterator[tuple[str, dict[str, Any], MeshSizes]]:
    """(strategy, its options, mesh) of every layout the plannable strategies offer on the
    cluster's world; for a mixture of experts, with each expert-parallel size the mesh allows in
    the strategies that take one (a divisor of its data x context ranks)."""
    world = cluster.world_size
    for name, cls in plannable().items():
        for options, mesh in cls.candidate_meshes(world_size=world, nodes=cluster.nodes,
                                                  devices_per_node=cluster.devices_per_node,
                                                  context_sizes=context_sizes(world, facts)):
            if facts.moe is None or not takes(cls, "expert_parallel_size"):
                yield name, options, mesh
                continue
            for experts in divisors(mesh.expert_borrowed):
                yield name, {**options, "expert_parallel_size": experts}, dataclasses.replace(mesh, expert=experts)


def knobs(cls: type) -> Iterator[dict[str, Any]]:
    """The plan's fields a strategy's constructor takes, each value the planner tries."""
    checkpointing = (False, True) if takes(cls, "activation_checkpointing") else (False,)
    pipelined = itertools.product(PIPELINE_MICROBATCHES, PIPELINE_SCHEDULES) if takes(cls, "microbatches") \
        else [(1, ("1f1b", 1))]
    for flag, (microbatches, (schedule, virtual)) in itertools.product(checkpointing, pipelined):
        yield {"activation_checkpointing": flag, "microbatches": microbatches, "schedule": schedule,
               "virtual_stages": virtual}


def plans(cluster: Cluster, facts: ModelFacts, global_batch: int, *, compute_dtype: str = "float32",
          param_dtype: str = "float32", float8: bool = False) -> list[Plan]:
    found = []
    for name, options, mesh in candidates(cluster, facts):
        if global_batch % mesh.data:
            found.append(Plan(name, mesh, micro_batch=0, accumulation=0, options=options))  # pruned below
            continue
        per_rank = global_batch // mesh.data
        for micro, knob in itertools.product(divisors(per_rank), list(knobs(registered()[name]))):
            found.append(Plan(name, mesh, micro, per_rank // micro, compute_dtype=compute_dtype,
                              param_dtype=param_dtype, float8=float8, options=options, **knob))
    return found


def why_not(plan: Plan, cluster: Cluster, facts: ModelFacts, global_batch: int,
            refusals: Refusals | None = None) -> str | None:
    """Why ``plan`` cannot run (None if it can, memory aside): the strategy's own line where it
    refuses it (``refusals``: shared by the plans of one search, so each layout is asked once)."""
    mesh = plan.mesh
    if plan.micro_batch == 0:
        return f"global batch {global_batch} does not split over {mesh.data} data-parallel ranks"
    if mesh.tensor > cluster.devices_per_node:  # the strategy runs it; the planner does not plan it
        return f"tensor parallel {mesh.tensor} would cross nodes ({cluster.devices_per_node} devices per node)"
    refusals = refusals or Refusals(facts.net, facts.seq_len)
    return refusals(plan.strategy, plan.strategy_options(), mesh=mesh, micro_batch=plan.micro_batch,
                    compute_dtype=plan.compute_dtype, compression=plan.compression)


def search(cluster: Cluster, facts: ModelFacts, global_batch: int, *, refusals: Refusals | None = None,
           **precision) -> tuple[list[Prediction], list[Pruned]]:
    """Predictions of every plan that can run, fastest first, and the pruned plans with why."""
    ranked, pruned, layouts = [], [], {}
    refusals = refusals or Refusals(facts.net, facts.seq_len)
    for plan in plans(cluster, facts, global_batch, **precision):
        layouts.setdefault(_layout(plan), len(layouts))
        reason = why_not(plan, cluster, facts, global_batch, refusals)
        if reason is None:
            prediction = predict(plan, facts, cluster)
            if prediction.peak_bytes > cluster.device_memory_bytes:
                reason = (f"needs {prediction.peak_bytes / 2**30:.1f} GiB per rank, more than the device's "
                          f"{cluster.device_memory_bytes / 2**30:.0f} GiB")
            else:
                ranked.append(prediction)
        if reason is not None:
            pruned.append(Pruned(plan, reason))
    order = {name: index for index, name in enumerate(registered())}
    ranked.sort(key=lambda p: _rank(p, order, layouts))
    return ranked, pruned


def _layout(plan: Plan) -> tuple:
    return plan.strategy, tuple(plan.options.items())


def _rank(prediction: Prediction, order: dict[str, int], layouts: dict[tuple, int]) -> tuple:
    """Fastest first, by the step time as ``plan=show`` prints it (4 significant digits, so the
    printed column is in order); among plans that print the same, the simpler strategy (the
    order they are registered in), then the larger micro batch, then the layout its strategy
    offers first (ZeRO-1 before ZeRO-3), then the less memory."""
    plan = prediction.plan
    return (float(f"{prediction.step_s:.4g}"), order[plan.strategy], -plan.micro_batch, layouts[_layout(plan)],
            prediction.peak_bytes)
