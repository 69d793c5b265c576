"""The planner against published runs (``experiments/planner/anchors.py``): the anchors' table in
the planner's README and ``simulation.json`` is what the cost model predicts now, every row is
within 20% of its published tokens/s per GPU or names a cause that a published figure measures,
and the terms the table needed (float8's casts, the experts' grouped matmuls by size, an
all-to-all across nodes, a published framework's memory) against their formulas written out here."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math
from pathlib import Path

import pytest

from litscale.parallel.layout import MeshSizes
from litscale.parallel.sharding import Sharding
from litscale.planner.cluster import Cluster, Link
from litscale.planner.cost import collectives, rank_params, tensor_parallel_whole_bytes
from litscale.planner.float8_cost import float8_cast_s
from litscale.planner.model_facts import ModelFacts, MoEFacts
from litscale.planner.moe_cost import grouped_fraction, remote_nodes_per_token
from litscale.planner.plan import Framework, Plan

REPO = Path(__file__).resolve().parents[1]
PLANNER = REPO / "experiments" / "planner"
# experiments/planner/anchors.py, under a name of its own (the folder is no package)
_spec = importlib.util.spec_from_file_location("planner_anchors", PLANNER / "anchors.py")
anchors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(anchors)

LINK = Link(bandwidth_bytes_s=100e9, latency_s=1e-5)
CLUSTER = Cluster(name="test", nodes=2, devices_per_node=4, device_memory_bytes=16 * 2**30,
                  peak_flops={"float32": 100e12, "bfloat16": 200e12, "float8": 400e12}, intra_node=LINK,
                  inter_node=Link(bandwidth_bytes_s=10e9, latency_s=1e-5), allocator_overhead=0.0,
                  memory_bandwidth_bytes_s=1e9, memory_bandwidth_fraction=0.5)
# Made-up round numbers: 10,000 parameters, 8,400 in 2 MoE layers, 8,000 of them 8 routed experts
# (500 each per layer), top 2; 16 tokens of width 8.
FACTS = ModelFacts(num_params=10_000, flops_per_token=60_000.0, seq_len=16, layers=4, hidden=8, heads=4,
                   activation_bytes_per_sample=0.0,
                   moe=MoEFacts(layers=2, n_experts=8, top_k=2, expert_params=8_000, layer_params=8_400,
                                layer_flops_per_token=6 * (8_400 - 6_000), active_params=4_000))


@pytest.fixture(scope="module")
def table() -> tuple[dict, list[dict]]:
    """Every row predicted again by the cost model as it is now, from the facts ``simulate.py``
    traced (a trace of the 405B model takes minutes; the tracer is checked on GPT-2 small below)."""
    data = anchors.load()
    recorded = json.loads(anchors.FACTS_FILE.read_text())
    facts = {name: anchors.recorded_facts(spec, recorded[name]) for name, spec in data["models"].items()}
    stale = sorted(name for name, found in facts.items() if found is None)
    assert not stale, f"{stale}: configs changed since anchors_facts.json: rerun python experiments/planner/simulate.py"
    return data, anchors.predict_all(data, facts)


@pytest.mark.slow  # builds every anchor's model on the meta device (405B included): seconds each
def test_the_anchors_table_is_what_the_cost_model_predicts_now(table):
    """``python experiments/planner/simulate.py`` regenerates both; nothing in them is typed in."""
    data, rows = table
    assert anchors.report(data, rows) in (PLANNER / "README.md").read_text()
    assert json.loads((PLANNER / "simulation.json").read_text())["anchors"] == json.loads(json.dumps(rows))


@pytest.mark.slow  # GPT-2 small's trace at 1,024 tokens: seconds
def test_the_recorded_facts_are_what_the_tracer_finds_now():
    from litscale.planner import facts_cache
    from litscale.planner.model_facts import model_facts

    spec = anchors.load()["models"]["gpt2_small"]
    recorded = json.loads(anchors.FACTS_FILE.read_text())["gpt2_small"]["facts"]
    net, _ = anchors.network_of(spec)
    assert facts_cache.as_plain(model_facts(net, seq_len=spec["seq_len"], vocab_size=net.config.vocab_size)) == recorded


@pytest.mark.slow
def test_every_row_is_within_20_percent_or_names_a_cause_a_published_figure_measures(table):
    data, rows = table
    by_id = {row["id"]: row for row in rows}
    assert {anchor["id"] for anchor in data["anchors"]} == set(by_id)
    for anchor in data["anchors"]:
        row = by_id[anchor["id"]]
        if abs(row["error"]) <= anchors.GOAL:
            assert "cause" not in anchor, f"{anchor['id']} is within 20%: its cause is stale"
            continue
        assert "cause" in anchor, f"{anchor['id']} is {row['error']:+.0%} off and names no cause"
        measured_by = anchor["cause"]["measured_by"]
        if measured_by.startswith("published."):  # a figure of the source's own beside the one predicted
            assert measured_by.split(".", 1)[1] in anchor["published"], anchor["id"]
        else:  # another row of the table, which the cost model predicts within 20%
            assert abs(by_id[measured_by]["error"]) <= anchors.GOAL, (anchor["id"], measured_by)


@pytest.mark.slow
def test_the_interleaved_schedule_gains_what_torchtitan_measured(table):
    """torchtitan's 405B on 512 H100s: interleaved 1F1B (2 stages per rank) 1.28x 1F1B, both with
    8 micro-batches over 8 stages: the bubbles 7/23 against 7/15."""
    _, rows = table
    by_id = {row["id"]: row for row in rows}
    one, interleaved = by_id["torchtitan-405b-1f1b"], by_id["torchtitan-405b-interleaved"]
    assert (one["bubble"], interleaved["bubble"]) == pytest.approx((7 / 15, 7 / 23))
    published = interleaved["published_tps_per_gpu"] / one["published_tps_per_gpu"]
    predicted = interleaved["predicted_tps_per_gpu"] / one["predicted_tps_per_gpu"]
    assert predicted == pytest.approx(published, rel=0.05)


def test_the_float8_casts_cost_the_bytes_torchaos_roofline_moves():
    """One float8 Linear of 64 -> 128 features on 2 x 16 tokens: its input and output gradient
    (activations) read 2 bytes an element for the amax and 2 + 2 x 1 for the cast; its weight 2,
    then 2 + 1 twice (forward and backward); each pass at half of 1 GB/s, at least 2 us."""
    facts = dataclasses.replace(FACTS, moe=None, float8_linears=((64, 128),))
    plan = Plan("single", MeshSizes(), micro_batch=2, accumulation=1, compute_dtype="bfloat16", float8=True)

    def passes(numel: int, bytes_each: tuple[int, ...]) -> float:
        return sum(max(numel * b / 0.5e9, 2e-6) for b in bytes_each)

    expected = passes(32 * 64, (2, 0, 4)) + passes(64 * 128, (2, 0, 3, 3)) + passes(32 * 128, (2, 0, 4))
    assert float8_cast_s(plan, facts, CLUSTER) == pytest.approx(expected)
    assert float8_cast_s(dataclasses.replace(plan, float8=False), facts, CLUSTER) == 0.0
    assert float8_cast_s(plan, facts, dataclasses.replace(CLUSTER, memory_bandwidth_bytes_s=0.0)) == 0.0


@pytest.mark.parametrize(("micro_batch", "share"), [
    (1, 0.1),  # 4,000 FLOPs a call: the first point
    (2, 0.1),  # below no point: the first's share
    (10, 0.2),  # 40,000: the second point
    (20, 0.2 + 0.1 * math.log(80_000 / 40_000) / math.log(40_000 / 8_000)),  # the last two points' trend
    (10_000, 0.45),  # ... up to the dense matmuls' achieved fraction
])
def test_the_experts_grouped_matmuls_run_at_the_share_a_kernel_benchmark_reads_at_their_size(micro_batch, share):
    """One expert's forward FLOPs a call: micro batch x 16 tokens x top 2 / 8 experts rows x 2 x
    500 weights = 4,000 per sample; the cluster's points at 8,000 (0.1) and 40,000 (0.2)."""
    cluster = dataclasses.replace(CLUSTER, grouped_matmul_fractions=[[40_000.0, 0.2], [8_000.0, 0.1]],
                                  achieved_fraction=0.45)
    plan = Plan("single", MeshSizes(), micro_batch=micro_batch, accumulation=1)
    between = 0.1 + 0.1 * math.log(3 * 4_000 / 8_000) / math.log(5)  # 12,000 FLOPs: log-linear between
    assert grouped_fraction(dataclasses.replace(plan, micro_batch=3), FACTS, cluster) == pytest.approx(between)
    assert grouped_fraction(plan, FACTS, cluster) == pytest.approx(share)


