"""Sharded checkpoints: exact resume (``ckpt_path=last`` through train.py), resume at another
world size (FSDP, 2 -> 1 and 1 -> 2 ranks), consolidated exports that the plain zoo model
loads, and ``ckpt_path`` resolution of sharded checkpoint directories."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.checkpoints import sharded_checkpoint
from helpers.cli import explain, summaries, train_losses
from helpers.distributed import run_distributed
from helpers.inprocess import train_on_pool
from helpers.parity import TINY, ParitySetup, StepRecorder, assert_weights_match, tiny_module
from helpers.strategies import fsdp

from litscale.checkpoint.resume import newest_last_checkpoint, resolve_ckpt_path
from litscale.errors import ConfigError

STEPS, SAVE_AT, MICRO = 5, 2, 4


def _fit(rank: int, world_size: int, ckpt_dir: str, resume_from: str | None):
    """Fit the tiny GPT on synthetic data to STEPS, saving a sharded checkpoint every SAVE_AT
    steps; global batch 8 whatever the world size. Returns (export, losses by step)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from litscale.checkpoint.export import consolidated_state_dict
    from litscale.data.synthetic import SyntheticDataModule

    losses = StepRecorder()  # the global batch's loss, by the number of steps done
    data = SyntheticDataModule(batch_size=8 // world_size, num_samples=64, val_samples=8,
                               seq_len=TINY.block_size, vocab_size=TINY.vocab_size, seed=3)
    module = tiny_module(ParitySetup(optimizer="adamw"))
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", every_n_train_steps=SAVE_AT,
                                  save_top_k=-1, auto_insert_metric_name=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=fsdp(), max_steps=STEPS,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                        callbacks=[checkpoints, losses])
    trainer.fit(module, datamodule=data, ckpt_path=resume_from)
    return consolidated_state_dict(trainer, module), losses.losses


def _fits(rank, world_size, jobs):
    return [_fit(rank, world_size, *job) for job in jobs]


@pytest.mark.full  # make test-full: keeps make test within its time budget
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_resumes_at_another_world_size(tmp_path):
    """2 ranks save at step 2; 1 rank resumes from it. 1 rank saves; 2 ranks resume. Each
    resumed run matches its uninterrupted counterpart from step 3 on."""
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    ckpt = f"step{SAVE_AT}.ckpt"
    [(full_two, losses_two)] = run_distributed(_fits, 2, [(two, None)], timeout=250)[0]
    (resumed_one, resumed_losses_one), (full_one, losses_one) = run_distributed(
        _fits, 1, [(str(tmp_path / "x"), os.path.join(two, ckpt)), (one, None)], timeout=250)[0]
    [(resumed_two, resumed_losses_two)] = run_distributed(
        _fits, 2, [(str(tmp_path / "y"), os.path.join(one, ckpt))], timeout=250)[0]
    assert os.path.isfile(os.path.join(two, ckpt, ".metadata"))  # a DCP directory of shards
    assert sorted(resumed_losses_one) == [3, 4, 5]  # resumed after step 2, not from scratch
    # Another world size sums gradients in another order: fp32 rounding, nothing more.
    for step in (3, 4, 5):
        assert resumed_losses_one[step] == pytest.approx(losses_two[step], rel=1e-5)
        assert resumed_losses_two[step] == pytest.approx(losses_one[step], rel=1e-5)
    assert_weights_match(resumed_one, full_two, rtol=1e-5, atol=1e-5)
    assert_weights_match(resumed_two, full_one, rtol=1e-5, atol=1e-5)


