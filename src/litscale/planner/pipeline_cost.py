"""What each pipeline rank holds: its stages' blocks, cut and placed as the pipeline strategy
cuts them (``litscale.strategies.stages``: balanced by parameter count, or at
``split_points``), with each block's parameters and traced activations (``ModelFacts.block_*``).

An even split of the model over the stages is wrong where the blocks are unequal: a first
stage with the embedding, a last one with the head and the loss's log-probabilities, or 5
layers on 2 ranks. Here each rank's share is its own blocks'.
"""

from __future__ import annotations

from litscale.planner.model_facts import ModelFacts
from litscale.planner.plan import Plan


def rank_stages(plan: Plan, facts: ModelFacts) -> list[list[tuple[int, range]]] | None:
    """Each pipeline rank's stages ``(stage index, its blocks)``, as the strategy plans them;
    None without a pipeline, without the model's blocks, or with more stages than blocks."""
    mesh = plan.mesh
    if mesh.pipeline == 1 or not facts.block_params or facts.net is None:
        return None
    from litscale.strategies.pipeline import SCHEDULES
    from litscale.strategies.stages import balanced_cuts, find_blocks, stage_cuts, stage_ranks

    stages, split_points = mesh.pipeline * plan.virtual_stages, plan.options.get("split_points")
    if stages > len(facts.block_params):
        return None
    # Balanced as the strategy balances them (by parameter count, read once into the facts: a
    # ranking costs thousands of plans), or cut at the user's split points.
    cuts = stage_cuts(*find_blocks(facts.net), stages, split_points) if split_points else \
        balanced_cuts(facts.block_params, stages)
    cuts = [*cuts, len(facts.block_params)]
    held: list[list[tuple[int, range]]] = [[] for _ in range(mesh.pipeline)]
    for stage, rank in enumerate(stage_ranks(stages, mesh.pipeline, SCHEDULES[plan.schedule][1])):
        held[rank].append((stage, range(cuts[stage], cuts[stage + 1])))
    return held


def rank_param_shares(plan: Plan, facts: ModelFacts) -> list[float] | None:
    """Each pipeline rank's share of the model's parameters (a parameter two blocks share is
    counted in each: the strategy keeps such blocks on one stage)."""
    held = rank_stages(plan, facts)
    if held is None:
        return None
    total = sum(facts.block_params)
    return [sum(facts.block_params[b] for _, blocks in stages for b in blocks) / total for stages in held]


def rank_activation_bytes(plan: Plan, facts: ModelFacts, whole: float, boundary: float = 0.0) -> list[float] | None:
    """Each pipeline rank's activations at its peak, of a model whose saved activations for one
    pipeline micro-batch are ``whole`` bytes: each stage's blocks' share of them times the
    micro-batches in flight on that stage (GPipe: all; 1F1B: stage s of p holds p - s; the
    interleaved 1F1B: its warm-up's forwards, ``interleaved_peak``), plus the largest backward
    working set of its blocks, which it runs with all of them held, plus what the schedule keeps
    to pass ``boundary``-byte tensors between stages (``receive_buffers``, and the interleaved
    schedule's sends). None where the blocks are unknown or another schedule places several
    stages on a rank (its in-flight counts are the even split's, in ``cost.activation_bytes``)."""
    from litscale.strategies.pipeline import SCHEDULES

    held = rank_stages(plan, facts)
    if held is None:
        return None
    saved, backward = facts.block_shares(plan.pipeline_micro_batch)
    if not saved:
        return None
    last = plan.mesh.pipeline * plan.virtual_stages - 1
    if not plan.published.pipeline_receive_buffers:
        boundary = 0.0  # a published framework's point-to-point, freed once used (``Framework``)
    received = [boundary * receive_buffers([stage for stage, _ in stages], last, plan.microbatches) for stages in held]
    if plan.schedule == "interleaved_1f1b":
        sent = boundary / whole if whole > 0 else 0.0
        return [whole * interleaved_peak(plan, rank, {stage: (sum(saved[b] for b in blocks),
                                                              max(backward[b] for b in blocks),
                                                              sent * ((stage != last) + (stage != 0)))
                                                      for stage, blocks in stages}) + received[rank]
                for rank, stages in enumerate(held)]
    if SCHEDULES[plan.schedule][1] != "single":
        return None
    gpipe, pipeline = plan.schedule == "gpipe", plan.mesh.pipeline
    return [sum(whole * (sum(saved[b] for b in blocks)
                         * (plan.microbatches if gpipe else min(plan.microbatches, pipeline - stage))
                         + max(backward[b] for b in blocks))
                for stage, blocks in stages) + received[rank] for rank, stages in enumerate(held)]


def receive_buffers(stages: list[int], last: int, microbatches: int) -> int:
    """Tensors torch's pipeline stages keep to receive into, for the whole run: one per
    micro-batch for a stage's input (every stage but the first) and one for its output's
    gradient (every stage but the last), made at the first step (``_prepare_forward_infra``,
    ``_prepare_backward_infra``)."""
    return microbatches * sum((stage != 0) + (stage != last) for stage in stages)


def interleaved_peak(plan: Plan, rank: int, stages: dict[int, tuple[float, float, float]]) -> float:
    """The peak of pipeline rank ``rank``'s activations under torch's ``ScheduleInterleaved1F1B``,
    as shares of one micro-batch's whole model: ``stages`` maps each of the rank's stages to its
    (saved, backward working set, sent) shares. A micro-batch's saved share is held from its
    forward on a stage to its backward there, the working set on top while that backward runs.
    The sent share is what a stage has sent for a micro-batch (its output, its input's
    gradient), which the schedule waits for only at the step's end: held from its backward on."""
    held = peak = 0.0
    for kind, stage in interleaved_order(plan.mesh.pipeline, sorted(stages), plan.microbatches, rank):
        saved, working, sent = stages[stage]
        if kind == "F":
            held += saved
            peak = max(peak, held)
        else:
            peak, held = max(peak, held + working), held - saved + sent
    return peak


def interleaved_order(pipeline: int, stages: list[int], microbatches: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s forwards ("F") and backwards ("B") by stage, in the order of torch's
    ``ScheduleInterleaved1F1B``: a warm-up of forwards, local stage after local stage, each over
    a round of micro-batches (``(v - 1) x round + 2 x (p - 1 - rank)`` of them: torch's
    ``_get_warmup_ops``), then a forward and a backward at a time (backwards from the last local
    stage down), then the remaining backwards.
    NOTE: walked here rather than read off torch's schedule, which needs built stages and a
    process group; ``tests/test_planner_pipeline.py`` checks it against torch's own order."""
    local = len(stages)
    per_round = microbatches // max(1, microbatches // pipeline)
    total = microbatches * local
    warmup = min((local - 1) * per_round + 2 * (pipeline - 1 - rank), total)
    forwards = [("F", stages[(step // per_round) % local]) for step in range(total)]
    backwards = [("B", stages[local - 1 - (step // per_round) % local]) for step in range(total)]
    order = forwards[:warmup]
    for step in range(total - warmup):
        order += [forwards[warmup + step], backwards[step]]
    return order + backwards[total - warmup:]
