"""The planner asks the strategies (``litscale.parallel.contract``) instead of restating them: the layouts
are each strategy's ``candidate_meshes``, every plan it keeps is one its strategy builds and
validates on the model's meta-device network, every plan a strategy refuses is pruned with
that strategy's own line, a strategy whose package is missing is never recommended, and a
strategy registered anywhere is planned without a table of names."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hydra.utils import get_class
from omegaconf import OmegaConf

from litscale.models import gpt, llama, moe, moe_config
from litscale.parallel.layout import MeshSizes
from litscale.planner.cluster import Cluster, Link
from litscale.planner.cost import Plan
from litscale.planner.model_facts import (
    ModelFacts,
    context_parallel_kv_width,
    model_facts,
    moe_facts,
)
from litscale.planner.search import plans, search, why_not
from litscale.planner.strategies import Refusals, plannable, registered

SEQ, VOCAB = 64, 256
LINK = Link(bandwidth_bytes_s=100e9, latency_s=1e-5)
FAMILIES = {"gpt": (gpt.build_gpt, gpt.PRESETS), "llama": (llama.build_llama, llama.PRESETS),
            "moe": (moe.build_moe, moe_config.PRESETS)}
PRESETS = [(family, preset) for family, (_, presets) in FAMILIES.items() for preset in presets]
TINY = [("gpt", "nano"), ("llama", "tiny"), ("moe", "tiny")]


def cluster_of(world: int, *, per_node: int = 8, memory: float = 2.0**50) -> Cluster:
    nodes = world // per_node if world > per_node and world % per_node == 0 else 1
    return Cluster(name="test", nodes=nodes, devices_per_node=world // nodes, device_memory_bytes=memory,
                   peak_flops={"float32": 100e12}, intra_node=LINK, inter_node=LINK)


def layout_facts(family: str, preset: str, **overrides) -> ModelFacts:
    """What the search reads of a preset to enumerate and prune its plans (its network on the
    meta device, its attention and experts), without tracing its activations, which only the
    costing of a plan needs."""
    build, _ = FAMILIES[family]
    with torch.device("meta"):
        net = build(preset=preset, vocab_size=VOCAB, block_size=SEQ, **overrides)
    return ModelFacts(num_params=0, flops_per_token=0.0, seq_len=SEQ, layers=1, hidden=0, heads=0,
                      activation_bytes_per_sample=0.0, kv_width=context_parallel_kv_width(net), moe=moe_facts(net),
                      net=net)


@functools.cache
def strategy_from_its_option_file(name: str) -> type:
    """The class ``strategy=<name>`` instantiates (``conf/strategy/<name>.yaml``)."""
    from helpers.configs import CONF_DIR

    return get_class(OmegaConf.load(CONF_DIR / "strategy" / f"{name}.yaml")._target_)


def check_against_the_strategies(facts: ModelFacts, worlds) -> int:
    """Every plan of ``facts`` at each world: kept exactly when its strategy, built as its option
    file builds it, takes it on the plan's mesh; pruned with the strategy's line otherwise."""
    from litscale.parallel.contract import missing_requirement

    answers: dict[tuple, str | None] = {}
    checked = 0
    for world in worlds:
        cluster, global_batch = cluster_of(world), 4 * world
        refusals = Refusals(facts.net, facts.seq_len)
        for plan in plans(cluster, facts, global_batch):
            reason = why_not(plan, cluster, facts, global_batch, refusals)
            if plan.micro_batch == 0 or plan.mesh.tensor > cluster.devices_per_node:
                assert reason is not None, plan.describe()  # the planner's own reasons: batch and nodes
                continue
            options = plan.strategy_options()
            key = (plan.strategy, tuple(sorted(options.items())), world, plan.micro_batch)
            if key not in answers:
                cls = strategy_from_its_option_file(plan.strategy)
                answers[key] = missing_requirement(cls, plan.strategy)
                try:
                    strategy = cls(**options)
                    strategy.validate_setup(world_size=world, net=facts.net, seq_len=SEQ, micro_batch=plan.micro_batch)
                    assert strategy.resolve_mesh(world) == plan.mesh, (plan.describe(), options)
                except ValueError as error:
                    answers[key] = answers[key] or str(error).splitlines()[0]
            assert reason == answers[key], (plan.describe(), options)
            checked += 1
    return checked


@pytest.mark.slow  # about 1,800 plans checked twice: seconds on 2 shared cores
def test_the_search_keeps_what_the_tiny_presets_strategies_take_and_prunes_with_their_lines():
    """GPT-nano, Llama-tiny and the tiny MoE at 1 to 8 ranks: every layout of every plannable
    strategy (with the heads, key/value heads, width and vocabulary TP splits, the blocks a
    pipeline cuts, the experts EP splits, the sequence CP splits), against the strategies."""
    for family, preset in TINY:
        assert check_against_the_strategies(layout_facts(family, preset), range(1, 9)) > 100, preset


LARGE_PRESETS = {"medium", "llama3_8b", "qwen3_8b", "qwen3_30b_a3b", "deepseek_v3_like"}


@pytest.mark.full  # every preset of the zoo on the meta device, up to 64 ranks: 5-100 s each
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("family", "preset"), [
    # The presets of 8B parameters and more (15-45 s each; DeepSeek-V3-like about 160 s: 256
    # experts on the meta device at every size) in make test-soak, beyond CI's time.
    pytest.param(f, p, marks=[pytest.mark.soak] if p in LARGE_PRESETS else [], id=f"{f}-{p}") for f, p in PRESETS])
def test_every_preset_is_planned_as_its_strategies_take_it_at_1_to_64_ranks(family, preset):
    check_against_the_strategies(layout_facts(family, preset), (1, 2, 3, 4, 6, 8, 12, 16, 64))


@pytest.mark.slow
def test_a_tensor_parallel_size_the_key_value_heads_do_not_split_is_never_ranked():
    """Llama-tiny's 4 query heads split over 4 ranks, its 2 key/value heads do not: the strategy
    refuses TP 4, so the search ranks no such plan and says why in the strategy's words."""
    with torch.device("meta"):
        net = llama.build_llama(preset="tiny", vocab_size=VOCAB, block_size=SEQ, n_kv_heads=2)
    facts = model_facts(net, seq_len=SEQ, vocab_size=VOCAB)
    ranked, pruned = search(cluster_of(4), facts, 8)
    assert ranked and all(p.plan.mesh.tensor < 4 for p in ranked)
    assert "strategy.tensor_parallel_size=4 does not divide model.net.n_kv_heads=2; allowed: a divisor of 2" in {
        p.reason for p in pruned if p.plan.mesh.tensor == 4}


