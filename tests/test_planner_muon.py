"""The planner with Muon: its Newton-Schulz time (FLOPs counted by ``torch.utils.flop_counter``
on the iteration itself), the sharded matrices' update gathers, and a strategy that refuses the
run's Muon settings never ranked (DeepSpeed's ZeRO Muon with gradient clipping)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.configs import compose_job, described
from torch.utils.flop_counter import FlopCounterMode

from litscale.app.checks.contract import chosen_options, run_settings
from litscale.app.plan.runs import facts_of
from litscale.optim.muon import MATRIX, newton_schulz, newton_schulz_flops, parameter_roles
from litscale.parallel.layout import MeshSizes
from litscale.planner.cluster import Cluster
from litscale.planner.cost import predict
from litscale.planner.plan import Plan
from litscale.planner.strategies import Refusals

SMALL = ["data=synthetic", "data.seq_len=32", "trainer.accelerator=cpu", "strategy=ddp", "trainer.devices=2"]


def counted_flops(shapes) -> float:
    """What ``torch.utils.flop_counter`` counts when ``newton_schulz`` runs on these shapes."""
    with FlopCounterMode(display=False) as counter:
        for shape in shapes:
            newton_schulz(torch.zeros(shape, device="meta"), 5, torch.float32)
    return counter.get_total_flops()


@pytest.mark.parametrize("shapes", [[(32, 128)], [(128, 32)], [(64, 64)], [(4, 16, 32)], [(96, 32), (32, 96), (8, 8)]])
def test_the_iterations_flops_are_what_torchs_flop_counter_counts(shapes):
    assert newton_schulz_flops([torch.Size(s) for s in shapes]) == counted_flops(shapes)


def _facts(tmp_path, *overrides):
    cfg, choices = compose_job([*SMALL, *overrides], tmp_path / "run")
    return cfg, choices, facts_of(described(cfg, choices))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["model=gpt", "model=moe"])
def test_the_facts_count_every_hidden_matrix_of_the_model(model, tmp_path):
    _, _, facts = _facts(tmp_path, model, "optimizer=muon")
    matrices = [p for group in parameter_roles(facts.net, 0.0) if group["role"] == MATRIX for p in group["params"]]
    assert facts.matrix_params == sum(p.numel() for p in matrices) > 0
    assert facts.matrix_tensors == len(matrices)
    assert facts.newton_schulz_flops == counted_flops([p.shape for p in matrices])
    _, _, adamw = _facts(tmp_path, model, "optimizer=adamw")
    assert (adamw.matrix_params, adamw.newton_schulz_flops) == (0, 0.0)


def _cluster(cfg) -> Cluster:
    from litscale.app.build import build, trusted_targets

    return build(cfg.cluster, trusted=trusted_targets(cfg))


@pytest.mark.slow
def test_muon_adds_its_iterations_to_the_step_and_gathers_what_fsdp_shards(tmp_path):
    cfg, _, muon = _facts(tmp_path, "optimizer=muon")
    _, _, adamw = _facts(tmp_path, "optimizer=adamw")
    adamw = dataclasses.replace(adamw, optimizer_state_bytes_per_param=muon.optimizer_state_bytes_per_param)
    cluster = _cluster(cfg)
    iteration_s = muon.newton_schulz_flops * cluster.contention / cluster.flops("float32")
    fsdp = Plan("fsdp", MeshSizes(data_shard=2), micro_batch=4, accumulation=1, options={})
    with_muon, without = predict(fsdp, muon, cluster), predict(fsdp, adamw, cluster)
    # FSDP: every rank orthogonalises every matrix, gathered whole.
    assert with_muon.optimizer_s - without.optimizer_s == pytest.approx(iteration_s, rel=1e-9)
    [gather] = [c for c in with_muon.collectives if c.name == "Muon update all-gather"]
    assert gather.bytes_per_rank == muon.matrix_params * 4 / 2
    assert gather.calls == muon.matrix_tensors
    assert not [c for c in without.collectives if c.name.startswith("Muon")]
    # ZeRO-2 (DeepSpeed's ZeRO Muon): a rank orthogonalises the matrices of its partition, gathers none.
    zero = Plan("deepspeed_zero", MeshSizes(data_shard=2), micro_batch=4, accumulation=1, options={"stage": 2})
    with_muon, without = predict(zero, muon, cluster), predict(zero, adamw, cluster)
    assert with_muon.optimizer_s - without.optimizer_s == pytest.approx(iteration_s / 2, rel=1e-9)
    assert not [c for c in with_muon.collectives if c.name.startswith("Muon")]


@pytest.mark.slow
@pytest.mark.parametrize(("clipping", "refused"), [([], True), (["trainer.gradient_clip_val=null"], False)])
def test_the_planner_never_ranks_a_strategy_that_refuses_the_runs_muon_settings(clipping, refused, tmp_path):
    _, _, facts = _facts(tmp_path, "optimizer=muon", *clipping)  # the model's (validation refuses the run below)
    cfg, choices = compose_job([*SMALL, "optimizer=muon", "strategy=deepspeed_zero", *clipping], tmp_path / "zero")
    refusals = Refusals(facts.net, facts.seq_len, run_options=chosen_options(cfg, choices), settings=run_settings(cfg))
    reason = refusals("deepspeed_zero", {"stage": 2}, mesh=MeshSizes(data_shard=2), micro_batch=4)
    if refused:
        assert reason == ("trainer.gradient_clip_val=1.0 is not supported with optimizer=muon under "
                          "strategy=deepspeed_zero: DeepSpeed's ZeRO Muon clips by the norm of its orthogonalised "
                          "updates, not of the gradients one process clips; allowed: trainer.gradient_clip_val=null")
    else:
        assert reason is None
    assert refusals("deepspeed_zero", {"stage": 3}, mesh=MeshSizes(data_shard=2), micro_batch=4).startswith(
        "optimizer=muon is not supported with strategy=deepspeed_zero: ")
    assert refusals("fsdp", {}, mesh=MeshSizes(data_shard=2), micro_batch=4) is None
