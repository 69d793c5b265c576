"""CUDA paths (NCCL, bf16); skipped on machines without a GPU, as CI is."""

from __future__ import annotations

import pytest
import torch
from helpers.cli import explain, run_train, summaries

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.timeout(300)
def test_single_gpu_bf16_run(tmp_path):
    process = run_train("trainer=gpu", "trainer.devices=1", "precision=bf16_mixed",
                        "trainer.max_steps=20", "trainer.val_check_interval=10", outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    (summary,) = summaries(tmp_path)
    assert summary["val/loss"] < summary["val/loss_initial"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ddp_nccl_run(tmp_path):
    process = run_train("trainer=gpu", "trainer.devices=2", "strategy=ddp", "precision=bf16_mixed",
                        "trainer.max_steps=20", "trainer.val_check_interval=10", outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    (summary,) = summaries(tmp_path)
    assert summary["world_size"] == 2
