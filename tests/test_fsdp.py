"""FSDP2 strategy: sharding units, mixed precision, and use from a plain Lightning script
(parity with one process, step by step, is in ``test_parity.py``)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from helpers.cli import REPO, explain
from helpers.distributed import run_distributed
from helpers.inprocess import train_on_pool
from helpers.parity import (
    TINY,
    ParitySetup,
    assert_weights_match,
    fit,
    reference,
    tiny_module,
)
from helpers.strategies import fsdp
from lightning.pytorch import Callback


class ShardLayout(Callback):
    """After fitting: each parameter's local (this rank's) shape, and the class of each block
    and of the root network (FSDP2 swaps in an ``FSDP<class>`` for each sharding unit)."""

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        params = dict(pl_module.net.named_parameters())
        assert all(isinstance(p, DTensor) for p in params.values())
        self.local_shapes = {name: tuple(p.to_local().shape) for name, p in params.items()}
        units = [*pl_module.net.blocks.values(), pl_module.net]
        self.units = [type(m).__name__ for m in units]


def _shard_layout(rank: int, world_size: int):
    layout = ShardLayout()
    fit(rank, world_size, fsdp(), ParitySetup(steps=1), callbacks=[layout])
    return layout.local_shapes, layout.units


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp_shards_every_parameter_along_dim0_with_blocks_as_units():
    (shapes, units), _ = run_distributed(_shard_layout, 2, timeout=100)
    assert shapes["wte.weight"] == (TINY.vocab_size // 2, TINY.n_embd)
    assert shapes["blocks.0.mlp.up.weight"] == (2 * TINY.n_embd, TINY.n_embd)
    assert all(name.startswith("FSDP") for name in units), units  # each block + the root


def test_sharding_units_from_model_patterns_and_warning():
    from litscale.strategies.fully_shard import NO_UNITS_WARNING, find_sharding_units

    module = tiny_module(ParitySetup())
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
    from litscale.strategies.fully_shard import mixed_precision_policy

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
    return fit(rank, world_size, fsdp(precision_dtypes=dtypes), ParitySetup(), precision="bf16-mixed")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fsdp_bf16_mixed_on_cpu_matches_fp32_reference_within_bf16_tolerance():
    """FSDP gathers bf16 parameters for compute, reduces and steps in fp32 (no autocast on top)."""
    trace, _ = run_distributed(_bf16_fsdp, 2, timeout=120)
    assert all(v.dtype == torch.float32 for v in trace.weights.values())  # fp32 storage
    assert torch.isfinite(torch.tensor(trace.losses[-1]))
    assert_weights_match(trace.weights, reference(ParitySetup()).weights, rtol=1.6e-2, atol=1e-3)


@pytest.mark.full
@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.timeout(300)  # the first call starts the rank pool
@pytest.mark.parametrize("override", list(BAD_INPUT))
def test_bad_fsdp_options_fail_in_one_line_before_any_process_starts(tmp_path, override):
    # train.py's own check, on a rank of the pool (the imports paid once per session)
    process = train_on_pool("strategy=fsdp", override, "trainer.accelerator=cpu", "trainer.devices=2",
                            outputs=tmp_path)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [BAD_INPUT[override]]
    assert not any(tmp_path.iterdir())  # no run dir: nothing started


def test_reshard_after_forward_of_wrong_type_in_python():
    with pytest.raises(ValueError, match=r"^strategy.reshard_after_forward='yes' is not valid"):
        fsdp(reshard_after_forward="yes")
