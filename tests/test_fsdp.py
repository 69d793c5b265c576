"""FSDP2 strategy: parity with a single process of the same global batch (CPU, 2 gloo ranks),
sharding units, mixed precision, and use from a plain Lightning script."""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings

import pytest
import torch
from distributed import run_distributed
from train_cli import REPO, explain

from litscale.models.gpt import GPT, GPTConfig
from litscale.modules import CausalLMModule

# NOTE: no biases: the key projection's bias has an exactly zero gradient (softmax ignores a
# constant added to every key), so its computed gradient is rounding noise of order 1e-10,
# which AdamW divides by its own square root into steps of size lr: any two correct
# implementations then disagree by ~lr on that tensor.
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, bias=False)
STEPS, GLOBAL_BATCH = 5, 8
OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95)),
}


def global_batches() -> torch.Tensor:
    """``[STEPS, GLOBAL_BATCH, T+1]`` random tokens, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, TINY.vocab_size, (STEPS, GLOBAL_BATCH, TINY.block_size + 1), generator=generator)


def tiny_module(optimizer: str) -> CausalLMModule:
    torch.manual_seed(0)
    return CausalLMModule(net=GPT(TINY), optimizer=OPTIMIZERS[optimizer])


def reference_weights(optimizer: str) -> dict[str, torch.Tensor]:
    """A plain single-process loop over the global batches."""
    module = tiny_module(optimizer)
    opt = module.configure_optimizers()
    for tokens in global_batches():
        opt.zero_grad()
        module.loss((tokens[:, :-1], tokens[:, 1:])).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def rank_loader(rank: int, world_size: int):
    """This rank's micro batches: rows ``rank*b:(rank+1)*b`` of each global batch."""
    micro = GLOBAL_BATCH // world_size
    tokens = global_batches()[:, rank * micro:(rank + 1) * micro].reshape(-1, TINY.block_size + 1)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(dataset, batch_size=micro, shuffle=False)


def fit_tiny(rank: int, world_size: int, strategy_factory, optimizer: str, precision: str = "32-true",
             steps: int = STEPS, callbacks=()):
    """Fit the tiny GPT for ``steps`` with a strategy; return the consolidated weights (complete
    on rank 0) and the last loss."""
    import lightning as L

    from litscale.export import consolidated_state_dict

    module = tiny_module(optimizer)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy_factory(), max_steps=steps,
        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, train_dataloaders=rank_loader(rank, world_size))
    return consolidated_state_dict(trainer, module), float(trainer.callback_metrics["train/loss"])


def assert_matches_reference(actual: dict, expected: dict, **tolerance) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 10
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=functools.partial("{}: {}".format, name), **tolerance)


def fsdp(**options):
    from litscale.strategies import FSDPStrategy

    return FSDPStrategy(**options)


FSDP_VARIANTS = {
    "reshard": {"reshard_after_forward": True},
    "no_reshard": {"reshard_after_forward": False},
    "activation_checkpointing": {"activation_checkpointing": True},
}


def fit_variants(rank: int, world_size: int, factories: dict, optimizers=tuple(OPTIMIZERS)) -> dict:
    """Every (variant, optimizer) fit in one process group: one spawn instead of one per case."""
    return {(name, opt): fit_tiny(rank, world_size, factory, opt)[0]
            for name, factory in factories.items() for opt in optimizers}


@pytest.fixture(scope="module")
def fsdp_fits():
    factories = {name: functools.partial(fsdp, **options) for name, options in FSDP_VARIANTS.items()}
    return run_distributed(fit_variants, 2, factories, timeout=400)[0]


@pytest.mark.timeout(450)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("variant", list(FSDP_VARIANTS))
def test_fsdp_two_ranks_match_single_process(fsdp_fits, variant, optimizer):
    assert_matches_reference(fsdp_fits[variant, optimizer], reference_weights(optimizer),
                             rtol=1.3e-6, atol=1e-5)


def _local_shapes(rank: int, world_size: int):
    from torch.distributed.tensor import DTensor

    module = tiny_module("sgd")
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=fsdp(), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=rank_loader(rank, world_size))
    params = dict(module.net.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())
    blocks = module.net.blocks
    fsdp_units = [type(m).__name__ for m in [*blocks.values(), module.net]]
    return {name: tuple(p.to_local().shape) for name, p in params.items()}, fsdp_units


