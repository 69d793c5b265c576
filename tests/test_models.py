"""The model zoo, the task LightningModules and the LR schedules, against known figures."""

from __future__ import annotations

import copy
import math
import typing
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from litscale.data import DigitsDataModule, SyntheticDataModule
from litscale.models import MLP, PRESETS, GPTConfig, ResNet, build_gpt
from litscale.models.gpt import PresetName
from litscale.modules import CausalLMModule, ClassificationModule, weight_decay_groups
from litscale.optim.schedulers import constant, warmup_cosine

# --- GPT ------------------------------------------------------------------------------------


def hand_count(c: GPTConfig) -> tuple[int, int]:
    """``(non-embedding, total)`` parameters of a GPT, from its dimensions alone.

    Non-embedding: the weights used in matmuls or norms (blocks, final norm, LM head), not
    the lookup tables. With tied embeddings the LM head *is* the token table, counted once.
    """
    d, b = c.n_embd, int(c.bias)
    attention = 4 * (d * d + b * d)  # q, k, v, out
    feed_forward = (d * 4 * d + b * 4 * d) + (4 * d * d + b * d)
    norms = 2 * (d + b * d)
    non_embedding = c.n_layer * (attention + feed_forward + norms) + (d + b * d) + c.vocab_size * d
    tables = (0 if c.tie_embeddings else c.vocab_size * d) + c.block_size * d
    return non_embedding, non_embedding + tables


def test_gpt2_small_has_124m_parameters():
    with torch.device("meta"):
        model = build_gpt(preset="small", vocab_size=50257)
    assert model.config.block_size == 1024 and model.config.tie_embeddings
    assert model.num_params() == 124_439_808  # GPT-2 124M
    assert model.lm_head.weight is model.wte.weight


def test_gpt2_medium_has_355m_parameters():
    with torch.device("meta"):
        model = build_gpt(preset="medium", vocab_size=50257)
    assert model.num_params() == 354_823_168  # GPT-2 350M


@pytest.mark.parametrize("preset", list(PRESETS))
def test_param_count_matches_hand_count(preset):
    with torch.device("meta"):
        model = build_gpt(preset=preset)
    non_embedding, total = hand_count(PRESETS[preset])
    assert model.num_params() == total
    assert sum(p.numel() for p in model.parameters()) == total  # parameters() dedups ties


def test_preset_names_are_the_presets():
    assert list(typing.get_args(PresetName)) == list(PRESETS)


def test_flops_per_token_tied():
    """6 x non-embedding params + 12 L d T (PaLM appendix B), for GPT-2 small."""
    with torch.device("meta"):
        model = build_gpt(preset="small", vocab_size=50257)
    c, seq_len = model.config, 1024
    non_embedding, _ = hand_count(c)
    assert non_embedding == 123_653_376
    assert model.flops_per_token(seq_len) == 6 * non_embedding + 12 * c.n_layer * c.n_embd * seq_len


def test_flops_per_token_untied():
    model = build_gpt(preset="nano")
    c, seq_len = model.config, 128
    assert not c.tie_embeddings
    non_embedding, _ = hand_count(c)
    assert non_embedding == 826_112
    assert model.flops_per_token(seq_len) == 6 * non_embedding + 12 * c.n_layer * c.n_embd * seq_len


@pytest.fixture(scope="module")
def nano():
    torch.manual_seed(0)
    return build_gpt(preset="nano").eval()


def test_forward_shape(nano):
    tokens = torch.randint(256, (3, 17))
    with torch.no_grad():
        assert nano(tokens).shape == (3, 17, 256)


def test_causal(nano):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(256, (2, 32), generator=generator)
    t = 12
    changed = tokens.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % 256
    with torch.no_grad():
        before, after = nano(tokens), nano(changed)
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, t + 1], before[:, t + 1])


def test_initial_loss_is_uniform(nano):
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(256, (8, 64), generator=generator)
    targets = torch.randint(256, (8, 64), generator=generator)
    with torch.no_grad():
        loss = F.cross_entropy(nano(tokens).flatten(0, 1), targets.flatten())
    assert abs(loss.item() - math.log(256)) < 0.1


def test_build_gpt_overrides():
    model = build_gpt(preset="nano", n_layer=2, block_size=32, dropout=0.1)
    assert list(model.blocks) == ["0", "1"]
    assert model.config == GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=32, dropout=0.1)
    assert model.wpe.weight.shape == (32, 128)