@pytest.mark.slow
def test_a_strategy_whose_package_is_missing_is_pruned_with_the_pip_install_line(monkeypatch):
    """Without DeepSpeed installed, ``plan=show strategy=ddp trainer.devices=2`` must not
    recommend ``strategy=deepspeed_zero``: its runs would fail once the ranks import it."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a))
    from litscale.app.plan.ranking import overrides

    with torch.device("meta"):
        facts = model_facts(gpt.build_gpt(vocab_size=VOCAB, block_size=SEQ), seq_len=SEQ, vocab_size=VOCAB)
    cluster = cluster_of(2, memory=16 * 2**30)
    ranked, pruned = search(cluster, facts, 32)
    assert ranked and all(p.plan.strategy != "deepspeed_zero" for p in ranked)
    assert "strategy=deepspeed_zero" not in overrides(ranked[0].plan, cluster)
    assert {p.reason for p in pruned if p.plan.strategy == "deepspeed_zero"} == {
        "strategy=deepspeed_zero needs the deepspeed package, which is not installed; install it with: "
        "pip install 'litscale[extras]'"}


@pytest.mark.slow
def test_the_planner_plans_any_registered_strategy_from_its_own_candidate_meshes_and_sharding():
    """A strategy registered under a ``litscale_`` name is planned with no table of names: its
    layouts from its ``candidate_meshes``, its memory from its instance's ``sharding``, its
    command line from its options; one that is not ``plannable`` is not."""
    from lightning.pytorch.strategies import StrategyRegistry

    from litscale.app.plan.ranking import overrides
    from litscale.parallel.sharding import Sharding
    from litscale.strategies import DDPStrategy

    class ShardedStateDDP(DDPStrategy):  # as if its optimizer state were sharded (ZeRO-1)
        sharding = Sharding(zero_stage=1)

        @classmethod
        def candidate_meshes(cls, *, world_size, nodes, devices_per_node, context_sizes):
            return [({"bucket_cap_mb": 50.0}, MeshSizes(data_shard=world_size))]

        def resolve_mesh(self, world_size):
            return MeshSizes(data_shard=world_size)

    assert {"single", "ddp", "fsdp", "deepspeed_zero", "tensor_parallel", "pipeline"} <= set(registered())
    assert not {"local_sgd", "federated"} & set(plannable())
    StrategyRegistry.register("litscale_sharded_state", ShardedStateDDP)
    try:
        with torch.device("meta"):
            facts = model_facts(gpt.build_gpt(vocab_size=VOCAB, block_size=SEQ), seq_len=SEQ, vocab_size=VOCAB)
        cluster = cluster_of(2, memory=16 * 2**30)
        ranked, _ = search(cluster, facts, 8)
        mine = next(p for p in ranked if p.plan.strategy == "sharded_state")
        ddp = next(p for p in ranked if p.plan.strategy == "ddp" and p.plan.micro_batch == mine.plan.micro_batch)
        assert mine.memory["optimizer"] == pytest.approx(ddp.memory["optimizer"] / 2)
        assert overrides(mine.plan, cluster)[:2] == ["strategy=sharded_state", "strategy.bucket_cap_mb=50.0"]
    finally:
        StrategyRegistry.remove("litscale_sharded_state")


def test_a_plans_sharding_is_its_strategy_instances_with_the_plans_options():
    from litscale.parallel.sharding import fsdp2_sharding
    from litscale.strategies.deepspeed_zero import zero_sharding

    mesh = MeshSizes(data_shard=4)
    assert Plan("deepspeed_zero", mesh, 1, 1, options={"stage": 1}).sharding == zero_sharding(1)
    assert Plan("fsdp", mesh, 1, 1, options={"reshard_after_forward": False}).sharding == \
        fsdp2_sharding(reshard_after_forward=False)
    assert Plan("deepspeed_zero", mesh, 1, 1, options={"stage": 3}).describe().startswith("deepspeed_zero stage=3 pp1")


def test_pipeline_micro_batches_are_the_plans_one_rule():
    plan = Plan("pipeline", MeshSizes(pipeline=2), micro_batch=8, accumulation=3, microbatches=4)
    assert (plan.pipeline_micro_batch, plan.forward_backwards) == (2, 12)
    assert dataclasses.replace(plan, microbatches=1).pipeline_micro_batch == 8
