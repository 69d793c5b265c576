"""Memory per rank, measured from the tensors each rank holds: sharded strategies hold about
1/N of DDP's bytes for what they shard (2 gloo ranks, AdamW, fp32)."""

from __future__ import annotations

import functools

import pytest
from helpers.distributed import run_distributed
from helpers.parity import ParitySetup, fit_on_mesh, fit_with
from helpers.strategies import ddp, fsdp, pipeline, tensor_parallel, zero

KINDS = ("ddp", "fsdp", "zero1", "zero2", "zero3")
MODEL_PARALLEL = ("tp2", "pp2")  # the model split over the 2 ranks, no data sharding


def measure_all(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    from litscale.callbacks.memory import MemoryCallback

    factories = {"ddp": ddp, "fsdp": fsdp, **{f"zero{s}": functools.partial(zero, s) for s in (1, 2, 3)}}
    results = {}
    for kind in KINDS:
        callback = MemoryCallback()
        fit_with(rank, world_size, factories[kind], ParitySetup(optimizer="adamw", steps=1),
                 callbacks=[callback])
        results[kind] = callback.result
    for kind, strategy in (("tp2", tensor_parallel()), ("pp2", pipeline(microbatches=2))):
        callback = MemoryCallback()
        fit_on_mesh(rank, world_size, strategy, ParitySetup(optimizer="adamw", steps=1), callbacks=[callback])
        results[kind] = callback.result
    return results


@pytest.fixture(scope="module")
def memory():
    return run_distributed(measure_all, 2, timeout=400)  # per rank


def _total(figures: dict, *, without_master: bool = False) -> float:
    total = sum(figures[f"memory/{what}_bytes"] for what in ("params", "grads", "optimizer"))
    return total - (figures.get("memory/optimizer_master_bytes", 0) if without_master else 0)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_strategies_hold_about_half_of_ddp_per_rank(memory, rank):
    figures = memory[rank]
    ddp_ = figures["ddp"]
    params_bytes = ddp_["memory/params_bytes"]  # fp32: 4 bytes x P, replicated
    assert ddp_["memory/grads_bytes"] == pytest.approx(params_bytes, rel=0.01)
    assert ddp_["memory/optimizer_bytes"] == pytest.approx(2 * params_bytes, rel=0.01)  # Adam m, v
    assert _total(figures["fsdp"]) <= 0.55 * _total(ddp_)
    # DeepSpeed keeps an fp32 master partition even in fp32 training, which DDP does not hold
    # at all (4P/N on top: ZeRO-3 at N=2 is 10P against DDP's 16P). What sharding saves is
    # compared without it, and the master copy itself must be 1/N of the parameters.
    for kind in ("zero1", "zero2", "zero3"):
        master = figures[kind]["memory/optimizer_master_bytes"]
        assert 0 < master <= 0.55 * params_bytes, kind
    optimizer_state = {k: figures[k]["memory/optimizer_bytes"] - figures[k]["memory/optimizer_master_bytes"]
                       for k in ("zero1", "zero2")}
    assert optimizer_state["zero1"] <= 0.55 * ddp_["memory/optimizer_bytes"]
    assert figures["zero2"]["memory/grads_bytes"] <= 0.55 * ddp_["memory/grads_bytes"]
    assert _total(figures["zero3"], without_master=True) <= 0.55 * _total(ddp_)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_estimates_follow_the_zero_paper(memory):
    figures = memory[0]
    params = figures["ddp"]["memory/estimate_params_bytes"]
    assert figures["ddp"]["memory/estimate_optimizer_bytes"] == 2 * params  # K=8 in fp32
    assert figures["fsdp"]["memory/estimate_params_bytes"] == params / 2
    zero1, zero2 = figures["zero1"], figures["zero2"]
    assert zero1["memory/estimate_optimizer_bytes"] == 3 * params / 2  # (8 + 4 master) P / N
    assert zero1["memory/estimate_grads_bytes"] == params
    assert zero2["memory/estimate_grads_bytes"] == params / 2
    for kind in KINDS:
        for what in ("params", "grads", "optimizer"):
            if (kind, what) == ("zero1", "grads"):
                # DeepSpeed's stage 1 holds whole gradients only during backward; by the step it
                # has reduced them into its partition (less than the paper's 2P, never more).
                assert figures[kind]["memory/grads_bytes"] <= figures[kind]["memory/estimate_grads_bytes"]
                continue
            measured, estimate = figures[kind][f"memory/{what}_bytes"], figures[kind][f"memory/estimate_{what}_bytes"]
            assert measured == pytest.approx(estimate, rel=0.1), (kind, what)


def test_estimate_bytes_matches_paper_constants_for_mixed_precision_adam():
    from litscale.callbacks.memory import estimate_bytes

    p, n = 1000, 4
    for stage, expected in {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}.items():
        figures = estimate_bytes(num_params=p, world_size=n, zero_stage=stage, param_bytes=2,
                                 optimizer_bytes_per_param=12)
        assert sum(figures.values()) == expected, stage


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_model_parallel_estimates_are_the_share_each_rank_holds(memory):
    """Tensor parallel and a pipeline split the model over the mesh before any data sharding:
    each rank holds about half of it, as the estimate (the planner's formula) says, and the
    pipeline's two stages together hold the whole model exactly."""
    for rank in (0, 1):
        for kind in MODEL_PARALLEL:
            figures = memory[rank][kind]
            for what in ("params", "grads", "optimizer"):
                # TP replicates the norms (and sums their gradients), a pipeline's stages differ by
                # a block's share: within 10% of the even split
                assert figures[f"memory/{what}_bytes"] == pytest.approx(
                    figures[f"memory/estimate_{what}_bytes"], rel=0.1), (rank, kind, what)
    whole = memory[0]["ddp"]["memory/params_bytes"]
    assert memory[0]["pp2"]["memory/params_bytes"] + memory[1]["pp2"]["memory/params_bytes"] == whole
    assert memory[0]["pp2"]["memory/estimate_params_bytes"] == whole / 2


def test_the_planner_and_the_memory_callback_read_one_statement_of_each_strategy():
    """What a strategy states of itself (``sharding``) is what the planner costs: the planner's
    states at rest for each strategy equal the estimate the memory callback makes for the
    same strategy object on the same mesh."""
    from litscale.parallel.contract import StrategyContract
    from litscale.parallel.layout import MeshSizes
    from litscale.parallel.sharding import state_bytes_per_rank
    from litscale.planner.plan import Plan
    from litscale.strategies import (
        DDPStrategy,
        FSDPStrategy,
        PipelineParallelStrategy,
        TensorParallelStrategy,
    )
    from litscale.strategies.deepspeed_zero import zero_sharding

    built = {"ddp": DDPStrategy(), "fsdp": FSDPStrategy(), "tensor_parallel": TensorParallelStrategy(),
             "pipeline": PipelineParallelStrategy()}
    for name, strategy in built.items():
        assert isinstance(strategy, StrategyContract) and Plan(name, MeshSizes(), 1, 1).sharding == strategy.sharding, name
    assert Plan("deepspeed_zero", MeshSizes(), 1, 1, options={"stage": 2}).sharding == zero_sharding(2)
    assert (built["tensor_parallel"].sharding.zero_stage, built["pipeline"].sharding.peak_stage) == (3, 2)
    mesh = MeshSizes(pipeline=2, data_shard=2, tensor=2)
    states = state_bytes_per_rank(num_params=8000, mesh=mesh, sharding=built["pipeline"].sharding,
                                  param_bytes=4, optimizer_bytes_per_param=8)
    assert states["memory/estimate_params_bytes"] == 4 * 8000 / 4 / 2  # its quarter, sharded over 2 between steps
    peak = state_bytes_per_rank(num_params=8000, mesh=mesh, sharding=built["pipeline"].sharding, param_bytes=4,
                                optimizer_bytes_per_param=8, at_peak=True)
    assert peak["memory/estimate_params_bytes"] == 4 * 8000 / 4  # gathered through the step
