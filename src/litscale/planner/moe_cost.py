"""What a mixture of experts adds to a plan's cost (``cost.py`` calls these; a dense model's
facts have no ``moe`` and change nothing):

- **Parameters a rank's data group shards**: tensor parallel leaves the MoE layers whole
  (``models/moe_parallel.py``), so they are split by the pipeline only; under expert parallel
  the routed experts are split over the EP ranks and FSDP2-sharded over the expert-data ranks
  (data x context / EP), apart from the rest (``strategies/expert_parallel.py``).
- **FLOPs**: the MoE layers' (active experts only) are not divided by tensor parallel, each
  rank running them on the sequence it gathered; under EP the busiest rank computes its
  experts' share of the rows times the load imbalance. Where the cluster states how fast the
  grouped matmuls run by their size (``grouped_fraction``), the routed experts' FLOPs run at that
  share of the peak: an expert's matmul is small (Qwen3-30B-A3B: 768 wide, about 2,000 rows a
  call), and a benchmark of the kernel on an H100 reaches a quarter of the bf16 peak there.
- **All-to-all**: per MoE layer and forward-backward, the rows (a token's hidden state once per
  chosen expert) go to their experts' ranks and back in forward (dispatch, combine) and their
  gradients the other way in backward: 4 exchanges (6 with activation checkpointing, which
  runs the forward again), each rank sending ``tokens x top_k x hidden x dtype bytes x
  (ep - 1) / ep`` (an even routing keeps ``1 / ep`` of its rows) times the load imbalance; and
  once per layer and forward the rows per expert (int64), which the exchange is sized by.
  Timed with the link the EP group crosses, one latency per peer; an EP group over several
  nodes sends its rows for this node's peers over NVLink while the rest cross nodes, the slower
  of the two timing the exchange (a published dispatch that crosses once per node: DeepEP's,
  HybridEP's, ``Framework.dispatch_once_per_node``).
"""

from __future__ import annotations

import math
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


def routed_flops_per_token_per_rank(plan, facts: ModelFacts) -> float:
    """Of ``flops_per_token_per_rank``, the routed experts' (their grouped matmuls): 0 for a
    dense model."""
    mesh, moe = plan.mesh, facts.moe
    if moe is None:
        return 0.0
    routed = 6.0 * moe.expert_params * moe.top_k / moe.n_experts
    return routed * (moe.imbalance(mesh.expert) if mesh.expert > 1 else 1.0)


def expert_call_flops(plan, facts: ModelFacts) -> float:
    """Forward FLOPs of one expert's matmuls in one call of its grouped matmul: the rows it
    gets (a rank's tokens of one forward, ``top_k`` times, over the experts; under expert
    parallel from each of its EP peers) times twice its weights."""
    mesh, moe = plan.mesh, facts.moe
    rows = plan.pipeline_micro_batch * facts.seq_len / mesh.context * moe.top_k * mesh.expert / moe.n_experts
    return 2 * rows * moe.expert_params / (moe.layers * moe.n_experts)


def grouped_fraction(plan, facts: ModelFacts, cluster: Cluster) -> float:
    """The share of the compute dtype's peak the routed experts' grouped matmuls reach, read off
    the cluster's measured points (``grouped_matmul_fractions``) by the size of one expert's
    call: log-linear between the points; below them the smallest point's; above them the last
    two points' trend, up to the dense matmuls' ``achieved_fraction`` (an expert's matmul with
    enough rows is an ordinary one)."""
    points = sorted(cluster.grouped_matmul_fractions)
    size = expert_call_flops(plan, facts)
    if size <= points[0][0]:
        return points[0][1]
    for (low, low_share), (high, high_share) in zip(points, points[1:], strict=False):
        if size <= high:
            return low_share + (high_share - low_share) * math.log(size / low) / math.log(high / low)
    if len(points) == 1:
        return points[0][1]
    (low, low_share), (high, high_share) = points[-2:]
    trend = high_share + (high_share - low_share) * math.log(size / high) / math.log(high / low)
    return max(high_share, min(trend, cluster.achieved_fraction))


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
    exchanges = runs * moe.layers * (2 * forwards + 2)
    rows = exchanges * tokens * moe.top_k * facts.hidden * dtype_bytes * moe.imbalance(ep)
    link, peers = cluster.link_for(ep, mesh.tensor), (ep - 1) / ep
    local = min(ep, max(1, cluster.devices_per_node // mesh.tensor))  # EP peers on one node, this rank too
    if local < ep:  # rows bound for this node's peers go over NVLink while the others cross nodes
        crossing = rows * (ep - local) / ep
        if plan.published.dispatch_once_per_node:
            crossing = rows / moe.top_k * remote_nodes_per_token(moe.n_experts, moe.top_k, ep // local)
        seconds = max(cluster.intra_node.seconds(rows * (local - 1) / ep, messages=exchanges * (local - 1),
                                                 kind="all-to-all"),
                      link.seconds(crossing, messages=exchanges * (ep - local), kind="all-to-all"))
    else:
        seconds = link.seconds(rows * peers, messages=exchanges * (ep - 1), kind="all-to-all")
    counts, calls = runs * moe.layers * forwards * moe.n_experts * COUNT_BYTES * peers, runs * moe.layers * forwards
    return [("expert-parallel all-to-all", rows * peers, exchanges, seconds),
            ("expert-parallel count exchange", counts, calls,
             link.seconds(counts, messages=calls * (ep - 1), kind="all-to-all"))]


def remote_nodes_per_token(experts: int, top_k: int, nodes: int) -> float:
    """How many other nodes hold at least one of a token's ``top_k`` experts, on average, its
    experts drawn evenly from ``experts`` spread evenly over ``nodes`` nodes (force-balanced
    routing: the published MoE benchmarks' setting)."""
    per_node = experts // nodes
    none_there = math.comb(experts - per_node, top_k) / math.comb(experts, top_k)
    return (nodes - 1) * (1 - none_there)
