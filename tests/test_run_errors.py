"""Errors found before any rank starts: a pipeline whose micro-batches do not divide the batch,
and a checkpoint that cannot be read. Each is one line naming the key, from validation."""

from __future__ import annotations

import zipfile

import pytest
import torch
from helpers.configs import compose_job

from litscale.app.checks.validation import ConfigError, validate
from litscale.checkpoint.resume import resolve_ckpt_path


def test_pipeline_microbatches_must_divide_the_micro_batch(tmp_path, outputs_root):
    cfg, choices = compose_job(["strategy=pipeline", "trainer.accelerator=cpu", "trainer.devices=2",
                                "data.batch_size=6", "strategy.microbatches=4"], tmp_path)
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value) == (
        "strategy.microbatches=4 does not divide the micro batch of 6 samples per data-parallel "
        "rank (data.batch_size); allowed: 1, 2, 3, 6 (or a data.batch_size that is a multiple of 4)")


def _not_a_checkpoint(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "hello")


@pytest.mark.parametrize("make", [
    lambda path: path.write_text("garbage"),                      # not a torch file at all
    lambda path: path.write_bytes(b"PK\x03\x04" + b"\0" * 64),    # a torch file cut short
    _not_a_checkpoint,                                            # a zip, but no pickle
    lambda path: torch.save({"weights": torch.zeros(2)}, path),  # a torch file, no state_dict
], ids=["text", "truncated", "other-zip", "no-state-dict"])
def test_a_file_that_is_not_a_readable_checkpoint_is_named_in_one_line(tmp_path, make):
    path = tmp_path / "bad.ckpt"
    make(path)
    with pytest.raises(ConfigError) as error:
        resolve_ckpt_path(str(path), search_dir=str(tmp_path))
    assert str(error.value) == (
        f"ckpt_path={str(path)!r} is not a readable checkpoint (truncated, corrupt, not a Lightning checkpoint, "
        "or holding more than tensors and plain data, which litscale never unpickles); give a checkpoint path, "
        "last, auto, here or null")
    assert "weights_only" not in str(error.value)


def test_a_lightning_checkpoint_file_resolves_to_itself(tmp_path):
    path = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"net.w": torch.zeros(2)}, "global_step": 3}, path)
    assert resolve_ckpt_path(str(path), search_dir=str(tmp_path)) == str(path)


@pytest.mark.full  # make test-full: keeps make test within its time budget
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_summary_says_what_compression_and_lr_scaling_did(tmp_path):
    """The summary carries the final comm/* figures and the LR rule's figures, and the closing
    lines print the compression ratio (train.py on the rank pool)."""
    import json

    from helpers.inprocess import train_on_pool

    process = train_on_pool(
        "strategy=ddp", "compression=topk", "lr_scaling=linear", "trainer.accelerator=cpu",
        "trainer.devices=2", "trainer.max_steps=30", "trainer.enable_progress_bar=false",
        "data.max_bytes=200000", "data.batch_size=4", outputs=tmp_path, devices=2)
    assert process.returncode == 0, process.stderr[-3000:]
    (path,) = tmp_path.rglob("summary.json")
    summary = json.loads(path.read_text())
    assert summary["comm/compression_ratio"] > 10  # top-k 1% with int32 indices: ~50x
    assert summary["comm/bytes_per_step"] < summary["comm/dense_bytes_per_step"]
    assert summary["lr_scaling/rule"] == "linear" and summary["lr_scaling/global_batch"] == 8
    assert summary["lr_scaling/peak_lr"] == pytest.approx(
        summary["lr_scaling/base_lr"] * 8 / summary["lr_scaling/base_batch_size"])
    assert "litscale: compression " in process.stdout and "x fewer bytes than dense" in process.stdout
