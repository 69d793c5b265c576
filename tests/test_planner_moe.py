"""The planner's mixture-of-experts costs (``planner/moe_cost.py``): the facts read off the MoE
decoder against torch's FLOP counter and counts by hand, memory per rank and all-to-all bytes
against their formulas written out here, the search's expert-parallel sizes against the
strategies' own validation, and ``plan=show`` for Qwen3-30B-A3B at 64 devices. The bytes of a
real expert-parallel step are in ``test_planner_collectives.py``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from litscale.models.moe import build_moe
from litscale.parallel.layout import MeshSizes
from litscale.planner.cluster import Cluster, Link
from litscale.planner.cost import Plan, collectives, memory_per_rank, predict
from litscale.planner.model_facts import ModelFacts, MoEFacts, model_facts
from litscale.planner.search import search

LINK = Link(bandwidth_bytes_s=100e9, latency_s=1e-5)
CLUSTER = Cluster(name="test", nodes=2, devices_per_node=4, device_memory_bytes=16 * 2**30,
                  peak_flops={"float32": 100e12, "bfloat16": 200e12}, intra_node=LINK,
                  inter_node=Link(bandwidth_bytes_s=10e9, latency_s=1e-5), allocator_overhead=0.0)
SEQ, VOCAB = 32, 256


def _tiny_facts(**overrides) -> tuple[torch.nn.Module, ModelFacts]:
    torch.manual_seed(0)
    net = build_moe(vocab_size=VOCAB, block_size=SEQ, **overrides)
    with torch.device("meta"):
        facts = model_facts(build_moe(vocab_size=VOCAB, block_size=SEQ, **overrides), seq_len=SEQ, vocab_size=VOCAB)
    return net, facts


@pytest.mark.slow
def test_moe_facts_count_the_active_experts_as_torchs_flop_counter_does():
    """The tiny preset (a dense layer, 2 MoE layers of 8 SwiGLU experts, top-2, a shared
    expert): FLOPs per token of the whole step and of its MoE layers as torch counts a real
    forward-backward; the experts' parameters by hand."""
    net, facts = _tiny_facts()
    c, moe = net.config, facts.moe
    assert (moe.layers, moe.n_experts, moe.top_k, facts.hidden) == (2, 8, 2, 64)
    one_expert = 3 * c.n_embd * c.moe_ffn_hidden_size  # gate, up and down projections
    assert moe.expert_params == 2 * 8 * one_expert
    assert moe.active_params == facts.num_params - 2 * (8 - 2) * one_expert == net.num_active_params()
    tokens = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        net(tokens).float().sum().backward()
    assert facts.flops_per_token * 2 * SEQ == counter.get_total_flops()
    counts = counter.get_flop_counts()
    in_moe_layers = sum(sum(counts[f"MoEDecoder.layers.{i}.mlp"].values()) for i in c.moe_layers)
    assert moe.layer_flops_per_token * 2 * SEQ == in_moe_layers


# Made-up round numbers: 10,000 parameters, 8,400 in the MoE layers, 8,000 of them routed experts.
FACTS = ModelFacts(num_params=10_000, flops_per_token=60_000.0, seq_len=16, layers=4, hidden=8, heads=4,
                   activation_bytes_per_sample=0.0,
                   moe=MoEFacts(layers=2, n_experts=8, top_k=2, expert_params=8_000, layer_params=8_400,
                                layer_flops_per_token=6 * (8_400 - 6_000), active_params=4_000))


@pytest.mark.parametrize(("strategy", "mesh", "held"), [
    # FSDP over 8 ranks, EP 4: the rest over 8, each EP rank's 2,000 experts over 8 / 4 = 2
    ("fsdp", MeshSizes(data_shard=8, expert=4), (10_000 - 8_400) / 8 + 400 / 8 + 8_000 / 4 / 2),
    # HSDP 2 x 4, EP 2: the rest over the 4 shards, the experts over all 8 / 2 expert-data ranks
    ("fsdp", MeshSizes(data_replicate=2, data_shard=4, expert=2), 1_600 / 4 + 400 / 4 + 8_000 / 2 / 4),
    # TP 2 x data 4, EP 2: tensor parallel splits the dense 1,600 only; the MoE layers stay whole
    ("tensor_parallel", MeshSizes(data_shard=4, tensor=2, expert=2), 1_600 / 2 / 4 + 400 / 4 + 8_000 / 2 / 2),
    ("tensor_parallel", MeshSizes(data_shard=4, tensor=2), 1_600 / 2 / 4 + 8_400 / 4),  # no EP
], ids=["fsdp8-ep4", "hsdp2x4-ep2", "dp4-tp2-ep2", "dp4-tp2"])
def test_memory_per_rank_shards_the_experts_over_expert_and_expert_data_ranks(strategy, mesh, held):
    """fp32 AdamW, FSDP2 (ZeRO-3: everything sharded): 4 bytes of parameter, 4 of gradient and
    8 of optimizer state for each parameter a rank holds."""
    memory = memory_per_rank(Plan(strategy, mesh, micro_batch=1, accumulation=1), FACTS, CLUSTER)
    assert (memory["params"], memory["grads"], memory["optimizer"]) == pytest.approx((4 * held, 4 * held, 8 * held))