SHORT = ("model.net.preset=nano", "data.seq_len=32", "data.max_bytes=400000", "data.batch_size=4",
         "trainer.accelerator=cpu", "trainer.devices=2", "trainer.val_check_interval=3",
         "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "scheduler=constant",
         "trainer.enable_progress_bar=false")


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("choices", [
    ["strategy=fsdp"],
    # Muon's (soak: CI's time): the momentum DeepSpeed's ZeRO Muon keeps per partition.
    pytest.param(["strategy=deepspeed_zero"], marks=pytest.mark.full),
    pytest.param(["strategy=deepspeed_zero", "optimizer=muon", "trainer.gradient_clip_val=null"], marks=pytest.mark.soak),
], ids=["fsdp", "deepspeed_zero", "deepspeed_zero-muon"])
def test_ckpt_path_last_resumes_exactly_and_exports(tmp_path, choices):
    """train.py's runs on the rank pool (the claim is the checkpoint's, not the launcher's)."""
    overrides = (*SHORT, *choices)

    def train(*more: str):
        return train_on_pool(*overrides, *more, outputs=tmp_path, devices=2)

    full = train("trainer.max_steps=6", "name=full")
    assert full.returncode == 0, explain(full)
    part = train("trainer.max_steps=3", "name=part")
    assert part.returncode == 0, explain(part)
    assert os.path.isdir(newest_last_checkpoint(str(tmp_path / "part")))  # a sharded directory
    resumed = train("trainer.max_steps=6", "name=part", "ckpt_path=last")
    assert resumed.returncode == 0, explain(resumed)
    reference, _, after = summaries(tmp_path)
    assert after["steps"] == 6
    # Step k+1 (the 4th step, logged at Lightning's 0-based step 3), bit for bit.
    assert train_losses(after["output_dir"])[3] == train_losses(reference["output_dir"])[3]
    expected, actual = torch.load(reference["export"]), torch.load(after["export"])
    assert_weights_match(actual, expected, rtol=0, atol=0)
    _assert_plain_model_loads(reference["export"])


def _assert_plain_model_loads(path: str) -> None:
    from litscale.models.gpt import build_gpt

    net = build_gpt(preset="nano", block_size=32)
    net.load_state_dict(torch.load(path, weights_only=True))  # strict: every key, every shape


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [pytest.param("single", marks=pytest.mark.full), "ddp"])  # full: time budget
def test_unsharded_strategies_export_the_same_file(tmp_path, strategy):
    devices = 1 if strategy == "single" else 2
    process = train_on_pool(*SHORT, f"trainer.devices={devices}", f"strategy={strategy}",
                            "trainer.max_steps=2", "callbacks=none", "logger=none", outputs=tmp_path,
                            devices=devices)
    assert process.returncode == 0, explain(process)
    [summary] = summaries(tmp_path)
    _assert_plain_model_loads(summary["export"])


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
def test_resolve_accepts_sharded_checkpoint_directories(tmp_path):
    sharded = tmp_path / "run" / "checkpoints" / "last.ckpt"
    sharded.mkdir(parents=True)
    with pytest.raises(ConfigError, match="is a directory but not a sharded checkpoint"):
        resolve_ckpt_path(str(sharded), search_dir=str(tmp_path))
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) is None
    (sharded / "meta.pt").write_bytes(b"")  # a sharded checkpoint, but its save never finished
    with pytest.raises(ConfigError, match="is not a readable checkpoint"):  # one line, before any rank
        resolve_ckpt_path(str(sharded), search_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="^ckpt_path=last but no complete checkpoints/"):
        resolve_ckpt_path("last", search_dir=str(tmp_path))
    sharded_checkpoint(sharded, step=4)  # DCP shards, .metadata, then meta.pt: complete
    assert resolve_ckpt_path("last", search_dir=str(tmp_path)) == str(sharded)


@pytest.mark.slow  # composes jobs: over a second
@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
def test_here_resumes_only_from_the_runs_own_dir_never_another_job_of_its_name(tmp_path, monkeypatch):
    """A sweep's jobs share a name; a cluster job restarted in its run dir (Kubernetes, a
    SkyPilot managed job) resumes its own checkpoint with ``ckpt_path=here``, and its first
    start is fresh even where another job of the sweep has saved."""
    from helpers.configs import compose_job

    from litscale.app.checks.validation import validate

    monkeypatch.setenv("LITSCALE_OUTPUTS", str(tmp_path))
    sweep = tmp_path / "default" / "multiruns" / "2026-11-28_10-00-00"
    sharded_checkpoint(sweep / "0" / "checkpoints" / "last.ckpt", step=4)  # job 0 saved
    resumed = {}
    for word in ("here", "auto"):
        cfg, choices = compose_job([f"ckpt_path={word}"], sweep / "1")
        resumed[word] = validate(cfg, choices=choices, this_machine=False).ckpt_path
    assert resumed == {"here": None, "auto": str(sweep / "0" / "checkpoints" / "last.ckpt")}
    own = sweep / "1" / "checkpoints" / "last.ckpt"
    sharded_checkpoint(own, step=2)  # job 1, restarted after its own save
    cfg, choices = compose_job(["ckpt_path=here"], sweep / "1")
    assert validate(cfg, choices=choices, this_machine=False).ckpt_path == str(own)
