"""µP (``lr_scaling=mup``, litscale/optim/mup.py): the multipliers against Tensor Programs V's table
and the spectral condition, the base width as the standard model, the coordinate check's flat
activations against the standard parametrisation's growing ones, and the one-line refusals.
Parity at 2 and 4 ranks is in test_parity.py (``*_mup`` cells)."""

from __future__ import annotations

import functools
import json
import math
import re

import pytest
import torch
from helpers.cli import explain
from helpers.configs import compose_job
from helpers.inprocess import train_on_pool

from litscale.app.checks.validation import ConfigError, validate
from litscale.app.mup_check import CoordinateCheck, main
from litscale.models.gpt import GPT, GPTConfig
from litscale.models.moe import MoEConfig, MoEDecoder
from litscale.modules import weight_decay_groups
from litscale.optim.lr_scaling import ScaledOptimizerFactory
from litscale.optim.muon import Muon, parameter_roles
from litscale.optim.mup import WidthScaling


def gpt(width: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=width, vocab_size=64, block_size=16))


def roles(width: WidthScaling) -> dict[str, str]:
    return {name: found.role for name, (_, found) in width.parameters().items()}


def test_the_roles_and_multipliers_are_tensor_programs_v_s_at_four_times_the_base_width():
    m = 4  # width 64 against base 16
    width = WidthScaling(gpt(16 * m), 16)
    found = {name: entry for name, (_, entry) in width.parameters().items()}
    assert {n for n, r in roles(width).items() if r == "input"} == {"wte.weight", "wpe.weight"}
    assert {n for n, r in roles(width).items() if r == "output"} == {"lm_head.weight"}
    hidden = {n for n, r in roles(width).items() if r == "hidden"}
    assert hidden == {f"blocks.{i}.{layer}.weight" for i in range(2)
                      for layer in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.up", "mlp.down")}
    assert all(r == "vector" for n, r in roles(width).items() if n.endswith("bias") or "ln" in n)
    q = found["blocks.0.attn.q_proj.weight"]
    assert (q.init, q.adam_lr) == (pytest.approx(1 / math.sqrt(m)), pytest.approx(1 / m))
    # Muon: the spectral norm of the step stays put; match_rms_adamw's own scale grows sqrt(m).
    assert q.muon_lr("match_rms_adamw", (16, 16)) == pytest.approx(1 / math.sqrt(m))
    assert q.muon_lr("original", (16, 16)) == pytest.approx(1.0)
    for name in ("wte.weight", "lm_head.weight", "ln_f.weight"):
        assert (found[name].init, found[name].adam_lr) == (1.0, 1.0)


def test_the_forward_multipliers_and_the_init_are_set_once():
    net, m = gpt(64), 4
    before = net.blocks["0"].attn.q_proj.weight.detach().clone()
    width = WidthScaling(net, 16)
    assert width.apply() is True
    assert net.output_multiplier == pytest.approx(1 / m)
    # head_dim 32 against 8: scores x 1/head_dim instead of 1/sqrt(head_dim), relative to the base.
    assert net.blocks["1"].attn.score_multiplier == pytest.approx(math.sqrt(8 / 32))
    torch.testing.assert_close(net.blocks["0"].attn.q_proj.weight, before / math.sqrt(m))
    assert width.apply() is False  # a second fit of the same module leaves the weights alone
    torch.testing.assert_close(net.blocks["0"].attn.q_proj.weight, before / math.sqrt(m))


def test_a_router_is_a_readout_and_experts_are_hidden():
    config = MoEConfig(n_layer=2, n_head=2, n_kv_heads=2, n_embd=64, ffn_hidden_size=64, vocab_size=64,
                       block_size=16, n_experts=4, top_k=2, moe_ffn_hidden_size=32, n_shared_experts=1,
                       dense_layers=1)
    width = WidthScaling(MoEDecoder(config), 16)
    found = {name: entry for name, (_, entry) in width.parameters().items()}
    router = found["layers.1.mlp.gate.weight"]
    assert router.role == "readout"  # [experts, width]: only its fan-in grows
    assert (router.init, router.adam_lr) == (pytest.approx(1 / 4), pytest.approx(1 / 4))
    # The experts' hidden size is fixed here: their up projections read the width (readouts),
    # the down projection writes it (an input).
    assert found["layers.1.mlp.experts.up_proj"].role == "readout"
    assert found["layers.1.mlp.experts.down_proj"].role == "input"


def test_at_the_base_width_the_mup_model_is_the_standard_one():
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = {}
    for base_width in (None, 32):
        net = gpt(32)
        groups = weight_decay_groups(net, 0.1)
        factory = lambda params, lr: torch.optim.AdamW(params, lr=lr)  # noqa: E731
        if base_width is not None:
            width = WidthScaling(net, base_width)
            width.apply()
            optimizer = ScaledOptimizerFactory(factory, 1e-2, width)(groups)
        else:
            optimizer = factory(groups, 1e-2)
        losses[base_width] = []
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[base_width].append(loss.item())
    assert losses[None] == losses[32]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_optimizer_groups_hold_every_parameter_once_with_its_multiplied_lr(optimizer):
    net = gpt(64)
    width = WidthScaling(net, 16)
    grouped = parameter_roles(net, 0.1) if optimizer == "muon" else weight_decay_groups(net, 0.1)
    groups = width.param_groups(grouped, 1e-3, {})
    held = [id(p) for group in groups for p in group["params"]]
    assert sorted(held) == sorted(id(p) for p in net.parameters())
    names = {id(p): name for name, p in net.named_parameters()}
    for group in groups:
        assert group["lr"] == pytest.approx(1e-3 * group["lr_multiplier"])
        for param in group["params"]:
            hidden = param.dim() >= 2 and names[id(param)].startswith("blocks.")
            expected = (1 / 2 if optimizer == "muon" else 1 / 4) if hidden else 1.0  # m = 4
            assert group["lr_multiplier"] == pytest.approx(expected), names[id(param)]
    if optimizer == "muon":
        Muon(groups, lr=1e-3)  # the roles travel with the split groups


def mu_adamw_settings(name: str, param: torch.Tensor, base: dict[str, torch.Size], lr: float,
                      weight_decay: float) -> tuple[float, float]:
    """(lr, weight decay) of ``param`` as the ``mup`` package's ``MuAdamW`` sets them: a tensor
    with two dimensions grown from the base model (matrix-like) takes ``lr / m`` and
    ``weight_decay x m``; any other tensor keeps both."""
    grown = [now / then for now, then in zip(param.shape, base[name], strict=True) if now != then]
    return (lr / grown[-1], weight_decay * grown[-1]) if len(grown) == 2 else (lr, weight_decay)


def test_an_adamw_step_under_mup_is_mu_adamw_s():
    """One AdamW step at 4x the base width against MuAdamW's update by hand: ``p (1 - lr wd) -
    lr g / (|g| + eps)`` (the first step's bias-corrected moments are ``g`` and ``g^2``), with
    each tensor's lr and weight decay from its shapes. A hidden matrix's decay of a step,
    ``lr x wd``, is the base width's."""
    lr, decay, eps = 0.1, 0.5, 1e-8
    net = gpt(64)
    base = {name: p.shape for name, p in gpt(16).named_parameters()}
    width = WidthScaling(net, 16)
    width.apply()
    optimizer = ScaledOptimizerFactory(functools.partial(torch.optim.AdamW, lr=lr, eps=eps), lr, width)(
        weight_decay_groups(net, decay))
    generator = torch.Generator().manual_seed(1)
    for param in net.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    optimizer.step()
    for name, param in net.named_parameters():
        p, g = before[name], param.grad
        tensor_lr, tensor_decay = mu_adamw_settings(name, p, base, lr, decay if p.dim() >= 2 else 0.0)
        expected = p * (1 - tensor_lr * tensor_decay) - tensor_lr * g / (g.abs() + eps)
        torch.testing.assert_close(param.detach(), expected, rtol=1.3e-6, atol=1e-5,
                                   msg=lambda message, name=name: f"{name}: {message}")
    hidden = [n for n in before if len([d for d, b in zip(before[n].shape, base[n], strict=True) if d != b]) == 2]
    assert len(hidden) == 12


def test_muon_s_matrices_decay_by_the_base_width_s_lr_x_weight_decay():
    """With no gradient a step only decays: every decayed tensor by ``1 - lr x wd`` of the base
    width, the hidden matrices (Muon's LR x 1/sqrt(m)) as the embeddings and output layer."""
    lr, decay = 0.1, 0.5
    net = gpt(64)
    width = WidthScaling(net, 16)
    width.apply()
    optimizer = ScaledOptimizerFactory(functools.partial(Muon, lr=lr), lr, width)(parameter_roles(net, decay))
    for param in net.parameters():
        param.grad = torch.zeros_like(param)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    optimizer.step()
    for name, param in net.named_parameters():
        expected = before[name] * (1 - lr * decay) if param.dim() >= 2 else before[name]
        torch.testing.assert_close(param.detach(), expected, rtol=1.3e-6, atol=1e-5,
                                   msg=lambda message, name=name: f"{name}: {message}")


@pytest.mark.slow  # 2 x 4 widths x 4 steps in this process
def test_the_coordinate_check_is_flat_under_mup_and_grows_under_the_standard_parametrisation(tmp_path):
    overrides = ["model=gpt", "optimizer.lr=0.01", "data.batch_size=8", "data.seq_len=32", "+model.net.n_layer=2"]
    assert main([*overrides, "widths=32,64,128,256", "steps=4", f"out={tmp_path}"]) == 0
    written = json.loads((tmp_path / "mup_check.json").read_text())
    assert (tmp_path / "mup_check.png").stat().st_size > 0
    assert "| blocks.*.mlp | mup |" in (tmp_path / "mup_check.md").read_text()
    result = CoordinateCheck(widths=written["widths"], steps=4, base_width=written["base_width"], sizes={
        p: {k: {int(w): v for w, v in by_width.items()} for k, by_width in layers.items()}
        for p, layers in written["sizes"].items()})
    assert result.widths == [32, 64, 128, 256] and result.base_width == 32
    assert set(result.sizes["mup"]) == {"embedding", "blocks.*.attn", "blocks.*.mlp", "logits"}
    assert max(result.spread("mup").values()) < 2.0, result.table()
    growth = result.growth("sp")
    assert growth["blocks.*.attn"] > 8 and growth["blocks.*.mlp"] > 8, result.table()


def refusal(overrides: list[str], tmp_path) -> str:
    cfg, choices = compose_job(overrides, tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        validate(cfg, choices=choices)
    return str(info.value)


@pytest.mark.parametrize(("overrides", "line"), [
    (["optimizer=sgd"], "lr_scaling=mup has width multipliers for optimizer=adamw and optimizer=muon (or "
                        "torch.optim.Adam); got optimizer=sgd"),
    (["experiment=digits_mlp"], "lr_scaling=mup with model=mlp at lr_scaling.base_width=128: the network must "
                                "declare mup_width and at_width(width): MLP does not (see docs/width-scaling.md)"),
    (["lr_scaling.base_width=50"], "lr_scaling=mup with model=gpt at lr_scaling.base_width=50: model.net.n_embd=50 "
                                   "must be divisible by n_head=4"),
    (["model=llama", "export_hf=true"], "lr_scaling=mup multiplies the logits and attention scores (µP), which a "
                                        "Hugging Face Llama or Qwen3 has no field for: export_hf=true would write "
                                        "another function; allowed: export_hf=false with lr_scaling=mup"),
    (["model=llama", "model.net.from_hf=/models/qwen3"],
     "lr_scaling=mup re-initialises the network's matrices (µP's init), so it cannot fine-tune "
     "model.net.from_hf=/models/qwen3; allowed: lr_scaling=none, linear or sqrt"),
])
def test_what_mup_cannot_take_is_refused_in_one_line(overrides, line, tmp_path, outputs_root):
    assert refusal(["lr_scaling=mup", *overrides], tmp_path) == line


@pytest.mark.full
@pytest.mark.slow
def test_train_py_states_the_multipliers_and_trains(tmp_path):
    process = train_on_pool("lr_scaling=mup", "lr_scaling.base_width=64", "optimizer=muon", "trainer.accelerator=cpu",
                            "trainer.max_steps=2", "data.seq_len=32", "logger=none", "trainer.enable_progress_bar=false",
                            outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    printed = process.stdout + process.stderr
    line = re.search(r"litscale: lr scaling: µP width 128 / base 64 = x2 \| (.*)", printed)
    assert line, explain(process)
    assert "hidden (24): init x0.707107 lr x0.707107" in line.group(1)
    assert line.group(1).endswith("logits x0.5 | attention scores x0.707107")
