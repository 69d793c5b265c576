"""Every plan for a model, a cluster and a global batch: enumerated, pruned with the reason a
plan cannot run, predicted and ranked by step time."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from litscale.layout import MeshSizes
from litscale.planner.cluster import Cluster
from litscale.planner.cost import Plan, Prediction, predict
from litscale.planner.model_facts import ModelFacts

# The strategies the planner chooses among (litscale's `strategy=` options).
STRATEGIES = ("ddp", "fsdp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "tensor_parallel",
              "pipeline")
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
    context parallel splits, each divisor of ``ranks`` whose ``2 x`` divides the sequence."""
    return [c for c in divisors(ranks) if c == 1 or (facts.kv_width and facts.seq_len % (2 * c) == 0)]


def expert_sizes(mesh: MeshSizes, facts: ModelFacts) -> list[MeshSizes]:
    """``mesh``, and for a mixture of experts the same mesh with each expert-parallel size the
    layout allows (a divisor of its data x context ranks; what else the strategy refuses is
    pruned with its own line, ``why_not``)."""
    if facts.moe is None:
        return [mesh]
    return [dataclasses.replace(mesh, expert=e) for e in divisors(mesh.data * mesh.context)]


def meshes(strategy: str, cluster: Cluster, facts: ModelFacts) -> list[MeshSizes]:
    """The meshes a strategy can take on the cluster's world (expert parallel in the strategies
    that have it: FSDP and tensor parallel)."""
    if strategy in ("fsdp", "tensor_parallel"):
        return [with_experts for mesh in _meshes(strategy, cluster, facts) for with_experts in expert_sizes(mesh, facts)]
    return _meshes(strategy, cluster, facts)


def _meshes(strategy: str, cluster: Cluster, facts: ModelFacts) -> list[MeshSizes]:
    world = cluster.world_size
    if strategy == "ddp":
        return [MeshSizes(data_replicate=world)]
    if strategy.startswith("deepspeed_zero"):
        return [MeshSizes(data_shard=world)]
    if strategy == "fsdp":
        hybrid = [MeshSizes(data_replicate=cluster.nodes, data_shard=cluster.devices_per_node)] \
            if cluster.nodes > 1 else []
        return [MeshSizes(data_shard=world // c, context=c) for c in context_sizes(world, facts)] + hybrid
    if strategy == "tensor_parallel":
        return [MeshSizes(data_shard=world // (t * c), tensor=t, context=c) for t in divisors(world) if t > 1
                for c in context_sizes(world // t, facts)]
    return [MeshSizes(pipeline=p, data_shard=world // (p * t), tensor=t)
            for p in divisors(world) if p > 1 for t in divisors(world // p)]


def plans(cluster: Cluster, facts: ModelFacts, global_batch: int, *, compute_dtype: str = "float32",
          param_dtype: str = "float32") -> list[Plan]:
    found = []
    for strategy in STRATEGIES:
        for mesh in meshes(strategy, cluster, facts):
            if global_batch % mesh.data:
                found.append(Plan(strategy, mesh, micro_batch=0, accumulation=0))  # pruned below
                continue
            per_rank = global_batch // mesh.data
            for micro in divisors(per_rank):
                for checkpointing in ((False, True) if strategy == "fsdp" else (False,)):
                    for microbatches in (PIPELINE_MICROBATCHES if mesh.pipeline > 1 else (1,)):
                        for schedule, virtual in (PIPELINE_SCHEDULES if mesh.pipeline > 1 else (("1f1b", 1),)):
                            found.append(Plan(strategy, mesh, micro, per_rank // micro, checkpointing,
                                              compute_dtype, param_dtype, microbatches, schedule, virtual))
    return found


def why_not(plan: Plan, cluster: Cluster, facts: ModelFacts, global_batch: int) -> str | None:
    """Why ``plan`` cannot run (None if it can, memory aside)."""
    mesh = plan.mesh
    if plan.micro_batch == 0:
        return f"global batch {global_batch} does not split over {mesh.data} data-parallel ranks"
    if facts.moe is not None and plan.strategy == "deepspeed_zero3":
        from litscale.strategies.deepspeed_zero import ZERO3_MIXTURE_OF_EXPERTS

        return ZERO3_MIXTURE_OF_EXPERTS
    if mesh.tensor > cluster.devices_per_node:
        return f"tensor parallel {mesh.tensor} would cross nodes ({cluster.devices_per_node} devices per node)"
    if mesh.tensor > 1 and facts.heads % mesh.tensor:
        return f"{facts.heads} attention heads do not split over tensor parallel {mesh.tensor}"
    if mesh.expert > 1:  # the strategies' own rule
        from litscale.strategies.expert_parallel import check_expert_parallel_sizes

        try:
            check_expert_parallel_sizes(mesh.expert, facts.moe.n_experts if facts.moe else None, mesh.context)
        except ValueError as error:
            return str(error)
    stages = mesh.pipeline * plan.virtual_stages
    if mesh.pipeline > 1:  # the pipeline strategy's own rule (an uneven split runs, costed by its busiest rank)
        from litscale.strategies.stages import check_enough_blocks

        try:
            check_enough_blocks(facts.pipeline_blocks or facts.layers, stages, pipeline_parallel_size=mesh.pipeline)
        except ValueError as error:
            return str(error)
    if mesh.pipeline > 1 and plan.microbatches < mesh.pipeline:
        return f"{plan.schedule} needs at least {mesh.pipeline} pipeline micro-batches, not {plan.microbatches}"
    if plan.micro_batch % plan.microbatches:
        return f"micro batch {plan.micro_batch} does not split into {plan.microbatches} pipeline micro-batches"
    return None


def search(cluster: Cluster, facts: ModelFacts, global_batch: int, **dtypes: str) -> tuple[list[Prediction], list[Pruned]]:
    """Predictions of every plan that can run, fastest first, and the pruned plans with why."""
    ranked, pruned = [], []
    for plan in plans(cluster, facts, global_batch, **dtypes):
        reason = why_not(plan, cluster, facts, global_batch)
        if reason is None:
            prediction = predict(plan, facts, cluster)
            if prediction.peak_bytes > cluster.device_memory_bytes:
                reason = (f"needs {prediction.peak_bytes / 2**30:.1f} GiB per rank, more than the device's "
                          f"{cluster.device_memory_bytes / 2**30:.0f} GiB")
            else:
                ranked.append(prediction)
        if reason is not None:
            pruned.append(Pruned(plan, reason))
    ranked.sort(key=_rank)
    return ranked, pruned


def _rank(prediction: Prediction) -> tuple:
    """Fastest first, by the step time as ``plan=show`` prints it (4 significant digits, so the
    printed column is in order); among plans that print the same, the simpler strategy (the
    order of ``STRATEGIES``), then the larger micro batch, then the less memory."""
    plan = prediction.plan
    return (float(f"{prediction.step_s:.4g}"), STRATEGIES.index(plan.strategy), -plan.micro_batch,
            prediction.peak_bytes)