def test_a_token_crosses_to_each_other_node_holding_one_of_its_experts_once():
    """8 experts over 4 nodes (2 each), top 3: counted over every choice of 3 experts, from a
    token on node 0."""
    choices = list(itertools.combinations(range(8), 3))
    counted = sum(len({expert // 2 for expert in chosen} - {0}) for chosen in choices) / len(choices)
    assert remote_nodes_per_token(8, 3, 4) == pytest.approx(counted)


def test_an_all_to_all_across_nodes_sends_its_node_peers_rows_over_nvlink():
    """EP 8 over 2 nodes of 4 (FSDP 8), bf16, micro batch 2: 4 exchanges per MoE layer, each rank's
    rows 32 tokens x top 2 x width 8 x 2 bytes; 3 of its 8 peers' share over NVLink, 4 over the
    slower link, at the same time: the slower of the two. A dispatch that crosses once per node
    sends each token once to the other node (if it holds any of its experts)."""
    plan = Plan("fsdp", MeshSizes(data_shard=8, expert=8), micro_batch=2, accumulation=1, compute_dtype="bfloat16")
    exchanges, rows = 2 * 4, 2 * 4 * 32 * 2 * 8 * 2
    found = {c.name: c for c in collectives(plan, FACTS, CLUSTER)}["expert-parallel all-to-all"]
    intra = exchanges * 3 * 1e-5 + rows * 3 / 8 / 100e9
    inter = exchanges * 4 * 1e-5 + rows * 4 / 8 / 10e9
    assert found.seconds == pytest.approx(max(intra, inter)) and found.bytes_per_rank == pytest.approx(rows * 7 / 8)
    once = dataclasses.replace(plan, framework=Framework(dispatch_once_per_node=True))
    crossing = rows / 2 * (1 - math.comb(4, 2) / math.comb(8, 2))  # top 2 of 8 experts, 4 on the other node
    found = {c.name: c for c in collectives(once, FACTS, CLUSTER)}["expert-parallel all-to-all"]
    assert found.seconds == pytest.approx(max(intra, exchanges * 4 * 1e-5 + crossing / 10e9))


def test_tensor_parallel_under_checkpointing_keeps_one_layers_gathered_inputs():
    """Sequence parallel saves each attention's and MLP's gathered input whole (2 per layer) and
    the head's: all 4 layers' without checkpointing, the recomputed layer's only with it; a
    framework that gathers again in backward keeps none, and a vocabulary-parallel loss no whole
    log-probabilities (micro batch 1 x 16 tokens x 256 words x 4 bytes)."""
    facts = dataclasses.replace(FACTS, moe=None, vocab_size=256)
    plan = Plan("tensor_parallel", MeshSizes(data_shard=2, tensor=2), micro_batch=1, accumulation=1)
    layer_input, log_probs = 16 * 8 * 4, 16 * 256 * 4
    assert tensor_parallel_whole_bytes(plan, facts) == pytest.approx((9 * layer_input + log_probs) / 2)
    checkpointed = dataclasses.replace(plan, activation_checkpointing=True)
    assert tensor_parallel_whole_bytes(checkpointed, facts) == pytest.approx((3 * layer_input + log_probs) / 2)
    megatron = dataclasses.replace(plan, framework=Framework(saves_gathered_inputs=False, loss_parallel=True))
    assert tensor_parallel_whole_bytes(megatron, facts) == 0.0


def test_a_published_frameworks_sharding_and_its_ranks_parameters():
    """Megatron's distributed optimizer held instead of the strategy's; a rank's parameters
    before data sharding: the dense 1,600 split by tensor parallel 2, the MoE layers' 400 whole,
    their 8,000 experts over EP 4."""
    held = Sharding(zero_stage=1, fp32_master_copy=True)
    plan = Plan("tensor_parallel", MeshSizes(data_shard=4, tensor=2, expert=4), micro_batch=1, accumulation=1,
                framework=Framework(held=held))
    assert plan.sharding == held and Plan("ddp", MeshSizes(), 1, 1).published == Framework()
    assert rank_params(plan, FACTS) == pytest.approx(1_600 / 2 + 400 + 8_000 / 4)
    assert rank_params(plan, dataclasses.replace(FACTS, moe=None)) == pytest.approx(10_000 / 2)


def _torchtitans_selective_policy():
    """torchtitan's selective checkpointing by op (``_custom_policy`` at 9dec370) as torch's
    context: save the outputs of the matmuls but every second one of a block, and attention's;
    recompute the rest (CPU's flash attention in place of the CUDA kernels it names)."""
    from collections import defaultdict

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    mm, attention = torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    counts = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[key] += 1
        saved = func in (mm, attention) and not (func == mm and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _storages_made_by(work) -> tuple:
    """``work()``'s result and weak references to every storage an op's output held while it ran."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Made(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.storages = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outputs = out if isinstance(out, (tuple, list)) else [out]
            self.storages += [weakref.ref(t.untyped_storage()) for t in outputs if isinstance(t, torch.Tensor)]
            return out

    with Made() as made:
        result = work()
    return result, made.storages


@pytest.mark.slow  # a Llama block's forward under torch's selective checkpointing: about a second
def test_torchtitans_selective_checkpointing_by_op_keeps_what_the_anchors_count_per_token():
    """The memory term of the rows that ran torchtitan's selective checkpointing ('op'), against
    torch's own: a Llama-tiny block in bf16 under ``torch.utils.checkpoint`` with torchtitan's
    policy. What the forward leaves alive (every storage an op made, less the parameters' and the
    output's), with the input the checkpoint keeps, is what the anchors count per token."""
    from types import SimpleNamespace

    import torch
    from torch.utils.checkpoint import checkpoint

    from litscale.models.llama import build_llama

    torch.manual_seed(0)
    net = build_llama(preset="tiny", vocab_size=256, block_size=64).to(torch.bfloat16)
    block, batch, length = net.layers["0"], 2, 64
    x = torch.randn(batch, length, net.config.n_embd, dtype=torch.bfloat16, requires_grad=True)
    out, made = _storages_made_by(
        lambda: checkpoint(block, x, use_reentrant=False, context_fn=_torchtitans_selective_policy))
    not_activations = {p.untyped_storage().data_ptr() for p in block.parameters()} | {out.untyped_storage().data_ptr()}
    alive = {s.data_ptr(): s.nbytes() for s in (ref() for ref in made)
             if s is not None and s.data_ptr() not in not_activations}
    kept_per_token = (sum(alive.values()) + x.untyped_storage().nbytes()) / (batch * length)
    assert kept_per_token == anchors.selective_saves_bytes_per_token("selective_op", SimpleNamespace(net=net))
    assert anchors.selective_saves_bytes_per_token("layers:5", SimpleNamespace(net=net)) == 0.0
    out.float().sum().backward()  # the saved outputs serve the recompute
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