def test_build_gpt_rejects_heads_that_do_not_divide():
    with pytest.raises(ValueError, match=r"^model.net.n_embd=128 must be divisible by n_head=3$"):
        build_gpt(preset="nano", n_head=3)


def test_build_gpt_rejects_unknown_preset():
    with pytest.raises(ValueError, match=r"^model.net.preset=.huge. is not valid: expected one of: .nano., .micro."):
        build_gpt(preset="huge")


def pipeline_stage(full, layers: set[int], *, first: bool, last: bool):
    """``full`` with what a pipeline stage does not own set to None or deleted."""
    stage = copy.deepcopy(full)
    if not first:
        stage.wte = stage.wpe = None
    if not last:
        stage.ln_f = stage.lm_head = None
    for key in list(stage.blocks):
        if int(key) not in layers:
            del stage.blocks[key]
    return stage


def test_pipeline_stages_compose_to_the_full_model(nano):
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(3))
    first = pipeline_stage(nano, {0, 1}, first=True, last=False)
    second = pipeline_stage(nano, {2, 3}, first=False, last=True)
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, 128)
        assert torch.equal(second(hidden), nano(tokens))
    # Checkpoint keys stay those of the full model, layer indices included.
    full_keys = set(nano.state_dict())
    assert set(first.state_dict()) | set(second.state_dict()) == full_keys
    assert not set(first.state_dict()) & set(second.state_dict())
    assert "blocks.2.attn.q_proj.weight" in second.state_dict()
    assert first.num_params() + second.num_params() == nano.num_params()


def test_middle_stage_maps_hidden_to_hidden(nano):
    middle = pipeline_stage(nano, {1, 2}, first=False, last=False)
    hidden = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = middle(hidden)
        assert out.shape == hidden.shape
        assert torch.equal(out, nano.blocks["2"](nano.blocks["1"](hidden)))


# --- MLP and ResNet -------------------------------------------------------------------------


def test_mlp_shapes():
    mlp = MLP(input_shape=[1, 8, 8], num_classes=10, hidden_sizes=[32, 16])
    linears = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 16), (16, 10)]
    assert mlp(torch.randn(5, 1, 8, 8)).shape == (5, 10)


@pytest.mark.parametrize(("widths", "side"), [([8], 8), ([8, 16], 4), ([8, 16, 32], 2)])
def test_resnet_stages_halve_resolution(widths, side):
    net = ResNet(input_shape=[1, 8, 8], num_classes=10, widths=widths, blocks_per_stage=2)
    net.eval()
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert net.stages(net.stem(x)).shape == (5, widths[-1], side, side)
        assert net(x).shape == (5, 10)


# --- LightningModules -----------------------------------------------------------------------


# Lightning warns against its own pytree use; nothing here can act on it.
quiet_lightning = pytest.mark.filterwarnings(r"ignore:.*isinstance\(treespec, LeafSpec\)")


def fit(module, datamodule, steps: int = 5) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, val_check_interval=steps,
        limit_val_batches=2, num_sanity_val_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=datamodule)
    return trainer


@quiet_lightning
def test_classification_module_learns_digits():
    torch.manual_seed(0)
    module = ClassificationModule(
        net=MLP(input_shape=[1, 8, 8], num_classes=10, hidden_sizes=[64]),
        optimizer=partial(torch.optim.AdamW, lr=3e-3),
        scheduler=partial(warmup_cosine, warmup_steps=2, min_lr_ratio=0.1),
    )
    trainer = fit(module, DigitsDataModule(batch_size=64, seed=0))
    metrics = trainer.callback_metrics
    assert trainer.global_step == 5
    assert abs(module.initial_val_loss - math.log(10)) < 0.5  # an untrained 10-way classifier
    assert metrics["val/loss"] < module.initial_val_loss
    assert 0.0 <= metrics["val/accuracy"] <= 1.0
    assert "train/loss" in metrics
    # The schedule spans the run: 5 optimizer steps end at min_lr_ratio x the peak LR.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(3e-3 * 0.1)


@quiet_lightning
def test_causal_lm_module_learns_synthetic_tokens():
    torch.manual_seed(0)
    module = CausalLMModule(
        net=build_gpt(preset="nano", n_layer=2, block_size=16),
        optimizer=partial(torch.optim.AdamW, lr=3e-3),
        weight_decay=0.1,
    )
    datamodule = SyntheticDataModule(batch_size=8, seq_len=16, num_samples=64, val_samples=16)
    trainer = fit(module, datamodule)
    metrics = trainer.callback_metrics
    assert abs(module.initial_val_loss - math.log(256)) < 0.1
    assert metrics["val/loss"] < module.initial_val_loss
    assert metrics["val/bpb"] == pytest.approx(metrics["val/loss"].item() / math.log(2))
    groups = trainer.optimizers[0].param_groups  # no scheduler: the LR stays put
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["lr"] == 3e-3


