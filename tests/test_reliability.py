"""Fault injection: preemption and exact resume, failing and killed ranks, NaN losses,
untrusted targets and secrets (each scenario as a short CPU run through train.py)."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import torch
from train_cli import explain, final_weights, run_train, summaries

SHORT = ("trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
         "trainer.log_every_n_steps=1", "data.seq_len=32", "data.max_bytes=400000",
         "trainer.enable_progress_bar=false", "trainer.accelerator=cpu")
FAULT = "+callbacks.fault._target_=litscale.callbacks.faults.InjectFault"


def fault(at_step: int, kind: str, rank: int | None = None) -> tuple[str, ...]:
    extra = (f"+callbacks.fault.rank={rank}",) if rank is not None else ()
    return (FAULT, f"+callbacks.fault.at_step={at_step}", f"+callbacks.fault.kind={kind}", *extra)


def step_losses(run_dir: str) -> dict[int, float]:
    rows = csv.DictReader((Path(run_dir) / "csv" / "metrics.csv").open())
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def run_dirs(outputs: Path, name: str) -> list[Path]:
    return sorted((outputs / name / "runs").iterdir())


# NOTE: with several ranks, Lightning raises SIGTERMException where each rank checks its own
# flag (evaluation loop, epoch end) as well as at the per-step broadcast, so ranks signalled a
# moment apart can stop at different places and the checkpoint is then not written: seen in
# about 1 of 3 runs here. Until litscale agrees on the stop step itself, DDP preemption is
# not claimed; resume exactness under DDP is covered by the checkpoints tests.
DDP_PREEMPTION = pytest.param("ddp", marks=pytest.mark.skip(
    reason="multi-rank SIGTERM handling races in Lightning (see NOTE above)"))


@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", ["single", DDP_PREEMPTION])
def test_sigterm_saves_checkpoint_and_auto_resume_reproduces_losses(tmp_path, strategy):
    """Mid-epoch preemption (the job gets SIGTERM after step 5; not a checkpoint step), then
    ckpt_path=auto: the resumed steps have the uninterrupted run's losses and final weights,
    dropout included."""
    setup = (*SHORT, "trainer.max_steps=10", f"strategy={strategy}", "model.net.dropout=0.1",
             *(("trainer.devices=2", "data.batch_size=8") if strategy == "ddp" else ()))
    clean = run_train(*setup, "name=clean", outputs=tmp_path)
    assert clean.returncode == 0, explain(clean)
    stopped = run_train(*setup, "name=resumed", *fault(5, "sigterm", rank=0), outputs=tmp_path)
    assert stopped.returncode == 0, explain(stopped)
    assert "preempted" in stopped.stdout
    (interrupted,) = run_dirs(tmp_path, "resumed")
    # The signal is handled at the next step boundary every rank agrees on.
    saved_step = torch.load(interrupted / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 5 <= saved_step < 10, explain(stopped)
    resumed = run_train(*setup, "name=resumed", "ckpt_path=auto", outputs=tmp_path)
    assert resumed.returncode == 0, explain(resumed)
    reference, continued = summaries(tmp_path / "clean")[0], summaries(tmp_path / "resumed")[0]
    expected, actual = step_losses(reference["output_dir"]), step_losses(continued["output_dir"])
    assert sorted(actual) == list(range(saved_step, 10))  # Lightning's 0-based step index
    for step in actual:
        assert actual[step] == expected[step], step
    for name, tensor in final_weights(reference).items():
        assert torch.equal(final_weights(continued)[name], tensor), name


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("kind", "expected"), [
    ("exception", "error: rank 1 failed: InjectedFault: injected fault at step 2 on rank 1"),
    ("sigkill", "error: rank 1 failed: Signal 9 (SIGKILL) received by PID"),
])
def test_failing_rank_stops_every_rank_with_one_error(tmp_path, kind, expected):
    started = time.monotonic()
    process = run_train(*SHORT, "strategy=ddp", "trainer.devices=2", *fault(2, kind, rank=1),
                        outputs=tmp_path, timeout=180)
    assert process.returncode == 1, explain(process)
    assert time.monotonic() - started < 90
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(expected), explain(process)
    if kind == "exception":
        assert process.stderr.count("Traceback") == 1  # the root cause's traceback, once


@pytest.mark.timeout(200)
def test_persistent_nan_loss_stops_after_saving_a_checkpoint(tmp_path):
    process = run_train(*SHORT, *fault(2, "nan_weights"), "callbacks.nonfinite_guard.patience=2",
                        "callbacks.nonfinite_guard.check_every_n_steps=2", outputs=tmp_path)
    assert process.returncode == 1, explain(process)
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, explain(process)
    assert errors[0].startswith("error: NonFiniteLossError: train/loss was NaN/inf for 2 "
                                "consecutive steps up to step 4")
    (run_dir,) = run_dirs(tmp_path, "default")
    assert (run_dir / "checkpoints" / "nonfinite-step4.ckpt").is_file()
    assert not (run_dir / "summary.json").exists()


@pytest.mark.timeout(60)
def test_untrusted_target_is_refused_before_anything_runs(tmp_path):
    process = run_train("+callbacks.evil._target_=os.system", outputs=tmp_path)
    assert process.returncode == 2
    assert process.stderr.strip() == (
        "error: callbacks.evil._target_='os.system' is not allowed: targets must come from "
        "litscale, torch, lightning, pytorch_optimizer (trust another package with "
        "allowed_targets=[<package>])")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.timeout(200)
def test_values_from_the_environment_never_reach_logs_or_checkpoints(tmp_path):
    secret = "sk-litscale-test-0123456789"
    process = run_train(*SHORT, "trainer.max_steps=2", "trainer.val_check_interval=2",
                        "+notes=${oc.env:LITSCALE_TEST_SECRET}", "+copied_notes=${notes}",
                        "logger=tensorboard", outputs=tmp_path,
                        env={"LITSCALE_TEST_SECRET": secret, "WANDB_API_KEY": secret})
    assert process.returncode == 0, explain(process)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".ckpt" for p in files) and any("events" in p.name for p in files)
    leaks = [p for p in files if secret.encode() in p.read_bytes()]
    assert leaks == []
    assert secret not in process.stdout + process.stderr