@pytest.mark.timeout(120)
def test_fsdp_shards_every_parameter_along_dim0_with_blocks_as_units():
    (shapes, units), _ = run_distributed(_local_shapes, 2, timeout=100)
    assert shapes["wte.weight"] == (TINY.vocab_size // 2, TINY.n_embd)
    assert shapes["blocks.0.mlp.up.weight"] == (2 * TINY.n_embd, TINY.n_embd)
    assert all(name.startswith("FSDP") for name in units), units  # each block + the root


def test_sharding_units_from_model_patterns_and_warning():
    from litscale.strategies.fsdp import NO_UNITS_WARNING, find_sharding_units

    module = tiny_module("sgd")
    assert find_sharding_units(module) == list(module.net.blocks.values())
    assert find_sharding_units(module, ["net.blocks.*"]) == list(module.net.blocks.values())
    assert find_sharding_units(module, ["net.blocks.*.mlp"]) == [b.mlp for b in module.net.blocks.values()]
    with pytest.raises(ValueError, match=r"strategy.sharding_units=\['nope'\] matches no submodule"):
        find_sharding_units(module, ["nope"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert find_sharding_units(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []
    assert [str(w.message) for w in caught] == [NO_UNITS_WARNING]


def test_mixed_precision_policy_follows_precision_group():
    from litscale.precision import PrecisionDtypes
    from litscale.strategies.fsdp import mixed_precision_policy

    bf16_mixed = PrecisionDtypes.from_names(param_dtype="float32", compute_dtype="bfloat16",
                                            reduce_dtype="float32")
    policy = mixed_precision_policy(bf16_mixed)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp32 = mixed_precision_policy(PrecisionDtypes())
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, None)


def _bf16_fsdp(rank, world_size):
    from litscale.precision import PrecisionDtypes

    dtypes = PrecisionDtypes.from_names(param_dtype="float32", compute_dtype="bfloat16",
                                        reduce_dtype="float32")
    return fit_tiny(rank, world_size, functools.partial(fsdp, precision_dtypes=dtypes), "sgd",
                    precision="bf16-mixed")


@pytest.mark.timeout(150)
def test_fsdp_bf16_mixed_on_cpu_matches_fp32_reference_within_bf16_tolerance():
    """FSDP gathers bf16 parameters for compute, reduces and steps in fp32 (no autocast on top)."""
    (weights, loss), _ = run_distributed(_bf16_fsdp, 2, timeout=120)
    assert all(v.dtype == torch.float32 for v in weights.values())  # fp32 storage
    assert torch.isfinite(torch.tensor(loss))
    assert_matches_reference(weights, reference_weights("sgd"), rtol=1.6e-2, atol=1e-3)


@pytest.mark.timeout(150)
def test_fsdp_strategy_in_plain_lightning_script(tmp_path):
    script = REPO / "tests" / "scripts" / "plain_lightning_fsdp.py"
    process = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=140, cwd=tmp_path)
    assert process.returncode == 0, explain(process)
    assert "fsdp ok: 2 ranks, sharded DTensor parameters" in process.stdout


BAD_INPUT = {
    "strategy.reshard_after_forward=maybe":
        "error: strategy.reshard_after_forward='maybe' is not valid: expected true or false",
    "strategy.reshard_after_forward=2":
        "error: strategy.reshard_after_forward=2 is not valid: expected true or false",
    "strategy.replicate_size=3":
        "error: strategy.replicate_size=3 must divide the world size (2); allowed: a divisor of 2",
    "strategy.sharding_units=[nope]":
        "error: strategy.sharding_units=['nope'] matches no submodule of the model",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("override", list(BAD_INPUT))
def test_bad_fsdp_options_fail_in_one_line_before_any_process_starts(tmp_path, override):
    from train_cli import run_train

    process = run_train("strategy=fsdp", override, "trainer.accelerator=cpu", "trainer.devices=2",
                        outputs=tmp_path, timeout=100)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [BAD_INPUT[override]]
    assert not any(tmp_path.iterdir())  # no run dir: nothing started


def test_reshard_after_forward_of_wrong_type_in_python():
    with pytest.raises(ValueError, match=r"^strategy.reshard_after_forward='yes' is not valid"):
        fsdp(reshard_after_forward="yes")
