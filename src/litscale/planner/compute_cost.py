"""One rank's forward-backward time, before a pipeline's split and the node's contention
(``cost._time`` applies those): timed on this machine where a profile of the network as the plan
runs it exists, else FLOPs at the cluster's achieved throughput, with what FLOPs leave out where
the cluster states it: the routed experts' small grouped matmuls at their own measured share of
the peak (``moe_cost.grouped_fraction``), and precision=fp8's casts from the bytes they move
(``float8_cost``)."""

from __future__ import annotations

from litscale.planner.cluster import Cluster
from litscale.planner.float8_cost import float8_cast_s
from litscale.planner.model_facts import ModelFacts
from litscale.planner.moe_cost import (
    flops_per_token_per_rank,
    grouped_fraction,
    routed_flops_per_token_per_rank,
)
from litscale.planner.plan import Plan


def profile_key(plan: Plan) -> str:
    """How one rank of ``plan`` runs the network, as ``ModelFacts.profiles`` names it, from its
    mesh and what its strategy states of itself (``sharding``): under tensor parallel
    (``tp<n>``), inside a ZeRO optimizer that keeps fp32 partitions (DeepSpeed's engine, stage
    ``s``: ``zero<s>``, timed at one rank), with a compression hook (``ddp<n>-<compression>``:
    the codec's time and ratio), under FSDP2 sharded over its data x context ranks (``fsdp<n>``),
    or plain (a pipeline's stage too)."""
    mesh, sharding = plan.mesh, plan.sharding
    shards = mesh.fsdp
    if mesh.pipeline > 1:
        return "plain"
    if mesh.tensor > 1:
        return f"tp{mesh.tensor}"
    if sharding.fp32_master_copy and mesh.data_shard > 1:
        return f"zero{sharding.zero_stage}"
    if plan.compression != "none" and mesh.data > 1:
        return f"ddp{mesh.data}-{plan.compression}"
    if sharding.zero_stage == 3 and shards > 1:
        return f"fsdp{shards}"
    return "plain"


def compute_s(plan: Plan, facts: ModelFacts, cluster: Cluster) -> float:
    """Forward-backward time of one rank's micro-batches, before the pipeline's split: timed on
    this machine where the facts carry a profile of the network as the plan runs it (else of
    the plain network, divided by the tensor-parallel size), else FLOPs over the cluster's
    achieved throughput, plus the float8 casts. A published run's partial recompute
    (``Framework.recompute_flops_per_token``) adds its FLOPs' share of the step either way."""
    micro, count = plan.pipeline_micro_batch, plan.forward_backwards
    added = plan.published.recompute_flops_per_token
    recompute = 1 + added / facts.flops_per_token if facts.flops_per_token else 1.0
    timed = timed_forward_backward_s(plan, facts)
    if timed is not None:
        return count * timed * recompute
    tokens = count * micro * facts.seq_len / plan.mesh.context
    routed = routed_flops_per_token_per_rank(plan, facts) if cluster.grouped_matmul_fractions else 0.0
    dense = flops_per_token_per_rank(plan, facts) - routed
    seconds = tokens * dense * seconds_per_flop(plan, facts, cluster)
    if routed:
        peak = cluster.peak_flops.get(plan.compute_dtype, cluster.peak_flops["float32"])
        seconds += tokens * routed / (peak * grouped_fraction(plan, facts, cluster))
    return seconds * recompute + count * float8_cast_s(plan, facts, cluster)


def seconds_per_flop(plan: Plan, facts: ModelFacts, cluster: Cluster) -> float:
    """One FLOP of the plan's step (the routed experts' apart, where the cluster times their
    grouped matmuls on their own) at the cluster's achieved throughput: in its compute dtype,
    and under precision=fp8 the float8 layers' share of those FLOPs at the cluster's float8 peak
    where the cluster file states one (else that share runs in the compute dtype, as it would
    where torchao cannot run float8). A rank's split of the FLOPs is taken to hold that share
    as the whole model does; the same achieved fraction is taken for both."""
    per_flop = 1 / cluster.flops(plan.compute_dtype)
    if not plan.float8 or "float8" not in cluster.peak_flops or not facts.flops_per_token:
        return per_flop
    routed = 0.0
    if facts.moe is not None and cluster.grouped_matmul_fractions:
        routed = 6.0 * facts.moe.expert_params * facts.moe.top_k / facts.moe.n_experts
    share = facts.float8_flops_per_token / (facts.flops_per_token - routed)
    return (1 - share) * per_flop + share / cluster.flops("float8")


def timed_forward_backward_s(plan: Plan, facts: ModelFacts) -> float | None:
    """One micro-batch's forward-backward as timed here for ``plan`` (its own profile, else the
    plain network's over the tensor-parallel size); None where nothing was timed. Profiles run
    whole sequences: a context-parallel rank is costed at 1 / context of one (its load-balanced
    share of the attention too), its gathers as collectives."""
    micro = plan.pipeline_micro_batch
    timed = facts.profiles.get(profile_key(plan))
    if timed is not None and micro in timed.forward_backward_s:
        return timed.forward_backward_s[micro] / plan.mesh.context
    plain = facts.profiles.get("plain")
    if plain is not None and micro in plain.forward_backward_s:
        return plain.forward_backward_s[micro] / plan.mesh.sample_split
    return None
