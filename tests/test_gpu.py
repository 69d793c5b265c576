"""CUDA paths (NCCL, bf16, fp16 with its scaler, float8, compile, offload, comm hooks on CUDA
tensors); skipped on machines without a GPU, as CI is. Every strategy runs at world size 1 on
one GPU; the results of the last GPU run are in experiments/gpu/README.md."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.cli import explain, run_train, summaries

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# A short run of the tiny GPT that validates before and after, so a run shows it learned.
SHORT_RUN = ("trainer=gpu", "trainer.devices=1", "trainer.max_steps=12", "trainer.val_check_interval=12",
             "trainer.limit_val_batches=2", "data.batch_size=8")

STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    "zero1": ["strategy=deepspeed_zero", "strategy.stage=1"],
    "zero2": ["strategy=deepspeed_zero", "strategy.stage=2"],
    "zero3": ["strategy=deepspeed_zero", "strategy.stage=3"],
    "tp1": ["strategy=tensor_parallel", "strategy.tensor_parallel_size=1"],
    "pp1": ["strategy=pipeline", "strategy.pipeline_parallel_size=1"],
    "local_sgd": ["strategy=local_sgd", "strategy.sync_every=4"],
}
PRECISIONS = ("bf16_mixed", "bf16_true", "fp16_mixed")
# FSDP2 and DTensor strategies have no sharded loss scaler: fp16 is refused before start-up.
REFUSED = {("fsdp", "fp16_mixed"), ("tp1", "fp16_mixed"), ("pp1", "fp16_mixed")}
CUDA_ONLY = {
    "compile-single": ["strategy=single", "model.compile=true", "precision=bf16_mixed"],
    "compile-ddp": ["strategy=ddp", "model.compile=true", "precision=bf16_mixed"],
    "compile-fsdp": ["strategy=fsdp", "model.compile=true", "precision=bf16_mixed"],
    "fsdp-cpu-offload": ["strategy=fsdp", "strategy.cpu_offload=true"],
    "zero2-offload-optimizer": ["strategy=deepspeed_zero", "strategy.stage=2", "strategy.offload_optimizer=true"],
    "zero3-offload-all": ["strategy=deepspeed_zero", "strategy.stage=3", "strategy.offload_optimizer=true",
                          "strategy.offload_parameters=true"],
    "fp8-tensorwise": ["strategy=single", "precision=fp8", "precision.float8=tensorwise", "model.compile=true",
                       "model.net.preset=micro"],
    "fp8-rowwise": ["strategy=single", "precision=fp8", "precision.float8=rowwise", "model.compile=true",
                    "model.net.preset=micro"],
    "fp8-fsdp": ["strategy=fsdp", "precision=fp8", "model.net.preset=micro"],
    **{f"ddp-{name}": ["strategy=ddp", f"compression={name}", "precision=bf16_mixed"]
       for name in ("fp16", "bf16", "powersgd", "topk", "qsgd", "terngrad", "signsgd")},
}


def assert_learned(tmp_path, process) -> dict:
    assert process.returncode == 0, explain(process)
    (summary,) = summaries(tmp_path)
    assert summary["steps"] == 12
    assert math.isfinite(summary["train/loss"])
    assert summary["val/loss"] < summary["val/loss_initial"], summary
    return summary


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_strategy_on_one_gpu(tmp_path, strategy, precision):
    process = run_train(*SHORT_RUN, *STRATEGIES[strategy], f"precision={precision}", outputs=tmp_path)
    if (strategy, precision) in REFUSED:
        assert process.returncode == 2, explain(process)
        assert process.stderr.strip().splitlines()[-1].startswith(
            f"error: precision={precision} is not supported with "
            f"strategy={STRATEGIES[strategy][0].removeprefix('strategy=')} "), \
            explain(process)
        return
    assert_learned(tmp_path, process)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CUDA_ONLY))
def test_cuda_only_paths(tmp_path, case):
    process = run_train(*SHORT_RUN, *CUDA_ONLY[case], outputs=tmp_path)
    summary = assert_learned(tmp_path, process)
    if case.startswith("compile") or case.startswith("fp8"):
        assert summary["perf/mfu"] > 0


@pytest.mark.timeout(300)
def test_single_gpu_bf16_run(tmp_path):
    process = run_train("trainer=gpu", "trainer.devices=1", "precision=bf16_mixed",
                        "trainer.max_steps=20", "trainer.val_check_interval=10", outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    (summary,) = summaries(tmp_path)
    assert summary["val/loss"] < summary["val/loss_initial"]
    assert summary["memory/peak_bytes"] > summary["memory/params_bytes"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ddp_nccl_run(tmp_path):
    process = run_train("trainer=gpu", "trainer.devices=2", "strategy=ddp", "precision=bf16_mixed",
                        "trainer.max_steps=20", "trainer.val_check_interval=10", outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    (summary,) = summaries(tmp_path)
    assert summary["world_size"] == 2
