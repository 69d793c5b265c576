"""End to end through ``train.py``: DDP against a single-process reference, the summary a
run leaves, and DDP's comm hooks on CPU (multirun sweeps: test_scaling.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers.cli import REPO, explain, final_weights, run_train, summaries
from helpers.inprocess import train_on_pool

pytestmark = pytest.mark.slow  # every test here starts train.py or a script in processes

# 5 optimizer steps, SGD + momentum, no dropout: 2 ranks x micro batch 4 see the same global
# batches as 1 process x 8 (litscale's samplers guarantee it), so the weights must agree.
SHORT_RUN = (
    "optimizer=sgd", "optimizer.lr=0.05", "trainer.max_steps=5", "trainer.val_check_interval=5",
    "trainer.limit_val_batches=2", "trainer.accelerator=cpu", "data.seq_len=32",
    "data.max_bytes=400000", "trainer.enable_progress_bar=false",
)


@pytest.fixture(scope="module")
def single_and_ddp(tmp_path_factory):
    """One 1-process run (batch 8), on the rank pool, and one 2-process DDP run (batch 4 per
    rank) through train.py's own launcher."""
    outputs = tmp_path_factory.mktemp("outputs")
    single = train_on_pool(*SHORT_RUN, "data.batch_size=8", "name=single", outputs=outputs)
    assert single.returncode == 0, explain(single)
    ddp = run_train(*SHORT_RUN, "data.batch_size=4", "strategy=ddp", "trainer.devices=2",
                    "name=ddp", outputs=outputs)
    assert ddp.returncode == 0, explain(ddp)
    reference, distributed = summaries(outputs)
    return {"single": (single, reference), "ddp": (ddp, distributed)}


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_ddp_two_ranks_match_single_process_of_same_global_batch(single_and_ddp):
    _, reference = single_and_ddp["single"]
    _, distributed = single_and_ddp["ddp"]
    assert reference["global_batch"] == distributed["global_batch"] == 8
    assert (reference["world_size"], distributed["world_size"]) == (1, 2)
    assert torch.load(reference["checkpoint"], weights_only=True)["global_step"] == 5
    expected, actual = final_weights(reference), final_weights(distributed)
    assert expected.keys() == actual.keys() and len(expected) > 10
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1.3e-6, atol=1e-5, msg=name)


@pytest.mark.full
@pytest.mark.parametrize("run", ["single", "ddp"])
def test_run_ends_cleanly_with_summary(single_and_ddp, run):
    process, summary = single_and_ddp[run]
    output = process.stdout + process.stderr
    assert "terminate called" not in output
    assert output.count("litscale: done: 5 steps") == 1  # printed once, by rank 0
    assert f"outputs: {summary['output_dir']}" in output
    for key in ("train/loss", "val/loss", "val/loss_initial", "val/bpb", "perf/samples_per_sec",
                "perf/tokens_per_sec", "wall_time_s"):
        assert summary[key] > 0, key
    assert summary["val/loss"] < summary["val/loss_initial"]
    assert summary["choices"]["strategy"] == ("ddp" if run == "ddp" else "single")
    assert summary["perf/tokens_per_sec"] == pytest.approx(summary["perf/samples_per_sec"] * 32)
    run_dir = REPO.parent / summary["output_dir"]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "csv" / "metrics.csv").read_text().startswith("epoch,") or \
        "train/loss" in (run_dir / "csv" / "metrics.csv").read_text()


@pytest.mark.soak
@pytest.mark.timeout(240)
def test_ddp_strategy_attaches_comm_hook_on_cpu_in_plain_lightning_script(tmp_path):
    """Lightning's own DDPStrategy skips comm hooks off CUDA; litscale's attaches them."""
    script = REPO / "tests" / "scripts" / "plain_lightning_ddp.py"
    process = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                             text=True, timeout=200, cwd=tmp_path)
    assert process.returncode == 0, explain(process)
    hooks = sorted(p.read_text() for p in tmp_path.glob("comm_hook_rank*.txt"))
    assert hooks == ["fp16_compress_hook", "fp16_compress_hook"]


@pytest.mark.soak  # a small soak of repeated runs (experiments/lifecycle has the long one)
@pytest.mark.timeout(400)
def test_repeated_two_process_runs_never_abort_at_exit():
    """The fast version of experiments/lifecycle/soak.py (2 runs instead of 20)."""
    soak = REPO / "experiments" / "lifecycle" / "soak.py"
    process = subprocess.run([sys.executable, str(soak), "--runs", "2", "--only", "litscale",
                              "--out", "/dev/null"], capture_output=True, text=True, timeout=380)
    assert process.returncode == 0, explain(process)
    assert "litscale: 2 clean, 0 aborts, 0 hangs of 2" in process.stdout
