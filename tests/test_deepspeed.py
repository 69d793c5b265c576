"""DeepSpeed ZeRO 1/2/3 on CPU (gloo, ``DS_ACCELERATOR=cpu``): the config it builds, and
imports (parity with one process, offload included, is in ``test_parity.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.cli import REPO, explain, summaries
from helpers.inprocess import train_on_pool
from helpers.strategies import zero


def test_config_maps_stage_offload_and_precision():
    from litscale.precision import PrecisionDtypes

    strategy = zero(3, offload_optimizer=True, offload_parameters=True,
                    precision_dtypes=PrecisionDtypes.from_names(
                        param_dtype="float32", compute_dtype="bfloat16", reduce_dtype="float32"))
    zero_config = strategy.config["zero_optimization"]
    assert zero_config["stage"] == 3
    assert zero_config["offload_optimizer"]["device"] == "cpu"
    assert zero_config["offload_param"]["device"] == "cpu"
    assert "offload_param" not in zero(2, offload_optimizer=True).config["zero_optimization"]


def test_offload_rules_and_stage_range():
    from litscale.strategies.deepspeed_zero import check_offload

    for stage in (1, 2, 3):
        check_offload(stage, offload_optimizer=True, offload_parameters=stage == 3)
    with pytest.raises(ValueError, match=r"^strategy.offload_parameters=true needs strategy.stage=3"):
        check_offload(2, offload_optimizer=False, offload_parameters=True)


@pytest.mark.full
@pytest.mark.slow
def test_deepspeed_is_imported_only_when_the_strategy_runs():
    code = ("import sys; import litscale.strategies as s; s.DeepSpeedZeroStrategy(stage=3); "
            "print('deepspeed' in sys.modules)")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
    assert process.stdout.strip() == "False", process.stderr[-2000:]


BAD_INPUT = {
    "strategy.stage=0": "error: strategy.stage=0 is not valid: expected one of: 1, 2, 3",
    "strategy.stage=4": "error: strategy.stage=4 is not valid: expected one of: 1, 2, 3",
    "strategy.offload_parameters=true": (
        "error: strategy.offload_parameters=true needs strategy.stage=3 (got stage 2): only ZeRO-3 "
        "partitions parameters; use strategy.offload_optimizer=true with stages 1-2"),
}


@pytest.mark.slow
@pytest.mark.timeout(300)  # the first call starts the rank pool
@pytest.mark.parametrize("override", list(BAD_INPUT))
def test_bad_zero_options_fail_in_one_line_before_any_process_starts(tmp_path, override):
    # train.py's own check, on a rank of the pool (the imports paid once per session)
    process = train_on_pool("strategy=deepspeed_zero", override, "trainer.accelerator=cpu",
                            "trainer.devices=2", outputs=tmp_path)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [BAD_INPUT[override]]
    assert not any(tmp_path.iterdir())  # no run dir: nothing started


def _fit_zero3_and_check_linear(rank: int, world_size: int) -> bool:
    """One ZeRO-3 step of a model built in ``configure_model`` (DeepSpeed's ``zero.Init`` around
    it swaps ``F.linear``); is torch's ``F.linear`` back after the run?"""
    import lightning as L
    import torch

    from litscale.strategies import DeepSpeedZeroStrategy

    torch_linear = torch.nn.functional.linear

    class Tiny(L.LightningModule):
        def configure_model(self):
            self.layer = torch.nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=DeepSpeedZeroStrategy(stage=3),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Tiny(), train_dataloaders=data)
    return torch.nn.functional.linear is torch_linear


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_zero3_run_leaves_torchs_linear_as_it_found_it():
    """DeepSpeed leaves its own ``F.linear`` behind after ZeRO-3; the strategy's teardown puts
    torch's back, so a later model in the process computes as it would alone."""
    from helpers.distributed import run_distributed

    assert run_distributed(_fit_zero3_and_check_linear, 1) == [True]


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sweep_of_one_device_jobs_runs_each_in_the_sweeps_own_process(tmp_path):
    """One-device jobs of a sweep train one after another in the sweep's process, each in a
    process group of its own: the second must not reuse the first's (DeepSpeed keeps a clone of
    the world group per process; on the old one it failed with "Group ... is not registered")."""
    process = train_on_pool("-m", "strategy=deepspeed_zero", "trainer.accelerator=cpu", "trainer.devices=1",
                            "optimizer.lr=0.001,0.0005", "trainer.max_steps=2", "trainer.limit_val_batches=2",
                            "trainer.enable_progress_bar=false", "callbacks=none", "logger=none",
                            outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    assert sorted(s["choices"]["strategy"] for s in summaries(tmp_path)) == ["deepspeed_zero"] * 2
    # No JIT compile of DeepSpeed's shared-memory all-reduce at each start (its stale lock
    # once stalled every later run): deepspeed_zero.skip_shared_memory_all_reduce_build.
    assert "deepspeed_shm_comm" not in process.stdout + process.stderr, explain(process)
