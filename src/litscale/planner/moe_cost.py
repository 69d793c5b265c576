"""What a mixture of experts adds to a plan's cost (``cost.py`` calls these; a dense model's
facts have no ``moe`` and change nothing):

- **Parameters a rank's data group shards**: tensor parallel leaves the MoE layers whole
  (``models/moe_parallel.py``), so they are split by the pipeline only; under expert parallel
  the routed experts are split over the EP ranks and FSDP2-sharded over the expert-data ranks
  (data x context / EP), apart from the rest (``strategies/expert_parallel.py``).
- **FLOPs**: the MoE layers' (active experts only) are not divided by tensor parallel, each
  rank running them on the sequence it gathered; under EP the busiest rank computes its
  experts' share of the rows times the load imbalance.
- **All-to-all**: per MoE layer and forward-backward, the rows (a token's hidden state once per
  chosen expert) go to their experts' ranks and back in forward (dispatch, combine) and their
  gradients the other way in backward: 4 exchanges (6 with activation checkpointing, which
  runs the forward again), each rank sending ``tokens x top_k x hidden x dtype bytes x
  (ep - 1) / ep`` (an even routing keeps ``1 / ep`` of its rows) times the load imbalance; and
  once per layer and forward the rows per expert (int64), which the exchange is sized by.
  Timed with the link the EP group crosses, one latency per peer.
"""

from __future__ import annotations

from collections.abc import Callable

from litscale.parallel.layout import MeshAxis
from litscale.planner.cluster import Cluster
from litscale.planner.model_facts import ModelFacts

COUNT_BYTES = 8  # the rows per expert, int64

# ``cost.collectives``' ring helper: (name, bytes of the buffer, calls, group, link, factor).
Ring = Callable[[str, float, int, int, object, int], None]


def data_sharded_params(plan, facts: ModelFacts) -> tuple[float, float]:
    """(parameters FSDP shards over a rank's data x context ranks, per tensor x pipeline rank;
    routed experts FSDP shards over its expert-data ranks, per expert-parallel rank)."""
    mesh, moe = plan.mesh, facts.moe
    if moe is None:
        return facts.num_params / mesh.model_split, 0.0
    experts = moe.expert_params if mesh.expert > 1 else 0
    dense = (facts.num_params - moe.layer_params) / mesh.model_split
    return dense + (moe.layer_params - experts) / mesh.pipeline, experts / mesh.expert_split


def flops_per_token_per_rank(plan, facts: ModelFacts) -> float:
    """Training FLOPs one rank spends per token of its sequence share (before the pipeline's
    split): the dense part divided by tensor parallel, the MoE layers whole, the routed experts
    times the imbalance under EP."""
    mesh, moe = plan.mesh, facts.moe
    if moe is None:
        return facts.flops_per_token / mesh.tensor
    routed = 6.0 * moe.expert_params * moe.top_k / moe.n_experts
    busiest = routed * (moe.imbalance(mesh.expert) - 1) if mesh.expert > 1 else 0.0
    return (facts.flops_per_token - moe.layer_flops_per_token) / mesh.tensor + moe.layer_flops_per_token + busiest


def expert_fsdp_collectives(plan, facts: ModelFacts, cluster: Cluster, ring: Ring, dtype_bytes: int) -> None:
    """FSDP2 over the expert-data ranks, each MoE layer's experts a unit of their own: gathered
    in forward and again in backward, their gradients (fp32) reduce-scattered once."""
    mesh, moe = plan.mesh, facts.moe
    _, experts = data_sharded_params(plan, facts)
    if not experts:
        return
    group, acc = mesh.expert_data, plan.accumulation
    link = cluster.link_for(group, mesh.stride(MeshAxis.EXPERT_DATA))
    ring("expert parameter all-gather", acc * 2 * experts * dtype_bytes, acc * 2 * moe.layers, group, link, 1)
    ring("expert gradient reduce-scatter", acc * experts * 4, acc * moe.layers, group, link, 1)


def all_to_all(plan, facts: ModelFacts, cluster: Cluster, dtype_bytes: int):
    """The expert-parallel exchanges of one optimizer step: (name, bytes each rank sends, calls,
    seconds) of the rows and of the counts; none without EP."""
    mesh, moe = plan.mesh, facts.moe
    if moe is None or mesh.expert == 1:
        return []
    ep, runs, micro = mesh.expert, plan.forward_backwards, plan.pipeline_micro_batch
    forwards = 1 + plan.activation_checkpointing
    tokens = micro * facts.seq_len / mesh.context  # tensor-parallel ranks run their MoE layers whole
    rows = runs * moe.layers * (2 * forwards + 2) * tokens * moe.top_k * facts.hidden * dtype_bytes
    link, peers = cluster.link_for(ep, mesh.tensor), (ep - 1) / ep
    found = []
    for name, nbytes, calls in (
            ("expert-parallel all-to-all", rows * peers * moe.imbalance(ep), runs * moe.layers * (2 * forwards + 2)),
            ("expert-parallel count exchange", runs * moe.layers * forwards * moe.n_experts * COUNT_BYTES * peers,
             runs * moe.layers * forwards)):
        found.append((name, nbytes, calls, link.seconds(nbytes, messages=calls * (ep - 1), kind="all-to-all")))
    return found
