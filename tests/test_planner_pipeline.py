"""What each pipeline rank holds, as the planner counts it (``litscale.planner.pipeline_cost``):
its stages' blocks, cut and placed by the pipeline strategy's own rules, each block with its
parameters, the activations its forward saves and its backward's working set."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from litscale.models.gpt import build_gpt
from litscale.models.llama import build_llama
from litscale.parallel.layout import MeshSizes
from litscale.planner.model_facts import (
    ModelFacts,
    model_facts,
    pipeline_block_names,
    traced_step_bytes,
)
from litscale.planner.pipeline_cost import (
    interleaved_order,
    rank_activation_bytes,
    rank_param_shares,
    rank_stages,
)
from litscale.planner.plan import Plan
from litscale.strategies.pipeline import PipelineParallelStrategy
from litscale.strategies.stages import find_blocks


def two_linears() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def test_each_unit_is_given_the_activations_its_forward_saved():
    """Linear(8, 16) keeps its input (B x 8 floats), Linear(16, 4) its own (B x 16)."""
    traced = traced_step_bytes(two_linears(), torch.empty(5, 8, device="meta"), units=[["0"], ["1"]])
    assert traced.saved_by_unit == (5 * 8 * 4, 5 * 16 * 4)
    assert sum(traced.saved_by_unit) == traced.saved


def test_each_units_backward_working_set_is_the_gradient_it_passes_back():
    """Linear(16, 4)'s backward makes the gradient of its input (B x 16 floats) and of its
    weights (left out: a step holds them anyway), after the loss's backward (the last unit's:
    ``sum``'s gradient, one float expanded); the first Linear's input needs none."""
    traced = traced_step_bytes(two_linears(), torch.empty(5, 8, device="meta"), units=[["0"], ["1"]])
    assert traced.backward_by_unit == (0, 5 * 16 * 4 + 4)


def test_the_block_names_are_the_ones_the_pipeline_strategy_cuts_between():
    with torch.device("meta"):
        net = build_gpt(vocab_size=256, block_size=64)
    owner, units = find_blocks(net)
    assert owner is net and pipeline_block_names(net) == units
    assert pipeline_block_names(two_linears()) == []


def plan(pipeline: int, schedule: str = "1f1b", microbatches: int = 4, micro_batch: int = 8) -> Plan:
    return Plan(strategy="pipeline", mesh=MeshSizes(pipeline=pipeline), micro_batch=micro_batch, accumulation=1,
                microbatches=microbatches, schedule=schedule)


@pytest.fixture(scope="module")
def five_layers() -> ModelFacts:
    with torch.device("meta"):
        net = build_llama(preset="tiny", vocab_size=256, block_size=32, n_layer=5)
    return model_facts(net, seq_len=32, vocab_size=256)


@pytest.mark.slow  # traces a Llama (3 s)
@pytest.mark.parametrize("pipeline", [2, 3, 4])
def test_the_planners_stages_are_the_strategys(five_layers, pipeline):
    """The cut and the placement the planner costs are the ones the strategy makes of the same
    network, for layers that do not split evenly (5 layers, the embedding and the head)."""
    facts, net = five_layers, five_layers.net
    cuts, ranks = PipelineParallelStrategy(pipeline_parallel_size=pipeline, microbatches=4)._layout(
        *find_blocks(net), plan(pipeline).mesh)
    ends = [*cuts[1:], len(facts.block_params)]
    expected = [[(stage, range(cuts[stage], ends[stage])) for stage in range(len(cuts)) if ranks[stage] == rank]
                for rank in range(pipeline)]
    assert rank_stages(plan(pipeline), facts) == expected
    assert sum(rank_param_shares(plan(pipeline), facts)) == pytest.approx(1.0)


def facts_of_blocks(params, saved, backward) -> ModelFacts:
    """Facts of four blocks with the given parameters, saved bytes and backward working sets per
    sample (no fixed part)."""
    with torch.device("meta"):
        net = build_llama(preset="tiny", vocab_size=64, block_size=8)  # declares 4 blocks
    return ModelFacts(num_params=sum(params), flops_per_token=0.0, seq_len=8, layers=2, hidden=0, heads=1,
                      activation_bytes_per_sample=float(sum(saved)), pipeline_blocks=4, block_params=tuple(params),
                      block_saved_per_sample=tuple(map(float, saved)), block_saved_fixed=(0.0,) * 4,
                      block_backward_per_sample=tuple(map(float, backward)), net=net)


def test_each_rank_holds_its_own_blocks_activations_for_each_micro_batch_in_flight():
    """Blocks (embedding, layer, layer, head) cut 2 + 2 by parameters; whole = 1000 bytes for one
    pipeline micro-batch of 2 samples, shared 10% / 40% / 40% / 10%, the layers' backward
    working sets 5% of it. 1F1B: stage 0 holds 2 micro-batches (p - 0), stage 1 one; GPipe: all 4."""
    facts = facts_of_blocks(params=(1, 10, 10, 1), saved=(10, 40, 40, 10), backward=(0, 5, 5, 0))
    assert rank_activation_bytes(plan(2), facts, whole=1000.0) == pytest.approx([(100 + 400) * 2 + 50, 500 + 50])
    assert rank_activation_bytes(plan(2, "gpipe"), facts, whole=1000.0) == pytest.approx(
        [(100 + 400) * 4 + 50, (400 + 100) * 4 + 50])
    assert rank_param_shares(plan(2), facts) == pytest.approx([11 / 22, 11 / 22])


def test_the_interleaved_schedule_holds_its_warm_up_forwards_of_each_local_stage():
    """Interleaved 1F1B, 2 ranks x 2 local stages, 4 micro-batches (rounds of 2): rank 0 holds
    stages 0 and 2 (blocks of 10% and 40%) and warms up with 4 forwards (0, 0, 2, 2), then one
    more of stage 0 before its first backward: 1.1 micro-batches' whole. Rank 1 (stages 1 and 3:
    40% and 10%) warms up with 2 and peaks at its steady state's third forward of stage 1 (the
    backwards run from the last local stage down): 1.2."""
    facts = facts_of_blocks(params=(1, 10, 10, 1), saved=(10, 40, 40, 10), backward=(0, 0, 0, 0))
    looped = dataclasses.replace(plan(2, "interleaved_1f1b"), virtual_stages=2, microbatches=4)
    assert rank_stages(looped, facts) == [[(0, range(0, 1)), (2, range(2, 3))], [(1, range(1, 2)), (3, range(3, 4))]]
    assert rank_activation_bytes(looped, facts, whole=1000.0) == pytest.approx([1100, 1200])
    v_shaped = dataclasses.replace(plan(2, "zbv_zero_bubble"), virtual_stages=2)
    assert rank_activation_bytes(v_shaped, facts, whole=1000.0) is None  # the even split's counts


def test_each_rank_holds_the_schedules_receive_buffers_and_the_interleaved_sends():
    """The blocks above, with 10-byte tensors between stages and 4 micro-batches. Each stage
    keeps a buffer per micro-batch to receive its input (all but the first stage) and its
    output's gradient (all but the last): 1F1B's rank 0 (stage 0) and rank 1 (stage 1) 4 each,
    +40. Interleaved, rank 0 (stages 0 and 2) keeps 12, rank 1 (1 and 3) 12, +120; and what a
    stage has sent (its output, its input's gradient) is held from the micro-batch's backward to
    the step's end: rank 0 then peaks at the second forward of stage 2 after its warm-up, 1.15
    micro-batches' whole with 2 backwards of stage 2 and 1 of stage 0 sent (1.1 without), rank 1
    at its fourth forward of stage 1, 1.24 (1.2 without)."""
    facts = facts_of_blocks(params=(1, 10, 10, 1), saved=(10, 40, 40, 10), backward=(0, 5, 5, 0))
    assert rank_activation_bytes(plan(2), facts, whole=1000.0, boundary=10.0) == pytest.approx([1050 + 40, 550 + 40])
    facts = facts_of_blocks(params=(1, 10, 10, 1), saved=(10, 40, 40, 10), backward=(0, 0, 0, 0))
    looped = dataclasses.replace(plan(2, "interleaved_1f1b"), virtual_stages=2, microbatches=4)
    assert rank_activation_bytes(looped, facts, whole=1000.0, boundary=10.0) == pytest.approx([1150 + 120, 1240 + 120])


@pytest.mark.parametrize(("pipeline", "local", "microbatches"), [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 3, 4), (2, 3, 2)])
def test_the_interleaved_order_is_torchs_own(pipeline, local, microbatches):
    """The walk the planner takes is the order torch's ScheduleInterleaved1F1B builds its actions in."""
    from torch.distributed.pipelining.schedules import (
        _ComputationType,
        _get_1f1b_rank_ops,
        _get_warmup_ops,
    )

    per_round = microbatches // max(1, microbatches // pipeline)
    for rank in range(pipeline):
        warmup = _get_warmup_ops(rank, local, per_round, pipeline, microbatches)
        total = local * microbatches
        actions = _get_1f1b_rank_ops(
            local, pipeline, warmup, total - warmup, warmup, rank,
            lambda step, rank=rank: ((step // per_round) % local) * pipeline + rank,
            lambda step, rank=rank, warmup=warmup: (local - 1 - ((step - warmup) // per_round) % local) * pipeline + rank)
        theirs = [("F" if action.computation_type == _ComputationType.FORWARD else "B", action.stage_index)
                  for action in actions if action is not None]
        ours = interleaved_order(pipeline, [index * pipeline + rank for index in range(local)], microbatches, rank)
        assert ours == theirs, rank


def test_without_the_models_blocks_nothing_is_split_by_blocks():
    facts = dataclasses.replace(facts_of_blocks((1, 1, 1, 1), (1, 1, 1, 1), (0, 0, 0, 0)), block_params=(), net=None)
    assert rank_stages(plan(2), facts) is None and rank_activation_bytes(plan(2), facts, 1.0) is None
    assert rank_stages(plan(1), facts_of_blocks((1, 1, 1, 1), (1, 1, 1, 1), (0, 0, 0, 0))) is None
