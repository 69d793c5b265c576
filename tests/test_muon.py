"""Muon (``litscale.optim.muon``) against ``torch.optim.Muon`` and ``torch.optim.AdamW``, the roles it
reads from each model family's declarations, and a run of it measured. Its parity with one
process under DDP, FSDP, tensor and expert parallel, local SGD and a pipeline is in
``test_parity.py`` (the ``*_muon`` cells); DeepSpeed's refusal in ``test_compatibility.py``."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers.cli import explain, summaries
from helpers.inprocess import train_on_pool
from torch import nn

from litscale.models.gpt import build_gpt
from litscale.models.llama import Llama, LlamaConfig
from litscale.models.mlp import MLP
from litscale.models.moe import MoEConfig, MoEDecoder
from litscale.optim.muon import MATRIX, Muon, newton_schulz, parameter_roles


def steps(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: list[torch.Tensor]) -> None:
    for x in inputs:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("shape", [(8, 16), (16, 8)], ids=["wide", "tall"])
def test_a_matrix_steps_as_torch_muon_with_its_bfloat16_iteration_and_lr_rule(shape):
    torch.manual_seed(0)
    ours, theirs = nn.Linear(shape[1], shape[0], bias=False), nn.Linear(shape[1], shape[0], bias=False)
    theirs.load_state_dict(ours.state_dict())
    inputs = [torch.randn(4, shape[1]) for _ in range(3)]
    steps(ours, Muon([{"params": [ours.weight], "role": MATRIX, "weight_decay": 0.1}], lr=0.02,
                     ns_dtype="bfloat16", adjust_lr="original"), inputs)
    steps(theirs, torch.optim.Muon([theirs.weight], lr=0.02, weight_decay=0.1), inputs)
    assert torch.equal(ours.weight, theirs.weight)


def test_stacked_experts_are_orthogonalised_each_on_its_own():
    torch.manual_seed(0)
    experts = torch.randn(3, 8, 16)
    stacked = newton_schulz(experts, 5, torch.float32)
    for index in range(3):
        torch.testing.assert_close(stacked[index], newton_schulz(experts[index], 5, torch.float32))
    # In float32 the iteration's result has singular values near 1 (0.7 to 1.2 after 5 steps).
    singular = torch.linalg.svdvals(stacked)
    assert singular.min() > 0.5 and singular.max() < 1.5


def test_the_other_tensors_step_as_torch_adamw():
    torch.manual_seed(0)
    ours, theirs = nn.Linear(16, 8), nn.Linear(16, 8)
    theirs.load_state_dict(ours.state_dict())
    inputs = [torch.randn(4, 16) for _ in range(4)]
    steps(ours, Muon([{"params": list(ours.parameters()), "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95),
                     eps=1e-8), inputs)
    steps(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
          inputs)
    for mine, reference in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1.3e-6, atol=1e-6)


def names_by_role(net: nn.Module) -> dict[str, set[str]]:
    names = {id(p): name for name, p in net.named_parameters(remove_duplicate=False)}
    groups = parameter_roles(net, weight_decay=0.1)
    return {"matrix": {names[id(p)] for p in groups[0]["params"]},
            "other": {names[id(p)] for group in groups[1:] for p in group["params"]}}


def test_embeddings_and_the_declared_output_layer_are_left_to_adamw():
    roles = names_by_role(build_gpt(preset="nano"))
    assert {"wte.weight", "wpe.weight", "lm_head.weight"} <= roles["other"]
    assert "blocks.0.attn.q_proj.weight" in roles["matrix"] and "blocks.0.mlp.down.weight" in roles["matrix"]
    assert all(not name.endswith("bias") for name in roles["matrix"])
    classifier = names_by_role(MLP(input_shape=[8, 8], num_classes=10, hidden_sizes=[32, 32]))
    assert classifier["matrix"] == {"layers.1.weight", "layers.4.weight"}  # not the classifier, layers.7


def test_tied_embeddings_and_stacked_experts_take_their_roles():
    tied = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64,
                             block_size=16, tie_embeddings=True))
    groups = parameter_roles(tied, weight_decay=0.1)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert any(p is tied.embed_tokens.weight for group in groups[1:] for p in group["params"])
    assert all(p is not tied.embed_tokens.weight for p in groups[0]["params"])
    moe = MoEDecoder(MoEConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64,
                               block_size=16, n_experts=4, top_k=2, moe_every=1))
    experts = {name for name, p in moe.named_parameters() if p.dim() == 3}
    assert experts and experts <= names_by_role(moe)["matrix"]



@pytest.mark.full
@pytest.mark.slow
def test_train_py_steps_the_matrices_with_muon_and_measures_half_of_adamws_state_for_them(tmp_path):
    """Through the run's LR-scaling rule, which wraps the optimizer's factory: Muon once built
    from its groups as plain AdamW there, silently."""
    calibration = {"cores": 2, "memory_bytes": 8 * 2**30, "peak_flops": {"float32": 1e11, "bfloat16": 2e11},
                   "bandwidth_bytes_s": 1e9, "latency_s": 1e-4, "measured": "test"}  # made up: the run predicts
    (tmp_path / "cluster_local_cpu.json").write_text(json.dumps(calibration))
    process = train_on_pool("optimizer=muon", "trainer.accelerator=cpu", "trainer.max_steps=2", "data.seq_len=32",
                            "logger=none", "trainer.enable_progress_bar=false", outputs=tmp_path,
                            env={"LITSCALE_CACHE": str(tmp_path)})
    assert process.returncode == 0, explain(process)
    printed = process.stdout + process.stderr
    split = re.search(r"litscale: optimizer muon: 24 matrices \(([\d,]+) parameters\) orthogonalised in float32 \| "
                      r"AdamW for 45 tensors \(([\d,]+): embeddings, output layers, biases, norms\)", printed)
    assert split, explain(process)
    matrices, others = (int(count.replace(",", "")) for count in split.groups())
    summary = summaries(tmp_path)[-1]
    # Measured from the state tensors after the first step: one buffer per matrix parameter, two moments for the rest.
    assert summary["memory/optimizer_bytes"] == 4 * matrices + 8 * others
    assert summary["memory/estimate_optimizer_bytes"] == summary["memory/optimizer_bytes"]
    # The planner's prediction for the run counts the same state.
    measured = sum(summary[f"memory/{kind}_bytes"] for kind in ("params", "grads", "optimizer"))
    assert summary["plan/predicted_states_bytes"] == pytest.approx(measured, rel=1e-9)