def test_all_to_all_bytes_are_tokens_top_k_width_and_the_peers_share_times_the_imbalance():
    """Tensor parallel 2 x data 4 with EP 4, bf16, micro batch 2 in 3 accumulation steps,
    activation checkpointing (the forward runs twice): per layer and micro batch, 2 x 2
    exchanges in forward and 2 in backward, each sending 3/4 of 2 x 16 tokens x top-2 x width 8
    x 2 bytes; then the same with a stated imbalance of 1.5, and with one measured from a run's
    tokens per expert (EP 4's blocks of 2 experts: 4, 4, 2, 6 -> 6 over a mean of 4)."""
    plan = Plan("tensor_parallel", MeshSizes(data_shard=4, tensor=2, expert=4), micro_batch=2, accumulation=3,
                activation_checkpointing=True, compute_dtype="bfloat16")
    rows = 2 * 16 * 2 * 8 * 2
    found = {c.name: c for c in collectives(plan, FACTS, CLUSTER)}
    assert found["expert-parallel all-to-all"].calls == 3 * 2 * 6
    assert found["expert-parallel all-to-all"].bytes_per_rank == pytest.approx(3 * 2 * 6 * rows * 3 / 4)
    assert found["expert-parallel count exchange"].bytes_per_rank == pytest.approx(3 * 2 * 2 * 8 * 8 * 3 / 4)
    # EP 4 of 8 ranks, 2 apart (tensor innermost), on nodes of 4: this rank and 1 peer on its node,
    # 2 on the other; the rows for the one over NVLink while the others' cross nodes
    intra = 36 * 1 * 1e-5 + 3 * 2 * 6 * rows / 4 / 100e9
    inter = 36 * 2 * 1e-5 + 3 * 2 * 6 * rows * 2 / 4 / 10e9
    assert found["expert-parallel all-to-all"].seconds == pytest.approx(max(intra, inter))
    stated = dataclasses.replace(FACTS, moe=dataclasses.replace(FACTS.moe, load_imbalance=1.5))
    measured = dataclasses.replace(FACTS, moe=dataclasses.replace(
        FACTS.moe, tokens_per_expert=((4, 0, 2, 2, 1, 1, 3, 3), (4, 0, 2, 2, 1, 1, 3, 3))))
    for facts in (stated, measured):
        found = {c.name: c for c in collectives(plan, facts, CLUSTER)}
        assert found["expert-parallel all-to-all"].bytes_per_rank == pytest.approx(3 * 2 * 6 * rows * 3 / 4 * 1.5)
    assert measured.moe.imbalance(2) == 1.0  # blocks of 4: 8 and 8


def test_the_moe_layers_flops_and_optimizer_step_are_not_divided_by_tensor_parallel():
    """Compute from FLOPs: the dense 60,000 - 14,400 per token split over 2 tensor-parallel
    ranks, the MoE layers' 14,400 whole on each."""
    plan = Plan("tensor_parallel", MeshSizes(data_shard=4, tensor=2), micro_batch=2, accumulation=1)
    flops = ((60_000 - 14_400) / 2 + 14_400) * 2 * 16
    assert predict(plan, FACTS, CLUSTER).compute_s == pytest.approx(flops / CLUSTER.flops("float32"))
    # AdamW steps the parameters whose state the rank holds: the dense 1,600 over 2 x 4, the MoE
    # layers' 8,400 over the 4 data ranks.
    cluster = dataclasses.replace(CLUSTER, optimizer_s_per_param=1e-9)
    assert predict(plan, FACTS, cluster).optimizer_s == pytest.approx((1_600 / 2 / 4 + 8_400 / 4) * 1e-9)