def test_weight_decay_groups_gpt():
    net = build_gpt(preset="nano", n_layer=1, tie_embeddings=True)
    net.wpe.weight.requires_grad_(False)
    decay, no_decay = weight_decay_groups(net, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    params = dict(net.named_parameters())
    decay_ids, no_decay_ids = {id(p) for p in decay["params"]}, {id(p) for p in no_decay["params"]}
    for name in ("wte.weight", "blocks.0.attn.q_proj.weight", "blocks.0.mlp.down.weight"):
        assert id(params[name]) in decay_ids, name
    for name in ("blocks.0.attn.q_proj.bias", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias",
                 "ln_f.weight", "blocks.0.mlp.up.bias"):
        assert id(params[name]) in no_decay_ids, name
    assert id(net.wpe.weight) not in decay_ids | no_decay_ids  # frozen
    everything = decay["params"] + no_decay["params"]
    assert len(everything) == len({id(p) for p in everything}) == len(params) - 1  # tied once


def test_weight_decay_groups_resnet():
    net = ResNet(input_shape=[1, 8, 8], num_classes=10, widths=[8], blocks_per_stage=1)
    decay, no_decay = (set(map(id, g["params"])) for g in weight_decay_groups(net, 0.5))
    assert id(net.stem[0].weight) in decay  # conv kernel
    assert id(net.head.weight) in decay
    assert id(net.stem[1].weight) in no_decay  # batch-norm gain
    assert id(net.head.bias) in no_decay


# --- schedulers -----------------------------------------------------------------------------


def lr_curve(factory, steps: int, base: float = 0.5, **kwargs) -> list[float]:
    """The LR used at optimizer steps 0..steps, as Lightning steps the schedule."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    scheduler = factory(optimizer, **kwargs)
    lrs = []
    for _ in range(steps + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_warmup_cosine():
    """Warmup (step + 1) / W, then cosine from the peak at step W to min_lr_ratio x peak at
    the last optimizer step, total_steps - 1 (0-based), held after it."""
    base, total, warmup, floor = 0.5, 101, 10, 0.1
    last = total - 1
    lrs = lr_curve(warmup_cosine, 120, base, total_steps=total, warmup_steps=warmup,
                   min_lr_ratio=floor)
    assert lrs[0] == pytest.approx(base / warmup)
    assert lrs[warmup - 1] == pytest.approx(base)  # end of warmup
    assert lrs[warmup] == pytest.approx(base)  # cosine starts at the peak
    assert lrs[55] == pytest.approx(base * (floor + (1 - floor) * 0.5))  # halfway down
    assert lrs[last] == pytest.approx(base * floor)
    assert lrs[total] == lrs[120] == pytest.approx(base * floor)  # held after the end
    for step in range(warmup, last + 1):
        progress = (step - warmup) / (last - warmup)
        expected = base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert lrs[step] == pytest.approx(expected)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:], strict=False))


def test_warmup_cosine_without_warmup():
    lrs = lr_curve(warmup_cosine, 10, 1.0, total_steps=11, min_lr_ratio=0.0)
    assert lrs[0] == 1.0
    assert lrs[5] == pytest.approx(0.5)
    assert lrs[10] == pytest.approx(0.0)


def test_warmup_fraction_is_a_share_of_total_steps():
    by_steps = lr_curve(warmup_cosine, 60, 1.0, total_steps=50, warmup_steps=5)
    by_fraction = lr_curve(warmup_cosine, 60, 1.0, total_steps=50, warmup_steps=None,
                           warmup_fraction=0.1)
    assert by_fraction == by_steps


def test_constant_with_warmup_ramps_linearly():
    lrs = lr_curve(constant, 20, 0.3, total_steps=20, warmup_steps=4)
    assert lrs[:4] == pytest.approx([0.3 * k / 4 for k in (1, 2, 3, 4)])
    assert lrs[4:] == pytest.approx([0.3] * 17)


def test_constant_without_warmup():
    assert lr_curve(constant, 5, 0.3, total_steps=5) == pytest.approx([0.3] * 6)
