"""The dry run of ``plan=show`` (``litscale.app.plan.dry_run``): the configured strategy, built
from the composed config as a run builds it, splits the network on the meta device over
torch's fake process group, up to 256 ranks; what rank 0 holds is checked against counts
taken here from the plain network, and against the planner's prediction. Most tests build in
this process (``built_in_this_process``, a fraction of a second); the one marked slow goes
through the spawned child that ``plan=show`` uses."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from helpers.configs import compose_job, described
from omegaconf import OmegaConf

from litscale.app.checks.validation import meta_net, validate
from litscale.app.plan.dry_run import REPLICATED_MESH, built_in_this_process, built_on_fake_world
from litscale.app.plan.ranking import configured_plan, facts_of
from litscale.planner.cluster import Cluster, Link
from litscale.planner.cost import memory_per_rank

LINK = Link(bandwidth_bytes_s=1e9, latency_s=1e-5)
CLUSTER = Cluster(name="test", nodes=1, devices_per_node=8, device_memory_bytes=2**30,
                  peak_flops={"float32": 1e12}, intra_node=LINK, inter_node=LINK)
NANO = ["model=gpt", "data=synthetic", "data.seq_len=32"]  # 4 layers, 4 heads, width 128
# Every first dimension a multiple of 256, so FSDP2 splits each parameter evenly at 8 to 256 ranks.
WIDE = [*NANO, "data.seq_len=256", "+model.net.n_layer=2", "+model.net.n_head=8", "+model.net.n_embd=256"]
DTYPE_BYTES = {"fp32": 4, "bf16_true": 2}
# Parameters GPT's tensor-parallel plan leaves whole on every tensor-parallel rank: the
# position table (not in the plan), the LayerNorms (sequence parallel keeps them replicated)
# and the biases of the row-wise projections (added after the reduction).
REPLICATED = ("wpe.weight", "ln_1.", "ln_2.", "ln_f.", "out_proj.bias", "down.bias")


def _configured(overrides: list[str], world: int, tmp_path):
    """The job's config, its choices and layout at ``world`` ranks (8 per node), validated as
    ``plan=show`` validates it."""
    cfg, choices = compose_job(["plan=show", "trainer.accelerator=cpu", f"trainer.devices={min(world, 8)}",
                                f"trainer.num_nodes={max(1, world // 8)}", *overrides], tmp_path)
    return cfg, choices, validate(cfg, choices=choices, this_machine=False)


def _built(overrides: list[str], world: int, tmp_path) -> tuple[dict, object]:
    cfg, choices, layout = _configured(overrides, world, tmp_path)
    found = built_in_this_process(OmegaConf.to_container(cfg, resolve=True), world)
    assert not dist.is_initialized()  # the fake group is gone again
    assert found["ranks"] == world
    run = described(cfg, choices, layout)
    predicted = memory_per_rank(configured_plan(run), facts_of(run), CLUSTER)["params"]
    return found, meta_net(cfg), predicted


def _elements(net: torch.nn.Module, keep=lambda name: True, tensor: int = 1) -> float:
    """Elements one tensor-parallel rank holds of the parameters whose names ``keep`` picks."""
    return sum(p.numel() if any(part in name for part in REPLICATED) else p.numel() / tensor
               for name, p in net.named_parameters() if keep(name))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "extra", "mesh"), [
    (8, [], "shard 8"),
    (64, [], "shard 64"),
    (256, [], "shard 256"),
    (256, ["strategy.replicate_size=2"], "replicate 2 x shard 128"),
    (8, ["precision=bf16_true", "strategy.activation_checkpointing=true"], "shard 8"),
], ids=["shard8", "shard64", "shard256", "replicate2xshard128", "shard8-ac-bf16"])
def test_fsdp_rank0_holds_its_share(world, extra, mesh, tmp_path):
    found, net, predicted = _built([*WIDE, "strategy=fsdp", *extra], world, tmp_path)
    precision = next((e.split("=")[1] for e in extra if e.startswith("precision=")), "fp32")
    shards = world // (2 if "replicate" in mesh else 1)  # HSDP's replicas each hold a full set of shards
    exact = _elements(net) * DTYPE_BYTES[precision] / shards
    assert found["params_bytes"] == exact  # no padding: every first dimension divides
    assert found["params_bytes"] == pytest.approx(predicted, rel=1e-6)
    assert found["mesh"] == mesh


@pytest.mark.slow
def test_fsdp_rank0_holds_whole_rows_when_a_parameter_has_fewer_rows_than_ranks(tmp_path):
    """At 256 ranks nano's 128-row parameters leave ranks 128-255 empty and rank 0 one row of
    each: it holds more than the even share the planner predicts, and the dry run says so."""
    found, net, predicted = _built([*NANO, "strategy=fsdp"], 256, tmp_path)
    rows = sum(math.ceil(p.shape[0] / 256) * p[0].numel() for p in net.parameters())
    assert found["params_bytes"] == rows * 4
    assert found["params_bytes"] > predicted == pytest.approx(_elements(net) * 4 / 256)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "extra"), [
    (2, []),
    (8, ["+model.net.n_head=8"]),
    (8, ["strategy.tensor_parallel_size=2", "strategy.data_parallel_size=4"]),
], ids=["tp2", "tp8", "dp4xtp2"])
def test_tensor_parallel_rank0_holds_its_split_and_the_replicated_rest(world, extra, tmp_path):
    found, net, predicted = _built([*NANO, "strategy=tensor_parallel", *extra], world, tmp_path)
    data = 4 if "strategy.data_parallel_size=4" in extra else 1
    tensor = world // data
    assert found["params_bytes"] == pytest.approx(_elements(net, tensor=tensor) * 4 / data, rel=1e-6)
    # The planner splits every parameter by the tensor-parallel size; rank 0 holds a little more.
    assert predicted <= found["params_bytes"]
    assert found["mesh"] == " x ".join([*([f"shard {data}"] if data > 1 else []), f"tensor_parallel {tensor}"])


@pytest.mark.slow
@pytest.mark.parametrize(("world", "extra", "pipeline", "data", "tensor"), [
    (2, [], 2, 1, 1),
    (4, ["strategy.pipeline_parallel_size=4"], 4, 1, 1),
    (8, ["strategy.pipeline_parallel_size=2", "strategy.data_parallel_size=2", "strategy.tensor_parallel_size=2"],
     2, 2, 2),
], ids=["pp2", "pp4", "pp2xdp2xtp2"])
def test_pipeline_rank0_holds_its_first_stage(world, extra, pipeline, data, tensor, tmp_path):
    """Stage 0 of nano (4 blocks), balanced by parameters: the embeddings and 4 / pp blocks."""
    found, net, _ = _built([*NANO, "strategy=pipeline", *extra], world, tmp_path)
    first = ("wte.", "wpe.", *(f"blocks.{i}." for i in range(4 // pipeline)))
    exact = _elements(net, lambda name: name.startswith(first), tensor) * 4 / data  # FSDP2 per stage over data
    assert found["params_bytes"] == pytest.approx(exact, rel=1e-6)
    assert found["mesh"] == " x ".join(f"{name} {size}" for name, size in (
        ("pipeline_parallel", pipeline), ("shard", data), ("tensor_parallel", tensor)) if size > 1)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16_true"])
def test_ddp_holds_the_whole_model_in_its_parameter_dtype(precision, tmp_path):
    found, net, predicted = _built([*NANO, "strategy=ddp", f"precision={precision}"], 4, tmp_path)
    assert found == {"params_bytes": _elements(net) * DTYPE_BYTES[precision], "mesh": REPLICATED_MESH, "ranks": 4}
    assert predicted == found["params_bytes"]


def test_deepspeed_is_not_built_and_says_why(tmp_path):
    cfg, _, _ = _configured([*NANO, "strategy=deepspeed_zero", "strategy.stage=3"], 8, tmp_path)
    found = built_in_this_process(OmegaConf.to_container(cfg, resolve=True), 8)
    assert found["params_bytes"] is None and found["ranks"] == 8
    assert "fake process group" in found["skipped"]


def test_building_here_refuses_a_process_that_holds_a_group(tmp_path):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg, _, _ = _configured([*NANO, "strategy=fsdp"], 2, tmp_path)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="holds a process group already"):
            built_in_this_process(OmegaConf.to_container(cfg, resolve=True), 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # one spawned child (imports Lightning): ~7 s
def test_in_a_child_process_the_same_as_here(tmp_path):
    cfg, _, _ = _configured([*WIDE, "strategy=fsdp", "strategy.replicate_size=2"], 256, tmp_path)
    run_config = OmegaConf.to_container(cfg, resolve=True)
    assert built_on_fake_world(run_config, 256) == built_in_this_process(run_config, 256)


MOE = ["model=moe", "data=synthetic", "data.seq_len=32"]  # tiny: 3 layers, 2 of them MoE (8 experts), width 64


@pytest.mark.slow  # over a second alone: out of the quick loop
@pytest.mark.parametrize(("world", "extra", "mesh"), [
    (8, ["strategy.expert_parallel_size=4"], "shard 8"),
    (8, ["strategy.expert_parallel_size=2", "strategy.replicate_size=2"], "replicate 2 x shard 4"),
], ids=["shard8-ep4", "replicate2xshard4-ep2"])
def test_expert_parallel_rank0_holds_its_experts_and_its_shard_of_the_rest(world, extra, mesh, tmp_path):
    """The routed experts split over the EP ranks, then sharded over the data ranks left (all of
    them, replicas included); the rest sharded as FSDP shards it: what the planner predicts."""
    found, net, predicted = _built([*MOE, "strategy=fsdp", *extra], world, tmp_path)
    shards = world // (2 if "replicate" in mesh else 1)
    experts = sum(p.numel() for name, p in net.named_parameters() if ".experts." in name)
    exact = (experts / world + (_elements(net) - experts) / shards) * 4  # experts: / ep, then / (world / ep)
    assert found["params_bytes"] == exact
    assert found["params_bytes"] == pytest.approx(predicted, rel=1e-6)
    assert found["mesh"] == mesh


@pytest.mark.slow
def test_tensor_parallel_leaves_the_moe_layers_whole_and_expert_parallel_splits_their_experts(tmp_path):
    """Data 4 x tensor 2 with EP 2 at 8 ranks: tensor parallel splits the attention, the dense
    MLP, the embedding and the head (not the norms, as for Llama); each MoE layer's router and
    shared expert are whole on every tensor-parallel rank and sharded over the 4 data ranks, its
    experts split over 2 EP ranks and sharded over the 2 data ranks left. The planner splits
    the norms too: it predicts a little less."""
    found, net, predicted = _built([*MOE, "strategy=tensor_parallel", "strategy.tensor_parallel_size=2",
                                    "strategy.data_parallel_size=4", "strategy.expert_parallel_size=2"], 8, tmp_path)
    kinds = {"experts": 0, "moe_rest": 0, "norms": 0, "split": 0}
    for name, param in net.named_parameters():
        kind = ("experts" if ".experts." in name else "moe_rest" if ".mlp.gate." in name or "shared_experts" in name
                else "norms" if "norm" in name else "split")
        kinds[kind] += param.numel()
    exact = (kinds["experts"] / 2 / 2 + (kinds["moe_rest"] + kinds["norms"]) / 4 + kinds["split"] / 2 / 4) * 4
    assert found["params_bytes"] == pytest.approx(exact, rel=1e-6)
    assert predicted == pytest.approx(exact - kinds["norms"] / 2 / 4 * 4, rel=1e-6)


# One rank's training step at the configured world (plan.fake_step): its peak, measured by
# torch's MemTracker on fake tensors, against the planner's prediction for the same run.
STEP_WITHIN = 0.10
GPT = ["model=gpt", "data=synthetic"]  # 128 tokens, as a run's default
STEPS = [
    pytest.param(["model=gpt", "model.net.preset=small", "data.seq_len=1024", "data.batch_size=8", "strategy=fsdp"], 64,
                 id="gpt2_small-fsdp64"),
    pytest.param([*GPT, "data.batch_size=8", "strategy=single"], 1, id="nano-single", marks=pytest.mark.full),
    pytest.param([*GPT, "data.batch_size=8", "strategy=tensor_parallel"], 2, id="nano-tp2", marks=pytest.mark.full),
    pytest.param([*GPT, "data.batch_size=8", "strategy=ddp"], 2, id="nano-ddp2", marks=pytest.mark.full),
    pytest.param(["model=llama", "data.batch_size=8", "strategy=fsdp", "strategy.context_parallel_size=2"], 2,
                 id="llama-cp2", marks=pytest.mark.full),
    pytest.param(["model=moe", "data=synthetic", "data.batch_size=8", "strategy=fsdp"], 2, id="moe-fsdp2",
                 marks=pytest.mark.full),
    pytest.param(["model=moe", "data=synthetic", "data.batch_size=8", "strategy=fsdp", "strategy.expert_parallel_size=2"],
                 2, id="moe-ep2", marks=pytest.mark.full),
    pytest.param(["model=llama", "data.batch_size=8", "strategy=fsdp", "strategy.context_parallel_size=2"], 4,
                 id="llama-cp2-dp2", marks=pytest.mark.full),
    pytest.param(["model=llama", "data.batch_size=8", "strategy=ddp", "strategy.gradient_as_bucket_view=false"], 2,
                 id="llama-ddp2-copied-gradients", marks=pytest.mark.full),
    pytest.param(["model=llama", "data.batch_size=8", "precision=bf16_mixed", "strategy=fsdp"], 4,
                 id="llama-bf16_mixed-fsdp4", marks=pytest.mark.full),
    pytest.param([*GPT, "data.batch_size=8", "optimizer=muon", "strategy=fsdp"], 2, id="nano-muon-fsdp2",
                 marks=pytest.mark.full),
    # FSDP2's policy computes in bf16 without autocast: costed from the 16-bit-weights trace
    # (GPT-nano: +13.6% from the autocast trace), each checkpointed layer keeping a bf16 input.
    pytest.param([*GPT, "data.batch_size=8", "precision=bf16_mixed", "strategy=fsdp"], 2, id="nano-bf16_mixed-fsdp2",
                 marks=pytest.mark.full),
    pytest.param(["model=llama", "data.batch_size=8", "precision=bf16_mixed", "strategy=fsdp",
                  "strategy.activation_checkpointing=true"], 4, id="llama-bf16_mixed-fsdp4-ac", marks=pytest.mark.full),
    # Missed: in fp32 the checkpointed step peaks 14% above the prediction (each layer's input
    # and one layer's activations); what else it holds was not found.
    pytest.param(["model=llama", "data.batch_size=8", "strategy=fsdp", "strategy.activation_checkpointing=true"], 4,
                 id="llama-fsdp4-ac", marks=[pytest.mark.soak, pytest.mark.xfail(strict=True)]),
]


@pytest.mark.full
@pytest.mark.slow  # traces two training steps (3-8 s)
@pytest.mark.parametrize(("overrides", "world"), STEPS)
def test_one_step_at_the_configured_world_peaks_within_ten_percent_of_the_prediction(overrides, world, tmp_path):
    cfg, choices, layout = _configured(["plan.fake_step=true", *overrides], world, tmp_path)
    found = built_in_this_process(OmegaConf.to_container(cfg, resolve=True), world)
    assert "step_skipped" not in found, found.get("step_skipped")
    # Tensors' bytes on both sides: no allocator's reserve.
    cluster = dataclasses.replace(CLUSTER, allocator_overhead=0.0)
    run = described(cfg, choices, layout)
    predicted = memory_per_rank(configured_plan(run), facts_of(run), cluster)["total"]
    assert abs(predicted / found["step_peak_bytes"] - 1) <= STEP_WITHIN, (
        f"predicted {predicted / 2**20:.2f} MiB, one step peaked at {found['step_peak_bytes'] / 2**20:.2f} MiB")


@pytest.mark.parametrize(("overrides", "reason"), [
    (["strategy=local_sgd"], "OWN_AVERAGING"),
    (["strategy=pipeline"], "PIPELINE"),
], ids=["local_sgd", "pipeline"])
def test_a_step_the_fake_group_cannot_run_is_skipped_with_the_reason(overrides, reason, tmp_path):
    from litscale.app.plan import fake_step

    cfg, _, _ = _configured(["plan.fake_step=true", "data.seq_len=32", *overrides], 2, tmp_path)
    found = built_in_this_process(OmegaConf.to_container(cfg, resolve=True), 2)
    assert found["step_skipped"] == getattr(fake_step, reason) and "step_peak_bytes" not in found


def test_without_plan_fake_step_no_step_runs(tmp_path):
    cfg, _, _ = _configured([*NANO, "strategy=fsdp"], 2, tmp_path)
    found = built_in_this_process(OmegaConf.to_container(cfg, resolve=True), 2)
    assert "step_peak_bytes" not in found and "step_skipped" not in found