@pytest.mark.slow
def test_the_search_offers_the_expert_parallel_sizes_the_strategies_accept():
    """Every ranked plan with EP is one the strategy itself lays out and validates on the tiny
    decoder (with 6 experts); the sizes it refuses (4 does not divide them) are pruned with its
    own line."""
    from litscale.app.plan.ranking import overrides
    from litscale.strategies import FSDPStrategy, TensorParallelStrategy

    net, facts = _tiny_facts(n_experts=6)
    cluster = dataclasses.replace(CLUSTER, nodes=1, devices_per_node=4)
    ranked, pruned = search(cluster, facts, 8)
    with_experts = [p.plan for p in ranked if p.plan.mesh.expert > 1]
    assert {plan.strategy for plan in with_experts} == {"fsdp", "tensor_parallel"}
    for plan in with_experts:
        mesh = plan.mesh
        strategy = FSDPStrategy(expert_parallel_size=mesh.expert, context_parallel_size=mesh.context) \
            if plan.strategy == "fsdp" else TensorParallelStrategy(
                tensor_parallel_size=mesh.tensor, context_parallel_size=mesh.context, expert_parallel_size=mesh.expert)
        strategy.validate_setup(world_size=4, net=net)
        assert strategy.resolve_mesh(4) == mesh, plan.describe()
        assert f"ep{mesh.expert}" in plan.describe().split()
        assert f"strategy.expert_parallel_size={mesh.expert}" in overrides(plan, cluster)
    reasons = {p.reason for p in pruned if p.plan.mesh.expert > 1}
    assert {p.reason for p in pruned if p.plan.options.get("stage") == 3} == {  # the strategy's own line
        "model=moe is not supported with strategy=deepspeed_zero strategy.stage=3: DeepSpeed's ZeRO-3 does not "
        "train a mixture of experts yet (its backward reads an expert weight the engine has released: \"The size "
        "of tensor a (0) must match the size of tensor b (64)\"); allowed: strategy=fsdp, tensor_parallel or "
        "deepspeed_zero stage 1 or 2"}
    assert ("strategy.expert_parallel_size=4 does not divide model.net.n_experts=6; allowed: a divisor of 6"
            in reasons)


@pytest.mark.soak
@pytest.mark.slow  # over a second alone: out of the quick loop
def test_plan_show_ranks_expert_parallel_plans_for_qwen3_moe_at_64_devices(tmp_path, outputs_root, capsys):
    """Qwen3-30B-A3B on 8 nodes of 8 H100s, no process started: the run as configured (FSDP with
    EP 8) built on a fake process group, and EP plans among those ranked."""
    from helpers.configs import compose_job

    from litscale.app.run import train

    cfg, choices = compose_job(["plan=show", "model=moe", "model.net.preset=qwen3_30b_a3b", "cluster=h100_8x",
                                "trainer.num_nodes=8", "trainer.devices=8", "precision=bf16_mixed",
                                "strategy=fsdp", "strategy.expert_parallel_size=8", "plan.top=40"], tmp_path)
    train(cfg, choices=choices)
    out = capsys.readouterr().out
    ranked = [line for line in out.splitlines() if line[:1].isdigit()]
    assert any(" ep" in line for line in ranked), out
    assert "litscale: as configured: fsdp pp1 dp64 tp1 ep8 mb16 acc1: " in out
    assert "litscale: as configured: built on a fake process group of 64 ranks" in out


@pytest.mark.slow
@pytest.mark.full
def test_a_runs_tokens_per_expert_set_the_imbalance(tmp_path):
    from helpers.configs import compose_job, described

    from litscale.app.plan.ranking import facts_of
    from litscale.errors import ConfigError

    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"moe/tokens_per_expert": [[6, 2, 4, 4, 4, 4, 4, 4]] * 2}))
    run = described(*compose_job(["plan=show", "model=moe", f"plan.moe_load_from={summary}"], tmp_path / "run"))
    assert facts_of(run).moe.imbalance(4) == 1.0 and facts_of(run).moe.imbalance(8) == 6 / 4
    summary.write_text(json.dumps({"moe/tokens_per_expert": [[1, 2]]}))
    with pytest.raises(ConfigError, match=r"^plan.moe_load_from=.* has no moe/tokens_per_expert of 8 experts"):
        facts_of(run)


@pytest.mark.slow
def test_a_pipeline_of_more_stages_than_layers_is_costed_by_its_blocks():
    """The tiny decoder's 3 layers and 5 blocks (embedding, layers, head) over 2 ranks of 2
    interleaved stages: 4 stages of 2, 1, 1 and 1 blocks (in some order), a rank holding two
    of them, 3 of the 5 blocks at most."""
    from litscale.planner.cost import busiest_pipeline_share

    _, facts = _tiny_facts()
    assert (facts.layers, facts.pipeline_blocks) == (3, 5)
    plan = Plan("pipeline", MeshSizes(pipeline=2), micro_batch=4, accumulation=1, microbatches=2,
                schedule="interleaved_1f1b", virtual_stages=2)
    assert busiest_pipeline_share(plan, facts) == 3 / 5
