"""One plan's prediction: memory per rank, the collectives of a step, and the step time.

Memory: parameters, gradients and optimizer state per strategy (the ZeRO paper's formulas on
what each strategy states of itself, ``litscale.parallel.sharding``, from which the memory callback
estimates every run beside its measurement), plus activations traced on the meta device, scaled by activation
checkpointing, tensor parallel and the micro-batches a pipeline stage holds in flight.
Communication: bytes of each collective of a step (ring algorithms), timed with the
cluster's alpha-beta figures. Time: FLOPs over calibrated throughput, plus the communication
that backward cannot hide, stretched by the pipeline bubble. A mixture of experts' parts
(the MoE layers tensor parallel leaves whole, expert parallel's sharding and all-to-all) are
in ``moe_cost.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from litscale.parallel.layout import PIPELINE
from litscale.parallel.sharding import Sharding, state_bytes_per_rank
from litscale.planner.cluster import Cluster
from litscale.planner.compute_cost import compute_s, profile_key
from litscale.planner.model_facts import ModelFacts
from litscale.planner.moe_cost import all_to_all, data_sharded_params, expert_fsdp_collectives
from litscale.planner.pipeline_cost import rank_activation_bytes, rank_param_shares
from litscale.planner.plan import Plan

# Bytes per element by dtype name. (Optimizer state per parameter: ModelFacts'.)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Collective:
    name: str
    bytes_per_rank: float  # what each rank sends over the step, all calls together
    calls: int
    seconds: float


@dataclass
class Prediction:
    plan: Plan
    memory: dict[str, float]
    collectives: list[Collective] = field(default_factory=list)
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    optimizer_s: float = 0.0
    bubble: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0

    @property
    def peak_bytes(self) -> float:
        return self.memory["total"]

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.collectives)

    def binding(self, cluster: Cluster) -> str:
        """What limits this plan most."""
        if self.peak_bytes > 0.9 * cluster.device_memory_bytes:
            return "memory"
        if self.bubble > 0.2:
            return "pipeline bubble"
        if self.exposed_comm_s > 0.25 * self.step_s:
            return "communication"
        return "compute"


def predict(plan: Plan, facts: ModelFacts, cluster: Cluster) -> Prediction:
    prediction = Prediction(plan, memory_per_rank(plan, facts, cluster))
    prediction.collectives = collectives(plan, facts, cluster)
    _time(prediction, facts, cluster)
    return prediction


def memory_per_rank(plan: Plan, facts: ModelFacts, cluster: Cluster) -> dict[str, float]:
    """The busiest rank's bytes at the step's peak: a pipeline's ranks each with their own
    stages' parameters and activations (``pipeline_cost``), where the model's blocks are known."""
    facts = facts_as_run(plan, facts)
    shares = rank_param_shares(plan, facts) or [1 / plan.mesh.pipeline]
    activations = rank_activation_bytes(plan, facts, pipeline_whole_bytes(plan, facts), stage_boundary_bytes(plan, facts)) \
        or [activation_bytes(plan, facts)] * len(shares)
    activations = [held * plan.published.saved_activation_share for held in activations]
    ranks = [_rank_memory(plan, facts, cluster, share * plan.mesh.pipeline, held)
             for share, held in zip(shares, activations, strict=True)]
    return max(ranks, key=lambda memory: memory["total"])


def facts_as_run(plan: Plan, facts: ModelFacts) -> ModelFacts:
    """``facts`` with the activations traced as the plan's strategy computes: with the weights in
    the compute dtype and no autocast where it gathers them so (FSDP2's mixed-precision policy,
    DeepSpeed's 16-bit engine). Costed from the autocast trace instead, GPT-nano under FSDP with
    bf16_mixed was predicted 14% above its fake-tensor step, and a checkpointed layer's input at
    fp32's 4 bytes where it keeps 2."""
    if facts.traced_under_autocast and (plan.sharding.zero_stage or plan.sharding.fp32_master_copy):
        return facts.with_weights_in_compute_dtype()
    return facts


def _rank_memory(plan: Plan, facts: ModelFacts, cluster: Cluster, scale: float, activations: float) -> dict[str, float]:
    """One rank's memory, holding ``scale`` times the even split's share of the parameters."""
    sharding, param_bytes = plan.sharding, DTYPE_BYTES[plan.param_dtype]
    master = 4 if param_bytes < 4 and not sharding.fp32_master_copy else 0  # 16-bit parameters' fp32 copy
    moe = facts.moe

    def states_of(held: Sharding) -> dict[str, float]:
        return state_bytes_per_rank(num_params=facts.num_params * scale, mesh=plan.mesh, sharding=held,
                                    param_bytes=param_bytes,
                                    optimizer_bytes_per_param=facts.optimizer_state_bytes_per_param + master,
                                    at_peak=True, tensor_whole_params=moe.layer_params * scale if moe else 0,
                                    expert_params=moe.expert_params * scale if moe else 0)

    states = states_of(sharding)
    # Gradients copied into reduction buckets (DeepSpeed's contiguous gradients) live there, not
    # beside them: a ZeRO-1 rank then keeps its reduced partition alone, as ZeRO-2's does.
    grads = states_of(replace(sharding, zero_stage=2)) if sharding.reduce_buffers and \
        sharding.zero_stage == 1 else states
    local_params = rank_params(plan, facts) * scale
    memory = {"params": states["memory/estimate_params_bytes"], "grads": grads["memory/estimate_grads_bytes"],
              "optimizer": states["memory/estimate_optimizer_bytes"],
              "buffers": sharding.reduce_buffer_bytes_per_rank(local_params, param_bytes)
              + fsdp_gathered_bytes(plan, facts) * scale,
              "activations": activations}
    memory["total"] = sum(memory.values()) * (1 + cluster.allocator_overhead)
    return memory


def rank_params(plan: Plan, facts: ModelFacts) -> float:
    """Parameters one rank holds whole before any data sharding, at an even pipeline split: the
    dense ones split by tensor parallel, a mixture of experts' MoE layers whole under it (their
    routed experts split over the expert-parallel ranks)."""
    mesh, moe = plan.mesh, facts.moe
    if moe is None:
        return facts.num_params / mesh.model_split
    dense = facts.num_params - moe.layer_params
    return (dense / mesh.tensor + moe.layer_params - moe.expert_params + moe.expert_params / mesh.expert) / mesh.pipeline


def fsdp_gathered_bytes(plan: Plan, facts: ModelFacts) -> float:
    """What FSDP2 holds in its own buffers beside a rank's shards (in the compute dtype, which its
    mixed-precision policy gathers in). Resharding after forward: the root's parameters
    (embeddings, head), kept gathered from forward to backward, and in backward one unit's
    gathered parameters and unsharded gradients before they are reduced. Holding the parameters
    through the step (a pipeline's stages): every gathered parameter, counted as the plan's
    parameters, beside which the shards stay."""
    sharding, mesh = plan.sharding, plan.mesh
    if sharding.zero_stage != 3 or sharding.fp32_master_copy or mesh.fsdp == 1 and not sharding.whole_parameters_in_step:
        return 0.0  # not FSDP2 (DeepSpeed's ZeRO-3 keeps its own buffers: reduce_buffers)
    split = mesh.model_split
    if sharding.whole_parameters_in_step:  # the shards at fp32 (DTYPE_BYTES of the parameters)
        return facts.num_params / split / mesh.fsdp * DTYPE_BYTES[plan.param_dtype]
    experts = facts.moe.expert_params if facts.moe else 0
    unit = (facts.num_params - facts.root_params - experts + experts / mesh.expert) / max(facts.layers, 1) / split
    return (facts.root_params / split + 2 * unit) * DTYPE_BYTES[plan.compute_dtype]


def pipeline_whole_bytes(plan: Plan, facts: ModelFacts) -> float:
    """Activations all the stages of one tensor-parallel rank save for one pipeline
    micro-batch: with context parallel, its share of the sequence's, plus each layer's keys and
    values gathered whole (kept for backward)."""
    mesh, micro, scale = plan.mesh, plan.pipeline_micro_batch, activation_scale(plan, facts)
    whole = facts.activations(micro) * scale  # as the strategy computes: ``facts_as_run``
    if plan.activation_checkpointing:  # every layer keeps its input; one layer is recomputed at a time
        # NOTE: counting the embedding and the head apart from the layers (each block's traced
        # share, the head's freed before the first recompute or not) was tried: against the
        # fake-tensor step of Llama-tiny under FSDP (fp32, bf16 at 128 and 512 tokens) it missed
        # by up to 20%, this even share by up to 14%.
        whole = facts.layers * facts.boundary_bytes(micro, layer_input_bytes(plan)) + whole / facts.layers
    elif plan.published.selective_saves_bytes_per_token:  # what the policy saves; one layer recomputed at a time
        saved = plan.published.selective_saves_bytes_per_token * micro * facts.seq_len
        whole = facts.layers * saved + whole / facts.layers
    return (whole / mesh.context + context_kv_bytes(plan, facts)) / mesh.tensor \
        + tensor_parallel_whole_bytes(plan, facts) / mesh.context


def stage_boundary_bytes(plan: Plan, facts: ModelFacts) -> float:
    """What a pipeline stage sends or receives for one micro-batch (its output, or its input's
    gradient), in the compute dtype, split as context and tensor parallel split the sequence."""
    mesh = plan.mesh
    return facts.boundary_bytes(plan.pipeline_micro_batch, DTYPE_BYTES[plan.compute_dtype]) / mesh.context / mesh.tensor


def backward_working_bytes(plan: Plan, facts: ModelFacts) -> float:
    """The step's working set beside the saved activations, once per rank (not once per
    micro-batch in flight): backward's (the logits' gradient, a layer's activation gradients), or
    where it is larger the logits' gather for the loss (``logits_gather_bytes``)."""
    mesh = plan.mesh
    traced = facts.backward_working_bytes(plan.pipeline_micro_batch) * activation_scale(plan, facts) \
        / mesh.context / mesh.tensor
    return max(traced, logits_gather_bytes(plan, facts))


def logits_gather_bytes(plan: Plan, facts: ModelFacts) -> float:
    """Tensor parallel without loss parallel gathers the head's vocabulary-split logits whole for
    the loss, at the end of forward, with every activation saved: the all-gather's output and its
    concatenation along the vocabulary (each the whole vocabulary's logits) beside the rank's own
    shard, before the log-probabilities (counted as saved) exist: 1 + 1/t whole logits beyond
    the saved activations. Measured on CPU (``tests/test_memory_table.py``): without it, GPT-nano
    and Llama tiny on 2 tensor-parallel ranks were predicted 7-10% below their peaks."""
    tensor = plan.mesh.tensor
    if tensor == 1 or loss_parallel(plan):
        return 0.0
    logits = plan.pipeline_micro_batch * facts.seq_len * facts.vocab_size * DTYPE_BYTES[plan.compute_dtype]
    return logits / plan.mesh.context * (1 + 1 / tensor)


def activation_bytes(plan: Plan, facts: ModelFacts) -> float:
    """Activations the busiest rank holds at the peak, between a micro-batch's forward and
    backward (``pipeline_whole_bytes``), with a pipeline its stage's for each micro-batch in
    flight, split evenly over the stages (``pipeline_cost`` splits them as the strategy does)."""
    mesh, micro = plan.mesh, plan.pipeline_micro_batch
    per_stage = pipeline_whole_bytes(plan, facts) / mesh.pipeline
    working = backward_working_bytes(plan, facts)
    if mesh.pipeline == 1:
        return per_stage + working
    # A pipeline's first stage holds the most micro-batches in flight (1F1B: as many as there are
    # stages; GPipe: all), its last stage the loss's fp32 log-probabilities for each of its own.
    loss = micro * facts.seq_len * facts.vocab_size * 4 / mesh.context / mesh.tensor
    body = per_stage - loss / mesh.pipeline
    gpipe = plan.schedule == "gpipe"
    first = body * (plan.microbatches if gpipe else min(plan.microbatches, mesh.pipeline))
    last = (body + loss) * (plan.microbatches if gpipe else 1)
    return max(first, last) + working


def layer_input_bytes(plan: Plan) -> int:
    """Bytes per element of a layer's input (what a checkpointed layer keeps): the compute
    dtype's where the whole forward runs in it, with 16-bit weights (``*_true``) or a strategy
    that gathers its weights in it and casts each unit's inputs (FSDP2's mixed-precision policy,
    DeepSpeed's 16-bit engine); else fp32, which autocast keeps the residual stream in."""
    sixteen_bit_weights = plan.param_dtype == plan.compute_dtype or plan.sharding.zero_stage or \
        plan.sharding.fp32_master_copy
    return DTYPE_BYTES[plan.compute_dtype] if sixteen_bit_weights else 4


def activation_scale(plan: Plan, facts: ModelFacts) -> float:
    """The plan's activation bytes over the traced ones: 1 where the trace ran in the plan's
    compute dtype, else the dtype's size over fp32's."""
    return 1.0 if facts.traced_dtype == plan.compute_dtype else DTYPE_BYTES[plan.compute_dtype] / 4


def tensor_parallel_whole_bytes(plan: Plan, facts: ModelFacts) -> float:
    """What tensor parallel leaves whole on each of its ranks beyond their share of the
    activations: under sequence parallel, the sequence-gathered input each attention and
    each MLP saves for its column-parallel matmuls, and that of the head (in the compute dtype);
    without loss parallel, the whole vocabulary's fp32 log-probabilities the cross-entropy keeps;
    a mixture of experts' MoE layers, which it leaves whole (``models/moe_parallel.py``). Under
    activation checkpointing a layer saves only its input from its forward to its backward: what
    it leaves whole lives while it is recomputed, one layer at a time (the head's input stays).
    A published framework that gathers again in backward instead (Megatron's sequence parallel)
    keeps no gathered input."""
    tensor = plan.mesh.tensor
    if tensor == 1:
        return 0.0
    micro = plan.pipeline_micro_batch
    held = 1 if plan.activation_checkpointing else facts.layers  # layers whose saves are alive at once
    gathered = (2 * held + 1) * facts.boundary_bytes(micro, DTYPE_BYTES[plan.compute_dtype]) \
        if plan.published.saves_gathered_inputs else 0.0
    log_probs = 0.0 if loss_parallel(plan) else micro * facts.seq_len * facts.vocab_size * 4
    moe = 0.0
    if facts.moe:
        moe = micro * facts.moe.saved_bytes_per_sample * activation_scale(plan, facts) * min(held, facts.moe.layers) \
            / facts.moe.layers
    return (gathered + log_probs + moe) * (1 - 1 / tensor)


def loss_parallel(plan: Plan) -> bool:
    """The loss computed on the vocabulary-split logits (the strategy's option, or a published
    framework's vocabulary-parallel cross-entropy)."""
    return bool(plan.options.get("loss_parallel")) or plan.published.loss_parallel


def context_kv_bytes(plan: Plan, facts: ModelFacts) -> float:
    """Keys and values of every layer for the whole sequence of one micro-batch (before tensor
    parallel's split): what context parallel gathers, 0 without it."""
    if plan.mesh.context == 1:
        return 0.0
    return 2 * facts.layers * plan.pipeline_micro_batch * facts.seq_len * facts.kv_width * DTYPE_BYTES[plan.compute_dtype]


# DDP's gradient buckets: the first holds 1 MiB, the others 25 MiB (torch's defaults).
DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES = 2**20, 25 * 2**20


def muon_update_gathers(plan: Plan, facts: ModelFacts, ring, shards: int, data_link, cluster: Cluster) -> None:
    """Muon's step gathers each sharded hidden matrix's fp32 update whole (``full_tensor``, one
    call per matrix): over the FSDP shards, and over the tensor-parallel ranks. ZeRO (DeepSpeed's
    ZeRO Muon) all-reduces only the matrices its partitions split, which is not counted."""
    mesh = plan.mesh
    if not facts.matrix_params or (plan.sharding.fp32_master_copy and mesh.data_shard > 1):
        return
    matrices, update = facts.matrix_tensors // mesh.pipeline, facts.matrix_params * 4 / mesh.pipeline
    if plan.sharding.zero_stage == 3 and shards > 1:
        ring("Muon update all-gather", update / mesh.tensor, matrices, shards, data_link, 1)
    if mesh.tensor > 1:
        ring("Muon update all-gather (tensor)", update, matrices, mesh.tensor, cluster.link_for(mesh.tensor, 1), 1)


def collective_kind(name: str) -> str | None:
    """The kind of collective a cost line names ("tensor-parallel all-gather": "all-gather"), as
    ``Link.collectives`` keys its measured figures."""
    return next((kind for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all") if kind in name), None)


def latency_steps(group: int, factor: int) -> int:
    """Latencies one collective pays: a ring's ``factor x (n - 1)`` steps, or a tree's
    ``factor x ceil(log2 n)`` where that is fewer (NCCL picks trees where latency dominates),
    while the bytes stay the ring's, the least any algorithm sends."""
    return factor * min(group - 1, math.ceil(math.log2(group)))


def collectives(plan: Plan, facts: ModelFacts, cluster: Cluster) -> list[Collective]:
    """Each collective of one optimizer step: its calls and the bytes each rank sends in all of
    them (ring algorithms: an all-reduce sends 2 (n-1)/n of the buffer, an all-gather or a
    reduce-scatter (n-1)/n), timed with one latency per ring message."""
    mesh, found = plan.mesh, []
    share = 1 / mesh.model_split
    sharded, _ = data_sharded_params(plan, facts)  # a mixture of experts' routed experts apart (moe_cost.py)
    grad_bytes = sharded * 4  # gradients reduced in fp32
    param_bytes = sharded * DTYPE_BYTES[plan.param_dtype]
    # FSDP shards over data x context: context-parallel ranks hold the same parameters.
    shards = mesh.fsdp
    data_link = cluster.link_for(mesh.loss, mesh.stride("loss"))
    units = facts.layers  # FSDP / ZeRO-3 gather and scatter one sharding unit per call

    def ring(name: str, nbytes: float, calls: int, group: int, link, factor: int) -> None:
        if group > 1 and nbytes > 0 and calls > 0:
            per_rank = factor * (group - 1) / group * nbytes
            found.append(Collective(name, per_rank, calls, link.seconds(
                per_rank, messages=calls * latency_steps(group, factor), kind=collective_kind(name))))

    sharding = plan.sharding
    stage = sharding.peak_stage if shards > 1 else 0
    if stage == 0:  # accumulation runs under no_sync: one reduction per step
        buckets = 1 + math.ceil(max(0.0, grad_bytes - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES)
        # NOTE: a compressed bucket is costed as an all-reduce of what its hook sends; hooks
        # that all-gather (top-k, QSGD, ...) send that many bytes per rank only at 2 ranks
        timed = facts.profiles.get(profile_key(plan))
        sent = grad_bytes / (timed.bytes_ratio if timed is not None else 1.0)
        # a replicated strategy (DDP) reduces in buckets; a sharded one over a single shard, at once
        ring("gradient all-reduce", sent, buckets if sharding.zero_stage == 0 else 1, mesh.data, data_link, 2)
    else:
        acc = plan.accumulation
        if stage == 3:  # each unit gathered for forward and again for backward; the root once, kept
            root_share = facts.root_params * share * DTYPE_BYTES[plan.param_dtype]
            ring("parameter all-gather", acc * (2 * param_bytes - root_share), acc * (2 * units + 1),
                 shards, data_link, 1)
            ring("gradient reduce-scatter", acc * grad_bytes, acc * (units + 1), shards, data_link, 1)
            expert_fsdp_collectives(plan, facts, cluster, ring, DTYPE_BYTES[plan.param_dtype])
        else:  # ZeRO-1/2 (and a pipeline's stage): gradients scattered in buckets, parameters gathered once
            ring("parameter all-gather", param_bytes, 1, shards, data_link, 1)
            ring("gradient reduce-scatter", (acc if stage == 2 else 1) * grad_bytes, acc if stage == 2 else 1,
                 shards, data_link, 1)
        if mesh.data_replicate > 1:
            ring("gradient all-reduce (replicas)", grad_bytes / shards, 1, mesh.data_replicate,
                 cluster.inter_node, 2)
    muon_update_gathers(plan, facts, ring, shards, data_link, cluster)
    micro, runs = plan.pipeline_micro_batch, plan.forward_backwards
    activation = facts.boundary_bytes(micro) * DTYPE_BYTES[plan.compute_dtype] / 4 / mesh.context
    found += [Collective(*exchange) for exchange in all_to_all(plan, facts, cluster, DTYPE_BYTES[plan.compute_dtype])]
    if mesh.context > 1:
        # Each attention gathers the keys and values of the whole sequence in forward (two
        # all-gathers) and reduce-scatters their gradients in backward (litscale's
        # strategies.context_parallel), over this rank's key/value heads.
        layers = facts.layers // mesh.pipeline
        kv = runs * context_kv_bytes(plan, facts) / mesh.pipeline / mesh.tensor
        link = cluster.link_for(mesh.context, mesh.tensor)
        ring("context-parallel all-gather", kv, runs * 2 * layers, mesh.context, link, 1)
        ring("context-parallel reduce-scatter", kv, runs * 2 * layers, mesh.context, link, 1)
    if mesh.tensor > 1:
        # As counted on a real step (tests/test_planner_collectives.py), with the strategy's
        # sequence parallelism (Megatron's pattern): per layer, attention and the MLP each
        # gather the sequence and reduce-scatter their output in forward; in backward each
        # gathers its output's gradient and reduce-scatters its input's. Per forward-backward,
        # the embedding's output is all-reduced and its gradient gathered; the head's input
        # gathered and its gradient reduce-scattered, and its logits gathered whole (on the last
        # stage: a pipeline is costed at its first). Per step, each norm's partial gradient is
        # all-reduced once.
        layers, head = facts.layers // mesh.pipeline, int(mesh.pipeline == 1)
        logits = micro * facts.seq_len * facts.vocab_size * DTYPE_BYTES[plan.compute_dtype] / mesh.context
        gathers = runs * (4 * layers + 1 + 2 * head)
        ring("tensor-parallel all-gather", runs * ((4 * layers + 1 + head) * activation + head * logits), gathers,
             mesh.tensor, cluster.intra_node, 1)
        # An MoE layer, whole on every rank (models/moe_parallel.py), gathers its input in forward
        # and its output's gradient in backward as an MLP does, but keeps its own slice of its
        # output and of its input's gradient: no reduce-scatter.
        scatters = 4 * layers + head - 2 * (facts.moe.layers // mesh.pipeline if facts.moe else 0)
        ring("tensor-parallel reduce-scatter", runs * scatters * activation, runs * scatters,
             mesh.tensor, cluster.intra_node, 1)
        norms = facts.norm_tensors // mesh.pipeline
        norm_grads = facts.norm_params / mesh.pipeline * DTYPE_BYTES[plan.param_dtype]
        ring("tensor-parallel all-reduce", runs * activation + norm_grads, runs + norms, mesh.tensor,
             cluster.intra_node, 2)
    if mesh.pipeline > 1:
        # The busiest rank's sends, as counted: each of its stages sends activations forward
        # and gradients back, but not past an end of the pipeline (at 2 ranks each rank holds
        # one: one send fewer per micro-batch) nor to a stage on the same rank (a V-shaped
        # schedule's middle two, on one rank at 2 ranks: one fewer again). With tensor
        # parallel a stage sends its slice of the sequence. Then the last stage broadcasts
        # the loss (fp32), once per training step.
        link = cluster.link_for(mesh.pipeline, mesh.stride(PIPELINE))
        ends = 0 if mesh.pipeline > 2 else 1 + (plan.schedule in ("zbv_zero_bubble", "dualpipev"))
        calls = runs * (2 * plan.virtual_stages - ends)
        sent = calls * activation / mesh.tensor
        found.append(Collective("pipeline send/recv", sent, calls, link.seconds(sent, calls, kind="send")))
        found.append(Collective("pipeline loss broadcast", 4 * plan.accumulation, plan.accumulation, link.seconds(
            4 * plan.accumulation, plan.accumulation * latency_steps(mesh.pipeline, 1), kind="send")))
    return found


def _optimizer_s(prediction: Prediction, facts: ModelFacts, cluster: Cluster) -> float:
    """The optimizer step over the parameters this rank updates (its shard of them)."""
    plan, key = prediction.plan, profile_key(prediction.plan)
    if key.startswith("zero") and key in facts.profiles:  # DeepSpeed's step, timed on all of it at one rank
        return facts.profiles[key].optimizer_step_s / plan.mesh.data_shard
    if key != "plain" and key in facts.profiles:  # timed on the shard this rank holds
        return facts.profiles[key].optimizer_step_s / plan.mesh.pipeline
    # The parameters whose optimizer state this rank holds: its share as the memory counts it.
    moe, stage = facts.moe, min(plan.sharding.zero_stage, 1)
    updated = state_bytes_per_rank(num_params=facts.num_params, mesh=plan.mesh, sharding=Sharding(zero_stage=stage),
                                   param_bytes=0, optimizer_bytes_per_param=1,
                                   tensor_whole_params=moe.layer_params if moe else 0,
                                   expert_params=moe.expert_params if moe else 0)["memory/estimate_optimizer_bytes"]
    plain = facts.profiles.get("plain")
    if plain is not None:
        return plain.optimizer_step_s * updated / facts.num_params
    return cluster.optimizer_s_per_param * updated


def newton_schulz_s(plan: Plan, facts: ModelFacts, cluster: Cluster) -> float:
    """Muon's orthogonalisation on one rank: every hidden matrix it holds whole or gathers (a
    sharded matrix's update is gathered and orthogonalised on every rank of its shards,
    ``litscale.optim.muon``), a pipeline rank its stages' matrices, a ZeRO rank those of its partition
    (DeepSpeed's ZeRO Muon); FLOPs over the cluster's achieved throughput in its dtype, slowed
    by the node's contention as the forward-backward is."""
    share = 1 / plan.mesh.pipeline
    if plan.sharding.fp32_master_copy and plan.mesh.data_shard > 1:
        share /= plan.mesh.data_shard
    if plan.mesh.world_size > 1:  # the node's other ranks iterate at the same time, as they compute
        share *= cluster.contention
    return facts.newton_schulz_flops * share / cluster.flops(facts.newton_schulz_dtype)


def busiest_pipeline_share(plan: Plan, facts: ModelFacts) -> float:
    """The share of the layers the busiest pipeline rank runs, split as the pipeline strategy
    splits them (``balanced_cuts`` over equal layers, stages placed by the schedule): 1/p where
    the layers split evenly, more where they do not (5 layers on 2 ranks: 3/5). With more stages
    than layers (the strategy also cuts at the embedding and the head), each block is counted
    as a layer's work."""
    if plan.mesh.pipeline == 1:
        return 1.0
    from litscale.strategies.pipeline import SCHEDULES
    from litscale.strategies.stages import balanced_cuts, stage_ranks

    stages = plan.mesh.pipeline * plan.virtual_stages
    layers = max(facts.layers, 1) if stages <= facts.layers else max(facts.pipeline_blocks, stages)
    cuts = balanced_cuts([1] * layers, stages) + [layers]
    ranks = stage_ranks(stages, plan.mesh.pipeline, SCHEDULES[plan.schedule][1])
    held = [0] * plan.mesh.pipeline
    for stage, rank in enumerate(ranks):
        held[rank] += cuts[stage + 1] - cuts[stage]
    return max(held) / layers


def _time(prediction: Prediction, facts: ModelFacts, cluster: Cluster) -> None:
    plan, mesh = prediction.plan, prediction.plan.mesh
    tokens_per_rank = plan.micro_batch * plan.accumulation * facts.seq_len
    compute = compute_s(plan, facts, cluster) * busiest_pipeline_share(plan, facts)
    if mesh.world_size > 1:  # the node's other ranks compute at the same time
        compute *= cluster.contention
    if plan.activation_checkpointing:
        compute *= 4 / 3  # the forward again, inside backward
    compute += plan.forward_backwards * cluster.overhead_per_microbatch_s
    if mesh.pipeline > 1:  # idle time: p - 1 stage-steps of v x m (Narayanan et al. 2021, interleaved)
        work = plan.virtual_stages * plan.microbatches
        prediction.bubble = (mesh.pipeline - 1) / (work + mesh.pipeline - 1)
        compute /= 1 - prediction.bubble
    hideable = {"gradient all-reduce", "gradient reduce-scatter", "parameter all-gather",
                "gradient all-reduce (replicas)", "pipeline send/recv", "expert parameter all-gather",
                "expert gradient reduce-scatter"}
    hidden_comm = sum(c.seconds for c in prediction.collectives if c.name in hideable)
    exposed = max(0.0, hidden_comm - cluster.overlap * compute * 2 / 3)  # backward: 2/3 of compute
    exposed += sum(c.seconds for c in prediction.collectives if c.name not in hideable)
    prediction.compute_s, prediction.exposed_comm_s = compute, exposed
    prediction.optimizer_s = _optimizer_s(prediction, facts, cluster) + newton_schulz_s(plan, facts, cluster)
    prediction.step_s = compute + exposed + prediction.optimizer_s
    global_tokens = tokens_per_rank * mesh.data
    prediction.tokens_per_s = global_tokens / prediction.step_s
    prediction.mfu = facts.flops_per_token * prediction.tokens_per_s / (
        mesh.world_size * cluster.peak_flops.get(plan.compute_dtype, cluster.peak_flops["float32"]))
