"""Expert parallel (``strategies/expert_parallel.py``) below the parity table: one MoE layer
whose experts are split over 2 gloo ranks, fed different tokens on each, against the whole
layer in one process on the same tokens (forward and the input's gradient), dropless and with
a capacity; and the one-line errors of a bad ``strategy.expert_parallel_size``. The whole
decoder under EP, EP x FSDP and EP x TP is in the parity table (``test_parity.py``, family
``moe``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.configs import compose_job
from helpers.distributed import run_distributed
from helpers.parity import TOLERANCE

from litscale.errors import ConfigError
from litscale.models.moe import MoEConfig
from litscale.models.moe_layer import MoELayer

LAYER = MoEConfig(n_layer=1, n_head=2, n_kv_heads=1, n_embd=16, ffn_hidden_size=32, n_experts=4, top_k=2,
                  moe_ffn_hidden_size=16, n_shared_experts=1)


class OneLayer(torch.nn.Module):
    """A network of one MoE layer, declaring its experts as the decoder does."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.mlp = MoELayer(config)
        torch.manual_seed(0)
        for param in self.parameters():
            torch.nn.init.normal_(param, std=0.3)

    expert_modules = ("mlp.experts",)


def layer_on_two_ranks(rank: int, world_size: int, config: MoEConfig) -> dict:
    """Rank ``r`` runs tokens ``r`` through the expert-parallel layer; returns what it holds and
    what it computed, and the same from the whole layer in this process."""
    from litscale.parallel.layout import MeshAxis, MeshSizes
    from litscale.parallel.mesh import ParallelMesh
    from litscale.strategies.expert_parallel import apply_expert_parallel

    whole, split = OneLayer(config), OneLayer(config)
    x = torch.randn(2, 8, config.n_embd, generator=torch.Generator().manual_seed(rank))
    mesh = ParallelMesh.build(MeshSizes(data_shard=world_size, expert=world_size), "cpu")
    apply_expert_parallel(split, mesh.get(MeshAxis.EXPERT), mesh.get(MeshAxis.EXPERT_DATA), divide_factor=world_size)
    results = {}
    for name, net in (("whole", whole), ("split", split)):
        inputs = x.clone().requires_grad_()
        out = net.mlp(inputs)
        out.pow(2).sum().backward()
        results[name] = (out.detach(), inputs.grad, net.mlp.take_statistics()[0])
    results["local_experts"] = split.mlp.experts.gate_proj.to_local().shape[0]
    return results


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_experts_split_over_two_ranks_compute_what_the_whole_layer_does(capacity_factor):
    config = dataclasses.replace(LAYER, capacity_factor=capacity_factor)
    for rank, result in enumerate(run_distributed(layer_on_two_ranks, 2, config, timeout=240)):
        assert result["local_experts"] == 2, f"rank {rank} holds {result['local_experts']} of 4 experts"
        (out, grad, load), (want_out, want_grad, want_load) = result["split"], result["whole"]
        torch.testing.assert_close(out, want_out, **TOLERANCE)
        torch.testing.assert_close(grad, want_grad, **TOLERANCE)
        # Routing and the capacity are decided where the tokens are: the same drops.
        assert torch.equal(load, want_load)
        if capacity_factor:
            assert load[-1] > 0, "the capacity dropped nothing: the case tests no drop"


EP = ["strategy=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=moe", *EP, "strategy.expert_parallel_size=4"],
         "strategy.expert_parallel_size=4 does not divide the data x context ranks (2 x 1 = 2); "
         "allowed: a divisor of 2"),
        (["model=moe", *EP, "strategy.expert_parallel_size=2", "model.net.n_experts=3"],
         "strategy.expert_parallel_size=2 does not divide model.net.n_experts=3; allowed: a divisor of 3"),
        (["model=llama", *EP, "strategy.expert_parallel_size=2"],
         "strategy.expert_parallel_size=2 needs a mixture-of-experts model, and Llama declares no "
         "experts; allowed: 1 (or model=moe)"),
        (["model=moe", "strategy=tensor_parallel", "trainer.accelerator=cpu", "trainer.devices=2",
          "strategy.expert_parallel_size=2"],
         "strategy.expert_parallel_size=2 does not divide the data x context ranks (1 x 1 = 1); "
         "allowed: a divisor of 1"),
        (["model=moe", *EP, "strategy.expert_parallel_size=2", "strategy.context_parallel_size=2"],
         "strategy.expert_parallel_size=2 with context_parallel_size=2 is not supported yet; allowed: one of them 1"),
    ],
    ids=["ranks", "experts", "dense", "tensor-parallel-ranks", "with-context-parallel"],
)
def test_a_bad_expert_parallel_size_is_one_line(overrides, message, tmp_path, outputs_root):
    from litscale.app.checks.validation import validate

    cfg, choices = compose_job(overrides, tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value) == message
